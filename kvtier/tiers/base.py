"""The interface of every tier below the CPU tier (disk, shared filesystem, Redis, peers, plug-ins).

Lower tiers store opaque chunk payloads (bytes; ~5.9 MB per 256-token chunk of
the reference model) under chunk keys. Implementations are found through the
``kvtier.tiers`` entry-point group (see :mod:`kvtier.tiers.registry`) and prove
conformance with the contract kit :mod:`kvtier.testing`; :class:`LowerTier`
states the semantics each keeps.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Iterator, Sequence

from kvtier.serde.base import Buffer, Codec, byte_view

#: What a tier that reports its own changes calls: ``(op, keys, parents)`` with ``op``
#: ``"s"`` (stored; ``parents`` as long as ``keys``), ``"r"`` (removed) or ``"c"``
#: (cleared; ``keys`` empty). Called under the tier's lock: it must only enqueue
#: (see :mod:`kvtier.storage.tier_events`).
ChangeHook = Callable[[str, Sequence[bytes], Sequence["bytes | None"]], None]


@dataclass
class AtomicCounters:
    """Base of counter dataclasses shared by caller threads: int fields, atomic ``add``, ``snapshot``."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        """Add ``deltas`` atomically (counters are shared by caller threads)."""
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class TierCounters(AtomicCounters):
    """Monotonic counters of a remote tier (chunks, bytes, calls).

    Attributes:
        contains_keys: keys asked about; ``contains_hits`` of them existed.
        gets: chunks asked for; ``get_hits`` returned data, ``get_misses`` were
            absent (never stored, evicted, expired, or the store restarted empty),
            ``get_corrupt`` were unusable (checksum, foreign key, unknown codec).
        puts: chunks offered; ``put_ok`` stored, ``put_failed`` dropped (store
            error, refusal such as out-of-memory, or the tier unavailable).
        bytes_read / bytes_written: stored bytes moved (envelope included).
        deletes: chunks removed by ``delete_many``/``clear``.
        errors: failed round trips (timeout, connection, I/O errors).
        skipped_calls: calls answered with misses without touching the store
            (circuit breaker open, tier closed).
    """

    contains_keys: int = 0
    contains_hits: int = 0
    gets: int = 0
    get_hits: int = 0
    get_misses: int = 0
    get_corrupt: int = 0
    puts: int = 0
    put_ok: int = 0
    put_failed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    deletes: int = 0
    errors: int = 0
    skipped_calls: int = 0


@dataclass(frozen=True)
class ChunkWrite:
    """One chunk to store in a lower tier.

    Attributes:
        key: chunk key (32-byte blake3 digest, already committed to the namespace).
        parent: key of the previous chunk of the prompt (None for the first). Every
            tier records it, so eviction stays leaf-first (prefix-closed) also after
            an index rebuild.
        payload: C-contiguous buffer (uint8 ``[chunk_bytes]`` numpy array, bytes,
            memoryview); only read during the call.
    """

    key: bytes
    parent: bytes | None
    payload: Buffer


class LowerTier(ABC):
    """A tier below the CPU tier: local disk, shared filesystem, Redis, a peer, a plug-in.

    The storage manager is the CPU tier plus an ordered list of these, fastest
    first. Lower tiers move bytes only to and from CPU slots (``get_many_into``
    writes into a reserved CPU slot; ``put_many`` reads a committed one); the
    manager owns write-behind (one worker type for every tier), promotion (one
    path: lower tier -> CPU slot) and leases. Keys are chunk keys (``bytes``,
    1..255 bytes; kvtier uses 32-byte blake3 digests). Values are C-contiguous
    buffers.

    Semantics every implementation keeps (the contract kit, :mod:`kvtier.testing`,
    checks each):

    - **Scoped to one namespace.** A tier is opened for one namespace digest
      (``namespace``: 32 bytes, :meth:`kvtier.index.keys.KeyNamespace.digest`);
      ``clear`` removes that namespace's chunks and nothing else, also in a store
      other models share.
    - **Prefix-closed.** A tier never keeps a chunk whose parent (recorded at
      ``put_many``) it dropped by eviction or expiry: it evicts leaf-first, also
      after rebuilding its index at start.
    - **Failures never raise to the engine.** A down, slow, full or corrupt
      backing store turns into misses (``False``) and counted failures. Only
      programming errors (wrong argument types, non-contiguous or read-only
      buffers) raise ``TypeError``/``ValueError``, at once, before any I/O.
    - **Bounded time.** Every call returns within the tier's configured timeout
      plus a small slack, whatever the backing store does (where the platform
      allows: see each tier's notes).
    - **Batched.** ``contains_many`` answers all keys of a prompt in one round
      trip where the store allows; ``put_many``/``get_many_into`` move many chunks
      in as few round trips as possible. Results are in the order of the arguments.
    - **Misses are honest.** ``True`` from a get means ``out`` holds exactly the
      stored payload (checksummed). A value that vanished, is corrupt, belongs to
      another key or namespace, or uses a codec the reader lacks is a miss. After
      ``False`` the contents of ``out`` are unspecified. ``contains`` is a hint: a
      later get may still miss (the caller must then recompute).
    - **Thread-safe.** Any method may be called from several threads at once.
    - After ``close()`` every call is a miss / no-op.
    """

    # ``name``, ``kind`` and ``local`` are class attributes a subclass sets; an instance may set its own
    # (a wrapper such as :class:`kvtier.storage.reporting_tier.ReportingTier` takes its inner tier's).
    #: Short tier name for logs and stats, e.g. ``"disk"``, ``"redis"``, ``"fs"``.
    name: str = ""
    #: Label lookups report for chunks served from this tier: ``"disk"`` (local,
    #: survives restarts), ``"remote"`` (shared by machines) or ``"peer"``.
    kind: str = "remote"
    #: True: the tier is on this machine (the local disk): asking it is a local call, never a network
    #: round trip, so ``where``/``contains``, write refusals and promotion ask it chunk by chunk, its
    #: write queue is ``disk_write_queue`` (else ``remote_write_queue``), and its absences are not
    #: tracked as stale (:mod:`kvtier.storage.stale_remote`). A wrapper forwards its inner tier's.
    local: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass of kind ``"disk"`` that does not say otherwise is local (``kind`` labels the
        tier the way lookups report it; a plug-in disk tier written before ``local`` keeps its locality)."""
        super().__init_subclass__(**kwargs)
        if "local" not in cls.__dict__ and cls.kind == "disk":
            cls.local = True
    #: URL schemes this class opens (see :mod:`kvtier.tiers.registry`).
    schemes: ClassVar[tuple[str, ...]] = ()

    @property
    def location(self) -> str:
        """Where this tier's chunks live, without secrets (a masked URL plus key prefix, a
        directory): two tiers with equal locations hold the same chunks (the fleet controller
        indexes a shared tier once by it). Default: the tier's ``name``."""
        return self.name or type(self).__name__

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "LowerTier":
        """Open a tier from a URL (e.g. ``redis://host:6379/0``) plus keyword options
        (``namespace`` among them).

        Raises:
            ValueError: malformed URL or options.
        """
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a URL")

    # -- batched operations --------------------------------------------------
    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Existence of each key (one round trip where the store allows). Failure: all False."""

    def contains_many_known(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool]]:
        """:meth:`contains_many`, plus per key whether the store itself answered.

        Returns ``(found, answered)``: ``answered[i]`` False means ``found[i]`` False is a
        failure (timeout, store down), not the store saying "absent". The storage
        manager forgets a chunk it reported stored only on an answered absence (see
        :mod:`kvtier.storage.stale_remote`). Default: nothing counts as answered, so a
        tier that does not override this never has chunks forgotten.
        """
        found = self.contains_many(keys)
        return found, [False] * len(found)

    @abstractmethod
    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """Store each chunk; True where stored. Failed writes are dropped and counted.

        The payload buffers are only read during the call (the caller may reuse them after).
        """

    @abstractmethod
    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        """Read each ``(key, out)``: True where ``out`` now holds the payload; False is a miss.

        ``out`` must be writable and exactly the payload size; a stored payload of
        another size is a miss. No write into any ``out`` happens after the call returns.
        """

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many existed (0 on failure)."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every chunk of this tier's namespace, nothing else; returns how many were removed."""

    @abstractmethod
    def close(self) -> None:
        """Release connections/files; idempotent. Later calls are misses."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters (:class:`TierCounters` fields) plus tier-specific state, e.g. breaker state."""

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` (one prompt's hit chunks, in prompt order) as used.

        Recency for the tier's eviction (tail first, so the head outlives its
        tails), or a TTL refresh in a store that expires keys. Default: nothing.
        Never raises for a store failure.
        """

    @property
    def writable(self) -> bool:
        """False once the tier stopped accepting writes (e.g. disk full); reads go on."""
        return True

    # -- optional capabilities (operations of the controller) ------------------
    def set_change_hook(self, hook: ChangeHook | None) -> bool:
        """Ask the tier to report its own stores and removals to ``hook`` (None: stop).

        Returns True if the tier does (it then reports every change, evictions
        included, under its own lock); False (the default) if it cannot, and the
        storage manager's wrapper of the tier (:class:`kvtier.storage.reporting_tier.ReportingTier`)
        reports the changes made through it instead.
        """
        return False

    def scan_keys(self) -> Iterator[tuple[bytes, bytes | None]]:
        """Every ``(key, parent)`` of this tier's namespace (parent None when unknown or first).

        Raises:
            NotImplementedError: the tier cannot list its chunks (the default).
        """
        raise NotImplementedError(f"the {self.name or type(self).__name__} tier cannot list its chunks")

    def stored_sizes(self, keys: Sequence[bytes]) -> list[int]:
        """Stored bytes of each key (record or value, headers included); 0 where absent.

        Raises:
            NotImplementedError: the tier cannot tell (the default).
        """
        raise NotImplementedError(f"the {self.name or type(self).__name__} tier cannot report stored sizes")

    def put_many_with_codec(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        """:meth:`put_many` encoding the bodies with ``codec`` instead of the tier's own codec
        (re-encoding stored chunks in place).

        Raises:
            NotImplementedError: the tier's format has no codec field (the default).
        """
        raise NotImplementedError(f"the {self.name or type(self).__name__} tier cannot store chunks with a codec")

    # -- single-key conveniences -----------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def put(self, key: bytes, payload: Buffer, parent: bytes | None = None) -> bool:
        return self.put_many([ChunkWrite(key, parent, payload)])[0]

    def get_into(self, key: bytes, out: Buffer) -> bool:
        return self.get_many_into([(key, out)])[0]

    def delete(self, key: bytes) -> bool:
        return self.delete_many([key]) > 0

    def __enter__(self) -> "LowerTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The name plug-ins written for kvtier 0.1 subclass (same interface).
RemoteTier = LowerTier


def check_key(key: bytes) -> None:
    """Raise for keys the envelope cannot carry (a programming error, not a miss)."""
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"chunk keys are bytes, got {type(key).__name__}")
    if not 0 < len(key) <= 255:
        raise ValueError(f"chunk keys must be 1..255 bytes, got {len(key)}")


def writable_view(out: Buffer) -> memoryview:
    """A flat writable uint8 view of ``out`` (no copy).

    Raises:
        ValueError: ``out`` is read-only or not C-contiguous.
    """
    mv = byte_view(out)
    if mv.readonly:
        raise ValueError("get destination buffer is read-only")
    if not mv.c_contiguous:
        raise ValueError("get destination buffer must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def destination_views(items: Sequence[tuple[bytes, Buffer]]) -> list[memoryview]:
    """The argument check of ``get_many_into``: each key valid, each destination a flat writable
    uint8 view (no copy), in order.

    Raises:
        TypeError/ValueError: a bad key, or a destination read-only or not C-contiguous.
    """
    views = []
    for key, buf in items:
        check_key(key)
        views.append(writable_view(buf))
    return views


def as_chunk_write(item: "ChunkWrite | tuple[bytes, Buffer]") -> ChunkWrite:
    """``item`` as a checked :class:`ChunkWrite` (a ``(key, payload)`` pair has no parent).

    Raises:
        TypeError/ValueError: a key the record cannot carry, or a chunk that is its own parent.
    """
    w = item if isinstance(item, ChunkWrite) else ChunkWrite(item[0], None, item[1])
    check_key(w.key)
    if w.parent is not None:
        check_key(w.parent)
        if w.parent == w.key:
            raise ValueError("a chunk cannot be its own parent")
    return w
