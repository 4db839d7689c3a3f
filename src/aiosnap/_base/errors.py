"""The one exception hierarchy of aiosnap.

    CheckpointError
    ├── CaptureError              (also RuntimeError)   a lazy capture saw a tensor change under it
    ├── CheckpointNotFoundError   (also FileNotFoundError)
    ├── ConflictError             (also RuntimeError)
    ├── CorruptCheckpointError    (also ValueError)
    │   └── NotACheckpointError   a file of another format (torch.save, NumPy ...)
    ├── DirectoryLockedError      (also RuntimeError)
    ├── ForeignFileError          (also FileExistsError)
    ├── IndexWriteError           (also OSError)   the checkpoint committed; its index did not
    ├── LeaseLostError            (also RuntimeError)
    ├── LoaderClosedError         (also RuntimeError)
    ├── PeerTransferError         (also RuntimeError)   a file's bytes did not reach another rank whole
    ├── CheckpointKeyError        (also KeyError)
    ├── PickleNotAllowedError     (also ValueError)
    ├── RankFailedError           (also RuntimeError)
    ├── RemoteStorageError        (also OSError)
    ├── SaveCancelledError        (also RuntimeError)   its caller gave the save up before its capture
    ├── StateMismatchError        (also ValueError)
    ├── StepExistsError           (also FileExistsError)
    ├── UnsupportedTypeError      (also TypeError)
    ├── WorkerCrashedError        (also RuntimeError)
    └── WriterClosedError         (also RuntimeError)

Failures of a background save are *not* wrapped: the original exception (an
``OSError`` from a full disk, the exception a ``savefun`` raised, ...) is re-raised
with its own type, so callers can keep catching what they already catch.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every error aiosnap raises itself."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (a worker process's error, a spawned rank's): the subclasses'
        # own __init__ arguments are not their args, so rebuild without calling it.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[CheckpointError], args: tuple[Any, ...], state: dict[str, Any]) -> CheckpointError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class CaptureError(CheckpointError, RuntimeError):
    """A lazily captured tensor was changed in place after the save call and before its
    copy ended, by a path the capture could not hold back (another thread, NumPy, a raw
    pointer): the save would mix values of two moments, so it fails instead.

    Args:
        entry: The entry's dotted path in the state.
    """

    def __init__(self, entry: str, detail: str) -> None:
        super().__init__(
            f"{entry} changed in place after the save call and before its copy ended ({detail}): the "
            "save would mix values from two moments, so it failed. Change it only after `await "
            "handle.wait_captured()`, on the event loop's thread, or save with capture='eager'"
        )
        self.entry = entry


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist (a storage backend raises it for a missing object).

    Args:
        path: What was not found.
        message: The message; by default it names ``path``.
    """

    def __init__(self, path: str, message: str | None = None) -> None:
        super().__init__(message or f"no checkpoint at {path!r}")
        self.path = path

    def __str__(self) -> str:
        return str(self.args[0])


class ConflictError(CheckpointError, RuntimeError):
    """An object changed on storage since it was read: another writer replaced it (a
    storage backend's ``replace_if`` raises it).

    Args:
        path: The object.
        message: The message; by default it names ``path``.
    """

    def __init__(self, path: str, message: str | None = None) -> None:
        super().__init__(message or f"{path} was replaced by another writer since it was read")
        self.path = path


