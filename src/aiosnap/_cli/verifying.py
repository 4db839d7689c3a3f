"""``aiosnap verify``: what its targets hold, and each checkpoint verified in turn."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from .._load.verify import verify_blocking
from . import views
from .dirs import checkpoints, locate, run


@dataclass(frozen=True, slots=True)
class Verified:
    """A checkpoint to verify; ``direct``: named by the user (not found in a directory)."""

    storage: Any
    path: str
    size: int
    direct: bool


def verify_targets(target: str, name: str | None) -> list[Verified]:
    """The checkpoints ``target`` names: itself, or every one of its directory (a
    manager's, with ``name``, or an integration's)."""
    place = locate(target)
    if place.kind == "dcp":
        raise CheckpointError(f"{target} is a torch.distributed.checkpoint directory: it has no checksums")
    if place.kind == "directory":
        found = run(checkpoints, target, name)
        return [Verified(place.storage, path, size, False) for path, size in found]
    return [Verified(place.storage, place.path, place.size, True)]


def verify_all(todo: list[Verified], say: Callable[[BaseException], object]) -> tuple[int, int]:
    r"""Verify each of ``todo``, a line on stdout each, a progress bar on stderr: (the
    checkpoints that failed, the files named that are no checkpoint, each ``say``\ d)."""
    out, failed, broken = views.out(), 0, 0
    with views.progress(views.err(), bytes_=True) as bar:
        task = bar.add_task("verifying", total=sum(v.size for v in todo) or None)
        offset = 0
        for v in todo:
            progress = functools.partial(_advance, bar.update, task, offset, v.size)
            try:
                report = verify_blocking(v.storage, v.path, progress)
            except NotACheckpointError as exc:
                if v.direct and len(todo) == 1:
                    raise  # bad input, not a checkpoint that failed
                if v.direct:
                    broken += 1
                    say(exc)
                else:
                    failed += 1
                    out.print(f"FAILED  {v.path}: not a checkpoint")
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                failed += 1
                out.print(f"FAILED  {views.one_line(str(exc))}")
            else:
                tag = "ok     " if report.format != "torch.save" else "pickle "
                out.print(f"{tag} {v.path} ({views.verified(report)})")
            offset += v.size
            bar.update(task, completed=offset)
    return failed, broken


def _advance(update: Callable[..., None], task: Any, offset: int, size: int, done: int, total: int) -> None:
    update(task, completed=offset + (size * done // total if total else 0))
