"""Value serialization for remote tiers: codecs and the checksummed envelope.

- :mod:`kvtier.serde.base`: the :class:`Codec` interface and :class:`ValueSpec`.
- Codecs: ``raw`` (default, zero-copy), ``shuffle-zstd`` (lossless), ``int8`` (lossy).
- :mod:`kvtier.serde.envelope`: header with magic, format, codec name+version,
  lengths, xxh3 checksums and the key; anything that does not check out is a miss.
"""

from kvtier.serde.base import Buffer, Codec, CodecError, ValueSpec
from kvtier.serde.envelope import EncodedValue, ValueMiss, encode_value, read_value_into
from kvtier.serde.registry import CODECS, DEFAULT_DECODERS, decoders_with, make_codec

__all__ = [
    "CODECS",
    "DEFAULT_DECODERS",
    "Buffer",
    "Codec",
    "CodecError",
    "EncodedValue",
    "ValueMiss",
    "ValueSpec",
    "decoders_with",
    "encode_value",
    "make_codec",
    "read_value_into",
]
