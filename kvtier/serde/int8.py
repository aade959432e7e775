"""Lossy codec: symmetric int8 quantization with per-token or per-channel scales.

Each value ``x`` becomes ``q = round(x / s)`` in ``[-127, 127]`` with
``s = max|x| / 127`` over its group, and decodes to ``q * s`` rounded back to the
payload dtype. The payload is viewed as ``[G, T, C]`` using the last two axes of
the shape hint as tokens ``T`` and channels ``C``:

- ``mode="token"``: one scale per (group, token) over its ``C`` channels;
- ``mode="channel"``: one scale per (group, channel) over the ``T`` tokens.

KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache", ICML 2024) observed that keys have outlier channels (favouring
per-channel scales) while values suit per-token scales; this codec offers both
granularities at 8 bits, symmetric, with float32 scales. It roughly halves bf16
payloads. A CacheGen-style codec (Liu et al., "CacheGen: KV Cache Compression
and Streaming for Fast Large Language Model Serving", SIGCOMM 2024: delta
encoding across tokens, layer-wise quantization, arithmetic coding) can be added
as another codec later.

Body layout (little-endian): ``mode u8, dtype u8, G u32, T u32, C u32``, then the
scales (float32, ``G*T`` or ``G*C``), then ``G*T*C`` int8 values.
"""

from __future__ import annotations

import struct

import numpy as np

from kvtier.serde.base import Buffer, Codec, CodecError, ValueSpec

_META = struct.Struct("<BBIII")
_MODES = {"token": 0, "channel": 1}
_DTYPES = {"bfloat16": 0, "float16": 1, "float32": 2}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def _to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """uint8 bytes of ``dtype`` elements -> float32 values."""
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    return raw.view(np.float32)


def _from_f32(x: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Write float32 ``x`` into ``out`` (uint8 bytes) as ``dtype``, rounding to nearest even."""
    if dtype == "bfloat16":
        u = x.view(np.uint32)
        rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        out.view(np.uint16)[:] = rounded.astype(np.uint16).reshape(-1)
    elif dtype == "float16":
        out.view(np.float16)[:] = x.astype(np.float16).reshape(-1)
    else:
        out.view(np.float32)[:] = x.reshape(-1)


class Int8Codec(Codec):
    """Symmetric int8 quantization of float KV payloads (lossy).

    Args:
        mode: ``"token"`` or ``"channel"`` scale granularity (see module doc).

    Raises:
        ValueError: unknown mode.
    """

    name = "int8"
    version = 1
    lossless = False

    def __init__(self, mode: str = "token"):
        if mode not in _MODES:
            raise ValueError(f"int8 mode must be one of {sorted(_MODES)}, got {mode!r}")
        self.mode = mode

    def encode(self, payload: memoryview, spec: ValueSpec) -> list[Buffer]:
        if spec.dtype not in _DTYPES:
            raise CodecError(f"int8 codec quantizes {sorted(_DTYPES)}, not {spec.dtype}")
        if spec.shape is None or len(spec.shape) < 2:
            raise CodecError("int8 codec needs a shape hint with at least (tokens, channels)")
        spec.check(len(payload))
        t, c = spec.shape[-2], spec.shape[-1]
        g = int(np.prod(spec.shape[:-2], dtype=np.int64)) if len(spec.shape) > 2 else 1
        x = _to_f32(np.frombuffer(payload, dtype=np.uint8), spec.dtype).reshape(g, t, c)
        axis = 2 if self.mode == "token" else 1
        amax = np.abs(x).max(axis=axis, keepdims=True)
        if not np.isfinite(amax).all():
            raise CodecError("int8 codec cannot quantize non-finite (inf/nan) values")
        scale = (amax / np.float32(127.0)).astype(np.float32)
        scale[scale == 0] = 1.0
        q = np.rint(x / scale).clip(-127, 127).astype(np.int8)
        meta = _META.pack(_MODES[self.mode], _DTYPES[spec.dtype], g, t, c)
        return [meta, scale.tobytes(), q.reshape(-1)]

    def decode_into(self, body: memoryview, out: memoryview) -> None:
        if len(body) < _META.size:
            raise CodecError("int8 body too short")
        mode, dt, g, t, c = _META.unpack_from(body)
        if mode not in (0, 1) or dt not in _DTYPE_NAMES:
            raise CodecError(f"int8 body has unknown mode {mode} or dtype {dt}")
        dtype = _DTYPE_NAMES[dt]
        n = g * t * c
        nscales = g * t if mode == 0 else g * c
        if len(body) != _META.size + 4 * nscales + n:
            raise CodecError("int8 body size does not match its header")
        itemsize = 4 if dtype == "float32" else 2
        if n * itemsize != len(out):
            raise CodecError(f"int8 body decodes to {n * itemsize} B, expected {len(out)} B")
        off = _META.size
        scale = np.frombuffer(body, dtype=np.float32, count=nscales, offset=off)
        scale = scale.reshape(g, t, 1) if mode == 0 else scale.reshape(g, 1, c)
        q = np.frombuffer(body, dtype=np.int8, count=n, offset=off + 4 * nscales).reshape(g, t, c)
        _from_f32(q.astype(np.float32) * scale, dtype, np.frombuffer(out, dtype=np.uint8))
