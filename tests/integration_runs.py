"""Training runs in child processes for the integration tests (tests/test_integration_*.py).

A child is a training function of a test module, run with ``python -c``; it reports on
stdout, one line each, every step's loss (as ``float.hex``: compared bit for bit), every
save call that returned and the step it resumed from. The parent SIGKILLs it once it has
read the report of the save chosen for the run: the kill lands right after a save call
returned, while its commit may still be in flight, on any machine, without a clock.

A child that calls ``pause_at_file_ops(root)`` also reports each rename, fsync, directory
fsync, unlink and rmdir aiosnap is about to make under ``root``, and waits for the
parent's answer before making it: the parent SIGKILLs it there (``kill_before``), so a
kill lands before exactly the system call chosen, every time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosnap

ROOT = Path(__file__).resolve().parent.parent
MARK = "@aiosnap-test "


#: Set for a ``Child``: after each ``saved`` report it waits for the parent's answer, which
#: is a go-ahead or a SIGKILL, so a kill after a save lands before anything else happens.
HOLD_SAVES = "AIOSNAP_TEST_HOLD_SAVES"


def report(kind: str, *values: object) -> None:
    """From a child: one line for the parent (``loss STEP HEX``, ``saved WHAT``, ``resumed STEP``...)."""
    sys.stdout.write("\n" + MARK + " ".join([kind, *map(str, values)]) + "\n")  # one write: see pause
    sys.stdout.flush()
    if kind == "saved" and os.environ.get(HOLD_SAVES) and not sys.stdin.readline():
        os._exit(3)  # the parent is gone: make nothing more


def loss(step: int, value: float) -> None:
    report("loss", step, float(value).hex())


Op = tuple[str, str, str]
"""A system call a paused child was about to make: (kind, path, a rename's source or "")."""


def pause_at_file_ops(root: str) -> None:
    """From a child: before each rename, fsync, directory fsync, unlink and rmdir that any
    ``aiosnap.storage.Posix`` makes under ``root`` from now on, report it (``op``) and
    wait for the parent's go-ahead on stdin."""
    from aiosnap.storage import Posix

    lock = threading.Lock()  # one call reported and answered at a time
    paths: dict[int, str] = {}
    root = os.path.abspath(root)

    def pause(kind: str, path: str, source: str = "") -> None:
        if path == root or path.startswith(root + os.sep):
            with lock:
                # One write, on a line of its own: print() writes its text and its newline
                # apart, so another thread's print (a Trainer's logs) could end up around
                # this report, which the parent would then not see -- and never answer.
                sys.stdout.write("\n" + MARK + "op " + json.dumps([kind, path, source]) + "\n")
                sys.stdout.flush()
                if not sys.stdin.readline():
                    os._exit(3)  # the parent is gone: make nothing more

    def hooked(method: Callable[..., Any], kind: str, where: Callable[..., tuple[str, str]]) -> Any:
        def call(self: Posix, *args: Any) -> Any:
            pause(kind, *where(*args))
            return method(self, *args)

        return call

    original_open, original_close = Posix.open, Posix.close

    def open_(self: Posix, path: str, flags: int, mode: int = 0o644) -> int:
        fd = original_open(self, path, flags, mode)
        paths[fd] = os.path.abspath(path)
        return fd

    def close(self: Posix, fd: int) -> None:
        paths.pop(fd, None)
        original_close(self, fd)

    Posix.open = open_  # type: ignore[method-assign]
    Posix.close = close  # type: ignore[method-assign]
    Posix.fsync = hooked(Posix.fsync, "fsync", lambda fd: (paths.get(fd, ""), ""))  # type: ignore[method-assign]
    Posix.rename = hooked(Posix.rename, "rename", lambda src, dst: (os.path.abspath(dst), src))  # type: ignore[method-assign]
    Posix.fsync_dir = hooked(Posix.fsync_dir, "dirsync", lambda p: (os.path.abspath(p), ""))  # type: ignore[method-assign]
    Posix.unlink = hooked(Posix.unlink, "unlink", lambda p: (os.path.abspath(p), ""))  # type: ignore[method-assign]
    Posix.rmdir = hooked(Posix.rmdir, "rmdir", lambda p: (os.path.abspath(p), ""))  # type: ignore[method-assign]


@dataclass
class Run:
    """What a child reported."""

    losses: dict[int, str] = field(default_factory=dict)
    saves: list[str] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    other: dict[str, list[str]] = field(default_factory=dict)
    killed: bool = False


class Child:
    """A child running ``module.function(*args)``, started at once; its stdin is a pipe
    from the parent, which answers each ``saved`` report (``HOLD_SAVES``) and, where the
    child calls ``pause_at_file_ops``, each file operation."""

    def __init__(self, function: str, *args: object, log: Path) -> None:
        module, name = function.rsplit(".", 1)
        code = f"import sys; from {module} import {name}; {name}(*sys.argv[1:])"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}
        env[HOLD_SAVES] = "1"
        self.log = log
        self._stderr = open(log, "w")  # noqa: SIM115 - closed in finish()
        # A session of its own: the kill takes any process it started too.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *map(str, args)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )

    def finish(
        self, *, kill_after_save: int | None = None, kill_before: Callable[[list[Op]], bool] | None = None
    ) -> Run:
        """Read the child's reports until it exits, or until its ``kill_after_save``-th
        save call returned (the child waits for the answer: it is killed right there), or
        until ``kill_before(ops)`` is true of the calls it reported (the last one about to
        be made): then SIGKILL it."""
        run = Run()
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                if not line.startswith(MARK):
                    continue
                kind, *values = line[len(MARK) :].split()
                if kind == "op":
                    op, path, source = json.loads(line[len(MARK) + len("op ") :])
                    run.ops.append((op, path, source))
                    if kill_before is not None and kill_before(run.ops):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                        run.killed = True
                        break
                    self._go()
                elif kind == "loss":
                    run.losses[int(values[0])] = values[1]
                elif kind == "saved":
                    run.saves.append(" ".join(values))
                    if len(run.saves) == kill_after_save:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                        run.killed = True
                        break
                    self._go()
                else:
                    run.other.setdefault(kind, []).extend(values)
        finally:
            self.proc.stdout.close()
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait()
            self._stderr.close()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything that outlived it
            except ProcessLookupError:
                pass
        if not run.killed:
            assert self.proc.returncode == 0, f"the run failed:\n{self.log.read_text()[-6000:]}"
        return run

    def _go(self) -> None:
        """Let the child go on past what it reported and waits on."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


@dataclass
class Killed:
    """One run of ``kill_points``: its folder, and the calls it made (``made``) before the
    one it was killed before (``at``; None for the run left to finish)."""

    case: Path
    made: list[Op]
    at: Op | None

    def renamed_into(self, final: Path) -> bool:
        """Whether a folder was renamed to ``final`` (the new checkpoint put in place)."""
        return any(kind == "rename" and path == str(final) for kind, path, _ in self.made)


#: The kill points of a publish that replaces ``final``, by name: before the old folder is
#: moved aside, between that rename and the one that puts the new in place, and right after.
POINTS = ("aside", "between", "after")


def _named(point: str, final: str) -> Callable[[list[Op]], bool]:
    def at(ops: list[Op]) -> bool:
        kind, path, source = ops[-1]
        if point == "aside":
            return kind == "rename" and source == final
        if point == "between":
            return kind == "rename" and path == final
        return len(ops) > 1 and ops[-2][:2] == ("rename", final)

    return at


def kill_points(
    function: str, cases: Path, final: str, point: str, prepare: Callable[[Path], list[object]]
) -> Iterator[Killed]:
    """Run ``function(*prepare(case))`` in a paused child in a fresh folder ``case`` under
    ``cases``, killed at ``point`` (one of POINTS, about the folder ``case / final``); or,
    for ``point="every"``, once to the end and then once killed before each call that run
    made. Yields each run, once it is over."""
    cases.mkdir(parents=True, exist_ok=True)

    def run(name: str, kill: Callable[[list[Op]], bool] | None) -> Killed:
        case = cases / name
        child = Child(function, *prepare(case), log=cases / f"{name}.log")
        done = child.finish(kill_before=kill)
        if not done.killed:
            return Killed(case, done.ops, None)
        return Killed(case, done.ops[:-1], done.ops[-1])

    if point != "every":
        killed = run(point, _named(point, str(cases / point / final)))
        assert killed.at is not None, f"the run never reached the point {point!r}: {killed.made}"
        yield killed
        return
    whole = run("whole", None)
    yield whole
    for n in range(1, len(whole.made) + 1):
        yield run(f"kill{n}", lambda ops, n=n: len(ops) == n)


def assert_resumed_exactly(reference: Run, resumed: Run, last_step: int) -> int:
    """The resumed run trained every step after the one it resumed from, each with the
    reference run's loss, bit for bit; return that step."""
    start = int(resumed.other["resumed"][0])
    steps = sorted(resumed.losses)
    assert steps == list(range(start + 1, last_step + 1)) or steps == list(range(start, last_step)), steps
    for step in steps:
        assert resumed.losses[step] == reference.losses[step], f"step {step} differs after the resume"
    return start


