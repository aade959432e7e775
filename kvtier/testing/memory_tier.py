"""An in-memory reference :class:`~kvtier.tiers.base.LowerTier` for tests.

:class:`MemoryStore` plays the shared backing store (like one Redis several
engines use): values by ``(namespace, key)``, optionally bounded per namespace
(``capacity_chunks``) with chain-aware LRU eviction, so it is prefix-closed.
:class:`MemoryTier` is one tier instance on it, for one namespace, and keeps
every semantic of the interface (envelope-checksummed values whose key field
carries the namespace tag, honest misses, namespace-scoped ``clear``, misses
after ``close``). Tests can hang its calls (``gate``), fail them (``fail``) and
count them (``calls``).
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

from kvtier.serde.base import Buffer, Codec, ValueSpec, byte_view
from kvtier.serde.envelope import ValueMiss, encode_value, read_value_into
from kvtier.serde.registry import decoders_with, make_codec
from kvtier.tiers.base import ChunkWrite, LowerTier, TierCounters, check_key, writable_view
from kvtier.tiers.policies import LRUPolicy


class MemoryStore:
    """Stored values by namespace and key (thread-safe).

    Args:
        capacity_chunks: most chunks kept per namespace (None: unbounded). When
            full, a write evicts the least recently used chunk that is neither a
            resident chunk's recorded parent (leaf first) nor the written chunk's
            parent; with no such chunk the write is refused.
    """

    def __init__(self, capacity_chunks: int | None = None):
        if capacity_chunks is not None and capacity_chunks < 1:
            raise ValueError("capacity_chunks must be at least 1")
        self.capacity_chunks = capacity_chunks
        self.data: dict[bytes, dict[bytes, bytes]] = {}
        self._policies: dict[bytes, LRUPolicy] = {}
        self.lock = threading.Lock()
        self.evicted = 0

    def put(self, namespace: bytes, key: bytes, parent: bytes | None, value: bytes) -> bool:
        with self.lock:
            values = self.data.setdefault(namespace, {})
            policy = self._policies.setdefault(namespace, LRUPolicy())
            if key in values:
                values[key] = value
                policy.touch(key)
                return True
            if self.capacity_chunks is not None and len(values) >= self.capacity_chunks:
                # never the new chunk's own parent: it would be orphaned at birth
                victim = next((k for k in policy.candidates() if k != parent), None)
                if victim is None:
                    return False
                assert policy.num_children(victim) == 0, "evicting the parent of a resident chunk"
                del values[victim]
                policy.remove(victim)
                self.evicted += 1
            values[key] = value
            policy.insert(key, None if policy.closes_cycle(key, parent) else parent)
            return True

    def get(self, namespace: bytes, key: bytes) -> bytes | None:
        with self.lock:
            return self.data.get(namespace, {}).get(key)

    def set_raw(self, namespace: bytes, key: bytes, value: bytes) -> None:
        """Overwrite the stored bytes (tests: corruption, foreign values)."""
        with self.lock:
            values = self.data.setdefault(namespace, {})
            if key not in values:
                self._policies.setdefault(namespace, LRUPolicy()).insert(key)
            values[key] = value

    def touch(self, namespace: bytes, keys: Sequence[bytes]) -> None:
        with self.lock:
            policy = self._policies.get(namespace)
            if policy is not None:
                for k in reversed(keys):
                    policy.touch(k)

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Remove ``keys`` (a resident chunk's parent included: the caller asked)."""
        with self.lock:
            values = self.data.get(namespace, {})
            policy = self._policies.get(namespace)
            n = 0
            for k in keys:
                if values.pop(k, None) is not None:
                    n += 1
                    if policy is not None:
                        policy.remove(k)
            return n

    def clear(self, namespace: bytes) -> int:
        with self.lock:
            n = len(self.data.pop(namespace, {}))
            self._policies.pop(namespace, None)
            return n


