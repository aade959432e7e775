"""The controller's fleet state: registry + index behind one lock, and the agent-message logic.

:meth:`FleetState.handle` is the whole controller side of :mod:`kvtier.protocol.fleet`
without sockets (the endpoint thread feeds it decoded frames), so it is testable alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from kvtier.controller.index import FleetIndex
from kvtier.controller.registry import InstanceRegistry, RegistrationError, Sender
from kvtier.protocol.fleet import (
    DEFAULT_EXPIRY_S,
    DEFAULT_HEARTBEAT_S,
    MAX_HEALTH_BYTES,
    Ack,
    AgentMessage,
    Changes,
    FleetProtocolError,
    Heartbeat,
    OpResult,
    Register,
    Snapshot,
)
from kvtier.protocol.trust import Members

log = logging.getLogger(__name__)

#: A resync is not asked for again within this many seconds of the last request.
RESYNC_RETRY_S = 0.3
#: A refused registration is logged once per instance and reason in this many seconds.
REFUSAL_LOG_S = 60.0


class FleetState:
    """Registry and index of the fleet, guarded by :attr:`lock`.

    Args:
        token: token agents must present in ``Register.token`` (None: none).
        expiry_s: silence (seconds) after which an instance and its index are dropped.
        heartbeat_s: heartbeat period the controller asks for in every ``Ack``.
        members: the authorized members (CURVE on the agent endpoint); None: an open (loopback) fleet.
        max_keys_per_instance: most chunk keys one instance may have indexed over all its tiers.
    """

    def __init__(self, token: str | None = None, expiry_s: float = DEFAULT_EXPIRY_S,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, members: Members | None = None,
                 max_keys_per_instance: int | None = None):
        self.lock = threading.RLock()
        self.registry = InstanceRegistry(token=token, expiry_s=expiry_s, members=members)
        self.index = FleetIndex() if max_keys_per_instance is None else FleetIndex(max_keys_per_instance)
        self.epoch = os.urandom(8).hex()
        self.heartbeat_s = heartbeat_s
        self._resync_asked: dict[str, float] = {}
        self._refusals_logged: dict[tuple[str, str], float] = {}  # (instance, reason) -> last logged
        #: Called (outside the lock) with the id of every dropped instance (expired or restarted).
        self.on_drop: list[Callable[[str], None]] = []
        self.counters: dict[str, int] = {
            "malformed_frames": 0, "refused_registrations": 0, "registrations": 0, "reregistrations": 0, "expirations": 0,
            "resyncs_requested": 0, "unknown_sender_messages": 0, "health_dropped": 0,
        }

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def handle(self, sender: Sender | str | bytes, msg: AgentMessage, now: float | None = None,
               size: int = 0) -> Ack | None:
        """Apply one agent message from ``sender`` (its connection; a str or bytes: a routing id without
        CURVE); the ``Ack`` to send back, if any. ``size``: the encoded message's bytes.

        A message for an instance ``sender`` does not own (:meth:`InstanceRegistry.owner`) changes
        nothing: a Heartbeat gets ``Ack(known=False)``, others are counted and ignored. ``OpResult`` is
        not handled here (the endpoint routes it).

        Raises:
            FleetProtocolError: the message does not fit (unknown tier or namespace, bad key lists);
                the caller drops and counts it.
        """
        now_m = time.monotonic() if now is None else now
        who = Sender.of(sender)
        dropped: list[str] = []
        try:
            with self.lock:
                if isinstance(msg, OpResult):
                    return None
                if isinstance(msg, Register):
                    return self._register(msg, now_m, dropped, who)
                rec = self.registry.owner(msg.instance, msg.epoch, who, now_m)
                if rec is None:
                    self.counters["unknown_sender_messages"] += 1
                    if isinstance(msg, Heartbeat):
                        return Ack(self.epoch, known=False, heartbeat_s=self.heartbeat_s)
                    return None
                if isinstance(msg, Heartbeat):
                    rec.last_heartbeat = time.time()
                    if size > MAX_HEALTH_BYTES:  # a sign of life; its report is not kept or served
                        self.counters["health_dropped"] += 1
                        rec.health = {"error": f"health report of {size} bytes dropped (at most {MAX_HEALTH_BYTES})"}
                    else:
                        rec.health = dict(msg.health)
                    self.index.heartbeat_seq(msg.instance, msg.seq)
                    return Ack(self.epoch, known=True, resync=self._take_resync(msg.instance, now_m),
                               heartbeat_s=self.heartbeat_s)
                if isinstance(msg, Snapshot):
                    label = rec.tier_label(msg.tier)
                    if label is None:
                        raise FleetProtocolError(f"instance {msg.instance!r} has no tier {msg.tier!r}")
                    if self.index.apply_snapshot(msg, label):
                        self._resync_asked.pop(msg.instance, None)
                    return None
                if isinstance(msg, Changes):
                    self.index.apply_changes(msg)
                    return None
                raise FleetProtocolError(f"unexpected message {type(msg).__name__}")
        finally:
            for inst in dropped:
                self._notify_drop(inst)

    def _register(self, msg: Register, now_m: float, dropped: list[str], who: Sender) -> Ack | None:
        old = self.registry.get(msg.instance)
        try:
            rec, replaced = self.registry.register(msg, now_m, who)
        except RegistrationError as exc:
            self.counters["refused_registrations"] += 1
            # The agent retries (backing off): one line per instance and reason a minute, not per try.
            said = (msg.instance, str(exc))
            if len(self._refusals_logged) > 1024:  # bounded, whatever ids strangers make up
                self._refusals_logged.clear()
            if now_m - self._refusals_logged.get(said, -REFUSAL_LOG_S) >= REFUSAL_LOG_S:
                self._refusals_logged[said] = now_m
                log.warning("controller: refused registration: %s", exc)
            return Ack(self.epoch, known=False, heartbeat_s=self.heartbeat_s, refused=str(exc), retry_s=exc.retry_s)
        if replaced:
            dropped.append(msg.instance)
        if old is not None and not replaced and old.tiers == rec.tiers and old.namespaces.keys() == rec.namespaces.keys():
            # The same process (its owner, its epoch) registering again: an agent that found the controller
            # silent for a while and reconnected. Its index stays served (the snapshot that follows every
            # Register refreshes it); emptying it made a pause of the controller an outage of every instance.
            rec.registered_at = old.registered_at
            self.counters["reregistrations"] += 1
        else:
            self.index.add_instance(msg.instance, rec.tiers, list(rec.namespaces),
                                    {d: e.info.chunk_bytes for d, e in rec.namespaces.items()})
        self.counters["registrations"] += 1
        self._resync_asked[msg.instance] = now_m
        self.counters["resyncs_requested"] += 1
        return Ack(self.epoch, known=True, resync=True, heartbeat_s=self.heartbeat_s)

    def _take_resync(self, instance: str, now_m: float) -> bool:
        if instance not in self.index.needs_resync:
            return False
        asked = self._resync_asked.get(instance)
        if asked is not None and now_m - asked < RESYNC_RETRY_S:
            return False
        self.index.needs_resync.discard(instance)
        self._resync_asked[instance] = now_m
        self.counters["resyncs_requested"] += 1
        return True

    def sweep(self, now: float | None = None) -> list[str]:
        """Drop instances silent past the expiry; their ids."""
        with self.lock:
            gone = self.registry.expired(now)
            for inst in gone:
                self.registry.drop(inst)
                self.index.drop_instance(inst)
                self._resync_asked.pop(inst, None)
                self.counters["expirations"] += 1
        for inst in gone:
            log.info("controller: instance %s expired (silent > %.2f s); its index is dropped",
                     inst, self.registry.expiry_s)
            self._notify_drop(inst)
        return gone

    def _notify_drop(self, instance: str) -> None:
        for cb in list(self.on_drop):
            try:
                cb(instance)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the endpoint
                log.exception("controller: on_drop listener failed")