def assert_aiosnap_checkpoint(path: Path) -> None:
    """``path`` is an aiosnap file (a safetensors file has no checksums), its checksums
    hold, and it loads without unpickling."""
    report = aiosnap.verify_sync(str(path))  # NotACheckpointError for any other format
    assert report.checksummed and report.tensors > 0, f"{path} is not an aiosnap checkpoint"
    aiosnap.load_sync(str(path))  # allow_pickle=False: raises if anything is pickled


def temp_entries(directory: Path) -> list[str]:
    """Temp files or directories of commits, anywhere under ``directory``."""
    return [
        os.path.join(root, name)
        for root, dirs, files in os.walk(directory)
        for name in [*dirs, *files]
        if name.startswith(aiosnap.storage.TEMP_PREFIX)
    ]


# -- jobs of several ranks (torch.distributed, gloo on 127.0.0.1) ------------------------------


def rank_loss(step: int, value: float) -> None:
    """From a rank of a ``RankJob``: its loss of ``step`` (``loss RANK STEP HEX``)."""
    report("loss", os.environ["RANK"], step, float(value).hex())


def rank_report(kind: str, *values: object) -> None:
    """From a rank of a ``RankJob``: ``kind RANK VALUES...`` (``resumed``, ``raised``...)."""
    report(kind, os.environ["RANK"], *values)


