"""Registered instances: who they are, their epochs, namespaces, tiers and last heartbeat.

An instance is known from its ``Register`` until it is silent for ``expiry_s`` seconds
(no message of any kind); a ``Register`` with a new ``epoch`` for a known id replaces the
old record (the instance restarted; the caller drops its old index). Not thread-safe on
its own: the :class:`~kvtier.controller.server.Controller` serialises access with one lock.
"""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.index.keys import KEY_SCHEME_VERSION, ChunkHasher, KeyNamespace, LayoutSignature
from kvtier.protocol.fleet import (
    DEFAULT_EXPIRY_S,
    FLEET_PROTOCOL_VERSION,
    MAX_PEER_URL,
    PEER_URL_SCHEMES,
    NamespaceInfo,
    Register,
    TierInfo,
)
from kvtier.storage.types import TIER_KINDS


class RegistrationError(ValueError):
    """A ``Register`` the controller refuses (wrong version or token, bad namespace spec)."""


def namespace_from_spec(spec: bytes) -> KeyNamespace:
    """Rebuild a :class:`KeyNamespace` from its canonical JSON (``KeyNamespace.canonical_bytes()``).

    Raises:
        ValueError: not UTF-8 JSON, missing/extra fields, another key scheme, or invalid values.
    """
    try:
        doc = json.loads(spec.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"namespace spec is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("namespace spec is not a JSON object")
    scheme = doc.pop("scheme", None)
    if scheme != KEY_SCHEME_VERSION:
        raise ValueError(f"namespace spec uses key scheme {scheme!r}, this controller knows {KEY_SCHEME_VERSION}")
    layout = doc.pop("layout", None)
    if not isinstance(layout, dict):
        raise ValueError("namespace spec has no layout object")
    try:
        return KeyNamespace(layout=LayoutSignature(**layout), **doc)
    except TypeError as exc:
        raise ValueError(f"namespace spec has wrong fields: {exc}") from None


def check_peer_url(instance: str, url: str) -> None:
    """Refuse a ``Register.peer_url`` that is not "" or ``SCHEME://REST`` with a known scheme, printable, short.

    Raises:
        RegistrationError: naming the instance and the problem.
    """
    if not url:
        return
    scheme, sep, rest = url.partition("://")
    if len(url) > MAX_PEER_URL or not url.isprintable() or scheme not in PEER_URL_SCHEMES or not sep or not rest:
        raise RegistrationError(
            f"instance {instance!r}: peer_url {url[:64]!r} must be {' or '.join(s + '://...' for s in PEER_URL_SCHEMES)}"
            f" (at most {MAX_PEER_URL} printable characters)")


@dataclass
class NamespaceEntry:
    """A registered namespace: its wire info, the rebuilt namespace and a hasher for it."""

    info: NamespaceInfo
    namespace: KeyNamespace
    hasher: ChunkHasher

    @property
    def digest(self) -> bytes:
        return self.info.digest


@dataclass
class InstanceRecord:
    """One registered instance.

    Attributes:
        instance: instance id (also its ZMQ identity).
        epoch: random per process start of the instance.
        role: ``"embedded"`` or ``"server"``.
        namespaces: namespace digest -> entry.
        tiers: tier label (``TierInfo.kind``) -> info, in registration order.
        registered_at: wall-clock time of the ``Register`` (seconds since the epoch).
        last_seen: ``time.monotonic()`` of the last message.
        last_heartbeat: wall-clock time of the last heartbeat (0: none yet).
        health: the last heartbeat's health map.
        peer_url: the URL its peer server listens on ("" when it serves no peers).
    """

    instance: str
    epoch: str
    role: str
    host: str
    pid: int
    namespaces: dict[bytes, NamespaceEntry]
    tiers: dict[str, TierInfo]
    registered_at: float
    last_seen: float
    last_heartbeat: float = 0.0
    health: dict[str, Any] = field(default_factory=dict)
    peer_url: str = ""

    def tier_label(self, tier: str) -> str | None:
        """The label (kind) of a tier named by kind or by ``TierInfo.name``; None if unknown."""
        if tier in self.tiers:
            return tier
        for label, info in self.tiers.items():
            if info.name == tier:
                return label
        return None


class InstanceRegistry:
    """Instances by id, with expiry.

    Args:
        token: the token agents must present in ``Register.token`` ("" or None: none needed).
        expiry_s: silence after which an instance is forgotten (seconds).
    """

    def __init__(self, token: str | None = None, expiry_s: float = DEFAULT_EXPIRY_S):
        self._token = token or ""
        self.expiry_s = expiry_s
        self._instances: dict[str, InstanceRecord] = {}

    def __contains__(self, instance: str) -> bool:
        return instance in self._instances

    def get(self, instance: str) -> InstanceRecord | None:
        return self._instances.get(instance)

    def ids(self) -> list[str]:
        return sorted(self._instances)

    def records(self) -> list[InstanceRecord]:
        return [self._instances[i] for i in sorted(self._instances)]

    def register(self, msg: Register, now: float | None = None) -> tuple[InstanceRecord, bool]:
        """Record a ``Register``.

        Returns:
            ``(record, replaced)``: ``replaced`` is True when a record with another epoch
            existed (the instance restarted: its pending operations are void). The caller
            rebuilds the instance's index either way (a resync follows every ``Register``).

        Raises:
            RegistrationError: wrong protocol version or token, no tiers, bad tier kind, or a
                namespace whose spec does not rebuild to its digest.
        """
        if msg.version != FLEET_PROTOCOL_VERSION:
            raise RegistrationError(
                f"instance {msg.instance!r} speaks fleet protocol {msg.version}, controller {FLEET_PROTOCOL_VERSION}")
        if self._token and not msg.token:
            raise RegistrationError(f"instance {msg.instance!r} sent no token; this controller requires one "
                                    "(the instance's controller_token setting: KVTIER_CONTROLLER_TOKEN, "
                                    "kvtier server --controller-token)")
        if self._token and not hmac.compare_digest(msg.token.encode(), self._token.encode()):
            raise RegistrationError(f"instance {msg.instance!r} presented a wrong token")
        if not msg.instance:
            raise RegistrationError("empty instance id")
        check_peer_url(msg.instance, msg.peer_url)
        tiers: dict[str, TierInfo] = {}
        for info in msg.tiers:
            if info.kind not in TIER_KINDS:
                raise RegistrationError(f"instance {msg.instance!r}: tier kind {info.kind!r} not in {TIER_KINDS}")
            tiers.setdefault(info.kind, info)
        namespaces: dict[bytes, NamespaceEntry] = {}
        for ns_info in msg.namespaces:
            try:
                ns = namespace_from_spec(ns_info.spec)
            except ValueError as exc:
                raise RegistrationError(f"instance {msg.instance!r}: {exc}") from None
            if ns.digest() != ns_info.digest:
                raise RegistrationError(
                    f"instance {msg.instance!r}: namespace spec does not match its digest {ns_info.digest.hex()}")
            namespaces[ns_info.digest] = NamespaceEntry(ns_info, ns, ChunkHasher(ns))
        now_m = time.monotonic() if now is None else now
        old = self._instances.get(msg.instance)
        replaced = old is not None and old.epoch != msg.epoch
        rec = InstanceRecord(
            instance=msg.instance, epoch=msg.epoch, role=msg.role, host=msg.host, pid=msg.pid,
            namespaces=namespaces, tiers=tiers, registered_at=time.time(), last_seen=now_m, peer_url=msg.peer_url,
        )
        self._instances[msg.instance] = rec
        return rec, replaced

    def touch(self, instance: str, epoch: str, now: float | None = None) -> InstanceRecord | None:
        """Mark a message from ``instance``; None if unknown or of another epoch."""
        rec = self._instances.get(instance)
        if rec is None or rec.epoch != epoch:
            return None
        rec.last_seen = time.monotonic() if now is None else now
        return rec

    def expired(self, now: float | None = None) -> list[str]:
        """Ids silent for longer than ``expiry_s``."""
        now_m = time.monotonic() if now is None else now
        return [i for i, r in self._instances.items() if now_m - r.last_seen > self.expiry_s]

    def drop(self, instance: str) -> InstanceRecord | None:
        return self._instances.pop(instance, None)
