"""The peers, each measured the way its users call it (in a thread: they block)."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _harness import RssSampler, cold_start, fsync_path

Result = dict[str, float]


def torch_save(state: dict[str, Any], directory: Path, rss: RssSampler) -> Result:
    path = directory / "ckpt.pt"
    with rss:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        total = time.perf_counter() - t0
    return {"stall": total, "total": total}


def torch_load(state: dict[str, Any], directory: Path, rss: RssSampler) -> Result:
    path = directory / "load.pt"
    torch.save(state, path)
    cold_start(path)
    with rss:
        t0 = time.perf_counter()
        torch.load(path, weights_only=True)
        total = time.perf_counter() - t0
    return {"stall": total, "total": total}


def _dcp() -> Any:
    warnings.simplefilter("ignore")  # every DCP call without a process group warns
    import torch.distributed.checkpoint as dcp

    return dcp


def dcp_save(state: dict[str, Any], directory: Path, rss: RssSampler) -> Result:
    dcp = _dcp()
    with rss:
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory / "dcp", thread_count=2), no_dist=True)
        total = time.perf_counter() - t0
    return {"stall": total, "total": total}


def reused_stager(*, pinned: bool) -> Any:
    """A DCP DefaultStager to pass to every ``async_save`` call, as DCP's users get their
    fastest stall: its buffers are allocated (and pinned) once; ``close()`` it after the
    last save. ``pinned=False`` works on a CPU-only torch: no pinned memory, no non-blocking
    copies. (On the H200 machine's torch 2.11 such a stager failed its second save,
    ``KeyError: <class 'type'>``; benchmarks/gpu_check.py then gives each save a new one.)"""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=pinned,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=pinned,
    )
    return DefaultStager(options)


def cpu_stager() -> Any:
    """A reused DCP DefaultStager that works on a CPU-only torch."""
    return reused_stager(pinned=False)


def timed_async_save(start: Callable[[], Any]) -> tuple[float, float]:
    """(stall, call->durable) of a ``dcp.async_save`` call that ``start`` makes."""
    t0 = time.perf_counter()
    response = start()
    if hasattr(response, "staging_completion"):
        response.staging_completion.result()  # the state may change only after this
        stall = time.perf_counter() - t0
        response.upload_completion.result()
    else:
        stall = time.perf_counter() - t0
        response.result()
    return stall, time.perf_counter() - t0


def dcp_async_save(reuse_stager: bool) -> Callable[[dict[str, Any], Path, RssSampler], Result]:
    def run(state: dict[str, Any], directory: Path, rss: RssSampler) -> Result:
        dcp = _dcp()
        stager = cpu_stager() if reuse_stager else None

        def save(name: str) -> tuple[float, float]:
            checkpoint_id = str(directory / name)
            return timed_async_save(
                lambda: dcp.async_save(state, checkpoint_id=checkpoint_id, async_stager=stager, no_dist=True)
            )

        try:
            with rss:
                save("warm")
                stall, total = save("dcp")
        finally:
            if stager is not None:
                stager.close()
        return {"stall": stall, "total": total}

    return run


def pfn_thread_queue_writer(state: dict[str, Any], directory: Path, rss: RssSampler) -> Result:
    from pytorch_pfn_extras.writing import SimpleWriter, ThreadQueueWriter

    # Its consumer task writes under its own out_dir, not the one passed to the call.
    task = SimpleWriter(savefun=torch.save, out_dir=str(directory))
    writer = ThreadQueueWriter(savefun=torch.save, out_dir=str(directory), task=task)
    try:
        with rss:
            writer("warm", str(directory), state)
            t0 = time.perf_counter()
            writer("ckpt", str(directory), state)  # queues a reference: no copy is made
            stall = time.perf_counter() - t0
            writer.finalize()  # waits for the queue; pfn does not fsync, so we do
            fsync_path(directory / "ckpt")
            total = time.perf_counter() - t0
    finally:
        writer.finalize()
    return {"stall": stall, "total": total}


PEERS: dict[str, Callable[[dict[str, Any], Path, RssSampler], Result]] = {
    "peer: torch.save + fsync": torch_save,
    "peer: dcp.save (2 threads)": dcp_save,
    "peer: dcp.async_save": dcp_async_save(reuse_stager=False),
    "peer: dcp.async_save + reused DefaultStager": dcp_async_save(reuse_stager=True),
    "peer: pfn-extras ThreadQueueWriter(torch.save)": pfn_thread_queue_writer,
    "peer: torch.load (cold)": torch_load,
}
