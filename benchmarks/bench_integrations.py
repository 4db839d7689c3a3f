"""The save call in each framework's own save path: aiosnap's integration, the framework's
default, and a durable torch.save of the same state, side by side in one run.

    python benchmarks/bench_integrations.py [--size 200MiB] [--reps 5] [--only ppe,hf] [--dir DIR]

Each framework holds a model plus its AdamW state, ``--size`` in all (an MLP; a BERT for
the Hugging Face Trainer), after one training step. Its save path is timed as training
sees it, from the call to its return: ppe's snapshot extension, Lightning's
``Trainer.save_checkpoint``, the Trainer's ``_save_checkpoint`` (what ``save_steps``
calls), Accelerate's ``save_state``. The durable torch.save is ``torch.save`` of
``{"model": state_dict, "optimizer": state_dict}`` then ``fsync``: what a save that is on
disk when the call returns costs. Each figure is the median of ``--reps`` repetitions
whose order rotates; before each, every earlier save is durable and ``os.sync()`` ran,
so no method inherits another's dirty pages. For aiosnap the time until the checkpoint
is durable is given too. Results: ``benchmarks/results/integrations.{md,json}``;
``--publish`` puts the table in docs/benchmarks.md, and each framework's rows in its page
(docs/integration-*.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _harness import fsync_path, publish
from bench import machine, parse_size

ROOT = Path(__file__).resolve().parent
DOCS = ROOT.parent / "docs"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
#: A method: set up once; returns ``(save, durable)``, both blocking: ``save(rep)`` is the
#: timed call, ``durable()`` waits until what it saved is on disk (untimed).
Method = Callable[[], tuple[Callable[[int], None], Callable[[], None]]]
AIOSNAP, DEFAULT, DURABLE = "aiosnap", "framework default", "durable torch.save"


def mlp(size: int) -> torch.nn.Module:
    """Two square layers holding ``size / 3`` bytes (AdamW keeps two more copies)."""
    width = max(16, int((size / 3 / 4 / 2) ** 0.5))
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))


def stepped(model: torch.nn.Module, loss: Callable[[torch.nn.Module], torch.Tensor] | None = None) -> Any:
    """An AdamW after one step, so its state is allocated."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if loss is None:
        loss = lambda m: m(torch.randn(4, next(m.parameters()).shape[1])).sum()  # noqa: E731
    loss(model).backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def state_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    tensors = [*model.state_dict().values()]
    tensors += [t for s in optimizer.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def durable_torch_save(model: torch.nn.Module, optimizer: Any, directory: Path) -> Method:
    def setup() -> tuple[Callable[[int], None], Callable[[], None]]:
        def save(rep: int) -> None:
            path = directory / "torch.pt"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            fsync_path(path)

        return save, lambda: None

    return setup


# -- the frameworks ---------------------------------------------------------------------------------


def ppe_methods(size: int, scratch: Path) -> tuple[dict[str, Method], int]:
    import pytorch_pfn_extras as ppe
    from pytorch_pfn_extras.training import extensions

    from aiosnap.integrations.ppe import Writer, snapshot

    model = mlp(size)
    optimizer = stepped(model)

    def with_writer(directory: Path, make: Callable[[Any], Any]) -> Method:
        def setup() -> tuple[Callable[[int], None], Callable[[], None]]:
            manager = ppe.training.ExtensionsManager(
                model, optimizer, 1, iters_per_epoch=1, out_dir=str(directory)
            )
            extension, writer = make(str(directory))
            extension.initialize(manager)
            return (lambda rep: extension(manager)), getattr(writer, "flush", lambda: None)

        return setup

    def ours(out: str) -> tuple[Any, Any]:
        writer = Writer(out)
        return snapshot(writer=writer), writer

    def theirs(out: str) -> tuple[Any, Any]:
        return extensions.snapshot(writer=ppe.writing.SimpleWriter(out_dir=out)), None

    return {
        AIOSNAP: with_writer(scratch / "ppe-aiosnap", ours),
        DEFAULT: with_writer(scratch / "ppe-default", theirs),
        DURABLE: durable_torch_save(model, optimizer, scratch),
    }, state_bytes(model, optimizer)


def lightning_methods(size: int, scratch: Path) -> tuple[dict[str, Method], int]:
    import lightning as L

    from aiosnap.integrations.lightning import AiosnapCheckpointIO

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(size)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    width = mlp(size)[0].in_features
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, width)), batch_size=4)

    def trainer(directory: Path, plugins: list[Any]) -> Method:
        def setup() -> tuple[Callable[[int], None], Callable[[], None]]:
            t = L.Trainer(
                max_steps=1,
                plugins=plugins,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            t.fit(Module(), data)
            flush = getattr(plugins[0], "flush", lambda: None) if plugins else lambda: None
            return (lambda rep: t.save_checkpoint(directory / "last.ckpt")), flush

        return setup

    module = Module()
    optimizer = stepped(module.net)
    return {
        AIOSNAP: trainer(scratch / "lightning-aiosnap", [AiosnapCheckpointIO()]),
        DEFAULT: trainer(scratch / "lightning-default", []),
        DURABLE: durable_torch_save(module, optimizer, scratch),
    }, state_bytes(module, optimizer)


def bert(size: int) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    hidden, layers = 256, 2
    # The embeddings take what the layers (~12 hidden^2 each) leave of size / 3 bytes.
    vocab = max(1000, int((size / 3 / 4 - layers * 12 * hidden * hidden) / hidden))
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * hidden,
    )
    return BertForSequenceClassification(config)


