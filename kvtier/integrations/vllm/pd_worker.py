"""Prefiller worker side of PD: holds finished prefill requests' blocks until the decoder confirms.

Invariants:
- A request is reported in ``finished_sending`` at most once, and only after vLLM
  reported it finished (``get_finished``'s ``finished_req_ids``; the scheduler side
  returned ``delay_free=True`` for every request it marked), so vLLM never frees a
  running request's blocks.
- Each hold ends by a confirm carrying the hold's confirm value (a confirm without it,
  whoever sends it, is ignored and counted), a release from the scheduler side (request
  aborted), or ``lease_s`` seconds after vLLM finished the request; its store lease
  (``pd:<request id>``) ends with it. Shutdown releases everything.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from kvtier.integrations.vllm.pd import PDConfirm, PDSettings
from kvtier.integrations.vllm.types import PDHold

log = logging.getLogger("kvtier.vllm")

#: Largest confirm frame read (bytes; a confirm is ~100).
MAX_CONFIRM_BYTES = 4096


@dataclass
class _Held:
    keys: list[bytes]
    token: str = ""  # the confirm value a confirm must carry
    finished_at: float | None = None  # when vLLM reported it finished (monotonic seconds)
    done: bool = False  # confirmed or released: report once vLLM finished it


@dataclass
class PDWorker:
    """Hold table and confirm socket of a prefiller's worker.

    Args:
        settings: PD settings (``port`` is bound on ``host`` for confirms).
        engine_id: this engine's id (confirms for another engine are ignored).
        store: the worker's store (``lookup_keys``/``release`` lease the held chunks), or None.
        clock: monotonic seconds (tests pass a fake clock).
    """

    settings: PDSettings
    engine_id: str
    store: Any = None
    clock: Callable[[], float] = time.monotonic
    held: dict[str, _Held] = field(default_factory=dict)
    confirms: int = 0
    expired: int = 0
    refused: int = 0  # confirms for a held request without its confirm value
    _ctx: Any = None
    _sock: Any = None

    def __post_init__(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONFIRM_BYTES)  # anyone may connect: bound what it sends
        self._sock.bind(f"tcp://{self.settings.host}:{self.settings.port}")
        log.info("kvtier pd: prefiller confirms on tcp://%s:%d (lease %.1f s)",
                 self.settings.host, self.settings.port, self.settings.lease_s)

    def on_step(self, holds: list[PDHold], releases: list[str]) -> None:
        """Register this step's holds (after its saves: the lease lookup also orders the
        store's commits before the prefill's reply) and the scheduler side's releases."""
        for h in holds:
            if h.req_id in self.held:
                continue
            self.held[h.req_id] = _Held(list(h.keys), h.confirm_token)
            if self.store is not None and h.keys:
                try:
                    self.store.lookup_keys(h.keys, f"pd:{h.req_id}")
                except Exception:  # the hold still keeps the blocks; the chunks may be evicted
                    log.exception("kvtier pd: leasing the chunks of %s failed", h.req_id)
        for rid in releases:
            if rid in self.held:
                self.held[rid].done = True

    def _drain(self) -> None:
        import zmq

        while True:
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = msgspec.msgpack.decode(raw, type=PDConfirm)
            except msgspec.DecodeError:
                self.refused += 1
                self._warn(f"dropped a malformed confirm ({len(raw)} bytes)")
                continue
            h = self.held.get(msg.request_id)
            if msg.engine_id != self.engine_id or h is None:
                continue
            if not h.token or not hmac.compare_digest(msg.token.encode(), h.token.encode()):
                self.refused += 1  # not from the decoder this hold's params went to
                self._warn(f"ignored a confirm for {msg.request_id!r} without its confirm value")
                continue
            h.done = True
            self.confirms += 1

    def _warn(self, what: str) -> None:
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood cannot fill the log
            log.warning("kvtier pd: %s (%d refused so far)", what, self.refused)

    def waiting_for_confirms(self) -> bool:
        """True while a held request vLLM already finished waits for its decoder's confirm."""
        return any(h.finished_at is not None and not h.done for h in self.held.values())

    def wait_for_confirm(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` seconds until a confirm is readable (an idle engine step's wait)."""
        if self._sock is not None and timeout_s > 0:
            self._sock.poll(int(timeout_s * 1000))

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Held requests whose blocks vLLM may free now."""
        if not self.held:
            return set()
        self._drain()
        now = self.clock()
        out: set[str] = set()
        for rid, h in self.held.items():
            if rid in finished_req_ids and h.finished_at is None:
                h.finished_at = now
            if h.finished_at is None:
                continue
            if h.done or now - h.finished_at >= self.settings.lease_s:
                if not h.done:
                    self.expired += 1
                    log.info("kvtier pd: hold of %s expired after %.1f s without a confirm", rid,
                             self.settings.lease_s)
                out.add(rid)
        for rid in out:
            self._end(rid)
        return out

    def _end(self, rid: str) -> None:
        self.held.pop(rid, None)
        if self.store is not None:
            try:
                self.store.release(f"pd:{rid}")
            except Exception:  # the lease then ends at its TTL
                log.exception("kvtier pd: releasing the lease of %s failed", rid)

    def close(self) -> None:
        for rid in list(self.held):
            self._end(rid)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
