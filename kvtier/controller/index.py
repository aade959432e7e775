"""The fleet index: which chunk keys each instance holds, per namespace and tier.

Per instance, per namespace digest, per tier label (``cpu``/``disk``/``remote``/``peer``)
a table ``key -> parent`` (32-byte keys; parent None for a chain's first chunk) plus the
keys pinned there. A tier registered as ``shared`` (the same Redis URL or shared
filesystem on several instances) keeps one *view* per sharer, keyed by its ``TierInfo.name``;
every sharer sees the union of the views. A sharer's snapshot replaces its own view only, so
one member's empty (or lying) snapshot never erases what the others report; a removal or clear
in the shared store applies to every view and makes the other sharers resync, whose snapshots
(listings of the real store) then repair their views.

Claims are bounded (issue 24): a table holds at most the chunks its tier's declared capacity
fits (``capacity_bytes // chunk_bytes``, plus 1/16 slack for index lag; :data:`UNBOUNDED_TIER_KEYS`
for a tier without a capacity) and an instance at most ``max_keys_per_instance`` keys over all its
tables; stores beyond are not indexed (counted in :attr:`FleetIndex.claims_dropped`).

Consistency (see :mod:`kvtier.protocol.fleet`): ``Changes`` are numbered per epoch; a gap
(or a heartbeat whose ``seq`` is ahead of the last applied one) marks the instance
``needs_resync``. A ``Snapshot`` is assembled from its parts and swapped in on the last
part; ``Changes`` newer than the snapshot's ``seq`` that were already applied are replayed
onto the new table from a short log, so the swap never loses them.

Not thread-safe: callers hold :attr:`kvtier.controller.state.FleetState.lock`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from kvtier.index.keys import is_lineage
from kvtier.protocol.fleet import NO_PARENT, Changes, FleetProtocolError, Snapshot, TierInfo, split_keys

#: Recent ``Changes`` kept per instance to replay after a snapshot swap.
CHANGE_LOG = 512
#: Most keys of one table of a tier that declares no capacity (Redis, a shared filesystem).
UNBOUNDED_TIER_KEYS = 1 << 20
#: Default most keys one instance may have indexed (over its namespaces and tiers).
DEFAULT_MAX_KEYS_PER_INSTANCE = 1 << 21

TableId = tuple


@dataclass
class PrefixMatch:
    """Longest cached prefix of one key chain on one instance, in chunks.

    Attributes:
        per_tier: tier label -> leading chunks that tier holds by itself.
        longest: leading chunks held by any tier (a load may mix tiers per chunk).
        pinned: leading chunks that are held and pinned.
    """

    per_tier: dict[str, int]
    longest: int
    pinned: int


@dataclass
class _Pending:
    resync_id: int
    seq: int = 0
    entries: dict[bytes, bytes | None] = field(default_factory=dict)
    pinned: set[bytes] = field(default_factory=set)


class _Union:
    """The read view of a shared tier: the union of its sharers' views (``in``, iteration, ``items``)."""

    def __init__(self, views: list[dict[bytes, bytes | None]]):
        self.views = views

    def __contains__(self, key: object) -> bool:
        return any(key in v for v in self.views)

    def __iter__(self) -> Iterator[bytes]:
        seen: set[bytes] = set()
        for v in self.views:
            for k in v:
                if k not in seen:
                    seen.add(k)
                    yield k

    def __len__(self) -> int:
        return len(self.views[0]) if len(self.views) == 1 else len(set(self))

    def items(self) -> Iterator[tuple[bytes, bytes | None]]:
        for v in self.views:
            yield from v.items()

    def get(self, key: bytes, default: bytes | None = None) -> bytes | None:
        for v in self.views:
            if key in v:
                return v[key]
        return default


def _pairs(keys: bytes, parents: bytes) -> list[tuple[bytes, bytes | None]]:
    ks = split_keys(keys)
    ps = split_keys(parents) if parents else []
    if ps and len(ps) != len(ks):
        raise FleetProtocolError(f"{len(ks)} keys but {len(ps)} parents")
    if not ps:
        return [(k, None) for k in ks]
    return [(k, None if p == NO_PARENT else p) for k, p in zip(ks, ps)]


