"""Finding lower-tier implementations: the ``kvtier.tiers`` entry-point group.

A package adds a tier by declaring, in its ``pyproject.toml``::

    [project.entry-points."kvtier.tiers"]
    mystore = "mypkg.tier:MyStoreTier"   # a LowerTier subclass

The entry-point name is the URL scheme (or plain name) that selects it:
``open_tier("mystore://host/x")`` calls ``MyStoreTier.from_url(url, **options)``;
``open_tier("mystore", **options)`` calls ``MyStoreTier(**options)``. kvtier's own
tiers are registered the same way (redis, rediss, unix, redis+cluster,
rediss+cluster, fs, mooncake) and, for source checkouts where no package metadata is
installed, also found through the fallback table below. An installed entry
point of the same name takes precedence over the fallback.

Peer sharing (``peers`` / ``peer_listen`` / ``peer_discovery`` settings) lives above the storage
layer and is joined to a manager there (:mod:`kvtier.transfer.assembly`), not found here.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any, Mapping

from kvtier.tiers.base import LowerTier

ENTRY_POINT_GROUP = "kvtier.tiers"

#: Built-in tiers (name -> "module:attribute"), mirrored in pyproject.toml.
BUILTIN_TIERS: Mapping[str, str] = MappingProxyType(
    {
        "redis": "kvtier.tiers.redis_tier:RedisTier",
        "rediss": "kvtier.tiers.redis_tier:RedisTier",
        "unix": "kvtier.tiers.redis_tier:RedisTier",
        "redis+cluster": "kvtier.tiers.redis_tier:RedisTier",
        "rediss+cluster": "kvtier.tiers.redis_tier:RedisTier",
        "fs": "kvtier.tiers.fs_tier:FsTier",
        "mooncake": "kvtier.tiers.mooncake_tier:MooncakeTier",
    }
)


def available_tiers() -> dict[str, str]:
    """Every selectable tier name -> ``"module:attribute"`` (entry points over built-ins)."""
    found = dict(BUILTIN_TIERS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.value
    return found


def load_tier_class(name: str) -> type[LowerTier]:
    """The tier class registered under ``name`` (a scheme or plain name).

    Raises:
        ValueError: no tier has that name (the message lists the known ones), or
            the registered object is not a :class:`LowerTier` subclass.
        ImportError: the registered module cannot be imported (e.g. a missing extra).
    """
    tiers = available_tiers()
    target = tiers.get(name.lower())
    if target is None:
        raise ValueError(f"no kvtier tier named {name!r}; available: {', '.join(sorted(tiers))}")
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, LowerTier)):
        raise ValueError(f"kvtier tier {name!r} -> {target} is not a LowerTier subclass")
    return obj


def check_tier_url(url: str) -> None:
    """Validate a remote tier URL at config time through its tier class, contacting nothing.

    Calls the class's optional ``check_url(url)`` classmethod (the Redis tier
    checks its query options there); tiers without one are checked when opened.

    Raises:
        ValueError: unknown scheme, a module that cannot be imported (a missing
            extra, e.g. ``pip install 'kvtier[redis]'``), or a URL/option the tier refuses.
    """
    scheme = url.split("://", 1)[0]
    try:
        cls = load_tier_class(scheme)
    except ImportError as exc:
        raise ValueError(
            f"the tier for {scheme}:// cannot be imported ({exc}); install its extra, e.g. pip install 'kvtier[redis]'"
        ) from None
    check = getattr(cls, "check_url", None)
    if callable(check):
        check(url)


def open_tier(spec: str, **options: Any) -> LowerTier:
    """Open a lower tier from a URL (selected by scheme) or a registered name.

    Examples: ``open_tier("redis://127.0.0.1:6379/0", ttl_s=3600)``,
    ``open_tier("redis+cluster://10.0.0.5:7000")``, ``open_tier("fs:///mnt/kv")``.

    Raises:
        ValueError: unknown scheme/name or bad options.
    """
    if "://" in spec:
        scheme = spec.split("://", 1)[0]
        return load_tier_class(scheme).from_url(spec, **options)
    return load_tier_class(spec)(**options)
