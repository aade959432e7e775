"""``a2q``: adaptive 2Q with a long, compact history, for prefix-chained chunks.

Sources:

- T. Johnson, D. Shasha, "2Q: A Low Overhead High Performance Buffer Management Replacement
  Algorithm", VLDB 1994: a FIFO of first-time keys (A1in), a ghost list of keys recently
  evicted from it (A1out), an LRU of keys referenced again (Am). It is the O(1)
  approximation of LRU-2 (E. J. O'Neil, P. E. O'Neil, G. Weikum, "The LRU-K page replacement
  algorithm for database disk buffering", SIGMOD 1993), which the issue measured at 2x LRU
  on the Mooncake conversation trace at 1M tokens.
- C. A. Waldspurger, T. Saemundsson, I. Ahmad, N. Park, "Cache Modeling and Optimization
  using Miniature Simulations", USENIX ATC 2017 (with SHARDS sampling, Waldspurger et al.,
  FAST 2015): the share the first-time FIFO may keep is chosen online by simulating a
  spatially sampled copy of the reference stream under each candidate share.

Why it suits prefix chains. In production traffic (Mooncake FAST'25 conversation trace)
76% of the chunks ever stored are never referenced again, and the reuses of a chunk seen
once come thousands of references later (5th percentile 2,900 references, median 12,000),
so a small LRU cache spends itself on chunks that never return. A chunk referenced twice is
referenced again with probability 0.42, three times 0.50, four times 0.58. So: a chunk
enters the FIFO ``T1`` on its first reference and goes first; a chunk referenced while
resident, or stored again while its key is in the ghost history (it was evicted earlier),
enters the LRU ``T2``. The history remembers ``HISTORY`` x the resident count of evicted
keys (a direct-mapped table of 8-byte fingerprints: 32 bytes per resident chunk, no key
objects kept alive, oldest forgotten first), long enough to see the second reference of a conversation's chunks.
Chains are kept by the chain rule of :class:`~kvtier.tiers.policies.ChainAwarePolicy`
(leaf first); a chain's chunks are referenced together, so they move between T1 and T2
together.

Where a bigger cache could keep first-time chunks until their return (measured: 10M tokens
on the conversation trace), a share of the cache for T1 pays; with ``lru`` the two queues
are merged by last use, which is exactly LRU. :class:`MiniSims` replays a 1/16 sample of
the keys (by fingerprint) through one miniature cache per mode (``lru``, T1 share 0, 1/4,
1/2 of the sampled capacity, scaled by the same 1/16) and the real cache follows the mode
with the most miniature hits over the last periods.

Cost: insert/touch/remove O(1) (dictionary and ordered-dictionary operations, one
fingerprint probe); 1/16 of them also drive the four miniature caches (O(1) each).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from typing import Iterator, TypeVar

from kvtier.tiers.policy_base import ChainAwarePolicy

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def fingerprint(key: bytes) -> int:
    """A non-zero 64-bit fingerprint of ``key``: its first 8 bytes times the golden-ratio
    constant (Knuth's multiplicative hashing), high half folded onto the low half so the low
    bits (set index, sample) depend on every input bit. kvtier keys are blake3 digests."""
    x = (int.from_bytes(key[:8], "little") * _GOLDEN) & _MASK64
    return (x ^ (x >> 32)) or 1


class GhostTable:
    """Fingerprints of recently evicted keys, oldest forgotten first: a set-associative table
    of ``WAYS``-entry sets, each a FIFO ring (so an entry lives for about ``WAYS x sets``
    later additions, like one global FIFO), grown as the cache fills.

    Memory: 8 bytes a slot (little-endian, 0 = empty) plus 1 byte a set. A lookup reads one
    set (a byte search of its 128 bytes, kept to slot boundaries); a false positive needs two
    keys with the same 64-bit fingerprint.
    """

    WAYS = 16
    _SET_BYTES = 8 * WAYS

    def __init__(self, slots: int = 1024) -> None:
        self._sets = 1
        while self._sets * self.WAYS < slots:
            self._sets *= 2
        self._slots = bytearray(self._SET_BYTES * self._sets)
        self._next = bytearray(self._sets)

    def __len__(self) -> int:
        return self._sets * self.WAYS

    def grow_to(self, slots: int) -> None:
        """Keep at least ``slots`` slots (entries move over oldest first, so their order stays)."""
        if slots <= len(self):
            return
        old = array("Q")
        old.frombytes(bytes(self._slots))
        if sys.byteorder != "little":
            old.byteswap()
        old_next, old_sets = self._next, self._sets
        self.__init__(slots)  # type: ignore[misc]
        w = self.WAYS
        for r in range(w):  # round r: the r-th oldest entry of every old set
            for s in range(old_sets):
                f = old[s * w + (old_next[s] + r) % w]
                if f:
                    self.add(f)

    def add(self, f: int) -> None:
        s = f % self._sets
        i = self._next[s]
        at = s * self._SET_BYTES + 8 * i
        self._slots[at : at + 8] = f.to_bytes(8, "little")
        self._next[s] = (i + 1) % self.WAYS

    def pop(self, f: int) -> bool:
        """True (and forget it) if ``f`` is held."""
        base = (f % self._sets) * self._SET_BYTES
        end = base + self._SET_BYTES
        fb = f.to_bytes(8, "little")
        slots = self._slots
        at = slots.find(fb, base, end)
        while at >= 0:
            if not (at - base) & 7:
                slots[at : at + 8] = bytes(8)
                return True
            at = slots.find(fb, at + 1, end)
        return False


#: Modes the real cache can follow: ``"lru"`` or the share of the cache T1 may keep.
MODES: tuple[str | float, ...] = ("lru", 0.0, 0.25, 0.5)


class _Mini:
    """One miniature cache of sampled keys under one mode (no chains: a key stands alone)."""

    __slots__ = ("mode", "t1", "t2", "ghost", "hits", "score", "tick")

    def __init__(self, mode: str | float) -> None:
        self.mode = mode
        self.t1: OrderedDict[int, int] = OrderedDict()
        self.t2: OrderedDict[int, int] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.score = 0.0
        self.tick = 0

    def ref(self, f: int, pf: int, cap: int, history: int) -> None:
        """A reference to ``f``; ``pf``: its parent's sampled fingerprint (0: none or not
        sampled). A resident key counts as a hit only if its parent is resident too, as a
        prefix hit would need."""
        self.tick += 1
        t1, t2 = self.t1, self.t2
        if f in t1:
            del t1[f]
            t2[f] = self.tick
            if not pf or pf in t1 or pf in t2:
                self.hits += 1
            return
        if f in t2:
            t2.move_to_end(f)
            t2[f] = self.tick
            if not pf or pf in t1 or pf in t2:
                self.hits += 1
            return
        if f in self.ghost:
            del self.ghost[f]
            t2[f] = self.tick
        else:
            t1[f] = self.tick
        while len(t1) + len(t2) > cap:
            q = _victim_queue(self.mode, t1, t2, cap)
            g, _ = q.popitem(last=False)
            self.ghost[g] = None
        while len(self.ghost) > history * cap:
            self.ghost.popitem(last=False)


#: Key type of the queues (chunk keys in the policy, sampled fingerprints in its miniature simulations).
_K = TypeVar("_K")


def _victim_queue(mode: str | float, t1: OrderedDict[_K, int], t2: OrderedDict[_K, int],
                  resident: int) -> OrderedDict[_K, int]:
    """The queue whose oldest key goes next under ``mode`` (both non-empty or one of them)."""
    if not t2:
        return t1
    if not t1:
        return t2
    if mode == "lru":
        return t1 if next(iter(t1.values())) <= next(iter(t2.values())) else t2
    return t1 if len(t1) > float(mode) * resident else t2


class MiniSims:
    """Miniature simulations (one per mode in :data:`MODES`) of a sample of the keys.

    The sample is 1 key in ``2**shift`` by fingerprint, ``shift`` the largest (at most
    ``max_shift``) that leaves a miniature cache of at least ``min_cache`` keys; when the
    cache grows past the next power of two the sample is halved and the minis start over.

    Args:
        start: the mode followed before the first choice.
        min_cache: least keys a miniature cache holds (smaller real caches are copied whole).
        max_shift: sparsest sample (1 in ``2**max_shift``).
        history: ghost history, in multiples of the miniature capacity.
    """

    #: Relative miniature-hit margin needed to leave LRU, and to change between other modes.
    LEAVE_LRU = 0.15
    SWITCH = 0.01

    def __init__(self, start: str | float = "lru", min_cache: int = 1024, max_shift: int = 6,
                 history: int = 4) -> None:
        self.min_cache = min_cache
        self.max_shift = max_shift
        self.history = history
        self.shift = 0
        self.minis = [_Mini(m) for m in MODES]
        self.mode: str | float = start
        self.sampled = 0
        self.switches = 0
        self._due = min_cache
        self._lo, self._hi = 0, min_cache << 1
        #: ``2**shift - 1``: a key is sampled when ``f & mask`` is 0. ``observe`` changes
        #: nothing for a key that is not sampled while ``_lo <= resident < _hi``, so the
        #: policy's hot path skips the call then (:meth:`A2QPolicy._ref`).
        self.mask = 0

    def _shift_for(self, resident: int) -> int:
        return max(0, min(self.max_shift, (resident // self.min_cache).bit_length() - 1))

    def observe(self, f: int, parent: bytes | None, resident: int) -> None:
        """A reference to the key of fingerprint ``f`` whose parent key is ``parent`` (None:
        none); ``resident``: the real cache's size."""
        if not self._lo <= resident < self._hi:  # the sample rate changes only at powers of two
            shift = self._shift_for(resident)
            self._lo = self.min_cache << shift if shift else 0
            self._hi = self.min_cache << (shift + 1) if shift < self.max_shift else 1 << 62
            if shift != self.shift:
                self.shift = shift
                self.mask = (1 << shift) - 1
                self.minis = [_Mini(m) for m in MODES]
        shift = self.shift
        mask = self.mask
        if f & mask:
            return
        cap = max(1, resident >> shift)
        pf = 0 if parent is None else fingerprint(parent)
        pf = 0 if pf & mask else pf >> shift
        f >>= shift
        for m in self.minis:
            m.ref(f, pf, cap, self.history)
        self.sampled += 1
        if self.sampled >= self._due:
            self._due = self.sampled + max(256, cap)
            self._choose()

    def _choose(self) -> None:
        best = None
        for m in self.minis:
            m.score = 0.5 * m.score + m.hits
            m.hits = 0
            if best is None or m.score > best.score:
                best = m
        current = next(m for m in self.minis if m.mode == self.mode)
        # Leaving LRU needs a clear win: a miniature cache has no chains and sees few keys.
        margin = self.LEAVE_LRU if self.mode == "lru" else self.SWITCH
        if best is not None and best.score > current.score * (1 + margin) + 1:
            self.mode = best.mode
            self.switches += 1


