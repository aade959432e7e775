"""Metadata-only replay of a keyed trace through one eviction policy.

The simulated tier holds chunk keys only (no payloads) and acts like the
storage manager: a lookup hits the longest resident prefix of a prompt, at most
``(num_tokens - 1) // chunk_size`` chunks (the engine always computes at least
one token); hit chunks are touched last to first; then the prompt's missing full
chunks are stored in order with ``policy.insert(key, parent)``, evicting the
policy's first candidate that is not pinned. The prompt's own chunks are pinned
during its request (as a lookup lease pins them). Stores start right after the
resident prefix and stop at the first chunk that cannot be stored, so a stored
chunk's parent is always resident.

Token hit rate = hit tokens / prompt tokens, over the whole trace; chunk hit rate = hit
chunks / chunks referenced (a Mooncake trace's "fraction of block references hit").
:func:`step` is one request, shared by :func:`replay` and the trace replay
(:mod:`kvtier.sim.trace_replay`), whose ``every-block`` mode lets every referenced chunk hit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from kvtier.tiers.policies import EvictionPolicy, make_policy


@dataclass
class SimStats:
    """Outcome of one replay (tokens and chunks).

    Attributes:
        policy: policy name.
        capacity_chunks: tier capacity in chunks (None: unbounded).
        requests: prompts replayed.
        prompt_tokens: tokens of every prompt.
        hit_tokens: tokens served from the tier.
        chunk_refs: chunks referenced (every key of every request).
        hit_chunks: chunks served from the tier.
        stored_chunks: chunks inserted.
        evicted_chunks: chunks evicted.
        store_skipped: chunks not stored because every candidate was pinned.
        chain_violations: evictions of a chunk with resident children, plus lookups
            that found a resident chunk right after a missing one (must be 0).
    """

    policy: str
    capacity_chunks: int | None
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    chunk_refs: int = 0
    hit_chunks: int = 0
    stored_chunks: int = 0
    evicted_chunks: int = 0
    store_skipped: int = 0
    chain_violations: int = 0

    @property
    def hit_rate(self) -> float:
        """Token hit rate in [0, 1]."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def chunk_hit_rate(self) -> float:
        """Chunk (block reference) hit rate in [0, 1]."""
        return self.hit_chunks / self.chunk_refs if self.chunk_refs else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "chunk_hit_rate": self.chunk_hit_rate}


class SimTier:
    """A tier of ``capacity`` chunk keys ordered by ``policy``.

    Invariant: ``resident`` and the policy hold the same keys; ``children[p]``
    counts resident keys whose parent is ``p`` (used only to check the chain rule).

    Raises:
        ValueError: capacity below one chunk.
    """

    def __init__(self, capacity: int | None, policy: EvictionPolicy, stats: SimStats):
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be at least one chunk, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.stats = stats
        self.resident: set[bytes] = set()
        self.parent: dict[bytes, bytes | None] = {}
        self.children: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self.resident

    def store(self, key: bytes, parent: bytes | None, pinned: set[bytes]) -> bool:
        """Insert ``key``, evicting if full; False if nothing could be evicted."""
        if self.capacity is not None and len(self.resident) >= self.capacity:
            victim = None
            for cand in self.policy.candidates():
                if cand not in pinned:
                    victim = cand
                    break
            if victim is None:
                return False
            self._evict(victim)
        self.resident.add(key)
        self.parent[key] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1
        self.policy.insert(key, parent)
        self.stats.stored_chunks += 1
        return True

    def _evict(self, key: bytes) -> None:
        if self.children.get(key):
            self.stats.chain_violations += 1
        self.resident.remove(key)
        self.policy.remove(key)
        parent = self.parent.pop(key)
        if parent is not None:
            left = self.children[parent] - 1
            if left:
                self.children[parent] = left
            else:
                del self.children[parent]
        self.stats.evicted_chunks += 1


def step(tier: SimTier, num_tokens: int, keys: Sequence[bytes], hit_limit: int) -> int:
    """One request: look up, touch the hits tail first, store the rest; returns hit chunks.

    Args:
        tier: the simulated tier (its ``stats`` are updated).
        num_tokens: the prompt's tokens.
        keys: the chunk keys the request references, in prompt order.
        hit_limit: most chunks that may count as hits (the engine computes at least one
            token: ``(num_tokens - 1) // chunk_size``; ``len(keys)`` lets every one hit).
    """
    stats = tier.stats
    stats.requests += 1
    stats.prompt_tokens += num_tokens
    stats.chunk_refs += len(keys)
    present = 0  # longest resident prefix; at most `hit_limit` of it is a hit
    while present < len(keys) and keys[present] in tier:
        present += 1
    if present + 1 < len(keys) and keys[present + 1] in tier:
        stats.chain_violations += 1  # an unreachable chunk was kept
    touch = tier.policy.touch
    for key in reversed(keys[:present]):
        touch(key)
    hits = min(present, hit_limit)
    stats.hit_chunks += hits
    pinned = set(keys)
    for i in range(present, len(keys)):
        parent = keys[i - 1] if i else None
        if not tier.store(keys[i], parent, pinned):
            stats.store_skipped += len(keys) - i
            break
    return hits


def replay(
    prompts: Sequence[tuple[int, list[bytes]]],
    chunk_size: int,
    policy: str,
    capacity: int | None,
) -> SimStats:
    """Replay keyed prompts through a fresh tier.

    Args:
        prompts: ``(num_tokens, chunk keys)`` per request, in arrival order; the
            keys are those of every full chunk (``ChunkHasher.keys``).
        chunk_size: tokens per chunk.
        policy: a name in ``POLICIES``.
        capacity: tier capacity in chunks, or None for unbounded.

    Raises:
        ValueError: unknown policy or capacity below one chunk.
    """
    stats = SimStats(policy, capacity)
    tier = SimTier(capacity, make_policy(policy), stats)
    for num_tokens, keys in prompts:
        hits = step(tier, num_tokens, keys, max(0, (num_tokens - 1) // chunk_size))
        stats.hit_tokens += hits * chunk_size
    return stats
