"""Moving a committed checkpoint file's bytes from one rank of a group to another.

A replica on a partner node, and a restore that fetches a file its node lacks, both
move whole files between two ranks; files are many GB, so nothing goes through rank 0
(``coord``'s channels) and no file is ever held whole in memory. A ``PeerLink`` is a
gloo group of its own whose pairs connect lazily (only ranks that exchange files
connect); a file streams over it in pieces through two reused page-aligned buffers (the
next piece is read or received while the last one is sent or written), and lands in a
durable upload of the receiver's storage: committed once every byte arrived and the
stream's crc32c matched, aborted otherwise, so no partial file is ever visible.

The protocol of one transfer, on two gloo slots of its tag (``_slots``), each in order:

    sender -> receiver (data):   [size, piece]   the pieces   [crc32c of the stream]
    receiver -> sender (reply):  [GO | REFUSED, expected size]   [COMMITTED | FAILED, 0]

A sender whose file is gone offers [-1, 0] and stops; a receiver that cannot create the
upload answers REFUSED: either end learns it at once, not after the timeout.

The receiver knows the size it expects (the step's manifest) and refuses another before
it allocates anything; the sender learns whether the copy was committed. Every blocking
gloo call runs in a ``run_peer`` thread and waits at most the link's timeout: a peer that
died (its connection closes) or fell silent makes the other end raise PeerTransferError.
A rank runs at most ``PEER_THREADS`` transfers at once: past that, two ranks whose threads
all wait on sends to each other leave no thread to post the receives those wait for (each
transfer holds one thread at a time, so up to that many never starve).
This is the third module that touches torch.distributed (with ``coord`` and ``_shards``).
"""

from __future__ import annotations

import datetime
import logging
import mmap
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, final

import anyio
import torch
import torch.distributed as dist

from .._base import offload as _offload
from .._base.checksums import crc32c
from .._base.errors import PeerTransferError
from .._storage.protocol import ALIGN, Reader, Storage, Upload
from .coord import lazy_group
from .group import DeadlineMissed, reason

logger = logging.getLogger(__name__)

#: The largest piece of a file in one message (and each of the two buffers per transfer).
MAX_PIECE = 64 << 20
#: The largest tag a transfer may have (each takes two gloo slots, see ``_slots``).
MAX_TAG = (1 << 30) - 2
_HELLO = 2 * (MAX_TAG + 1)  # the slot of the partners' greetings (gloo's slots are int32)
_GO, _REFUSED, _COMMITTED, _FAILED = 0, 1, 2, 3
#: The size of an offer of no file (the sender's is gone): the receiver stops at once.
_NO_FILE = -1


async def open_peer_link(
    parent: dist.ProcessGroup | None, silence: float, *, partners: Iterable[int] = ()
) -> PeerLink:
    """A link over the ranks of ``parent`` (the default group if None) whose waits on a
    peer last at most ``silence`` seconds. Collective: every rank of ``parent`` calls it,
    in the same order among its other group creations.

    ``partners``: the ranks this one will exchange files with, connected now (each must
    name this rank too). A pair connects at its first message otherwise, and a first
    message to a rank that died meanwhile waits out gloo's own connect deadline (5 times
    ``silence`` here), where a connection made before is seen closed at once."""
    # Destroyed at close only over all ranks, as ``coord.new_group``'s, for its reason.
    group = await _offload.run_peer(lazy_group, parent, silence)
    link = PeerLink(group, timeout=silence, destroy=parent is None)
    try:
        await _offload.run_peer(link.greet, sorted(set(partners)))
    except BaseException:
        link.close()
        raise
    return link


