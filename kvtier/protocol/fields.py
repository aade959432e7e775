"""Validated reads of message fields (every check raises ``ProtocolError(BAD_MESSAGE)``)."""

from __future__ import annotations

import math
from dataclasses import asdict, fields
from typing import Any

from kvtier.index.keys import KEY_BYTES, KeyNamespace, LayoutSignature
from kvtier.protocol.errors import ErrorCode, ProtocolError

#: Keys in one lookup, reservation, load or prefetch (256 tokens each: 4M tokens).
MAX_KEYS = 16_384
#: Longest client id or lease owner (characters).
MAX_NAME_CHARS = 256
INT64_MAX = (1 << 63) - 1

_BAD = ErrorCode.BAD_MESSAGE


def get_int(obj: dict[str, Any], name: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    v = obj.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(_BAD, f"field {name!r} must be an integer in [{lo}, {hi}]")
    return v


def get_float(obj: dict[str, Any], name: str, lo: float, hi: float) -> float:
    v = obj.get(name)
    if (type(v) is not int and type(v) is not float) or not math.isfinite(v) or not lo <= v <= hi:
        raise ProtocolError(_BAD, f"field {name!r} must be a number in [{lo}, {hi}]")
    return float(v)


def get_str(obj: dict[str, Any], name: str, max_chars: int = MAX_NAME_CHARS) -> str:
    v = obj.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= max_chars:
        raise ProtocolError(_BAD, f"field {name!r} must be a non-empty string of <= {max_chars} chars")
    return v


def get_opt_str(obj: dict[str, Any], name: str, max_chars: int = MAX_NAME_CHARS) -> str | None:
    return None if obj.get(name) is None else get_str(obj, name, max_chars)


def get_key(obj: dict[str, Any], name: str) -> bytes:
    v = obj.get(name)
    if not isinstance(v, bytes) or len(v) != KEY_BYTES:
        raise ProtocolError(_BAD, f"field {name!r} must be a {KEY_BYTES}-byte binary key")
    return v


def get_opt_key(obj: dict[str, Any], name: str) -> bytes | None:
    return None if obj.get(name) is None else get_key(obj, name)


def get_keys(obj: dict[str, Any], name: str) -> list[bytes]:
    """A key list (its wire form: one binary of ``n * 32`` bytes, ``n <= MAX_KEYS``)."""
    v = obj.get(name)
    if not isinstance(v, bytes) or len(v) % KEY_BYTES or len(v) > MAX_KEYS * KEY_BYTES:
        raise ProtocolError(_BAD, f"field {name!r} must be a binary of n*{KEY_BYTES} bytes, n <= {MAX_KEYS}")
    return [v[i : i + KEY_BYTES] for i in range(0, len(v), KEY_BYTES)]


def get_key_and_parent(o: dict[str, Any]) -> tuple[bytes, bytes | None]:
    key, parent = get_key(o, "key"), get_opt_key(o, "parent")
    if parent == key:
        # Tiers refuse a chunk that is its own parent (a prefix chain has no cycles).
        raise ProtocolError(_BAD, "a chunk cannot be its own parent")
    return key, parent


def join_keys(keys: list[bytes]) -> bytes:
    """Keys as one binary (the wire form of a key list)."""
    return b"".join(keys)


def namespace_to_wire(ns: KeyNamespace) -> dict[str, Any]:
    return asdict(ns)


def namespace_from_wire(v: Any) -> KeyNamespace:
    """Rebuild a :class:`KeyNamespace` from its wire map.

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
