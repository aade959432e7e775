"""Subscribe to a KV event stream (vLLM's or kvtier's publisher), filling gaps by replay.

Reads ``[topic, seq (8 bytes big-endian), payload]`` messages from a ``PUB`` socket and
decodes each payload with :func:`kvtier.events.codec.decode_batch`. When a ``seq`` skips
ahead (messages lost at the high-water mark, a slow joiner...) and a replay endpoint is
configured, it asks the publisher's ``ROUTER`` for the missing batches (8-byte big-endian
start seq; replies ``[b"", topic, seq, payload]`` until the ``seq = -1`` end marker) and
delivers them, in order, before the batch that revealed the gap. What replay cannot fill is
counted (:attr:`EventSubscriber.missed`), never waited for.

A socket is not thread-safe: use one subscriber from one thread.
"""

from __future__ import annotations

import time
from typing import Any
from collections import deque
from collections.abc import Iterator

import zmq

from kvtier.events.codec import EventDecodeError, decode_batch
from kvtier.events.schema import KVEventBatch

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Largest message frame accepted by default (bytes): 16 MiB, ~5M token ids of ``BlockStored``,
#: far beyond one engine step's events. A larger frame makes ZeroMQ drop the publisher's
#: connection (a protocol error, after which ZeroMQ would not reconnect: the subscriber does,
#: see ``disconnects``); the lost seqs are a gap (replay, else counted missed).
MAX_MESSAGE_BYTES = 16 << 20
#: Seconds between two re-dials of a dropped link.
RELINK_EVERY_S = 1.0
#: Receive high-water mark (message frames; 3 per batch) by default: with
#: :data:`MAX_MESSAGE_BYTES`, at most ~256 MiB queued for a slow reader; beyond, the publisher
#: drops (a gap, as above).
RECV_HWM = 48


