"""Lossless codec: byte shuffle followed by Zstandard.

Floating-point KV values compress poorly as interleaved bytes; grouping byte
``j`` of every element together (the "byte shuffle" of Blosc/HDF5 filters) puts
the slowly varying sign/exponent bytes of bf16 next to each other, where a
general-purpose compressor finds redundancy. Zstandard (RFC 8878) through the
maintained ``zstandard`` bindings does the entropy coding.

Body layout: ``itemsize`` (1 byte) then one zstd frame (with content size) of
the shuffled bytes.
"""

from __future__ import annotations

import numpy as np
import zstandard

from kvtier.serde.base import Buffer, Codec, CodecError, ValueSpec


class ShuffleZstdCodec(Codec):
    """Byte shuffle by element size, then zstd at ``level`` (1 = fastest; 3 = zstd default).

    Raises:
        ValueError: ``level`` outside zstd's range.
    """

    name = "shuffle-zstd"
    version = 1
    lossless = True

    def __init__(self, level: int = 1):
        if not -7 <= level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {level}")
        self.level = level

    def encode(self, payload: memoryview, spec: ValueSpec) -> list[Buffer]:
        spec.check(len(payload))
        k = spec.itemsize
        data = np.frombuffer(payload, dtype=np.uint8)
        shuffled = data.reshape(-1, k).T.copy() if k > 1 else data
        # ZstdCompressor objects are not safe to share between threads: one per call.
        # zstandard's stubs name ByteString; its C function takes any buffer (as here, an ndarray).
        frame = zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(shuffled)  # type: ignore[arg-type]
        return [bytes([k]), frame]

    def decode_into(self, body: memoryview, out: memoryview) -> None:
        if len(body) < 2:
            raise CodecError("shuffle-zstd body too short")
        k = body[0]
        frame = body[1:]
        try:
            size = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as exc:
            raise CodecError(f"bad zstd frame: {exc}") from None
        if size != len(out) or k == 0 or len(out) % k:
            raise CodecError(f"zstd frame holds {size} B, expected {len(out)} B of {k}-byte elements")
        try:
            plain = zstandard.ZstdDecompressor().decompress(frame)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd decompression failed: {exc}") from None
        if len(plain) != len(out):
            raise CodecError("zstd frame decompressed to the wrong size")
        dst = np.frombuffer(out, dtype=np.uint8)
        src = np.frombuffer(plain, dtype=np.uint8)
        if k == 1:
            dst[:] = src
        else:
            dst.reshape(-1, k)[:] = src.reshape(k, -1).T
