"""Run Lightning's own CheckpointIO and ModelCheckpoint tests with AiosnapCheckpointIO
standing in for Lightning's default plugin (``lightning_substitute``).

    python tests/peers/run_lightning_tests.py LIGHTNING_SRC [--sync] [-- PYTEST_ARGS...]

LIGHTNING_SRC is a checkout of github.com/Lightning-AI/pytorch-lightning at the tag of the
installed version (``git clone --branch 2.6.5 ...``). The tests need ``cloudpickle`` and
``jsonargparse`` besides Lightning (``tensorboard`` for four of them). ``--sync`` makes
each save return once durable, setting aside the deliberate difference that a save returns
before its file exists. What remains, and why, is in docs/integration-lightning.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = [
    "plugins/test_checkpoint_io_plugin.py",
    "plugins/test_async_checkpoint.py",
    "checkpointing/test_model_checkpoint.py",
]
INI = """[pytest]
addopts = -p no:cacheprovider -p no:asyncio --disable-pytest-warnings
markers =
    cloud: cloud
    flaky: flaky
filterwarnings =
    error::FutureWarning
    ignore:You are using `torch.load` with `weights_only=False`.*:FutureWarning
    ignore::FutureWarning:torch.distributed.algorithms.ddp_comm_hooks
    ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated.*:FutureWarning
"""


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("lightning", type=Path, help="a checkout of Lightning's repository")
    parser.add_argument("--sync", action="store_true", help="each save returns once durable")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    source = args.lightning / "tests" / "tests_pytorch"
    with tempfile.TemporaryDirectory(prefix="aiosnap-lightning-tests-") as tmp:
        tests = Path(tmp) / "tests" / "tests_pytorch"
        shutil.copytree(source / "helpers", tests / "helpers")
        packages = ["__init__.py", "conftest.py", "plugins/__init__.py", "checkpointing/__init__.py"]
        for name in [*packages, *FILES]:
            (tests / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / name, tests / name)
        (Path(tmp) / "pytest.ini").write_text(INI)
        env = {**os.environ, "AIOSNAP_TORCH_LOAD": "1", "AIOSNAP_SYNC_SAVES": "1" if args.sync else "0"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
        command = [sys.executable, "-m", "pytest", "-c", str(Path(tmp) / "pytest.ini"), "--rootdir", tmp]
        command += ["-p", "tests.peers.lightning_substitute", "-q", "-rfE", *FILES, *args.pytest_args]
        return subprocess.run(command, cwd=tests, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
