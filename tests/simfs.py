"""An in-memory filesystem that knows what is durable: power-loss simulation.

``SimFS`` stands in for the system calls of LocalStorage (``aiosnap.storage.Posix``).
Every file keeps its current bytes, its durable bytes, and the writes made since its
last fsync; every directory keeps its current entries, its durable entries, and the
entry changes (create, rename, unlink) made since its last fsync. That is what POSIX
promises and no more: fsync of a file makes its data durable, not its name; fsync of
a directory makes its entries durable, not the data of the files they name.

Before each system call the state is snapshotted. ``crash_states(snapshot)`` then gives
every state the disk may hold after a power loss at that point: the durable state with
any subset of the pending operations applied, in their order (each directory's entry
changes and each file's writes reach the disk independently). Small cases are
enumerated exhaustively; larger ones are sampled.
"""

from __future__ import annotations

import copy
import errno
import itertools
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiosnap.storage import FileStat, Posix


@dataclass
class Node:
    ino: int
    is_dir: bool
    data: bytearray = field(default_factory=bytearray)  # files: the current bytes
    durable: bytes = b""
    entries: dict[str, int] = field(default_factory=dict)  # directories: the current entries
    durable_entries: dict[str, int] = field(default_factory=dict)
    pending: list[tuple[Any, ...]] = field(default_factory=list)  # since the last fsync
    changes: int = 0  # bumps the version on every change


@dataclass
class State:
    nodes: dict[int, Node]
    root: int
    next_ino: int


