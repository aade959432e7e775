"""The chunk record format shared by the disk and shared-filesystem tiers (kvtier.serde.record)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvtier.serde.base import ValueSpec
from kvtier.serde.record import (
    ALIGN,
    FIXED,
    FORMAT_VERSION,
    HEADER_BYTES,
    BadChecksum,
    BadMagic,
    BadVersion,
    PayloadSizeMismatch,
    RecordError,
    RecordMismatch,
    Truncated,
    UnknownCodec,
    decode_header,
    encode_header,
    encode_payload_header,
    encode_record,
    read_record_into,
    record_relpath,
)
from kvtier.serde.registry import DEFAULT_DECODERS, make_codec

KEY, PARENT, NS = bytes(range(32)), bytes(range(1, 33)), b"N" * 32
PAYLOAD = np.arange(10_000, dtype=np.uint16).view(np.uint8)


def test_header_round_trip_and_alignment() -> None:
    h = encode_payload_header(KEY, NS, PAYLOAD, PARENT, stored_len=-(-PAYLOAD.nbytes // ALIGN) * ALIGN)
    assert len(h) == HEADER_BYTES  # the body starts page-aligned
    hdr = decode_header(h)
    assert (hdr.key, hdr.parent, hdr.namespace, hdr.codec) == (KEY, PARENT, NS, "raw")
    assert hdr.payload_len == hdr.body_len == PAYLOAD.nbytes and hdr.stored_len % ALIGN == 0
    assert decode_header(encode_payload_header(KEY, NS, PAYLOAD)).parent is None
    assert decode_header(h[:200], full=False) == hdr  # an index rebuild reads only the fields


@pytest.mark.parametrize(
    "mutate,error",
    [
        (lambda h: b"XXXXXXXX" + h[8:], BadMagic),
        (lambda h: h[:8] + struct.pack("<H", FORMAT_VERSION + 1) + h[10:], BadVersion),
        (lambda h: h[:20] + bytes([h[20] ^ 1]) + h[21:], BadChecksum),  # namespace bit
        (lambda h: h[:-1] + b"\x01", BadChecksum),  # padding
        (lambda h: h[:100], Truncated),
        (lambda h: h[: FIXED.size + 10], Truncated),
    ],
    ids=["magic", "version", "field", "padding", "short", "short-key"],
)
def test_bad_headers_raise_named_errors(mutate, error) -> None:  # type: ignore[no-untyped-def]
    h = encode_payload_header(KEY, NS, PAYLOAD, PARENT)
    with pytest.raises(error):
        decode_header(mutate(h))
    assert issubclass(error, RecordError)


def test_old_disk_format_is_recognised() -> None:
    with pytest.raises(BadMagic) as err:
        decode_header(b"KVTIER\x00\x01" + bytes(HEADER_BYTES - 8))
    assert err.value.old_format


def test_expect_checks_key_namespace_and_size() -> None:
    hdr = decode_header(encode_payload_header(KEY, NS, PAYLOAD))
    hdr.expect(KEY, NS, HEADER_BYTES + PAYLOAD.nbytes)
    with pytest.raises(RecordMismatch):
        hdr.expect(PARENT, NS)
    with pytest.raises(RecordMismatch):
        hdr.expect(KEY, b"M" * 32)
    with pytest.raises(Truncated):
        hdr.expect(KEY, NS, HEADER_BYTES + PAYLOAD.nbytes - 1)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        encode_header(key=b"", namespace=NS, parent=None, payload_len=1, body_len=1, body_sum=bytes(8))
    with pytest.raises(ValueError):
        encode_header(key=KEY, namespace=b"short", parent=None, payload_len=1, body_len=1, body_sum=bytes(8))
    with pytest.raises(ValueError):
        encode_header(key=KEY, namespace=NS, parent=None, payload_len=1, body_len=10, body_sum=bytes(8), stored_len=11)


def _reader(data: bytes):  # type: ignore[no-untyped-def]
    pos = [0]

    def readinto(view: memoryview) -> int:
        n = min(len(view), len(data) - pos[0])
        view[:n] = data[pos[0] : pos[0] + n]
        pos[0] += n
        return n

    return readinto


def _scratch(n: int) -> memoryview:
    return memoryview(bytearray(n))


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
def test_whole_record_round_trip(codec: str) -> None:
    parts, n = encode_record(KEY, NS, PARENT, memoryview(PAYLOAD), make_codec(codec), ValueSpec("float16"))
    data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert len(data) == n
    out = np.zeros_like(PAYLOAD)
    hdr = read_record_into(_reader(data), n, KEY, NS, memoryview(out), DEFAULT_DECODERS, _scratch)
    assert np.array_equal(out, PAYLOAD) and hdr.parent == PARENT and hdr.codec == codec
    with pytest.raises(PayloadSizeMismatch):
        read_record_into(_reader(data), n, KEY, NS, memoryview(out[:-2]), DEFAULT_DECODERS, _scratch)
    with pytest.raises(UnknownCodec):
        read_record_into(_reader(data), n, KEY, NS, memoryview(out), {}, _scratch)
    flipped = data[:-5] + bytes([data[-5] ^ 4]) + data[-4:]
    with pytest.raises(BadChecksum):
        read_record_into(_reader(flipped), n, KEY, NS, memoryview(out), DEFAULT_DECODERS, _scratch)
    with pytest.raises(Truncated):
        read_record_into(_reader(data[:-1]), n - 1, KEY, NS, memoryview(out), DEFAULT_DECODERS, _scratch)


def test_long_keys_get_a_digest_file_name() -> None:
    assert record_relpath(KEY) == f"{KEY.hex()[:2]}/{KEY.hex()}.kvc"
    name = record_relpath(bytes(200))
    assert len(name.split("/")[1]) < 255 and name.startswith("x")
