"""Registered instances: who they are, their epochs, namespaces, tiers and last heartbeat.

An instance is known from its ``Register`` until it is silent for ``expiry_s`` seconds
(no message of any kind); a ``Register`` with a new ``epoch`` for a known id replaces the
old record (the instance restarted; the caller drops its old index). Not thread-safe on
its own: the :class:`~kvtier.controller.server.Controller` serialises access with one lock.

**Who owns a record** (issue 24: identity is never a claimed id). A record is bound to the
connection that registered it (:class:`Sender`: the ZMQ routing id the controller's ROUTER
assigned, and with CURVE the member's authenticated public key):

- with members (CURVE): only connections of the same key speak for it (a reconnect or a restart
  of that member rebinds it); another key's ``Register`` of a live id is refused, and a key must
  be a current member with the ``register`` role whose ``ids``/``models`` allow what it registers;
- without members (a loopback controller): the record's ``epoch`` (random per process start, never
  shown) is the proof: messages of another epoch are ignored, and a ``Register`` of a live id from
  another connection with another epoch is refused until the record expires (``Ack.retry_s``).

So no connection ever displaces a live member, whatever id it claims.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
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
from kvtier.protocol.decoding import json_loads
from kvtier.protocol.trust import Members
from kvtier.storage.types import TIER_KINDS

#: Live instance records one member key may hold (its TP ranks, a restart overlapping its old self).
MAX_INSTANCES_PER_MEMBER = 16
#: Rebuilt namespaces kept by spec (a Register repeats the same few specs).
NAMESPACE_CACHE = 256


@dataclass(frozen=True)
class Sender:
    """Where an agent message came from: the ZMQ routing id of its connection (assigned by the
    controller's ROUTER, never chosen by the agent) and, over CURVE, the Z85 public key it proved
    ("" without CURVE)."""

    routing_id: bytes
    key: str = ""

    @classmethod
    def of(cls, who: "Sender | str | bytes") -> "Sender":
        """A Sender from a routing id given as text or bytes (tests, in-process callers)."""
        if isinstance(who, Sender):
            return who
        return cls(who.encode() if isinstance(who, str) else bytes(who))


def epoch_fingerprint(epoch: str) -> str:
    """A non-secret stand-in for an epoch (``/instances`` shows it: a restart changes it), 12 hex digits."""
    return hashlib.blake2s(epoch.encode(), digest_size=6).hexdigest()


class RegistrationError(ValueError):
    """A ``Register`` the controller refuses (wrong version or token, bad namespace spec, not a member);
    ``retry_s`` > 0 when it may succeed later by itself (the id is held by a live connection)."""

    def __init__(self, message: str, retry_s: float = 0.0):
        super().__init__(message)
        self.retry_s = retry_s


def namespace_from_spec(spec: bytes) -> KeyNamespace:
    """Rebuild a :class:`KeyNamespace` from its canonical JSON (``KeyNamespace.canonical_bytes()``).

    Raises:
        ValueError: not UTF-8 JSON, missing/extra fields, another key scheme, or invalid values.
    """
    try:
        doc = json_loads(spec.decode())
    except ValueError as exc:  # not UTF-8, not JSON, or nested too deeply (json_loads)
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
        routing_id: the ZMQ routing id of the connection that speaks for it now.
        member_key: the Z85 public key it authenticated with ("" without CURVE).
        member: that member's name in the members file ("").
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
    routing_id: bytes = b""
    member_key: str = ""
    member: str = ""

    @property
    def authenticated(self) -> bool:
        """True when it proved a member key (CURVE)."""
        return bool(self.member_key)

    def tier_label(self, tier: str) -> str | None:
        """The label (kind) of a tier named by kind or by ``TierInfo.name``; None if unknown."""
        if tier in self.tiers:
            return tier
        for label, info in self.tiers.items():
            if info.name == tier:
                return label
        return None


class InstanceRegistry:
    """Instances by id, with expiry and ownership (see the module docstring).

    Args:
        token: the token agents must present in ``Register.token`` ("" or None: none needed);
            not asked of members authenticated by CURVE.
        expiry_s: silence after which an instance is forgotten (seconds).
        members: the authorized members (the controller runs CURVE); None: no member check.
    """

    def __init__(self, token: str | None = None, expiry_s: float = DEFAULT_EXPIRY_S, members: Members | None = None):
        self._token = token or ""
        self.expiry_s = expiry_s
        self.members = members
        self._instances: dict[str, InstanceRecord] = {}
        self._spaces: OrderedDict[bytes, tuple[KeyNamespace, ChunkHasher]] = OrderedDict()

    def __contains__(self, instance: str) -> bool:
        return instance in self._instances

    def get(self, instance: str) -> InstanceRecord | None:
        return self._instances.get(instance)

    def ids(self) -> list[str]:
        return sorted(self._instances)

    def records(self) -> list[InstanceRecord]:
        return [self._instances[i] for i in sorted(self._instances)]

    def _namespace(self, spec: bytes) -> tuple[KeyNamespace, ChunkHasher]:
        got = self._spaces.get(spec)
        if got is None:
            ns = namespace_from_spec(spec)
            got = (ns, ChunkHasher(ns))
            self._spaces[spec] = got
            while len(self._spaces) > NAMESPACE_CACHE:
                self._spaces.popitem(last=False)
        else:
            self._spaces.move_to_end(spec)
        return got

    def _owns(self, rec: InstanceRecord, msg_epoch: str, sender: Sender) -> bool:
        """May ``sender`` speak for ``rec``? (module docstring)."""
        if rec.member_key:
            return hmac.compare_digest(sender.key, rec.member_key)
        return sender.routing_id == rec.routing_id or hmac.compare_digest(msg_epoch, rec.epoch)

    def register(self, msg: Register, now: float | None = None,
                 sender: Sender | str | bytes | None = None) -> tuple[InstanceRecord, bool]:
        """Record a ``Register`` from ``sender`` (default: a connection named after the instance).

        Returns:
            ``(record, replaced)``: ``replaced`` is True when a record with another epoch
            existed (the instance restarted: its pending operations are void). The caller
            rebuilds the instance's index either way (a resync follows every ``Register``).

        Raises:
            RegistrationError: wrong protocol version or token, not a member (or not allowed this id or
                a namespace's model), the id held by another live connection (``retry_s`` set), too many
                records of one member, no tiers, a bad tier kind, a namespace whose spec does not rebuild
                to its digest or whose chunk geometry disagrees with it.
        """
        who = Sender.of(sender if sender is not None else msg.instance)
        inst = msg.instance
        if msg.version != FLEET_PROTOCOL_VERSION:
            raise RegistrationError(
                f"instance {inst!r} speaks fleet protocol {msg.version}, controller {FLEET_PROTOCOL_VERSION}")
        member = None
        if self.members is not None:
            member = self.members.get(who.key) if who.key else None
            if member is None or not member.may("register"):
                raise RegistrationError(f"instance {inst!r}: key {who.key or '(none)'} is not a fleet member with the "
                                        "register role here")
            if not member.allows_id(inst):
                raise RegistrationError(f"member {member.name!r} may not register instance id {inst!r}")
        elif self._token and not msg.token:
            raise RegistrationError(f"instance {inst!r} sent no token; this controller requires one "
                                    "(the instance's controller_token setting: KVTIER_CONTROLLER_TOKEN, "
                                    "kvtier server --controller-token)")
        elif self._token and not hmac.compare_digest(msg.token.encode(), self._token.encode()):
            raise RegistrationError(f"instance {inst!r} presented a wrong token")
        if not inst:
            raise RegistrationError("empty instance id")
        old = self._instances.get(inst)
        if old is not None and not self._owns(old, msg.epoch, who):
            raise RegistrationError(
                f"instance id {inst!r} is held by another live connection"
                f"{' of member ' + repr(old.member) if old.member else ''}; retrying", retry_s=self.expiry_s)
        if member is not None:
            mine = sum(1 for r in self._instances.values() if r.member_key == who.key and r.instance != inst)
            if mine >= MAX_INSTANCES_PER_MEMBER:
                raise RegistrationError(f"member {member.name!r} holds {mine} live instances already "
                                        f"(at most {MAX_INSTANCES_PER_MEMBER})")
        check_peer_url(inst, msg.peer_url)
        tiers: dict[str, TierInfo] = {}
        for info in msg.tiers:
            if info.kind not in TIER_KINDS:
                raise RegistrationError(f"instance {inst!r}: tier kind {info.kind!r} not in {TIER_KINDS}")
            tiers.setdefault(info.kind, info)
        namespaces: dict[bytes, NamespaceEntry] = {}
        for ns_info in msg.namespaces:
            try:
                ns, hasher = self._namespace(ns_info.spec)
            except ValueError as exc:
                raise RegistrationError(f"instance {inst!r}: {exc}") from None
            if ns.digest() != ns_info.digest:
                raise RegistrationError(
                    f"instance {inst!r}: namespace spec does not match its digest {ns_info.digest.hex()}")
            if ns.chunk_bytes != ns_info.chunk_bytes or ns.chunk_size != ns_info.chunk_size:
                raise RegistrationError(
                    f"instance {inst!r}: namespace {ns.model!r} declares {ns_info.chunk_size} tokens / "
                    f"{ns_info.chunk_bytes} bytes per chunk; its layout gives {ns.chunk_size} / {ns.chunk_bytes}")
            if member is not None and not member.allows_model(ns.model):
                raise RegistrationError(f"member {member.name!r} may not register model {ns.model!r}")
            namespaces[ns_info.digest] = NamespaceEntry(ns_info, ns, hasher)
        now_m = time.monotonic() if now is None else now
        replaced = old is not None and old.epoch != msg.epoch
        rec = InstanceRecord(
            instance=inst, epoch=msg.epoch, role=msg.role, host=msg.host, pid=msg.pid,
            namespaces=namespaces, tiers=tiers, registered_at=time.time(), last_seen=now_m, peer_url=msg.peer_url,
            routing_id=who.routing_id, member_key=who.key if member is not None else "",
            member=member.name if member is not None else "",
        )
        self._instances[inst] = rec
        return rec, replaced

    def owner(self, instance: str, epoch: str, sender: Sender | str | bytes | None = None,
              now: float | None = None) -> InstanceRecord | None:
        """The record ``sender`` may speak for (same epoch, and its key or, without CURVE, that epoch),
        marked seen and rebound to ``sender``'s connection; None otherwise."""
        rec = self._instances.get(instance)
        who = Sender.of(sender if sender is not None else instance)
        if rec is None or rec.epoch != epoch or not self._owns(rec, epoch, who):
            return None
        rec.routing_id = who.routing_id  # the agent reconnected (a new routing id): replies go there
        rec.last_seen = time.monotonic() if now is None else now
        return rec

    def touch(self, instance: str, epoch: str, now: float | None = None) -> InstanceRecord | None:
        """:meth:`owner` for a sender named after the instance (in-process callers and tests)."""
        return self.owner(instance, epoch, None, now)

    def excuse(self, seconds: float) -> None:
        """Do not count ``seconds`` of silence against any record: the controller itself could not listen
        for that long (its endpoint was not scheduled), so what it did not hear says nothing of them."""
        for r in self._instances.values():
            r.last_seen += seconds

    def expired(self, now: float | None = None) -> list[str]:
        """Ids silent for longer than ``expiry_s``, and ids whose member key was revoked."""
        now_m = time.monotonic() if now is None else now
        out = [i for i, r in self._instances.items() if now_m - r.last_seen > self.expiry_s]
        if self.members is not None:
            out += [i for i, r in self._instances.items()
                    if i not in out and r.member_key and not self.members.admits(r.member_key, "register")]
        return out

    def drop(self, instance: str) -> InstanceRecord | None:
        return self._instances.pop(instance, None)
