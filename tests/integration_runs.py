"""Training runs in child processes for the integration tests (tests/test_integration_*.py).

A child is a training function of a test module, run with ``python -c``; it reports on
stdout, one line each, every step's loss (as ``float.hex``: compared bit for bit), every
save call that returned and the step it resumed from. The parent SIGKILLs it once it has
read the report of the save chosen for the run: the kill lands right after a save call
returned, while its commit may still be in flight, on any machine, without a clock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiosnap

ROOT = Path(__file__).resolve().parent.parent
MARK = "@aiosnap-test "


def report(kind: str, *values: object) -> None:
    """From a child: one line for the parent (``loss STEP HEX``, ``saved WHAT``, ``resumed STEP``...)."""
    print(MARK + kind, *values, flush=True)


def loss(step: int, value: float) -> None:
    report("loss", step, float(value).hex())


@dataclass
class Run:
    """What a child reported."""

    losses: dict[int, str] = field(default_factory=dict)
    saves: list[str] = field(default_factory=list)
    other: dict[str, list[str]] = field(default_factory=dict)
    killed: bool = False


class Child:
    """A child running ``module.function(*args)``, started at once."""

    def __init__(self, function: str, *args: object, log: Path) -> None:
        module, name = function.rsplit(".", 1)
        code = f"import sys; from {module} import {name}; {name}(*sys.argv[1:])"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}
        self.log = log
        self._stderr = open(log, "w")  # noqa: SIM115 - closed in finish()
        # A session of its own: the kill takes any process it started too.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *map(str, args)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )

    def finish(self, *, kill_after_save: int | None = None) -> Run:
        """Read the child's reports until it exits, or until its ``kill_after_save``-th
        save call returned: then SIGKILL it."""
        run = Run()
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                if not line.startswith(MARK):
                    continue
                kind, *values = line[len(MARK) :].split()
                if kind == "loss":
                    run.losses[int(values[0])] = values[1]
                elif kind == "saved":
                    run.saves.append(" ".join(values))
                    if len(run.saves) == kill_after_save:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                        run.killed = True
                        break
                else:
                    run.other.setdefault(kind, []).extend(values)
        finally:
            self.proc.stdout.close()
            self.proc.wait()
            self._stderr.close()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything that outlived it
            except ProcessLookupError:
                pass
        if not run.killed:
            assert self.proc.returncode == 0, f"the run failed:\n{self.log.read_text()[-6000:]}"
        return run


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
        if name.startswith(aiosnap.TEMP_PREFIX)
    ]
