"""The save call of Accelerate and the HF Trainer in a multi-process DDP run, per rank:
aiosnap's integration against the framework's own save made durable, in one run.

    python benchmarks/bench_ranks_hf_accelerate.py [--nproc 2] [--size 100MiB] [--reps 3] [--only hf]

Starts ``--nproc`` processes on CPU (gloo on 127.0.0.1, the environment torchrun gives its
workers). Each holds the same DDP model plus its AdamW state, ``--size`` in all (an MLP; a
BERT for the Trainer). On every rank, timed from the call to its return: aiosnap's
``save_state()`` / ``_save_checkpoint`` (the group's commit goes on in the background;
waited for, untimed, before the next repetition), and the framework's own, followed by an
``fsync`` of every file it wrote on that rank and a barrier: what a save that is durable
on every rank when the call returns costs. The ratio is aiosnap's call over that, per rank.
Medians of ``--reps`` repetitions after a warm-up; the order alternates. Results:
``benchmarks/results/ranks_hf_accelerate.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
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
from _harness import fsync_path
from bench import machine, parse_size
from bench_integrations import bert, mlp

ROOT = Path(__file__).resolve().parent
MARK = "@bench-rank "
AIOSNAP, DURABLE = "aiosnap", "framework's own + fsync"
#: A method: ``(save, settle)``: ``save(rep)`` the timed call, ``settle()`` untimed after it.
Method = tuple[Callable[[int], None], Callable[[], None]]


def _fsync_tree(path: Path, since: float) -> None:
    """fsync every file under ``path`` written since ``since`` (this rank's), and the folders."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            if os.stat(os.path.join(root, name)).st_mtime >= since:
                fsync_path(os.path.join(root, name))
        fsync_path(root)


def _durable(save: Callable[[Path], None], scratch: Path) -> Callable[[int], None]:
    import torch.distributed as dist

    def call(rep: int) -> None:
        folder = scratch / f"own-{rep + 1}"
        since = time.time() - 1
        save(folder)
        _fsync_tree(folder, since)
        dist.barrier()  # durable on every rank

    return call


def accelerate_methods(size: int, scratch: Path) -> dict[str, Method]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from aiosnap.integrations.accelerate import AiosnapAccelerator

    config = ProjectConfiguration(project_dir=str(scratch / "aiosnap"), automatic_checkpoint_naming=True)

    def prepared(cls: type[Any], **kwargs: Any) -> Any:
        torch.manual_seed(0)
        accelerator = cls(cpu=True, **kwargs)
        model = mlp(size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.backward(model(torch.randn(4, next(model.parameters()).shape[1])).sum())
        optimizer.step()  # its state allocated
        return accelerator

    ours = prepared(AiosnapAccelerator, project_config=config)
    own = prepared(Accelerator)

    def our_save(rep: int) -> None:
        ours.save_state()

    def own_save(folder: Path) -> None:
        own.save_state(str(folder))

    return {AIOSNAP: (our_save, ours.flush), DURABLE: (_durable(own_save, scratch), lambda: None)}


def hf_methods(size: int, scratch: Path) -> dict[str, Method]:
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from aiosnap.integrations.transformers import AiosnapTrainer

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.arange(12) + i, "labels": torch.tensor(i % 2)}

    def trainer(cls: type[Any], out: Path) -> Any:
        args = TrainingArguments(
            str(out),
            per_device_train_batch_size=4,
            max_steps=1,
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            ddp_backend="gloo",
        )
        t = cls(model=bert(size), args=args, train_dataset=Data())
        t.train()
        return t

    hf_logging.disable_progress_bar()  # save_pretrained's, in the Trainer's own save
    ours = trainer(AiosnapTrainer, scratch / "aiosnap")
    own = trainer(Trainer, scratch / "own")

    def own_save(folder: Path) -> None:
        own.args.output_dir = str(folder)
        own._save_checkpoint(own.model, trial=None)

    def our_save(rep: int) -> None:
        ours.state.global_step = rep + 2  # a fresh checkpoint-N each time
        ours._save_checkpoint(ours.model, trial=None)

    return {AIOSNAP: (our_save, ours.flush), DURABLE: (_durable(own_save, scratch), lambda: None)}


FRAMEWORKS = {"accelerate": ("Accelerate", accelerate_methods), "hf": ("HF Trainer", hf_methods)}


def rank_main(key: str, size_arg: str, reps_arg: str, scratch: str) -> None:
    """One rank: set the framework up, time both methods, report on stdout."""
    size, reps = int(size_arg), int(reps_arg)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    folder = Path(scratch, key)
    methods = FRAMEWORKS[key][1](size, folder)
    for save, settle in methods.values():  # warm: first calls import, open, allocate
        save(-1)
        settle()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for rep in range(reps):
        for name in names[rep % 2 :] + names[: rep % 2]:
            save, settle = methods[name]
            t0 = time.perf_counter()
            save(rep)
            times[name].append(time.perf_counter() - t0)
            settle()
    rank = int(os.environ["RANK"])
    print(MARK + json.dumps({"rank": rank, "times": times}), flush=True)
    os._exit(0)  # the frameworks' groups: torn down with the process


def run(key: str, nproc: int, size: int, reps: int, scratch: Path) -> dict[int, dict[str, list[float]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
        env["HF_HUB_OFFLINE"] = "1"
        code = "import sys; from bench_ranks_hf_accelerate import rank_main; rank_main(*sys.argv[1:])"
        args = [sys.executable, "-c", code, key, str(size), str(reps), str(scratch)]
        procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
    found: dict[int, dict[str, list[float]]] = {}
    for p in procs:
        out, _ = p.communicate()
        for line in out.splitlines():
            if line.startswith(MARK):
                report = json.loads(line[len(MARK) :])
                found[report["rank"]] = report["times"]
        assert p.returncode == 0, f"a rank of {key} failed"
    return found


def render(results: dict[str, Any], info: dict[str, str], size: int, reps: int, nproc: int) -> str:
    lines = [
        f"### Save call per rank in a {nproc}-process DDP run, ~{size >> 20} MiB of model + AdamW state",
        "",
        f"Medians of {reps} alternated repetitions, one run. Machine: "
        + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        f"| framework | rank | aiosnap save call s | {DURABLE} s | ratio |",
        "|---|---|---|---|---|",
    ]
    for key, ranks in results.items():
        for rank, times in sorted(ranks.items()):
            ours, own = statistics.median(times[AIOSNAP]), statistics.median(times[DURABLE])
            lines.append(f"| {FRAMEWORKS[key][0]} | {rank} | {ours:.3f} | {own:.3f} | {ours / own:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--size", default="100MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default=",".join(FRAMEWORKS))
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()
    size = parse_size(args.size)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-ranks-", dir=ROOT)).resolve()
    results: dict[str, Any] = {}
    try:
        for key in args.only.split(","):
            print(f"{FRAMEWORKS[key][0]} ...", flush=True)
            results[key] = run(key, args.nproc, size, args.reps, scratch)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    info = {**machine(), "vCPU": str(os.cpu_count())}
    info.pop("cores", None)
    table = render(results, info, size, args.reps, args.nproc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"size": size, "nproc": args.nproc, "machine": info, "results": results}
    (out / "ranks_hf_accelerate.json").write_text(json.dumps(record))
    (out / "ranks_hf_accelerate.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
