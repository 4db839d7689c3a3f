"""Object stores (S3, GCS, Azure) through obstore, behind the Storage interface.

Paths are URLs (``s3://bucket/run/snapshot_iter_5``): the storage keeps one obstore
store per bucket, configured by the URL, the options given to ``from_url`` and the
standard environment (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``), as obstore reads it.
Only obstore's synchronous calls are made, from aiosnap's worker threads.

- An upload streams the object front to back as a multipart upload (parts go up in
  parallel) that becomes visible only when it completes; a small object is one PUT.
- The index is replaced with a conditional PUT (If-None-Match, If-Match with the ETag
  read), so two writers never silently lose an update.
- A lease is a lock object created only if absent, renewed with its own version, and
  taken over only once its holder stopped renewing it for ``ttl``.
- A killed upload leaves only parts, never a visible object; ``sweep_incomplete``
  aborts them with the provider's own client (obstore has no call for it).

Failures are translated once, here: a missing object is CheckpointNotFoundError, a
lost race ConflictError, and anything else after obstore's retries (5xx, resets and
timeouts are retried until ``deadline`` seconds have passed) RemoteStorageError,
naming the URL; missing or refused credentials and a missing bucket are permanent,
never retried (``objerrors``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from .._base.errors import (
    CheckpointNotFoundError,
    ConflictError,
    CorruptCheckpointError,
    RemoteStorageError,
)
from .lease import VersionedLease
from .objerrors import NO_BUCKET, check_credentials, permanent, translate
from .protocol import LEASE_NAME, CommitTimes, Entry, UrlPaths, Version

#: Objects up to this size are one PUT; larger ones a multipart upload of parts this big
#: (the default of ``ObjectStorage(part_size=...)``); reads ask for at least this much a GET.
PART = 16 << 20
#: The least part S3 accepts (but the last); the other stores accept it too.
MIN_PART = 5 << 20
#: Parts (and ranged GETs) in flight at once.
CONCURRENCY = 8
#: The least a streamed GET hands over at a time.
STREAM_CHUNK = 4 << 20
#: Seconds an operation is retried before it fails (transient errors only).
DEADLINE = 120.0


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ImportError(
            "object stores need obstore: pip install obstore (aiosnap's extras s3, gcs, azure and remote "
            "bring it, with the provider's client)"
        ) from None
    return obstore


class ObjectStorage(UrlPaths):
    """An object store (see the module docstring). Build it with ``from_url``, which
    passes its keyword arguments on to this constructor.

    Args:
        scheme: The URL's scheme: ``s3``, ``gs``, ``az`` or one of their aliases.
        bucket: The bucket (a container, on Azure).
        deadline: Seconds a failing operation is retried (transient errors only: 5xx,
            resets, timeouts) before it raises RemoteStorageError.
        part_size: Bytes of one part of a multipart upload; an object up to this size is
            one PUT. At least 5 MiB, the least part S3 accepts.
        **options: obstore's own options for the store (``endpoint``, ``region``,
            ``access_key_id``, ``client_options`` ...); unset ones come from the
            environment, as obstore reads it.
    """

    random_access = False

    def __init__(
        self, scheme: str, bucket: str, *, deadline: float = DEADLINE, part_size: int = PART, **options: Any
    ) -> None:
        if part_size < MIN_PART:
            raise ValueError(f"part_size={part_size}: parts are at least {MIN_PART} bytes (5 MiB)")
        self.scheme, self.bucket = scheme, bucket
        self.deadline, self.part_size, self.options = deadline, part_size, options
        self._store: Any = None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> ObjectStorage:
        scheme, rest = url.split("://", 1)
        bucket = rest.split("/", 1)[0]
        if not bucket:
            raise ValueError(f"{url!r}: no bucket")
        return cls(scheme.lower(), bucket, **options)

    def __repr__(self) -> str:
        return f"ObjectStorage({self.scheme}://{self.bucket})"

    def __getstate__(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "bucket": self.bucket,
            "deadline": self.deadline,
            "part_size": self.part_size,
            "options": self.options,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["scheme"],
            state["bucket"],
            deadline=state["deadline"],
            part_size=state["part_size"],
            **state["options"],
        )

    @property
    def store(self) -> Any:
        if self._store is None:
            obs = _obstore()
            options = dict(self.options)
            # obstore's own request timeouts (30 s, 5 s to connect) stand; client_options
            # given here would replace the ones it reads from the environment.
            options.setdefault(
                "retry_config",
                {
                    "max_retries": 20,
                    "retry_timeout": timedelta(seconds=self.deadline),
                    "backoff": {
                        "init_backoff": timedelta(milliseconds=100),
                        "max_backoff": timedelta(seconds=5),
                        "base": 2,
                    },
                },
            )
            check_credentials(self.scheme, self.bucket, self.options)
            try:
                self._store = obs.store.from_url(f"{self.scheme}://{self.bucket}", **options)
            except Exception as exc:  # a configuration no retry changes
                raise permanent(f"{self.scheme}://{self.bucket}: {exc}") from exc
        return self._store

    # -- paths -----------------------------------------------------------------------------
    def _root(self) -> str:
        return f"{self.scheme}://{self.bucket}"

    def key(self, path: str) -> str:
        """The object key of ``path`` (a URL of this bucket)."""
        root = self._root()
        if path != root and not path.startswith(root + "/"):
            raise ValueError(f"{path!r} is not in {root}")
        return path[len(root) :].strip("/")

    # -- writing -----------------------------------------------------------------------------
    def create(self, path: str, size: int | None) -> _ObjectUpload:
        return _ObjectUpload(self, path, size)

    def replace_if(self, path: str, data: bytes, expect: Version | None) -> Version:
        obs = _obstore()
        mode: Any = "create" if expect is None else _mode(expect)
        try:
            with self.writing(path):
                result = self._call(obs.put, path, self.store, self.key(path), data, mode=mode)
        except (RemoteStorageError, ConflictError):
            # The outcome of a conditional PUT whose answer was lost is unknown, and its
            # retry may find it done ("already exists"): read what is there; if it is
            # what this call wrote, it went through.
            try:
                now, version = self.read_versioned(path)
            except CheckpointNotFoundError:
                raise ConflictError(path, f"{path}: the conditional write's outcome is unknown") from None
            if now == data:
                return version
            raise
        return _version(result)

    # -- reading -----------------------------------------------------------------------------
    def open_read(self, path: str) -> _ObjectReader:
        return _ObjectReader(self, path)

    def read_versioned(self, path: str) -> tuple[bytes, Version]:
        obs = _obstore()
        got = self._idempotent(obs.get, path, self.store, self.key(path))
        data = bytes(got.bytes())
        return data, _version(got.meta)

    def stat(self, path: str) -> Entry | None:
        obs = _obstore()
        name = self.split(path)[1]
        try:
            meta = self._idempotent(obs.head, path, self.store, self.key(path))
            return Entry(name, False, int(meta["size"]), identity=_version(meta))
        except CheckpointNotFoundError:
            pass
        listed = self._idempotent(obs.list_with_delimiter, path, self.store, self.key(path))
        return Entry(name, True) if listed["objects"] or listed["common_prefixes"] else None

    # -- removing ----------------------------------------------------------------------------
    def delete(self, path: str) -> None:
        obs = _obstore()
        try:
            self._idempotent(obs.delete, path, self.store, self.key(path))
        except CheckpointNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        obs = _obstore()
        keys = [meta["path"] for meta in self._walk(path)]
        for i in range(0, len(keys), 1000):
            try:
                self._idempotent(obs.delete, path, self.store, keys[i : i + 1000])
            except CheckpointNotFoundError:
                pass  # some were gone already (Azure says so); the others went

    def _walk(self, path: str) -> Iterator[dict[str, Any]]:
        obs = _obstore()
        prefix = self.key(path)
        # A listing fails while it is read: collect it inside the call that translates errors.
        yield from self._idempotent(lambda: obs.list(self.store, prefix or None).collect(), path)

    def sweep_incomplete(self, path: str) -> list[str]:
        """Abort the multipart uploads killed saves left under ``path`` (S3), or delete
        the blobs with only uncommitted blocks (Azure); GCS keeps nothing visible."""
        prefix = self.key(path)
        prefix = prefix + "/" if prefix else ""
        if self.scheme in ("s3", "s3a"):
            return [f"{self._root()}/{key}" for key in _sweep_s3(self.bucket, prefix, self.options)]
        if self.scheme in ("az", "azure", "abfs", "abfss", "adl"):
            return [f"{self._root()}/{key}" for key in _sweep_azure(self.bucket, prefix, self.options)]
        return []

    def lease(self, path: str, ttl: float) -> VersionedLease:
        return VersionedLease(self, self.join(path, LEASE_NAME), ttl)

    # Last: below it, ``list`` would name this method in annotations.
    def list(self, path: str) -> list[Entry]:
        obs = _obstore()
        prefix = self.key(path)
        listed = self._idempotent(obs.list_with_delimiter, path, self.store, prefix or None)
        found = [Entry(p.rstrip("/").rsplit("/", 1)[-1], True) for p in listed["common_prefixes"]]
        found += [Entry(m["path"].rsplit("/", 1)[-1], False, int(m["size"])) for m in listed["objects"]]
        return sorted(found, key=lambda e: e.name)

    # -- errors ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self, path: str) -> Iterator[None]:
        """Where a write answers "not found", the bucket is missing, not an object: say so."""
        try:
            yield
        except CheckpointNotFoundError:
            raise self._no_bucket(path) from None

    def _no_bucket(self, path: str) -> RemoteStorageError:
        return permanent(
            f"{path}: the bucket {self._root()} does not exist (was it deleted, or did the object "
            "store restart without it?)"
        )

    def _call(self, fn: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)``, its failures translated: the one place obstore's errors come in."""
        obs = _obstore()
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise CheckpointNotFoundError(path) from None
        except (obs.exceptions.AlreadyExistsError, obs.exceptions.PreconditionError) as exc:
            raise ConflictError(path) from exc
        except (obs.exceptions.BaseError, OSError) as exc:
            if NO_BUCKET.search(str(exc)):
                raise self._no_bucket(path) from exc
            raise translate(path, exc, self.deadline) from exc

    def _idempotent(self, fn: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        """``_call`` of a call that may be repeated (a read, a listing, a delete): obstore
        retries what fails before an answer, not a body cut off midway; this retries
        that too, with backoff and jitter, until the deadline. An attempt is made only if
        one as long as the last would end by then: obstore's own retries of an endpoint
        that refuses take seconds per attempt, and the call must fail by its deadline,
        not one attempt past it."""
        deadline = time.monotonic() + self.deadline
        delay = 0.1
        while True:
            started = time.monotonic()
            try:
                return self._call(fn, path, *args, **kwargs)
            except RemoteStorageError as exc:
                now = time.monotonic()
                if exc.permanent or now + delay + (now - started) > deadline:
                    raise
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)


