"""Translate an LMCache configuration (its YAML file's keys) into kvtier settings.

A user coming from LMCache points kvtier at the file they already have
(``config_file = lmcache.yaml``, the setting ``lmcache_config_file``, or the
``LMCACHE_CONFIG_FILE`` environment variable); :func:`translate_lmcache` sorts
every key into one of three lists:

- **mapped**: an LMCache key with a kvtier counterpart (the kvtier key and the
  value shown, units spelt out);
- **refused**: a key kvtier cannot honour (a feature it does not implement, a
  value with no counterpart) or a key that is not LMCache's (a typo) — the
  load fails with :class:`~kvtier.config.ConfigError` naming each key and why;
- **ignored**: a key that does not change what is cached or whether it is hit
  (LMCache's own observability and allocator tuning, or a sub-key of a feature
  that is off), with the reason; these are logged.

Units. LMCache's ``max_local_cpu_size`` and ``max_local_disk_size`` are numbers
of "GB" that LMCache multiplies by ``1024**3`` (so ``5`` is 5 GiB =
5,368,709,120 bytes, not 5e9): ``LMCacheEngineBuilder._Create_memory_allocator``
in ``lmcache/v1/cache_engine.py`` allocates ``int(max_local_cpu_size * 1024**3)``
bytes and ``LocalDiskBackend`` in ``lmcache/v1/storage_backend/local_disk_backend.py``
bounds the disk by ``int(config.max_local_disk_size * 1024**3)``; the docs
(``docs/source/api_reference/configurations.rst``) call both "size in GB",
default 5.0 (CPU) and 0.0 (disk). kvtier takes bytes, so the translation
yields the same byte counts. ``lookup_timeout_ms`` is milliseconds (kvtier's
``lookup_timeout_s`` seconds).

Defaults. Keys the file omits take kvtier's defaults, except the CPU size:
LMCache's default ``max_local_cpu_size`` of 5 GB (5 GiB) applies when the file
does not give one, so the hot tier has the size the file's owner had. Caches
are not shared with LMCache: kvtier keys and encodes chunks its own way, so a
Redis or directory LMCache filled gives no hits to kvtier (it starts cold).

Key list: LMCache v1's ``_CONFIG_DEFINITIONS`` and aliases in
``lmcache/v1/config.py`` (plus a few keys of earlier releases).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config_lmcache_transfer import PD_NOTE, TRANSFER_RULES, _pd_on
from kvtier.config_lmcache_values import (
    ALIASES,
    LMCACHE_GB,
    Rule,
    _bool,
    _default_only,
    _feature,
    _gb_to_bytes,
    _get,
    _ignore,
    _Ignore,
    _number,
    _on,
    _Refuse,
    _sub_key,
    _unset,
    _unset_only,
)

__all__ = ["ALIASES", "LMCACHE_GB", "LmcacheTranslation", "RULES", "lmcache_connector_settings", "lmcache_keys",
           "read_lmcache_file", "translate_lmcache"]

#: LMCache's default ``max_local_cpu_size`` in its GB (``lmcache/v1/config.py``).
LMCACHE_DEFAULT_CPU_GB = 5.0
#: The environment variable LMCache reads its config file path from.
LMCACHE_ENV = "LMCACHE_CONFIG_FILE"
#: LMCache ``remote_serde`` -> kvtier ``remote_codec``.
SERDE_TO_CODEC = {"naive": "raw", "cachegen": "cachegen"}
#: Where the README explains the translation.
SEE = "see README, Configuration: Coming from LMCache"

@dataclass
class LmcacheTranslation:
    """The outcome of translating one LMCache config.

    Attributes:
        settings: kvtier key -> value (sizes in bytes, durations in seconds),
            ready for :class:`~kvtier.config.KVTierConfig`.
        mapped: (LMCache key, kvtier key, value shown with its unit) per mapped setting.
        refused: (LMCache key, reason) per key kvtier cannot honour or does not know.
        ignored: (LMCache key, reason) per key that does not change kvtier's behaviour.
        connector: vLLM connector settings (``kv_connector_extra_config`` keys, e.g. ``pd_role``)
            mapped from the file; the connector takes them where its own extra config has none.
        notes: what a mapped feature still needs from the operator (e.g. PD addresses).
    """

    settings: dict[str, Any] = field(default_factory=dict)
    mapped: list[tuple[str, str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    connector: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def origin(self, kvtier_key: str) -> str | None:
        """The LMCache key a kvtier setting came from (None: not from this translation)."""
        for lm_key, kv_key, _ in self.mapped:
            if kv_key == kvtier_key:
                return lm_key
        return None

    def raise_if_refused(self, source: str) -> None:
        """Raise when any key was refused.

        Raises:
            ConfigError: naming ``source`` (e.g. the file) and every refused key with its reason.
        """
        if self.refused:
            from kvtier.config_base import ConfigError

            raise ConfigError(
                f"{source}: kvtier cannot honour {len(self.refused)} LMCache key(s): "
                + "; ".join(f"{k}: {why}" for k, why in self.refused)
                + f" ({SEE})"
            )



def _chunk_size(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Refuse(f"{v!r} is not a whole number of tokens")
    return [("chunk_size", v, f"{v} tokens")]


def _local_cpu(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    if _bool(v):
        raise _Ignore("the CPU tier is always on in kvtier (sized by max_local_cpu_size)")
    if _pd_on(doc):
        raise _Ignore("false in an LMCache PD config (only the transfer buffer in CPU memory); kvtier's PD loads "
                      "through its CPU tier, sized by pd_buffer_size (else max_local_cpu_size)")
    raise _Refuse(
        "false (CPU memory only as a staging buffer) has no counterpart: kvtier always keeps a CPU tier, "
        "every load goes through it; remove 'local_cpu: false' and size that tier with max_local_cpu_size"
    )


def _local_device(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    if isinstance(v, str) and v.strip().lower() == "cpu":
        raise _Ignore("LMCache v0's 'cpu': the CPU tier is always on in kvtier")
    if isinstance(v, str) and v.strip().startswith("file://"):  # LMCache v0: the local disk backend's directory
        path = v.strip().removeprefix("file://")
        if not path:
            raise _Refuse(f"{v!r} names no directory")
        return [("disk_path", path, f"{path} (LMCache v0 disk backend; disk_capacity: kvtier's default, "
                                    "LMCache v0 had no bound)")]
    raise _Refuse(f"{v!r}: LMCache v0's local_device is 'cpu' or file:///path/; use local_cpu / local_disk (v1 keys)")


def _cpu_size(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    if _pd_on(doc) and _get(doc, "local_cpu") is not None and not _on(doc, "local_cpu"):
        raise _Ignore("LMCache's PD receiver keeps no CPU cache (local_cpu: false); kvtier's CPU tier is sized by "
                      "pd_buffer_size, else kvtier's default")
    nbytes, shown = _gb_to_bytes(v)
    return [("cpu_capacity", nbytes, shown)]


def _local_disk(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    if v is None:
        raise _Ignore("null: no disk tier (kvtier's default too)")
    if not isinstance(v, str) or not v.strip():
        raise _Refuse(f"{v!r} is not a path or file:///path/ URL")
    if "," in v:
        raise _Refuse(f"{v!r} lists several directories; kvtier has one disk tier directory (disk_path)")
    path = v.strip()
    path = path.removeprefix("file://")
    if not path:
        raise _Refuse(f"{v!r} names no directory")
    size = _get(doc, "max_local_disk_size")
    if size is None or _number(size, "GB") == 0:
        raise _Refuse(
            f"{v!r} is set but max_local_disk_size is {size if size is not None else '0.0 (LMCache default)'} GB: "
            "the disk would hold nothing; give max_local_disk_size in GB"
        )
    return [("disk_path", path, path)]


def _disk_size(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    if _unset(_get(doc, "local_disk")):
        raise _Ignore("no local_disk is set, so LMCache uses no disk either")
    nbytes, shown = _gb_to_bytes(v)
    return [("disk_capacity", nbytes, shown)]


def _remote_url(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    from kvtier.urls import mask_url
    from kvtier.tiers.registry import available_tiers

    if v is None:
        raise _Ignore("null: no remote tier (kvtier's default too)")
    if not isinstance(v, str) or "://" not in v:
        raise _Refuse(f"{v!r} is not a URL (scheme://...)")
    scheme, _, rest = v.partition("://")
    scheme = scheme.lower()
    known = sorted(available_tiers())
    if scheme == "lm":
        raise _Refuse(
            "lm:// is LMCache's own cache-server protocol, which kvtier does not speak; share a cache through "
            "`kvtier server` (one machine) or a remote tier: redis://HOST:PORT, redis+cluster://..., fs:///path"
        )
    if scheme == "fs":  # LMCache's FSConnector uses only the URL's path (host:port are placeholders)
        path = "/" + rest.split("/", 1)[1] if "/" in rest else ""
        if path in ("", "/"):
            raise _Refuse(f"{v!r} names no directory (fs://HOST:PORT/path or fs:///path)")
        url = f"fs://{path}"
        return [("remote_url", url, f"{url} (LMCache ignores the host:port of fs:// URLs; so does this mapping)")]
    if scheme == "resp" and "redis" in known:  # LMCache's native RESP client: the Redis protocol
        from urllib.parse import quote

        extra = _get(doc, "extra_config")
        extra = extra if isinstance(extra, Mapping) else {}
        user, pw = extra.get("username"), extra.get("password")
        auth = "" if _unset(pw) else f"{quote(str(user or ''), safe='')}:{quote(str(pw), safe='')}@"
        url = f"redis://{auth}{rest}"
        return [("remote_url", url, f"{mask_url(url)} (LMCache's resp:// client speaks RESP, as kvtier's Redis tier"
                                    + (", credentials from extra_config" if auth else "") + ")")]
    if scheme == "redis-sentinel" and scheme not in known:
        raise _Refuse(
            "Redis Sentinel is not supported by kvtier's Redis tier; point remote_url at the master "
            "(redis://HOST:PORT) or at a Redis Cluster (redis+cluster://HOST:PORT)"
        )
    if scheme == "valkey" and scheme not in known:
        raise _Refuse("no valkey:// tier; Valkey speaks the Redis protocol: use redis://HOST:PORT")
    if scheme not in known:
        raise _Refuse(f"no kvtier remote tier for {scheme}:// (kvtier has: {', '.join(s + '://' for s in known)})")
    return [("remote_url", v, mask_url(v))]


def _remote_serde(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    name = "naive" if v is None else v
    if not isinstance(name, str) or name.lower() not in SERDE_TO_CODEC:
        if isinstance(name, str) and name.lower() == "kivi":
            raise _Refuse("kivi (2-bit KIVI quantization) is not implemented; use naive (raw) or cachegen")
        raise _Refuse(f"{v!r} has no kvtier codec (LMCache serdes kvtier honours: naive -> raw, cachegen -> cachegen)")
    codec = SERDE_TO_CODEC[name.lower()]
    return [("remote_codec", codec, f"{codec} (LMCache {name})")]


def _async_loading(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    on = _bool(v)
    return [("async_load", on, f"{on} (disk/remote hits loaded while the engine serves others)")]


def _seconds(kvtier_key: str, scale: float, unit: str) -> Rule:
    def rule(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
        n = _number(v, unit)
        if n == 0:
            raise _Refuse(f"{v!r}: must be positive")
        s = n * scale
        return [(kvtier_key, s, f"{v} {unit} = {s:g} s")]

    return rule


def _cache_policy(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    from kvtier.tiers.policies import POLICIES

    if not isinstance(v, str) or v.strip().lower() not in POLICIES:
        raise _Refuse(f"{v!r} has no kvtier eviction policy (kvtier has: {', '.join(sorted(POLICIES))})")
    p = v.strip().lower()
    return [("cpu_eviction", p, p), ("disk_eviction", p, p)]


def _save_unfull_chunk(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    if not _bool(v):
        raise _Ignore(_FULL + " (same)")
    if _pd_on(doc):
        raise _Ignore("kvtier's PD prefiller stores a prompt's partial last chunk for its decoder (as LMCache's PD)")
    raise _Refuse(_FULL + " outside PD; a partial last chunk is recomputed")


def _reserve_cpu(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    if _number(v, "GB") == 0:
        raise _Ignore("0 (LMCache's default)")
    raise _Refuse("kvtier allocates all of cpu_capacity at start; lower max_local_cpu_size instead of reserving")


def _min_retrieve(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    if _number(v, "tokens") == 0:
        raise _Ignore("0 (LMCache's default: every hit is loaded)")
    raise _Refuse("kvtier loads every hit; skipping hits shorter than N tokens is not implemented")


def _extra_config(v: Any, doc: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    raise _Ignore("empty")  # non-empty tables are expanded key by key in translate_lmcache


_ALLOC = "LMCache's allocator tuning; kvtier pre-allocates and pre-touches cpu_capacity at start"
_OBS = "LMCache's own observability/debug service; kvtier has its metrics on `kvtier server` and vLLM's /metrics"
_FULL = "kvtier stores full prompt chunks only"

#: LMCache key -> rule. Every key LMCache v1 defines (lmcache/v1/config.py) plus earlier ones.
RULES: dict[str, Rule] = {
    # mapped
    "chunk_size": _chunk_size,
    "local_cpu": _local_cpu,
    "local_device": _local_device,
    "max_local_cpu_size": _cpu_size,
    "local_disk": _local_disk,
    "max_local_disk_size": _disk_size,
    "remote_url": _remote_url,
    "remote_serde": _remote_serde,
    "enable_async_loading": _async_loading,
    "blocking_timeout_secs": _seconds("remote_timeout_s", 1.0, "s"),
    "lookup_timeout_ms": _seconds("lookup_timeout_s", 1e-3, "ms"),
    "pin_timeout_sec": _seconds("lease_ttl_s", 1.0, "s"),
    "cache_policy": _cache_policy,
    # honoured at LMCache's default only
    "save_decode_cache": _default_only(False, _FULL + " (same)", _FULL + "; decode-phase KV is not saved"),
    "save_unfull_chunk": _save_unfull_chunk,
    "reserve_local_cpu_size": _reserve_cpu,
    "min_retrieve_tokens": _min_retrieve,
    "priority_limit": _unset_only("kvtier caches every request; priority-based admission is not implemented"),
    "hit_miss_ratio": _unset_only("LMCache's hit-rate test knob has no kvtier counterpart"),
    "retrieve_locations": _unset_only("kvtier searches its tiers in order (CPU, disk, remote); no per-backend choice"),
    "store_location": _unset_only("kvtier writes through its tiers in order; no per-backend choice"),
    "external_lookup_client": _unset_only("kvtier answers lookups itself; external lookup services are not supported"),
    "storage_plugins": _unset_only("LMCache storage plug-ins cannot load in kvtier (kvtier tiers are plug-ins by URL scheme)"),
    "remote_storage_plugins": _unset_only("LMCache remote storage plug-ins cannot load in kvtier"),
    "runtime_plugin_locations": _unset_only("LMCache runtime plug-ins are not supported"),
    "remote_config_url": _unset_only("fetching configuration from a remote service is not supported"),
    "audit_actual_remote_url": _unset_only("LMCache's audit connector is not supported"),
    "gds_path": _unset_only("GPU Direct Storage is not implemented; use local_disk for a disk tier"),
    "weka_path": _unset_only("the WekaFS GDS backend is not implemented; use local_disk for a disk tier"),
    "maru_path": _unset_only("the Maru CXL shared-memory backend is not implemented"),
    # features kvtier does not implement: false ignored, true refused
    "use_layerwise": _default_only(
        False, "kvtier loads whole chunks",
        "layer-by-layer pipelining is not implemented (kvtier loads whole chunks; disk/remote hits asynchronously)",
    ),
    "enable_blending": _feature("CacheBlend (reusing non-prefix KV with partial recompute) is not implemented"),
    "enable_hidden_state_cache": _feature("hidden-state caching (vLLM-Omni) is not implemented"),
    "local_cpu_use_hugepages": _default_only(False, _ALLOC, "huge pages for the CPU tier are not implemented"),
    # sub-keys of refused features, ignored
    **{k: _sub_key("enable_blending") for k in (
        "blend_recompute_ratios", "blend_recompute_ratio", "blend_thresholds", "blend_check_layers",
        "blend_min_tokens", "blend_special_str",
    )},
    **{k: _sub_key("gds_path") for k in ("gds_path_sharding", "gds_buffer_size", "use_gds", "gds_backend",
                                          "cufile_buffer_size")},
    "maru_pool_size": _sub_key("maru_path"),
    **{k: _sub_key("enable_hidden_state_cache") for k in (
        "max_hidden_state_cpu_size", "hidden_state_layers", "hidden_states_retrieve_mode",
    )},
    **{k: _sub_key("cache_policy: cost_aware", "only used by LMCache's cost_aware cache_policy")
       for k in ("cost_aware_half_life_seconds", "cost_aware_ewma_alpha")},
    "app_id": _sub_key("remote_config_url"),
    # do not change what is cached or hit
    "pre_caching_hash_algorithm": _ignore("kvtier keys chunks by its own blake3 digest (caches are not shared with LMCache)"),
    "local_disk_path_sharding": _ignore("kvtier has one disk directory per process or server"),
    "enable_lazy_memory_allocator": _ignore(_ALLOC),
    "lazy_memory_initial_ratio": _ignore(_ALLOC),
    "lazy_memory_expand_trigger_ratio": _ignore(_ALLOC),
    "lazy_memory_step_ratio": _ignore(_ALLOC),
    "lazy_memory_safe_size": _ignore(_ALLOC),
    "py_enable_gc": _ignore("kvtier does not change the engine's garbage collector"),
    "pin_check_interval_sec": _ignore("kvtier expires leases on their own clock (lease_ttl_s)"),
    "internal_api_server_enabled": _ignore(_OBS),
    "internal_api_server_host": _ignore(_OBS),
    "internal_api_server_port_start": _ignore(_OBS),
    "internal_api_server_include_index_list": _ignore(_OBS),
    "internal_api_server_socket_path_prefix": _ignore(_OBS),
    "script_allowed_imports": _ignore(_OBS),
    "enable_chunk_statistics": _ignore(_OBS),
    "chunk_statistics_auto_start_statistics": _ignore(_OBS),
    "chunk_statistics_auto_exit_timeout_hours": _ignore(_OBS),
    "chunk_statistics_auto_exit_target_unique_chunks": _ignore(_OBS),
    "chunk_statistics_strategy": _ignore(_OBS),
    "enable_kv_events": _ignore(
        "kvtier's connector publishes its tier changes as KV events whenever vLLM's --kv-events-config is set"
    ),
    "mp_host": _ignore("LMCache's multi-process server (SGLang) setting"),
    "mp_port": _ignore("LMCache's multi-process server (SGLang) setting"),
    "lookup_server_worker_ids": _ignore("LMCache's lookup-server wiring; kvtier's scheduler asks its own worker"),
    "enable_scheduler_bypass_lookup": _ignore("LMCache's lookup wiring; kvtier's scheduler asks its own worker"),
    "use_gpu_connector_v3": _ignore("LMCache's internal GPU copy path"),
    "extra_config": _extra_config,
    # LMCache v0 keys in LMCache's own examples that LMCache 0.5.6 no longer reads (it warns and goes on)
    "pipelined_backend": _ignore("LMCache v0's pipelined retrieve switch (LMCache 0.5.6 no longer reads it); "
                                 "kvtier loads disk/remote hits asynchronously with enable_async_loading"),
    "async_loading": _ignore("not read by LMCache 0.5.6 (it warns and goes on; enable_async_loading is the key)"),
    **TRANSFER_RULES,
}

#: Mapped keys that are vLLM connector settings (``kv_connector_extra_config``), not KVTierConfig fields.
CONNECTOR_KEYS = frozenset({"pd_role"})
#: extra_config keys that are purely observability (``histogram_bucket_<name>``).
_COSMETIC_EXTRA = re.compile(r"histogram_bucket_\w+")


def lmcache_keys() -> frozenset[str]:
    """Every LMCache key the translation knows (current names and deprecated aliases)."""
    return frozenset(RULES) | frozenset(ALIASES)


def translate_lmcache(doc: Mapping[str, Any]) -> LmcacheTranslation:
    """Translate an LMCache config (the parsed YAML mapping) into kvtier settings.

    Never raises for a key: each lands in ``mapped``, ``refused`` (including keys that are
    not LMCache's, with a did-you-mean hint) or ``ignored``; call
    :meth:`LmcacheTranslation.raise_if_refused` to fail on refusals.

    Raises:
        ConfigError: ``doc`` is not a mapping of string keys.
    """
    from kvtier.config_base import ConfigError

    if not isinstance(doc, Mapping) or not all(isinstance(k, str) for k in doc):
        raise ConfigError(f"an LMCache config must be a mapping of keys to values, got {type(doc).__name__}")
    out = LmcacheTranslation()
    known = sorted(lmcache_keys())
    for key, value in doc.items():
        if key.startswith("ec_"):  # LMCACHE_EC_* / ec_* : erasure-coded storage settings
            out.refused.append((key, "erasure-coded storage (LMCache ec_* settings) is not implemented"))
            continue
        name = ALIASES.get(key, key)
        rule = RULES.get(name)
        if rule is None:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            out.refused.append((key, f"not an LMCache setting{hint}"))
            continue
        if name == "extra_config" and not _unset(value):
            _extra(key, value, doc, out)
            continue
        try:
            results = rule(value, doc)
        except _Ignore as why:
            out.ignored.append((key, str(why)))
            continue
        except _Refuse as why:
            out.refused.append((key, str(why)))
            continue
        for kv_key, kv_value, shown in results:
            target = out.connector if kv_key in CONNECTOR_KEYS else out.settings
            target[kv_key] = kv_value
            out.mapped.append((key, kv_key, shown))
    if "pd_role" in out.connector:
        out.notes.append(PD_NOTE)
    if "peer_listen" in out.settings and "peer_discovery" not in out.settings:
        out.notes.append("P2P: no controller is named, so list the other instances' peer_listen URLs under peers")
    if str(out.settings.get("peer_listen", "shm://")).split("://", 1)[0] != "shm":
        out.notes.append("P2P: kvtier's TCP/NIXL peers authenticate (LMCache's P2P does not): make a key per "
                         "instance with `kvtier keys new`, list the members' public keys in one file, and set "
                         "fleet_key and fleet_members beside this file (e.g. KVTIER_FLEET_KEY, or the connector's "
                         "extra config); on one machine shm:///PATH peers need no keys")
    if ("max_local_cpu_size" not in doc and "cpu_capacity" not in out.settings
            and not any(k == "local_cpu" for k, _ in out.refused)):
        nbytes, shown = _gb_to_bytes(LMCACHE_DEFAULT_CPU_GB)
        out.settings["cpu_capacity"] = nbytes
        out.mapped.append(("max_local_cpu_size (LMCache default)", "cpu_capacity", shown))
    return out


def _extra(key: str, value: Any, doc: Mapping[str, Any], out: LmcacheTranslation) -> None:
    if not isinstance(value, Mapping):
        out.refused.append((key, f"{value!r} is not a mapping"))
        return
    resp = str(_get(doc, "remote_url") or "").lower().startswith("resp://")
    for sub, v in value.items():
        name = f"{key}.{sub}"
        if isinstance(sub, str) and _COSMETIC_EXTRA.fullmatch(sub):
            out.ignored.append((name, "LMCache metrics histogram buckets (observability only)"))
        elif sub == "use_odirect":
            try:
                on = _bool(v)
            except _Refuse as why:
                out.refused.append((name, str(why)))
                continue
            out.settings["disk_direct_io"] = on
            out.mapped.append((name, "disk_direct_io", f"{on} (O_DIRECT disk reads and writes)"))
        elif sub == "gpu_to_numa_mapping":
            out.ignored.append((name, "read with numa_mode: manual (cpu_numa_node)"))
        elif sub == "lookup_backoff_time":
            out.ignored.append((name, "LMCache's P2P lookup retry pause; kvtier's peer calls are bounded by "
                                      "peer_timeout_s and skipped for peer_retry_s after a failure"))
        elif resp and sub in ("username", "password"):
            out.ignored.append((name, "in remote_url's user info (resp:// -> redis://)"))
        elif resp and sub in ("resp_num_threads", "save_chunk_meta"):
            out.ignored.append((name, "LMCache's RESP client tuning; kvtier's Redis tier pipelines each batch on "
                                      "its own connections and stores fixed-size checksummed records"))
        else:
            out.refused.append((name, "LMCache backend option with no kvtier counterpart"))


def lmcache_connector_settings(path: Path) -> dict[str, Any]:
    """The vLLM connector settings (``kv_connector_extra_config`` keys such as ``pd_role``) an LMCache file maps to.

    Raises:
        ConfigError: as :func:`read_lmcache_file`.
    """
    return dict(read_lmcache_file(Path(path))[1].connector)


def read_lmcache_file(path: Path) -> tuple[dict[str, Any], LmcacheTranslation]:
    """Parse an LMCache YAML (or JSON) config file and translate it.

    Returns:
        (kvtier settings, the translation with its mapped/refused/ignored tables).

    Raises:
        ConfigError: unreadable file, invalid YAML, not a mapping, or any refused key
            (the message names the file, each key and why).
    """
    from kvtier.config_base import ConfigError, read_config_text

    try:
        import yaml
    except ModuleNotFoundError:  # pragma: no cover - pyyaml is a core dependency
        raise ConfigError(f"reading the LMCache config {path} needs PyYAML: pip install pyyaml") from None
    text = read_config_text(path, "LMCache config file")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"LMCache config file {path} is not valid YAML: {exc}") from None
    except RecursionError:  # PyYAML's composer recurses per nesting level
        raise ConfigError(f"LMCache config file {path} is not valid YAML: nested too deeply") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"LMCache config file {path} must hold a mapping of LMCache keys")
    translation = translate_lmcache(doc)
    translation.raise_if_refused(f"LMCache config file {path}")
    return dict(translation.settings), translation
