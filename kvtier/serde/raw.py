"""The identity codec: the body is the payload (no copy on write or read)."""

from __future__ import annotations

from kvtier.serde.base import Buffer, Codec, CodecError, ValueSpec


class RawCodec(Codec):
    """Stores payload bytes unchanged; the default."""

    name = "raw"
    version = 1
    lossless = True
    identity = True

    def encode(self, payload: memoryview, spec: ValueSpec) -> list[Buffer]:
        return [payload]

    def decode_into(self, body: memoryview, out: memoryview) -> None:
        if len(body) != len(out):
            raise CodecError(f"raw body of {len(body)} B for a {len(out)} B payload")
        out[:] = body
