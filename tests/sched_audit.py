"""The auditing pieces of the scheduler harness (tests/sched_harness.py).

- :class:`PoisonModel`: the deterministic "forward". The KV of position ``p`` at
  layer 0 is a hash of (token, ``p``); at layer ``l > 0`` also of a digest of the
  layer ``l-1`` KV of positions ``0..p`` as read from the paged cache. So the KV
  (and every later token) of anything computed over a wrong block is wrong, and the
  KV of a prompt is a pure function of its tokens (its "cold" KV).
- :class:`Audit`: every chunk kvtier commits is compared, at commit, with the cold
  KV of its tokens; reads of blocks that do not hold their cold KV are recorded.
- :class:`FaultyStore`: the worker's store with injected read failures.

Values are uint16 bit patterns in bf16 KV ``[num_blocks, heads, block_size, 2 * head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

VOCAB = 50_000

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wraps mod 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 8
    block_size: int = 16

    @property
    def width(self) -> int:
        """uint16 values per (layer, token)."""
        return self.num_kv_heads * 2 * self.head_dim


class PoisonModel:
    """The deterministic forward (see the module doc)."""

    def __init__(self, g: Geometry):
        self.g = g
        rng = np.random.default_rng(1234)
        self._w = rng.integers(1, 2**63, size=g.width, dtype=np.uint64)
        self._cols = np.arange(g.width, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)

    def values(self, layer: int, tokens: np.ndarray, pos: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """KV of ``layer`` at ``pos``: uint16 ``[n, width]``."""
        seed = _mix(tokens.astype(np.uint64) * np.uint64(1_000_003) + pos.astype(np.uint64) * np.uint64(7919)
                    + np.uint64(layer * 104_729 + 1))
        seed = _mix(seed ^ ctx)
        return (_mix(seed[:, None] + self._cols[None, :]) & np.uint64(0xFFFF)).astype(np.uint16)

    def digest(self, rows: np.ndarray) -> np.ndarray:
        """Per position p, a digest of ``rows[0..p]`` (uint64 ``[n]``)."""
        pos = np.arange(len(rows), dtype=np.uint64)
        h = _mix((rows.astype(np.uint64) * self._w[None, :]).sum(axis=1, dtype=np.uint64) + pos * np.uint64(31))
        return np.cumsum(h, dtype=np.uint64)

    def sample(self, top_digest: np.uint64) -> int:
        return int(_mix(np.array([top_digest], dtype=np.uint64))[0] % np.uint64(VOCAB))

    def cold(self, tokens: list[int]) -> list[np.ndarray]:
        """The KV of ``tokens`` computed from scratch: per layer uint16 ``[n, width]``."""
        t = np.asarray(tokens, dtype=np.int64)
        pos = np.arange(len(t))
        out: list[np.ndarray] = []
        for layer in range(self.g.num_layers):
            ctx = np.zeros(len(t), dtype=np.uint64) if layer == 0 else self.digest(out[-1])
            out.append(self.values(layer, t, pos, ctx))
        return out

    def cold_generate(self, prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            top = self.cold(seq)[-1]
            seq.append(self.sample(self.digest(top)[-1]))
        return seq[len(prompt):]


# -- faults and the commit audit -----------------------------------------------------------------
class FaultyStore:
    """The worker's store with injected read failures; checks every commit against cold KV.

    ``fail_read(key, item_index, reads_so_far)`` decides whether one item of an
    ``open_read_many`` comes back as a miss (a failed read).
    """

    def __init__(self, inner: Any, audit: "Audit"):
        self._inner = inner
        self._audit = audit
        self._bufs: dict[bytes, np.ndarray] = {}
        self.fail_read: Callable[[bytes], bool] = lambda key: False
        self.failed_reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def open_read_many(self, items: Any) -> list[Any]:
        handles = self._inner.open_read_many(items)
        out = []
        for (key, _), h in zip(items, handles):
            if h is not None and self.fail_read(key):
                h.close()
                self.failed_reads += 1
                h = None
            out.append(h)
        return out

    def open_write_many(self, keys: Any, *args: Any, **kwargs: Any) -> list[Any]:
        got = self._inner.open_write_many(keys, *args, **kwargs)
        for k, g in zip(keys, got):
            if isinstance(g, np.ndarray):
                self._bufs[k] = g
        return got

    def commit(self, key: bytes, *args: Any, **kwargs: Any) -> None:
        buf = self._bufs.pop(key, None)
        if buf is not None:
            self._audit.check_commit(key, buf)
        self._inner.commit(key, *args, **kwargs)

    def abort(self, key: bytes) -> None:
        self._bufs.pop(key, None)
        self._inner.abort(key)


@dataclass
class Audit:
    """What the harness saw: commits that differ from cold KV, reads of wrong blocks."""

    model: PoisonModel
    geometry: Geometry
    chunk_size: int
    chunk_tokens: dict[bytes, list[int]] = field(default_factory=dict)  # key -> tokens up to the chunk's end
    bad_commits: list[tuple[bytes, int]] = field(default_factory=list)  # (key, chunk index)
    unknown_commits: list[bytes] = field(default_factory=list)
    commits: int = 0
    wrong_reads: list[tuple[int, str, int]] = field(default_factory=list)  # (step, request, block index)

    def matches(self, buf: np.ndarray, tokens: list[int]) -> bool:
        """Whether a stored chunk holds the cold KV of the chunk of ``tokens`` that ends at
        ``len(tokens)`` (a PD partial chunk: only its first ``len(tokens) % chunk_size`` positions)."""
        g, cs = self.geometry, self.chunk_size
        n = len(tokens) % cs or cs
        start = len(tokens) - n
        cold = self.model.cold(tokens)
        bpc = cs // g.block_size
        got = buf.view(np.uint16).reshape(g.num_layers, bpc, g.num_kv_heads, g.block_size, 2 * g.head_dim)
        got = got.transpose(0, 1, 3, 2, 4).reshape(g.num_layers, cs, g.width)[:, :n]
        return bool(np.array_equal(got, np.stack([c[start:] for c in cold])))

    def check_commit(self, key: bytes, buf: np.ndarray) -> None:
        self.commits += 1
        tokens = self.chunk_tokens.get(key)
        if tokens is None:
            self.unknown_commits.append(key)
            return
        if not self.matches(buf, tokens):
            self.bad_commits.append((key, -(-len(tokens) // self.chunk_size) - 1))

    def check_store(self, manager: Any) -> list[bytes]:
        """Keys of chunks resident in the CPU tier whose bytes differ from cold KV (or are unknown)."""
        bad = []
        for key, _ in manager.cpu.resident():
            buf = manager.cpu.acquire(key)
            if buf is None:
                continue
            try:
                tokens = self.chunk_tokens.get(key)
                if tokens is None or not self.matches(buf, tokens):
                    bad.append(key)
            finally:
                manager.cpu.release(key)
        return bad


def tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids."""
    return np.random.default_rng(seed).integers(1, VOCAB, size=n).tolist()


def fail_once(keys: Iterable[bytes]) -> Callable[[bytes], bool]:
    """A read plan: the first read of each of ``keys`` fails, later ones succeed."""
    pending = set(keys)

    def plan(key: bytes) -> bool:
        if key in pending:
            pending.discard(key)
            return True
        return False

    return plan
