"""The self-describing envelope every remote value is stored in.

Layout (little-endian), ``header_len`` bytes of header then ``body_len`` bytes of body::

    magic         4s   b"KVRV"
    format        B    FORMAT_VERSION
    key_len       B    bytes of the chunk key
    header_len    H    FIXED.size + key_len + 8
    codec         16s  codec name, NUL padded
    codec_version H
    flags         H    0 (reserved)
    payload_len   Q    decoded payload bytes
    body_len      Q    stored body bytes
    body_sum      8s   xxh3-64 of the body
    key           key_len bytes
    header_sum    8s   xxh3-64 of every header byte before it

Invariant: a value is handed to a caller only if magic, format, both checksums,
the key, the payload size and a known codec+version all match; anything else
(corrupt, truncated, foreign, written by a newer kvtier) is a miss with a reason.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Mapping

import xxhash

from kvtier.serde.base import Buffer, Codec, CodecError, ValueSpec, byte_view

MAGIC = b"KVRV"
FORMAT_VERSION = 1
FIXED = struct.Struct("<4sBBH16sHHQQ8s")
_SUM = 8


class ValueMiss(Exception):
    """A stored value cannot be used; ``reason`` says why, ``consumed`` how many bytes were read."""

    def __init__(self, reason: str, consumed: int):
        super().__init__(reason)
        self.reason = reason
        self.consumed = consumed


@dataclass(frozen=True)
class EncodedValue:
    """A value ready to store: ``parts`` written back to back are ``nbytes`` long."""

    parts: list[Buffer]
    nbytes: int
    payload_len: int


def as_bytes_view(buf: Buffer) -> memoryview:
    """A flat uint8 view of ``buf`` (no copy).

    Raises:
        ValueError: ``buf`` is not C-contiguous.
    """
    mv = byte_view(buf)
    if not mv.c_contiguous:
        raise ValueError("chunk buffers must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def encode_value(key: bytes, payload: Buffer, codec: Codec, spec: ValueSpec) -> EncodedValue:
    """Wrap ``payload`` encoded by ``codec`` in an envelope for ``key``.

    The raw codec copies nothing: the payload buffer itself is one of the parts,
    so it must stay unchanged until the parts are written.

    Raises:
        CodecError: the codec refuses the payload (e.g. shape mismatch, non-finite values).
        ValueError: key longer than 255 bytes or payload not contiguous.
    """
    if not 0 < len(key) <= 255:
        raise ValueError(f"keys must be 1..255 bytes, got {len(key)}")
    data = as_bytes_view(payload)
    body = codec.encode(data, spec)
    h = xxhash.xxh3_64()
    body_len = 0
    for part in body:
        h.update(part)  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer on 3.12+ only
        body_len += byte_view(part).nbytes
    header_len = FIXED.size + len(key) + _SUM
    name = codec.name.encode("ascii")
    if len(name) > 16:
        raise ValueError(f"codec name {codec.name!r} longer than 16 bytes")
    head = FIXED.pack(
        MAGIC, FORMAT_VERSION, len(key), header_len, name.ljust(16, b"\x00"),
        codec.version, 0, len(data), body_len, h.digest(),
    ) + key
    head += xxhash.xxh3_64_digest(head)
    return EncodedValue([head, *body], header_len + body_len, len(data))


def read_value_into(
    read_exact: Callable[[memoryview], None],
    value_len: int,
    key: bytes,
    out: memoryview,
    decoders: Mapping[str, Codec],
    scratch: Callable[[int], memoryview],
) -> None:
    """Read one enveloped value of ``value_len`` bytes and decode it into ``out``.

    Args:
        read_exact: fills the given view completely from the value's bytes, in order
            (raises on I/O errors, which propagate).
        value_len: total stored bytes of the value.
        key: the key the caller asked for; a value carrying another key is a miss.
        out: writable uint8 view; its length must equal the stored payload length.
        decoders: codec name -> decoder.
        scratch: returns a writable view of at least n bytes for non-identity bodies.

    Raises:
        ValueMiss: the value is unusable (``consumed`` tells a stream reader how much
            of the value it has already read; it must skip the rest). ``out`` may
            have been written.
    """
    if value_len < FIXED.size + _SUM:
        raise ValueMiss("value shorter than an envelope header", 0)
    fixed = bytearray(FIXED.size)
    read_exact(memoryview(fixed))
    consumed = FIXED.size
    magic, fmt, key_len, header_len, name, cver, _flags, payload_len, body_len, body_sum = FIXED.unpack(fixed)
    if magic != MAGIC:
        raise ValueMiss("not a kvtier value (bad magic)", consumed)
    if fmt != FORMAT_VERSION:
        raise ValueMiss(f"unsupported envelope format {fmt}", consumed)
    if header_len != FIXED.size + key_len + _SUM or header_len + body_len != value_len:
        raise ValueMiss("envelope lengths are inconsistent (truncated or corrupt)", consumed)
    rest = bytearray(key_len + _SUM)
    read_exact(memoryview(rest))
    consumed += len(rest)
    if xxhash.xxh3_64_digest(bytes(fixed) + rest[:key_len]) != rest[key_len:]:
        raise ValueMiss("header checksum mismatch", consumed)
    if rest[:key_len] != key:
        raise ValueMiss("value belongs to another key", consumed)
    if payload_len != len(out):
        raise ValueMiss(f"payload is {payload_len} B, expected {len(out)} B", consumed)
    codec_name = name.rstrip(b"\x00").decode("ascii", "replace")
    codec = decoders.get(codec_name)
    if codec is None or codec.version != cver:
        raise ValueMiss(f"no decoder for codec {codec_name!r} version {cver}", consumed)
    if codec.identity:
        if body_len != payload_len:
            raise ValueMiss("identity body size differs from payload size", consumed)
        read_exact(out)
        consumed += body_len
        if xxhash.xxh3_64_digest(out) != body_sum:
            raise ValueMiss("body checksum mismatch", consumed)
        return
    body = scratch(body_len)[:body_len]
    read_exact(body)
    consumed += body_len
    if xxhash.xxh3_64_digest(body) != body_sum:
        raise ValueMiss("body checksum mismatch", consumed)
    try:
        codec.decode_into(body, out)
    except CodecError as exc:
        raise ValueMiss(f"codec {codec_name!r} cannot decode the body: {exc}", consumed) from None
