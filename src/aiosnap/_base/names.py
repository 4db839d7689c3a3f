"""The names a checkpoint directory may hold: templates, steps and file names.

A checkpoint directory is shared ground: people, evaluation jobs and ``rsync`` put
files there too. aiosnap writes only inside it, under names it can read back, and
never under the names it keeps for itself: temp files and the lock (``.aiosnap``...),
the index and the manifests (``aiosnap-index``..., ``aiosnap-manifest``...), the blobs of
incremental saves (``aiosnap-blobs/``). A name
template renders every step to one path component that parses back to that step, so
that what a save writes is what the next open finds. Pure functions, standard library
only.
"""

from __future__ import annotations

import numbers
import re
import string

#: Names aiosnap keeps for itself: its temp files and lock, its index and manifests, the
#: folder of an incremental checkpoint directory's blobs.
RESERVED_PREFIXES = (".aiosnap", "aiosnap-index", "aiosnap-manifest", "aiosnap-blobs")
#: The folder, beside the checkpoints that refer to them, where incremental saves keep
#: their blobs (each named by its content hash).
BLOB_DIR = "aiosnap-blobs"
_FIELDS = ("step", "epoch", "rank")


def check_component(name: str, what: str) -> str:
    """``name`` if it is one path component that is not aiosnap's own; else ValueError.
    ``what`` says what the name is, for the message."""
    if not isinstance(name, str):
        raise ValueError(f"{what} must be a str, not {type(name).__name__}")
    problem = _component_problem(name)
    if problem:
        raise ValueError(f"{what} {name!r} {problem}")
    return name


def _component_problem(name: str) -> str:
    if not name:
        return "is empty"
    if name in (".", ".."):
        return "is not a file name"
    if "/" in name or "\\" in name:
        return "must be a single name inside the directory, without '/' or '\\'"
    if "\0" in name:
        return "holds a NUL character"
    if name.startswith(RESERVED_PREFIXES):
        return f"starts like aiosnap's own files ({', '.join(RESERVED_PREFIXES)}...); pick another name"
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return "is longer than a file name may be (255 bytes)"
    return ""


def check_step(step: object, what: str = "step") -> int:
    """``step`` as an int if it is a non-negative integer (a NumPy one too), never a bool;
    else ValueError."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise ValueError(f"{what} must be a non-negative int, not {step!r} ({type(step).__name__})")
    if step < 0:
        raise ValueError(f"{what} must be a non-negative int, not {step}")
    return int(step)


def template(name: str) -> re.Pattern[str]:
    """The pattern of the names ``name`` renders, after checking the template: only
    ``{step}``, ``{epoch}`` and ``{rank}``, each at most once, ``{step}`` required, and
    every rendering one path component that is not aiosnap's own."""
    if not isinstance(name, str):
        raise ValueError(f"name must be a str, not {type(name).__name__}")
    parts, seen = [], set()
    try:
        parsed = list(string.Formatter().parse(name))
    except ValueError as exc:
        raise ValueError(f"name {name!r}: {exc}") from None
    for literal, field, spec, conv in parsed:
        parts.append(re.escape(literal))
        if field is None:
            continue
        if field not in _FIELDS or spec or conv:
            raise ValueError(f"name {name!r}: only {{step}}, {{epoch}} and {{rank}} may be used")
        if field in seen:
            raise ValueError(f"name {name!r} uses {{{field}}} twice")
        seen.add(field)
        parts.append(f"(?P<{field}>\\d+)")
    if "step" not in seen:
        raise ValueError(f"name {name!r} must contain {{step}}")
    pattern = re.compile("".join(parts))
    sample = name.format(step=0, epoch=0, rank=0)
    problem = _component_problem(sample)
    if problem:
        raise ValueError(f"name {name!r} renders {sample!r}, which {problem}")
    return pattern


def render(name: str, pattern: re.Pattern[str], step: int, epoch: int | None, rank: int) -> str:
    """The file name of ``step``; ValueError unless it parses back to this step (and
    epoch), so that the next open finds it as what it is."""
    if epoch is None and "epoch" in pattern.groupindex:
        raise ValueError(f"name {name!r} uses {{epoch}}: pass epoch=")
    rendered = name.format(step=step, epoch=epoch, rank=rank)
    check_component(rendered, f"name {name!r} renders")
    found = pattern.fullmatch(rendered)
    back = (int(found.group("step")), _group(found, "epoch")) if found else None
    if back != (step, epoch if "epoch" in pattern.groupindex else None):
        raise ValueError(
            f"name {name!r} renders step {step}{'' if epoch is None else f', epoch {epoch}'} as "
            f"{rendered!r}, which reads back as another step: put a separator between the fields"
        )
    return rendered


def _group(found: re.Match[str], field: str) -> int | None:
    value = found.groupdict().get(field)
    return None if value is None else int(value)
