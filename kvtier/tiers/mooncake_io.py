"""What one Mooncake value holds and how a batch is laid out for the zero-copy calls.

A value is one chunk record (:mod:`kvtier.serde.record`): its 4096-byte header
(key, parent, namespace digest, codec, lengths, xxh3-64 of the body and of the
header) followed by the body. With the raw codec the body is the payload itself,
so a put hands Mooncake two buffers per chunk -- the header and the caller's
payload (a CPU tier slot) -- with ``batch_put_from_multi_buffers``, and a get
receives straight into the same two (``batch_get_into_multi_buffers``): the
payload moves between the CPU slot and the store with no copy in kvtier. Other
codecs hand over their encoded parts (again no copy) and are read whole into a
scratch buffer and decoded.

Every get verifies the record before the caller sees a hit: header checksum,
key, namespace, lengths against the value's size, codec, and the body checksum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from kvtier.serde.base import Codec, CodecError, ValueSpec
from kvtier.serde.envelope import as_bytes_view
from kvtier.serde.record import (
    HEADER_BYTES,
    BadChecksum,
    PayloadSizeMismatch,
    RecordError,
    Truncated,
    UnknownCodec,
    checksum,
    decode_header,
    encode_payload_header,
    encode_record,
    read_record_into,
)
from kvtier.tiers.base import ChunkWrite

__all__ = ["PutBatch", "ReadPlan", "address", "encode_puts", "plan_reads", "verify_direct", "verify_whole"]


def address(buf: Any) -> int:
    """The address of a C-contiguous buffer's first byte (read-only buffers too)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data) if arr.size else 0


@dataclass
class PutBatch:
    """The buffers of one batched put: per chunk, addresses and sizes of its parts in order.

    ``keep`` holds every buffer (headers, encoded bodies) until Mooncake has read them:
    a call that outlives its deadline still reads them on its worker thread.
    """

    ptrs: list[list[int]] = field(default_factory=list)
    sizes: list[list[int]] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)


def encode_puts(items: Sequence[ChunkWrite], namespace: bytes, codec: Codec, spec: ValueSpec) -> tuple[PutBatch, list[int]]:
    """Records of ``items`` laid out for ``batch_put_from_multi_buffers``.

    Returns the batch and the indices (into ``items``) it carries; a chunk the codec
    refuses (e.g. a lossy codec and non-finite values) is left out.

    Raises:
        ValueError: a payload that is not C-contiguous.
    """
    batch = PutBatch()
    carried: list[int] = []
    for i, w in enumerate(items):
        payload = as_bytes_view(w.payload)
        if codec.identity:
            header = encode_payload_header(w.key, namespace, payload, w.parent)
            parts: list[Any] = [header, payload]
        else:
            try:
                parts, _ = encode_record(w.key, namespace, w.parent, payload, codec, spec)
            except CodecError:
                continue
        views = [as_bytes_view(p) for p in parts]
        views = [v for v in views if v.nbytes]
        batch.ptrs.append([address(v) for v in views])
        batch.sizes.append([v.nbytes for v in views])
        batch.nbytes.append(sum(v.nbytes for v in views))
        batch.keep.append(parts)
        carried.append(i)
    return batch, carried


@dataclass
class ReadPlan:
    """How each present chunk of a get is read.

    ``direct``: indices whose value is exactly a header plus ``len(out)`` bytes: read
    into a header buffer and the caller's ``out`` (zero-copy). ``whole``: indices read
    whole into a scratch buffer of the value's size (other codecs, other payload sizes).
    ``too_big``: indices whose value exceeds the read bound (a miss without a transfer).
    ``tiny``: indices whose value is shorter than a record header (corrupt, not read).
    """

    direct: list[int] = field(default_factory=list)
    whole: list[int] = field(default_factory=list)
    too_big: list[int] = field(default_factory=list)
    tiny: list[int] = field(default_factory=list)
    headers: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    scratch: dict[int, np.ndarray] = field(default_factory=dict)


def plan_reads(sizes: Sequence[int], outs: Sequence[memoryview], max_value_bytes: int) -> ReadPlan:
    """Sort the chunks of a get by their stored ``sizes`` (0: absent) against their destinations."""
    plan = ReadPlan()
    for i, (n, out) in enumerate(zip(sizes, outs)):
        if n <= 0:
            continue
        if n == HEADER_BYTES + len(out):
            plan.direct.append(i)
        elif n < HEADER_BYTES:
            plan.tiny.append(i)
        elif n > max_value_bytes:
            plan.too_big.append(i)
        else:
            plan.whole.append(i)
    plan.headers = np.empty(len(plan.direct) * HEADER_BYTES, np.uint8)
    plan.scratch = {i: np.empty(sizes[i], np.uint8) for i in plan.whole}
    return plan


def verify_direct(header: memoryview, out: memoryview, key: bytes, namespace: bytes,
                  decoders: Mapping[str, Codec]) -> None:
    """Check a record received as ``header`` + body in ``out`` (the payload's size).

    Raises:
        RecordError: the record is unusable (:class:`~kvtier.serde.record.KeepRecord`
            subclasses: sound but not for this reader).
    """
    hdr = decode_header(header)
    hdr.expect(key, namespace, HEADER_BYTES + len(out))
    if hdr.payload_len != len(out):
        raise PayloadSizeMismatch(f"payload is {hdr.payload_len} B, expected {len(out)} B")
    codec = decoders.get(hdr.codec)
    if codec is None or codec.version != hdr.codec_version:
        raise UnknownCodec(f"no decoder for codec {hdr.codec!r} version {hdr.codec_version}")
    if checksum(out) != hdr.body_sum:
        raise BadChecksum("body checksum mismatch")
    if not codec.identity:  # a body as long as its payload, but encoded: decode from a copy
        body = bytes(out)
        try:
            codec.decode_into(memoryview(body), out)
        except CodecError as exc:
            raise BadChecksum(f"codec {hdr.codec!r} cannot decode the body: {exc}") from None


def verify_whole(value: np.ndarray, out: memoryview, key: bytes, namespace: bytes,
                 decoders: Mapping[str, Codec]) -> None:
    """Check a whole record read into ``value`` and decode its payload into ``out``.

    Raises:
        RecordError: as :func:`verify_direct`.
    """
    src = memoryview(value.data).cast("B")
    pos = [0]

    def readinto(view: memoryview) -> int:
        n = min(len(view), len(src) - pos[0])
        view[:n] = src[pos[0] : pos[0] + n]
        pos[0] += n
        return n

    def scratch(n: int) -> memoryview:
        return memoryview(bytearray(n))

    if len(src) < HEADER_BYTES:
        raise Truncated("value shorter than a record header")
    read_record_into(readinto, len(src), key, namespace, out, decoders, scratch)


__all__ += ["RecordError"]
