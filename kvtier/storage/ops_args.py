"""Argument checks of the instance operations (:mod:`kvtier.storage.instance_ops`).

Each check returns the argument in the form the operations use, or raises
:class:`OpError` whose message starts with the offending field (``tier``,
``keys[3]``, ``pin_id``...).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from kvtier.index.chains import request_cycle
from kvtier.serde.base import Codec
from kvtier.serde.registry import make_codec
from kvtier.storage.manager import StorageManager
from kvtier.storage.types import TIER_KINDS

__all__ = [
    "KEY_BYTES", "OpError", "Tier", "check_codec", "check_keys", "check_parents", "check_pin_id",
    "check_ttl", "resolve_tier", "resolve_tiers", "tier_names",
]

#: Bytes of a chunk key.
KEY_BYTES = 32

Tier = Any  # "cpu" (the CPU tier) or a LowerTier


class OpError(ValueError):
    """An operation's argument is bad: ``str(exc)`` starts with the field name (``tier``, ``keys[3]``...)."""


def tier_names(m: StorageManager) -> list[str]:
    """The tier labels ``m`` has, fastest first (``cpu`` then each lower tier's kind)."""
    out = ["cpu"]
    for t in m.lower:
        if t.kind not in out:
            out.append(t.kind)
    return out


def resolve_tier(m: StorageManager, name: object, field: str = "tier", allow_cpu: bool = True) -> Tier:
    """The tier labelled ``name``: ``"cpu"`` or the first lower tier of that kind.

    Raises:
        OpError: ``name`` is not a tier label, is ``cpu`` without ``allow_cpu``, or
            ``m`` has no such tier.
    """
    if not isinstance(name, str) or name not in TIER_KINDS:
        raise OpError(f"{field}: unknown tier {name!r}; tier labels are {list(TIER_KINDS)}")
    if name == "cpu":
        if not allow_cpu:
            raise OpError(f"{field}: this operation works on lower tiers, not 'cpu'")
        return "cpu"
    for t in m.lower:
        if t.kind == name:
            return t
    raise OpError(f"{field}: this instance has no {name!r} tier; it has {tier_names(m)}")


def resolve_tiers(m: StorageManager, name: object, field: str = "tier") -> list[Tier]:
    """Every tier of ``m`` (``"cpu"`` first) for ``name`` None, else :func:`resolve_tier`'s one."""
    return ["cpu", *m.lower] if name is None else [resolve_tier(m, name, field)]


def check_keys(keys: object, field: str = "keys") -> list[bytes]:
    """``keys`` as a list of 32-byte ``bytes``.

    Raises:
        OpError: not a sequence of keys, or a key that is not 32 bytes.
    """
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
        raise OpError(f"{field}: expected a list of {KEY_BYTES}-byte keys, got {type(keys).__name__}")
    out = []
    for i, k in enumerate(keys):
        if not isinstance(k, (bytes, bytearray)):
            raise OpError(f"{field}[{i}]: key must be bytes, got {type(k).__name__}")
        if len(k) != KEY_BYTES:
            raise OpError(f"{field}[{i}]: key must be {KEY_BYTES} bytes, got {len(k)}")
        out.append(bytes(k))
    return out


def check_parents(parents: object, keys: list[bytes]) -> list[bytes | None]:
    """Each key's parent (None: ``keys`` are one prompt's chain in order; an empty or
    all-zero parent is None).

    Raises:
        OpError: not a sequence, a length other than ``len(keys)``, a parent that is not
            a 32-byte key, a chunk its own parent, or parents that form a cycle.
    """
    if parents is None:
        return [keys[i - 1] if i else None for i in range(len(keys))]
    if isinstance(parents, (bytes, bytearray, str)) or not isinstance(parents, Sequence):
        raise OpError(f"parents: expected a list of keys or None, got {type(parents).__name__}")
    if len(parents) != len(keys):
        raise OpError(f"parents: {len(parents)} parents for {len(keys)} keys")
    out: list[bytes | None] = []
    for i, p in enumerate(parents):
        if p is None or (isinstance(p, (bytes, bytearray)) and (len(p) == 0 or p == bytes(KEY_BYTES))):
            out.append(None)
        elif not isinstance(p, (bytes, bytearray)) or len(p) != KEY_BYTES:
            raise OpError(f"parents[{i}]: parent must be None or a {KEY_BYTES}-byte key")
        elif p == keys[i]:
            raise OpError(f"parents[{i}]: a chunk cannot be its own parent")
        else:
            out.append(bytes(p))
    at = request_cycle(keys, out)
    if at is not None:
        raise OpError(f"parents[{at}]: keys[{at}] is its own ancestor (the parents form a cycle)")
    return out


def check_pin_id(pin_id: object) -> str:
    """``pin_id`` if it is a non-empty string.

    Raises:
        OpError: anything else.
    """
    if not isinstance(pin_id, str) or not pin_id:
        raise OpError("pin_id: must be a non-empty string")
    return pin_id


def check_ttl(ttl_s: object) -> float | None:
    """``ttl_s`` if it is None or a positive finite number of seconds.

    Raises:
        OpError: anything else (booleans included).
    """
    if ttl_s is not None and (
        isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0
    ):
        raise OpError(f"ttl_s: must be a positive number of seconds or None, got {ttl_s!r}")
    return ttl_s


def check_codec(codec: str) -> Codec:
    """The codec named ``codec`` (:mod:`kvtier.serde.registry`).

    Raises:
        OpError: unknown codec (the registry's message follows ``codec:``).
    """
    try:
        return make_codec(codec)
    except ValueError as exc:
        raise OpError(f"codec: {exc}") from None
