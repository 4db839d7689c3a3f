"""The save call of ppe's ``snapshot(saver_rank=0)``, of Lightning's ``strategy="ddp"`` and of
Lightning's FSDP2 ``ModelParallelStrategy`` in a multi-process run: aiosnap's integration,
the framework's default, and a durable torch.save from rank 0, per rank, in one run.

    python benchmarks/bench_ranks_ppe_lightning.py [--ranks 2] [--size 200MiB] [--reps 5] [--only ppe]

Each rank holds the same DDP model plus its AdamW state, ``--size`` in all, after one step.
The save call is timed on every rank as training sees it, from the call to its return:
ppe's snapshot extension called on the manager (the saver writes, every rank waits at the
end: ppe's barrier, aiosnap's agreement), Lightning's ``Trainer.save_checkpoint`` (rank 0
writes; Lightning's barrier). The durable torch.save is rank 0's ``torch.save`` then
``fsync``, then a barrier: a save that is on disk when every rank's call returns. Medians
of ``--reps``, the methods' order rotating; before each, every save is durable and
``os.sync()`` ran. Results: ``benchmarks/results/ranks_ppe_lightning.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import machine, parse_size
from bench_integrations import AIOSNAP, DEFAULT, DURABLE, mlp, stepped

ROOT = Path(__file__).resolve().parent
MARK = "@bench "
#: Per framework: each method's (timed save, untimed wait until durable on every rank).
Methods = dict[str, tuple[Callable[[int], None], Callable[[], None]]]


def _durable(model: Any, optimizer: Any, directory: Path) -> tuple[Callable[[int], None], Callable[[], None]]:
    import torch.distributed as dist

    def save(rep: int) -> None:
        if dist.get_rank() == 0:
            path = directory / "torch.pt"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        dist.barrier()

    return save, lambda: None


def ppe_methods(size: int, scratch: Path) -> Methods:
    import pytorch_pfn_extras as ppe
    import torch.distributed as dist
    from pytorch_pfn_extras.training import extensions

    from aiosnap.integrations.ppe import Writer, snapshot

    model = torch.nn.parallel.DistributedDataParallel(mlp(size))
    optimizer = stepped(model)

    def run(directory: Path, extension: Any, writer: Any) -> tuple[Callable[[int], None], Callable[[], None]]:
        manager = ppe.training.ExtensionsManager(
            model, optimizer, 1, iters_per_epoch=1, out_dir=str(directory)
        )
        extension.initialize(manager)

        def durable() -> None:
            if writer is not None and dist.get_rank() == 0:
                writer.flush()
            dist.barrier()

        return (lambda rep: extension(manager)), durable

    ours = Writer(str(scratch / "ppe-aiosnap"))
    theirs = ppe.writing.SimpleWriter(out_dir=str(scratch / "ppe-default"))
    return {
        AIOSNAP: run(scratch / "ppe-aiosnap", snapshot(writer=ours, saver_rank=0), ours),
        DEFAULT: run(scratch / "ppe-default", extensions.snapshot(writer=theirs, saver_rank=0), None),
        DURABLE: _durable(model, optimizer, scratch),
    }


def lightning_methods(size: int, scratch: Path) -> Methods:
    import lightning as L
    import torch.distributed as dist

    from aiosnap.integrations.lightning import AiosnapCheckpointIO

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(size)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def trainer(plugins: list[Any]) -> Any:
        made = L.Trainer(
            accelerator="cpu", strategy="ddp", devices=dist.get_world_size() if dist.is_initialized() else 2,
            max_steps=1, plugins=plugins, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        width = mlp(size)[0].in_features
        data = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(8, width)), batch_size=4
        )
        made.fit(Module(), data)  # attaches the model; the optimizer's state is allocated
        return made

    ours = trainer([AiosnapCheckpointIO()])
    plugin = ours.strategy.checkpoint_io
    theirs = trainer([])

    def durable() -> None:
        if dist.get_rank() == 0:
            plugin.flush()
        dist.barrier()

    module = theirs.lightning_module
    return {
        AIOSNAP: (lambda rep: ours.save_checkpoint(scratch / f"ours-{rep}.ckpt"), durable),
        DEFAULT: (lambda rep: theirs.save_checkpoint(scratch / f"theirs-{rep}.ckpt"), dist.barrier),
        DURABLE: _durable(module, theirs.optimizers[0], scratch),
    }


def lightning_fsdp_methods(size: int, scratch: Path) -> Methods:
    """FSDP2 (``ModelParallelStrategy``): each rank holds its shards, ``size`` in all over the
    ranks. The framework's default, DCP's synchronous save (``FileSystemWriter``, which
    fsyncs), is durable when it returns: it is also the durable baseline."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from aiosnap.integrations.lightning import AiosnapModelParallelStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(size)

        def configure_model(self) -> None:
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def trainer(kind: type[Any]) -> Any:
        world = dist.get_world_size()
        made = L.Trainer(
            accelerator="cpu", strategy=kind(data_parallel_size=world, tensor_parallel_size=1), devices=world,
            max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        width = mlp(size)[0].in_features
        data = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(8, width)), batch_size=4
        )
        made.fit(Module(), data)
        return made

    ours, theirs = trainer(AiosnapModelParallelStrategy), trainer(ModelParallelStrategy)
    ours.strategy.setup_environment()  # fit's teardown released the strategy's save group

    def durable() -> None:
        ours.strategy.settle()
        dist.barrier()

    return {
        AIOSNAP: (lambda rep: ours.save_checkpoint(scratch / f"ours-{rep}.ckpt"), durable),
        DEFAULT: (lambda rep: theirs.save_checkpoint(scratch / f"theirs-{rep}.ckpt"), dist.barrier),
    }


