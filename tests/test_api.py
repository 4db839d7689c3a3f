"""The public surface: names, the exception hierarchy."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import aiosnap
import aiosnap.cli


def test_all_is_sorted_and_complete() -> None:
    assert aiosnap.__all__ == sorted(aiosnap.__all__)
    importlib.import_module("aiosnap.demo")  # an imported submodule is an attribute, not a public name
    assert {n for n in dir(aiosnap) if not n.startswith("_")} == set(aiosnap.__all__)
    for module in (aiosnap.errors, aiosnap.storage, aiosnap.triggers, aiosnap.retention, aiosnap.cli):
        assert module.__all__ == sorted(module.__all__)
        assert {n for n in dir(module) if not n.startswith("_") and n != "annotations"} == set(module.__all__)


def test_each_public_name_has_one_home() -> None:
    """A name lives in one public module: the errors in ``aiosnap.errors``, retention,
    triggers and storage in theirs, the rest at the top (issue 41: at most 50 there)."""
    homes: dict[str, list[str]] = {}
    for module in (aiosnap, aiosnap.errors, aiosnap.storage, aiosnap.triggers, aiosnap.retention):
        for name in module.__all__:
            homes.setdefault(name, []).append(module.__name__)
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}
    assert len(aiosnap.__all__) <= 50
    assert all(
        aiosnap.errors.CheckpointError in (cls, *cls.__mro__) or cls is aiosnap.errors.AiosnapWarning
        for cls in map(vars(aiosnap.errors).get, aiosnap.errors.__all__)
    )
    assert {getattr(aiosnap.errors, name).__module__ for name in aiosnap.errors.__all__} == {"aiosnap.errors"}


def test_every_error_is_a_checkpoint_error_and_its_nearest_builtin() -> None:
    pairs = {
        aiosnap.errors.CaptureError: RuntimeError,
        aiosnap.errors.CheckpointNotFoundError: FileNotFoundError,
        aiosnap.errors.ConflictError: RuntimeError,
        aiosnap.errors.CorruptCheckpointError: ValueError,
        aiosnap.errors.DirectoryLockedError: RuntimeError,
        aiosnap.errors.ForeignFileError: FileExistsError,
        aiosnap.errors.IndexWriteError: OSError,
        aiosnap.errors.LeaseLostError: RuntimeError,
        aiosnap.errors.LoaderClosedError: RuntimeError,
        aiosnap.errors.NotACheckpointError: ValueError,
        aiosnap.errors.CheckpointKeyError: KeyError,
        aiosnap.errors.PeerTransferError: RuntimeError,
        aiosnap.errors.PickleNotAllowedError: ValueError,
        aiosnap.errors.RankFailedError: RuntimeError,
        aiosnap.errors.RemoteStorageError: OSError,
        aiosnap.errors.SaveCancelledError: RuntimeError,
        aiosnap.errors.StateMismatchError: ValueError,
        aiosnap.errors.StepExistsError: FileExistsError,
        aiosnap.errors.UnsupportedTypeError: TypeError,
        aiosnap.errors.WorkerCrashedError: RuntimeError,
        aiosnap.errors.WriterClosedError: RuntimeError,
    }
    for cls, builtin in pairs.items():
        assert issubclass(cls, aiosnap.errors.CheckpointError) and issubclass(cls, builtin)
    exported = [getattr(aiosnap.errors, n) for n in aiosnap.errors.__all__]
    errors = {v for v in exported if isinstance(v, type) and issubclass(v, Exception)}
    assert errors == {*pairs, aiosnap.errors.CheckpointError, aiosnap.errors.AiosnapWarning}
    assert issubclass(aiosnap.errors.AiosnapWarning, UserWarning)  # a warning, not an error
    assert _subclasses(aiosnap.errors.CheckpointError) == set(pairs)  # none of aiosnap's errors is hidden


def _subclasses(cls: type) -> set[type]:
    return {s for sub in cls.__subclasses__() for s in (sub, *_subclasses(sub))}


def test_corrupt_error_names_path_and_reason() -> None:
    err = aiosnap.errors.CorruptCheckpointError("/x/y", "truncated")
    assert str(err) == "/x/y: truncated" and err.path == "/x/y" and err.reason == "truncated"


def _documented() -> list[tuple[str, str]]:
    """(where, docstring) of every public module, name, method and property."""
    found = []
    for module in (aiosnap, aiosnap.storage, aiosnap.triggers, aiosnap.retention, aiosnap.cli):
        found.append((module.__name__, module.__doc__ or ""))
        for name in module.__all__:
            obj = getattr(module, name)
            found.append((f"{module.__name__}.{name}", inspect.getdoc(obj) or ""))
            for attr, member in vars(obj).items() if inspect.isclass(obj) else ():
                if not attr.startswith("_") or attr in ("__call__", "__init__"):
                    found.append((f"{module.__name__}.{name}.{attr}", inspect.getdoc(member) or ""))
    return found


def test_every_aiosnap_name_a_docstring_mentions_exists() -> None:
    broken = []
    for where, doc in _documented():
        for ref in re.findall(r"\baiosnap(?:\.\w+)+", doc):
            obj: object = aiosnap
            for part in ref.split(".")[1:]:
                if not hasattr(obj, part):
                    broken.append(f"{where} mentions {ref}")
                    break
                obj = getattr(obj, part)
    assert broken == []


def test_a_former_name_still_works_and_warns() -> None:
    # AnyOf became AnyPolicy, named as AnyTrigger is: code written with the old name runs,
    # and is told where it uses it.
    for module in (aiosnap.retention,):
        with pytest.warns(DeprecationWarning, match=rf"{module.__name__}\.AnyOf is deprecated") as seen:
            former = module.AnyOf
        assert former is aiosnap.retention.AnyPolicy and seen[0].filename == __file__
    with pytest.warns(DeprecationWarning, match="it is aiosnap.retention.AnyPolicy"):
        from aiosnap.retention import AnyOf
    assert AnyOf(aiosnap.retention.KeepLast(1), aiosnap.retention.KeepEvery(10)).keep([], 0.0) == set()
    with pytest.raises(AttributeError, match="no attribute 'AnyOff'"):
        aiosnap.retention.AnyOff  # noqa: B018
    assert "AnyOf" not in dir(aiosnap) and "AnyOf" not in dir(aiosnap.retention)


def test_every_error_pickles_whole_and_is_named_as_users_import_it() -> None:
    """A worker process's or a spawned rank's error arrives whole (its subclass's own
    arguments are not its args); a traceback names it ``aiosnap.X``."""
    import pickle
    import traceback

    made = [
        aiosnap.errors.CorruptCheckpointError("/p", "a checksum does not match"),
        aiosnap.errors.StepExistsError("/p/s1", 1),
        aiosnap.errors.CaptureError("model.w", "by another thread"),
        aiosnap.errors.ForeignFileError("/p/x", "a link"),
    ]
    for error in made:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error) and back.__dict__ == error.__dict__
        assert traceback.format_exception_only(error)[-1].startswith(
            f"aiosnap.errors.{type(error).__name__}: "
        )
