"""The public surface: names, the exception hierarchy."""

from __future__ import annotations

import aiosnap
import aiosnap._errors as errors


def test_all_is_sorted_and_complete() -> None:
    assert aiosnap.__all__ == sorted(aiosnap.__all__)
    public = {
        n for n in dir(aiosnap) if not n.startswith("_") and n not in {"logging", "annotations", "demo"}
    }
    assert public == set(aiosnap.__all__)


def test_every_error_is_a_checkpoint_error_and_its_nearest_builtin() -> None:
    pairs = {
        aiosnap.CheckpointNotFoundError: FileNotFoundError,
        aiosnap.ConflictError: RuntimeError,
        aiosnap.CorruptCheckpointError: ValueError,
        aiosnap.DirectoryLockedError: RuntimeError,
        aiosnap.LeaseLostError: RuntimeError,
        aiosnap.LoaderClosedError: RuntimeError,
        aiosnap.CheckpointKeyError: KeyError,
        aiosnap.PickleNotAllowedError: ValueError,
        aiosnap.RankFailedError: RuntimeError,
        aiosnap.StateMismatchError: ValueError,
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