def transformers_methods(size: int, scratch: Path) -> tuple[dict[str, Method], int]:
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from aiosnap.integrations.transformers import AiosnapTrainer

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.arange(12) + i, "labels": torch.tensor(i % 2)}

    def trainer(cls: type[Any], directory: Path) -> Method:
        def setup() -> tuple[Callable[[int], None], Callable[[], None]]:
            args = TrainingArguments(
                str(directory),
                per_device_train_batch_size=4,
                max_steps=1,
                save_strategy="no",
                logging_strategy="no",
                report_to=[],
                disable_tqdm=True,
            )
            t = cls(model=bert(size), args=args, train_dataset=Data())
            t.train()
            flush = getattr(t, "flush", lambda: None)
            return (lambda rep: t._save_checkpoint(t.model, trial=None)), flush

        return setup

    hf_logging.disable_progress_bar()  # save_pretrained's, in the default rows
    model = bert(size)
    optimizer = stepped(model, lambda m: m(input_ids=torch.arange(12)[None], labels=torch.tensor([1])).loss)
    return {
        AIOSNAP: trainer(AiosnapTrainer, scratch / "hf-aiosnap"),
        DEFAULT: trainer(Trainer, scratch / "hf-default"),
        DURABLE: durable_torch_save(model, optimizer, scratch),
    }, state_bytes(model, optimizer)


def accelerate_methods(size: int, scratch: Path) -> tuple[dict[str, Method], int]:
    from accelerate import Accelerator

    from aiosnap.integrations.accelerate import AiosnapAccelerator

    def accelerator(cls: type[Any], directory: Path) -> Method:
        def setup() -> tuple[Callable[[int], None], Callable[[], None]]:
            acc = cls(cpu=True)
            model = mlp(size)
            acc.prepare(model, stepped(model))
            flush = getattr(acc, "flush", lambda: None)
            return (lambda rep: acc.save_state(str(directory))), flush

        return setup

    model = mlp(size)
    optimizer = stepped(model)
    return {
        AIOSNAP: accelerator(AiosnapAccelerator, scratch / "accelerate-aiosnap"),
        DEFAULT: accelerator(Accelerator, scratch / "accelerate-default"),
        DURABLE: durable_torch_save(model, optimizer, scratch),
    }, state_bytes(model, optimizer)