class EventSubscriber:
    """Receive ``(seq, KVEventBatch)`` pairs in seq order, with gap detection and replay.

    Args:
        endpoint: the publisher's PUB endpoint to connect to (e.g. ``tcp://127.0.0.1:5557``).
        replay_endpoint: its replay ROUTER endpoint (``None``: gaps are only counted).
        topic: only messages whose topic frame equals this (``""``: every topic).
        replay_timeout_s: longest wait for one replay answer to complete (seconds).
        from_seq: if set (with a replay endpoint), the first message received also fetches
            every buffered batch from this seq on (a late joiner's catch-up).
        normalize: decode ``STORAGE`` mediums as ``DISK``.
        max_message_bytes: largest frame accepted, on the PUB stream and replay answers
            (bytes, > 0; ZeroMQ ``MAXMSGSIZE``): a publisher never makes the subscriber hold
            more than that per frame.
        recv_hwm: frames queued before the publisher drops (ZeroMQ ``RCVHWM``, > 0).
        credentials / server_key: this node's fleet credentials and the publisher's Z85 public key:
            both sockets are CURVE clients (a kvtier publisher with credentials admits members with the
            ``events`` role only); None: plain.

    Counters: ``received`` (batches delivered), ``gaps`` (seq jumps seen), ``replayed``
    (batches delivered from replay), ``missed`` (seqs never obtained), ``decode_errors``
    (malformed messages skipped), ``restarts`` (the stream started over: its seq went backwards,
    or the link dropped and came back), ``disconnects`` (the link to the publisher dropped, e.g. a
    frame over ``max_message_bytes`` or a publisher that exited; the subscriber connects again).

    Invariant kept by :meth:`_on_message`: a batch is delivered as the continuation of the last one
    (``seq == last_seq + 1``, or a gap filled from replay) only if the link never dropped in between.
    A publisher that restarts on the same endpoint starts its seq at 0 again, and its first batches
    may be lost before the link is back (a SUB joins late); when the old one had sent exactly as many
    batches as were lost, the first seq that arrives is ``last_seq + 1`` and seq arithmetic alone
    takes the new stream for the old one (stale routes: blocks of a process that is gone). So a
    dropped link counts as a restart: ``last_seq`` is forgotten and consumers drop what they built
    from the stream. The stream is then rebuilt from its start: the first batch after the drop, seq
    ``s``, makes ``[0, s)`` a gap, asked of replay and otherwise counted ``missed`` (lost while the link
    was down, or, for the same publisher, batches the dropped state held). A link that dropped while
    the same publisher lived costs a re-learnt index, never a wrong one.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "kv-events", replay_timeout_s: float = 1.0,
                 from_seq: int | None = None, normalize: bool = True, credentials: Any = None,
                 server_key: str | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 recv_hwm: int = RECV_HWM) -> None:
        if max_message_bytes <= 0 or recv_hwm <= 0:
            raise ValueError(f"max_message_bytes and recv_hwm must be > 0, got {max_message_bytes}, {recv_hwm}")
        if from_seq is not None and not 0 <= from_seq < 1 << 63:
            raise ValueError(f"from_seq must be in [0, 2**63), got {from_seq}")
        self._topic = topic.encode("utf-8")
        self._max_message_bytes = max_message_bytes
        self._recv_hwm = recv_hwm
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_s = replay_timeout_s
        self._normalize = normalize
        self._last_seq: int | None = None if from_seq is None else from_seq - 1
        self._pending: deque[tuple[int, KVEventBatch]] = deque()
        self.received = 0
        self.gaps = 0
        self.replayed = 0
        self.missed = 0
        self.decode_errors = 0
        self.restarts = 0
        self.disconnects = 0
        self._endpoint = endpoint
        self._relink_at = 0.0  # monotonic time before which a dropped link is not re-dialled
        self._dropped = False
        self._resync = False  # the link dropped after batches arrived: rebuild from seq 0 (class doc)
        self._closed = False
        self._curve = (credentials, server_key) if credentials is not None and server_key else None
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.IPV6, int("[" in endpoint))  # libzmq dials tcp://[::1]:P only with IPV6 set
        self._secure(self._sub)
        self._bound(self._sub)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None

    def _secure(self, sock: zmq.Socket) -> None:
        """CURVE client options on ``sock`` when this subscriber has credentials and a server key."""
        if self._curve is not None:
            from kvtier.protocol.curve import curve_client

            curve_client(sock, self._curve[0].key, self._curve[1])

    @property
    def last_seq(self) -> int | None:
        """The seq of the last batch delivered or accounted for (``None``: none yet)."""
        return self._last_seq

    def stats(self) -> dict[str, int]:
        """The counters as a dict."""
        return {"received": self.received, "gaps": self.gaps, "replayed": self.replayed,
                "missed": self.missed, "decode_errors": self.decode_errors,
                "restarts": self.restarts, "disconnects": self.disconnects}

    def poll(self, timeout_s: float = 0.0) -> tuple[int, KVEventBatch] | None:
        """The next batch in seq order, waiting up to ``timeout_s`` seconds; ``None`` if none.

        Malformed messages are skipped (counted in ``decode_errors``); never raises for
        wire content. Raises ``RuntimeError`` once closed.
        """
        if self._closed:
            raise RuntimeError("EventSubscriber is closed")
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not self._pending:
            self._relink()
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(wait_ms):
                self._relink()
                return None
            self._on_message(self._sub.recv_multipart())
            if not self._pending and time.monotonic() >= deadline:
                return None
        self.received += 1
        return self._pending.popleft()

    def __iter__(self) -> Iterator[tuple[int, KVEventBatch]]:
        """Yield batches until :meth:`close` (checks every 0.1 s)."""
        while not self._closed:
            item = self.poll(0.1)
            if item is not None:
                yield item

    def items(self, idle_s: float) -> Iterator[tuple[int, KVEventBatch]]:
        """Yield batches until none arrives for ``idle_s`` seconds."""
        while True:
            item = self.poll(idle_s)
            if item is None:
                return
            yield item

    def close(self) -> None:
        """Close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------

    def _drain_monitor(self) -> None:
        """Read the link's monitor events: a disconnect marks the link dropped and the stream as
        started over (see the class doc's invariant)."""
        while self._monitor.poll(0):
            if self._monitor.recv_multipart()[0][:2] == zmq.EVENT_DISCONNECTED.to_bytes(2, "little"):
                self._dropped = True
                if self._last_seq is not None:
                    self.restarts += 1
                    self._last_seq = None
                    self._resync = True

    def _relink(self) -> None:
        """Connect again after the link dropped: ZeroMQ gives up on a link it cut for a protocol
        error (a frame over ``MAXMSGSIZE``), so without this one oversized frame would end the
        stream for good."""
        self._drain_monitor()
        if self._dropped and time.monotonic() >= self._relink_at:
            self._dropped = False
            self._relink_at = time.monotonic() + RELINK_EVERY_S  # a publisher refusing us is not hammered
            self.disconnects += 1
            try:
                self._sub.disconnect(self._endpoint)
            except zmq.ZMQError:
                pass
            self._sub.connect(self._endpoint)

    def _on_message(self, frames: list[bytes]) -> None:
        self._drain_monitor()  # a drop seen before this message makes it a new stream's
        if len(frames) != 3 or len(frames[1]) != 8:
            self.decode_errors += 1
            return
        topic, seq_bytes, payload = frames
        if self._topic and topic != self._topic:
            return  # a longer topic sharing our prefix
        seq = int.from_bytes(seq_bytes, "big")
        try:
            batch = decode_batch(payload, normalize=self._normalize)
        except EventDecodeError:
            self.decode_errors += 1
            batch = None
        last = self._last_seq
        if self._resync:
            self._resync = False
            if seq > 0:
                self.gaps += 1
                self._fill(0, seq)
        elif last is not None and seq <= last:
            self.restarts += 1  # the publisher restarted (its seq starts at 0 again)
        elif last is not None and seq > last + 1:
            self.gaps += 1
            self._fill(last + 1, seq)
        self._last_seq = seq
        if batch is not None:
            self._pending.append((seq, batch))

    def _fill(self, start: int, stop: int) -> None:
        """Deliver replayed batches with ``start <= seq < stop``; count the rest as missed."""
        got: dict[int, KVEventBatch] = {}
        if self._replay_endpoint is not None:
            for seq, payload in self._request_replay(start):
                if start <= seq < stop and seq not in got:
                    try:
                        got[seq] = decode_batch(payload, normalize=self._normalize)
                    except EventDecodeError:
                        self.decode_errors += 1
        self.missed += (stop - start) - len(got)
        for seq in sorted(got):
            self._pending.append((seq, got[seq]))
        self.replayed += len(got)

    def _request_replay(self, start: int) -> list[tuple[int, bytes]]:
        sock = self._replay_socket()
        while sock.poll(0):  # leftovers of an earlier, timed-out answer
            sock.recv_multipart()
        out: list[tuple[int, bytes]] = []
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return out
        deadline = time.monotonic() + self._replay_timeout_s
        while True:
            wait_ms = int((deadline - time.monotonic()) * 1000)
            if wait_ms <= 0 or not sock.poll(wait_ms):
                return out  # publisher gone or slow: what we have is all we get
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 3 or len(frames[1]) != 8:
                self.decode_errors += 1
                continue
            if frames[1] == _END_SEQ:
                return out
            out.append((int.from_bytes(frames[1], "big"), frames[2]))

    def _bound(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, self._recv_hwm)

    def _replay_socket(self) -> zmq.Socket:
        if self._replay is None:
            assert self._replay_endpoint is not None
            self._replay = self._ctx.socket(zmq.DEALER)
            self._secure(self._replay)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.IPV6, int("[" in self._replay_endpoint))
            self._bound(self._replay)
            self._replay.connect(self._replay_endpoint)
        return self._replay