@dataclass
class RankRun:
    """What the ranks of a job reported: per rank, its losses and its other reports;
    ``saves``, every ``saved`` line of any rank, in the order they came."""

    losses: dict[int, dict[int, str]] = field(default_factory=dict)
    reports: dict[int, dict[str, list[str]]] = field(default_factory=dict)
    saves: list[str] = field(default_factory=list)
    killed: bool = False
    returncodes: list[int] = field(default_factory=list)

    def of(self, rank: int, kind: str) -> list[str]:
        return self.reports.get(rank, {}).get(kind, [])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


#: Seconds a job of ranks may stay silent before the test fails (a hang, not a timing).
JOB_CAP = 600


class RankJob:
    """A torch.distributed job: ``ranks`` children each running ``module.function(*args)``
    with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
    127.0.0.1, a free ``MASTER_PORT``), started at once, all in one process group of
    their own (in this session: a process may only join a group of its own session),
    so that one SIGKILL takes the whole job at the same instant (torchrun puts
    each worker in a session of its own: killing it would orphan them)."""

    def __init__(self, function: str, *args: object, ranks: int, log: Path) -> None:
        import queue

        module, name = function.rsplit(".", 1)
        code = f"import sys; from {module} import {name}; {name}(*sys.argv[1:])"
        base = {
            **os.environ,
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",  # 2 cores for all the ranks: no thread pools fighting
            "HF_HUB_OFFLINE": "1",  # nothing leaves the machine (transformers, accelerate)
            "TRANSFORMERS_OFFLINE": "1",
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "GROUP_RANK": "0",  # with TORCHELASTIC_RUN_ID: what Lightning takes for a torchrun job
            "TORCHELASTIC_RUN_ID": "aiosnap-test",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        }
        self.logs = [log.with_name(f"{log.stem}.rank{r}.log") for r in range(ranks)]
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for r in range(ranks):
                with open(self.logs[r], "w") as stderr:
                    group = {"process_group": 0 if r == 0 else self.procs[0].pid}
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, "-c", code, *map(str, args)],
                            cwd=ROOT,
                            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                            stdout=subprocess.PIPE,
                            stderr=stderr,
                            text=True,
                            **group,  # type: ignore[arg-type]
                        )
                    )
                threading.Thread(target=self._read, args=(r,), daemon=True).start()
        except BaseException:
            if self.procs:  # the ranks started so far would wait for the others forever
                os.killpg(self.procs[0].pid, signal.SIGKILL)
            raise

    def _read(self, r: int) -> None:
        stdout = self.procs[r].stdout
        assert stdout is not None
        for line in stdout:
            self._lines.put(line)
        self._lines.put(None)

    def finish(self, *, kill_after_save: int | None = None, check: bool = True) -> RankRun:
        """Read every rank's reports until all exit, or until the ``kill_after_save``-th
        ``saved`` line of any rank: then SIGKILL the whole job. ``check``: every rank
        must have exited with 0 (unless killed)."""
        run = RankRun()
        open_streams = len(self.procs)
        try:
            while open_streams:
                # A cap, not a timing: a job that hangs fails the test instead of stalling it.
                line = self._lines.get(timeout=JOB_CAP)
                if line is None:
                    open_streams -= 1
                    continue
                if not line.startswith(MARK):
                    continue
                kind, *values = line[len(MARK) :].split()
                if kind == "saved":
                    run.saves.append(" ".join(values))
                    if len(run.saves) == kill_after_save:
                        os.killpg(self.procs[0].pid, signal.SIGKILL)
                        run.killed = True
                        break
                elif kind == "loss":
                    run.losses.setdefault(int(values[0]), {})[int(values[1])] = values[2]
                else:
                    run.reports.setdefault(int(values[0]), {}).setdefault(kind, []).extend(values[1:])
        finally:
            for proc in self.procs:
                proc.wait()
            try:
                os.killpg(self.procs[0].pid, signal.SIGKILL)  # anything that outlived them
            except ProcessLookupError:
                pass
        run.returncodes = [proc.returncode for proc in self.procs]
        if check and not run.killed:
            for log, code in zip(self.logs, run.returncodes, strict=True):
                assert code == 0, f"a rank failed ({code}):\n{log.read_text()[-6000:]}"
        return run


