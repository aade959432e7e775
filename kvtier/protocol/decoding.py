"""Decoding bytes another process chose (JSON, msgpack), whatever their nesting depth.

msgspec and the standard ``json`` module decode nested arrays and maps recursively and give up
past the interpreter's recursion limit with ``RecursionError``, not their decode error: a body of
about a thousand ``[`` is enough, and with a typed decoder (a msgspec Struct) the nesting may sit
in a field the type does not even have (msgspec skips an unknown field by walking it). A caller
that catches only ``msgspec.DecodeError`` / ``ValueError`` then lets a bad input through as an
unexpected error: a 500 from the router or the PD proxy, a traceback per frame on the controller,
an exception out of a vLLM worker's confirm drain. Every decode of what a client or a peer sent
goes through here, so too deep is one more way of being malformed.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

T = TypeVar("T", covariant=True)


class _Decoder(Protocol[T]):
    def decode(self, buf: Any, /) -> T: ...


def decode(decoder: _Decoder[T], data: Any) -> T:
    """``decoder.decode(data)`` (a ``msgspec.json.Decoder`` or ``msgspec.msgpack.Decoder``).

    Raises:
        msgspec.DecodeError: not valid for the decoder, or nested too deeply to decode (what the
            decoder raises besides, e.g. ``msgspec.ValidationError``, unchanged).
    """
    try:
        return decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("nested too deeply to decode") from None


def json_loads(data: bytes | str) -> Any:
    """``json.loads(data)``.

    Raises:
        ValueError: not JSON (``json.JSONDecodeError``, ``UnicodeDecodeError``), or nested too deeply.
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to decode") from None


#: Largest JSON file :func:`read_json_file` reads by default (bytes).
MAX_JSON_FILE_BYTES = 256 << 20


def read_json_file(path: Path | str, max_bytes: int = MAX_JSON_FILE_BYTES) -> Any:
    """The JSON document in the file ``path``: a regular file of at most ``max_bytes`` bytes.

    Checked before reading, so no path hangs or exhausts the process: a FIFO (opening one blocks
    until a writer comes), a device such as ``/dev/zero``, a directory.

    Raises:
        ValueError: no such file, not a regular file, unreadable, larger than ``max_bytes``, not
            UTF-8 JSON, or nested too deeply; the message says which (without the path).
    """
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer; the type is checked on the open
        # file itself, so swapping the path after a check cannot slip a FIFO or device in.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except BaseException:
            os.close(fd)
            raise
        if not regular:
            os.close(fd)
            raise ValueError("not a regular file")
        with open(fd, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    try:
        return json_loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"not JSON ({exc})") from None


def json_dumps(obj: Any) -> bytes:
    """``json.dumps(obj)`` as UTF-8 bytes (``obj`` came from :func:`json_loads` of a client's body: the
    encoder recurses too, and a document decoded near the limit may not encode from a deeper stack).

    Raises:
        ValueError: nested too deeply to encode, or a value JSON cannot hold.
    """
    try:
        return json.dumps(obj).encode()
    except RecursionError:
        raise ValueError("JSON nested too deeply to encode") from None
