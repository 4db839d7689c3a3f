"""How the command line shows things: tables and lines on stdout, progress bars on
stderr (only on a terminal), sizes and times as people read them."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .._load.verify import VerifyReport
from .._manager.records import CheckpointRecord
from .bench import Measurement
from .dirs import Listing, Row
from .entries import jsonable


def out() -> Console:
    """Tables fit the terminal; lines of text are never wrapped (paths stay whole). No
    markup: names and values from a file are shown as they are (``[bold]`` too)."""
    return Console(highlight=False, soft_wrap=True, markup=False)


def err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True, markup=False)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=repr) + "\n")


def human(n: int | None) -> str:
    """Bytes as people read them: 512 B, 4.0 KiB, 1.2 GiB."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def metrics(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def progress(console: Console, *, bytes_: bool) -> Progress:
    """A bar on stderr, shown only on a terminal (a log gets the results, not the bar)."""
    amount = DownloadColumn(binary_units=True) if bytes_ else TextColumn("{task.completed}/{task.total}")
    columns = (TextColumn("{task.description}"), BarColumn(), amount, TimeRemainingColumn())
    return Progress(*columns, console=console, disable=not console.is_terminal)


def print_listing(found: Listing, remote: bool) -> None:
    """A manager's checkpoints by step; an integration's with their file or folder names
    (what ``inspect`` and ``verify`` take), and no commit time (nothing records it)."""
    named = found.layout is not None
    headers = ["checkpoint"] * named + ["step", "epoch"] + ["saved"] * (not named)
    table = Table(*headers, "size", "metrics", "status")
    if remote:
        table.add_column("remote")
    for row in found.rows:
        table.add_row(*([row.file] * named), *ls_cells(row, remote, saved=not named))
    out().print(table)
    latest = next((r.step for r in found.rows if r.latest), None)
    local = sum(r.local for r in found.rows)
    where = found.directory
    if found.layout is not None:
        where += f" ({found.layout.title})"
    out().print(f"{local} checkpoint(s) in {where}; latest: step {latest}")


def ls_cells(row: Row, remote: bool, *, saved: bool = True) -> list[str]:
    status = "latest" if row.latest else ""
    if row.corrupt is not None:
        status = f"corrupt: {row.corrupt.rpartition(f'{row.file}: ')[2]}"  # the path is in the row
    if not row.local:
        status = "remote only"
    cells = ["-" if row.step is None else str(row.step), epoch(row.epoch)]
    cells += [when(row.time) if row.time is not None else "-"] * saved
    cells += [human(row.size or None), metrics(row.metrics), status]
    return [*cells, "uploaded" if row.remote else "-"] if remote else cells


def epoch(value: int | float | None) -> str:
    """An epoch as its trainer counts it: a whole number, or the Hugging Face Trainer's
    fraction of epochs done (``2.5``)."""
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def listing_json(found: Listing) -> dict[str, Any]:
    rows = []
    for row in found.rows:
        rows.append(
            {
                "step": row.step,
                "epoch": row.epoch,
                "file": row.file,
                "time": row.time,
                "bytes": row.size,
                "metrics": jsonable(row.metrics),
                "latest": row.latest,
                "corrupt": row.corrupt,
                "local": row.local,
                "uploaded": row.remote,
            }
        )
    latest = next((r.step for r in found.rows if r.latest), None)
    layout = "manager" if found.layout is None else found.layout.kind
    return {
        "directory": found.directory,
        "layout": layout,
        "name": found.name,
        "latest": latest,
        "checkpoints": rows,
    }


def stored(tensors: int, nbytes: int) -> str:
    """What a checkpoint's data section holds, in the words inspect and verify share."""
    return f"stored: {tensors} tensor(s), {human(nbytes)} of data"


def verified(report: VerifyReport) -> str:
    what = stored(report.tensors, report.bytes)
    if report.format == "torch.save":
        return (
            f"a torch.save file, not an aiosnap checkpoint: {what}; its zip CRC-32s match; "
            "loading it unpickles (runs code from the file): only with --allow-pickle"
        )
    return (
        what
        + ("; checksums match" if report.checksummed else "; plain safetensors, no checksums to match")
        + (f"; {report.node}" if report.node else "")
    )


def print_pruned(gone: list[CheckpointRecord], kept: list[CheckpointRecord], dry_run: bool) -> None:
    if gone:
        table = Table("step", "epoch", "saved", "size", "metrics")
        for r in gone:
            table.add_row(*record_cells(r))
        out().print(table)
    verb = "would remove" if dry_run else "removed"
    freed = human(sum(r.bytes for r in gone))
    kept_text = ", ".join(f"{r.step}{' (corrupt)' if r.corrupt else ''}" for r in kept) or "none"
    out().print(f"{verb} {len(gone)} checkpoint(s) ({freed}); keeping steps {kept_text}")


def record_cells(r: CheckpointRecord) -> list[str]:
    saved = when(r.wall_time) if r.timings else "-"
    epoch = "-" if r.epoch is None else str(r.epoch)
    return [str(r.step), epoch, saved, human(r.bytes or None), metrics(r.metrics)]


def print_bench(results: list[Measurement], nbytes: int, directory: str) -> None:
    by = {m.name: m for m in results}
    table = Table("method", "caller waits s", "done s", "GB/s", "x disk")
    for m in results:
        disk = by["disk: write + fsync" if m.phase == "save" else "disk: read (cold)"].total
        rate = nbytes / m.total / 1e9 if m.total else 0.0
        table.add_row(m.name, f"{m.stall:.3f}", f"{m.total:.3f}", f"{rate:.2f}", f"{m.total / disk:.2f}")
    console = out()
    console.print(f"{human(nbytes)} state in {os.path.abspath(directory)}, median of the runs")
    console.print(table)
    load, queued = by["aiosnap.load (cold)"], by["aiosnap QueueWriter (open)"]
    torch_save = by["torch.save + fsync"].total
    console.print(
        f"aiosnap QueueWriter: durable {torch_save / queued.total:.2f}x as fast as torch.save + fsync;"
    )
    console.print(f"  training waits {queued.stall:.3f} s of the {queued.total:.3f} s a save takes")
    console.print(f"aiosnap.load: {by['torch.load (cold)'].total / load.total:.2f}x as fast as torch.load")


def one_line(text: str) -> str:
    return " ".join(text.split())
