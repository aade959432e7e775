"""CacheGen-style codec: round trips within the stated error bound, layout handling, bad bodies, registry."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.bench.quality import agreement
from kvtier.serde.base import CodecError, ValueSpec
from kvtier.serde.cachegen import CacheGenCodec
from kvtier.serde.envelope import ValueMiss, encode_value, read_value_into
from kvtier.serde.registry import CODECS, DEFAULT_DECODERS, make_codec

# A small LBHNC chunk: 3 layers, 2 blocks of 16 tokens, 2 KV heads, head dim 8.
L, B, H, N, D = 3, 2, 2, 16, 8
SHAPE = (L, B, H, N, 2 * D)


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bytes (uint8), round to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)


def f32(payload: np.ndarray) -> np.ndarray:
    return (payload.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def smooth_kv(seed: int, shape: tuple[int, ...] = SHAPE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An LBHNC payload whose K and V drift slowly along tokens (as real KV does).

    Returns (payload, K [L, H, T, D], V [L, H, T, D]) with K stored transposed in the blocks.
    """
    l, b, h, n, d2 = shape
    d, t = d2 // 2, b * n
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((l, 2, h, 1, d)) * 2
    walk = np.cumsum(rng.standard_normal((l, 2, h, t, d)) * 0.05, axis=3)
    kv = (base + walk).astype(np.float32)
    k, v = kv[:, 0], kv[:, 1]
    blocks = np.empty((l, b, h, 2, n * d), np.float32)
    kb = k.reshape(l, h, b, n, d).transpose(0, 2, 1, 4, 3)  # [L, B, H, D, N]: K transposed
    vb = v.reshape(l, h, b, n, d).transpose(0, 2, 1, 3, 4)  # [L, B, H, N, D]
    blocks[:, :, :, 0] = kb.reshape(l, b, h, n * d)
    blocks[:, :, :, 1] = vb.reshape(l, b, h, n * d)
    return bf16(blocks.reshape(-1)), k, v


def round_trip(codec: CacheGenCodec, payload: np.ndarray, spec: ValueSpec) -> tuple[np.ndarray, int]:
    body = b"".join(bytes(memoryview(p).cast("B")) for p in codec.encode(memoryview(payload), spec))
    out = np.zeros_like(payload)
    codec.decode_into(memoryview(body), memoryview(out))
    return out, len(body)


def max_bound(x: np.ndarray, codec: CacheGenCodec, spec: ValueSpec) -> float:
    """The error bound the module states: half the largest delta bin, plus bf16 rounding of the result."""
    streams, meta = codec._streams(x, spec)
    s = streams.reshape(-1, streams.shape[-2], streams.shape[-1])
    g = codec.group
    ascale = np.abs(s[:, ::g]).max(axis=1) / 127
    anchors = np.rint(s[:, ::g] / np.where(ascale == 0, 1, ascale)[:, None]) * ascale[:, None]
    delta = s - np.repeat(anchors, g, axis=1)[:, : s.shape[1]]
    width = np.abs(delta).max(axis=1) / (2 ** (min(codec.bits) - 1) - 1)
    return float(width.max() / 2 + np.abs(x).max() * 2.0**-8)


@pytest.mark.parametrize("k_layout", ["transposed", "token"])
def test_round_trip_within_error_bound(k_layout: str) -> None:
    payload, _, _ = smooth_kv(0)
    spec = ValueSpec("bfloat16", SHAPE)
    codec = CacheGenCodec(k_layout=k_layout)
    out, _ = round_trip(codec, payload, spec)
    x, y = f32(payload), f32(out)
    assert np.abs(x - y).max() <= max_bound(x, codec, spec)
    assert not np.array_equal(out, payload)  # lossy indeed
    if k_layout == "transposed":  # the layout the payload really has: small error too
        assert np.linalg.norm(x - y) / np.linalg.norm(x) < 0.02


def test_matching_k_layout_is_more_accurate() -> None:
    """K is stored transposed in vLLM CPU blocks: reading it that way finds the token locality,
    so the delta bins (and the error) are much smaller at the same bit depth."""
    payload, _, _ = smooth_kv(1, (4, 4, 2, 32, 32))
    spec = ValueSpec("bfloat16", (4, 4, 2, 32, 32))
    x = f32(payload)
    right, _ = round_trip(CacheGenCodec(k_layout="transposed"), payload, spec)
    wrong, _ = round_trip(CacheGenCodec(k_layout="token"), payload, spec)
    assert np.linalg.norm(x - f32(right)) < np.linalg.norm(x - f32(wrong)) / 2


def test_deltas_beat_plain_quantization_on_smooth_kv() -> None:
    payload, _, _ = smooth_kv(2, (4, 4, 2, 32, 32))
    spec = ValueSpec("bfloat16", (4, 4, 2, 32, 32))
    _, grouped = round_trip(CacheGenCodec(group=16), payload, spec)
    _, no_delta = round_trip(CacheGenCodec(group=1), payload, spec)  # every token its own anchor
    assert grouped < no_delta
    assert payload.nbytes / grouped > 2.0


