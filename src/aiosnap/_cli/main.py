"""The ``aiosnap`` command line (also ``python -m aiosnap``): look at, check, compare,
prune and convert checkpoints, local or at a URL, and measure a disk.

Everything but ``prune`` and ``convert``'s output only reads, through read-only
managers and the blocking readers, so it runs beside a training job and never takes
its directory. Results go to stdout (tables, or JSON with ``--json``), progress bars
and errors to stderr. Exit codes, the same for every command: 0 done, nothing wrong
found; 1 a check found a problem (``verify``: a checkpoint fails; ``diff``: the two
differ); 2 the command could not do what was asked -- a usage error, a missing path,
no checkpoints where some were to be found, a file that is no checkpoint, a store that
cannot be reached, a directory in use -- said in one line on stderr, never a traceback
(``AIOSNAP_DEBUG=1`` prints it too); 130 interrupted.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, get_args

import typer

from .. import __version__
from .._base.errors import CheckpointError
from .._manager.retention import AnyPolicy, KeepBest, KeepEvery, KeepLast, KeepWithin, RetentionPolicy
from . import tables, views
from .bench import Bench, parse_size
from .convert import convert, read_state
from .diff import Status, diff
from .dirs import listing, locate, prune, reaching, run
from .entries import describe
from .help import Command, Group
from .select import select
from .tables import Shown
from .verifying import Verified, verify_all, verify_targets

OK, FAILED, ERROR = 0, 1, 2
#: The base of the usage errors of the click typer carries inside (it exports no name for it).
_CLICK_ERROR: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

app = typer.Typer(
    name="aiosnap",
    help="Look at, check, compare, prune and convert aiosnap checkpoints (local paths or URLs).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=Group,
)

Name = Annotated[
    str | None,
    typer.Option(help="The manager's name= ({step} and maybe {epoch}); read off the index if not given."),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
AllowPickle = Annotated[
    bool,
    typer.Option(
        "--allow-pickle",
        help="Read torch.save files and DCP directories (and pickled entries): runs code from the file.",
    ),
]
Keys = Annotated[
    list[str] | None,
    typer.Option(
        "--keys",
        "-k",
        metavar="GLOB",
        help="Show only entries whose dotted path, or a container's above them, matches (repeatable): "
        "'optimizer', '*.exp_avg', 'model.enc.layers.0*'.",
    ),
]
Exclude = Annotated[
    list[str] | None,
    typer.Option("--exclude", "-x", metavar="GLOB", help="Leave out what matches, as --keys (repeatable)."),
]
Depth = Annotated[
    int | None,
    typer.Option(help="Show the tree this many levels deep; one row per container below.", min=1),
]
Expand = Annotated[
    bool,
    typer.Option("--expand", help="List every plain value (a container of more than 8 is one row)."),
]
Wide = Annotated[
    bool,
    typer.Option("--wide", help="One line per row, however wide (long names wrap otherwise)."),
]
#: How long the command line waits on an object store by default: a person waits for
#: it (the library's own default, for training jobs, is 120 s).
DEADLINE = 30.0
Deadline = Annotated[
    float,
    typer.Option(
        metavar="SECONDS",
        min=0.1,
        help="Seconds a failing call to an object store (s3://, gs://, az://) is retried before the "
        "command fails; a URL's store that accepts and never answers is given up 5 s later.",
    ),
]


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        sys.stdout.write(f"aiosnap {__version__}\n")
        raise typer.Exit(OK)


# -- ls --------------------------------------------------------------------------------------------


@app.command("ls", cls=Command)
def ls_command(
    directory: Annotated[
        str, typer.Argument(metavar="DIRECTORY", help="A checkpoint directory: path or URL.")
    ],
    name: Name = None,
    remote: Annotated[
        str | None, typer.Option(help="The remote tier (a manager's remote=): shows which steps it holds.")
    ] = None,
    as_json: Json = False,
    deadline: Deadline = DEADLINE,
) -> None:
    """List the checkpoints of a directory.

    Steps, epochs, times, sizes, metrics, the latest, those marked corrupt (and which
    the remote tier holds, with --remote). A CheckpointManager's directory, or the
    checkpoints of the trainer integrations: Hugging Face Trainer and Accelerate
    folders (checkpoint-N/, checkpoint_N/), Lightning .ckpt files, here or in a
    checkpoints/ folder. Exit 2 if there are none."""
    with reaching(f"listing {directory}", deadline, directory, *([remote] if remote else [])):
        found = run(listing, directory, name, remote)
    if as_json:
        views.print_json(views.listing_json(found))
        return
    views.print_listing(found, remote is not None)


# -- inspect ---------------------------------------------------------------------------------------


@app.command("inspect", cls=Command)
def inspect_command(
    checkpoint: Annotated[
        str,
        typer.Argument(metavar="CHECKPOINT", help="A checkpoint file or step directory: a path or a URL."),
    ],
    keys: Keys = None,
    exclude: Exclude = None,
    depth: Depth = None,
    expand: Expand = False,
    wide: Wide = False,
    as_json: Json = False,
    allow_pickle: AllowPickle = False,
    deadline: Deadline = DEADLINE,
) -> None:
    """Show what a checkpoint holds: its tree, with dtypes, shapes, sizes and checksums.

    Only the header is read. A container of more than 8 plain values (an RNG state, a
    list of parameter ids) is one row unless --expand; --keys, --exclude and --depth
    choose what is shown. --json lists every entry --keys and --exclude select. A
    trainer's checkpoint folder (checkpoint-N/) is its state.aiosnap."""
    with reaching(f"inspecting {checkpoint}", deadline, checkpoint):
        described = describe(locate(checkpoint), allow_pickle)
    shown = Shown(keys or (), exclude or (), depth, expand, wide)
    if as_json:
        data = described.to_json()
        data["entries"] = [e.to_json() for e in select(described.entries, _path, shown.keys, shown.exclude)]
        views.print_json(data)
        return
    tables.print_described(described, shown)