def _err(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


class SimFS(Posix):
    """The calls of ``Posix`` on an in-memory tree rooted at ``root`` (an absolute path)."""

    def __init__(self, root: str, state: State | None = None) -> None:
        self.root = root.rstrip("/")
        if state is None:
            top = Node(1, True)
            state = State({1: top}, 1, 2)
        self.state = state
        self._fds: dict[int, tuple[int, str]] = {}
        self._next_fd = 1000
        self._lock = threading.RLock()
        #: Snapshots taken before each call, when ``recording``.
        self.snapshots: list[tuple[str, str, State]] = []
        self.recording = False

    # -- paths -----------------------------------------------------------------------------
    def _parts(self, path: str) -> list[str]:
        path = os.path.normpath(path)
        if path != self.root and not path.startswith(self.root + "/"):
            raise _err(errno.ENOENT, path)
        rest = path[len(self.root) :].strip("/")
        return [p for p in rest.split("/") if p]

    def _lookup(self, path: str) -> Node | None:
        node = self.state.nodes[self.state.root]
        for part in self._parts(path):
            if not node.is_dir or part not in node.entries:
                return None
            node = self.state.nodes[node.entries[part]]
        return node

    def _parent(self, path: str) -> tuple[Node, str]:
        parts = self._parts(path)
        if not parts:
            raise _err(errno.EEXIST, path)
        parent = self._lookup(os.path.join(self.root, *parts[:-1]))
        if parent is None or not parent.is_dir:
            raise _err(errno.ENOENT, path)
        return parent, parts[-1]

    def _new(self, is_dir: bool) -> Node:
        node = Node(self.state.next_ino, is_dir)
        self.state.nodes[node.ino] = node
        self.state.next_ino += 1
        return node

    def _before(self, op: str, path: str) -> None:
        if self.recording:
            self.snapshots.append((op, path, copy.deepcopy(self.state)))

    # -- files -----------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        with self._lock:
            self._before("open", path)
            if flags & getattr(os, "O_DIRECT", 0):
                raise _err(errno.EINVAL, path)  # as tmpfs: buffered writes instead
            node = self._lookup(path)
            if node is None:
                if not flags & os.O_CREAT:
                    raise _err(errno.ENOENT, path)
                parent, name = self._parent(path)
                node = self._new(False)
                parent.entries[name] = node.ino
                parent.pending.append(("link", name, node.ino))
                parent.changes += 1
            elif flags & os.O_CREAT and flags & os.O_EXCL:
                raise _err(errno.EEXIST, path)
            if node.is_dir and flags & (os.O_WRONLY | os.O_RDWR):
                raise _err(errno.EISDIR, path)
            fd = self._next_fd
            self._next_fd += 1
            self._fds[fd] = (node.ino, path)
            return fd

    def _node(self, fd: int) -> Node:
        if fd not in self._fds:
            raise _err(errno.EBADF, str(fd))
        return self.state.nodes[self._fds[fd][0]]

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        with self._lock:
            self._before("write", self._fds.get(fd, (0, ""))[1])
            node = self._node(fd)
            raw = bytes(data)
            _apply(node.data, ("write", offset, raw))
            node.pending.append(("write", offset, raw))
            node.changes += 1
            return len(raw)

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        with self._lock:
            node = self._node(fd)
            done = 0
            for buf in bufs:
                piece = node.data[offset + done : offset + done + len(buf)]
                buf[: len(piece)] = piece
                done += len(piece)
                if len(piece) < len(buf):
                    break
            return done

    def ftruncate(self, fd: int, size: int) -> None:
        with self._lock:
            self._before("truncate", self._fds.get(fd, (0, ""))[1])
            node = self._node(fd)
            _apply(node.data, ("truncate", size))
            node.pending.append(("truncate", size))
            node.changes += 1

    def fsync(self, fd: int) -> None:
        with self._lock:
            self._before("fsync", self._fds.get(fd, (0, ""))[1])
            self._sync(self._node(fd))

    def _sync(self, node: Node) -> None:
        if node.is_dir:
            node.durable_entries = dict(node.entries)
        else:
            node.durable = bytes(node.data)
        node.pending.clear()

    def close(self, fd: int) -> None:
        with self._lock:
            self._node(fd)
            del self._fds[fd]

    def fstat(self, fd: int) -> FileStat:
        with self._lock:
            return self._stat(self._node(fd))

    def _stat(self, node: Node) -> FileStat:
        size = len(node.data)
        return FileStat(node.is_dir, size, f"{node.ino}-{node.changes}-{size}")

    def flock(self, fd: int, *, exclusive: bool = True, wait: bool = False) -> None:
        self._node(fd)  # one process: nothing else can hold it

    # -- names -----------------------------------------------------------------------------
    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            self._before("rename", dst)
            sparent, sname = self._parent(src)
            dparent, dname = self._parent(dst)
            if sname not in sparent.entries:
                raise _err(errno.ENOENT, src)
            assert sparent is dparent, "the simulation renames within a directory only"
            sparent.entries[dname] = sparent.entries.pop(sname)
            sparent.pending.append(("rename", sname, dname))
            sparent.changes += 1

    def unlink(self, path: str) -> None:
        with self._lock:
            self._before("unlink", path)
            parent, name = self._parent(path)
            node = self._lookup(path)
            if node is None:
                raise _err(errno.ENOENT, path)
            if node.is_dir:
                raise _err(errno.EISDIR, path)
            del parent.entries[name]
            parent.pending.append(("unlink", name))
            parent.changes += 1

    def mkdir(self, path: str) -> None:
        with self._lock:
            self._before("mkdir", path)
            parent, name = self._parent(path)
            if name in parent.entries:
                raise _err(errno.EEXIST, path)
            node = self._new(True)
            parent.entries[name] = node.ino
            parent.pending.append(("link", name, node.ino))
            parent.changes += 1

    def rmdir(self, path: str) -> None:
        with self._lock:
            self._before("rmdir", path)
            parent, name = self._parent(path)
            node = self._lookup(path)
            if node is None:
                raise _err(errno.ENOENT, path)
            if node.entries:
                raise _err(errno.ENOTEMPTY, path)
            del parent.entries[name]
            parent.pending.append(("unlink", name))
            parent.changes += 1

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            self._before("dirsync", path)
            node = self._lookup(path)
            if node is None or not node.is_dir:
                raise _err(errno.ENOENT, path)
            self._sync(node)

    def stat(self, path: str) -> FileStat | None:
        with self._lock:
            try:
                node = self._lookup(path)
            except OSError:
                return None
            return None if node is None else self._stat(node)

    def lstat(self, path: str) -> FileStat | None:
        return self.stat(path)  # no symbolic links here

    def scandir(self, path: str) -> list[tuple[str, FileStat]]:
        with self._lock:
            node = self._lookup(path)
            if node is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            if not node.is_dir:
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
            return [(name, self._stat(self.state.nodes[ino])) for name, ino in sorted(node.entries.items())]

    def free_bytes(self, path: str) -> int | None:
        return None


def _apply(data: bytearray, op: tuple[Any, ...]) -> None:
    if op[0] == "write":
        _, offset, raw = op
        if len(data) < offset:
            data.extend(bytes(offset - len(data)))
        data[offset : offset + len(raw)] = raw
    else:
        del data[op[1] :]
        data.extend(bytes(max(0, op[1] - len(data))))


def _pending_ops(state: State) -> list[tuple[int, int]]:
    """Every operation that may or may not have reached the disk: (inode, index)."""
    return [(ino, i) for ino, node in sorted(state.nodes.items()) for i in range(len(node.pending))]


def _after_power_loss(state: State, survived: set[tuple[int, int]]) -> State:
    """The durable state, with the ``survived`` pending operations applied in order."""
    nodes = {}
    for ino, node in state.nodes.items():
        kept = [op for i, op in enumerate(node.pending) if (ino, i) in survived]
        fresh = Node(ino, node.is_dir, changes=node.changes)
        if node.is_dir:
            entries = dict(node.durable_entries)
            for op in kept:
                if op[0] == "link":
                    entries[op[1]] = op[2]
                elif op[0] == "unlink":
                    entries.pop(op[1], None)
                elif op[1] in entries:  # a rename of an entry that is on the disk
                    entries[op[2]] = entries.pop(op[1])
            fresh.entries, fresh.durable_entries = dict(entries), dict(entries)
        else:
            data = bytearray(node.durable)
            for op in kept:
                _apply(data, op)
            fresh.data, fresh.durable = data, bytes(data)
        nodes[ino] = fresh
    return State(nodes, state.root, state.next_ino)


def crash_states(
    state: State, *, exhaustive_up_to: int = 8, samples: int = 48, seed: int = 0
) -> Iterator[State]:
    """Every state the disk may be in after a power loss in ``state`` (sampled when more
    than ``exhaustive_up_to`` operations are pending; the two extremes always)."""
    pending = _pending_ops(state)
    if len(pending) <= exhaustive_up_to:
        choices: Iterator[tuple[int, ...]] = itertools.product((0, 1), repeat=len(pending))
    else:
        rng = random.Random(seed)
        extremes = [(0,) * len(pending), (1,) * len(pending)]
        sampled = (tuple(rng.randint(0, 1) for _ in pending) for _ in range(samples))
        choices = itertools.chain(extremes, sampled)
    for choice in choices:
        yield _after_power_loss(state, {op for op, keep in zip(pending, choice, strict=True) if keep})