def _mode(expect: Version) -> dict[str, str]:
    e_tag, version = json.loads(expect)
    return {k: v for k, v in (("e_tag", e_tag), ("version", version)) if v is not None}


def _version(meta: Any) -> Version:
    return json.dumps([meta.get("e_tag"), meta.get("version")])


class _ObjectUpload:
    """An object written front to back: a PUT at commit if small, else a multipart upload
    that completes at commit (parts upload in parallel meanwhile)."""

    random_access = False
    local_path: str | None = None

    def __init__(self, storage: ObjectStorage, path: str, size: int | None) -> None:
        self.path, self.size = path, size
        self._storage, self._key = storage, storage.key(path)
        self._pos, self._write_s = 0, 0.0
        self._part = storage.part_size
        self._small: bytearray | None = bytearray() if size is not None and size <= self._part else None
        self._writer: Any = None
        self._done = False

    def write_at(self, offset: int, data: memoryview) -> None:
        if offset != self._pos:
            raise ValueError(
                f"{self.path}: an object is written front to back (at {self._pos}, not {offset})"
            )
        if self.size is not None:
            data = data[: max(0, self.size - offset)]
        t0 = time.perf_counter()
        if self._small is not None:
            self._small += data
        else:
            with self._storage.writing(self.path):
                self._write_parts(data)
        self._pos += len(data)
        self._write_s += time.perf_counter() - t0

    def _write_parts(self, data: memoryview) -> None:
        if self._writer is None:
            obs = _obstore()
            self._writer = self._storage._call(
                obs.open_writer,
                self.path,
                self._storage.store,
                self._key,
                buffer_size=self._part,
                max_concurrency=CONCURRENCY,
            )
        # obstore's writer keeps the buffers it is given (no copy) until their part is
        # sent, and callers reuse theirs (the pieces of a large save, a copy): it gets
        # copies, a part at a time, so at most its concurrency's worth is held.
        for start in range(0, len(data), self._part):
            self._storage._call(self._writer.write, self.path, bytes(data[start : start + self._part]))

    def commit(self) -> CommitTimes:
        t0 = time.perf_counter()
        try:
            with self._storage.writing(self.path):
                self._finish()
        except BaseException:
            self.abort()
            raise
        self._done = True
        return CommitTimes(self._write_s, time.perf_counter() - t0, self._pos)

    def _finish(self) -> None:
        obs = _obstore()
        if self._small is not None:
            self._storage._idempotent(obs.put, self.path, self._storage.store, self._key, bytes(self._small))
        elif self._writer is not None:
            self._storage._call(self._writer.close, self.path)
        else:
            self._storage._idempotent(obs.put, self.path, self._storage.store, self._key, b"")

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        writer, self._writer, self._small = self._writer, None, None
        if writer is not None:
            try:
                # Leaving the writer's context with an error aborts the multipart upload.
                writer.__exit__(RuntimeError, RuntimeError("aborted"), None)
            except Exception:  # the sweep at the next open takes what is left
                pass