# -- verify ----------------------------------------------------------------------------------------


@app.command("verify", cls=Command)
def verify_command(
    targets: Annotated[
        list[str],
        typer.Argument(
            metavar="TARGET",
            help="Checkpoints, or directories: every checkpoint of each.",
            show_default=False,
        ),
    ],
    name: Name = None,
    deadline: Deadline = DEADLINE,
) -> None:
    """Recompute every checksum; exit 1 if any fails.

    Each TARGET is a checkpoint (a file, a step directory, a trainer's checkpoint
    folder) or a directory of them (a manager's, or the trainer integrations'). A
    progress bar runs on stderr (on a terminal), and a failure names every entry that
    failed. The stored count and bytes are those inspect shows. Exit 1 if a checkpoint
    fails, 2 if a TARGET could not be read as one (it is said, and the others are
    still verified)."""
    todo: list[Verified] = []
    errors = 0
    with reaching(f"verifying {' '.join(targets)}", deadline, *targets):
        for target in targets:
            try:
                todo += verify_targets(target, name)
            except Exception as exc:
                if len(targets) == 1:
                    raise
                errors += 1
                _error(exc)
        failed, broken = verify_all(todo, _error)
    if len(targets) > 1 or any(not v.direct for v in todo):
        verdict = f"{failed} of {len(todo)} FAILED" if failed else "all verified"
        where = targets[0] if len(targets) == 1 else f"{len(targets)} targets"
        views.out().print(f"{len(todo)} checkpoint(s) in {where}: {verdict}")
    if errors or broken:
        raise typer.Exit(ERROR)
    if failed:
        raise typer.Exit(FAILED)


def _path(item: Any) -> tuple[object, ...]:
    return item.path  # type: ignore[no-any-return]


# -- diff ------------------------------------------------------------------------------------------


@app.command("diff", cls=Command)
def diff_command(
    a: Annotated[str, typer.Argument(metavar="A", help="The first checkpoint.")],
    b: Annotated[str, typer.Argument(metavar="B", help="The second checkpoint.")],
    atol: Annotated[
        float, typer.Option(help="Tensors whose values differ by at most this are 'close'.")
    ] = 0.0,
    show_all: Annotated[bool, typer.Option("--all", help="List equal entries too.")] = False,
    keys: Keys = None,
    exclude: Exclude = None,
    depth: Depth = None,
    expand: Expand = False,
    wide: Wide = False,
    as_json: Json = False,
    allow_pickle: AllowPickle = False,
    deadline: Deadline = DEADLINE,
) -> None:
    """Compare two checkpoints, of any formats convert reads. Exit 1 if they differ.

    Lists the entries added, removed and changed (tensors: max abs and relative
    difference), and counts the equal ones. A container of more than 8 plain values is
    one row unless --expand; --keys and --exclude choose what is compared (the exit
    code too), --depth folds what is deeper into one row per container."""
    with reaching(f"comparing {a} and {b}", deadline, a, b):
        left, _ = read_state(locate(a), allow_pickle)
        right, _ = read_state(locate(b), allow_pickle)
    shown = Shown(keys or (), exclude or (), depth, expand, wide)
    changes = select(diff(left, right, atol=atol), _path, shown.keys, shown.exclude)
    counts = {s: sum(c.status == s for c in changes) for s in get_args(Status)}
    if as_json:
        views.print_json({"a": a, "b": b, "counts": counts, "entries": [c.to_json() for c in changes]})
    else:
        tables.print_diff(changes, show_all, shown)
        views.out().print(", ".join(f"{n} {s}" for s, n in counts.items()))
    if counts["added"] or counts["removed"] or counts["changed"]:
        raise typer.Exit(FAILED)


