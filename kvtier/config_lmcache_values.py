"""Values and rule helpers of the LMCache config translation (:mod:`kvtier.config_lmcache`).

A rule gets an LMCache key's value and the whole document and returns the kvtier
settings it maps to, as ``[(kvtier key, value, shown)]``, or raises :class:`_Refuse`
(kvtier cannot honour it) or :class:`_Ignore` (it changes nothing kvtier does) with
the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

#: Bytes in one LMCache "GB" (LMCache multiplies its GB sizes by 1024**3; see module doc).
LMCACHE_GB = 1024**3

# LMCache's deprecated names -> current names (lmcache/v1/config.py _CONFIG_ALIASES).
ALIASES: dict[str, str] = {
    "enable_xpyd": "enable_pd",
    "nixl_peer_host": "pd_peer_host",
    "nixl_peer_init_port": "pd_peer_init_port",
    "nixl_peer_alloc_port": "pd_peer_alloc_port",
    "nixl_proxy_host": "pd_proxy_host",
    "nixl_proxy_port": "pd_proxy_port",
    "nixl_role": "pd_role",
    "nixl_buffer_size": "pd_buffer_size",
    "controller_url": "controller_pull_url",
    "lmcache_worker_port": "lmcache_worker_ports",
    "plugin_locations": "runtime_plugin_locations",
    "external_backends": "storage_plugins",
}


class _Refuse(Exception):
    """A key's value cannot be honoured (the message is the reason)."""


class _Ignore(Exception):
    """A key's value does not change kvtier's behaviour (the message is the reason)."""


# -- value helpers ---------------------------------------------------------------------------------


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise _Refuse(f"{value!r} is not true/false")


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or value is None:
        raise _Refuse(f"{value!r} is not a number ({what})")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise _Refuse(f"{value!r} is not a number ({what})") from None
    if not math.isfinite(out) or out < 0:
        raise _Refuse(f"{value!r} must be a finite, non-negative number ({what})")
    return out


def _gb_to_bytes(value: Any) -> tuple[int, str]:
    """LMCache GB (x 1024**3) -> (bytes, value shown)."""
    gb = _number(value, "LMCache sizes are numbers of GB, 1 GB = 1024**3 bytes, e.g. 5 or 0.5")
    nbytes = int(gb * LMCACHE_GB)  # LMCache's own rounding: int(size * 1024**3)
    return nbytes, f"{gb:g} GB (LMCache GB = 1024**3 B) = {nbytes} B ({_human(nbytes)})"


def _human(nbytes: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g}{unit}"
    return f"{nbytes}B"


def _on(doc: Mapping[str, Any], key: str) -> bool:
    """LMCache boolean ``key`` (or its alias) set true in ``doc``; a non-boolean counts as on."""
    for name in (key, *[a for a, k in ALIASES.items() if k == key]):
        if name in doc:
            try:
                if _bool(doc[name]):
                    return True
            except _Refuse:
                return True
    return False


def _get(doc: Mapping[str, Any], key: str) -> Any:
    """Value of LMCache ``key`` or of one of its deprecated aliases (None when absent)."""
    if key in doc:
        return doc[key]
    for alias, target in ALIASES.items():
        if target == key and alias in doc:
            return doc[alias]
    return None


def _unset(value: Any) -> bool:
    return value is None or value == [] or value == {} or (isinstance(value, str) and not value.strip())


# -- rules -----------------------------------------------------------------------------------------
# A rule gets (value, whole document) and returns [(kvtier key, kvtier value, shown)], or raises
# _Refuse / _Ignore with the reason.
Rule = Callable[[Any, Mapping[str, Any]], list[tuple[str, Any, str]]]


def _default_only(default: Any, ok: str, refuse: str) -> Rule:
    """A key kvtier honours only at LMCache's default value (``ok``: why that is the same; ``refuse``: why not)."""

    def rule(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
        same = _bool(v) == default if isinstance(default, bool) else (v == default or _unset(v) and default is None)
        if same:
            raise _Ignore(f"{v!r} is LMCache's default; {ok}")
        raise _Refuse(f"{v!r}: {refuse}")

    return rule


def _feature(flag_reason: str) -> Rule:
    """An LMCache feature switch kvtier does not implement: false is ignored, true refused."""

    def rule(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
        if not _bool(v):
            raise _Ignore("off (LMCache's default)")
        raise _Refuse(flag_reason)

    return rule


def _unset_only(refuse: str) -> Rule:
    """A key whose only honourable value is unset/empty."""

    def rule(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
        if _unset(v):
            raise _Ignore("unset (LMCache's default)")
        raise _Refuse(refuse)

    return rule


def _ignore(reason: str) -> Rule:
    def rule(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
        raise _Ignore(reason)

    return rule


def _sub_key(flag: str, reason: str | None = None) -> Rule:
    """A setting of LMCache feature ``flag``: it changes nothing in kvtier (the flag itself is refused when on)."""

    def rule(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
        raise _Ignore(reason or f"only used with {flag}" + (" (refused)" if _on(doc, flag) else " (off)"))

    return rule