@final
class PeerLink:
    """A gloo group for whole files between pairs of ranks (see the module docstring).

    Attributes:
        rank: This process's rank in the link (its rank in the parent group).
        size: The ranks of the link.
        timeout: Seconds any one wait on a peer may last.
    """

    def __init__(self, group: dist.ProcessGroup, *, timeout: float, destroy: bool) -> None:
        self.group = group
        self.rank, self.size, self.timeout = group.rank(), group.size(), timeout
        self._destroy = destroy
        #: The wires of failed transfers, with their messages still posted and buffers:
        #: gloo may still read or write those, so they live as long as the group.
        self._stale: list[_Wire] = []
        #: (direction, peer, tag) of transfers in flight, or failed (their slots may still
        #: hold messages of the old stream: never used again on this link).
        self._taken: set[tuple[str, int, int]] = set()

    def close(self) -> None:
        """Release the group, and let go of it here, in the closing thread (a worker
        thread that freed it during the interpreter's shutdown would abort the process:
        see ``GlooTransport.close``). Blocking."""
        group = self.group
        del self.group
        if self._destroy:
            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # the group may be broken already; closing must not fail
                logger.debug("destroying the peer link: %r", exc)
        del group
        self._stale.clear()

    def greet(self, partners: list[int]) -> None:
        """Connect to each of ``partners``: a message each way. Blocking."""
        works = []
        for peer in partners:
            if not 0 <= peer < self.size or peer == self.rank:
                raise ValueError(f"rank {peer} cannot be a partner of rank {self.rank} of {self.size}")
            works.append((peer, self.group.send([torch.zeros(1, dtype=torch.uint8)], peer, _HELLO)))
            works.append((peer, self.group.recv([torch.zeros(1, dtype=torch.uint8)], peer, _HELLO)))
        for peer, work in works:
            try:
                _wait(work, self.timeout)
            except (RuntimeError, DeadlineMissed) as exc:
                raise PeerTransferError(
                    peer, "the peer link", f"rank {peer} {reason(exc, self.timeout)}"
                ) from exc

    def take(self, direction: str, peer: int, tag: int) -> tuple[str, int, int]:
        """Claim a transfer's tag with ``peer``; ValueError if it is in flight or failed."""
        if not 0 <= tag <= MAX_TAG or not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"no transfer with rank {peer} under tag {tag} on a link of {self.size}")
        key = (direction, peer, tag)
        if key in self._taken:
            raise ValueError(f"tag {tag} is in use, or failed, with rank {peer} ({direction})")
        self._taken.add(key)
        return key

    def release(self, key: tuple[str, int, int], wire: _Wire) -> None:
        """A transfer that ended: its tag may be used again, unless a message of it is
        still posted (its last reply, unheard)."""
        if wire.pending:
            self.forsake(wire)
        else:
            self._taken.discard(key)

    def forsake(self, wire: _Wire) -> None:
        """A transfer that failed: its tag stays taken, and what it posted stays alive (a
        thread abandoned by a cancelled caller may still post)."""
        self._stale.append(wire)


def _slots(tag: int) -> tuple[int, int]:
    """The gloo slots of a transfer: its data (sender to receiver) and the receiver's
    replies. Two transfers with the same tag in opposite directions never meet: a slot's
    messages are matched per direction of the pair."""
    return 2 * tag, 2 * tag + 1


@final
class _Wire:
    """One transfer's messages with its peer, posted and waited in order (gloo keeps the
    messages of one slot of one pair in order). Its methods block."""

    def __init__(self, link: PeerLink, peer: int, tag: int, path: str) -> None:
        self.link, self.peer, self.path = link, peer, path
        self.data, self.reply = _slots(tag)
        self.pending: deque[tuple[Any, torch.Tensor]] = deque()

    def step(self, posts: list[tuple[bool, torch.Tensor, int]], keep: int) -> None:
        """Post ``(send?, tensor, slot)`` each, then wait until ``keep`` are pending."""
        for send, tensor, slot in posts:
            # The group is not held across the waits: a thread that a cancelled caller
            # abandoned must never be the one to free it (see ``PeerLink.close``).
            post = self.link.group.send if send else self.link.group.recv
            self.pending.append((post([tensor], self.peer, slot), tensor))
            del post
        while len(self.pending) > keep:
            _wait(self.pending[0][0], self.link.timeout)
            self.pending.popleft()

    async def run(self, posts: list[tuple[bool, torch.Tensor, int]], keep: int = 0) -> None:
        """``step`` in a peer thread; a failure of the transport as PeerTransferError."""
        try:
            await _offload.run_peer(self.step, posts, keep)
        except (RuntimeError, DeadlineMissed) as exc:
            why = f"rank {self.peer} {reason(exc, self.link.timeout)}"
            raise PeerTransferError(self.peer, self.path, why) from exc

    async def ask(self, out: torch.Tensor, back: torch.Tensor) -> None:
        """The sender's side of an exchange: send ``out``, receive the answer in ``back``."""
        await self.run([(True, out, self.data), (False, back, self.reply)])


def _wait(work: Any, timeout: float) -> None:
    try:
        done = work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        # gloo says it timed out only in words ("Timed out waiting 5000ms for recv").
        if "Timed out" in str(exc):
            raise DeadlineMissed(str(exc)) from exc
        raise
    if not done:
        raise DeadlineMissed


