"""Codec interface: how a chunk payload is turned into stored bytes and back.

A codec is chosen per tier for writing; readers pick the decoder named in each
stored value's header (see :mod:`kvtier.serde.envelope`), so tiers configured
with different codecs still read each other's values. A reader that lacks the
codec (or its version) treats the value as a miss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Union

import numpy as np

#: Anything exposing the buffer protocol as contiguous bytes.
Buffer = Union[bytes, bytearray, memoryview, np.ndarray]


def byte_view(buf: Buffer) -> memoryview:
    """``memoryview(buf)``, typed for any :data:`Buffer`.

    numpy's stubs declare ``ndarray.__buffer__`` for Python >= 3.12 only (numpy#26783), so a
    type checker targeting 3.11 rejects ``memoryview(ndarray)``, which works at runtime.
    """
    return memoryview(buf)  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer on 3.12+ only

#: Element dtypes codecs understand, with their item sizes in bytes.
DTYPE_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "int8": 1, "fp8": 1}


class CodecError(ValueError):
    """A payload cannot be encoded (bad input) or a body cannot be decoded (corrupt/foreign)."""


@dataclass(frozen=True)
class ValueSpec:
    """What a chunk payload holds, so codecs can exploit its structure.

    Attributes:
        dtype: element dtype name, e.g. ``"bfloat16"`` (KV caches of the reference model).
        shape: optional logical shape in elements; its product times the item
            size must equal the payload bytes. Codecs that group values (int8)
            use the last two axes as ``(tokens, channels)``.

    Raises:
        ValueError: unknown dtype or a non-positive dimension.
    """

    dtype: str = "bfloat16"
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_ITEMSIZE)}")
        if self.shape is not None:
            if not self.shape or any(int(d) <= 0 for d in self.shape):
                raise ValueError(f"shape dimensions must be positive, got {self.shape}")
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    def check(self, nbytes: int) -> None:
        """Raise :class:`CodecError` unless ``nbytes`` fits this dtype and shape."""
        if nbytes % self.itemsize:
            raise CodecError(f"payload of {nbytes} B is not a whole number of {self.dtype} elements")
        if self.shape is not None and int(np.prod(self.shape)) * self.itemsize != nbytes:
            raise CodecError(f"payload of {nbytes} B does not match shape {self.shape} of {self.dtype}")


class Codec(ABC):
    """Encodes chunk payloads into a stored body and decodes bodies into caller buffers.

    Instances are immutable and safe to share between threads.
    """

    #: Name written into every stored value (ASCII, at most 16 bytes).
    name: ClassVar[str]
    #: Bumped whenever the body format changes; readers reject other versions.
    version: ClassVar[int]
    #: False for codecs whose decode only approximates the input.
    lossless: ClassVar[bool]
    #: True if the body *is* the payload, so a reader may receive it straight into its buffer.
    identity: ClassVar[bool] = False

    @abstractmethod
    def encode(self, payload: memoryview, spec: ValueSpec) -> list[Buffer]:
        """Body of ``payload`` (uint8 view) as a list of buffers to be written in order.

        Raises:
            CodecError: the payload does not fit ``spec`` or cannot be encoded.
        """

    @abstractmethod
    def decode_into(self, body: memoryview, out: memoryview) -> None:
        """Decode ``body`` into ``out`` (writable uint8 view of the payload size).

        Raises:
            CodecError: the body is malformed or decodes to another size.
        """
