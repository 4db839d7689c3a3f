"""Object storage: checkpoints to and from S3 (a moto server on loopback), aiosnap against
boto3 and s3fs; and the tiered manager's caller stall against a local-only manager.

    python benchmarks/bench_remote.py [--size 1GiB] [--reps 3]

The state is 16 float32 tensors of ``size / 16`` bytes. moto runs in a process of its own
(``moto_server``), so the server's work does not share this process's GIL.

Upload rows: the time from the call until the object is complete in the bucket.
- ``aiosnap.save(url, state)``: serialization, checksums and a multipart upload;
- ``aiosnap UploadWriter copy``: what the tiered manager does, a committed local file copied;
- peers, with a committed local file of the same bytes: boto3's ``upload_file``
  (TransferManager, parallel parts) and s3fs's ``put_file``.
Download rows: the object read back into memory.
- ``aiosnap.load(url)``: parallel ranged GETs into fresh tensors, checksums verified;
- peers: boto3's ``download_file`` and s3fs's ``get_file`` to a local file, the transfer alone.
Tiered rows: the caller's stall per save (median of ``--saves`` saves), a local-only
manager against one with ``remote=`` uploading in the background (target: at most
1.1x), with no upload running at the save (the hand-off's own cost) and with the previous
save's upload running (on 2 cores, moto's server then takes one of them).

Each time is the median of ``reps`` repetitions (min-max shown), methods in rotated order.
Results: benchmarks/results/remote.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import aiosnap
from aiosnap._save.transfer import copy_object
from aiosnap.storage import LocalStorage, from_url

sys.path.insert(0, str(Path(__file__).parent))
from _harness import publish

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent
TENSORS = 16
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
}


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server in its own process on a free loopback port; its endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "from moto.server import main; main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # until it answers (it reports nothing else)
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("moto_server did not answer")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait()


def _state(size: int, fill: float) -> dict[str, torch.Tensor]:
    n = size // TENSORS // 4
    return {f"w{i}": torch.full((n,), fill + i) for i in range(TENSORS)}


class Bench:
    def __init__(self, endpoint: str, size: int, scratch: Path) -> None:
        self.endpoint, self.size, self.scratch = endpoint, size, scratch
        self.options = {
            "endpoint": endpoint,
            "access_key_id": "bench",
            "secret_access_key": "bench",
            "region": "us-east-1",
            "client_options": {"allow_http": True},
        }
        import boto3

        self.s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        )
        self.bucket = "bench"
        self.s3.create_bucket(Bucket=self.bucket)
        self.storage = from_url(f"s3://{self.bucket}", **self.options)
        self.state = _state(size, 1.0)
        self.local = str(scratch / "ckpt")
        asyncio.run(aiosnap.save(self.local, self.state))  # the committed file peers upload

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=key)

    # -- uploads -------------------------------------------------------------------------
    def aiosnap_save(self) -> float:
        t0 = time.perf_counter()
        asyncio.run(aiosnap.save(self.url("up/aiosnap"), self.state, storage=self.storage))
        return time.perf_counter() - t0

    def aiosnap_copy(self) -> float:
        t0 = time.perf_counter()
        copy_object(LocalStorage(), self.local, self.storage, self.url("up/copy"))
        return time.perf_counter() - t0

    def boto3_upload(self) -> float:
        t0 = time.perf_counter()
        self.s3.upload_file(self.local, self.bucket, "up/boto3")
        return time.perf_counter() - t0

    def s3fs_put(self) -> float:
        fs = self._s3fs()
        t0 = time.perf_counter()
        fs.put_file(self.local, f"{self.bucket}/up/s3fs")
        return time.perf_counter() - t0

    def _s3fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(
            key="bench", secret="bench", endpoint_url=self.endpoint, skip_instance_cache=True
        )

    # -- downloads -----------------------------------------------------------------------
    def prepare_download(self) -> None:
        asyncio.run(aiosnap.save(self.url("down/ckpt"), self.state, storage=self.storage))

    def aiosnap_load(self) -> float:
        t0 = time.perf_counter()
        loaded = asyncio.run(aiosnap.load(self.url("down/ckpt"), storage=self.storage))
        took = time.perf_counter() - t0
        assert torch.equal(loaded["w3"], self.state["w3"])
        return took

    def boto3_download(self) -> float:
        target = str(self.scratch / "boto3.download")
        t0 = time.perf_counter()
        self.s3.download_file(self.bucket, "down/ckpt", target)
        took = time.perf_counter() - t0
        os.unlink(target)
        return took

    def s3fs_get(self) -> float:
        fs, target = self._s3fs(), str(self.scratch / "s3fs.download")
        t0 = time.perf_counter()
        fs.get_file(f"{self.bucket}/down/ckpt", target)
        took = time.perf_counter() - t0
        os.unlink(target)
        return took

    # -- the tiered manager's caller stall -----------------------------------------------
    def stall(self, tiered: bool, saves: int, overlap: bool) -> float:
        directory = tempfile.mkdtemp(dir=self.scratch)
        remote = self.url(f"tiered/{os.path.basename(directory)}") if tiered else None
        extra: dict[str, Any] = {"remote": aiosnap.Remote(remote, storage=self.storage)} if tiered else {}

        async def run() -> list[float]:
            stalls = []
            async with aiosnap.CheckpointManager(
                directory, keep=aiosnap.retention.KeepLast(2), **extra
            ) as mgr:
                for step in range(saves + 1):
                    t0 = time.perf_counter()
                    handle = await mgr.save(step, self.state)
                    if step:  # the first save warms the arenas
                        stalls.append(time.perf_counter() - t0)
                    # Training goes on meanwhile; the next step waits for the local commit
                    # only, as a trainer with one save in flight does (or, to see the
                    # hand-off alone, for the upload too).
                    await (handle.wait() if overlap else mgr.flush())
                await mgr.flush()
            return stalls

        stalls = asyncio.run(run())
        shutil.rmtree(directory, ignore_errors=True)
        return statistics.median(stalls)


def _measure(methods: dict[str, Callable[[], float]], reps: int) -> dict[str, dict[str, float]]:
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            times[name].append(methods[name]())
    return {n: {"median": statistics.median(t), "min": min(t), "max": max(t)} for n, t in times.items()}


def run(size: int, reps: int, saves: int, scratch: Path) -> dict[str, Any]:
    with moto_server() as endpoint:
        bench = Bench(endpoint, size, scratch)
        upload = _measure(
            {
                "aiosnap.save(url)": bench.aiosnap_save,
                "aiosnap UploadWriter copy (tiered)": bench.aiosnap_copy,
                "peer: boto3 upload_file": bench.boto3_upload,
                "peer: s3fs put_file": bench.s3fs_put,
            },
            reps,
        )
        bench.prepare_download()
        download = _measure(
            {
                "aiosnap.load(url)": bench.aiosnap_load,
                "peer: boto3 download_file": bench.boto3_download,
                "peer: s3fs get_file": bench.s3fs_get,
            },
            reps,
        )
        tiered = _measure(
            {
                "local-only manager": lambda: bench.stall(False, saves, True),
                "tiered, no upload running": lambda: bench.stall(True, saves, False),
                "tiered, the previous upload running": lambda: bench.stall(True, saves, True),
            },
            reps,
        )
    return {"bytes": size, "reps": reps, "upload": upload, "download": download, "tiered": tiered}


def render(data: dict[str, Any]) -> str:
    mib = data["bytes"] / MiB
    lines = [
        f"### Object storage: {mib:.0f} MiB to and from S3 (moto on loopback, its own process)",
        "",
        "| phase | method | s (min-max) | MB/s | x best peer |",
        "|---|---|---|---|---|",
    ]
    for phase in ("upload", "download"):
        rows = data[phase]
        best = min(v["median"] for k, v in rows.items() if k.startswith("peer"))
        for name, row in rows.items():
            rate = data["bytes"] / row["median"] / 1e6
            lines.append(
                f"| {phase} | {name} | {row['median']:.3f} ({row['min']:.3f}-{row['max']:.3f}) | "
                f"{rate:.0f} | {row['median'] / best:.2f} |"
            )
    rows = data["tiered"]
    local = rows["local-only manager"]
    for name, row in rows.items():
        lines.append(
            f"| caller stall | {name} | {row['median']:.4f} ({row['min']:.4f}-{row['max']:.4f}) | | "
            f"{row['median'] / local['median']:.2f} x local-only |"
        )
    lines += ["", "x best peer: below 1.00 is faster than the fastest peer in the same run."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="1GiB", help="the whole state (e.g. 64MiB, 1GiB)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--saves", type=int, default=5, help="saves per tiered-stall repetition")
    parser.add_argument("--dir", help="scratch directory for the local files")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--publish", action="store_true", help="put it in docs/benchmarks.md")
    args = parser.parse_args()
    for key, value in CREDENTIALS.items():  # for boto3 and s3fs; aiosnap gets them explicitly
        os.environ.setdefault(key, value)
    number, unit = args.size[:-3], args.size[-3:]
    size = int(float(number) * {"MiB": MiB, "GiB": 1024 * MiB}[unit])
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-remote-", dir=ROOT)).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        data = run(size, args.reps, args.saves, scratch)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    (out / "remote.json").write_text(json.dumps(data, indent=1))
    table = render(data)
    (out / "remote.md").write_text(table)
    print(table)
    if args.publish:
        publish("remote", table)


if __name__ == "__main__":
    main()
