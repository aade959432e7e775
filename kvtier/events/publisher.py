"""Publish KV event batches over ZeroMQ exactly as vLLM's ``ZmqEventPublisher`` does.

Wire (what vLLM's own subscribers read):

* a ``PUB`` socket sends one multipart message per batch: ``[topic, seq, payload]`` where
  ``topic`` is UTF-8, ``seq`` an 8-byte big-endian counter starting at 0, ``payload`` the
  msgpack batch (:func:`kvtier.events.codec.encode_batch`);
* an optional ``ROUTER`` replay socket: a client (``REQ``, or ``DEALER`` sending an empty
  delimiter frame first) sends the first seq it wants as 8 bytes big-endian; the publisher
  answers, for every buffered batch with ``seq >= start``, ``[b"", topic, seq, payload]``
  (as seen by a ``DEALER``; a ``REQ`` strips the empty frame), then the end marker
  ``[b"", b"", seq=-1 (8 bytes, signed big-endian), b""]``. Requests of another shape are
  ignored.

:meth:`EventPublisher.publish` never blocks: batches go through a bounded queue to one
sender thread, which owns the sockets; a full queue drops the batch and counts it.

Who may read it (issue 24: a key stream must not be open to strangers): over ``ipc://`` the
socket files are made 0600 (this user only); over ``tcp://`` the publisher needs fleet
``credentials`` (CURVE: only current members with the ``events`` role may subscribe or ask
for a replay; subscribers need the publisher's public key) or an explicit ``plain=True``
(vLLM's own wire, readable by anyone who can connect). Both sockets take messages of at most
64 KiB (``ZMQ_MAXMSGSIZE``): subscriptions and replay requests are a few bytes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvtier.events.codec import EventEncodeError, encode_batch, make_batch
from kvtier.events.schema import KVEvent, KVEventBatch
from kvtier.protocol.curve import CurveGate, bound_messages, curve_server

log = logging.getLogger(__name__)

#: The replay end marker's seq frame (-1, 8 bytes big-endian, signed).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: ZAP domain of the publisher's sockets (members with the ``events`` role).
ZAP_DOMAIN = "kvtier-events"
#: Largest message a subscriber or replay client may send (bytes).
MAX_REQUEST_BYTES = 64 << 10
#: Replayed batches sent per second, all clients together (a token bucket; burst: one whole
#: default buffer). An 8-byte request costs up to ``buffer_batches`` sends: without a budget, a
#: client looping over requests kept the thread replaying and the live stream stalled (1,000
#: requests: no fresh batch within 90 s). Requests beyond it wait in the socket for the budget.
REPLAY_BATCHES_PER_S = 20_000


def _owner_only(endpoint: str) -> None:
    """Make an ``ipc://`` socket file 0600 (only this user may connect); other endpoints unchanged."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if path and not path.startswith("@"):  # "@": Linux abstract namespace, no file
            os.chmod(path, 0o600)


def _is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule (wildcard host, ipc, inproc: bind; otherwise connect), plus port 0 and the IPv4
    wildcard ``0.0.0.0`` (an address nothing can be connected to on purpose): bind."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://", "tcp://0.0.0.0:"))
            or endpoint.endswith(":0"))


