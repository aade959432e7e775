"""kvtier's local CPU and disk tiers behind the :class:`RemoteTier` interface, for the contract kit.

The CPU tier (fixed-size slots, reference counts) and the disk tier (one file
per chunk) have an engine-facing API of their own; these adapters let the same
contract tests (:class:`kvtier.testing.TierContract`) drive them. Each stored
value is the checksummed envelope of :mod:`kvtier.serde.envelope` (so codecs and
the corrupt/foreign/unknown-codec checks apply as for remote tiers), framed in a
fixed-size slot: ``u64 length`` then the envelope, zero padded to ``slot_bytes``.

Several adapters may share one tier (as several clients share one Redis):
``close`` ends the adapter, not the tier. The tiers' own corruption checks (the
disk tier's header and payload checksums) are tested by their own fault tests;
here a corrupt value is caught by the envelope.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from kvtier.serde.base import Buffer, Codec, ValueSpec
from kvtier.serde.envelope import ValueMiss, encode_value, read_value_into
from kvtier.serde.registry import decoders_with, make_codec
from kvtier.tiers.base import RemoteTier, TierCounters, check_key, writable_view
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier

_LEN = struct.Struct("<Q")


class SlotStore(Protocol):
    """Fixed-size byte slots by key: what the adapter needs from a local tier."""

    slot_bytes: int

    def write(self, key: bytes, framed: np.ndarray) -> bool: ...

    def read(self, key: bytes, out: np.ndarray) -> bool: ...

    def contains(self, key: bytes) -> bool: ...

    def delete(self, key: bytes) -> bool: ...

    def clear(self) -> int: ...


class CpuSlots:
    """A :class:`CpuTier` as a :class:`SlotStore` (an existing key is replaced)."""

    def __init__(self, tier: CpuTier):
        self.tier = tier
        self.slot_bytes = tier.chunk_bytes

    def write(self, key: bytes, framed: np.ndarray) -> bool:
        self.tier.delete(key)  # overwrite = replace; fails harmlessly while readers hold it
        dst = self.tier.reserve(key)
        if dst is None:
            return False
        dst[:] = framed
        self.tier.commit(key)
        return True

    def read(self, key: bytes, out: np.ndarray) -> bool:
        buf = self.tier.acquire(key)
        if buf is None:
            return False
        try:
            out[:] = buf
        finally:
            self.tier.release(key)
        return True

    def contains(self, key: bytes) -> bool:
        return self.tier.contains(key)

    def delete(self, key: bytes) -> bool:
        return self.tier.delete(key)

    def clear(self) -> int:
        return self.tier.clear()


class DiskSlots:
    """A :class:`DiskTier` as a :class:`SlotStore` (synchronous writes; an existing key is replaced)."""

    def __init__(self, tier: DiskTier, slot_bytes: int):
        self.tier = tier
        self.slot_bytes = slot_bytes
        self._lock = threading.Lock()  # delete + put of one key must not interleave with another

    def write(self, key: bytes, framed: np.ndarray) -> bool:
        with self._lock:
            self.tier.delete(key)
            return self.tier.put(key, framed)

    def read(self, key: bytes, out: np.ndarray) -> bool:
        return self.tier.get_into(key, out)

    def contains(self, key: bytes) -> bool:
        return self.tier.contains(key)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            return self.tier.delete(key)

    def clear(self) -> int:
        return self.tier.clear()


class LocalTierAdapter(RemoteTier):
    """A :class:`SlotStore` (CPU or disk tier) with the :class:`RemoteTier` semantics.

    Args:
        store: the slots; values larger than ``slot_bytes - 8`` are refused (put False).
        codec / codec_options / spec / decoders: as for the remote tiers.

    Keys must be 32 bytes (the local tiers' key size); other lengths raise ``ValueError``.
    """

    name = "local-adapter"

    def __init__(
        self,
        store: SlotStore,
        codec: str | Codec = "raw",
        codec_options: Mapping[str, Any] | None = None,
        spec: ValueSpec = ValueSpec(),
        decoders: Mapping[str, Codec] | None = None,
    ):
        self.store = store
        self.codec = make_codec(codec, **dict(codec_options or {}))
        self.spec = spec
        self.decoders = decoders_with(decoders)
        self.counters = TierCounters()
        self._closed = False

    @staticmethod
    def _check(key: bytes) -> None:
        check_key(key)
        if len(key) != 32:
            raise ValueError(f"local tiers take 32-byte keys, got {len(key)}")

    def _frame(self, data: Sequence[Buffer], nbytes: int) -> np.ndarray | None:
        if nbytes + _LEN.size > self.store.slot_bytes:
            return None
        framed = np.zeros(self.store.slot_bytes, np.uint8)
        framed[: _LEN.size] = np.frombuffer(_LEN.pack(nbytes), np.uint8)
        pos = _LEN.size
        for part in data:
            view = np.frombuffer(memoryview(part).cast("B"), np.uint8)
            framed[pos : pos + len(view)] = view
            pos += len(view)
        return framed

    def write_stored(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` as the stored bytes of ``key`` (bypassing the codec; for tests)."""
        framed = self._frame([value], len(value))
        return framed is not None and self.store.write(key, framed)

    def read_stored(self, key: bytes) -> bytes | None:
        """The stored bytes of ``key`` (the envelope), or None if absent."""
        framed = np.empty(self.store.slot_bytes, np.uint8)
        if not self.store.read(key, framed):
            return None
        (n,) = _LEN.unpack_from(framed)
        return framed[_LEN.size : _LEN.size + min(n, self.store.slot_bytes - _LEN.size)].tobytes()

    # -- RemoteTier ---------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        for k in keys:
            self._check(k)
        if self._closed:
            self.counters.add(skipped_calls=1)
            return [False] * len(keys)
        out = [self.store.contains(k) for k in keys]
        self.counters.add(contains_keys=len(keys), contains_hits=sum(out))
        return out

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        for k, _ in items:
            self._check(k)
        if self._closed:
            self.counters.add(skipped_calls=1, puts=len(items), put_failed=len(items))
            return [False] * len(items)
        out = []
        written = 0
        for key, payload in items:
            try:
                ev = encode_value(key, payload, self.codec, self.spec)
            except ValueError:
                out.append(False)
                continue
            framed = self._frame(ev.parts, ev.nbytes)
            ok = framed is not None and self.store.write(key, framed)
            written += ev.nbytes if ok else 0
            out.append(ok)
        self.counters.add(puts=len(items), put_ok=sum(out), put_failed=len(items) - sum(out), bytes_written=written)
        return out

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = []
        for k, buf in items:
            self._check(k)
            views.append(writable_view(buf))
        if self._closed:
            self.counters.add(skipped_calls=1, gets=len(items), get_misses=len(items))
            return [False] * len(items)
        out = [False] * len(items)
        hits = corrupt = nbytes = 0
        for i, (key, _) in enumerate(items):
            stored = self.read_stored(key)
            if stored is None:
                continue
            pos = 0

            def read_exact(dst: memoryview) -> None:
                nonlocal pos
                if pos + len(dst) > len(stored):
                    raise ValueMiss("value shorter than its envelope", pos)
                dst[:] = stored[pos : pos + len(dst)]
                pos += len(dst)

            try:
                read_value_into(read_exact, len(stored), key, views[i], self.decoders, lambda n: memoryview(bytearray(n)))
            except ValueMiss:
                corrupt += 1
                continue
            out[i] = True
            hits += 1
            nbytes += len(stored)
        self.counters.add(
            gets=len(items), get_hits=hits, get_misses=len(items) - hits - corrupt,
            get_corrupt=corrupt, bytes_read=nbytes,
        )
        return out

    def delete_many(self, keys: Sequence[bytes]) -> int:
        for k in keys:
            self._check(k)
        if self._closed:
            return 0
        n = sum(self.store.delete(k) for k in keys)
        self.counters.add(deletes=n)
        return n

    def clear(self) -> int:
        if self._closed:
            return 0
        n = self.store.clear()
        self.counters.add(deletes=n)
        return n

    def close(self) -> None:
        self._closed = True

    def stats(self) -> dict[str, Any]:
        return {**self.counters.snapshot(), "codec": self.codec.name}
