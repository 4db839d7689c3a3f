"""The figures of the migration guides (docs/from-*.md), measured in one run on one state.

    python benchmarks/migration.py [--reps 5] [--dir DIR]

The state is a BERT-shaped classifier (transformers' BertForSequenceClassification with a
small config, built locally: nothing is downloaded) and its AdamW state after one step,
about 170 MB. Each method saves it the way its users do, in a rotating order, --reps times;
the medians are printed. "waits" is how long the training loop is held by a save call,
"durable" how long until the checkpoint is on disk (fsynced), "-" where the method never
fsyncs. Methods whose package is missing are skipped (pip install lightning transformers).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

import aiosnap

Result = tuple[float, float | None]  # (the loop waits, call -> durable); None: never durable
Method = Callable[[], Result | Awaitable[Result]]


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=8000, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536
    )
    return BertForSequenceClassification(config)


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ids = torch.randint(0, 8000, (2, 16))
    loss = model(input_ids=ids, labels=torch.tensor([0, 1])).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Methods:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.model = bert()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        one_step(self.model, self.optimizer)
        self.state = {"model": self.model, "optimizer": self.optimizer, "step": 1}
        self.n = 0
        self.manager: aiosnap.CheckpointManager | None = None
        self.lightning: Any = None
        self.hf: Any = None

    def fresh(self, name: str) -> Path:
        self.n += 1
        return self.dir / f"{name}-{self.n}"

    def nbytes(self) -> int:
        model = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        adam = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        return model + adam

    # -- torch.save ---------------------------------------------------------------------------

    def torch_save(self) -> Result:
        path = self.fresh("torch") / "ckpt.pt"
        path.parent.mkdir()
        t0 = time.perf_counter()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, path)
        return time.perf_counter() - t0, None

    def torch_save_fsync(self) -> Result:
        path = self.fresh("torchf") / "ckpt.pt"
        path.parent.mkdir()
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        took = time.perf_counter() - t0
        return took, took

    # -- aiosnap: an open manager, as a training loop keeps one ---------------------------------

    async def aiosnap(self) -> Result:
        assert self.manager is not None
        self.n += 1
        t0 = time.perf_counter()
        handle = await self.manager.save(self.n, self.state)
        waits = time.perf_counter() - t0
        await handle.wait()
        return waits, time.perf_counter() - t0

    async def aiosnap_save_sync(self) -> Result:
        """The blocking twin, as a synchronous callback calls it (a writer per call): in a
        thread here, since this event loop runs and a twin refuses to run inside one."""
        t0 = time.perf_counter()
        await asyncio.to_thread(aiosnap.save_sync, str(self.fresh("sync")), self.state)
        took = time.perf_counter() - t0
        return took, took

    # -- torch.distributed.checkpoint --------------------------------------------------------------

    def dcp_save(self) -> Result:
        import torch.distributed.checkpoint as dcp

        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(self.fresh("dcp")), no_dist=True)
        took = time.perf_counter() - t0
        return took, took

    def dcp_async_save(self) -> Result:
        import torch.distributed.checkpoint as dcp

        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(self.fresh("dcpa")), no_dist=True)
        waits = time.perf_counter() - t0
        future.result()
        return waits, time.perf_counter() - t0

    # -- Lightning: Trainer.save_checkpoint, what ModelCheckpoint calls ----------------------------

    def lightning_save(self) -> Result:
        if self.lightning is None:
            self.lightning = _lightning_trainer(self.model, self.dir)
        path = self.fresh("lightning") / "last.ckpt"
        t0 = time.perf_counter()
        self.lightning.save_checkpoint(path)
        return time.perf_counter() - t0, None

    # -- transformers: Trainer._save_checkpoint, what save_strategy calls --------------------------

    def hf_save(self) -> Result:
        if self.hf is None:
            self.hf = _hf_trainer(self.model, self.optimizer, self.dir)
        self.hf.args.output_dir = str(self.fresh("hf"))
        t0 = time.perf_counter()
        self.hf._save_checkpoint(self.hf.model, trial=None)
        return time.perf_counter() - t0, None


def _lightning_trainer(model: torch.nn.Module, directory: Path) -> Any:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.net(input_ids=batch[0], labels=batch[1]).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = torch.utils.data.TensorDataset(torch.randint(0, 8000, (2, 16)), torch.tensor([0, 1]))
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(directory),
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=2))  # an AdamW state, as in training
    return trainer


def _hf_trainer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(directory / "hf"), report_to=[], use_cpu=True, save_strategy="no")
    trainer = Trainer(model=model, args=args, optimizers=(optimizer, None))
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    return trainer


def _clean(root: Path) -> None:
    """Remove what the peers wrote (the manager's directory it keeps pruned itself)."""
    for path in root.iterdir():
        if path.name != "aiosnap":
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (a temporary directory inside it)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # DCP warns at every call without a process group
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="aiosnap-migration-", dir=args.dir))
    try:
        asyncio.run(measure(root, args.reps))
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def measure(root: Path, reps: int) -> None:
    """Every method, once unmeasured, then ``reps`` times in a rotating order. The peers
    block this event loop, as they block a training loop; the manager has nothing in
    flight meanwhile (each of its saves is waited for)."""
    methods = Methods(root)
    table: dict[str, Method] = {
        "torch.save": methods.torch_save,
        "torch.save + fsync": methods.torch_save_fsync,
        "dcp.save": methods.dcp_save,
        "dcp.async_save": methods.dcp_async_save,
        "aiosnap CheckpointManager.save": methods.aiosnap,
        "aiosnap.save_sync": methods.aiosnap_save_sync,
    }
    for name, fn, package in (
        ("Lightning Trainer.save_checkpoint", methods.lightning_save, "lightning"),
        ("HF Trainer._save_checkpoint", methods.hf_save, "transformers"),
    ):
        try:
            __import__(package)
            table[name] = fn
        except ImportError:
            print(f"skipped {name}: pip install {package}")
    results: dict[str, list[Result]] = {name: [] for name in table}
    async with aiosnap.CheckpointManager(
        str(root / "aiosnap"), keep=aiosnap.retention.KeepLast(2)
    ) as manager:
        methods.manager = manager
        for fn in table.values():  # once unmeasured: imports, threads, first allocations
            await _run(fn)
            _clean(root)
        for rep in range(reps):
            names = list(table)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                results[name].append(await _run(table[name]))
                _clean(root)
    print(
        f"{methods.nbytes() / 1e6:.0f} MB state (BERT-shaped model + AdamW), median of {reps}; "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__}"
    )
    print(f"{'method':36} {'loop waits s':>12} {'durable s':>10}")
    for name, runs in results.items():
        waits = statistics.median(r[0] for r in runs)
        durable = [r[1] for r in runs if r[1] is not None]
        shown = f"{statistics.median(durable):10.3f}" if durable else f"{'-':>10}"
        print(f"{name:36} {waits:12.3f} {shown}")


async def _run(fn: Method) -> Result:
    out = fn()
    return await out if inspect.isawaitable(out) else out  # type: ignore[return-value]


if __name__ == "__main__":
    main()