FRAMEWORKS = {"ppe": ppe_methods, "lightning": lightning_methods, "lightning_fsdp": lightning_fsdp_methods}


def worker(framework: str, size: int, reps: int, scratch: str) -> None:
    """One rank: time each method's save call; print its times (seconds) for the parent."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    directory = Path(scratch) / framework
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    methods = FRAMEWORKS[framework](size, directory)
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            save, durable = methods[name]
            os.sync()
            dist.barrier()
            start = time.perf_counter()
            save(rep)
            times[name].append(time.perf_counter() - start)
            durable()
    print(MARK + json.dumps({"framework": framework, "rank": rank, "times": times}), flush=True)


def run(framework: str, ranks: int, size: int, reps: int, scratch: str) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    args = [__file__, "--worker", framework, "--size", str(size), "--reps", str(reps), "--dir", scratch]
    done = subprocess.run([*command, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-4000:])
    return [json.loads(line[len(MARK) :]) for line in done.stdout.splitlines() if line.startswith(MARK)]


def table(rows: list[dict[str, Any]], size: int, ranks: int) -> str:
    info = machine()
    lines = [
        f"Machine: {', '.join(f'{k} {v}' for k, v in info.items())}; {ranks} ranks (gloo), "
        f"{size / 2**20:.0f} MiB of model + AdamW state per rank",
        "",
        "| framework | rank | aiosnap (s) | framework default (s) | durable torch.save (s) "
        "| aiosnap / durable |",
        "|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["framework"], r["rank"])):
        m = {name: statistics.median(values) for name, values in row["times"].items()}
        durable = m.get(DURABLE, m[DEFAULT])  # FSDP2: the default is durable (see lightning_fsdp_methods)
        lines.append(
            f"| {row['framework']} | {row['rank']} | {m[AIOSNAP]:.3f} | {m[DEFAULT]:.3f} "
            f"| {f'{m[DURABLE]:.3f}' if DURABLE in m else 'the default'} | {m[AIOSNAP] / durable:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", default="200MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", default="ppe,lightning,lightning_fsdp")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    size = parse_size(args.size)
    if args.worker:
        worker(args.worker, size, args.reps, args.dir)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        rows = [
            row for name in args.only.split(",") for row in run(name, args.ranks, size, args.reps, scratch)
        ]
    text = table(rows, size, args.ranks)
    print(text)
    results = Path(args.out)
    results.mkdir(parents=True, exist_ok=True)
    (results / "ranks_ppe_lightning.md").write_text(text + "\n")
    (results / "ranks_ppe_lightning.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
