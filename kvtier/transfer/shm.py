"""The shared-memory transfer channel (same machine): payloads never go through the socket.

Both ends share :class:`kvtier.memory.shared_segment.SharedSegment` mappings (like ``kvtier server``'s
CPU pool): a segment's file descriptor travels once over the channel's Unix socket
(``SCM_RIGHTS``, a :class:`~kvtier.transfer.frames.Segment` frame) and the peer maps it.
Then only small :class:`~kvtier.transfer.frames.Chunk` frames (key, size, xxh3-64, segment,
offset) cross the socket; the receiver copies each payload once, from the mapping into
the caller's destination, and verifies what it wrote (:mod:`kvtier.transfer.verify`).

Where the payload comes from:

- a payload inside a segment shared with :meth:`ShmChannel.share_segment` (e.g. the
  pool of ``kvtier server``) is read in place: one copy in all;
- any other payload is first copied into this end's *staging* segment (a ring of
  ``staging_bytes``, sparse: pages are backed when first written; a batch cycles through
  its first ``STAGING_WINDOW_BYTES`` only, or its largest payload, so the same warm pages
  serve every batch), so sender and receiver copy concurrently; the receiver's
  :class:`~kvtier.transfer.frames.ChunkAck` per chunk frees its ring space.

``send`` returns once every chunk is acknowledged, so the payload memory may change
afterwards. A mapping of a peer that died stays valid (the kernel keeps the memory
while mapped); its chunks in flight end with :class:`PeerGone`.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections import deque
from typing import Sequence

import numpy as np

from kvtier.memory.shared_segment import SharedSegment
from kvtier.transfer.channel import (
    DEFAULT_TIMEOUT_S,
    Deadline,
    InSlot,
    OutChunk,
    buffer_address,
    check_in_slots,
    check_out_chunks,
    payload_digest,
)
from kvtier.transfer.errors import ProtocolError, TransferError
from kvtier.transfer.frames import Batch, Chunk, ChunkAck, Segment, encode_frame
from kvtier.transfer.stream import StreamChannel, check_same_user
from kvtier.transfer.verify import Check, Verifier, copy_and_hash

#: Default bytes of the staging ring (sparse): the largest payload a private buffer may hold.
DEFAULT_STAGING_BYTES = 256 << 20
#: Bytes of the ring one batch cycles through (more only for a larger payload). The same
#: pages are reused batch after batch: a fresh page costs a fault on both ends (on the VMs
#: measured here, a 23-chunk batch reaching 36 MiB of never-touched ring pages took 80 ms
#: instead of 21), and a few chunks in flight already keep the receiver busy.
STAGING_WINDOW_BYTES = 32 << 20
#: Most chunks sent and not yet acknowledged. The receiver writes acks while the sender writes
#: frames: unbounded, a batch of thousands of small chunks filled both socket buffers and both
#: ends blocked until the timeout. A Unix socket charges each write's buffer (~1 KiB for a small
#: frame or ack, not its bytes) to the sender's 208 KiB send buffer: 64 writes each way fit.
MAX_UNACKED_CHUNKS = 64
#: Most segments one peer may share.
MAX_PEER_SEGMENTS = 64


class ShmChannel(StreamChannel):
    """One end of a shared-memory transfer link (see the module docstring).

    Args:
        sock: a connected Unix stream socket (owned from now on).
        timeout_s: default bound of each call, seconds.
        staging_bytes: size of the staging ring; a payload larger than it cannot be sent
            unless it lies in a shared segment.
    """

    kind = "shm"
    #: Whether received chunks lying in a segment the peer shared may go two at a time (one
    #: copied and hashed on a helper thread, :mod:`kvtier.transfer.verify`). False: every
    #: chunk is copied and hashed on the calling thread (one core; e.g. beside a busy engine).
    #: Also off for a call from a thread that may run on one CPU only (e.g. a vLLM CPU
    #: engine's threads, pinned to the engine's core): the helper thread would only take
    #: turns with it on that core, paying GIL hand-offs for nothing.
    overlap: bool = True

    def __init__(self, sock: socket.socket, timeout_s: float = DEFAULT_TIMEOUT_S,
                 staging_bytes: int = DEFAULT_STAGING_BYTES):
        super().__init__(sock, timeout_s, pass_fds=True)
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        self.staging_bytes = staging_bytes
        self._mine: dict[int, tuple[int, int]] = {}  # segment id -> (address, size), shared by us
        self._staging: SharedSegment | None = None
        self._staging_id = -1
        self._theirs: dict[int, SharedSegment] = {}
        self._verifier = Verifier()
        self._their_staging: set[int] = set()  # the peer's staging-ring segment ids

    @classmethod
    def connect(cls, path: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                staging_bytes: int = DEFAULT_STAGING_BYTES, auth: object = None) -> "ShmChannel":
        """Dial a :class:`ShmListener` at ``path`` and exchange hellos (with ``auth``, a
        :class:`~kvtier.transfer.peer_auth.ClientAuth`: authenticated, see :meth:`handshake`).

        Raises:
            PeerRefused: the listener runs as another user, or refused this end.
            TransferError: cannot connect, or the peer is not a shared-memory channel.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise TransferError(f"cannot connect to shm transfer peer {path}: {exc}") from None
        try:
            check_same_user(sock, f"shm transfer peer {path}")
        except TransferError:
            sock.close()
            raise
        chan = cls(sock, timeout_s, staging_bytes)
        chan.handshake(auth=auth)
        return chan

    @classmethod
    def pair(cls, timeout_s: float = DEFAULT_TIMEOUT_S,
             staging_bytes: int = DEFAULT_STAGING_BYTES) -> tuple["ShmChannel", "ShmChannel"]:
        """Two connected ends in this process (tests; threads)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(a, timeout_s, staging_bytes), cls(b, timeout_s, staging_bytes)

    # -- segments --------------------------------------------------------------------
    def share_segment(self, segment: SharedSegment, timeout_s: float | None = None) -> int:
        """Let the peer map ``segment`` (server side: it owns an fd); payloads inside it are
        then sent without any copy on this side. Returns the segment's id on this link.

        Raises:
            ValueError: the segment has no file descriptor (an attached, client-side segment).
            TransferError: timeout or the peer gone.
        """
        if segment.fd is None:
            raise ValueError("only a segment that owns its file descriptor can be shared")
        seg_id = len(self._mine)
        try:
            self._send_views([encode_frame(Segment(segment_id=seg_id, nbytes=segment.size))],
                             self._deadline(timeout_s), fds=[segment.fd])
        except (OSError, TransferError) as exc:
            raise self._fail(exc) from None
        self._mine[seg_id] = (int(segment.array.ctypes.data), segment.size)
        return seg_id

    def _on_segment(self, msg: Segment, fd: int) -> None:
        if msg.segment_id in self._theirs or len(self._theirs) >= MAX_PEER_SEGMENTS:
            os.close(fd)
            raise ProtocolError(f"segment {msg.segment_id} shared twice or too many segments")
        try:
            self._theirs[msg.segment_id] = SharedSegment.attach_fd(fd, msg.nbytes, writable=False)  # closes fd
            if msg.staging:
                self._their_staging.add(msg.segment_id)
        except (OSError, ValueError) as exc:
            raise ProtocolError(f"cannot map the peer's segment {msg.segment_id}: {exc}") from None

    def peer_segment(self, segment_id: int) -> np.ndarray:
        """The peer's segment ``segment_id`` as mapped here (``uint8 [size]``; benches, diagnostics).

        Raises:
            KeyError: the peer has not shared that segment (yet).
        """
        return self._theirs[segment_id].array

    def _locate(self, mv: memoryview) -> tuple[int, int]:
        """(segment id, offset) of a payload lying in a shared segment, else (-1, -1)."""
        addr, n = buffer_address(mv), len(mv)
        for seg_id, (base, size) in self._mine.items():
            if base <= addr and addr + n <= base + size and seg_id != self._staging_id:
                return seg_id, addr - base
        return -1, -1

    # -- send ------------------------------------------------------------------------
    def send(self, chunks: Sequence[OutChunk], timeout_s: float | None = None) -> list[bool]:
        """See :meth:`TransferChannel.send`; payloads in shared segments are not copied."""
        items = check_out_chunks(chunks)
        deadline = self._deadline(timeout_s)
        batch_id = self._begin_batch()
        placed = [self._locate(it[1]) for it in items]
        if any(s < 0 and len(mv) > self.staging_bytes for (s, _), (_, mv, _) in zip(placed, items)):
            raise ValueError(f"a payload larger than the staging ring ({self.staging_bytes} bytes) "
                             "must lie in a shared segment")
        received = [False] * len(items)
        ring: deque[tuple[int, int, int]] = deque()  # (chunk index, start, end) staged, not yet acked
        acked = 0
        try:
            staged = [len(mv) for (s, _), (_, mv, _) in zip(placed, items) if s < 0 and len(mv)]
            if staged:
                self._ensure_staging(deadline)
            ring_bytes = min(self.staging_bytes, max(STAGING_WINDOW_BYTES, max(staged, default=0)))
            # Frames of chunks that cost nothing to describe (in a shared segment, checksum
            # given) leave together in one write: the receiver finds the next frame ready
            # and copies two chunks at once instead of waiting for this process to run.
            out = [encode_frame(Batch(batch_id=batch_id, count=len(items)))]
            for i, ((key, mv, given), (seg_id, offset)) in enumerate(zip(items, placed)):
                if i - acked >= MAX_UNACKED_CHUNKS:  # frames go one way, acks the other: bound both
                    self._send_views(out, deadline)
                    out = []
                    while i - acked >= MAX_UNACKED_CHUNKS // 2:
                        acked = self._take_ack(batch_id, acked, received, ring, deadline)
                if seg_id < 0 and len(mv):
                    self._send_views(out, deadline)
                    out = []
                    while (start := self._ring_place(ring, len(mv), ring_bytes)) < 0:
                        acked = self._take_ack(batch_id, acked, received, ring, deadline)
                    ring.append((i, start, start + len(mv)))
                    assert self._staging is not None
                    src = np.frombuffer(mv, dtype=np.uint8)
                    dst = self._staging.array[start : start + len(mv)]
                    digest = copy_and_hash(src, dst) if given is None else given
                    if given is not None:
                        np.copyto(dst, src)
                    seg_id, offset = self._staging_id, start
                    flush = True
                else:
                    if given is None and len(mv):
                        self._send_views(out, deadline)  # let the receiver start while this hashes
                        out = []
                    digest = payload_digest(mv, given)
                    flush = False
                out.append(encode_frame(Chunk(index=i, key=key, nbytes=len(mv), checksum=digest,
                                              segment_id=seg_id, offset=offset)))
                if flush:
                    self._send_views(out, deadline)
                    out = []
            self._send_views(out, deadline)
            while acked < len(items):
                acked = self._take_ack(batch_id, acked, received, ring, deadline)
        except (OSError, TransferError) as exc:
            raise self._fail(exc) from None
        self._count_sent(items, received)
        return received

    def _ensure_staging(self, deadline: Deadline) -> None:
        if self._staging is None:
            seg = SharedSegment.create(self.staging_bytes, name="kvtier-transfer", sparse=True)
            self._staging = seg
            self._send_views([encode_frame(Segment(segment_id=len(self._mine), nbytes=seg.size, staging=True))], deadline,
                             fds=[seg.fd] if seg.fd is not None else [])
            self._staging_id = len(self._mine)
            self._mine[self._staging_id] = (int(seg.array.ctypes.data), seg.size)

    @staticmethod
    def _ring_place(ring: deque[tuple[int, int, int]], n: int, ring_bytes: int) -> int:
        """Start of ``n`` free bytes in the first ``ring_bytes`` of the staging ring, or -1 until an ack frees space."""
        if not ring:
            return 0
        head, tail = ring[0][1], ring[-1][2]
        if ring[-1][1] >= head:  # not wrapped: [head, tail) in use
            if tail + n <= ring_bytes:
                return tail
            return 0 if n <= head else -1
        return tail if tail + n <= head else -1

    def _take_ack(self, batch_id: int, acked: int, received: list[bool],
                  ring: deque[tuple[int, int, int]], deadline: Deadline) -> int:
        ack = self._recv_msg(deadline)
        if not isinstance(ack, ChunkAck) or ack.batch_id != batch_id or ack.index != acked:
            raise ProtocolError(f"expected the ack of chunk {acked} of batch {batch_id}, got {ack!r:.80}")
        received[acked] = ack.ok
        if ring and ring[0][0] == acked:
            ring.popleft()
        return acked + 1

    # -- receive ---------------------------------------------------------------------
    def recv_into(self, dests: Sequence[InSlot], timeout_s: float | None = None) -> list[bool]:
        """See :meth:`TransferChannel.recv_into`; one copy from the peer's mapping per chunk.

        Chunks in a segment the peer shared are shared between two threads: the helper
        thread copies and hashes one (:mod:`kvtier.transfer.verify`) while this thread
        copies and hashes the next ones whose frames are already here; once the helper
        is done it takes the next chunk. Chunks in the peer's staging ring are done here
        (the sender is busy copying) and acknowledged at once (it frees ring space). Acks
        of other chunks leave in chunk order, gathered into one write whenever this end
        would otherwise wait for the next frame (and at the end), so a sender whose chunks
        need no ring space is not woken once per chunk. Every earlier chunk is settled and
        acknowledged before blocking, so a sender waiting for ring space never waits on
        this end.
        """
        views, index = check_in_slots(dests)
        deadline = self._deadline(timeout_s)
        result = [False] * len(views)
        overlap = self.overlap and _may_use_two_cpus()
        unacked: list[Check] = []  # copied, in chunk order; only unacked[0] may still run on the helper
        acks: list[bytes] = []  # ack frames not yet sent, in chunk order
        try:
            batch = self._recv_batch(deadline)
            batch_id = batch.batch_id
            for expect in range(batch.count):
                if unacked and unacked[0].ready:
                    unacked = self._settle(unacked, batch_id, result, deadline, acks)
                if not self._frame_ready():
                    unacked = self._settle(unacked, batch_id, result, deadline, acks)
                    acks = self._flush(acks, deadline)
                chunk = self._recv_chunk(batch, expect, deadline)
                src = self._source(chunk)
                i = self._slot_for(chunk.key, chunk.nbytes, views, index)
                if i is None or (unacked and unacked[0].slot == i):  # never two writers on one slot
                    unacked = self._settle(unacked, batch_id, result, deadline, acks)
                if i is None:
                    acks.append(encode_frame(ChunkAck(batch_id=batch_id, index=expect, ok=False)))
                    continue
                check = self._verifier.copy(expect, i, src, np.frombuffer(views[i], dtype=np.uint8), chunk.checksum,
                                            overlap=overlap and not unacked
                                            and chunk.segment_id not in self._their_staging)
                unacked.append(check)
                if unacked[0].done:  # nothing on the helper: settle now
                    unacked = self._settle(unacked, batch_id, result, deadline, acks)
                    if chunk.segment_id in self._their_staging:  # the sender may be waiting for its ring space
                        acks = self._flush(acks, deadline)
            self._settle(unacked, batch_id, result, deadline, acks)
            unacked = []
            acks = self._flush(acks, deadline)
        except (OSError, TransferError) as exc:
            for c in unacked:  # copied before the failure: counts once verified
                if not c.recorded:
                    with contextlib.suppress(TransferError):
                        self._record(c, result, c.wait(deadline.at - time.monotonic() + 1.0))
                        c.recorded = True
            raise self._fail(exc, received=result) from None
        return result

    def _frame_ready(self) -> bool:
        """Whether bytes of the next frame are already waiting on the socket (no blocking)."""
        return bool(select.select([self._live()], [], [], 0)[0])

    def _record(self, check: Check, result: list[bool], ok: bool) -> None:
        result[check.slot] = ok
        self._count_received(ok, check.nbytes)

    def _settle(self, checks: Sequence[Check], batch_id: int, result: list[bool], deadline: Deadline,
                acks: list[bytes]) -> list[Check]:
        """Wait for each check's hash (in order), record it and append its ack frame to ``acks``
        (sent by :meth:`_flush`); returns a new empty list (nothing unsettled).

        A check counts as recorded once its hash is known, even if its ack then fails.
        """
        for check in checks:
            ok = check.wait(deadline.remaining())
            self._record(check, result, ok)
            check.recorded = True
            acks.append(encode_frame(ChunkAck(batch_id=batch_id, index=check.index, ok=ok)))
        return []

    def _flush(self, acks: list[bytes], deadline: Deadline) -> list[bytes]:
        """Send the gathered ack frames in one write; returns a new empty list."""
        if acks:
            self._send_views([b"".join(acks)], deadline)
        return []

    def _source(self, chunk: Chunk) -> np.ndarray:
        if chunk.nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        seg = self._theirs.get(chunk.segment_id)
        if seg is None:
            raise ProtocolError(f"chunk frame names unknown segment {chunk.segment_id}")
        if not 0 <= chunk.offset <= seg.size - chunk.nbytes:
            raise ProtocolError(f"chunk frame [{chunk.offset}, +{chunk.nbytes}) outside segment of {seg.size} bytes")
        return seg.array[chunk.offset : chunk.offset + chunk.nbytes]

    def close(self) -> None:
        super().close()
        self._verifier.close()
        theirs, self._theirs = self._theirs, {}
        for seg in theirs.values():
            seg.close()
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.close()


def _may_use_two_cpus() -> bool:
    """Whether the calling thread may run on more than one CPU (Linux: its own affinity mask)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return getaffinity is None or len(getaffinity(0)) > 1
