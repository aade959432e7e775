"""Offline ceilings of a replay: Belady's MIN and the unbounded cache, on integer chunk ids.

Belady's MIN (L. A. Belady, "A study of replacement algorithms for a virtual-storage
computer", IBM Systems Journal 5(2), 1966): when a chunk must go, evict the resident chunk
whose next reference is furthest in the future (never referenced again: first). It needs
the whole future, so it runs in two passes: the first records every reference (8 bytes
each: the id) and computes each reference's next use (4 more bytes); the second replays.
Under prefix chains a parent is referenced whenever any child is, so its next use is never
later than a child's and MIN gives chains up tail first on its own.

Both follow the replay semantics of :func:`kvtier.sim.replay.step`: per request, the longest
resident prefix is looked up (at most ``hit_limit`` chunks count as hits), then every
referenced chunk is resident (MIN may evict any resident chunk, one of the request's own
included, and does not cache a chunk that is never used again once the cache is full).
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

#: References above which :func:`belady` refuses (12 bytes each: 240 MB at this bound).
MAX_REFS = 20_000_000

#: A request as the ceilings see it: (hit limit in chunks, chunk ids in prompt order).
IdRequest = tuple[int, Sequence[int]]


@dataclass
class CeilingStats:
    """Outcome of a ceiling replay.

    Attributes:
        name: ``belady`` or ``unbounded``.
        capacity_chunks: capacity (None: unbounded).
        requests, chunk_refs, hit_chunks: counts over the trace.
    """

    name: str
    capacity_chunks: int | None
    requests: int = 0
    chunk_refs: int = 0
    hit_chunks: int = 0

    @property
    def chunk_hit_rate(self) -> float:
        return self.hit_chunks / self.chunk_refs if self.chunk_refs else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "chunk_hit_rate": self.chunk_hit_rate}


class _SeenIds:
    """A set of non-negative ints: a growable bitmap while ids stay small, else a Python set."""

    BITMAP_LIMIT = 1 << 31

    def __init__(self) -> None:
        self._bits = np.zeros(1 << 16, dtype=np.uint8)
        self._set: set[int] | None = None

    def __contains__(self, i: int) -> bool:
        if self._set is not None:
            return i in self._set
        return (i >> 3) < len(self._bits) and bool(self._bits[i >> 3] & (1 << (i & 7)))

    def add(self, i: int) -> None:
        if self._set is None and i >= self.BITMAP_LIMIT:
            self._set = {int(j) for j in self._ids()}
        if self._set is not None:
            self._set.add(i)
            return
        need = (i >> 3) + 1
        if need > len(self._bits):
            grown = np.zeros(max(need, 2 * len(self._bits)), dtype=np.uint8)
            grown[: len(self._bits)] = self._bits
            self._bits = grown
        self._bits[i >> 3] |= 1 << (i & 7)

    def _ids(self) -> np.ndarray:
        return np.flatnonzero(np.unpackbits(self._bits, bitorder="little"))


def unbounded(requests: Iterable[IdRequest]) -> CeilingStats:
    """The unbounded cache: every chunk ever referenced stays. Memory: one bit per id value
    while ids are below 2**31 (Mooncake's remapped ids are small), else a set."""
    st = CeilingStats("unbounded", None)
    seen = _SeenIds()
    for limit, ids in requests:
        st.requests += 1
        st.chunk_refs += len(ids)
        p = 0
        while p < len(ids) and ids[p] in seen:
            p += 1
        st.hit_chunks += min(p, limit)
        for i in ids[p:]:
            seen.add(i)
    return st


class _Refs:
    """Every reference of a trace in arrays (pass one of :func:`belady`)."""

    def __init__(self, requests: Iterable[IdRequest], max_refs: int) -> None:
        ids: list[np.ndarray] = []
        lens: list[int] = []
        limits: list[int] = []
        total = 0
        for limit, req in requests:
            total += len(req)
            if total > max_refs:
                raise ValueError(f"Belady's MIN keeps every reference in memory; this trace has more than "
                                 f"{max_refs:,} (use --no-belady, or a shorter trace)")
            ids.append(np.asarray(req, dtype=np.int64))
            lens.append(len(req))
            limits.append(limit)
        self.ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        self.lens = np.asarray(lens, dtype=np.int64)
        self.limits = np.asarray(limits, dtype=np.int64)
        self.next = self._next_use(self.ids)

    @staticmethod
    def _next_use(ids: np.ndarray) -> np.ndarray:
        """Index of each reference's next reference to the same id (len(ids): none)."""
        n = len(ids)
        nxt = np.full(n, n, dtype=np.int64)
        if n:
            order = np.argsort(ids, kind="stable")  # same ids together, in reference order
            same = ids[order[1:]] == ids[order[:-1]]
            nxt[order[:-1][same]] = order[1:][same]
        return nxt.astype(np.int32 if n < 2**31 - 1 else np.int64)


def belady(make_requests: Callable[[], Iterable[IdRequest]], capacities: Sequence[int],
           max_refs: int = MAX_REFS, progress: Callable[[int], None] | None = None) -> dict[int, CeilingStats]:
    """Belady's MIN at each capacity (chunks), from one recording of the references.

    Args:
        make_requests: returns the trace's requests (called once).
        capacities: capacities in chunks (each >= 1).
        max_refs: refuse traces with more references (memory: 12 bytes per reference).
        progress: called with each capacity once it is done.

    Raises:
        ValueError: a capacity below 1, or more than ``max_refs`` references.
    """
    if any(c < 1 for c in capacities):
        raise ValueError("capacities must be at least 1 chunk")
    refs = _Refs(make_requests(), max_refs)
    out = {}
    for cap in capacities:
        out[cap] = _min(refs, cap)
        if progress is not None:
            progress(cap)
    return out


def _min(refs: _Refs, cap: int) -> CeilingStats:
    st = CeilingStats("belady", cap, requests=len(refs.lens), chunk_refs=len(refs.ids))
    never = len(refs.ids)
    ids = refs.ids.tolist()
    nxt = refs.next.tolist()
    resident: dict[int, int] = {}  # id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, id), stale entries skipped
    pos = 0
    hits = 0
    for n, limit in zip(refs.lens.tolist(), refs.limits.tolist()):
        p = 0
        while p < n and ids[pos + p] in resident:
            p += 1
        hits += min(p, limit)
        for j in range(pos, pos + n):
            i, nu = ids[j], nxt[j]
            if i in resident:
                resident[i] = nu
                heapq.heappush(heap, (-nu, i))
                continue
            if len(resident) >= cap:
                if nu == never:
                    continue  # never used again: not worth a slot
                while True:
                    neg, v = heapq.heappop(heap)
                    if resident.get(v) == -neg:
                        break
                if -neg < nu:  # everything resident is used sooner than this chunk
                    heapq.heappush(heap, (neg, v))
                    continue
                del resident[v]
            resident[i] = nu
            heapq.heappush(heap, (-nu, i))
        pos += n
        if len(heap) > 4 * cap + 1024:  # drop stale entries
            heap = [(-nu, i) for i, nu in resident.items()]
            heapq.heapify(heap)
    st.hit_chunks = hits
    return st
