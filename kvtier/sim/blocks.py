"""kvtier chunk keys for the blocks of a Mooncake-format trace (:mod:`kvtier.storage.trace_file`).

A trace names each ``block_size``-token block of a prompt by a hash id (equal ids, equal
prefixes) and carries no tokens. To replay it through kvtier's real key chain, each hash id
becomes ``block_size`` token ids (:func:`block_tokens`: its first two tokens are the id
itself, so distinct ids never share a block; the rest are a splitmix64 stream of the id),
and a prompt's tokens are hashed with :class:`kvtier.index.keys.ChunkHasher` exactly as the
connector hashes a real prompt (``block_size / chunk_size`` chunk keys per block).

A block's keys depend on its whole prefix, so they are computed once per (parent key, hash
id) and kept in a bounded LRU map (:class:`BlockKeyer`); a prompt continues from the key of
its previous block, so a block that fell out of the map costs one block's hashing.

Two replay modes set which blocks a request references:

- ``every-block`` (the Mooncake figures): every block, the partial last one included (its
  tokens are those of a full block: an id names the block, whatever its fill);
- ``engine`` (what kvtier really stores): full chunks only, ``input_length // chunk_size``;
  the partial last block is never keyed.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature
from kvtier.storage.trace_file import TraceRecord

MODES = ("every-block", "engine")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)

#: Key layout used by replays (the demo model's: SmolLM2-135M, bf16), so capacities convert to bytes.
SIM_LAYOUT = LayoutSignature(
    engine="sim", attn_backend="none", kv_layout="none", block_size=16,
    num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16",
)


def block_tokens(hash_id: int, block_size: int) -> np.ndarray:
    """The token ids standing for block ``hash_id``: uint32 ``[block_size]`` (``block_size >= 2``).

    Tokens 0 and 1 are the low and high 32 bits of the id (so the map is injective); token
    ``j >= 2`` is splitmix64(id * block_size + j) (Steele, Lea, Flood, "Fast splittable
    pseudorandom number generators", OOPSLA 2014) folded to 32 bits.

    Raises:
        ValueError: ``hash_id`` outside ``[0, 2**63)`` or ``block_size < 2``.
    """
    return blocks_tokens([hash_id], block_size)[0]


def blocks_tokens(hash_ids: "list[int] | tuple[int, ...]", block_size: int) -> np.ndarray:
    """:func:`block_tokens` of each id at once: uint32 ``[len(hash_ids), block_size]``.

    Raises:
        ValueError: an id outside ``[0, 2**63)`` or ``block_size < 2``.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    ids = np.asarray(hash_ids, dtype=np.int64 if not len(hash_ids) or max(hash_ids) < 1 << 63 else object)
    if ids.dtype == object or (ids.size and int(ids.min()) < 0):
        raise ValueError(f"hash ids must be in [0, 2**63), got {min(hash_ids)}..{max(hash_ids)}")
    u = ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = u[:, None] * np.uint64(block_size) + np.arange(block_size, dtype=np.uint64)[None, :]
        x += _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _C1
        x = (x ^ (x >> np.uint64(27))) * _C2
        x ^= x >> np.uint64(31)
    out = (x ^ (x >> np.uint64(32))).astype(np.uint32)
    out[:, 0] = (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    out[:, 1] = (u >> np.uint64(32)).astype(np.uint32)
    return out


def sim_namespace(chunk_size: int) -> KeyNamespace:
    """The key namespace of replays (model ``kvtier-sim``, :data:`SIM_LAYOUT`)."""
    return KeyNamespace(model="kvtier-sim", layout=SIM_LAYOUT, chunk_size=chunk_size)


class BlockKeyer:
    """Chunk keys of trace records, with a bounded map of computed blocks.

    Args:
        chunk_size: kvtier chunk, tokens (divides ``block_size``).
        block_size: the trace's block, tokens.
        mode: one of :data:`MODES`.
        max_blocks: blocks kept in the map (memory: about 200 bytes each plus 33 bytes per key).

    Raises:
        ValueError: a chunk size that does not divide the block size, an unknown mode.
    """

    def __init__(self, chunk_size: int, block_size: int, mode: str = "every-block", max_blocks: int = 1 << 20):
        if chunk_size < 16 or block_size % chunk_size:
            raise ValueError(f"chunk size {chunk_size} must be >= 16 and divide the block size {block_size}")
        if mode not in MODES:
            raise ValueError(f"unknown replay mode {mode!r}; choose one of {', '.join(MODES)}")
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.mode = mode
        self.per_block = block_size // chunk_size
        self.namespace = sim_namespace(chunk_size)
        self.hasher = ChunkHasher(self.namespace)
        self.max_blocks = max(1, max_blocks)
        self._memo: OrderedDict[int, tuple[bytes | None, list[bytes]]] = OrderedDict()
        self.hashed_blocks = 0

    def _block(self, hash_id: int, parent: bytes | None) -> list[bytes]:
        got = self._memo.get(hash_id)
        if got is not None and got[0] == parent:
            self._memo.move_to_end(hash_id)
            return got[1]
        keys = self.hasher.keys(block_tokens(hash_id, self.block_size), parent=parent)
        self.hashed_blocks += 1
        self._memo[hash_id] = (parent, keys)
        if len(self._memo) > self.max_blocks:
            self._memo.popitem(last=False)
        return keys

    def keys(self, rec: TraceRecord) -> list[bytes]:
        """The chunk keys ``rec`` references, in prompt order (see the module doc for the modes)."""
        ids = rec.hash_ids
        if self.mode == "engine":
            n_chunks = rec.input_length // self.chunk_size
            ids = ids[: -(-n_chunks // self.per_block)]
        else:
            n_chunks = len(ids) * self.per_block
        out: list[bytes] = []
        parent: bytes | None = None
        for h in ids:
            ks = self._block(h, parent)
            out.extend(ks)
            parent = ks[-1]
        del out[n_chunks:]
        return out