def test_shallow_layers_get_finer_bins() -> None:
    payload, _, _ = smooth_kv(3)
    spec = ValueSpec("bfloat16", SHAPE)
    out, _ = round_trip(CacheGenCodec(bits=(8, 5, 2)), payload, spec)
    err = np.abs(f32(payload) - f32(out)).reshape(L, -1).max(axis=1)
    assert err[0] < err[1] < err[2]


@pytest.mark.parametrize("shape", [(6, 32, 16), (2, 3, 24, 8), (40, 8)])
def test_generic_shapes_round_trip(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal(int(np.prod(shape))).astype(np.float32)
    payload = bf16(x)
    spec = ValueSpec("bfloat16", shape)
    codec = CacheGenCodec()
    out, _ = round_trip(codec, payload, spec)
    xs = f32(payload)
    assert np.abs(xs - f32(out)).max() <= max_bound(xs, codec, spec)


def test_float16_and_float32_payloads() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(L * B * H * N * 2 * D).astype(np.float32)
    for dtype, data in (("float16", x.astype(np.float16).view(np.uint8)), ("float32", x.view(np.uint8))):
        spec = ValueSpec(dtype, SHAPE)
        out, _ = round_trip(CacheGenCodec(bits=(8, 8, 8)), data, spec)
        y = out.view(np.float16 if dtype == "float16" else np.float32).astype(np.float32)
        xs = data.view(np.float16 if dtype == "float16" else np.float32).astype(np.float32)
        assert np.abs(xs - y).max() < 0.05


def test_refuses_bad_input() -> None:
    codec = CacheGenCodec()
    payload, _, _ = smooth_kv(6)
    with pytest.raises(CodecError, match="shape"):
        codec.encode(memoryview(payload), ValueSpec("bfloat16", None))
    with pytest.raises(CodecError):
        codec.encode(memoryview(payload[:-2]), ValueSpec("bfloat16", SHAPE))
    bad = f32(payload).copy()
    bad[5] = np.inf
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode(memoryview(bf16(bad)), ValueSpec("bfloat16", SHAPE))
    with pytest.raises(CodecError):
        codec.encode(memoryview(payload), ValueSpec("uint8", (payload.nbytes // 8, 8)))
    for kwargs in ({"bits": (9, 5, 4)}, {"bits": (6, 5)}, {"group": 0}, {"k_layout": "diagonal"}):
        with pytest.raises(ValueError):
            CacheGenCodec(**kwargs)


def test_corrupt_or_foreign_bodies_raise_codec_error() -> None:
    codec = CacheGenCodec()
    payload, _, _ = smooth_kv(7)
    body = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in codec.encode(memoryview(payload), ValueSpec("bfloat16", SHAPE))))
    out = np.zeros_like(payload)
    with pytest.raises(CodecError):
        codec.decode_into(memoryview(bytes(body[:10])), memoryview(out))
    with pytest.raises(CodecError):  # wrong destination size
        codec.decode_into(memoryview(bytes(body)), memoryview(np.zeros(out.nbytes + 2, np.uint8)))
    truncated = bytes(body[:-5])
    with pytest.raises(CodecError):
        codec.decode_into(memoryview(truncated), memoryview(out))
    body[1] = 9  # unknown mode
    with pytest.raises(CodecError):
        codec.decode_into(memoryview(bytes(body)), memoryview(out))


def test_registered_and_carried_by_the_envelope() -> None:
    assert "cachegen" in CODECS and "cachegen" in DEFAULT_DECODERS
    codec = make_codec("cachegen", bits=(8, 6, 4))
    payload, _, _ = smooth_kv(8)
    key = b"k" * 32
    ev = encode_value(key, payload, codec, ValueSpec("bfloat16", SHAPE))
    blob = b"".join(bytes(memoryview(p).cast("B")) for p in ev.parts)
    assert ev.nbytes < 0.75 * payload.nbytes
    pos = 0

    def read_exact(dst: memoryview) -> None:
        nonlocal pos
        dst[:] = blob[pos : pos + len(dst)]
        pos += len(dst)

    out = np.zeros_like(payload)
    # A default-configured reader decodes whatever bit depths the writer chose.
    read_value_into(read_exact, len(blob), key, memoryview(out), DEFAULT_DECODERS, lambda n: memoryview(bytearray(n)))
    assert np.abs(f32(out) - f32(payload)).max() < 0.1
    pos = 0
    with pytest.raises(ValueMiss, match="no decoder"):  # a reader without the codec: a miss
        read_value_into(read_exact, len(blob), key, memoryview(out), {"raw": DEFAULT_DECODERS["raw"]}, lambda n: memoryview(bytearray(n)))


def test_agreement_metrics() -> None:
    a = agreement([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [8]])
    assert a.answers_identical == 1 and a.first_divergence == [None, 1, 0]
    assert a.exact_match_rate == pytest.approx(1 / 3)
    assert a.token_match_rate == pytest.approx(4 / 7)
    with pytest.raises(ValueError):
        agreement([[1]], [])