class MemoryTier(LowerTier):
    """A lower tier in memory (see the module doc).

    Args:
        store: the shared backing store (a private one if None).
        namespace: namespace digest (8..64 bytes; default 32 zero bytes).
        codec / codec_options / spec / decoders: as for :class:`kvtier.tiers.redis_tier.RedisTier`.
        kind: the label lookups report for it (default ``"remote"``).
    """

    name = "memory"
    kind = "remote"

    def __init__(
        self,
        store: MemoryStore | None = None,
        namespace: bytes = bytes(32),
        codec: str | Codec = "raw",
        codec_options: Mapping[str, Any] | None = None,
        spec: ValueSpec = ValueSpec(),
        decoders: Mapping[str, Codec] | None = None,
        kind: str | None = None,
    ):
        if not isinstance(namespace, (bytes, bytearray)) or not 8 <= len(namespace) <= 64:
            raise ValueError("namespace must be 8..64 bytes")
        self.store = store if store is not None else MemoryStore()
        self.namespace = bytes(namespace)
        self.codec = make_codec(codec, **dict(codec_options or {}))
        self.spec = spec
        self.decoders = decoders_with(decoders)
        if kind is not None:
            self.kind = kind
        self.counters = TierCounters()
        #: Cleared: every call waits until it is set again (a hung store).
        self.gate = threading.Event()
        self.gate.set()
        #: True: every call fails (a down store).
        self.fail = False
        #: Calls made, by method name.
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- test hooks ----------------------------------------------------------------------
    def raw(self, key: bytes) -> bytes | None:
        """Stored bytes of ``key`` (the envelope), bypassing the tier."""
        return self.store.get(self.namespace, key)

    def set_raw(self, key: bytes, value: bytes) -> None:
        """Overwrite the stored bytes of ``key``, bypassing the tier."""
        self.store.set_raw(self.namespace, key, value)

    def _ekey(self, key: bytes) -> bytes:
        return self.namespace[:8] + key

    def _call(self, name: str) -> bool:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
        self.gate.wait()
        if self._closed or self.fail:
            self.counters.add(skipped_calls=int(self._closed), errors=int(self.fail and not self._closed))
            return False
        return True

    # -- LowerTier -----------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        for k in keys:
            check_key(k)
        if not keys:
            return []
        if not self._call("contains_many"):
            return [False] * len(keys)
        out = [self.store.get(self.namespace, k) is not None for k in keys]
        self.counters.add(contains_keys=len(keys), contains_hits=sum(out))
        return out

    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        for item in items:
            if not isinstance(item, ChunkWrite):
                raise TypeError(f"put_many takes ChunkWrite items, got {type(item).__name__}")
            check_key(item.key)
        if not items:
            return []
        if not self._call("put_many"):
            self.counters.add(puts=len(items), put_failed=len(items))
            return [False] * len(items)
        out = []
        written = 0
        for item in reversed(items):  # tail first, as the Redis tier
            try:
                ev = encode_value(self._ekey(item.key), item.payload, self.codec, self.spec)
            except ValueError:
                out.append(False)
                continue
            value = b"".join(bytes(byte_view(p).cast("B")) for p in ev.parts)
            ok = self.store.put(self.namespace, item.key, item.parent, value)
            written += len(value) if ok else 0
            out.append(ok)
        out.reverse()
        self.counters.add(puts=len(items), put_ok=sum(out), put_failed=len(items) - sum(out), bytes_written=written)
        return out

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = []
        for k, buf in items:
            check_key(k)
            views.append(writable_view(buf))
        if not items:
            return []
        if not self._call("get_many_into"):
            self.counters.add(gets=len(items), get_misses=len(items))
            return [False] * len(items)
        out = [False] * len(items)
        hits = corrupt = nbytes = 0
        for i, (key, _) in enumerate(items):
            stored = self.store.get(self.namespace, key)
            if stored is None:
                continue
            if self._decode(stored, key, views[i]):
                out[i] = True
                hits += 1
                nbytes += len(stored)
            else:
                corrupt += 1
                self.store.delete(self.namespace, [key])
        self.counters.add(
            gets=len(items), get_hits=hits, get_misses=len(items) - hits - corrupt, get_corrupt=corrupt, bytes_read=nbytes
        )
        return out

    def _decode(self, stored: bytes, key: bytes, dst: memoryview) -> bool:
        pos = 0

        def read_exact(view: memoryview) -> None:
            nonlocal pos
            if pos + len(view) > len(stored):
                raise ValueMiss("value shorter than its envelope", pos)
            view[:] = stored[pos : pos + len(view)]
            pos += len(view)

        try:
            read_value_into(read_exact, len(stored), self._ekey(key), dst, self.decoders, lambda n: memoryview(bytearray(n)))
        except ValueMiss:
            return False
        return True

    def touch_many(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            check_key(k)
        if keys and self._call("touch_many"):
            self.store.touch(self.namespace, keys)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        for k in keys:
            check_key(k)
        if not keys or not self._call("delete_many"):
            return 0
        n = self.store.delete(self.namespace, keys)
        self.counters.add(deletes=n)
        return n

    def clear(self) -> int:
        if not self._call("clear"):
            return 0
        n = self.store.clear(self.namespace)
        self.counters.add(deletes=n)
        return n

    def close(self) -> None:
        self._closed = True

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters.snapshot(),
            "breakers": {"memory": "open" if self.fail else "closed"},
            "codec": self.codec.name,
        }
