"""Operations a fleet controller runs on one instance's storage (clear, pin, move, compress...).

:class:`InstanceOps` wraps one :class:`~kvtier.storage.manager.StorageManager`.
Every method may be called from another thread while the engine runs (each
uses only the tiers' thread-safe calls; operations are serialized among
themselves by one lock). Arguments: chunk keys are 32-byte ``bytes``; tier names
are :data:`~kvtier.storage.types.TIER_KINDS` labels (``"cpu"``, ``"disk"``,
``"remote"``; a tier named by kind is the first lower tier of that kind). Results
are plain dicts of ints, floats, strings and lists (JSON-able), except
:meth:`InstanceOps.snapshot` and :meth:`InstanceOps.pinned_keys`, which return keys.
Bad arguments raise :class:`OpError` (a ``ValueError``) whose message starts with
the offending field; a failing tier is a miss, never an exception.

Semantics worth knowing:

- Operations that write or remove chunks of a lower tier first flush the
  manager's write-behind, so a queued write cannot undo them.
- ``delete`` in a prefix-closed tier (``cpu``, ``disk``) also removes the deleted
  chunks' resident descendants (a chunk is never kept without its parent); a
  chunk being read stays, with its ancestors. ``remote`` tiers delete only the
  named keys (their orphans are never hit: lookups walk prefixes).
- ``bytes`` in results are the tier's own accounting where it has one (CPU
  slots, disk file bytes), else ``chunks * chunk_bytes``.
- Pins are leases owned by ``"pin:" + pin_id`` (:data:`~kvtier.storage.leases.PIN_PREFIX`):
  pinned chunks are never evicted from the CPU or disk tier. The union of all
  pins may cover at most half of the CPU tier's slots.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from kvtier.storage import ops_codec, ops_move, ops_pins, ops_remove, ops_state
from kvtier.storage.manager import StorageManager
from kvtier.storage.ops_args import (
    KEY_BYTES,
    OpError,
    Tier,
    check_codec,
    check_keys,
    check_parents,
    check_pin_id,
    check_ttl,
    resolve_tier,
    resolve_tiers,
    tier_names,
)
from kvtier.storage.ops_staging import FLUSH_TIMEOUT_S

__all__ = ["FLUSH_TIMEOUT_S", "KEY_BYTES", "InstanceOps", "OpError", "Tier"]


class InstanceOps:
    """Controller operations on one storage manager (see the module doc).

    Argument checks live in :mod:`kvtier.storage.ops_args`; the operations' bodies in
    :mod:`~kvtier.storage.ops_remove`, :mod:`~kvtier.storage.ops_pins`,
    :mod:`~kvtier.storage.ops_move`, :mod:`~kvtier.storage.ops_codec` and
    :mod:`~kvtier.storage.ops_state`. This class checks arguments, then runs the body
    under its lock (queries run without it).

    Args:
        manager: the instance's storage manager (not owned: closing it is the caller's job).
    """

    def __init__(self, manager: StorageManager):
        self.m = manager
        self._lock = threading.Lock()

    def tier_names(self) -> list[str]:
        """The tier labels this instance has, fastest first (``cpu`` then each lower tier's kind)."""
        return tier_names(self.m)

    # -- queries ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, list[tuple[bytes, bytes | None]]]:
        """Resident chunks per tier label: ``{tier: [(key, parent), ...]}``.

        ``cpu`` from its index, ``disk`` from its index, ``remote`` by listing the store
        (fs: the namespace's files, parents from the record headers; Redis: ``SCAN`` of
        the namespace's key prefix, parents None). A tier that cannot list its chunks
        (:meth:`~kvtier.tiers.base.LowerTier.scan_keys` raises NotImplementedError) or
        fails is omitted. Cost: O(chunks); the remote listing is a store round trip per
        1000 keys (Redis) or a file open per record (fs).
        """
        return ops_state.resident_chunks(self.m)

    def pinned_keys(self) -> list[bytes]:
        """Keys of every live pin (each once, in pin order)."""
        return ops_pins.pinned(self.m)

    # -- removal ----------------------------------------------------------------------------------
    def clear(self, tier: str | None = None) -> dict[str, int]:
        """Remove this namespace's chunks from ``tier`` (None: every tier).

        Chunks being read stay (with their ancestors). Returns ``{"chunks", "bytes"}`` removed.

        Raises:
            OpError: unknown ``tier``.
        """
        targets = resolve_tiers(self.m, tier)
        with self._lock:
            return ops_remove.clear_tiers(self.m, targets)

    def delete(self, keys: Sequence[bytes], tier: str | None = None) -> dict[str, int]:
        """Remove ``keys`` from ``tier`` (None: every tier); see the module doc for descendants.

        Returns ``{"chunks", "bytes"}`` removed (descendants included).

        Raises:
            OpError: unknown ``tier``, a key that is not 32 bytes.
        """
        keys = check_keys(keys)
        targets = resolve_tiers(self.m, tier)
        with self._lock:
            return ops_remove.delete_keys(self.m, keys, targets)

    # -- pins -----------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], pin_id: str, ttl_s: float | None = None) -> dict[str, int]:
        """Pin ``keys`` (never evicted from CPU or disk) under ``pin_id`` (replacing that pin).

        Args:
            ttl_s: seconds the pin lasts; None: until :meth:`unpin`.

        Returns:
            ``{"pinned": n}``: how many of ``keys`` some tier of this instance holds now
            (the others are pinned too, should they arrive).

        Raises:
            OpError: bad keys, empty ``pin_id``, non-positive ``ttl_s``, or all pins together
                would cover more than half of the CPU tier's chunk slots.
        """
        keys = check_keys(keys)
        check_pin_id(pin_id)
        check_ttl(ttl_s)
        with self._lock:
            return ops_pins.grant_pin(self.m, keys, pin_id, ttl_s)

    def unpin(self, pin_id: str) -> dict[str, int]:
        """End pin ``pin_id``; returns ``{"unpinned": keys it covered}`` (0 for an unknown pin).

        Raises:
            OpError: empty ``pin_id``.
        """
        check_pin_id(pin_id)
        with self._lock:
            return ops_pins.end_pin(self.m, pin_id)

    # -- moves --------------------------------------------------------------------------------------
    def move_local(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None] | None, src: str, dst: str, copy: bool = False
    ) -> dict[str, int]:
        """Move (or ``copy``) the chunks of ``src`` among ``keys`` to ``dst`` (``cpu``, ``disk``,
        ``remote`` of this instance), through a CPU slot.

        A chunk read from a lower tier goes into a CPU slot (reserve, read, commit); the
        destination write is synchronous and confirmed by asking ``dst``. Without ``copy``
        the source copies of the moved chunks are deleted afterwards (with their
        descendants in a prefix-closed source). A CPU copy made only for the move is
        dropped again when ``dst`` is not ``cpu``. ``parents``: each key's parent (None:
        ``keys`` are one prompt's chain in order).

        Returns ``{"moved": chunks now in dst, "bytes": moved * chunk_bytes}``; keys not in
        ``src`` are not counted.

        Raises:
            OpError: bad keys/parents, unknown or equal ``src``/``dst``.
        """
        keys = check_keys(keys)
        pars = check_parents(parents, keys)
        s = resolve_tier(self.m, src, "src")
        d = resolve_tier(self.m, dst, "dst")
        if s == d:
            raise OpError(f"dst: same tier as src ({dst!r})")
        with self._lock:
            return ops_move.move_between(self.m, keys, pars, s, d, copy)

    def export(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None, tier: str = "remote"
    ) -> dict[str, int]:
        """Make sure ``keys`` are in the (shared) lower ``tier``, writing those it lacks from
        wherever this instance holds them (CPU, other lower tiers); confirmed by asking the tier.

        Returns ``{"exported": keys the tier holds afterwards}``.

        Raises:
            OpError: bad keys/parents, unknown tier or ``cpu``.
        """
        keys = check_keys(keys)
        pars = check_parents(parents, keys)
        d = resolve_tier(self.m, tier, "tier", allow_cpu=False)
        with self._lock:
            return ops_move.export_to(self.m, keys, pars, d)

    def import_(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None, dst: str = "cpu"
    ) -> dict[str, int]:
        """Bring ``keys`` from this instance's other tiers (e.g. a shared remote tier) into
        ``dst`` (``cpu``: the manager's promotion path; ``disk``: a synchronous write).

        Returns ``{"imported": keys dst holds afterwards}``.

        Raises:
            OpError: bad keys/parents, unknown ``dst`` or one that is not cpu/disk.
        """
        keys = check_keys(keys)
        pars = check_parents(parents, keys)
        d = resolve_tier(self.m, dst, "dst")
        if d != "cpu" and not d.local:
            raise OpError(f"dst: import goes into 'cpu' or 'disk', not {dst!r}")
        with self._lock:
            return ops_move.import_into(self.m, keys, pars, d)

    # -- re-encoding and checks ------------------------------------------------------------------
    def compress(self, keys: Sequence[bytes], tier: str, codec: str) -> dict[str, Any]:
        """Re-encode the stored chunks ``keys`` of lower ``tier`` in place with ``codec``
        (a name of :mod:`kvtier.serde.registry`; ``"raw"`` decompresses).

        Each chunk is read (decoded), rewritten with ``codec`` and read back; the error
        is measured against what was read first, element-wise in the namespace's dtype
        (non-finite originals are skipped). The fs and Redis tiers store a codec name
        with each value; the disk tier's records are raw only.

        Returns:
            ``{"chunks": rewritten, "bytes_before", "bytes_after": stored bytes of those
            chunks, "max_abs_error": float, "lossless": bool}`` (``lossless``: the codec
            is lossless and every chunk read back bit-exactly).

        Raises:
            OpError: bad keys, unknown tier or ``cpu``, unknown codec, or a tier whose
                format cannot hold ``codec`` (the message names it).
        """
        keys = check_keys(keys)
        t = resolve_tier(self.m, tier, "tier", allow_cpu=False)
        c = check_codec(codec)
        with self._lock:
            return ops_codec.recode(self.m, keys, t, c)

    def decompress(self, keys: Sequence[bytes], tier: str) -> dict[str, Any]:
        """:meth:`compress` with codec ``raw``."""
        return self.compress(keys, tier, "raw")

    def verify(self, keys: Sequence[bytes], tier: str | None = None) -> dict[str, Any]:
        """Load every chunk of ``keys`` from ``tier`` (None: every tier) into a scratch buffer
        (never the engine's) and check it: lower tiers checksum what they return; a CPU
        chunk is checked by taking a read reference (the CPU tier holds no checksum).

        Returns ``{"verified", "missing", "corrupt", "tiers": {tier: {same three}}}``. With
        ``tier`` None a key counts as verified if some tier returns it intact, corrupt if
        tiers hold it but none returns it, missing if no tier holds it. A corrupt local
        record is removed by its tier (a miss from then on).

        Raises:
            OpError: bad keys or unknown tier.
        """
        keys = check_keys(keys)
        targets = resolve_tiers(self.m, tier)
        with self._lock:
            return ops_codec.verify_keys(self.m, keys, targets)

    def health(self, probe: bool = False) -> dict[str, dict[str, Any]]:
        """Per tier label: ``reachable``, ``read_errors``, ``write_errors``, ``breaker``
        (``closed``/``open``/``half_open``/``n/a``), ``queue_depth`` (write-behind items
        waiting), ``used_bytes``, ``capacity_bytes``, ``chunks``, from the tiers' stats.

        ``reachable`` without ``probe``: no breaker open (Redis), the root directory
        exists (fs), the tier is open (disk). With ``probe`` one bounded ``contains``
        round trip must also succeed. Tiers without accounting (Redis, fs) report 0
        for ``used_bytes``, ``capacity_bytes`` and ``chunks``. Cheap without ``probe``
        (the agent sends it with every heartbeat).
        """
        return ops_state.tier_health(self.m, probe)

    def stats(self) -> dict[str, int | float]:
        """The manager's flat stats (:meth:`StorageManager.stats`)."""
        return dict(self.m.stats())

    # -- dispatch ----------------------------------------------------------------------------------
    def run(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run operation ``op`` (:data:`kvtier.protocol.fleet.OPS`) with keyword ``args``.

        Raises:
            OpError: unknown op, unknown or missing argument, or the op's own checks.
        """
        ops: dict[str, Callable[..., dict[str, Any]]] = {
            "clear": self.clear, "delete": self.delete, "pin": self.pin, "unpin": self.unpin,
            "move_local": self.move_local, "export": self.export, "import": self.import_,
            "compress": self.compress, "decompress": self.decompress, "verify": self.verify,
            "health": self.health, "stats": self.stats,
        }
        fn = ops.get(op)
        if fn is None:
            raise OpError(f"op: unknown operation {op!r}")
        if not isinstance(args, dict):
            raise OpError(f"args: expected a mapping, got {type(args).__name__}")
        try:
            return fn(**args)
        except TypeError as exc:
            raise OpError(f"args: {op}: {exc}") from None