def run_torchrun_example(script: str, out: Path, *args: str) -> str:
    """Run ``examples/<script>`` under torchrun on 2 CPU processes, as its docs page says,
    with ``--out out`` and ``args``; its stdout (it must exit 0)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*command, str(ROOT / "examples" / script), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=JOB_CAP,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def printed_losses(stdout: str, unit: str = "step") -> dict[tuple[int, int], str]:
    """Each rank's loss per ``unit`` (step, iteration) as a docs example prints it
    (``rank R UNIT N: loss X``), found anywhere in the output, where two ranks' lines may
    have come out glued together."""
    found = re.findall(rf"rank (\d+) {unit} (\d+): loss (-?\d+\.\d{{6}})", stdout)
    return {(int(rank), int(at)): value for rank, at, value in found}


def sum_in_rank_order(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads real annotations
    """A DDP communication hook: the bucket's mean over the ranks, summed in rank order.
    DDP rebuilds its buckets after a process's first step, and a ring allreduce over more
    than 2 ranks sums each element in an order that depends on where the bucket put it: a
    resumed process's first step then sums in another order than the uninterrupted run's
    at that step (a last-bit difference; state restored bit for bit: checked at 4 ranks).
    Gathering and summing in rank order makes the run the same across a restart. (No
    annotations: DDP checks them as objects, which ``from __future__ import annotations``
    turns into strings.)"""
    import torch
    import torch.distributed as dist

    grads = bucket.buffer()
    parts = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, grads)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    future = torch.futures.Future()  # type: ignore[var-annotated]
    future.set_result(total.div_(len(parts)))
    return future


def assert_ranks_resumed_exactly(reference: RankRun, resumed: RankRun, last_step: int) -> int:
    """Every rank resumed from the same step and trained every step after it with the
    reference run's loss of that rank, bit for bit; return that step."""
    starts = {int(resumed.of(r, "resumed")[0]) for r in reference.losses}
    assert len(starts) == 1, f"the ranks resumed from different steps: {starts}"
    start = starts.pop()
    assert sorted(resumed.losses) == sorted(reference.losses)
    for rank, losses in resumed.losses.items():
        assert sorted(losses) == list(range(start + 1, last_step + 1)), (rank, sorted(losses))
        for step, value in losses.items():
            assert value == reference.losses[rank][step], f"rank {rank}, step {step} differs after the resume"
    return start