class _ObjectReader:
    """An object read by ranges; large reads go as parallel ranged GETs."""

    #: Batches a loader hands over at once (see _readers.EntryReader.read_all).
    batch_bytes = 1 << 30
    batch_iovecs = 1 << 16

    def __init__(self, storage: ObjectStorage, path: str) -> None:
        obs = _obstore()
        self.path, self._storage, self._key = path, storage, storage.key(path)
        meta = storage._idempotent(obs.head, path, storage.store, self._key)
        self.size = int(meta["size"])

    def readinto(self, offset: int, buf: memoryview) -> None:
        self.read_batch([(offset, [buf])])

    def read_batch(self, requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        spans: list[tuple[int, list[memoryview]]] = []  # contiguous ranges, their destinations in order
        end = -1
        for offset, bufs in requests:
            flat = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in bufs]
            flat = [b for b in flat if len(b)]
            if not flat:
                continue
            if offset != end:
                spans.append((offset, []))
                end = offset
            spans[-1][1].extend(flat)
            end += sum(len(b) for b in flat)
            if end > self.size:
                raise CorruptCheckpointError(self.path, f"truncated: wanted bytes up to {end}")
        # As few GETs as keep CONCURRENCY of them busy: each request costs a round trip
        # (and some servers read the whole object for any range of it); each streams its
        # body straight into the destinations, so no GET holds more than a chunk.
        total = sum(len(b) for _, bufs in spans for b in bufs)
        pieces = [p for span in spans for p in _cut(span, max(PART, -(-total // CONCURRENCY)))]
        if len(pieces) <= 1:
            for piece in pieces:
                self._fetch(piece)
            return
        # Ranged GETs in parallel: a pool scoped to this call, joined before it returns.
        with concurrent.futures.ThreadPoolExecutor(min(CONCURRENCY, len(pieces))) as pool:
            for future in [pool.submit(self._fetch, p) for p in pieces]:
                future.result()

    def _fetch(self, piece: tuple[int, list[memoryview]]) -> None:
        """Fill the destinations of a range, streamed; a body cut off midway is asked for
        again from where it stopped, with backoff and jitter, until the deadline."""
        start, views = piece
        sink = _Scatter(views)
        deadline, delay = time.monotonic() + self._storage.deadline, 0.1
        while sink.left:
            try:
                self._storage._call(self._stream, self.path, start + sink.filled, sink)
            except RemoteStorageError as exc:
                if exc.permanent or time.monotonic() + delay > deadline:
                    raise
            else:
                if not sink.left:
                    return
                if time.monotonic() + delay > deadline:
                    raise CorruptCheckpointError(self.path, f"truncated: the body at {start} ended short")
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)

    def _stream(self, at: int, sink: _Scatter) -> None:
        obs = _obstore()
        result = obs.get(self._storage.store, self._key, options={"range": (at, at + sink.left)})
        for chunk in result.stream(min_chunk_size=STREAM_CHUNK):
            sink.write(memoryview(chunk), self.path)

    def close(self) -> None:
        pass


def _cut(span: tuple[int, list[memoryview]], size: int) -> list[tuple[int, list[memoryview]]]:
    """A contiguous range cut in pieces of at most ``size`` bytes (a destination may be split)."""
    at, views = span
    pieces: list[tuple[int, list[memoryview]]] = [(at, [])]
    room = size
    for view in views:
        while len(view):
            if not room:
                pieces.append((at, []))
                room = size
            part, view = view[:room], view[room:]
            pieces[-1][1].append(part)
            at, room = at + len(part), room - len(part)
    return pieces


class _Scatter:
    """Destinations filled in order by the chunks of a body."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views, self._i, self._pos = views, 0, 0
        self.filled, self.left = 0, sum(len(v) for v in views)

    def write(self, chunk: memoryview, path: str) -> None:
        if len(chunk) > self.left:
            raise CorruptCheckpointError(path, "a ranged read returned more bytes than asked for")
        while len(chunk):
            view = self._views[self._i]
            n = min(len(view) - self._pos, len(chunk))
            view[self._pos : self._pos + n] = chunk[:n]
            chunk, self._pos = chunk[n:], self._pos + n
            if self._pos == len(view):
                self._i, self._pos = self._i + 1, 0
            self.filled, self.left = self.filled + n, self.left - n


def _sweep_s3(bucket: str, prefix: str, options: dict[str, Any]) -> list[str]:
    try:
        import boto3
    except ImportError:
        return []  # nothing visible is left in any case; the bucket's lifecycle rule takes the parts
    kwargs: dict[str, Any] = {}
    for ours, theirs in (
        ("endpoint", "endpoint_url"),
        ("aws_endpoint", "endpoint_url"),
        ("access_key_id", "aws_access_key_id"),
        ("aws_access_key_id", "aws_access_key_id"),
        ("secret_access_key", "aws_secret_access_key"),
        ("aws_secret_access_key", "aws_secret_access_key"),
        ("region", "region_name"),
        ("aws_region", "region_name"),
    ):
        if ours in options:
            kwargs[theirs] = options[ours]
    client = boto3.client("s3", **kwargs)
    aborted = []
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted.append(upload["Key"])
    return aborted


def _sweep_azure(container: str, prefix: str, options: dict[str, Any]) -> list[str]:
    try:
        from azure.storage.blob import BlobServiceClient
    except ImportError:
        return []  # Azure drops uncommitted blocks itself after a week
    account = options.get("account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    key = options.get("access_key") or os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    endpoint = options.get("endpoint") or f"https://{account}.blob.core.windows.net"
    if not account or not key:
        return []
    client = BlobServiceClient(account_url=endpoint, credential={"account_name": account, "account_key": key})
    swept = []
    box = client.get_container_client(container)
    for blob in box.list_blobs(name_starts_with=prefix, include=["uncommittedblobs"]):
        blob_client = box.get_blob_client(blob.name)
        committed, uncommitted = blob_client.get_block_list("all")
        if uncommitted and not committed and not blob.size:
            blob_client.delete_blob()
            swept.append(blob.name)
    return swept
