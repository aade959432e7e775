"""Codecs and the envelope: round trips, error bounds, and corruption always being a miss."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.serde import (
    DEFAULT_DECODERS,
    CodecError,
    ValueMiss,
    ValueSpec,
    encode_value,
    make_codec,
    read_value_into,
)
from kvtier.serde.envelope import FIXED
from kvtier.serde.int8 import Int8Codec
from kvtier.testing import bf16_payload

KEY = bytes(range(32))


def _blob(ev) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in ev.parts)


def _decode(blob: bytes, out: np.ndarray, key: bytes = KEY, decoders=DEFAULT_DECODERS) -> None:
    pos = 0

    def read_exact(view: memoryview) -> None:
        nonlocal pos
        view[:] = blob[pos : pos + view.nbytes]
        pos += view.nbytes

    read_value_into(read_exact, len(blob), key, memoryview(out), decoders, lambda n: memoryview(bytearray(n)))


def _f32(bf16: np.ndarray) -> np.ndarray:
    return (bf16.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def test_raw_envelope_references_the_payload_without_copying():
    payload = bf16_payload(1 << 16, 0)
    ev = encode_value(KEY, payload, make_codec("raw"), ValueSpec())
    assert len(ev.parts) == 2 and np.shares_memory(np.frombuffer(ev.parts[1], np.uint8), payload)
    out = np.zeros_like(payload)
    _decode(_blob(ev), out)
    assert np.array_equal(out, payload)


def test_shuffle_zstd_is_exact_and_compresses_bf16():
    payload = bf16_payload(1 << 18, 1)
    ev = encode_value(KEY, payload, make_codec("shuffle-zstd"), ValueSpec())
    assert ev.nbytes < 0.85 * payload.nbytes  # exponent bytes of bf16 compress once grouped
    out = np.zeros_like(payload)
    _decode(_blob(ev), out)
    assert np.array_equal(out, payload)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=2, max_size=4096).filter(lambda b: len(b) % 2 == 0), codec=st.sampled_from(["raw", "shuffle-zstd"]))
def test_lossless_codecs_round_trip_any_bytes(data: bytes, codec: str):
    ev = encode_value(KEY, data, make_codec(codec), ValueSpec())
    out = np.zeros(len(data), np.uint8)
    _decode(_blob(ev), out)
    assert out.tobytes() == data


@pytest.mark.parametrize("mode", ["token", "channel"])
def test_int8_error_is_within_half_a_step_of_each_group(mode: str):
    t, c = 256, 64
    payload = bf16_payload(2 * 4 * t * c, 2)
    spec = ValueSpec("bfloat16", (4, t, c))
    ev = encode_value(KEY, payload, Int8Codec(mode), spec)
    assert ev.nbytes < 0.55 * payload.nbytes
    out = np.zeros_like(payload)
    _decode(_blob(ev), out)
    x = _f32(payload).reshape(4, t, c)
    y = _f32(out).reshape(4, t, c)
    axis = 2 if mode == "token" else 1
    step = np.abs(x).max(axis=axis, keepdims=True) / 127
    # half a quantization step plus bf16 rounding of the result (2**-8 relative)
    assert (np.abs(x - y) <= step / 2 + np.abs(x) * 2**-8 + 1e-12).all()


def test_int8_channel_scales_protect_normal_channels_from_an_outlier_channel():
    # KIVI's observation for keys: a few channels carry large magnitudes.
    t, c = 128, 64
    rng = np.random.default_rng(3)
    x = rng.standard_normal((t, c), dtype=np.float32)
    x[:, 5] *= 100.0
    payload = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    spec = ValueSpec("bfloat16", (t, c))
    errs = {}
    for mode in ("token", "channel"):
        out = np.zeros_like(payload)
        _decode(_blob(encode_value(KEY, payload, Int8Codec(mode), spec)), out)
        diff = np.abs(_f32(payload) - _f32(out)).reshape(t, c)
        errs[mode] = np.delete(diff, 5, axis=1).mean()
    assert errs["channel"] < errs["token"] / 10


def test_int8_refuses_bad_input_with_clear_errors():
    codec = Int8Codec()
    good = bf16_payload(2 * 16 * 8, 4)
    with pytest.raises(CodecError, match="shape hint"):
        encode_value(KEY, good, codec, ValueSpec("bfloat16"))
    with pytest.raises(CodecError, match="does not match shape"):
        encode_value(KEY, good, codec, ValueSpec("bfloat16", (16, 9)))
    inf = good.copy()
    inf.view(np.uint16)[3] = 0x7F80  # bf16 +inf
    with pytest.raises(CodecError, match="non-finite"):
        encode_value(KEY, inf, codec, ValueSpec("bfloat16", (16, 8)))
    with pytest.raises(ValueError):
        Int8Codec("per-galaxy")


def test_value_spec_and_codec_names_are_validated():
    with pytest.raises(ValueError, match="unknown dtype"):
        ValueSpec("bfloat17")
    with pytest.raises(ValueError):
        ValueSpec("bfloat16", (4, 0))
    with pytest.raises(ValueError, match="raw"):
        make_codec("lzma")
    with pytest.raises(ValueError):
        make_codec("shuffle-zstd", level=99)


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
def test_every_header_byte_is_protected(codec: str):
    payload = bf16_payload(4096, 5)
    blob = _blob(encode_value(KEY, payload, make_codec(codec), ValueSpec()))
    header_len = FIXED.size + 32 + 8
    for i in range(header_len):
        bad = bytearray(blob)
        bad[i] ^= 0x10
        with pytest.raises(ValueMiss):
            _decode(bytes(bad), np.zeros_like(payload))


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd", "int8"])
def test_body_corruption_and_truncation_are_misses(codec: str):
    payload = bf16_payload(2 * 64 * 64, 6)
    spec = ValueSpec("bfloat16", (64, 64))
    blob = _blob(encode_value(KEY, payload, make_codec(codec), spec))
    rng = np.random.default_rng(0)
    for i in rng.integers(FIXED.size + 40, len(blob), 20):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(ValueMiss, match="checksum"):
            _decode(bytes(bad), np.zeros_like(payload))
    with pytest.raises(ValueMiss):
        _decode(blob[:-1], np.zeros_like(payload))


def test_wrong_key_wrong_size_and_unknown_codec_are_misses():
    payload = bf16_payload(1024, 7)
    blob = _blob(encode_value(KEY, payload, make_codec("shuffle-zstd"), ValueSpec()))
    with pytest.raises(ValueMiss, match="another key"):
        _decode(blob, np.zeros_like(payload), key=bytes(32))
    with pytest.raises(ValueMiss, match="expected"):
        _decode(blob, np.zeros(1022, np.uint8))
    no_zstd = {k: v for k, v in DEFAULT_DECODERS.items() if k != "shuffle-zstd"}
    with pytest.raises(ValueMiss, match="no decoder"):
        _decode(blob, np.zeros_like(payload), decoders=no_zstd)

    class NewerZstd(type(DEFAULT_DECODERS["shuffle-zstd"])):
        version = 2

    with pytest.raises(ValueMiss, match="version 1"):
        _decode(blob, np.zeros_like(payload), decoders={"shuffle-zstd": NewerZstd()})
