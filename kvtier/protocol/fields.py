"""The field types of control-plane messages, each with its bounds (msgspec annotations).

Every field a client chooses is bounded here, once: a value outside its type or bounds fails
decoding with a ``msgspec.ValidationError`` whose message ends with the field's path (e.g.
``- at `$.keys```), which :mod:`kvtier.protocol.messages` turns into ``ProtocolError(BAD_MESSAGE)``.

One wire form is not msgspec's own: a key list (:data:`KeyList`), one binary of ``n * 32``
bytes with ``n <= MAX_KEYS``, decoded by :func:`dec_hook` into a list of 32-byte keys. A
:class:`~kvtier.index.keys.KeyNamespace` travels as its dataclass map (msgspec decodes it
natively) and :func:`check_namespace` bounds its strings and integers.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kvtier.index.keys import KEY_BYTES, KeyNamespace, LayoutSignature
from kvtier.protocol.errors import ErrorCode, ProtocolError

#: Keys in one lookup, reservation, load or prefetch (256 tokens each: 4M tokens).
MAX_KEYS = 16_384
#: Longest client id or lease owner (characters).
MAX_NAME_CHARS = 256
INT64_MAX = (1 << 63) - 1

_BAD = ErrorCode.BAD_MESSAGE
_KEY_FORMAT = f"{KEY_BYTES}s"

#: One chunk key: exactly 32 bytes.
Key = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
#: A client id or lease owner: 1 to ``MAX_NAME_CHARS`` characters.
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
#: 0 to ``2**63 - 1`` (an unsigned value that fits an int64).
U64 = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
#: A positive int64.
Pos64 = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
#: One parent per key (nil: a prompt's first chunk); the count is checked against the keys.
Parents = Annotated[list[Key | None], msgspec.Meta(max_length=MAX_KEYS)]

# Type checkers see a plain list of keys (requests built in code take plain lists); at run time
# msgspec needs a class of its own to call dec_hook for, and checks the hook returns one.
if TYPE_CHECKING:
    KeyList = list[bytes]
else:

    class KeyList(list):
        """A decoded key list (a ``list`` of 32-byte keys; see :func:`dec_hook`)."""

        __slots__ = ()


def split_keys(v: object, name: str = "keys") -> KeyList:
    """The keys of a key-list binary.

    Raises:
        ValueError: not a binary of ``n * 32`` bytes with ``n <= MAX_KEYS``.
    """
    if not isinstance(v, bytes) or len(v) % KEY_BYTES or len(v) > MAX_KEYS * KEY_BYTES:
        raise ValueError(f"field {name!r} must be a binary of n*{KEY_BYTES} bytes, n <= {MAX_KEYS}")
    return KeyList(struct.unpack(_KEY_FORMAT * (len(v) // KEY_BYTES), v))  # C speed: 4x a slicing loop


def dec_hook(t: type, obj: Any) -> Any:
    """msgspec's hook for the wire forms it does not know (:data:`KeyList`).

    Raises:
        ValueError: a bad key list (msgspec adds the field's path).
        NotImplementedError: any other type.
    """
    if t is KeyList:
        return split_keys(obj)
    raise NotImplementedError(f"no wire form for {t}")


def join_keys(keys: list[bytes]) -> bytes:
    """Keys as one binary (the wire form of a key list)."""
    return b"".join(keys)


def get_int(obj: dict[str, Any], name: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    v = obj.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(_BAD, f"field {name!r} must be an integer in [{lo}, {hi}]")
    return v


def get_str(obj: dict[str, Any], name: str, max_chars: int = MAX_NAME_CHARS) -> str:
    v = obj.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= max_chars:
        raise ProtocolError(_BAD, f"field {name!r} must be a non-empty string of <= {max_chars} chars")
    return v


def namespace_to_wire(ns: KeyNamespace) -> dict[str, Any]:
    return asdict(ns)


def check_namespace(ns: KeyNamespace) -> None:
    """Bound a decoded namespace's fields as :func:`namespace_from_wire` does.

    Raises:
        ProtocolError: ``BAD_MESSAGE`` naming the field.
    """
    namespace_from_wire(namespace_to_wire(ns))


def namespace_from_wire(v: Any) -> KeyNamespace:
    """Rebuild a :class:`KeyNamespace` from its wire map.

    Layout strings are 1 to ``MAX_NAME_CHARS`` characters and its integers 1 to 2**20; the
    namespace's strings at most 1024 characters and its integers 0 to 2**20.

    Raises:
        ProtocolError: missing/extra fields, wrong types or invalid values.
    """
    if not isinstance(v, dict) or not isinstance(v.get("layout"), dict):
        raise ProtocolError(_BAD, "namespace must be a map with a layout map")
    lay = v["layout"]
    lf = {f.name: f.type for f in fields(LayoutSignature)}
    nf = {f.name: f.type for f in fields(KeyNamespace)}
    if set(lay) != set(lf) or set(v) != set(nf):
        raise ProtocolError(_BAD, "namespace or layout has missing or unknown fields")
    try:
        lay_args: dict[str, Any] = {
            k: (get_str(lay, k) if lf[k] == "str" else get_int(lay, k, 1, 1 << 20)) for k in lf
        }
        ns_args: dict[str, Any] = {}
        for k, t in nf.items():
            if k == "layout":
                ns_args[k] = LayoutSignature(**lay_args)
            elif t == "str":
                ns_args[k] = get_str(v, k, max_chars=1024)
            elif t == "int":
                ns_args[k] = get_int(v, k, 0, 1 << 20)
            else:  # other value types are checked by the constructor
                ns_args[k] = v[k]
        return KeyNamespace(**ns_args)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as exc:
        raise ProtocolError(_BAD, f"invalid namespace: {exc}") from None