# -- prune -----------------------------------------------------------------------------------------


class Mode(enum.StrEnum):
    min = "min"
    max = "max"


@app.command("prune", cls=Command)
def prune_command(
    directory: Annotated[
        str, typer.Argument(metavar="DIRECTORY", help="A checkpoint directory: path or URL.")
    ],
    keep_last: Annotated[int | None, typer.Option(help="Keep the newest N.", min=1)] = None,
    keep_every: Annotated[int | None, typer.Option(help="Keep steps that are multiples of N.", min=1)] = None,
    keep_best: Annotated[str | None, typer.Option(help="Keep the best by this metric.")] = None,
    best_mode: Annotated[
        Mode, typer.Option(help="min: lower is better (a loss); max: higher is (an accuracy).")
    ] = Mode.min,
    best_n: Annotated[int, typer.Option(help="How many best ones --keep-best keeps.", min=1)] = 1,
    keep_within: Annotated[
        str | None, typer.Option(help="Keep what was saved within this: 90s, 30m, 12h, 7d.")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would go; remove nothing, take no lock.")
    ] = False,
    name: Name = None,
    deadline: Deadline = DEADLINE,
) -> None:
    """Delete the checkpoints no retention policy keeps.

    As the directory's manager would after a save: a checkpoint goes unless a policy
    keeps it, and the newest always stays. Takes the directory's lock (and fails,
    saying so, while training holds it)."""
    policy = _policy(keep_last, keep_every, keep_best, best_mode, best_n, keep_within)
    with reaching(f"pruning {directory}", deadline, directory):
        gone, kept = run(functools.partial(prune, directory, name, policy, dry_run=dry_run))
    views.print_pruned(gone, kept, dry_run)


def _policy(
    last: int | None, every: int | None, best: str | None, mode: Mode, best_n: int, within: str | None
) -> RetentionPolicy:
    policies: list[RetentionPolicy] = []
    if last is not None:
        policies.append(KeepLast(last))
    if every is not None:
        policies.append(KeepEvery(every))
    if best is not None:
        policies.append(KeepBest(best, "min" if mode is Mode.min else "max", best_n))
    if within is not None:
        policies.append(KeepWithin(parse_duration(within)))
    if not policies:
        raise ValueError("say what to keep: --keep-last, --keep-every, --keep-best or --keep-within")
    return policies[0] if len(policies) == 1 else AnyPolicy(*policies)


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``12h``, ``7d`` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    unit = text[-1:].lower()
    try:
        return float(text[:-1] if unit in units else text) * units.get(unit, 1)
    except ValueError:
        raise ValueError(f"--keep-within {text!r} is not a duration (90s, 30m, 12h, 7d)") from None


# -- convert ---------------------------------------------------------------------------------------


class Target(enum.StrEnum):
    aiosnap = "aiosnap"
    safetensors = "safetensors"
    torch = "torch"
    dcp = "dcp"