def _buffers(size: int, piece: int) -> list[mmap.mmap]:
    """Two page-aligned buffers of one piece (anonymous maps: a local upload writes them
    with O_DIRECT)."""
    n = -(-max(1, min(size, piece)) // ALIGN) * ALIGN
    return [mmap.mmap(-1, n) for _ in range(2)]


def _tensor(buf: mmap.mmap, n: int) -> torch.Tensor:
    """The first ``n`` bytes of ``buf`` as gloo sees them (the tensor keeps ``buf`` alive)."""
    return torch.frombuffer(buf, dtype=torch.uint8, count=n)


def _pieces(size: int, piece: int) -> list[tuple[int, int]]:
    return [(offset, min(piece, size - offset)) for offset in range(0, size, piece)]


async def send_file(
    link: PeerLink,
    dst: int,
    tag: int,
    storage: Storage,
    path: str,
    *,
    piece: int = MAX_PIECE,
    on_piece: Callable[[int], object] | None = None,
) -> int:
    """Stream the committed file at ``path`` to rank ``dst``, which calls ``recv_file``
    with the same ``tag`` (one not in flight between the two in this direction); return
    once ``dst`` committed it, with the bytes sent. ``on_piece(n)`` after each piece
    ``dst`` took. PeerTransferError if the peer refused the file, failed to commit it, died
    or fell silent for the link's timeout."""
    if not 0 < piece <= MAX_PIECE:
        raise ValueError(f"a piece of {piece} bytes: 1 to {MAX_PIECE}")
    key = link.take("send", dst, tag)
    wire = _Wire(link, dst, tag, path)
    try:
        with anyio.CancelScope(shield=True):  # opened, it is closed below
            reader: Reader = await _offload.run_io(storage.open_read, path)
    except BaseException:
        # The receiver waits for an offer: told there is none, it stops now, not after
        # the link's timeout (a file retention removed before its copy was made).
        with anyio.CancelScope(shield=True):
            await _decline(wire)
        link.forsake(wire)
        raise
    try:
        await _offer(wire, reader.size, piece)
        crc = await _stream_out(wire, reader, piece, on_piece)
        await _finish_send(wire, crc)
    except BaseException:
        link.forsake(wire)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await _offload.run_io(reader.close)
    link.release(key, wire)
    return reader.size


async def _decline(wire: _Wire) -> None:
    """Tell the receiver that no file comes (an offer of no size); a courtesy, as ``_tell``."""
    try:
        await wire.run([(True, torch.tensor([_NO_FILE, 0], dtype=torch.int64), wire.data)])
    except PeerTransferError as exc:
        logger.debug("%s", exc)


async def _offer(wire: _Wire, size: int, piece: int) -> None:
    answer = torch.zeros(2, dtype=torch.int64)
    await wire.ask(torch.tensor([size, piece], dtype=torch.int64), answer)
    status, expected = (int(x) for x in answer)
    if status != _GO:
        why = f"expects {expected} bytes" if status == _REFUSED else f"answered {status}"
        raise PeerTransferError(
            wire.peer, wire.path, f"rank {wire.peer} refused the file of {size} bytes: it {why}"
        )


async def _stream_out(
    wire: _Wire, reader: Reader, piece: int, on_piece: Callable[[int], object] | None
) -> int:
    """Send the pieces, each read while the one before is sent; the stream's crc32c."""
    bufs, crc = _buffers(reader.size, piece), 0
    pieces = _pieces(reader.size, piece)
    for k, (offset, n) in enumerate(pieces):
        buf = bufs[k % 2]  # the send of piece k-2 from it is done: at most one is pending
        crc = await _offload.run_io(_read, reader, offset, memoryview(buf)[:n], crc)
        await wire.run([(True, _tensor(buf, n), wire.data)], keep=1)
        if k and on_piece is not None:
            on_piece(pieces[k - 1][1])
    await wire.run([], keep=0)
    if pieces and on_piece is not None:
        on_piece(pieces[-1][1])
    return crc


def _read(reader: Reader, offset: int, view: memoryview, crc: int) -> int:
    reader.readinto(offset, view)
    return int(crc32c(view, crc))


async def _finish_send(wire: _Wire, crc: int) -> None:
    verdict = torch.zeros(2, dtype=torch.int64)
    await wire.ask(torch.tensor([crc, 0], dtype=torch.int64), verdict)
    if int(verdict[0]) != _COMMITTED:
        why = "its copy failed the stream's crc32c, or could not be written"
        raise PeerTransferError(wire.peer, wire.path, f"rank {wire.peer} did not commit the file: {why}")


async def recv_file(
    link: PeerLink,
    src: int,
    tag: int,
    storage: Storage,
    path: str,
    *,
    expected_size: int,
    on_piece: Callable[[int], object] | None = None,
) -> int:
    """Receive the file rank ``src`` sends with ``send_file`` under ``tag`` into a durable
    upload at ``path``, committed once whole and checked; the bytes received.
    ``on_piece(n)`` after each piece is written. PeerTransferError, with nothing at
    ``path``, if ``src`` announces another size than ``expected_size`` (refused before
    anything is allocated), sends bytes whose crc32c is not the stream's, dies or falls
    silent for the link's timeout; an error of the storage is raised as it is."""
    key = link.take("recv", src, tag)
    wire = _Wire(link, src, tag, path)
    try:
        size, piece = await _accept(wire, expected_size)
        try:
            with anyio.CancelScope(shield=True):  # created, it is committed or aborted below
                upload: Upload = await _offload.run_io(storage.create, path, size)
        except BaseException:
            with anyio.CancelScope(shield=True):  # the sender stops now, not after the timeout
                await _answer(wire, _REFUSED, expected_size)
            raise
        await _answer(wire, _GO, expected_size)
    except BaseException:
        link.forsake(wire)
        raise
    try:
        crc = await _stream_in(wire, upload, size, piece, on_piece)
        await _check_and_commit(wire, upload, crc)
    except BaseException:
        link.forsake(wire)
        with anyio.CancelScope(shield=True):
            await _offload.run_io(upload.abort)
        raise
    link.release(key, wire)
    return size


async def _accept(wire: _Wire, expected: int) -> tuple[int, int]:
    """The announced size and piece, if they are the ones expected (the answer, GO, once
    the upload is made: ``_answer``); else REFUSED, and raised. An offer of no file is
    raised at once (the sender waits for no answer)."""
    header = torch.zeros(2, dtype=torch.int64)
    await wire.run([(False, header, wire.data)])
    size, piece = (int(x) for x in header)
    if size == _NO_FILE:
        raise PeerTransferError(wire.peer, wire.path, f"rank {wire.peer} has no such file to send")
    fault = None
    if size != expected:
        fault = f"rank {wire.peer} announced {size} bytes where {expected} were expected"
    elif not 0 < piece <= MAX_PIECE:
        fault = f"rank {wire.peer} announced pieces of {piece} bytes (1 to {MAX_PIECE})"
    if fault is not None:
        await _answer(wire, _REFUSED, expected)
        raise PeerTransferError(wire.peer, wire.path, f"refused: {fault}")
    return size, piece


async def _answer(wire: _Wire, status: int, expected: int) -> None:
    await wire.run([(True, torch.tensor([status, expected], dtype=torch.int64), wire.reply)])


async def _stream_in(
    wire: _Wire, upload: Upload, size: int, piece: int, on_piece: Callable[[int], object] | None
) -> int:
    """Receive the pieces, each written while the next arrives; their crc32c."""
    bufs, crc = _buffers(size, piece), 0
    pieces = _pieces(size, piece)
    if pieces:
        await wire.run([(False, _tensor(bufs[0], pieces[0][1]), wire.data)], keep=1)
    for k, (offset, n) in enumerate(pieces):
        nxt = (
            [(False, _tensor(bufs[(k + 1) % 2], pieces[k + 1][1]), wire.data)] if k + 1 < len(pieces) else []
        )
        await wire.run(nxt, keep=len(nxt))  # piece k is in; k+1 is on its way
        crc = await _offload.run_io(_write, upload, offset, memoryview(bufs[k % 2])[:n], crc)
        if on_piece is not None:
            on_piece(n)
    return crc


def _write(upload: Upload, offset: int, view: memoryview, crc: int) -> int:
    crc = int(crc32c(view, crc))
    upload.write_at(offset, view)
    return crc


async def _check_and_commit(wire: _Wire, upload: Upload, crc: int) -> None:
    """Commit if the trailer's crc32c is the stream's, and tell the sender either way."""
    trailer = torch.zeros(2, dtype=torch.int64)
    await wire.run([(False, trailer, wire.data)])
    if int(trailer[0]) != crc:
        await _tell(wire, _FAILED)
        sent = int(trailer[0])
        fault = f"the bytes received have crc32c {crc:#010x}, rank {wire.peer} sent {sent:#010x}"
        raise PeerTransferError(wire.peer, wire.path, fault)
    try:
        await _offload.run_io(upload.commit)
    except BaseException:
        await _tell(wire, _FAILED)
        raise
    await _tell(wire, _COMMITTED)


async def _tell(wire: _Wire, status: int) -> None:
    """Tell the sender how its file ended. A courtesy: what this end raises, or that its
    copy is whole, checked and committed, stands whether the sender hears it or not (a
    sender that does not raises PeerTransferError itself)."""
    with anyio.CancelScope(shield=True):
        try:
            await wire.run([(True, torch.tensor([status, 0], dtype=torch.int64), wire.reply)])
        except PeerTransferError as exc:
            logger.debug("%s", exc)
