"""Checks of a Redis tier's URL options and of the Redis it points at (for operators).

- :func:`connection_params`: the keyword options redis-py's connection class
  accepts, so an unknown URL query option (``?key_prefx=``) is refused when the
  config loads instead of failing later inside redis-py with a ``TypeError``;
- :func:`store_problems`: one bounded ``INFO memory`` round trip at open that
  finds an unreachable store, no ``maxmemory`` or an eviction policy that cannot
  evict kvtier's keys (each a WARNING in the log).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import redis


def connection_params(connection_class: type) -> set[str]:
    """Keyword names ``connection_class(...)`` accepts (its ``__init__`` and its bases', ``object`` excluded)."""
    names: set[str] = set()
    for klass in connection_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
                names.add(p.name)
    names.discard("self")
    return names


def store_problems(connect: Callable[[], Any], url: str, has_ttl: bool) -> list[str]:
    """Problems of the Redis behind ``url`` (password masked), one line each; empty: none.

    Args:
        connect: returns an unconnected redis-py connection whose socket
            timeouts bound the check (seconds).
        url: the tier's URL for the messages.
        has_ttl: whether the tier sets a TTL on its keys.

    Finds: the store does not answer (its calls miss until it does); no
    ``maxmemory`` (Redis grows until the machine runs out of memory);
    ``noeviction`` (every write fails once full); a ``volatile-*`` policy with
    no TTL (nothing kvtier writes can be evicted). Never raises for a store failure.
    """
    conn = connect()
    try:
        conn.send_command("INFO", "memory")
        reply = conn.read_response()
    except (redis.RedisError, OSError) as exc:
        return [f"remote tier {url} does not answer ({exc}); its calls miss until it does"]
    finally:
        conn.disconnect()
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    problems = []
    if info.get("maxmemory", "0").strip() == "0":
        problems.append(
            f"remote tier {url}: Redis has no maxmemory, so it grows until the machine runs out of "
            "memory; set maxmemory and maxmemory-policy allkeys-lru"
        )
    policy = info.get("maxmemory_policy", "").strip()
    if policy == "noeviction":
        problems.append(
            f"remote tier {url}: maxmemory-policy noeviction makes every write fail once Redis is full; use allkeys-lru"
        )
    elif policy.startswith("volatile-") and not has_ttl:
        problems.append(
            f"remote tier {url}: maxmemory-policy {policy} evicts only keys with a TTL and kvtier sets none "
            "(remote_ttl_s unset); use allkeys-lru or set remote_ttl_s"
        )
    return problems
