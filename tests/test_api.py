"""The public surface: names, the exception hierarchy."""

from __future__ import annotations

import importlib
import inspect
import re

import aiosnap
import aiosnap._base.errors as errors


def test_all_is_sorted_and_complete() -> None:
    assert aiosnap.__all__ == sorted(aiosnap.__all__)
    importlib.import_module("aiosnap.demo")  # an imported submodule is an attribute, not a public name
    assert {n for n in dir(aiosnap) if not n.startswith("_")} == set(aiosnap.__all__)
    for module in (aiosnap.storage, aiosnap.triggers, aiosnap.retention):
        assert module.__all__ == sorted(module.__all__)
        assert {n for n in dir(module) if not n.startswith("_") and n != "annotations"} == set(module.__all__)


def test_every_error_is_a_checkpoint_error_and_its_nearest_builtin() -> None:
    pairs = {
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
    defined = {v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)}
    assert defined == {*pairs, aiosnap.CheckpointError}


def test_corrupt_error_names_path_and_reason() -> None:
    err = aiosnap.CorruptCheckpointError("/x/y", "truncated")
    assert str(err) == "/x/y: truncated" and err.path == "/x/y" and err.reason == "truncated"


def _documented() -> list[tuple[str, str]]:
    """(where, docstring) of every public module, name, method and property."""
    found = []
    for module in (aiosnap, aiosnap.storage, aiosnap.triggers, aiosnap.retention):
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
