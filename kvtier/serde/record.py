"""The chunk record: the one self-describing file format of the disk and shared-filesystem tiers.

A record is ``HEADER_BYTES`` (4096) of header, then the stored body. The header
is padded with zeros to 4096 B so the body starts page-aligned (O_DIRECT reads
and writes of the body need no staging).

Header layout (little-endian)::

    magic          8s   MAGIC (b"KVTIERC\\x00"; the old disk format used b"KVTIER\\x00\\x01")
    version        H    FORMAT_VERSION
    header_len     H    HEADER_BYTES
    flags          H    0 (reserved)
    key_len        B    bytes of the chunk key (1..255)
    parent_len     B    bytes of the parent key (0: the chunk is a prompt's first)
    namespace      32s  KeyNamespace digest (model, layout, chunk size, rank)
    codec          16s  codec name of the body, NUL padded ("raw": the body is the payload)
    codec_version  H    that codec's version
    payload_len    Q    decoded payload bytes
    body_len       Q    body bytes (encoded; == payload_len for "raw")
    stored_len     Q    body bytes in the file: ``body_len``, or rounded up to ``ALIGN``
                        with zeros when written with O_DIRECT
    body_sum       8s   xxh3-64 of the body (``body_len`` bytes, not the padding)
    created        d    unix time (seconds) of the write
    key            key_len bytes
    parent         parent_len bytes
    header_sum     8s   xxh3-64 of every header byte before it
    (zero padding to HEADER_BYTES)

:func:`encode_record` and :func:`read_record_into` write and read whole records
with any codec (the shared-filesystem tier); the disk tier writes ``raw``
records itself (O_DIRECT, no copy) with :func:`encode_payload_header`.

Invariant: a record is used only if magic, version, header length, header
checksum, zero padding, key, namespace, file size (``HEADER_BYTES + stored_len``)
and body checksum all match; each failure raises a :class:`RecordError` subclass
that names it. Nothing here does I/O except through the callables it is given.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import blake3
import xxhash

from kvtier.serde.base import Buffer, Codec, CodecError, ValueSpec, byte_view

MAGIC = b"KVTIERC\x00"
#: Magic of the disk tier's previous format (files found at start are dropped).
OLD_DISK_MAGIC = b"KVTIER\x00\x01"
FORMAT_VERSION = 3
HEADER_BYTES = 4096
#: Alignment of O_DIRECT buffers, lengths and offsets (covers 512 B and 4 KiB devices).
ALIGN = 4096
FIXED = struct.Struct("<8sHHHBB32s16sHQQQ8sd")
_SUM = 8
#: Longest header before its padding (255-byte key and parent): a reader that only
#: needs the fields (e.g. an index rebuild) reads this many bytes.
MAX_FIELDS_BYTES = FIXED.size + 255 + 255 + _SUM
NAMESPACE_BYTES = 32
#: File name suffix of a record.
SUFFIX = ".kvc"
_ZERO_PAD = bytes(HEADER_BYTES)


class RecordError(ValueError):
    """A record cannot be used; ``str(exc)`` says why."""


class BadMagic(RecordError):
    """Not a chunk record (another file, or the old disk format: see ``old_format``)."""

    def __init__(self, reason: str, old_format: bool = False):
        super().__init__(reason)
        self.old_format = old_format


class BadVersion(RecordError):
    """A record of another format version or header length."""


class BadChecksum(RecordError):
    """Header or body checksum mismatch, or non-zero header padding (corruption)."""


class Truncated(RecordError):
    """Fewer bytes than the header says (or an extended file)."""


class RecordMismatch(RecordError):
    """A sound record that is not the one asked for: another key or namespace."""


class KeepRecord(RecordError):
    """A sound record of this key that this reader cannot use (another reader may): keep the file."""


class PayloadSizeMismatch(KeepRecord):
    """The record's payload has another size than the caller's buffer."""


class UnknownCodec(KeepRecord):
    """The record's codec (or its version) is not among the reader's decoders."""


@dataclass(frozen=True)
class RecordHeader:
    """The decoded header fields of one record (lengths in bytes, ``created`` in unix seconds)."""

    key: bytes
    parent: bytes | None
    namespace: bytes
    codec: str
    codec_version: int
    payload_len: int
    body_len: int
    stored_len: int
    body_sum: bytes
    created: float

    @property
    def file_bytes(self) -> int:
        """Bytes of the whole record file (header, body and alignment padding)."""
        return HEADER_BYTES + self.stored_len

    def expect(self, key: bytes, namespace: bytes, file_size: int | None = None) -> None:
        """Check this record is ``key``'s in ``namespace`` and (if given) ``file_size`` long.

        Raises:
            RecordMismatch: another key or namespace.
            Truncated: the file size differs from ``file_bytes``.
        """
        if self.key != key:
            raise RecordMismatch("record belongs to another key")
        if self.namespace != namespace:
            raise RecordMismatch("namespace (model/layout) mismatch")
        if file_size is not None and file_size != self.file_bytes:
            raise Truncated(f"file size {file_size} != {self.file_bytes} (truncated or extended)")


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def checksum(data: Buffer) -> bytes:
    """xxh3-64 digest (8 bytes) of ``data``."""
    return xxhash.xxh3_64_digest(data)  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer on 3.12+ only


def encode_header(
    *,
    key: bytes,
    namespace: bytes,
    parent: bytes | None,
    payload_len: int,
    body_len: int,
    body_sum: bytes,
    codec: str = "raw",
    codec_version: int = 1,
    stored_len: int | None = None,
    created: float | None = None,
) -> bytes:
    """The ``HEADER_BYTES`` header of a record.

    Args:
        key: chunk key (1..255 bytes). parent: the previous chunk's key or None.
        namespace: 32-byte namespace digest.
        payload_len / body_len: decoded and stored body bytes; body_sum: xxh3-64 of the body.
        codec / codec_version: how the body decodes (name at most 16 ASCII bytes).
        stored_len: body bytes in the file including O_DIRECT padding (default ``body_len``).
        created: unix seconds (default now).

    Raises:
        ValueError: key, parent, namespace or codec name of a bad length, or a
            ``stored_len`` that does not fit ``body_len``.
    """
    if not 0 < len(key) <= 255:
        raise ValueError(f"chunk keys must be 1..255 bytes, got {len(key)}")
    if parent is not None and not 0 < len(parent) <= 255:
        raise ValueError(f"parent keys must be 1..255 bytes, got {len(parent)}")
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace digests are {NAMESPACE_BYTES} bytes, got {len(namespace)}")
    name = codec.encode("ascii")
    if len(name) > 16:
        raise ValueError(f"codec name {codec!r} longer than 16 bytes")
    stored = body_len if stored_len is None else stored_len
    if stored not in (body_len, align_up(body_len)):
        raise ValueError(f"stored length {stored} does not fit body length {body_len}")
    par = parent or b""
    head = (
        FIXED.pack(
            MAGIC, FORMAT_VERSION, HEADER_BYTES, 0, len(key), len(par), namespace,
            name.ljust(16, b"\x00"), codec_version, payload_len, body_len, stored, body_sum,
            time.time() if created is None else created,
        )
        + key
        + par
    )
    head += checksum(head)
    return head.ljust(HEADER_BYTES, b"\x00")


def encode_payload_header(
    key: bytes, namespace: bytes, payload: Buffer, parent: bytes | None = None, stored_len: int | None = None
) -> bytes:
    """The header of a ``raw`` record whose body is ``payload`` (checksummed here)."""
    n = byte_view(payload).nbytes
    return encode_header(
        key=key, namespace=namespace, parent=parent, payload_len=n, body_len=n,
        body_sum=checksum(payload), stored_len=stored_len,
    )


def decode_header(buf: Buffer, *, full: bool = True) -> RecordHeader:
    """Decode and verify a header.

    Args:
        buf: the file's first bytes: ``HEADER_BYTES`` of them (``full``), or at least
            the fields (``full=False``: an index rebuild reading :data:`MAX_FIELDS_BYTES`;
            the zero padding is then not checked).

    Raises:
        Truncated: fewer bytes than the header needs.
        BadMagic: not a record (``old_format`` set for the previous disk format).
        BadVersion: another format version or header length.
        BadChecksum: header checksum mismatch or non-zero padding.
    """
    mv = byte_view(buf).cast("B")
    if len(mv) < FIXED.size:
        raise Truncated("truncated header")
    magic = bytes(mv[:8])
    if magic != MAGIC:
        old = magic == OLD_DISK_MAGIC
        raise BadMagic("old disk record format" if old else "bad magic", old_format=old)
    (_, version, header_len, _flags, key_len, parent_len, namespace, codec, cver, payload_len, body_len,
     stored, body_sum, created) = FIXED.unpack_from(mv)
    if version != FORMAT_VERSION or header_len != HEADER_BYTES:
        raise BadVersion(f"unsupported record version {version} (header {header_len} B)")
    end = FIXED.size + key_len + parent_len
    if len(mv) < end + _SUM:
        raise Truncated("truncated header")
    if checksum(mv[:end]) != mv[end : end + _SUM]:
        raise BadChecksum("header checksum mismatch")
    if full:
        if len(mv) < HEADER_BYTES:
            raise Truncated("truncated header")
        if mv[end + _SUM : HEADER_BYTES].tobytes() != _ZERO_PAD[: HEADER_BYTES - end - _SUM]:
            raise BadChecksum("header padding is not zero")
    if key_len == 0 or stored not in (body_len, align_up(body_len)):
        raise BadChecksum("inconsistent header lengths")
    key = bytes(mv[FIXED.size : FIXED.size + key_len])
    parent = bytes(mv[FIXED.size + key_len : end]) if parent_len else None
    return RecordHeader(
        key=key, parent=parent, namespace=namespace,
        codec=codec.rstrip(b"\x00").decode("ascii", "replace"), codec_version=cver,
        payload_len=payload_len, body_len=body_len, stored_len=stored, body_sum=body_sum, created=created,
    )


#: Body bytes read per step of a buffered read; each step is checksummed while it
#: is still in the CPU cache (few steps per chunk: each is a GIL hand-off).
READ_PIECE_BYTES = 2 * 1024 * 1024


def read_and_checksum(readinto: Callable[[memoryview], int], dst: memoryview) -> tuple[int, bytes]:
    """Read ``len(dst)`` bytes into ``dst`` piecewise, checksumming as it goes (no extra copy).

    Args:
        readinto: fills a view from the current position, returns bytes read (short only at EOF).

    Returns:
        (bytes read, xxh3-64 of them).
    """
    h = xxhash.xxh3_64()
    pos, n = 0, len(dst)
    while pos < n:
        piece = dst[pos : min(n, pos + READ_PIECE_BYTES)]
        got = readinto(piece)
        h.update(piece[:got])
        pos += got
        if got < len(piece):
            break
    return pos, h.digest()


def record_relpath(key: bytes) -> str:
    """``<2 hex>/<key hex>.kvc``: where a directory of records keeps ``key``'s record.

    Keys longer than 100 bytes (file names are at most 255 bytes) are named by
    ``x`` + the blake3 hex digest of the key instead; the record holds the key itself.
    """
    h = key.hex() if len(key) <= 100 else "x" + blake3.blake3(key).hexdigest()
    return f"{h[:2]}/{h}{SUFFIX}"


def encode_record(
    key: bytes, namespace: bytes, parent: bytes | None, payload: memoryview, codec: Codec, spec: ValueSpec
) -> tuple[list[Buffer], int]:
    """A whole record of ``payload`` (uint8 view) encoded by ``codec``: (parts to write in order, total bytes).

    The raw codec copies nothing: the payload itself is one of the parts, so it
    must stay unchanged until the parts are written.

    Raises:
        CodecError: the codec refuses the payload. ValueError: bad key/parent/namespace.
    """
    body = codec.encode(payload, spec)
    h = xxhash.xxh3_64()
    body_len = 0
    for part in body:
        h.update(part)  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer on 3.12+ only
        body_len += byte_view(part).nbytes
    header = encode_header(
        key=key, namespace=namespace, parent=parent, payload_len=len(payload), body_len=body_len,
        body_sum=h.digest(), codec=codec.name, codec_version=codec.version,
    )
    return [header, *body], HEADER_BYTES + body_len


def read_record_into(
    readinto: Callable[[memoryview], int],
    file_size: int,
    key: bytes,
    namespace: bytes,
    out: memoryview,
    decoders: Mapping[str, Codec],
    scratch: Callable[[int], memoryview],
) -> RecordHeader:
    """Read one record (``file_size`` bytes, from its start) and decode its payload into ``out``.

    Args:
        readinto: fills a view from the current position, returns bytes read (short only at EOF).
        key / namespace: what the record must carry.
        out: writable uint8 view of the payload size.
        decoders: codec name -> decoder.
        scratch: a writable view of exactly n bytes (for the header and non-identity bodies).

    Raises:
        RecordError: the record is unusable (delete it); :class:`KeepRecord` subclasses
            (another payload size, an unknown codec): keep it. ``out`` may have been written.
    """
    head = scratch(HEADER_BYTES)
    if _fill(readinto, head) != HEADER_BYTES:
        raise Truncated("truncated header")
    hdr = decode_header(head)
    hdr.expect(key, namespace, file_size)
    if hdr.payload_len != len(out):
        raise PayloadSizeMismatch(f"payload is {hdr.payload_len} B, expected {len(out)} B")
    codec = decoders.get(hdr.codec)
    if codec is None or codec.version != hdr.codec_version:
        raise UnknownCodec(f"no decoder for codec {hdr.codec!r} version {hdr.codec_version}")
    if codec.identity and hdr.body_len != hdr.payload_len:
        raise BadChecksum("identity body size differs from payload size")
    body = out if codec.identity else scratch(hdr.body_len)
    got, digest = read_and_checksum(lambda v: _fill(readinto, v), body)
    if got != hdr.body_len:
        raise Truncated("body shorter than its header says")
    if digest != hdr.body_sum:
        raise BadChecksum("body checksum mismatch")
    if not codec.identity:
        try:
            codec.decode_into(body, out)
        except CodecError as exc:
            raise BadChecksum(f"codec {hdr.codec!r} cannot decode the body: {exc}") from None
    return hdr


def _fill(readinto: Callable[[memoryview], int], view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = readinto(view[got:])
        if not n:
            break
        got += n
    return got
