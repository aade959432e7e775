"""Prefix-chained chunk keys.

A prompt is cut into chunks of ``chunk_size`` tokens; only full chunks get a key.
The key of chunk ``i`` is::

    key[0] = blake3(root || tokens[0:C])
    key[i] = blake3(key[i-1] || tokens[i*C:(i+1)*C])

where tokens are encoded as fixed-width little-endian uint32 and ``root`` is a
digest of the :class:`KeyNamespace` (model identity, KV layout signature, world
size, rank, chunk size) and the optional per-request ``cache_salt``.

Per-request :class:`KeyExtras` carry what else decides a chunk's KV besides its
tokens (as the engine's own block hash does): the LoRA adapter identity is
folded into the root (every chunk differs), and each multimodal item's content
hash is appended to the hash input of every chunk overlapping its placeholder
range (so that chunk and, through the chain, every later chunk differ)::

    root'  = blake3(EXTRA_DOMAIN || root || "a" || len || adapter)   (adapter set)
    key[i] = blake3(key[i-1] || tokens[i*C:(i+1)*C] || "m" || n || item...)

where each overlapping item is ``len || identifier || offset - i*C (int64) ||
length`` (little endian). Without extras (or with empty extras) keys are exactly
the scheme-1 keys above: the golden vectors in the tests pin both. The encoding
is canonical JSON (sorted keys, no whitespace) so the same tokens and config give
the same key in every process, on every machine and across restarts. Python's
``hash()`` is never used: it is salted per process.

Because each key commits to its whole prefix, a key hit implies every earlier
chunk of the prompt matched too (the scheme used by vLLM's prefix caching and
LMCache's chunk hashing).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

import blake3
import numpy as np

#: Bumped only if the key derivation itself changes; golden vectors in the tests pin it.
KEY_SCHEME_VERSION = 1
#: Bytes per chunk key.
KEY_BYTES = 32
_ROOT_DOMAIN = b"kvtier/root/v1\x00"
_EXTRA_DOMAIN = b"kvtier/extras/v1\x00"


def _lp(data: bytes) -> bytes:
    """Length-prefixed bytes (8-byte little-endian length): unambiguous concatenation."""
    return len(data).to_bytes(8, "little") + data


#: First bytes of a lineage marker (see :meth:`KeyNamespace.lineage`).
LINEAGE_TAG = b"\x00" * 8
_LINEAGE_DOMAIN = b"kvtier/lineage/v1\x00"


def is_lineage(parent: bytes | None) -> bool:
    """True if ``parent`` is a lineage marker (the recorded parent of a prompt's first chunk),
    not a chunk key. A chunk key starts with 8 zero bytes with probability 2**-64."""
    return parent is not None and len(parent) == KEY_BYTES and parent[:8] == LINEAGE_TAG and any(parent[8:])


def chain_parents(keys: Sequence[bytes], first: bytes | None = None) -> list[bytes | None]:
    """The parent of each of ``keys`` when they are consecutive chunks of one prompt:
    ``first`` (the parent of ``keys[0]``: the chunk before it, a lineage marker, or None
    for a prompt's first chunk), then each key's predecessor. For ``open_write_many``."""
    return [keys[i - 1] if i else first for i in range(len(keys))]


def chain_parent(parent: bytes | None) -> bytes | None:
    """The parent that links chunks in a tier: ``parent``, or None for a lineage marker (a
    prompt's first chunk, whose marker is never a resident chunk)."""
    return None if parent is None or is_lineage(parent) else parent


@dataclass(frozen=True)
class MMItem:
    """One multimodal input item of a prompt, as it decides the KV of its placeholder tokens.

    Attributes:
        identifier: content hash of the item (vLLM's ``MultiModalFeatureSpec.identifier``),
            non-empty. Items with equal identifiers have equal embeddings.
        offset: first placeholder token of the item in the prompt (tokens, >= 0).
        length: placeholder tokens of the item (> 0).
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not self.identifier:
            raise ValueError("MMItem.identifier must be a non-empty content hash")
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"MMItem placeholder range must have offset >= 0, length > 0; got "
                             f"offset={self.offset} length={self.length}")

    def encode(self, chunk_start: int) -> bytes:
        """Bytes folded into a chunk starting at token ``chunk_start`` that overlaps this item."""
        return (_lp(self.identifier.encode()) + (self.offset - chunk_start).to_bytes(8, "little", signed=True)
                + self.length.to_bytes(8, "little"))


@dataclass(frozen=True)
class KeyExtras:
    """Per-request inputs besides tokens and cache salt that decide the KV (part of the key).

    Attributes:
        adapter: LoRA adapter identity (name plus a fingerprint of its weights), or None
            for the base model. Distinct strings never share chunks.
        mm_items: multimodal items, in any order (sorted by offset when hashing).
    """

    adapter: str | None = None
    mm_items: tuple[MMItem, ...] = ()

    def __bool__(self) -> bool:
        return self.adapter is not None or bool(self.mm_items)


@dataclass(frozen=True)
class LayoutSignature:
    """Everything that decides the byte layout of one chunk's KV payload.

    Two engines may exchange a chunk only if their signatures are equal.

    Attributes:
        engine: engine family, e.g. ``"vllm"``.
        attn_backend: attention backend and kernel packing, e.g. ``"CPU_ATTN/vec"``.
        kv_layout: the engine's KV cache layout name, e.g. ``"LBHNC"``.
        block_size: engine paged-block size in tokens.
        num_layers: attention layers whose KV is stored.
        num_kv_heads: KV heads per layer (on this rank).
        head_dim: head dimension.
        dtype: KV element dtype name, e.g. ``"bfloat16"``.
    """

    engine: str
    attn_backend: str
    kv_layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LayoutSignature.{name} must be positive, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        """Bytes per KV element."""
        return np.dtype(_NUMPY_ITEMSIZE_ALIASES.get(self.dtype, self.dtype)).itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers (e.g. 23,040 for SmolLM2-135M bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


# numpy has no bfloat16/fp8; only the item size matters here.
_NUMPY_ITEMSIZE_ALIASES = {
    "bfloat16": "uint16",
    "float16": "float16",
    "float32": "float32",
    "fp8": "uint8",
    "fp8_e4m3": "uint8",
    "fp8_e5m2": "uint8",
}


@dataclass(frozen=True)
class KeyNamespace:
    """The key namespace: chunks are shared only between equal namespaces.

    Attributes:
        model: model identity (name plus a weights fingerprint, or an explicit id).
        layout: the KV layout signature.
        chunk_size: tokens per chunk.
        world_size: tensor-parallel world size (each rank stores its own KV heads).
        rank: this worker's rank.
    """

    model: str
    layout: LayoutSignature
    chunk_size: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.chunk_size % self.layout.block_size:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must be a multiple of the engine block size "
                f"({self.layout.block_size}) so that chunks are whole blocks"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world_size {self.world_size}")

    @property
    def chunk_bytes(self) -> int:
        """Payload bytes of one full chunk."""
        return self.chunk_size * self.layout.bytes_per_token

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.layout.block_size

    def canonical_bytes(self) -> bytes:
        """Canonical encoding: sorted-key compact JSON, UTF-8."""
        doc = {"scheme": KEY_SCHEME_VERSION, **asdict(self)}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        """32-byte digest identifying this namespace (written into disk headers)."""
        return blake3.blake3(_ROOT_DOMAIN + self.canonical_bytes()).digest()

    def lineage(self, cache_salt: str | None = None) -> bytes:
        """The recorded parent of a prompt's first chunk: ``LINEAGE_TAG`` (8 zero bytes) + 24 bytes
        of ``blake3(domain || root(cache_salt))``.

        Keys do not depend on it (a key chains from :meth:`root`); tiers store it as the first
        chunk's parent so that which tenant salt a chain started from is known later (the fleet
        controller's ``clear(cache_salt=...)``), and treat it as "no parent" for prefix closure
        (:func:`chain_parent`). The LoRA adapter is not in it: a salt's chains under every adapter
        share one marker.
        """
        return LINEAGE_TAG + blake3.blake3(_LINEAGE_DOMAIN + self.root(cache_salt)).digest()[:KEY_BYTES - 8]

    def root(self, cache_salt: str | None = None) -> bytes:
        """Parent digest of a prompt's first chunk.

        ``cache_salt`` isolates tenants: different salts never share chunks. ``None``
        and ``""`` are distinct from every non-empty salt (the salt is length-prefixed).
        """
        h = blake3.blake3(_ROOT_DOMAIN)
        h.update(self.canonical_bytes())
        if cache_salt is None:
            h.update(b"\x00")
        else:
            salt = cache_salt.encode()
            h.update(b"\x01" + len(salt).to_bytes(8, "little") + salt)
        return h.digest()


class ChunkHasher:
    """Computes the chain of chunk keys for token sequences in one namespace.

    Throughput: one numpy conversion per prompt plus one blake3 call per chunk
    (see ``kvtier bench`` for tokens/s on this machine).
    """

    def __init__(self, namespace: KeyNamespace):
        self.namespace = namespace
        self.chunk_size = namespace.chunk_size
        self._roots: dict[tuple[str | None, str | None], bytes] = {}
        self._lineages: dict[str | None, bytes] = {}

    def _root(self, cache_salt: str | None, adapter: str | None = None) -> bytes:
        memo = (cache_salt, adapter)
        root = self._roots.get(memo)
        if root is None:
            root = self.namespace.root(cache_salt)
            if adapter is not None:
                root = blake3.blake3(_EXTRA_DOMAIN).update(root).update(b"a" + _lp(adapter.encode())).digest()
            if len(self._roots) < 4096:  # bounded memo; salts are per tenant, adapters per deployment
                self._roots[memo] = root
        return root

    def lineage(self, cache_salt: str | None = None) -> bytes:
        """:meth:`KeyNamespace.lineage` (memoized per salt)."""
        got = self._lineages.get(cache_salt)
        if got is None:
            got = self.namespace.lineage(cache_salt)
            if len(self._lineages) < 4096:
                self._lineages[cache_salt] = got
        return got

    def num_full_chunks(self, num_tokens: int) -> int:
        return num_tokens // self.chunk_size

    def keys(
        self,
        tokens: Sequence[int] | np.ndarray,
        cache_salt: str | None = None,
        max_chunks: int | None = None,
        extras: KeyExtras | None = None,
        *,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Keys of the full chunks of ``tokens`` (at most ``max_chunks``).

        Args:
            tokens: token ids, each in ``[0, 2**32)``.
            cache_salt: optional tenant salt.
            max_chunks: stop after this many chunks.
            extras: adapter identity and multimodal items of the request (None or empty:
                the plain scheme-1 keys).
            parent: the key of the chunk just before ``tokens[0]``, to continue a prompt
                whose earlier chunks were hashed already (None: ``tokens`` starts the prompt).
                The keys equal those of the whole prompt at the same positions.

        Returns:
            ``len(tokens) // chunk_size`` keys (or fewer with ``max_chunks``), 32 bytes each.

        Raises:
            ValueError: a token id is not an integer, is negative or does not fit in 32 bits;
                ``parent`` given with multimodal items (their offsets count from token 0).
        """
        if parent is not None and extras is not None and extras.mm_items:
            raise ValueError("parent cannot be combined with multimodal items")
        n = len(tokens) // self.chunk_size
        if max_chunks is not None:
            n = min(n, max_chunks)
        if n <= 0:
            return []
        arr = np.asarray(tokens[: n * self.chunk_size])
        if arr.dtype != np.dtype("<u4"):
            # Non-integer ids (floats, strings) are refused: astype would truncate 0.5 to 0.
            if arr.dtype.kind not in "iu" or (arr.size and (arr.min() < 0 or arr.max() >= 2**32)):
                raise ValueError("token ids must be integers in [0, 2**32)")
            arr = arr.astype("<u4")
        buf = memoryview(arr.tobytes())
        step = self.chunk_size * 4
        if parent is None:
            parent = self._root(cache_salt, extras.adapter if extras else None)
        mm = self._mm_suffixes(extras.mm_items, n) if extras and extras.mm_items else {}
        out: list[bytes] = []
        for i in range(n):
            h = blake3.blake3(parent).update(buf[i * step : (i + 1) * step])
            suffix = mm.get(i)
            if suffix is not None:
                h.update(suffix)
            parent = h.digest()
            out.append(parent)
        return out

    def _mm_suffixes(self, items: tuple[MMItem, ...], n: int) -> dict[int, bytes]:
        """Chunk index -> bytes of the multimodal items overlapping that chunk (first ``n`` chunks)."""
        per_chunk: dict[int, list[bytes]] = {}
        C = self.chunk_size
        for item in sorted(items, key=lambda it: (it.offset, it.length, it.identifier)):
            first = item.offset // C
            last = min(n - 1, (item.offset + item.length - 1) // C)
            for i in range(first, last + 1):
                per_chunk.setdefault(i, []).append(item.encode(i * C))
        return {
            i: b"m" + len(parts).to_bytes(8, "little") + b"".join(parts) for i, parts in per_chunk.items()
        }
