"""Lookup RPC between vLLM's scheduler-side connector and the worker that owns the tiers.

vLLM's multi-process engine runs the scheduler and the model worker in
different processes (even with one worker), but a lookup must be answered and
leased by the manager that will serve the load. The worker side runs a
:class:`LookupServer` on an owner-only Unix socket (ZeroMQ REQ/REP, msgpack
bodies, never pickle); the scheduler side calls it through
:class:`LookupClient`. Payloads never cross this channel, only keys.

Protocol version 1 (every message a msgpack map)::

    {"v": 1, "op": "lookup", "keys": <n*32 bytes>, "owner": str|None,
     "prompt_tokens": int, "engine_hit_tokens": int}
        -> {"ok": true, "tiers": <one byte per hit chunk: b"c" cpu, b"d" disk>}
    {"v": 1, "op": "release", "owner": str}          -> {"ok": true}
    {"v": 1, "op": "ping"}                            -> {"ok": true, "pid": int}
    anything malformed                                -> {"ok": false, "error": str}

Failure rule: the client never blocks longer than its timeout; after a failure
it reports misses without calling for ``backoff_s`` seconds, then retries.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass

import msgpack
import zmq

from kvtier.index.keys import KEY_BYTES
from kvtier.storage.manager import LookupResult, RequestRecord, StorageManager

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # 32,768 keys: far beyond any prompt
_TIER_CODES = {"cpu": b"c", "disk": b"d"}
_TIER_NAMES = {ord("c"): "cpu", ord("d"): "disk"}


def socket_path(engine_id: str) -> str:
    """Owner-only Unix socket of one engine's lookup server."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:64] or "engine"
    return os.path.join(base, f"kvtier-{safe}.sock")


class LookupServer:
    """Serves lookups and lease releases for ``manager`` on ``path`` (a thread).

    Raises:
        zmq.ZMQError: the socket cannot be bound.
    """

    def __init__(self, manager: StorageManager, path: str):
        self.manager = manager
        self.path = path
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if os.path.exists(path):
            os.unlink(path)  # a stale socket of a dead engine with the same id
        old = os.umask(0o077)
        try:
            self._sock.bind(f"ipc://{path}")
        finally:
            os.umask(old)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvtier-lookup-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            try:
                reply = self.handle(raw)
            except Exception as exc:  # the server carries on whatever arrives
                log.exception("kvtier lookup server: request failed")
                reply = {"ok": False, "error": f"internal error: {type(exc).__name__}"}
            try:
                self._sock.send(msgpack.packb(reply))
            except zmq.ZMQError:
                pass
        self._sock.close(0)

    def handle(self, raw: bytes) -> dict:
        """Decode, validate and execute one request; returns the reply map."""
        try:
            msg = msgpack.unpackb(raw, raw=False)
        except Exception:
            return {"ok": False, "error": "not msgpack"}
        if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION:
            return {"ok": False, "error": f"expected a map with v={PROTOCOL_VERSION}"}
        op = msg.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        owner = msg.get("owner")
        if owner is not None and not isinstance(owner, str):
            return {"ok": False, "error": "owner must be a string"}
        if op == "release":
            if owner is None:
                return {"ok": False, "error": "release needs an owner"}
            self.manager.release(owner)
            return {"ok": True}
        if op == "lookup":
            keys = msg.get("keys")
            if not isinstance(keys, bytes) or len(keys) % KEY_BYTES:
                return {"ok": False, "error": f"keys must be bytes, a multiple of {KEY_BYTES}"}
            prompt_tokens = msg.get("prompt_tokens", 0)
            engine_hit = msg.get("engine_hit_tokens", 0)
            if not isinstance(prompt_tokens, int) or not isinstance(engine_hit, int):
                return {"ok": False, "error": "token counts must be integers"}
            if owner is not None:
                self.manager.record_request(owner, RequestRecord(prompt_tokens, engine_hit_tokens=engine_hit))
            key_list = [keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]
            res = self.manager.lookup_keys(key_list, lease_owner=owner)
            return {"ok": True, "tiers": b"".join(_TIER_CODES[t] for t in res.tiers)}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            os.unlink(self.path)
        except OSError:
            pass


@dataclass
class LookupClient:
    """Scheduler-side stub of a remote manager's lookup and lease release.

    Args:
        path: the server's socket path.
        chunk_size: tokens per chunk (to turn hit chunks into tokens).
        timeout_s: bound on each call; a call that times out is a miss.
        backoff_s: after a failure, calls return misses at once for this long.
    """

    path: str
    chunk_size: int
    timeout_s: float = 0.5
    backoff_s: float = 5.0

    def __post_init__(self) -> None:
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.failures = 0

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.REQ)
            ms = max(1, int(self.timeout_s * 1000))
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, ms)
            s.setsockopt(zmq.SNDTIMEO, ms)
            s.connect(f"ipc://{self.path}")
            self._sock = s
        return self._sock

    def _call(self, msg: dict) -> dict | None:
        with self._lock:
            if time.monotonic() < self._down_until:
                return None
            if not os.path.exists(self.path):
                self._fail("no lookup server at " + self.path)
                return None
            try:
                sock = self._socket()
                sock.send(msgpack.packb({"v": PROTOCOL_VERSION, **msg}))
                reply = msgpack.unpackb(sock.recv(), raw=False)
            except (zmq.ZMQError, ValueError) as exc:
                # A REQ socket that timed out is stuck mid-exchange: start a new one.
                if self._sock is not None:
                    self._sock.close(0)
                    self._sock = None
                self._fail(f"{type(exc).__name__}: {exc}")
                return None
            if not isinstance(reply, dict) or not reply.get("ok"):
                log.warning("kvtier lookup RPC refused: %s", reply)
                return None
            return reply

    def _fail(self, why: str) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.backoff_s
        log.warning("kvtier lookup RPC failed (%s); reporting misses for %.1f s", why, self.backoff_s)

    def lookup_keys(
        self, keys: list[bytes], lease_owner: str | None, prompt_tokens: int = 0, engine_hit_tokens: int = 0
    ) -> LookupResult:
        reply = self._call(
            {
                "op": "lookup",
                "keys": b"".join(keys),
                "owner": lease_owner,
                "prompt_tokens": prompt_tokens,
                "engine_hit_tokens": engine_hit_tokens,
            }
        )
        if reply is None:
            return LookupResult(0)
        tiers = [_TIER_NAMES.get(c, "disk") for c in reply.get("tiers", b"")][: len(keys)]
        return LookupResult(len(tiers) * self.chunk_size, list(keys[: len(tiers)]), tiers)

    def release(self, lease_owner: str) -> None:
        self._call({"op": "release", "owner": lease_owner})

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None
