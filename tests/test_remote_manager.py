"""CheckpointManager on object storage: saves, retention, a conditional index, leases,
groups, dead endpoints and missing credentials; moto (S3) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap
from aiosnap._manager.catalog import INDEX_NAME
from aiosnap.storage import from_url

from .servers import free_port
from .test_distributed import ok, run_ranks


def _objects(s3: Any, bucket: str) -> list[str]:
    found = s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(o["Key"] for o in found)


async def test_a_manager_on_s3_saves_rotates_indexes_and_restores(s3: Any) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    storage = from_url(url, **s3.options)
    keep = aiosnap.retention.KeepLast(2)
    async with aiosnap.CheckpointManager(url, storage=storage, keep=keep) as mgr:
        for step in range(1, 5):
            await (
                await mgr.save(step, {"w": torch.full((1000,), float(step))}, metrics={"loss": 1 / step})
            ).wait()
        assert await mgr.steps() == [3, 4]
        async with aiosnap.CheckpointManager(url, storage=storage, read_only=True) as reader:
            assert await reader.steps() == [3, 4]  # while the writer holds the lease
            assert float((await reader.restore()).state["w"][0]) == 4.0
        # The holder's lease (60 s) cannot go stale during the second's patience (its own
        # lease_ttl, 0.5 s, plus 1): however starved the renewals are, it is refused.
        with pytest.raises(aiosnap.errors.DirectoryLockedError):
            async with aiosnap.CheckpointManager(url, storage=storage, lease_ttl=0.5):
                pass
    assert _objects(s3, bucket) == sorted(
        ["run/.aiosnap.lock", f"run/{INDEX_NAME}", "run/snapshot_iter_3", "run/snapshot_iter_4"]
    )
    async with aiosnap.CheckpointManager(url, storage=storage) as mgr:  # the lease was released
        assert [h.step for h in await mgr.history()] == [1, 2, 3, 4]
        restored = await mgr.restore(target={"w": torch.zeros(1000)})
        assert restored.step == 4 and restored.path == f"{url}/snapshot_iter_4"


async def test_a_lease_left_by_a_manager_on_another_host_is_taken_once_stale(s3: Any) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    storage = from_url(url, **s3.options)
    async with aiosnap.CheckpointManager(url, storage=storage) as mgr:
        await (await mgr.save(1, {"w": torch.ones(10)})).wait()
    # A holder elsewhere that died 1 s into its 3 s lease: nobody here can see it die.
    expires = time.time() + 2.0
    lease = json.dumps({"owner": "elsewhere|pid:[1]|42|ab", "expires": expires}).encode()
    s3.client().put_object(Bucket=bucket, Key="run/.aiosnap.lock", Body=lease)
    async with aiosnap.CheckpointManager(url, storage=storage) as mgr:
        assert time.time() >= expires  # it waited for the lease to go stale
        assert (await mgr.restore()).step == 1


class _Said(logging.Handler):
    """Sets ``event`` when a record's message contains ``words`` (logged on the loop)."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words, self.event = words, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


async def test_a_lease_renewed_while_an_opener_waits_for_it_is_refused_at_once(s3: Any) -> None:
    # The opener waits for a lease that may be a dead holder's; seeing it renewed (its
    # expiry moved on, as the lease itself says) it gives up at once: the holder lives.
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    storage = from_url(url, **s3.options)
    first = time.time() + 30.0
    owner = "elsewhere|pid:[1]|42|ab"
    s3.client().put_object(
        Bucket=bucket, Key="run/.aiosnap.lock", Body=json.dumps({"owner": owner, "expires": first}).encode()
    )
    said = _Said("may have died")
    logging.getLogger("aiosnap").addHandler(said)
    try:

        async def renew() -> None:
            await said.event.wait()  # the opener found the lease and waits for it
            renewed = json.dumps({"owner": owner, "expires": time.time() + 60.0}).encode()
            s3.client().put_object(Bucket=bucket, Key="run/.aiosnap.lock", Body=renewed)

        renewal = asyncio.create_task(renew())
        with pytest.raises(aiosnap.errors.DirectoryLockedError, match="in use by another"):
            async with aiosnap.CheckpointManager(url, storage=storage, lease_ttl=60.0):
                pass
        await renewal
    finally:
        logging.getLogger("aiosnap").removeHandler(said)
    assert time.time() < first  # refused before the first lease could have gone stale