class CorruptCheckpointError(CheckpointError, ValueError):
    """The file is truncated, altered or not a checkpoint at all.

    Args:
        path: The file (or object) read.
        reason: What is wrong with it; the message is ``"{path}: {reason}"``.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class NotACheckpointError(CorruptCheckpointError):
    """The file is not a checkpoint aiosnap reads, but a file of another format (torch.save,
    NumPy, pickle ...); the message says what it is and how to read it."""


class CheckpointKeyError(CheckpointError, KeyError):
    """A requested key is not in the checkpoint."""

    def __str__(self) -> str:
        return str(self.args[0])


class DirectoryLockedError(CheckpointError, RuntimeError):
    """Another CheckpointManager holds the directory (a storage backend's ``lease``
    raises it).

    Args:
        message: Who holds it, as far as is known.
        retry_after: The seconds until the holder's lease goes stale if it stops renewing
            it; None for a lock the kernel drops when its holder dies.
        expires: When the holder's lease goes stale, as the lease itself says (seconds
            since the epoch, the holder's clock), if known: a later try that reads the
            same value knows the lease was not renewed meanwhile.
    """

    def __init__(self, message: str, retry_after: float | None = None, expires: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.expires = expires


class ForeignFileError(CheckpointError, FileExistsError):
    """Something aiosnap did not write (a user's file, a symbolic link, a directory)
    stands where aiosnap would write or lock: aiosnap leaves it alone and refuses.

    Args:
        path: Where it stands.
        what: What it is, in words (``"a directory"``).
    """

    def __init__(self, path: str, what: str) -> None:
        super().__init__(
            f"{path} is {what}, which aiosnap did not write: aiosnap never writes over, follows or "
            "deletes what it did not write; move it away, or use another name or directory"
        )
        self.path = path


class IndexWriteError(CheckpointError, OSError):
    """The checkpoint was committed, and is restorable and rotated as any other; only
    the index beside it (a cache of the directory, rebuilt from it at the next open)
    could not be written. The cause (a full disk ...) is chained, its errno kept.

    Args:
        path: The index.
        cause: Why it could not be written.
    """

    def __init__(self, path: str, cause: OSError) -> None:
        super().__init__(
            f"the checkpoint was committed, but its index {path} could not be written "
            f"({cause.strerror or cause}); the index is rebuilt from the directory at the next open"
        )
        self.errno, self.strerror, self.filename = cause.errno, cause.strerror, path
        self.path = path

    def __str__(self) -> str:  # not OSError's "[Errno N] strerror: filename"
        return str(self.args[0])


class LeaseLostError(CheckpointError, RuntimeError):
    """The lease of a checkpoint directory expired and another manager took it over."""


class LoaderClosedError(CheckpointError, RuntimeError):
    """The AsyncLoader is not open, or its producer stopped."""


class PeerTransferError(CheckpointError, RuntimeError):
    """A checkpoint file's bytes did not move whole between two ranks: the peer died,
    fell silent, refused the file or sent other bytes than it announced. Nothing partial
    is left at the receiving end.

    Args:
        peer: The other rank of the transfer.
        path: The file, at this rank's end.
        reason: What went wrong, in words.
    """

    def __init__(self, peer: int, path: str, reason: str) -> None:
        super().__init__(f"{path}: the transfer with rank {peer} failed: {reason}")
        self.peer, self.path, self.reason = peer, path, reason


class PickleNotAllowedError(CheckpointError, ValueError):
    """The checkpoint holds pickled objects and ``allow_pickle`` was not given."""


class RankFailedError(CheckpointError, RuntimeError):
    """Another rank of the group failed, died or stopped answering. The checkpoint in
    progress was not committed.

    Args:
        message: What failed, naming the ranks.
        failed: Each rank that failed, mapped to what is known of it.
    """

    def __init__(self, message: str, failed: dict[int, str]) -> None:
        super().__init__(message)
        self.failed = failed


class RemoteStorageError(CheckpointError, OSError):
    """An object store failed, or could not be reached within the retry deadline; the
    message names the URL and what went wrong (credentials, the endpoint, a status)."""

    #: Whether trying again cannot help (the bucket does not exist): not retried.
    permanent: bool = False


class SaveCancelledError(CheckpointError, RuntimeError):
    """The save was given up by its caller before its state was captured (its call, or
    its ``wait_captured()``, was cancelled): nothing of it was written."""


class StateMismatchError(CheckpointError, ValueError):
    """``load_into`` found missing, unexpected or differently shaped entries."""


class StepExistsError(CheckpointError, FileExistsError):
    """The step is committed already: a save does not replace it unless asked to
    (``overwrite=True``).

    Args:
        path: The committed checkpoint of the step.
        step: The step.
    """

    def __init__(self, path: str, step: int) -> None:
        super().__init__(
            f"step {step} is committed already ({path}): pass overwrite=True to replace it, "
            "or save another step"
        )
        self.path, self.step = path, step


class UnsupportedTypeError(CheckpointError, TypeError):
    """A value in the state tree cannot be stored without pickle."""


class WorkerCrashedError(CheckpointError, RuntimeError):
    """The offload worker process died while it held a save."""


class WriterClosedError(CheckpointError, RuntimeError):
    """The writer is not open: use ``async with`` before saving, not after."""
