"""Chunk keys: golden vectors, prefix chaining, namespace isolation, cross-process stability."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import blake3
import numpy as np
import pytest

from conftest import CHUNK, small_layout, small_namespace
from kvtier.index.keys import KEY_BYTES, ChunkHasher, KeyExtras, KeyNamespace, LayoutSignature, MMItem

REPO = Path(__file__).resolve().parents[1]

SMOL_LAYOUT = LayoutSignature("vllm", "CPU_ATTN/vec", "LBHNC", 128, 30, 3, 64, "bfloat16")
SMOL_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Golden vectors for SMOL namespace (chunk_size 256), tokens = range(600): two full chunks.
# These pin KEY_SCHEME_VERSION 1. If they change, every stored chunk on every disk
# becomes unreachable: bump KEY_SCHEME_VERSION and update them deliberately.
GOLDEN_NO_SALT = [
    "fc0279baf5bb9250f61d6cfc91c8f58dcef2bd8973dee4967095c9ae1ee00630",
    "6d08c4247d9d8551cb1e4bcc2bb403164080f7c0bd1655471f6209193c4cd838",
]
GOLDEN_SALT_TENANT_A = [
    "b13ffb465c1ccb2e3ecf13bd2d620fefda2be5b14a1b9ded96e622870bc9aff0",
    "532a83904cbd349f4017fad449f6eb9542776e2c8b9289aca60500ebeab8ab5e",
]


def smol_hasher() -> ChunkHasher:
    return ChunkHasher(KeyNamespace(SMOL_MODEL, SMOL_LAYOUT, 256))


# -- golden vectors --------------------------------------------------------------


def test_golden_keys_without_salt() -> None:
    keys = smol_hasher().keys(list(range(600)))
    assert [k.hex() for k in keys] == GOLDEN_NO_SALT


def test_golden_keys_with_salt() -> None:
    keys = smol_hasher().keys(list(range(600)), cache_salt="tenant-a")
    assert [k.hex() for k in keys] == GOLDEN_SALT_TENANT_A


def test_keys_follow_the_documented_derivation() -> None:
    """Recompute the chain from the module docstring with blake3 directly."""
    ns = KeyNamespace(SMOL_MODEL, SMOL_LAYOUT, 256)
    canonical = (
        b'{"chunk_size":256,"layout":{"attn_backend":"CPU_ATTN/vec","block_size":128,'
        b'"dtype":"bfloat16","engine":"vllm","head_dim":64,"kv_layout":"LBHNC",'
        b'"num_kv_heads":3,"num_layers":30},"model":"HuggingFaceTB/SmolLM2-135M-Instruct",'
        b'"rank":0,"scheme":1,"world_size":1}'
    )
    assert ns.canonical_bytes() == canonical
    domain = b"kvtier/root/v1\x00"
    for salt, golden in ((None, GOLDEN_NO_SALT), ("tenant-a", GOLDEN_SALT_TENANT_A)):
        if salt is None:
            salt_part = b"\x00"
        else:
            salt_part = b"\x01" + len(salt.encode()).to_bytes(8, "little") + salt.encode()
        parent = blake3.blake3(domain + canonical + salt_part).digest()
        tokens = np.arange(600, dtype="<u4")
        for i, want in enumerate(golden):
            parent = blake3.blake3(parent + tokens[i * 256 : (i + 1) * 256].tobytes()).digest()
            assert parent.hex() == want


def test_input_types_give_the_same_keys() -> None:
    h = smol_hasher()
    want = h.keys(list(range(600)))
    assert h.keys(tuple(range(600))) == want
    assert h.keys(np.arange(600, dtype=np.int64)) == want
    assert h.keys(np.arange(600, dtype="<u4")) == want
    assert h.keys(np.arange(600, dtype=">u4")) == want
    assert h.keys(range(600)) == want


# -- chaining and full chunks ----------------------------------------------------


def test_changing_chunk0_changes_every_key(hasher: ChunkHasher) -> None:
    tokens = list(range(4 * CHUNK))
    base = hasher.keys(tokens)
    assert len(base) == 4
    changed = list(tokens)
    changed[CHUNK - 1] += 1  # last token of chunk 0
    other = hasher.keys(changed)
    assert all(a != b for a, b in zip(base, other))


def test_changing_chunk1_keeps_key0(hasher: ChunkHasher) -> None:
    tokens = list(range(4 * CHUNK))
    base = hasher.keys(tokens)
    changed = list(tokens)
    changed[CHUNK] = 99_999  # first token of chunk 1
    other = hasher.keys(changed)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:]))


def test_same_chunk_content_at_another_position_has_another_key(hasher: ChunkHasher) -> None:
    block = list(range(CHUNK))
    keys = hasher.keys(block * 3)
    assert len(set(keys)) == 3


def test_only_full_chunks_get_keys(hasher: ChunkHasher) -> None:
    assert hasher.keys([]) == []
    assert hasher.keys(list(range(CHUNK - 1))) == []
    assert len(hasher.keys(list(range(CHUNK)))) == 1
    assert len(hasher.keys(list(range(3 * CHUNK + CHUNK - 1)))) == 3
    # the partial tail does not influence the full chunks' keys
    a = hasher.keys(list(range(2 * CHUNK)) + [1, 2, 3])
    b = hasher.keys(list(range(2 * CHUNK)) + [7])
    assert a == b == hasher.keys(list(range(2 * CHUNK)))
    assert all(len(k) == KEY_BYTES for k in a)


def test_max_chunks_is_a_prefix(hasher: ChunkHasher) -> None:
    tokens = list(range(5 * CHUNK))
    full = hasher.keys(tokens)
    assert hasher.keys(tokens, max_chunks=2) == full[:2]
    assert hasher.keys(tokens, max_chunks=0) == []
    assert hasher.keys(tokens, max_chunks=99) == full


# -- namespace isolation ---------------------------------------------------------

LAYOUT_CHANGES = [
    ("engine", "sglang"),
    ("attn_backend", "OTHER_ATTN"),
    ("kv_layout", "NLBHC"),
    ("block_size", 32),
    ("num_layers", 3),
    ("num_kv_heads", 2),
    ("head_dim", 16),
    ("dtype", "bfloat16"),
]


@pytest.mark.parametrize(("field", "value"), LAYOUT_CHANGES, ids=[f for f, _ in LAYOUT_CHANGES])
def test_each_layout_field_changes_keys(field: str, value: object) -> None:
    tokens = list(range(2 * CHUNK))
    base = ChunkHasher(small_namespace()).keys(tokens)
    other_ns = small_namespace(layout=small_layout(**{field: value}))
    other = ChunkHasher(other_ns).keys(tokens)
    assert len(other) == 2
    assert set(base).isdisjoint(other)
    assert small_namespace().digest() != other_ns.digest()


NAMESPACE_CHANGES = [
    ("model", "test/another-model"),
    ("model", "test/tiny-model@rev2"),
    ("world_size", 2),
    ("chunk_size", 64),
]


@pytest.mark.parametrize(("field", "value"), NAMESPACE_CHANGES, ids=[f"{f}={v}" for f, v in NAMESPACE_CHANGES])
def test_each_namespace_field_changes_keys(field: str, value: object) -> None:
    tokens = list(range(4 * CHUNK))
    base = ChunkHasher(small_namespace()).keys(tokens)
    other_ns = small_namespace(**{field: value})
    other = ChunkHasher(other_ns).keys(tokens)
    assert set(base).isdisjoint(other)
    assert small_namespace().digest() != other_ns.digest()


def test_rank_changes_keys() -> None:
    tokens = list(range(2 * CHUNK))
    r0 = ChunkHasher(small_namespace(world_size=2, rank=0)).keys(tokens)
    r1 = ChunkHasher(small_namespace(world_size=2, rank=1)).keys(tokens)
    assert set(r0).isdisjoint(r1)


def test_salts_isolate(hasher: ChunkHasher) -> None:
    tokens = list(range(2 * CHUNK))
    variants = {
        "none": hasher.keys(tokens),
        "empty": hasher.keys(tokens, cache_salt=""),
        "a": hasher.keys(tokens, cache_salt="a"),
        "b": hasher.keys(tokens, cache_salt="b"),
        "nul": hasher.keys(tokens, cache_salt="\x00"),
    }
    flat = [k for keys in variants.values() for k in keys]
    assert len(set(flat)) == len(flat), "every salt (None, '', 'a', 'b', NUL) must give its own keys"
    # the memo of roots does not mix salts up
    assert hasher.keys(tokens, cache_salt="a") == variants["a"]
    assert hasher.keys(tokens) == variants["none"]


def test_equal_namespaces_share_keys() -> None:
    tokens = list(range(3 * CHUNK))
    assert ChunkHasher(small_namespace()).keys(tokens) == ChunkHasher(small_namespace()).keys(tokens)


# -- bad input --------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, 2**70])
def test_out_of_range_token_ids_raise(hasher: ChunkHasher, bad: int) -> None:
    tokens = list(range(2 * CHUNK))
    tokens[CHUNK + 3] = bad
    with pytest.raises(ValueError, match="token ids"):
        hasher.keys(tokens)


def test_out_of_range_token_in_numpy_array_raises(hasher: ChunkHasher) -> None:
    arr = np.arange(2 * CHUNK, dtype=np.int64)
    arr[5] = -7
    with pytest.raises(ValueError):
        hasher.keys(arr)
    arr = np.arange(2 * CHUNK, dtype=np.uint64)
    arr[5] = 2**33
    with pytest.raises(ValueError):
        hasher.keys(arr)


@pytest.mark.parametrize("bad", [0.5, 1.5, "7"], ids=["0.5", "1.5", "str"])
def test_non_integer_token_ids_raise(hasher: ChunkHasher, bad: object) -> None:
    """A fractional id must not be truncated into another token's key (0.5 -> 0)."""
    tokens: list[object] = list(range(CHUNK))
    tokens[0] = bad
    with pytest.raises(ValueError, match="token ids"):
        hasher.keys(tokens)  # type: ignore[arg-type]


