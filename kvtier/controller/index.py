"""The fleet index: which chunk keys each instance holds, per namespace and tier.

Per instance, per namespace digest, per tier label (``cpu``/``disk``/``remote``/``peer``)
a table ``key -> parent`` (32-byte keys; parent None for a chain's first chunk) plus the
keys pinned there. A tier registered as ``shared`` (the same Redis URL or shared
filesystem on several instances) is one table keyed by its ``TierInfo.name``: any
instance's snapshot or changes update it, and every instance that has it sees it.

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

from kvtier.index.keys import is_lineage
from kvtier.protocol.fleet import NO_PARENT, Changes, Snapshot, TierInfo, split_keys

#: Recent ``Changes`` kept per instance to replay after a snapshot swap.
CHANGE_LOG = 512

TableId = tuple[str, str, bytes, str]


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


def _pairs(keys: bytes, parents: bytes) -> list[tuple[bytes, bytes | None]]:
    ks = split_keys(keys)
    ps = split_keys(parents) if parents else []
    if ps and len(ps) != len(ks):
        from kvtier.protocol.fleet import FleetProtocolError

        raise FleetProtocolError(f"{len(ks)} keys but {len(ps)} parents")
    if not ps:
        return [(k, None) for k in ks]
    return [(k, None if p == NO_PARENT else p) for k, p in zip(ks, ps)]


class FleetIndex:
    """Index of every registered instance's chunks (see the module docstring)."""

    def __init__(self) -> None:
        self._tables: dict[TableId, dict[bytes, bytes | None]] = {}
        self._shared_refs: dict[TableId, set[str]] = {}
        #: instance -> tier label -> TierInfo
        self._tiers: dict[str, dict[str, TierInfo]] = {}
        self._namespaces: dict[str, set[bytes]] = {}
        self._pins: dict[tuple[str, bytes], dict[str, set[bytes]]] = {}
        self._seq: dict[str, int | None] = {}
        self._log: dict[str, deque[Changes]] = {}
        self._pending: dict[tuple[str, bytes, str], _Pending] = {}
        self.needs_resync: set[str] = set()
        #: Counters (read by /metrics).
        self.gaps = 0
        self.snapshots_applied = 0
        self.changes_applied = 0

    # -- membership ---------------------------------------------------------------

    def add_instance(self, instance: str, tiers: dict[str, TierInfo], namespaces: list[bytes]) -> None:
        """Start (or restart) indexing ``instance`` with these tiers and namespaces (empty tables)."""
        self.drop_instance(instance)
        self._tiers[instance] = dict(tiers)
        self._namespaces[instance] = set(namespaces)
        self._seq[instance] = None
        self._log[instance] = deque(maxlen=CHANGE_LOG)
        for label, info in tiers.items():
            if info.shared:
                for ns in namespaces:
                    tid = self._table_id(instance, ns, label)
                    self._shared_refs.setdefault(tid, set()).add(instance)
                    self._tables.setdefault(tid, {})

    def drop_instance(self, instance: str) -> None:
        """Forget everything about ``instance`` (shared tables stay while another instance has them)."""
        tiers = self._tiers.pop(instance, None)
        namespaces = self._namespaces.pop(instance, set())
        if tiers is not None:
            for label, info in tiers.items():
                for ns in namespaces:
                    tid = self._table_id_for(instance, ns, label, info)
                    if info.shared:
                        refs = self._shared_refs.get(tid, set())
                        refs.discard(instance)
                        if not refs:
                            self._shared_refs.pop(tid, None)
                            self._tables.pop(tid, None)
                    else:
                        self._tables.pop(tid, None)
            for ns in namespaces:
                self._pins.pop((instance, ns), None)
        self._seq.pop(instance, None)
        self._log.pop(instance, None)
        self.needs_resync.discard(instance)
        for k in [k for k in self._pending if k[0] == instance]:
            del self._pending[k]

    def instances(self) -> list[str]:
        return sorted(self._tiers)

    @staticmethod
    def _table_id_for(instance: str, ns: bytes, label: str, info: TierInfo) -> TableId:
        if info.shared:
            return ("s", info.name, ns, label)
        return ("i", instance, ns, label)

    def _table_id(self, instance: str, ns: bytes, label: str) -> TableId:
        return self._table_id_for(instance, ns, label, self._tiers[instance][label])

    def _table(self, instance: str, ns: bytes, label: str) -> dict[bytes, bytes | None]:
        tid = self._table_id(instance, ns, label)
        t = self._tables.get(tid)
        if t is None:
            t = self._tables[tid] = {}
        return t

    def _check(self, instance: str, ns: bytes, label: str) -> None:
        from kvtier.protocol.fleet import FleetProtocolError

        if instance not in self._tiers:
            raise FleetProtocolError(f"instance {instance!r} is not indexed")
        if label not in self._tiers[instance]:
            raise FleetProtocolError(f"instance {instance!r} has no tier {label!r}")
        if ns not in self._namespaces[instance]:
            raise FleetProtocolError(f"instance {instance!r} did not register namespace {ns.hex()[:16]}")

    # -- updates ------------------------------------------------------------------

    def apply_snapshot(self, msg: Snapshot, label: str) -> bool:
        """Fold one snapshot part in; on the last part swap the table in.

        Args:
            msg: the part.
            label: its tier label (resolved from ``msg.tier`` by the caller).

        Returns:
            True when this part completed the snapshot (the table was swapped).

        Raises:
            FleetProtocolError: unknown instance/tier/namespace, or a key list that is not
                a multiple of 32 bytes (the part is dropped, nothing changes).
        """
        self._check(msg.instance, msg.namespace, label)
        pairs = _pairs(msg.keys, msg.parents)
        pinned = split_keys(msg.pinned)
        pk = (msg.instance, msg.namespace, label)
        pending = self._pending.get(pk)
        if pending is None or pending.resync_id != msg.resync_id:
            pending = self._pending[pk] = _Pending(msg.resync_id)
        pending.entries.update(pairs)
        pending.pinned.update(pinned)
        pending.seq = max(pending.seq, msg.seq)
        if not msg.last:
            return False
        del self._pending[pk]
        table = pending.entries
        last_seq = self._seq.get(msg.instance)
        log = self._log[msg.instance]
        if last_seq is not None and last_seq > pending.seq:
            newer = [c for c in log if c.seq > pending.seq]
            if len(newer) < last_seq - pending.seq:  # the log no longer reaches back: resync again
                self.needs_resync.add(msg.instance)
            for ch in newer:
                for change in ch.changes:
                    if change.namespace == msg.namespace and self._label_of(msg.instance, change.tier) == label:
                        self._apply_one(table, change.op, change.keys, change.parents)
        else:
            self._seq[msg.instance] = pending.seq
        self._tables[self._table_id(msg.instance, msg.namespace, label)] = table
        self._pins.setdefault((msg.instance, msg.namespace), {})[label] = pending.pinned
        self._pins[(msg.instance, msg.namespace)].pop("_ops", None)
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

    @staticmethod
    def _apply_one(table: dict[bytes, bytes | None], op: str, keys: bytes, parents: bytes) -> None:
        if op == "s":
            table.update(_pairs(keys, parents))
        elif op == "r":
            for k in split_keys(keys):
                table.pop(k, None)
        elif op == "c":
            table.clear()

    def apply_changes(self, msg: Changes) -> bool:
        """Apply one ``Changes`` message.

        Returns:
            True when a gap in ``seq`` was seen (the instance now ``needs_resync``).

        Raises:
            FleetProtocolError: unknown instance, or a change naming an unknown tier or
                namespace or with a bad key list (the changes before it stay applied and
                the instance is marked ``needs_resync``).
        """
        from kvtier.protocol.fleet import FleetProtocolError

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
                self._apply_one(self._table(inst, change.namespace, label), change.op, change.keys, change.parents)
                if change.op != "s":
                    self._resync_sharers(inst, change.namespace, label)
            except FleetProtocolError:
                self.needs_resync.add(inst)
                raise
        self.changes_applied += 1
        return gap

    def _resync_sharers(self, instance: str, ns: bytes, label: str) -> None:
        """A removal or clear in a shared tier: the other instances sharing it resync.

        Messages of different instances are not ordered with each other: another instance's
        store may have reached the shared store after this removal yet reached the controller
        before it (and been wiped from the table here). The sharers' snapshots, taken after they
        get the request, list what the store really holds.
        """
        info = self._tiers.get(instance, {}).get(label)
        if info is None or not info.shared:
            return
        tid = self._table_id_for(instance, ns, label, info)
        for other in self._shared_refs.get(tid, ()):
            if other != instance:
                self.needs_resync.add(other)

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
            t = self._tables.get(self._table_id(instance, ns, label)) or {}
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
        return len(self._tables.get(self._table_id(instance, ns, label), ()))

    def keys_in(self, instance: str, ns: bytes, label: str | None = None) -> set[bytes]:
        """Distinct keys held on ``instance`` in namespace ``ns`` (one tier, or all)."""
        out: set[bytes] = set()
        for lab in self._tiers.get(instance, {}):
            if label is None or lab == label:
                out.update(self._tables.get(self._table_id(instance, ns, lab), ()))
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
            for k, p in self._tables.get(self._table_id(instance, ns, lab), {}).items():
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
            table = self._tables.get(self._table_id(instance, ns, label), {})
            keys = [k for k in keys if k in table]
        return keys, len(parents) - attributed