async def test_an_index_changed_behind_the_managers_back_is_not_overwritten(s3: Any) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    storage = from_url(url, **s3.options)
    index = f"{url}/{INDEX_NAME}"
    async with aiosnap.CheckpointManager(url, storage=storage) as mgr:
        await (await mgr.save(1, {"x": np.ones(3)})).wait()
        _, version = storage.read_versioned(index)
        other = json.dumps({"written by": "another writer"}).encode()
        storage.replace_if(index, other, version)  # a second writer, without the lease
        handle = await mgr.save(2, {"x": np.ones(3)})
        with pytest.raises(aiosnap.errors.ConflictError):
            await handle.wait()  # the checkpoint committed; the index update was refused
    assert storage.read_versioned(index)[0] == other  # the other writer's update stands
    async with aiosnap.CheckpointManager(url, storage=storage, read_only=True) as mgr:
        assert await mgr.steps() == [1, 2]  # the index is a cache: rebuilt from the objects


async def _group_on_s3(rank: int, world: int, url: str, env: dict[str, str]) -> Any:
    os.environ.update(env)
    state = {"model": {"w": torch.full((64,), 1.0)}, "mine": torch.full((8,), float(rank))}
    async with aiosnap.CheckpointManager(url, ranks=aiosnap.Ranks(replicated=["model"], timeout=60)) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, state)).wait()
        restored = await mgr.restore()
    return {"steps": [1, 2], "mine": float(restored.state["mine"][0])}


def test_a_group_checkpoints_to_s3_with_the_manifest_last(s3: Any) -> None:
    bucket = s3.bucket()
    results = run_ranks(2, _group_on_s3, f"s3://{bucket}/run", s3.env)
    ok(results, 2)
    assert [results[r]["mine"] for r in range(2)] == [0.0, 1.0]
    keys = _objects(s3, bucket)
    for step in (1, 2):
        assert {
            f"run/snapshot_iter_{step}/{n}" for n in ("rank_00000", "rank_00001", "aiosnap-manifest.json")
        } <= set(keys)


async def test_a_dead_endpoint_fails_the_save_within_its_deadline_naming_the_url() -> None:
    port = free_port()  # nothing listens there
    storage = from_url(
        "s3://ckpt",
        endpoint=f"http://127.0.0.1:{port}",
        access_key_id="k",
        secret_access_key="s",
        region="us-east-1",
        client_options={"allow_http": True},
        deadline=1.0,
    )
    with pytest.raises(aiosnap.errors.RemoteStorageError, match="s3://ckpt/run/ckpt"):
        await aiosnap.save("s3://ckpt/run/ckpt", {"w": torch.ones(3)}, storage=storage)
    with pytest.raises(aiosnap.errors.RemoteStorageError, match="s3://ckpt/run"):
        async with aiosnap.CheckpointManager("s3://ckpt/run", storage=storage):
            pass


async def test_missing_credentials_give_a_clear_error_at_open(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    dead = f"http://127.0.0.1:{free_port()}"  # no instance metadata service here either
    storage = from_url(
        f"s3://{s3.bucket()}",
        endpoint=s3.endpoint,
        region="us-east-1",
        metadata_endpoint=dead,
        client_options={"allow_http": True},
        deadline=1.0,
    )
    with pytest.raises(aiosnap.errors.RemoteStorageError, match="credentials"):
        async with aiosnap.CheckpointManager(f"s3://{storage.bucket}/run", storage=storage):  # type: ignore[attr-defined]
            pass


def test_unknown_schemes_and_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown storage scheme 'nosuch'"):
        from_url("nosuch://bucket/run")
    with pytest.raises(ValueError, match="takes no options"):
        from_url(str(tmp_path), direct=False)


async def test_a_write_to_a_bucket_that_is_gone_says_so(s3: Any) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    storage = from_url(url, **s3.options)
    async with aiosnap.CheckpointManager(url, storage=storage) as mgr:
        await (await mgr.save(1, {"w": torch.ones(4)})).wait()
        client = s3.client()  # the object store restarted empty (moto keeps buckets in memory)
        for key in _objects(s3, bucket):
            client.delete_object(Bucket=bucket, Key=key)
        client.delete_bucket(Bucket=bucket)
        with pytest.raises(
            aiosnap.errors.RemoteStorageError, match=f"the bucket s3://{bucket} does not exist"
        ):
            await (await mgr.save(2, {"w": torch.ones(4)})).wait()
        s3.client().create_bucket(Bucket=bucket)  # for the lease's release at the close