class FleetIndex:
    """Index of every registered instance's chunks (see the module docstring).

    Args:
        max_keys_per_instance: most keys one instance may have indexed over all its tables.
    """

    def __init__(self, max_keys_per_instance: int = DEFAULT_MAX_KEYS_PER_INSTANCE) -> None:
        self.max_keys_per_instance = max_keys_per_instance
        self._tables: dict[TableId, dict[bytes, bytes | None]] = {}
        self._shared_refs: dict[TableId, set[str]] = {}
        #: instance -> tier label -> TierInfo
        self._tiers: dict[str, dict[str, TierInfo]] = {}
        self._namespaces: dict[str, set[bytes]] = {}
        self._limits: dict[tuple[str, bytes, str], int] = {}
        self._held: dict[str, int] = {}
        self._pins: dict[tuple[str, bytes], dict[str, set[bytes]]] = {}
        self._seq: dict[str, int | None] = {}
        self._log: dict[str, deque[Changes]] = {}
        self._pending: dict[tuple[str, bytes, str], _Pending] = {}
        self.needs_resync: set[str] = set()
        #: Counters (read by /metrics).
        self.gaps = 0
        self.snapshots_applied = 0
        self.changes_applied = 0
        self.claims_dropped = 0

    # -- membership ---------------------------------------------------------------

    def add_instance(self, instance: str, tiers: dict[str, TierInfo], namespaces: list[bytes],
                     chunk_bytes: dict[bytes, int] | None = None) -> None:
        """Start (or restart) indexing ``instance`` with these tiers and namespaces (empty tables).

        ``chunk_bytes``: namespace digest -> bytes of one chunk, to bound each table by its tier's
        declared capacity (a namespace without it: :data:`UNBOUNDED_TIER_KEYS`).
        """
        self.drop_instance(instance)
        self._tiers[instance] = dict(tiers)
        self._namespaces[instance] = set(namespaces)
        self._seq[instance] = None
        self._log[instance] = deque(maxlen=CHANGE_LOG)
        self._held[instance] = 0
        for label, info in tiers.items():
            for ns in namespaces:
                cb = (chunk_bytes or {}).get(ns, 0)
                if info.capacity_bytes > 0 and cb > 0:
                    cap = info.capacity_bytes // cb
                    self._limits[(instance, ns, label)] = min(UNBOUNDED_TIER_KEYS, cap + max(64, cap // 16))
                else:
                    self._limits[(instance, ns, label)] = UNBOUNDED_TIER_KEYS
                if info.shared:
                    self._shared_refs.setdefault(("s", info.name, ns, label), set()).add(instance)
                    self._tables.setdefault(self._table_id(instance, ns, label), {})

    def drop_instance(self, instance: str) -> None:
        """Forget everything about ``instance`` (the other sharers' views of a shared tier stay)."""
        tiers = self._tiers.get(instance)
        namespaces = self._namespaces.get(instance, set())
        if tiers is not None:
            for label, info in tiers.items():
                for ns in namespaces:
                    view = self._tables.pop(self._table_id_for(instance, ns, label, info), None)
                    self._limits.pop((instance, ns, label), None)
                    if info.shared:
                        group = ("s", info.name, ns, label)
                        refs = self._shared_refs.get(group, set())
                        refs.discard(instance)
                        if not refs:
                            self._shared_refs.pop(group, None)
                        elif view:  # what it wrote is still in the store: the next sharer carries it
                            heir = min(refs)
                            self._apply_own(heir, ns, label, self._table(heir, ns, label), "s",
                                            b"".join(view), b"".join(p or NO_PARENT for p in view.values()))
                            self.needs_resync.update(refs)  # until their snapshots say what the store holds
        for ns in namespaces:
            self._pins.pop((instance, ns), None)
        self._tiers.pop(instance, None)
        self._namespaces.pop(instance, None)
        self._seq.pop(instance, None)
        self._log.pop(instance, None)
        self._held.pop(instance, None)
        self.needs_resync.discard(instance)
        for k in [k for k in self._pending if k[0] == instance]:
            del self._pending[k]

    def instances(self) -> list[str]:
        return sorted(self._tiers)

    @staticmethod
    def _table_id_for(instance: str, ns: bytes, label: str, info: TierInfo) -> TableId:
        if info.shared:
            return ("s", info.name, ns, label, instance)
        return ("i", instance, ns, label)

    def _table_id(self, instance: str, ns: bytes, label: str) -> TableId:
        return self._table_id_for(instance, ns, label, self._tiers[instance][label])

    def _table(self, instance: str, ns: bytes, label: str) -> dict[bytes, bytes | None]:
        """``instance``'s own table (its view, for a shared tier), created on demand."""
        tid = self._table_id(instance, ns, label)
        t = self._tables.get(tid)
        if t is None:
            t = self._tables[tid] = {}
        return t

    def _sharers(self, instance: str, ns: bytes, label: str) -> list[str]:
        info = self._tiers.get(instance, {}).get(label)
        if info is None or not info.shared:
            return [instance]
        return sorted(self._shared_refs.get(("s", info.name, ns, label), {instance}))

    def _read(self, instance: str, ns: bytes, label: str) -> "dict[bytes, bytes | None] | _Union":
        """What ``instance`` sees in a tier: its table, or the union of every sharer's view."""
        info = self._tiers[instance][label]
        if not info.shared:
            return self._tables.get(self._table_id_for(instance, ns, label, info)) or {}
        views = [self._tables.get(("s", info.name, ns, label, o)) or {} for o in self._sharers(instance, ns, label)]
        return views[0] if len(views) == 1 else _Union(views)

    def _room(self, instance: str, ns: bytes, label: str, current: int) -> int:
        """Keys the table of ``(instance, ns, label)`` holding ``current`` may still take."""
        per_table = self._limits.get((instance, ns, label), UNBOUNDED_TIER_KEYS) - current
        per_instance = self.max_keys_per_instance - self._held.get(instance, 0)
        return max(0, min(per_table, per_instance))

    def _check(self, instance: str, ns: bytes, label: str) -> None:
        if instance not in self._tiers:
            raise FleetProtocolError(f"instance {instance!r} is not indexed")
        if label not in self._tiers[instance]:
            raise FleetProtocolError(f"instance {instance!r} has no tier {label!r}")
        if ns not in self._namespaces[instance]:
            raise FleetProtocolError(f"instance {instance!r} did not register namespace {ns.hex()[:16]}")

    # -- updates ------------------------------------------------------------------

    def apply_snapshot(self, msg: Snapshot, label: str) -> bool:
        """Fold one snapshot part in; on the last part swap the table in (a shared tier: this
        instance's view only).

        Args:
            msg: the part.
            label: its tier label (resolved from ``msg.tier`` by the caller).

        Returns:
            True when this part completed the snapshot (the table was swapped).

        Raises:
            FleetProtocolError: unknown instance/tier/namespace, or a key list that is not
                a multiple of 32 bytes (the part is dropped, nothing changes).
        """
        inst = msg.instance
        self._check(inst, msg.namespace, label)
        pairs = _pairs(msg.keys, msg.parents)
        pinned = split_keys(msg.pinned)
        pk = (inst, msg.namespace, label)
        pending = self._pending.get(pk)
        if pending is None or pending.resync_id != msg.resync_id:
            pending = self._pending[pk] = _Pending(msg.resync_id)
        tid = self._table_id(inst, msg.namespace, label)
        old = len(self._tables.get(tid, ()))
        fresh = len(pending.entries)  # the old table is replaced: it does not count against the instance
        room = min(self._limits.get(pk, UNBOUNDED_TIER_KEYS) - fresh,
                   self.max_keys_per_instance - (self._held.get(inst, 0) - old) - fresh)
        if len(pairs) > room:
            self.claims_dropped += len(pairs) - max(0, room)
            pairs = pairs[: max(0, room)]
        pending.entries.update(pairs)
        pending.pinned.update(pinned)
        pending.seq = max(pending.seq, msg.seq)
        if not msg.last:
            return False
        del self._pending[pk]
        table = pending.entries
        last_seq = self._seq.get(inst)
        log = self._log[inst]
        self._tables[tid] = {}  # while replaying, the old table no longer counts
        self._held[inst] = self._held.get(inst, 0) - old + len(table)
        if last_seq is not None and last_seq > pending.seq:
            newer = [c for c in log if c.seq > pending.seq]
            if len(newer) < last_seq - pending.seq:  # the log no longer reaches back: resync again
                self.needs_resync.add(inst)
            for ch in newer:
                for change in ch.changes:
                    if change.namespace == msg.namespace and self._label_of(inst, change.tier) == label:
                        self._apply_own(inst, msg.namespace, label, table, change.op, change.keys, change.parents)
        else:
            self._seq[inst] = pending.seq
        self._tables[tid] = table
        self._pins.setdefault((inst, msg.namespace), {})[label] = pending.pinned
        self._pins[(inst, msg.namespace)].pop("_ops", None)
        self.snapshots_applied += 1
        return True

    def _label_of(self, instance: str, tier: str) -> str | None:
        tiers = self._tiers.get(instance, {})
        if tier in tiers:
            return tier
        for label, info in tiers.items():
            if info.name == tier:
                return label
        return None

    def _apply_own(self, instance: str, ns: bytes, label: str, table: dict[bytes, bytes | None], op: str,
                   keys: bytes, parents: bytes) -> None:
        """Apply one change to ``instance``'s own ``table`` (stores bounded by :meth:`_room`)."""
        before = len(table)
        if op == "s":
            pairs = [(k, p) for k, p in _pairs(keys, parents)]
            fresh = [kp for kp in pairs if kp[0] not in table]
            room = self._room(instance, ns, label, before)
            if len(fresh) > room:
                self.claims_dropped += len(fresh) - room
                keep = {k for k, _ in fresh[:room]}
                pairs = [kp for kp in pairs if kp[0] in table or kp[0] in keep]
            table.update(pairs)
        elif op == "r":
            for k in split_keys(keys):
                table.pop(k, None)
        elif op == "c":
            table.clear()
        self._held[instance] = self._held.get(instance, 0) + len(table) - before

    def apply_changes(self, msg: Changes) -> bool:
        """Apply one ``Changes`` message.

        Returns:
            True when a gap in ``seq`` was seen (the instance now ``needs_resync``).

        Raises:
            FleetProtocolError: unknown instance, or a change naming an unknown tier or
                namespace or with a bad key list (the changes before it stay applied and
                the instance is marked ``needs_resync``).
        """
        inst = msg.instance
        if inst not in self._tiers:
            raise FleetProtocolError(f"instance {inst!r} is not indexed")
        last = self._seq.get(inst)
        gap = False
        if last is not None:
            if msg.seq <= last:
                return False  # duplicate or already folded into a snapshot
            if msg.seq != last + 1:
                gap = True
                self.gaps += 1
                self.needs_resync.add(inst)
        self._seq[inst] = msg.seq
        self._log[inst].append(msg)
        for change in msg.changes:
            label = self._label_of(inst, change.tier)
            try:
                if label is None:
                    raise FleetProtocolError(f"instance {inst!r} has no tier {change.tier!r}")
                self._check(inst, change.namespace, label)
                ns = change.namespace
                self._apply_own(inst, ns, label, self._table(inst, ns, label), change.op, change.keys, change.parents)
                if change.op != "s":
                    for other in self._sharers(inst, ns, label):  # the store lost them: every view
                        if other != inst:
                            self._apply_own(other, ns, label, self._table(other, ns, label), change.op,
                                            change.keys, b"")
                    self._resync_sharers(inst, ns, label)
            except FleetProtocolError:
                self.needs_resync.add(inst)
                raise
        self.changes_applied += 1
        return gap

    def _resync_sharers(self, instance: str, ns: bytes, label: str) -> None:
        """A removal or clear in a shared tier: the other instances sharing it resync.

        Messages of different instances are not ordered with each other: another instance's
        store may have reached the shared store after this removal yet reached the controller
        before it (and been wiped from its view here). The sharers' snapshots, taken after they
        get the request, list what the store really holds (and repair what a lying removal erased).
        """
        for other in self._sharers(instance, ns, label):
            if other != instance:
                self.needs_resync.add(other)

    def held(self, instance: str) -> int:
        """Keys indexed for ``instance`` over all its tables (its views of shared tiers included)."""
        return self._held.get(instance, 0)

    def heartbeat_seq(self, instance: str, seq: int) -> bool:
        """Note a heartbeat's ``seq``; True (and ``needs_resync``) when changes were lost."""
        last = self._seq.get(instance)
        if instance in self._tiers and last is not None and seq > last:
            self.needs_resync.add(instance)
            return True
        if instance in self._tiers and last is None and seq > 0:
            # Nothing applied yet (a restarted controller): the requested snapshot brings it.
            return False
        return False

    def applied_seq(self, instance: str) -> int | None:
        """``seq`` of the last ``Changes`` applied for ``instance`` (None: none yet, or unknown)."""
        return self._seq.get(instance)

    def set_pins(self, instance: str, ns: bytes, keys: list[bytes], pinned: bool) -> None:
        """Record a pin/unpin the controller itself ran (until the next snapshot says otherwise)."""
        pins = self._pins.setdefault((instance, ns), {})
        if pinned:
            pins.setdefault("_ops", set()).update(keys)
        else:
            for s in pins.values():
                s.difference_update(keys)

    # -- queries ------------------------------------------------------------------

    def namespaces(self, instance: str) -> set[bytes]:
        return set(self._namespaces.get(instance, ()))

    def tier_labels(self, instance: str) -> list[str]:
        return list(self._tiers.get(instance, {}))

    def longest_prefix(self, instance: str, ns: bytes, keys: list[bytes]) -> dict[str, int]:
        """Tier label -> leading chunks of ``keys`` that tier holds (O(len(keys)) dict lookups per tier)."""
        return self.match(instance, ns, keys).per_tier

    def match(self, instance: str, ns: bytes, keys: list[bytes]) -> PrefixMatch:
        """Per-tier, any-tier and pinned leading chunks of ``keys`` on ``instance`` (all 0 if unknown)."""
        tiers = self._tiers.get(instance)
        if tiers is None or ns not in self._namespaces.get(instance, ()):
            return PrefixMatch({}, 0, 0)
        per_tier: dict[str, int] = {}
        tables = []
        for label in tiers:
            t = self._read(instance, ns, label)
            tables.append(t)
            n = 0
            for k in keys:
                if k not in t:
                    break
                n += 1
            per_tier[label] = n
        longest = max(per_tier.values(), default=0)
        for i in range(longest, len(keys)):
            k = keys[i]
            if not any(k in t for t in tables):
                break
            longest = i + 1
        pinned = 0
        pin_sets = [s for s in self._pins.get((instance, ns), {}).values() if s]
        if pin_sets:
            for i in range(longest):
                if not any(keys[i] in s for s in pin_sets):
                    break
                pinned = i + 1
        return PrefixMatch(per_tier, longest, pinned)

    def local_run(self, instance: str, ns: bytes, keys: list[bytes], labels: tuple[str, ...] = ("cpu", "disk")) -> int:
        """Leading chunks of ``keys`` that ``instance``'s own tiers named in ``labels`` hold (a chunk may be in
        any of them; shared tiers are skipped: a peer server serves only its local chunks). 0 if unknown."""
        tiers = self._tiers.get(instance)
        if tiers is None or ns not in self._namespaces.get(instance, ()):
            return 0
        tables = [self._tables.get(self._table_id(instance, ns, label)) or {}
                  for label, info in tiers.items() if label in labels and not info.shared]
        n = 0
        for k in keys:
            if not any(k in t for t in tables):
                break
            n += 1
        return n

    def tier_chunks(self, instance: str, ns: bytes, label: str) -> int:
        """Chunks indexed for one (instance, namespace, tier)."""
        if label not in self._tiers.get(instance, {}) or ns not in self._namespaces.get(instance, ()):
            return 0
        return len(self._read(instance, ns, label))

    def keys_in(self, instance: str, ns: bytes, label: str | None = None) -> set[bytes]:
        """Distinct keys held on ``instance`` in namespace ``ns`` (one tier, or all)."""
        out: set[bytes] = set()
        for lab in self._tiers.get(instance, {}):
            if label is None or lab == label:
                out.update(self._read(instance, ns, lab))
        return out

    def keys_of_salt(self, instance: str, ns: bytes, lineage: bytes,
                     label: str | None = None) -> tuple[list[bytes], int]:
        """Keys on ``instance`` (in tier ``label``, or any) whose chain starts at ``lineage``
        (``KeyNamespace.lineage(cache_salt)``, the recorded parent of a prompt's first chunk),
        and how many of its chunks have no known lineage.

        Parents are resolved across the instance's tiers (a tier that stores no parents, such as
        Redis after a resync, borrows them from the others). A chunk whose ancestry ends at an
        unknown parent (written without a lineage marker, e.g. by an older kvtier or a direct
        ``StorageManager`` user) cannot be attributed to any salt: it is counted, not cleared.
        """
        parents: dict[bytes, bytes | None] = {}
        for lab in self._tiers.get(instance, {}):
            for k, p in self._read(instance, ns, lab).items():
                if p is not None or k not in parents:
                    parents[k] = p
        children: dict[bytes, list[bytes]] = {}
        for k, p in parents.items():
            if p is not None:
                children.setdefault(p, []).append(k)

        def below(starts: list[bytes]) -> list[bytes]:
            out: list[bytes] = []
            seen: set[bytes] = set()
            todo = list(starts)
            while todo:
                for k in children.get(todo.pop(), ()):
                    if k not in seen:
                        seen.add(k)
                        out.append(k)
                        todo.append(k)
            return out

        attributed = len(below([p for p in children if is_lineage(p)]))
        keys = below([lineage])
        if label is not None:
            table = self._read(instance, ns, label)
            keys = [k for k in keys if k in table]
        return keys, len(parents) - attributed
