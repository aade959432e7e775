"""Configurations compared by ``kvtier bench serve``, vLLM's /metrics, and the routing oracle.

Configurations (each started by the bench, engine KV bounded the same way):

- ``vllm``: vLLM alone, both cores.
- ``kvtier-cpu``: vLLM + kvtier, CPU tier sized to hold the whole working set.
- ``kvtier-cpu-disk``: vLLM + kvtier, CPU tier holding half the working set, disk tier below.
- ``rr-2x``: two vLLM + kvtier (CPU) instances, each pinned to one core, behind
  ``kvtier router --policy round-robin``.
- ``router-2x``: the same two instances behind ``kvtier router --policy kv-aware``.
- ``lmcache-mp``: LMCache's standalone server and a vLLM from LMCache's own virtual
  environment (``--lmcache-venv``), L1 = kvtier-cpu's CPU tier capacity, SHM transport
  (:mod:`.lmcache_mp`). Not in the default list: it needs that venv.

Hit rate (per configuration, summed over its instances, deltas of /metrics over the run):
(``vllm:prefix_cache_hits`` + ``vllm:external_prefix_cache_hits``) / ``vllm:prefix_cache_queries``,
all in tokens: engine-resident and connector (kvtier) hits over prompt tokens looked up.

Oracle (``router_hit_rate_vs_oracle``'s denominator): the hit rate of a router that knows
true cache state and keeps instances balanced, on the same requests. It replays the
two-instance run's requests in the order they were sent; each instance's cache holds every
prompt it served (unbounded: kvtier's tiers are sized to hold the working set). A user's
first request goes to the instance that has served fewer requests (ties: the lower index),
every later one to the instance that served that user (where its whole history is). A
request hits its longest prefix shared with a prompt cached on that instance, rounded down
to whole kvtier chunks (the engine block, 128 tokens, in this bench) and at most prompt_tokens - 1 (vLLM always computes the last prompt
token). Hit rate: hit tokens / prompt tokens. Engine hits finer than a chunk are not
counted, so a measured rate can exceed it slightly. (Sending every request to the instance
with the longest cached prefix instead would put every user on one instance, since they
all share the system prompt: a hit-rate bound no balanced router can reach.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

#: Names accepted by ``--configs``, in run order.
CONFIG_NAMES = ("vllm", "kvtier-cpu", "kvtier-cpu-disk", "rr-2x", "router-2x", "lmcache-mp")


@dataclass(frozen=True)
class ConfigSpec:
    """One configuration.

    Attributes:
        name: one of :data:`CONFIG_NAMES`.
        kvtier: whether instances run the kvtier connector.
        disk: whether kvtier gets a disk tier (CPU tier then holds half the working set).
        instances: vLLM instances (1, or 2 pinned to one core each).
        policy: ``kvtier router`` policy for two instances, None for one.
        lmcache: LMCache's MP server instead of kvtier (:mod:`.lmcache_mp`).
    """

    name: str
    kvtier: bool
    disk: bool
    instances: int
    policy: str | None
    lmcache: bool = False


CONFIGS: dict[str, ConfigSpec] = {
    "vllm": ConfigSpec("vllm", False, False, 1, None),
    "kvtier-cpu": ConfigSpec("kvtier-cpu", True, False, 1, None),
    "kvtier-cpu-disk": ConfigSpec("kvtier-cpu-disk", True, True, 1, None),
    "rr-2x": ConfigSpec("rr-2x", True, False, 2, "round-robin"),
    "router-2x": ConfigSpec("router-2x", True, False, 2, "kv-aware"),
    "lmcache-mp": ConfigSpec("lmcache-mp", False, False, 1, None, lmcache=True),
}


def parse_configs(text: str) -> list[ConfigSpec]:
    """``"vllm,kvtier-cpu"`` -> specs in the order given. Raises ValueError naming an unknown one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise ValueError(f"unknown configuration(s) {bad or text!r}; choose from {', '.join(CONFIG_NAMES)}")
    return [CONFIGS[n] for n in dict.fromkeys(names)]


# -- /metrics ------------------------------------------------------------------------------
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")

#: Counters read from each instance (summed over label sets).
METRICS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def scrape(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The :data:`METRICS` counters of one instance (missing ones are 0).

    Raises httpx.HTTPError when the instance does not answer.
    """
    r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    r.raise_for_status()
    raw = parse_prometheus(r.text)
    return {k: raw.get(name, 0.0) for k, name in METRICS.items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def hit_rate(d: dict[str, float]) -> float:
    """(engine hits + connector hits) / prompt tokens looked up; 0 when nothing was looked up."""
    q = d.get("queries", 0.0)
    return (d.get("hits", 0.0) + d.get("external_hits", 0.0)) / q if q > 0 else 0.0


# -- oracle ---------------------------------------------------------------------------------
def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def oracle_hit_rate(
    requests: Sequence[tuple[str, Sequence[int]]], instances: int = 2, chunk_tokens: int = 256
) -> dict[str, float | None]:
    """Hit rate of the true-cache-state router described in the module docstring.

    Args:
        requests: (user key, prompt token ids) in issue order.
        instances: number of instances.
        chunk_tokens: hit granularity (kvtier's chunk size).

    Returns:
        ``{"hit_rate", "hit_tokens", "prompt_tokens", "max_request_share_ratio"}`` (the last
        None when an instance got no request).
    """
    if instances < 1 or chunk_tokens < 1:
        raise ValueError("instances and chunk_tokens must be >= 1")
    served: list[list[Sequence[int]]] = [[] for _ in range(instances)]
    last: dict[str, int] = {}
    counts = [0] * instances
    hit_total = tok_total = 0
    for user, ids in requests:
        pick = last[user] if user in last else min(range(instances), key=lambda i: counts[i])
        top = max((_common_prefix(ids, p) for p in served[pick]), default=0)
        hit = min(top, max(0, len(ids) - 1)) // chunk_tokens * chunk_tokens
        hit_total += hit
        tok_total += len(ids)
        served[pick].append(ids)
        counts[pick] += 1
        last[user] = pick
    lo = min(counts)
    return {
        "hit_rate": hit_total / tok_total if tok_total else 0.0,
        "hit_tokens": float(hit_total),
        "prompt_tokens": float(tok_total),
        "max_request_share_ratio": max(counts) / lo if lo else None,
    }
