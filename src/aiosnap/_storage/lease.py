"""The lease of a checkpoint directory on storage without locks (object stores, fsspec
filesystems): a small object ``{"owner", "expires"}`` written only through conditional
replaces, so of two managers racing for it exactly one wins.

A holder renews it every ``ttl / 3``; one that stops (it died, or lost the network)
holds it until ``expires``. A holder known to be dead holds it no longer: the owner
names its host, PID namespace and PID, so a restart on the same host takes over at once
from a process that is gone. Expiry is judged by the clocks of those who read it:
``ttl`` should be long against the clock skew between hosts.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Protocol

from .._base.errors import (
    CheckpointNotFoundError,
    ConflictError,
    DirectoryLockedError,
    LeaseLostError,
    RemoteStorageError,
)
from .protocol import Version


class _Versioned(Protocol):
    def split(self, path: str) -> tuple[str, str]: ...
    def read_versioned(self, path: str) -> tuple[bytes, Version]: ...
    def replace_if(self, path: str, data: bytes, expect: Version | None) -> Version: ...


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:
        return "?"


def _this_process() -> tuple[str, str, int]:
    return socket.gethostname(), _pid_namespace(), os.getpid()


def holder_is_gone(owner: str) -> bool:
    """Whether ``owner`` was a process of this host and PID namespace that has exited.
    Unknown (another host, another container) is not gone."""
    host, namespace, pid, *_ = [*owner.split("|"), "", "", ""]
    here_host, here_namespace, _ = _this_process()
    if host != here_host or namespace != here_namespace or namespace == "?" or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, as another user's process
        return False
    return False


class VersionedLease:
    """Taken in the constructor, or DirectoryLockedError (with ``retry_after`` set while
    the holder might be dead and its lease not yet stale)."""

    def __init__(self, storage: _Versioned, path: str, ttl: float) -> None:
        self._storage, self.path, self.ttl = storage, path, ttl
        host, namespace, pid = _this_process()
        self.owner = f"{host}|{namespace}|{pid}|{os.urandom(4).hex()}"
        self._version: Version | None = None
        try:
            self._version = storage.replace_if(path, self._content(), None)
        except ConflictError:
            self._take_over()

    def _content(self, expires: float | None = None) -> bytes:
        until = time.time() + self.ttl if expires is None else expires
        return json.dumps({"owner": self.owner, "expires": until}).encode()

    def _take_over(self) -> None:
        try:
            raw, version = self._storage.read_versioned(self.path)
        except CheckpointNotFoundError:  # released and deleted meanwhile: start again
            self._version = self._storage.replace_if(self.path, self._content(), None)
            return
        try:
            held = json.loads(raw)
            owner, expires = str(held["owner"]), float(held["expires"])
        except (ValueError, KeyError, TypeError):
            owner, expires = "?", 0.0  # unreadable: nobody can be renewing it
        if owner == self.owner:  # this lease's own create, whose answer was lost and retried
            self._version = version
            return
        if expires > time.time() and not holder_is_gone(owner):
            directory = self._storage.split(self.path)[0]
            raise DirectoryLockedError(
                f"{directory} is in use by another CheckpointManager ({owner.replace('|', ' ')}, renewed "
                f"until {time.strftime('%H:%M:%S', time.localtime(expires))}); open it with "
                "read_only=True to read while it trains",
                retry_after=expires - time.time(),
                expires=expires,
            )
        try:
            self._version = self._storage.replace_if(self.path, self._content(), version)
        except ConflictError:
            raise DirectoryLockedError(f"{self.path}: another manager took the stale lease first") from None

    def renew(self) -> None:
        if self._version is None:
            return
        try:
            self._version = self._storage.replace_if(self.path, self._content(), self._version)
        except ConflictError:
            self._version = None
            raise LeaseLostError(
                f"{self.path}: the lease expired and another manager took it; this one must stop writing"
            ) from None

    def release(self) -> None:
        """Best effort: a lease left behind goes stale after ``ttl`` anyway."""
        version, self._version = self._version, None
        if version is None:
            return
        try:  # expired, written only if it is still ours (there is no conditional delete)
            self._storage.replace_if(self.path, self._content(expires=0.0), version)
        except (ConflictError, RemoteStorageError, CheckpointNotFoundError):
            pass