#: Per framework: its title, its methods, what its default is, its docs page.
FRAMEWORKS: dict[str, tuple[str, Callable[[int, Path], tuple[dict[str, Method], int]], str, str]] = {
    "ppe": (
        "pytorch-pfn-extras",
        ppe_methods,
        "snapshot extension, SimpleWriter (torch.save)",
        "integration-ppe.md",
    ),
    "lightning": (
        "Lightning",
        lightning_methods,
        "Trainer.save_checkpoint, TorchCheckpointIO",
        "integration-lightning.md",
    ),
    "hf": (
        "HF Trainer",
        transformers_methods,
        "Trainer._save_checkpoint (save_steps)",
        "integration-transformers.md",
    ),
    "accelerate": ("Accelerate", accelerate_methods, "Accelerator.save_state", "integration-accelerate.md"),
}


# -- measuring ------------------------------------------------------------------------------------


def measure(methods: dict[str, Method], reps: int) -> dict[str, dict[str, list[float]]]:
    """Every method's save call (and call->durable) times, ``reps`` each, rotating."""
    ready = {name: setup() for name, setup in methods.items()}
    for save, durable in ready.values():  # warm: first calls import, open, allocate
        save(-1)
        durable()
    times: dict[str, dict[str, list[float]]] = {name: {"call": [], "durable": []} for name in ready}
    names = list(ready)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            save, durable = ready[name]
            os.sync()
            t0 = time.perf_counter()
            save(rep)
            t1 = time.perf_counter()
            durable()
            times[name]["call"].append(t1 - t0)
            times[name]["durable"].append(time.perf_counter() - t0)
    return times


def rows(key: str, data: dict[str, Any]) -> list[str]:
    """The table rows of one framework: aiosnap, its default, the durable torch.save."""
    title, _, default, _page = FRAMEWORKS[key]
    base = statistics.median(data[DURABLE]["call"])
    lines = []
    for name, label in ((AIOSNAP, "aiosnap"), (DEFAULT, f"default: {default}"), (DURABLE, DURABLE)):
        call = data[name]["call"]
        durable = f"{statistics.median(data[name]['durable']):.3f}" if name != DEFAULT else "not fsynced"
        median = statistics.median(call)
        spread = f"{min(call):.3f}-{max(call):.3f}"
        lines.append(
            f"| {title} ({data['bytes'] >> 20}) | {label} | {median:.3f} ({spread}) "
            f"| {durable} | {median / base:.2f} |"
        )
    return lines


def render(results: dict[str, Any], info: dict[str, str], size: int, reps: int) -> str:
    """The table of ``results`` (every framework of the run, or one)."""
    lines = [
        f"### Save call in each framework's own save path, ~{size >> 20} MiB of model + AdamW state",
        "",
        f"Medians of {reps} rotated repetitions, every figure of a framework from the same run. Machine: "
        + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        "| framework (state MiB) | method | save call s (min-max) | call->durable s | x durable torch.save |",
        "|---|---|---|---|---|",
    ]
    for key, data in results.items():
        lines += rows(key, data)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="200MiB", help="model + optimizer state per framework")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", default=",".join(FRAMEWORKS), help=f"some of {','.join(FRAMEWORKS)}")
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--publish", action="store_true", help="put the table in docs/benchmarks.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    size = parse_size(args.size)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-integrations-", dir=ROOT)).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    try:
        for key in args.only.split(","):
            print(f"{FRAMEWORKS[key][0]} ...", flush=True)
            methods, nbytes = FRAMEWORKS[key][1](size, scratch)
            results[key] = {**measure(methods, args.reps), "bytes": nbytes}
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    info = {**machine(), "vCPU": str(os.cpu_count())}
    info.pop("cores", None)
    table = render(results, info, size, args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "integrations.json").write_text(
        json.dumps({"size": size, "machine": info, "results": results}, indent=1)
    )
    (out / "integrations.md").write_text(table)
    print(table)
    if args.publish:
        publish("integrations", table)
        for key, data in results.items():  # each framework's page shows its own rows
            publish(key, render({key: data}, info, size, args.reps), docs=DOCS / FRAMEWORKS[key][3])


if __name__ == "__main__":
    main()