@app.command("convert", cls=Command)
def convert_command(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC", help="torch.save file, aiosnap file or step directory, safetensors, DCP."
        ),
    ],
    dst: Annotated[str, typer.Argument(metavar="DST", help="Where to write (a file; a directory for DCP).")],
    to: Annotated[
        Target | None,
        typer.Option(
            help="The output format. By default the one DST's extension names (.pt, .pth, .bin: torch; "
            ".safetensors), else aiosnap; an extension naming another format than --to is refused."
        ),
    ] = None,
    allow_pickle: AllowPickle = False,
    force: Annotated[bool, typer.Option("--force", help="Replace DST if it exists.")] = False,
    standalone: Annotated[
        bool,
        typer.Option(
            "--standalone",
            help="Copy an aiosnap file with the blobs it refers to (an incremental save's) stored in it.",
        ),
    ] = False,
    deadline: Deadline = DEADLINE,
) -> None:
    """Convert between aiosnap, safetensors, torch.save and torch.distributed.checkpoint.

    A step directory becomes one file. Safetensors output keeps the tree and the plain
    values in its metadata, so a round trip through it loses nothing; torch output is
    torch.save's own format."""
    with reaching(f"converting {src} to {dst}", deadline, src, dst):
        done = convert(
            src,
            dst,
            None if to is None else to.value,
            allow_pickle=allow_pickle,
            force=force,
            standalone=standalone,
        )
    views.out().print(
        f"{src} ({done.source}) -> {dst} ({done.target}): {done.tensors} tensor(s), {views.human(done.bytes)}"
    )
    for note in done.notes:
        views.err().print(f"note: {note}")


# -- bench -----------------------------------------------------------------------------------------


@app.command("bench", cls=Command)
def bench_command(
    directory: Annotated[
        str, typer.Option("--dir", help="Where checkpoints would go (a local directory).")
    ] = ".",
    size: Annotated[str, typer.Option(help="The state to save: 256MiB, 1GiB ...")] = "256MiB",
    reps: Annotated[int, typer.Option(help="Runs of each method (the median is shown).", min=1)] = 3,
    as_json: Json = False,
) -> None:
    """Measure a disk: aiosnap's save and load beside torch's and the disk's own speed.

    Write + fsync and a cold read, torch.save and torch.load, aiosnap's one-call save,
    an open QueueWriter and a cold load, on a state of --size."""
    bench = Bench(directory, parse_size(size), reps)
    methods = len(bench.methods())
    with views.progress(views.err(), bytes_=False) as bar:
        task = bar.add_task("measuring", total=reps * methods)
        results = bench.run(lambda name: bar.update(task, advance=1, description=name))
    if as_json:
        rows = [{"method": m.name, "phase": m.phase, "stall_s": m.stall, "total_s": m.total} for m in results]
        views.print_json(
            {"dir": os.path.abspath(directory), "bytes": bench.nbytes, "reps": reps, "results": rows}
        )
        return
    views.print_bench(results, bench.nbytes, directory)


# -- the entry point -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command of the command line and return its exit code (the console script
    exits with it). An error is said in one line on stderr, not raised; the process's
    logging and warning settings are as they were afterwards.

    Args:
        argv: The arguments after ``aiosnap``, e.g. ``["ls", "ckpts", "--json"]``; None reads
            ``sys.argv[1:]``, as the console script does.

    Returns:
        0 done, nothing wrong found; 1 a check found a problem (``verify``: a checkpoint
        that fails; ``diff``: a difference); 2 the command could not do what was asked (a
        usage error, a missing path, no checkpoints found, an unreadable input, a store
        that cannot be reached); 130 interrupted.
    """
    try:
        with _diagnostics():
            rv = app(args=argv, prog_name="aiosnap", standalone_mode=False)
    except _CLICK_ERROR as exc:  # a usage error: click says it, with the usage
        exc.show()
        return int(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.stderr.write("aiosnap: interrupted\n")
        return 130
    except Exception as exc:
        return _error(exc)
    return rv if isinstance(rv, int) else OK


def _error(exc: BaseException) -> int:
    """Say what went wrong in one line."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    message = str(exc) or type(exc).__name__
    if not isinstance(exc, (CheckpointError, OSError, ValueError, ImportError)):
        message = f"{type(exc).__name__}: {message}"  # a bug of ours, most likely
    sys.stderr.write(f"aiosnap: error: {views.one_line(message)}\n")
    if os.environ.get("AIOSNAP_DEBUG"):
        traceback.print_exception(exc)
    return ERROR


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"aiosnap: {record.levelname.lower()}: {views.one_line(record.getMessage())}"


@contextlib.contextmanager
def _diagnostics() -> Iterator[None]:
    """While a command runs, warnings and the library's log records (WARNING and up) are
    one line each on stderr; the process's own settings come back afterwards."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("aiosnap")
    saved = warnings.formatwarning
    warnings.formatwarning = lambda message, *_: f"aiosnap: warning: {views.one_line(str(message))}\n"
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        warnings.formatwarning = saved
