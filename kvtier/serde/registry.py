"""Built-in codecs by name: writers build one with options, readers look one up by name+version."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from kvtier.serde.base import Codec
from kvtier.serde.cachegen import CacheGenCodec
from kvtier.serde.int8 import Int8Codec
from kvtier.serde.raw import RawCodec
from kvtier.serde.shuffle_zstd import ShuffleZstdCodec

#: name -> codec class (read-only).
CODECS: Mapping[str, type[Codec]] = MappingProxyType(
    {c.name: c for c in (RawCodec, ShuffleZstdCodec, Int8Codec, CacheGenCodec)}
)

#: Decoders readers use by default: one default-configured instance per codec (read-only).
DEFAULT_DECODERS: Mapping[str, Codec] = MappingProxyType({name: cls() for name, cls in CODECS.items()})


def make_codec(codec: str | Codec, **options: Any) -> Codec:
    """A codec instance for writing.

    Args:
        codec: a codec name (``"raw"``, ``"shuffle-zstd"``, ``"int8"``, ``"cachegen"``) or an instance.
        options: constructor options, e.g. ``level=3`` or ``mode="channel"``.

    Raises:
        ValueError: unknown name (the message lists the known ones) or bad options.
    """
    if isinstance(codec, Codec):
        if options:
            raise ValueError("codec options given together with a codec instance")
        return codec
    try:
        cls = CODECS[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; choose one of {sorted(CODECS)}") from None
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for codec {codec!r}: {exc}") from None


def decoders_with(extra: Mapping[str, Codec] | None = None) -> dict[str, Codec]:
    """The default decoders plus ``extra`` (e.g. a third-party codec), keyed by codec name."""
    out = dict(DEFAULT_DECODERS)
    if extra:
        out.update(extra)
    return out
