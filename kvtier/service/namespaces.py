"""Registration and the namespace table of the cache service.

Who may register what:

- the namespace must be hostable: a known KV dtype, geometry within bounds,
  ``chunk_bytes`` equal to what the layout gives (else ``BAD_NAMESPACE``, or
  ``NAMESPACE_MISMATCH`` for a digest/chunk-bytes disagreement);
- its model id must match the allow-list when one is configured
  (``NamespacePolicy.allowed_models``, shell-style patterns), and a client id may
  bring at most ``max_per_client`` namespaces into the table (else
  ``NOT_ALLOWED``);
- at most ``max_namespaces`` are hosted at once. They share ``cpu_capacity``
  dynamically (:mod:`kvtier.memory.budget`): each one's sparse segment spans the
  whole capacity, slots are charged to one byte budget as they are used, so a
  namespace alone can fill the capacity and a namespace that needs room takes
  it back from the one furthest above its fair share (``cpu_capacity / hosted
  namespaces``) by evicting that one's unreferenced, unpinned leaf chunks.
  ``disk_capacity`` is shared too: each hosted namespace's disk tier is bounded by
  ``disk_capacity / hosted namespaces`` (a lone namespace gets all of it; the
  others shrink leaf-first before a new one opens, and grow when one leaves;
  the maintenance pass retries a shrink that pinned chunks held up). A namespace
  with no registered session and nothing pinned is released after
  ``idle_release_s`` seconds (by the maintenance pass, or at once when a new
  namespace needs its place), so a client that registered a namespace and left
  cannot lock the server.

Refusals are logged at WARNING at most once per client id and reason per
``log_interval_s`` (a flood of bad registrations writes a bounded number of
lines and no traceback).

Invariants (under the table lock): ``len(hosts) <= max_namespaces``; every
registered session's host is in the table (a host is released only when no
session uses it); the hosts' charged CPU bytes add up to at most
``cpu_capacity`` (asserted by the budget at every charge).
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvtier import protocol as P
from kvtier.config import KVTierConfig
from kvtier.index.keys import _NUMPY_ITEMSIZE_ALIASES, KeyNamespace
from kvtier.memory.budget import ByteBudget
from kvtier.protocol import ErrorCode, ProtocolError
from kvtier.service.namespace_host import NamespaceHost
from kvtier.service.quotas import QuotaLimits, QuotaTable
from kvtier.service.ratelog import RateLimitedLog
from kvtier.service.session import Registered, Session
from kvtier.tiers.disk.tier import DiskTier

if TYPE_CHECKING:
    from kvtier.service.session import SessionTable

log = logging.getLogger(__name__)

#: Bounds on a namespace's geometry (a registration outside them is BAD_NAMESPACE).
MAX_GEOMETRY = {"block_size": 1 << 16, "num_layers": 4096, "num_kv_heads": 4096, "head_dim": 1 << 16}
MAX_CHUNK_TOKENS = 1 << 20
MAX_NAME_CHARS = 512


@dataclass(frozen=True)
class NamespacePolicy:
    """What the namespace table allows.

    Attributes:
        max_namespaces: namespaces hosted at once (they share the CPU capacity
            dynamically; the disk capacity is split evenly).
        allowed_models: shell-style patterns of model ids that may register
            (empty: any).
        max_per_client: namespaces one client id may bring into the table.
        idle_release_s: seconds a namespace with no session and no pin is kept.
        hold_share / lease_share: fraction of a namespace's CPU slots one client
            id may hold (reservations + reads) / pin with leases.
        max_holds_per_client: upper bound on a client id's holds (slots).
        reservation_timeout_s: an uncommitted reservation older than this is aborted.
        log_interval_s: a refusal is logged once per client id and reason per interval.
        verify_loads: check a chunk's commit checksum before serving it from the
            CPU tier (see :mod:`kvtier.service.integrity`).
    """

    max_namespaces: int = 8
    allowed_models: tuple[str, ...] = ()
    max_per_client: int = 4
    idle_release_s: float = 300.0
    hold_share: float = 0.5
    lease_share: float = 0.5
    max_holds_per_client: int = 1024
    reservation_timeout_s: float = 30.0
    log_interval_s: float = 60.0
    verify_loads: bool = True

    def __post_init__(self) -> None:
        """Raises ValueError naming the server option whose value cannot work."""
        for name, flag in (("max_namespaces", "max_namespaces"), ("max_per_client", "max_namespaces_per_client"),
                           ("max_holds_per_client", "max_holds_per_client")):
            if getattr(self, name) < 1:
                raise ValueError(f"server option {flag} must be >= 1, got {getattr(self, name)}")
        for name, flag in (("hold_share", "client_hold_share"), ("lease_share", "client_lease_share")):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"server option {flag} must be a fraction in (0, 1], got {v}")
        for name, flag in (("idle_release_s", "namespace_idle_s"), ("reservation_timeout_s", "reservation_timeout_s"),
                           ("log_interval_s", "refusal_log_interval_s")):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"server option {flag} must be > 0 seconds, got {v}")
        for pat in self.allowed_models:
            if not isinstance(pat, str) or not pat:
                raise ValueError(f"server option allowed_models needs non-empty model id patterns, got {pat!r}")


def validate_namespace(ns: KeyNamespace, chunk_bytes: int) -> None:
    """Refuse a namespace the server cannot host.

    Raises:
        ProtocolError: ``BAD_NAMESPACE`` naming the field, its value and what is accepted.
    """
    lay = ns.layout
    if lay.dtype not in _NUMPY_ITEMSIZE_ALIASES:
        try:
            dt = np.dtype(lay.dtype)
            ok = dt.kind in "fiu" and dt.itemsize in (1, 2, 4, 8)
        except TypeError:
            ok = False
        if not ok:
            raise ProtocolError(
                ErrorCode.BAD_NAMESPACE,
                f"layout.dtype {lay.dtype[:64]!r} is not a KV dtype; accepted: "
                f"{', '.join(sorted(_NUMPY_ITEMSIZE_ALIASES))} or a numpy int/float dtype name",
            )
    for name, bound in MAX_GEOMETRY.items():
        v = getattr(lay, name)
        if not 1 <= v <= bound:
            raise ProtocolError(ErrorCode.BAD_NAMESPACE, f"layout.{name} {v} outside 1-{bound}")
    if not 1 <= ns.chunk_size <= MAX_CHUNK_TOKENS:
        raise ProtocolError(ErrorCode.BAD_NAMESPACE, f"chunk_size {ns.chunk_size} outside 1-{MAX_CHUNK_TOKENS}")
    for name in ("model",):
        if len(getattr(ns, name)) > MAX_NAME_CHARS:
            raise ProtocolError(ErrorCode.BAD_NAMESPACE, f"{name} longer than {MAX_NAME_CHARS} characters")
    for name in ("engine", "attn_backend", "kv_layout"):
        if len(getattr(lay, name)) > MAX_NAME_CHARS:
            raise ProtocolError(ErrorCode.BAD_NAMESPACE, f"layout.{name} longer than {MAX_NAME_CHARS} characters")
    if chunk_bytes != ns.chunk_bytes:
        raise ProtocolError(
            ErrorCode.NAMESPACE_MISMATCH,
            f"chunk_bytes {chunk_bytes} differs from the namespace's {ns.chunk_bytes} "
            "(chunk_size x 2 x layers x kv heads x head_dim x dtype size)",
        )


@dataclass
class _Entry:
    host: NamespaceHost
    creator: str
    idle_since: float | None  # monotonic time the last session left; None while used
    attaching: int = 0  # registrations between _attach and the session's registered state
    reading: int = 0  # peer reads holding this namespace's chunks (kvtier.service.peer_host)


class NamespaceTable:
    """The hosted namespaces, registration and the maintenance pass (thread-safe).

    Args:
        config: the server's tier settings.
        policy: limits (see :class:`NamespacePolicy`).
        sessions: the live sessions (to tell whether a namespace is in use).
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(
        self,
        config: KVTierConfig,
        policy: NamespacePolicy,
        sessions: "SessionTable",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.policy = policy
        self.sessions = sessions
        self.quotas = QuotaTable()
        self.refusals = RateLimitedLog(log, policy.log_interval_s)
        self._clock = clock
        self._entries: dict[bytes, _Entry] = {}
        self._lock = threading.Lock()
        self.budget = ByteBudget(int(config.cpu_capacity))  # shared by every hosted namespace's CPU pool
        self.released = 0
        #: Counter stats of the namespaces released so far, summed (see metrics.COUNTER_STAT_NAMES).
        self.released_counters: dict[str, float] = {}
        self.expired_reservations = 0
        p = policy
        log.info(
            "kvtier server: namespaces max %d (%d per client id, released after %.0f s unused), models %s; "
            "per client id: %.0f%% of slots held, %.0f%% leased; reservations expire after %.0f s; verify loads %s",
            p.max_namespaces, p.max_per_client, p.idle_release_s, ", ".join(p.allowed_models) or "any",
            100 * p.hold_share, 100 * p.lease_share, p.reservation_timeout_s, "on" if p.verify_loads else "off",
        )

    # -- inspection ---------------------------------------------------------------------
    def hosts(self) -> list[NamespaceHost]:
        with self._lock:
            return [e.host for e in self._entries.values()]

    def hold_all(self) -> list[tuple[bytes, NamespaceHost, Callable[[], None]]]:
        """Every hosted namespace with a release callable; none is released until its callable runs.

        Used by peer reads (:mod:`kvtier.service.peer_host`): a held namespace's segment stays mapped.
        """
        with self._lock:
            return [(d, e.host, self._holder(e)) for d, e in self._entries.items()]

    def hold_again(self, digest: bytes) -> Callable[[], None]:
        """One more hold on namespace ``digest``, which the caller holds already (see :meth:`hold_all`)."""
        with self._lock:
            e = self._entries[digest]
            assert e.reading > 0, "hold_again on a namespace the caller does not hold"
            return self._holder(e)

    def _holder(self, e: _Entry) -> Callable[[], None]:
        e.reading += 1
        done = threading.Event()

        def release() -> None:
            with self._lock:
                if done.is_set():
                    return
                done.set()
                e.reading -= 1
                assert e.reading >= 0, "namespace read holds went negative"

        return release

    def close(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for e in entries:
            e.host.close()

    # -- register -----------------------------------------------------------------------
    def register(
        self, s: Session, r: P.Register, token: str | None, instance: bytes
    ) -> tuple[dict[str, Any], int | None]:
        """Register session ``s``: check who it is and what it brings, attach it to its namespace.

        Returns the reply fields and the segment fd to pass (Unix) or None.

        Raises:
            ProtocolError: ``BAD_STATE``, ``AUTH``, ``NAMESPACE_MISMATCH``,
                ``BAD_NAMESPACE``, ``NOT_ALLOWED``, ``CAPACITY`` (each logged,
                rate-limited).
        """
        try:
            return self._register(s, r, token, instance)
        except ProtocolError as exc:
            self.refusals.warning(
                r.client_id, exc.code, "kvtier server: registration of client %r (pid %d) refused: %s: %s",
                r.client_id[:64], r.pid, exc.code, exc,
            )
            raise

    def _register(
        self, s: Session, r: P.Register, token: str | None, instance: bytes
    ) -> tuple[dict[str, Any], int | None]:
        if s.registered is not None:
            raise ProtocolError(ErrorCode.BAD_STATE, "already registered")
        if s.kind == "tcp":
            expected = token or ""
            if r.token is None or not hmac.compare_digest(r.token.encode(), expected.encode()):
                raise ProtocolError(ErrorCode.AUTH, "a valid token is required on TCP")
        validate_namespace(r.namespace, r.chunk_bytes)
        digest = r.namespace.digest()
        if digest != r.namespace_digest:
            raise ProtocolError(ErrorCode.NAMESPACE_MISMATCH, "namespace digest does not match its fields")
        allowed = self.policy.allowed_models
        if allowed and not any(fnmatch.fnmatchcase(r.namespace.model, pat) for pat in allowed):
            raise ProtocolError(
                ErrorCode.NOT_ALLOWED,
                f"model {r.namespace.model[:128]!r} is not in this server's allowed models ({', '.join(allowed)})",
            )
        host = self._attach(r.namespace, digest, r.client_id)
        try:
            p = self.policy
            limits = QuotaLimits.for_pool(host.pool.num_slots, p.hold_share, p.lease_share, p.max_holds_per_client)
            s.holds.quota = self.quotas.attach(digest, r.client_id, limits)
            s.registered = Registered(host, r.client_id, r.pid, f"{len(r.client_id)}:{r.client_id}/")
        finally:
            with self._lock:
                e = self._entries.get(digest)
                if e is not None:
                    e.attaching -= 1
        seg: dict[str, Any] = {
            "size": host.segment.size, "slot_bytes": host.pool.slot_bytes, "num_slots": host.pool.num_slots,
        }
        out: dict[str, Any] = {
            "segment": seg, "server_pid": os.getpid(), "instance": instance,
            "chunk_size": r.namespace.chunk_size,
        }
        fd = None
        if s.kind == "unix":
            seg["fd"] = True
            fd = host.segment.fd
        else:
            seg["path"] = f"/proc/{os.getpid()}/fd/{host.segment.fd}"
        log.info("kvtier server: client %s (pid %d, %s) registered", r.client_id, r.pid, s.kind)
        return out, fd

    def detach(self, s: Session) -> None:
        """Session ``s`` ended (its holds already released): give up its quota share, mark idle namespaces."""
        reg = s.registered
        if reg is None:
            return
        self.quotas.detach(reg.host.digest, reg.client_id)
        s.holds.quota = None

    def _attach(self, ns: KeyNamespace, digest: bytes, client_id: str) -> NamespaceHost:
        with self._lock:
            e = self._entries.get(digest)
            if e is not None:
                e.idle_since = None
                e.attaching += 1
                return e.host
            mine = sum(1 for x in self._entries.values() if x.creator == client_id)
            if mine >= self.policy.max_per_client:
                raise ProtocolError(
                    ErrorCode.NOT_ALLOWED,
                    f"client {client_id[:64]!r} already brought {mine} namespace(s), the most one client may "
                    "(--max-namespaces-per-client)",
                )
            n = self.policy.max_namespaces
            if len(self._entries) >= n:
                self._release_idle_locked(force=True)
            if len(self._entries) >= n:
                raise ProtocolError(
                    ErrorCode.NAMESPACE_MISMATCH,
                    f"this server hosts {n} other key namespace(s) (model/layout/chunk size/rank) in use and "
                    "no more; start it with a larger --max-namespaces or use another server",
                )
            share = self._disk_share(len(self._entries) + 1)
            self._set_disk_shares_locked(share)  # make room on disk before the new one opens
            try:
                host = NamespaceHost(
                    self.config, ns, int(self.config.cpu_capacity), share,
                    verify_loads=self.policy.verify_loads, budget=self.budget,
                )
            except ValueError as exc:
                self._set_disk_shares_locked(self._disk_share(len(self._entries)))
                raise ProtocolError(ErrorCode.CAPACITY, str(exc)) from None
            self._entries[digest] = _Entry(host, client_id, None, 1)
            assert len(self._entries) <= n, "more namespaces than max_namespaces"
            log.info(
                "kvtier server: hosting namespace %s (%s, %d slots)", digest.hex()[:16], ns.model[:128],
                host.pool.num_slots,
            )
            return host

    # -- maintenance --------------------------------------------------------------------
    def maintain(self) -> None:
        """Expire old reservations, release namespaces idle past ``idle_release_s``, trim stray pages."""
        now = self._clock()
        cutoff = now - self.policy.reservation_timeout_s
        for s in self.sessions.snapshot():
            reg = s.registered
            if reg is None or not s.holds.reserved_at:
                continue
            n = s.holds.expire_reservations(cutoff, reg.host.manager)
            if n:
                self.expired_reservations += n
                reg.host.expired_reservations += n
                self.refusals.warning(
                    reg.client_id, "expired", "kvtier server: client %r (pid %d) held %d reservations over %.0f s; aborted",
                    reg.client_id[:64], reg.pid, n, self.policy.reservation_timeout_s,
                )
        with self._lock:
            self._release_idle_locked(force=False)
            self._set_disk_shares_locked(self._disk_share(len(self._entries)))
            hosts = [e.host for e in self._entries.values()]
        for host in hosts:
            host.trim()
        self.budget.check_invariants()

    def _disk_share(self, hosted: int) -> int:
        """Bytes of ``disk_capacity`` each of ``hosted`` namespaces may use (all of it for one)."""
        return int(self.config.disk_capacity) // max(1, hosted)

    def _set_disk_shares_locked(self, share: int) -> None:
        """Bound every hosted namespace's disk tier by ``share`` bytes (shrinking evicts leaves)."""
        for e in self._entries.values():
            disk = e.host.manager.disk
            if isinstance(disk, DiskTier) and disk.capacity_bytes != share:  # (the only tier of kind disk)
                disk.set_capacity(share)

    def _keep_counters(self, host: NamespaceHost) -> None:
        """Add a namespace's counter stats to :attr:`released_counters` before it goes."""
        from kvtier.service.metrics import counter_values

        try:
            values = counter_values(host.typed_stats())
        except Exception:  # defensive: releasing must not fail for its bookkeeping
            log.exception("kvtier server: reading a released namespace's counters failed")
            return
        for name, v in values.items():
            self.released_counters[name] = self.released_counters.get(name, 0.0) + v

    def _release_idle_locked(self, force: bool) -> None:
        """Release unused namespaces: idle longer than ``idle_release_s`` (or any unused one when ``force``)."""
        now = self._clock()
        used = {id(s.registered.host) for s in self.sessions.snapshot() if s.registered is not None}
        for digest, e in list(self._entries.items()):
            if e.attaching or e.reading or id(e.host) in used or e.host.manager.leases.pinned_keys:
                e.idle_since = None
                continue
            if e.idle_since is None:
                e.idle_since = now
            if force or now - e.idle_since >= self.policy.idle_release_s:
                del self._entries[digest]
                self.released += 1
                self._keep_counters(e.host)
                log.info("kvtier server: released idle namespace %s (%s)", digest.hex()[:16], e.host.namespace.model[:128])
                e.host.close()


def maintenance_loop(table: NamespaceTable, stopping: Callable[[], bool], interval_s: float = 0.5) -> None:
    """Run :meth:`NamespaceTable.maintain` every ``interval_s`` until ``stopping()`` (a failing pass is logged)."""
    while not stopping():
        time.sleep(interval_s)
        try:
            table.maintain()
        except Exception:
            log.exception("kvtier server: maintenance pass failed")
