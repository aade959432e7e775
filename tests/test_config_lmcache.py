"""LMCache YAML configs: the translation (kvtier/config_lmcache.py) and the load path (kvtier/config.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvtier.config import ConfigError, load_config
from kvtier.config_lmcache import LMCACHE_GB, lmcache_keys, translate_lmcache


def yaml_doc(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())

GIB = 1024**3


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def settings(doc: dict[str, Any]) -> dict[str, Any]:
    t = translate_lmcache(doc)
    assert not t.refused, t.refused
    return t.settings


def refused(doc: dict[str, Any]) -> dict[str, str]:
    return dict(translate_lmcache(doc).refused)


def ignored(doc: dict[str, Any]) -> dict[str, str]:
    return dict(translate_lmcache(doc).ignored)


# -- sizes: LMCache "GB" is 1024**3 bytes ----------------------------------------------------------


def test_lmcache_gb_is_a_gibibyte() -> None:
    # LMCache allocates int(max_local_cpu_size * 1024**3) bytes (lmcache/v1/cache_engine.py) and
    # bounds its disk by int(max_local_disk_size * 1024**3) (local_disk_backend.py): 5 means 5 GiB.
    assert LMCACHE_GB == 1024**3
    assert settings({"max_local_cpu_size": 5})["cpu_capacity"] == 5 * GIB == 5_368_709_120
    assert settings({"max_local_cpu_size": 5.0})["cpu_capacity"] != 5 * 10**9
    assert settings({"max_local_cpu_size": 0.5})["cpu_capacity"] == GIB // 2
    assert settings({"max_local_cpu_size": "2"})["cpu_capacity"] == 2 * GIB


@pytest.mark.parametrize("bad", ["5GB", True, -1, float("nan"), None, [5]])
def test_a_size_that_is_not_a_number_of_gb_is_refused_naming_the_key(bad: Any) -> None:
    why = refused({"max_local_cpu_size": bad})
    assert "number" in why["max_local_cpu_size"]
    assert "cpu_capacity" not in translate_lmcache({"max_local_cpu_size": bad}).settings


def test_lmcache_default_cpu_size_applies_when_the_file_omits_it() -> None:
    t = translate_lmcache({"chunk_size": 256})
    assert t.settings["cpu_capacity"] == 5 * GIB
    assert ("max_local_cpu_size (LMCache default)", "cpu_capacity") in [(a, b) for a, b, _ in t.mapped]


def test_disk_path_and_size() -> None:
    s = settings({"local_disk": "file:///mnt/nvme/lmcache/", "max_local_disk_size": 100})
    assert s["disk_path"] == "/mnt/nvme/lmcache/" and s["disk_capacity"] == 100 * GIB
    assert settings({"local_disk": "/data/kv", "max_local_disk_size": 1.5})["disk_path"] == "/data/kv"
    assert settings({"local_disk": "/data/kv", "max_local_disk_size": 1.5})["disk_capacity"] == 3 * GIB // 2


def test_disk_without_size_several_dirs_and_size_without_disk() -> None:
    assert "max_local_disk_size" in refused({"local_disk": "file:///x/"})["local_disk"]
    assert "one disk tier" in refused({"local_disk": "/a/,/b/", "max_local_disk_size": 1})["local_disk"]
    assert "no local_disk" in ignored({"max_local_disk_size": 10})["max_local_disk_size"]
    assert "disk_path" not in translate_lmcache({"max_local_disk_size": 10}).settings


def test_local_cpu() -> None:
    assert "always on" in ignored({"local_cpu": True})["local_cpu"]
    assert "always keeps a CPU tier" in refused({"local_cpu": False})["local_cpu"]
    assert "v1" in refused({"local_device": "cuda"})["local_device"]
    assert settings({"local_device": "file:///data/kv/"})["disk_path"] == "/data/kv/"  # LMCache v0's disk backend


def test_chunk_size() -> None:
    assert settings({"chunk_size": 512})["chunk_size"] == 512
    assert "local_cpu" not in refused({"chunk_size": "256"}) and "chunk_size" in refused({"chunk_size": "256"})


# -- remote ----------------------------------------------------------------------------------------


def test_remote_urls() -> None:
    assert settings({"remote_url": "redis://localhost:6379"})["remote_url"] == "redis://localhost:6379"
    # LMCache's FSConnector uses the URL's path only; kvtier's fs tier takes fs:///path.
    assert settings({"remote_url": "fs://localhost:0/var/kv"})["remote_url"] == "fs:///var/kv"
    assert settings({"remote_url": "fs:///var/kv"})["remote_url"] == "fs:///var/kv"
    assert "LMCache's own cache-server protocol" in refused({"remote_url": "lm://localhost:65432"})["remote_url"]
    assert "Sentinel" in refused({"remote_url": "redis-sentinel://h1:26379,h2:26379"})["remote_url"]
    assert "mooncakestore://" in refused({"remote_url": "mooncakestore://x:1"})["remote_url"]
    assert "redis://" in refused({"remote_url": "valkey://x:6379"})["remote_url"]
    assert "not a URL" in refused({"remote_url": "localhost:6379"})["remote_url"]


def test_remote_url_password_is_masked_in_the_table() -> None:
    t = translate_lmcache({"remote_url": "redis://user:s3cret@localhost:6379"})
    assert t.settings["remote_url"] == "redis://user:s3cret@localhost:6379"
    assert all("s3cret" not in shown for _, _, shown in t.mapped)


def test_remote_serde() -> None:
    assert settings({"remote_serde": "naive"})["remote_codec"] == "raw"
    assert settings({"remote_serde": "cachegen"})["remote_codec"] == "cachegen"
    assert "KIVI" in refused({"remote_serde": "kivi"})["remote_serde"]
    assert "remote_serde" in refused({"remote_serde": "torch"})


# -- controller, timeouts, policies ----------------------------------------------------------------


def test_controller_maps_to_a_tcp_address_and_instance_id() -> None:
    doc = {"enable_controller": True, "lmcache_instance_id": "vllm-1", "controller_pull_url": "localhost:8300",
           "controller_reply_url": "localhost:8400", "lmcache_worker_ports": 8500}
    t = translate_lmcache(doc)
    assert not t.refused
    assert t.settings["controller"] == "tcp://localhost:8300" and t.settings["instance_id"] == "vllm-1"
    assert {"controller_reply_url", "lmcache_worker_ports"} <= set(dict(t.ignored))
    # the deprecated alias and an explicit tcp:// form
    assert settings({"enable_controller": True, "controller_url": "tcp://10.0.0.5:9001"})["controller"] == (
        "tcp://10.0.0.5:9001"
    )


def test_controller_refusals_and_off() -> None:
    assert "controller_pull_url" in refused({"enable_controller": True})["enable_controller"]
    assert "HOST:PORT" in refused({"enable_controller": True, "controller_url": "http://c/x"})["enable_controller"]
    off = translate_lmcache({"enable_controller": False, "lmcache_instance_id": "a", "controller_url": "h:1"})
    assert not off.refused and "controller" not in off.settings and "instance_id" not in off.settings
    assert set(dict(off.ignored)) == {"enable_controller", "lmcache_instance_id", "controller_url"}


def test_timeouts_and_policy_units() -> None:
    s = settings({"lookup_timeout_ms": 3000, "blocking_timeout_secs": 10, "pin_timeout_sec": 60,
                  "cache_policy": "LRU", "enable_async_loading": False})
    assert s["lookup_timeout_s"] == 3.0 and s["remote_timeout_s"] == 10.0 and s["lease_ttl_s"] == 60.0
    assert s["cpu_eviction"] == s["disk_eviction"] == "lru" and s["async_load"] is False
    assert "cache_policy" in refused({"cache_policy": "MRU"})


# -- features kvtier does not implement ------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("enable_blending", "CacheBlend"),
        ("use_layerwise", "layer-by-layer"),
        ("save_decode_cache", "decode"),
        ("save_unfull_chunk", "partial"),
    ],
)
def test_unimplemented_features_are_refused_when_on_and_ignored_when_off(key: str, words: str) -> None:
    assert words in refused({key: True})[key]
    assert key in ignored({key: False})


def test_sub_keys_of_a_feature_are_ignored_and_the_feature_is_refused() -> None:
    t = translate_lmcache({"enable_blending": True, "blend_special_str": " # # ", "blend_recompute_ratios": [0.15]})
    assert set(dict(t.refused)) == {"enable_blending"}
    assert {"blend_special_str", "blend_recompute_ratios"} <= set(dict(t.ignored))


def test_set_only_options_and_extra_config() -> None:
    assert "priority_limit" in refused({"priority_limit": 1}) and "priority_limit" in ignored({"priority_limit": None})
    assert "min_retrieve_tokens" in refused({"min_retrieve_tokens": 256})
    assert "ec_num_data" in refused({"ec_num_data": 4})
    t = translate_lmcache({"extra_config": {"histogram_bucket_time_to_store": [0.1], "save_chunk_meta": False}})
    assert "extra_config.save_chunk_meta" in dict(t.refused)
    assert "extra_config.histogram_bucket_time_to_store" in dict(t.ignored)
    assert "extra_config" in ignored({"extra_config": None})


def test_a_typo_key_is_refused_with_a_hint() -> None:
    why = refused({"max_local_cpu_sise": 5})["max_local_cpu_sise"]
    assert "not an LMCache setting" in why and "max_local_cpu_size" in why


def test_every_documented_lmcache_key_is_known() -> None:
    # The keys of LMCache's configuration reference (docs/source/api_reference/configurations.rst).
    documented = """chunk_size local_cpu max_local_cpu_size local_disk max_local_disk_size remote_url remote_serde
    save_decode_cache use_layerwise pre_caching_hash_algorithm save_unfull_chunk blocking_timeout_secs py_enable_gc
    cache_policy numa_mode external_lookup_client priority_limit min_retrieve_tokens extra_config
    enable_lazy_memory_allocator lazy_memory_initial_ratio lazy_memory_expand_trigger_ratio lazy_memory_step_ratio
    lazy_memory_safe_size reserve_local_cpu_size enable_blending blend_recompute_ratios blend_check_layers
    blend_special_str enable_p2p p2p_host transfer_channel enable_controller lmcache_instance_id controller_url
    lmcache_worker_port enable_pd pd_role pd_buffer_size pd_buffer_device nixl_backends pd_peer_host
    pd_peer_init_port pd_peer_alloc_port pd_proxy_host pd_proxy_port gds_path cufile_buffer_size
    internal_api_server_enabled internal_api_server_host""".split()
    assert set(documented) <= lmcache_keys()


# -- the load path ---------------------------------------------------------------------------------

#: LMCache's documented Redis offload example (docs: storage backends, Redis), CPU tier plus Redis.
DOCS_EXAMPLE = """\
# disabling CPU RAM offload not recommended (on by default)
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5.0
local_disk: "file:///tmp/lmcache-disk/"
max_local_disk_size: 20
remote_url: "redis://localhost:6379"
remote_serde: "naive"
save_decode_cache: False
"""


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_a_docs_example_loads_with_the_expected_settings(tmp_path: Path, suffix: str) -> None:
    f = write(tmp_path / f"lmcache{suffix}", DOCS_EXAMPLE)
    c = load_config({"config_file": f}, environ={})
    assert c.chunk_size == 256 and int(c.cpu_capacity) == 5 * GIB
    assert str(c.disk_path) == "/tmp/lmcache-disk" and int(c.disk_capacity) == 20 * GIB
    assert c.remote_url == "redis://localhost:6379" and c.remote_codec == "raw"
    assert c.lmcache_config_file == f
    assert c._sources["cpu_capacity"] == f"LMCache config file {f}, key max_local_cpu_size"


def test_docs_p2p_example_loads_as_peer_serving_with_controller_discovery(tmp_path: Path, fleet: Any) -> None:
    f = write(tmp_path / "instance1.yaml", """\
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5
enable_controller: True
lmcache_instance_id: "lmcache_instance_1"
controller_pull_url: "localhost:8300"
controller_reply_url: "localhost:8400"
lmcache_worker_ports: 8500
enable_p2p: True
p2p_host: "localhost"
p2p_init_ports: 8200
p2p_lookup_ports: 8201
transfer_channel: "nixl"
""")
    # kvtier's NIXL/TCP peers authenticate (LMCache's P2P does not): the file alone is refused, naming the keys,
    # and the translation's notes say how to add them.
    with pytest.raises(ConfigError, match=r"peer_listen .*key enable_p2p.*set fleet_key and fleet_members"):
        load_config({"config_file": f}, environ={})
    assert any("fleet_key and fleet_members" in n for n in translate_lmcache(yaml_doc(f)).notes)
    c = load_config({"config_file": f, **fleet.config("a")}, environ={})
    assert c.peer_listen == "nixl://localhost:8200" and c.peer_discovery == "http://localhost:7601"
    assert c.controller == "tcp://localhost:8300" and c.instance_id == "lmcache_instance_1"
    assert c._sources["peer_listen"] == f"LMCache config file {f}, key enable_p2p"


def test_a_typo_in_the_file_fails_the_load(tmp_path: Path) -> None:
    f = write(tmp_path / "l.yaml", "chunk_size: 256\nmax_local_cpu_sise: 5\n")
    with pytest.raises(ConfigError, match=r"max_local_cpu_sise: not an LMCache setting \(did you mean"):
        load_config({"config_file": f}, environ={})


def test_a_translated_value_kvtier_rejects_names_the_lmcache_key(tmp_path: Path) -> None:
    f = write(tmp_path / "l.yaml", "chunk_size: 8\n")
    with pytest.raises(ConfigError, match=r"chunk_size \(from LMCache config file .*key chunk_size\)"):
        load_config({"config_file": f}, environ={})


def test_invalid_yaml_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config({"config_file": write(tmp_path / "a.yaml", "chunk_size: [1\n")}, environ={})
    with pytest.raises(ConfigError, match="mapping"):
        load_config({"config_file": write(tmp_path / "b.yaml", "- 1\n- 2\n")}, environ={})
    deep = "chunk_size: " + "[" * 5000 + "]" * 5000 + "\n"  # PyYAML's composer recurses per level
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config({"config_file": write(tmp_path / "c.yaml", deep)}, environ={})


def test_env_beats_the_lmcache_file_and_explicit_beats_env(tmp_path: Path) -> None:
    f = write(tmp_path / "l.yaml", "max_local_cpu_size: 5\nchunk_size: 512\n")
    c = load_config({"config_file": f}, environ={"KVTIER_CPU_CAPACITY": "2GiB"})
    assert int(c.cpu_capacity) == 2 * GIB and c.chunk_size == 512
    assert c._sources["cpu_capacity"] == "environment variable KVTIER_CPU_CAPACITY"
    c = load_config({"config_file": f, "cpu_capacity": "3GiB"}, environ={"KVTIER_CPU_CAPACITY": "2GiB"})
    assert int(c.cpu_capacity) == 3 * GIB


def test_lmcache_env_and_setting_name_the_file(tmp_path: Path) -> None:
    f = write(tmp_path / "lmcache_config.yaml", "max_local_cpu_size: 2\n")
    assert int(load_config({}, environ={"LMCACHE_CONFIG_FILE": str(f)}).cpu_capacity) == 2 * GIB
    assert int(load_config({}, environ={"KVTIER_LMCACHE_CONFIG_FILE": str(f)}).cpu_capacity) == 2 * GIB
    c = load_config({"lmcache_config_file": str(f)}, environ={})
    assert int(c.cpu_capacity) == 2 * GIB and c._sources["lmcache_config_file"] == "explicit setting"
    # without any LMCache name, kvtier's defaults (not LMCache's 5 GB)
    assert int(load_config({}, environ={}).cpu_capacity) == 1 << 30


def test_a_kvtier_file_and_an_lmcache_file_together_are_an_error(tmp_path: Path) -> None:
    kv = write(tmp_path / "k.toml", 'cpu_capacity = "2GiB"\n')
    lm = write(tmp_path / "l.yaml", "max_local_cpu_size: 2\n")
    with pytest.raises(ConfigError, match="use one file source"):
        load_config({"config_file": kv}, environ={"LMCACHE_CONFIG_FILE": str(lm)})
    other = write(tmp_path / "m.yaml", "max_local_cpu_size: 3\n")
    with pytest.raises(ConfigError, match="two LMCache config files"):
        load_config({"config_file": lm}, environ={"LMCACHE_CONFIG_FILE": str(other)})


# -- kvtier config-check ---------------------------------------------------------------------------


def test_config_check_json_for_a_good_and_a_refused_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.cli import app

    for name in ("LMCACHE_CONFIG_FILE", "KVTIER_CONFIG_FILE", "KVTIER_LMCACHE_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    good = write(tmp_path / "good.yaml", DOCS_EXAMPLE)
    res = CliRunner().invoke(app, ["config-check", "--config", str(good), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ok"] and data["settings"]["cpu_capacity"] == 5 * GIB
    assert ["max_local_cpu_size", "cpu_capacity"] == data["lmcache"]["mapped"][1][:2]
    bad = write(tmp_path / "bad.yaml", "remote_url: lm://localhost:65432\nenable_blending: true\n")
    res = CliRunner().invoke(app, ["config-check", "--config", str(bad), "--json"])
    assert res.exit_code == 2
    data = json.loads(res.stdout)
    assert not data["ok"] and {r[0] for r in data["lmcache"]["refused"]} == {"remote_url", "enable_blending"}
    res = CliRunner().invoke(app, ["config-check", "--config", str(bad)])
    assert res.exit_code == 2 and "refused" in res.stdout and "lm://" in res.stdout