def test_bad_namespace_values_raise() -> None:
    with pytest.raises(ValueError, match="block size"):
        small_namespace(chunk_size=CHUNK + 8)
    with pytest.raises(ValueError):
        small_namespace(chunk_size=0)
    with pytest.raises(ValueError, match="rank"):
        small_namespace(world_size=2, rank=2)
    with pytest.raises(ValueError, match="num_layers"):
        small_layout(num_layers=0)


def test_namespace_sizes() -> None:
    assert SMOL_LAYOUT.bytes_per_token == 23_040
    assert KeyNamespace(SMOL_MODEL, SMOL_LAYOUT, 256).chunk_bytes == 23_040 * 256
    ns = small_namespace()
    assert ns.chunk_bytes == 2048 and ns.blocks_per_chunk == 2
    assert dataclasses.replace(ns, chunk_size=64).chunk_bytes == 4096


# -- cross-process stability -----------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature
    ns = KeyNamespace("HuggingFaceTB/SmolLM2-135M-Instruct",
                      LayoutSignature("vllm", "CPU_ATTN/vec", "LBHNC", 128, 30, 3, 64, "bfloat16"), 256)
    h = ChunkHasher(ns)
    for salt in (None, "", "tenant-a"):
        print(",".join(k.hex() for k in h.keys(list(range(600)), cache_salt=salt)))
    print(hash("kvtier"))
    """
)


def test_keys_are_identical_across_processes() -> None:
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        env = {k: v for k, v in env.items() if not k.startswith("KVTIER_")}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120, check=True
        )
        outputs.append(proc.stdout.splitlines())
    a, b = outputs
    assert a[-1] != b[-1], "the two children must really run with different hash() seeds"
    assert a[:3] == b[:3]
    assert a[0].split(",") == GOLDEN_NO_SALT
    assert a[2].split(",") == GOLDEN_SALT_TENANT_A
    # and the parent process agrees
    h = smol_hasher()
    assert a[1].split(",") == [k.hex() for k in h.keys(list(range(600)), cache_salt="")]


# -- per-request extras: LoRA adapter identity, multimodal items (issue 8, failing inputs 2 and 3) --

GOLDEN_ADAPTER = [
    "af205b170e6af2c13a19530f09af7e3275dd0a2826cbb5c37aa4b6726c17763e",
    "bb91d091ac4483486f2c9b689ff52fae1f5c3293f570aad207fad6df2d09e0e6",
]
GOLDEN_IMAGE_200_100 = [
    "8d54fb2e1a2b606c1105e60cba01a24e0308095937609f8fbcc6c09d84d40bc3",
    "34f5a14c158a8628226d63eac0db3bcb5ad264dd6ec932a52423e98f632db4cc",
]


def _lp(b: bytes) -> bytes:
    return len(b).to_bytes(8, "little") + b


def test_no_extras_and_empty_extras_keep_the_scheme_1_keys() -> None:
    h = smol_hasher()
    assert [k.hex() for k in h.keys(list(range(600)), extras=None)] == GOLDEN_NO_SALT
    assert [k.hex() for k in h.keys(list(range(600)), extras=KeyExtras())] == GOLDEN_NO_SALT
    assert [k.hex() for k in h.keys(list(range(600)), "tenant-a", extras=KeyExtras())] == GOLDEN_SALT_TENANT_A


def test_golden_keys_with_extras() -> None:
    h = smol_hasher()
    assert [k.hex() for k in h.keys(list(range(600)), extras=KeyExtras("adapter-a\x00abc"))] == GOLDEN_ADAPTER
    img = KeyExtras(None, (MMItem("img-1", 200, 100),))
    assert [k.hex() for k in h.keys(list(range(600)), extras=img)] == GOLDEN_IMAGE_200_100


def test_extras_follow_the_documented_derivation() -> None:
    """Adapter folded into the root; an item appended to each chunk it overlaps (module docstring)."""
    ns = KeyNamespace(SMOL_MODEL, SMOL_LAYOUT, 256)
    tokens = np.arange(600, dtype="<u4").tobytes()
    C = 256 * 4
    root = blake3.blake3(b"kvtier/extras/v1\x00").update(ns.root(None)).update(b"a" + _lp(b"ad")).digest()
    item = _lp(b"img") + (250 - 0).to_bytes(8, "little", signed=True) + (20).to_bytes(8, "little")
    k0 = blake3.blake3(root).update(tokens[:C]).update(b"m" + (1).to_bytes(8, "little") + item).digest()
    item1 = _lp(b"img") + (250 - 256).to_bytes(8, "little", signed=True) + (20).to_bytes(8, "little")
    k1 = blake3.blake3(k0).update(tokens[C : 2 * C]).update(b"m" + (1).to_bytes(8, "little") + item1).digest()
    keys = ChunkHasher(ns).keys(list(range(600)), extras=KeyExtras("ad", (MMItem("img", 250, 20),)))
    assert keys == [k0, k1]


def test_adapter_changes_every_key_and_adapters_are_isolated(hasher: ChunkHasher) -> None:
    toks = list(range(3 * CHUNK))
    base = hasher.keys(toks)
    a = hasher.keys(toks, extras=KeyExtras("a\x00f1"))
    a2 = hasher.keys(toks, extras=KeyExtras("a\x00f2"))  # same name, other weights
    b = hasher.keys(toks, extras=KeyExtras("b\x00f1"))
    for one, other in [(base, a), (a, a2), (a, b), (base, b)]:
        assert not set(one) & set(other)
    assert hasher.keys(toks, extras=KeyExtras("a\x00f1")) == a
    # adapter and salt are independent dimensions
    assert not set(hasher.keys(toks, "t", extras=KeyExtras("a\x00f1"))) & set(a)


def test_image_changes_its_chunk_and_every_later_one_only(hasher: ChunkHasher) -> None:
    toks = list(range(4 * CHUNK))
    plain = hasher.keys(toks)
    in_chunk1 = hasher.keys(toks, extras=KeyExtras(None, (MMItem("x", CHUNK + 3, 5),)))
    assert in_chunk1[0] == plain[0] and not set(in_chunk1[1:]) & set(plain)
    other_image = hasher.keys(toks, extras=KeyExtras(None, (MMItem("y", CHUNK + 3, 5),)))
    assert other_image[0] == plain[0] and not set(other_image[1:]) & set(in_chunk1)
    moved = hasher.keys(toks, extras=KeyExtras(None, (MMItem("x", CHUNK + 4, 5),)))
    assert not set(moved[1:]) & set(in_chunk1)  # same image, other position in the chunk
    spanning = hasher.keys(toks, extras=KeyExtras(None, (MMItem("x", CHUNK - 2, CHUNK + 4),)))
    assert not set(spanning) & set(plain)  # overlaps chunks 0 .. 2


def test_image_past_the_last_full_chunk_changes_nothing(hasher: ChunkHasher) -> None:
    toks = list(range(2 * CHUNK + 10))
    assert hasher.keys(toks, extras=KeyExtras(None, (MMItem("x", 2 * CHUNK + 1, 5),))) == hasher.keys(toks)


def test_item_order_does_not_matter(hasher: ChunkHasher) -> None:
    toks = list(range(2 * CHUNK))
    i1, i2 = MMItem("x", 3, 4), MMItem("y", 10, 4)
    assert hasher.keys(toks, extras=KeyExtras(None, (i1, i2))) == hasher.keys(toks, extras=KeyExtras(None, (i2, i1)))


@pytest.mark.parametrize("args", [("", 0, 1), ("x", -1, 1), ("x", 0, 0)])
def test_bad_mm_items_raise(args: tuple) -> None:
    with pytest.raises(ValueError):
        MMItem(*args)
