"""Which storage a path or URL lives on.

A plain path is local; a URL picks its backend by scheme: ``file://`` is local too,
the object stores (``s3://``, ``gs://``, ``az://`` ...) go through obstore, and any
other scheme fsspec knows (``memory://`` ...) through the fsspec adapter. A URL is
never taken for a local path, and an unknown scheme is a ValueError.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

from .local import LocalStorage
from .protocol import Storage

#: Schemes served by obstore (``backend="fsspec"`` sends them to fsspec instead).
OBJECT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss")

_cache: dict[tuple[str, str, float | None], Storage] = {}
_cache_lock = threading.Lock()
#: The retry deadline of the object stores ``resolve`` makes in this context (None:
#: their own default); see ``object_deadline``.
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("aiosnap_deadline", default=None)


@contextlib.contextmanager
def object_deadline(seconds: float | None) -> Iterator[None]:
    """Within (and in tasks started within): an object-store URL that ``resolve`` turns
    into a storage gets ``deadline=seconds`` (how long a failing call is retried), as
    ``from_url(url, deadline=...)`` would; the command line's ``--deadline``. None
    leaves the default. Storages made elsewhere, and ``storage=`` given, keep theirs."""
    if seconds is not None and not seconds > 0:
        raise ValueError(f"the deadline must be a positive number of seconds, not {seconds!r}")
    token = _deadline.set(seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def scheme_of(path: str) -> str | None:
    head, sep, _ = path.partition("://")
    return head.lower() if sep and head.replace("+", "").replace("-", "").isalnum() else None


def from_url(url: str, **options: Any) -> Storage:
    """The storage for ``url``, configured from ``options`` and the environment
    (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``), as obstore and fsspec read them.

    Args:
        url: A URL of the storage (``s3://bucket/run``: the path part is not used), or a
            local path or ``file://`` URL, which give LocalStorage.
        **options: For ``s3://``, ``gs://`` and ``az://`` (and their aliases), obstore's
            options (``endpoint``, ``region``, ``access_key_id``, ``client_options`` ...)
            plus ``deadline`` and ``part_size`` (see ``ObjectStorage``); for any other
            scheme fsspec knows, its filesystem's options (see ``FsspecStorage``).
            ``backend="fsspec"`` sends an object store to fsspec too (GCS through
            gcsfs, say). A local path takes none.

    Raises:
        ValueError: An unknown scheme, or options for a local path.
    """
    scheme = scheme_of(url)
    if scheme is None or scheme == "file":
        if options:
            raise ValueError(f"local storage takes no options (got {sorted(options)})")
        return LocalStorage()
    backend = options.pop("backend", None)
    if scheme in OBJECT_SCHEMES and backend in (None, "obstore"):
        from .objstore import ObjectStorage

        return ObjectStorage.from_url(url, **options)
    from .fsspec import FsspecStorage, known_protocol

    if known_protocol(scheme) and backend in (None, "fsspec"):
        return FsspecStorage.from_url(url, **options)
    raise ValueError(
        f"{url!r}: unknown storage scheme {scheme!r}; aiosnap knows local paths, file://, "
        f"{', '.join(s + '://' for s in OBJECT_SCHEMES)} (obstore) and the protocols of fsspec, "
        "if it is installed (pip install fsspec)"
    )


def resolve(path: str, storage: Storage | None = None) -> tuple[Storage, str]:
    """The storage ``path`` lives on, and the path in that storage's own form: what
    every function of aiosnap that takes ``path`` and ``storage=`` does first.

    Args:
        path: A local path or a URL.
        storage: The storage to use; None picks it by the URL's scheme (one storage per
            scheme and bucket, made once, configured from the environment).

    Returns:
        ``(storage, path)``: a ``file://`` URL becomes a local path.
    """
    if storage is not None:
        return storage, path
    scheme = scheme_of(path)
    if scheme is None:
        return _default("", ""), path
    if scheme == "file":
        return _default("", ""), path.partition("://")[2]
    deadline = _deadline.get() if scheme in OBJECT_SCHEMES else None
    key = (scheme, _bucket_of(path), deadline)
    with _cache_lock:
        found = _cache.get(key)
        if found is None:
            found = _cache[key] = from_url(path) if deadline is None else from_url(path, deadline=deadline)
    return found, path


def _bucket_of(url: str) -> str:
    return url.partition("://")[2].partition("/")[0]


def _default(scheme: str, bucket: str) -> Storage:
    key = (scheme, bucket, None)
    with _cache_lock:
        found = _cache.get(key)
        if found is None:
            found = _cache[key] = LocalStorage()
    return found
