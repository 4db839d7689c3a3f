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
    for module in (aiosnap.storage, aiosnap.triggers, aiosnap.retention, aiosnap.cli):
        assert module.__all__ == sorted(module.__all__)
        assert {n for n in dir(module) if not n.startswith("_") and n != "annotations"} == set(module.__all__)


def test_every_error_is_a_checkpoint_error_and_its_nearest_builtin() -> None:
    pairs = {
        aiosnap.CaptureError: RuntimeError,
        aiosnap.CheckpointNotFoundError: FileNotFoundError,
        aiosnap.ConflictError: RuntimeError,
        aiosnap.CorruptCheckpointError: ValueError,
        aiosnap.DirectoryLockedError: RuntimeError,
        aiosnap.ForeignFileError: FileExistsError,
        aiosnap.IndexWriteError: OSError,
        aiosnap.LeaseLostError: RuntimeError,
        aiosnap.LoaderClosedError: RuntimeError,
        aiosnap.NotACheckpointError: ValueError,
        aiosnap.CheckpointKeyError: KeyError,
        aiosnap.PickleNotAllowedError: ValueError,
        aiosnap.RankFailedError: RuntimeError,
        aiosnap.RemoteStorageError: OSError,
        aiosnap.SaveCancelledError: RuntimeError,
        aiosnap.StateMismatchError: ValueError,
        aiosnap.StepExistsError: FileExistsError,
        aiosnap.UnsupportedTypeError: TypeError,
        aiosnap.WorkerCrashedError: RuntimeError,
        aiosnap.WriterClosedError: RuntimeError,
    }
    for cls, builtin in pairs.items():
        assert issubclass(cls, aiosnap.CheckpointError) and issubclass(cls, builtin)
    exported = [getattr(aiosnap, n) for n in aiosnap.__all__]
    errors = {v for v in exported if isinstance(v, type) and issubclass(v, Exception)}
    assert errors == {*pairs, aiosnap.CheckpointError, aiosnap.AiosnapWarning}
    assert issubclass(aiosnap.AiosnapWarning, UserWarning)  # a warning, not an error
    assert _subclasses(aiosnap.CheckpointError) == set(pairs)  # none of aiosnap's errors is hidden


def _subclasses(cls: type) -> set[type]:
    return {s for sub in cls.__subclasses__() for s in (sub, *_subclasses(sub))}


def test_corrupt_error_names_path_and_reason() -> None:
    err = aiosnap.CorruptCheckpointError("/x/y", "truncated")
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
    for module in (aiosnap, aiosnap.retention):
        with pytest.warns(DeprecationWarning, match=rf"{module.__name__}\.AnyOf is deprecated") as seen:
            former = module.AnyOf
        assert former is aiosnap.AnyPolicy and seen[0].filename == __file__
    with pytest.warns(DeprecationWarning, match="it is aiosnap.retention.AnyPolicy"):
        from aiosnap.retention import AnyOf
    assert AnyOf(aiosnap.KeepLast(1), aiosnap.KeepEvery(10)).keep([], 0.0) == set()
    with pytest.raises(AttributeError, match="no attribute 'AnyOff'"):
        aiosnap.AnyOff  # noqa: B018
    assert "AnyOf" not in dir(aiosnap) and "AnyOf" not in dir(aiosnap.retention)


def test_every_error_pickles_whole_and_is_named_as_users_import_it() -> None:
    """A worker process's or a spawned rank's error arrives whole (its subclass's own
    arguments are not its args); a traceback names it ``aiosnap.X``."""
    import pickle
    import traceback

    made = [
        aiosnap.CorruptCheckpointError("/p", "a checksum does not match"),
        aiosnap.StepExistsError("/p/s1", 1),
        aiosnap.CaptureError("model.w", "by another thread"),
        aiosnap.ForeignFileError("/p/x", "a link"),
    ]
    for error in made:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error) and back.__dict__ == error.__dict__
        assert traceback.format_exception_only(error)[-1].startswith(f"aiosnap.{type(error).__name__}: ")