class EventPublisher:
    """A thread-safe, non-blocking KV event publisher (vLLM-compatible PUB + replay ROUTER).

    Args:
        endpoint: PUB address; ``tcp://*:5557`` and ``tcp://0.0.0.0:5557`` bind, ``tcp://host:5557``
            connects (to a forwarder), ``tcp://127.0.0.1:0`` binds an ephemeral port (see :attr:`endpoint`).
        replay_endpoint: ROUTER address for replay requests (always bound); ``None``: none.
        topic: topic frame of every message (vLLM's default is ``""``).
        buffer_batches: batches kept for replay.
        hwm: ZeroMQ send high-water mark of the PUB socket (messages).
        queue_size: batches waiting for the sender thread before :meth:`publish` drops.
        data_parallel_rank: stamped on batches that carry none.
        drop_filter: fault injection for tests: called with each seq; True skips the PUB send
            (the batch is still numbered and kept for replay, like a message lost in transit).
        credentials: fleet credentials (:class:`kvtier.protocol.trust.Credentials`): both sockets are
            CURVE servers admitting members with the ``events`` role.
        plain: allow a ``tcp://`` endpoint without credentials (vLLM-compatible, open to anyone).

    Raises:
        zmq.ZMQError: an endpoint cannot be bound or connected.
        ValueError: a non-positive size, or a ``tcp://`` endpoint with neither credentials nor ``plain``.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "kv-events", buffer_batches: int = 10_000, hwm: int = 100_000,
                 queue_size: int = 10_000, data_parallel_rank: int | None = None,
                 drop_filter: Callable[[int], bool] | None = None, credentials: Any = None,
                 plain: bool = False) -> None:
        if buffer_batches <= 0 or hwm <= 0 or queue_size <= 0:
            raise ValueError("buffer_batches, hwm and queue_size must be positive")
        for url in (endpoint, replay_endpoint):
            if url and url.startswith("tcp://") and credentials is None and not plain:
                raise ValueError(f"KV event endpoint {url}: a TCP stream needs fleet credentials (CURVE) or, "
                                 "vLLM-compatible and open to anyone who connects, kv_events_plain")
        self._topic = topic.encode("utf-8")
        self._dp_rank = data_parallel_rank
        self._drop_filter = drop_filter
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()
        self._published = 0
        self._dropped = 0
        self._encode_errors = 0
        self._replays = 0
        self._replay_tokens = float(max(buffer_batches, REPLAY_BATCHES_PER_S))
        self._replay_refilled = time.monotonic()
        self._next_seq = 0
        self._closed = False
        self._drain_until = 0.0
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._gate: CurveGate | None = None
        self._pub: zmq.Socket = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        self.public_key = credentials.key.public if credentials is not None else ""
        self._credentials = credentials
        self._hwm = hwm
        self._subscribers = self._event_members()
        self._checked_members = time.monotonic()
        self.rebinds = 0
        try:
            if credentials is not None:
                self._gate = CurveGate(self._ctx, credentials.members).allow(ZAP_DOMAIN, "events").start()
                curve_server(self._pub, credentials.key, ZAP_DOMAIN)
            self._pub.setsockopt(zmq.IPV6, int("[" in endpoint))  # libzmq takes tcp://[::1]:P only with IPV6 set
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            bound_messages(self._pub, MAX_REQUEST_BYTES)
            if _is_bind_endpoint(endpoint):
                self._pub.bind(endpoint)
                self._endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
                _owner_only(self._endpoint)
            else:
                self._pub.connect(endpoint)
                self._endpoint = endpoint
            self._replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.IPV6, int("[" in replay_endpoint))
                bound_messages(self._replay, MAX_REQUEST_BYTES)
                if credentials is not None:
                    curve_server(self._replay, credentials.key, ZAP_DOMAIN)
                self._replay.bind(replay_endpoint)
                self._replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                _owner_only(self._replay_endpoint)
        except Exception:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kvtier-event-publisher",
                                        daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB endpoint as bound (ephemeral port resolved) or connected."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay ROUTER endpoint as bound, or ``None``."""
        return self._replay_endpoint

    @property
    def published(self) -> int:
        """Batches sent on the PUB socket."""
        with self._lock:
            return self._published

    @property
    def dropped(self) -> int:
        """Batches not sent: the queue was full, the publisher was closed, or encoding failed."""
        with self._lock:
            return self._dropped

    def stats(self) -> dict[str, int]:
        """Counters: ``published``, ``dropped``, ``encode_errors``, ``replays``, ``queued``."""
        with self._lock:
            return {"published": self._published, "dropped": self._dropped,
                    "encode_errors": self._encode_errors, "replays": self._replays,
                    "queued": self._queue.qsize()}

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> bool:
        """Queue one batch of ``events`` (stamped ``ts``, now if ``None``); never blocks.

        Returns:
            True if queued (or ``events`` is empty: nothing to send); False if dropped
            (queue full or publisher closed), counted in :attr:`dropped`.
        """
        if not events:
            return True
        return self.publish_batch(make_batch(events, ts, self._dp_rank))

    def publish_batch(self, batch: KVEventBatch) -> bool:
        """Queue a ready batch (its ``data_parallel_rank`` set to ours if ``None``); never blocks.

        Returns:
            True if queued, False if dropped (counted).
        """
        if batch.data_parallel_rank is None and self._dp_rank is not None:
            batch.data_parallel_rank = self._dp_rank
        with self._lock:  # put_nowait never blocks; the lock orders it against close()
            if not self._closed:
                try:
                    self._queue.put_nowait(batch)
                    return True
                except queue.Full:
                    pass
            self._dropped += 1
        return False

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s`` seconds), stop the thread, close sockets.

        Idempotent. Batches still queued after the timeout are dropped (counted).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drain_until = time.monotonic() + max(0.0, timeout_s) * 0.8
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # stuck: leave its sockets to it rather than race it
            log.warning("kvtier event publisher thread did not stop within %.1fs", timeout_s)
            return
        with self._lock:
            self._dropped += self._queue.qsize()
        self._close_sockets()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._gate is not None:
            self._gate.stop()
        self._ctx.term()

    # --- sender thread -----------------------------------------------------------------

    def _event_members(self) -> frozenset[str]:
        if self._credentials is None:
            return frozenset()
        return frozenset(k for k, m in self._credentials.members.current().items() if m.may("events"))

    def _revoke_check(self) -> None:
        """Once a second: if a member lost the ``events`` role (its line removed), rebind both sockets on
        the same addresses, so every subscriber reconnects through the ZAP handler and the revoked one
        cannot (CURVE checks keys at connect only; a PUB socket cannot drop one peer). The batches sent
        meanwhile stay numbered: subscribers fill the gap from replay."""
        now = time.monotonic()
        if self._credentials is None or now - self._checked_members < 1.0:
            return
        self._checked_members = now
        current = self._event_members()
        revoked = self._subscribers - current
        self._subscribers = current
        if not revoked:
            return
        for attr, kind, hwm in (("_pub", zmq.PUB, self._hwm), ("_replay", zmq.ROUTER, 0)):
            old = getattr(self, attr)
            if old is None:
                continue
            where = old.getsockopt_string(zmq.LAST_ENDPOINT)
            old.close(linger=0)
            sock = self._ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            if hwm:
                sock.setsockopt(zmq.SNDHWM, hwm)
            bound_messages(sock, MAX_REQUEST_BYTES)
            curve_server(sock, self._credentials.key, ZAP_DOMAIN)
            for _ in range(50):  # the port is ours; a moment for the old socket's close to finish
                try:
                    sock.bind(where)
                    break
                except zmq.ZMQError:
                    time.sleep(0.01)
            setattr(self, attr, sock)
        self.rebinds += 1
        log.info("kvtier event publisher: %d member(s) lost the events role; subscribers reconnect", len(revoked))

    def _run(self) -> None:
        while True:
            if self._stop.is_set():
                if self._queue.empty() or time.monotonic() > self._drain_until:
                    return
            try:
                self._revoke_check()
            except Exception:  # noqa: BLE001 - never stop publishing over it
                log.exception("kvtier event publisher: revocation check failed")
            waiting = False
            if self._replay is not None:
                try:  # one request per turn, within the budget: live batches go out between replays
                    if self._replay_budget() and self._replay.poll(0):
                        self._replay_tokens -= self._serve_replay(self._replay)
                        waiting = bool(self._replay.poll(0))
                except zmq.ZMQError as exc:
                    log.warning("kvtier event replay failed: %s", exc)
            try:
                batch = self._queue.get_nowait() if waiting and self._replay_tokens > 0 else self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            try:
                self._send(batch)
            except Exception:  # the thread must outlive any one bad batch
                log.exception("kvtier event publisher: batch dropped")
                with self._lock:
                    self._dropped += 1

    def _send(self, batch: KVEventBatch) -> None:
        try:
            payload = encode_batch(batch)
        except EventEncodeError as exc:
            log.warning("kvtier event batch dropped: %s", exc)
            with self._lock:
                self._encode_errors += 1
                self._dropped += 1
            return
        seq = self._next_seq
        if self._drop_filter is None or not self._drop_filter(seq):
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                         flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # EAGAIN on a connected PUB with no peer yet, ...
                log.debug("kvtier event batch %d not sent: %s", seq, exc)
        # Numbered and buffered even if the PUB send failed: a subscriber sees the gap and
        # gets it from the replay buffer.
        self._next_seq = seq + 1
        self._buffer.append((seq, payload))
        with self._lock:
            self._published += 1

    def _replay_budget(self) -> bool:
        """Refill the replay token bucket; True while a request may be served."""
        now = time.monotonic()
        cap = float(max(self._buffer.maxlen or 0, REPLAY_BATCHES_PER_S))
        self._replay_tokens = min(cap, self._replay_tokens + (now - self._replay_refilled) * REPLAY_BATCHES_PER_S)
        self._replay_refilled = now
        return self._replay_tokens > 0

    def _serve_replay(self, sock: zmq.Socket) -> int:
        """Answer one replay request; the messages it sent (1 for an ignored request)."""
        frames = sock.recv_multipart(flags=zmq.NOBLOCK)
        if len(frames) != 3:
            log.debug("kvtier event replay: ignored a request of %d frames", len(frames))
            return 1
        client, _empty, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        sent = 1
        for seq, payload in list(self._buffer):
            if seq >= start:
                sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                sent += 1
        sock.send_multipart((client, b"", b"", END_SEQ, b""))
        with self._lock:
            self._replays += 1
        return sent