class A2QPolicy(ChainAwarePolicy):
    """Adaptive 2Q with ghost history and miniature-simulation tuning (see the module doc)."""

    name = "a2q"
    #: Ghost history, in multiples of the resident count.
    HISTORY = 4

    def __init__(self) -> None:
        super().__init__()
        self._t1: OrderedDict[bytes, int] = OrderedDict()  # first-time keys, oldest first (value: last use)
        self._t2: OrderedDict[bytes, int] = OrderedDict()  # keys used again, least recent first
        self._dseg: dict[bytes, int] = {}  # deferred key -> its queue (1 or 2)
        self._ghost = GhostTable()
        self._ghost_slots = len(self._ghost)
        self.mini = MiniSims(history=self.HISTORY)
        self._tick = 0
        self._victims = 0

    def _ref(self, key: bytes) -> int:
        self._tick += 1
        parents = self._parent
        resident = len(parents)
        if resident * self.HISTORY > self._ghost_slots:
            self._ghost.grow_to(resident * self.HISTORY)
            self._ghost_slots = len(self._ghost)
        x = (int.from_bytes(key[:8], "little") * _GOLDEN) & _MASK64  # fingerprint(key), inlined
        f = (x ^ (x >> 32)) or 1
        mini = self.mini
        if not f & mini.mask or not mini._lo <= resident < mini._hi:  # else observe is a no-op
            mini.observe(f, parents.get(key), resident)
        return f

    def _add(self, key: bytes) -> None:
        f = self._ref(key)
        (self._t2 if self._ghost.pop(f) else self._t1)[key] = self._tick

    def _use(self, key: bytes) -> None:
        # _ref inlined (the hot path), less its ghost growth: a use does not change the
        # resident count, which the last insert's _ref already grew the ghost for.
        self._tick = tick = self._tick + 1
        x = (int.from_bytes(key[:8], "little") * _GOLDEN) & _MASK64
        f = (x ^ (x >> 32)) or 1
        mini = self.mini
        if not f & mini.mask or not mini._lo <= len(self._parent) < mini._hi:
            mini.observe(f, self._parent.get(key), len(self._parent))
        t2 = self._t2
        if self._t1.pop(key, None) is None:  # values are ticks, never None
            t2.move_to_end(key)
        t2[key] = tick

    def _use_deferred(self, key: bytes) -> bool:
        self._ref(key)
        self._dseg[key] = 2
        return True

    def _detach(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._dseg[key] = 1
        else:
            del self._t2[key]
            self._dseg[key] = 2

    def _readd(self, key: bytes, as_victim: bool) -> None:
        seg = self._dseg.pop(key, 2)
        if not as_victim:
            self._t2[key] = self._tick
            return
        q = self._t1 if seg == 1 else self._t2
        self._victims += 1
        q[key] = -self._victims  # older than every key, the latest such key first: the next victim
        q.move_to_end(key, last=False)

    def _forget(self, key: bytes, in_order: bool) -> None:
        if in_order:
            if self._t1.pop(key, None) is None:
                del self._t2[key]
        else:
            self._dseg.pop(key, None)
        x = (int.from_bytes(key[:8], "little") * _GOLDEN) & _MASK64  # fingerprint(key), inlined
        self._ghost.add((x ^ (x >> 32)) or 1)

    def _members(self) -> set[bytes]:
        return set(self._t1) | set(self._t2)

    def _order(self) -> Iterator[bytes]:
        t1, t2 = self._t1, self._t2
        mode = self.mini.mode
        if not t2:
            return iter(t1)
        if not t1:
            return iter(t2)
        if mode == "lru":
            return _merge_by_value(t1, t2)
        first, second = (t1, t2) if _victim_queue(mode, t1, t2, len(self._parent)) is t1 else (t2, t1)
        return _chain(first, second)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert not (self._t1.keys() & self._t2.keys()), "a key is in both queues"
        assert self._dseg.keys() == self._deferred, "deferred queue marks disagree with the deferred keys"


def _chain(a: OrderedDict[bytes, int], b: OrderedDict[bytes, int]) -> Iterator[bytes]:
    yield from a
    yield from b


def _merge_by_value(a: OrderedDict[bytes, int], b: OrderedDict[bytes, int]) -> Iterator[bytes]:
    """Keys of ``a`` and ``b`` (each ordered by value) in order of value (ties: ``a`` first)."""
    ia, ib = iter(a.items()), iter(b.items())
    xa, xb = next(ia, None), next(ib, None)
    while xa is not None and xb is not None:
        if xa[1] <= xb[1]:
            yield xa[0]
            xa = next(ia, None)
        else:
            yield xb[0]
            xb = next(ib, None)
    while xa is not None:
        yield xa[0]
        xa = next(ia, None)
    while xb is not None:
        yield xb[0]
        xb = next(ib, None)
