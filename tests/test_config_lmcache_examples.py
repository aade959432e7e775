"""LMCache's own example configs (tests/data/lmcache_examples, sources in SOURCES.md) through kvtier.

Every key is mapped, ignored with a reason, or refused with a reason that is true of
kvtier today: no refusal may name a feature kvtier has (P2P, PD, NIXL, the controller,
compression, its tiers), nor call a key of LMCache's own examples "not an LMCache setting".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import ConfigError, load_config
from kvtier.config_lmcache import lmcache_connector_settings, translate_lmcache

EXAMPLES = Path(__file__).parent / "data" / "lmcache_examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))

#: Words naming features kvtier has; a refusal that says one of them is stale.
KVTIER_FEATURES = ("peer", "p2p", "disaggregat", "prefill", "decoder", "nixl", "controller", "compress", "cachegen",
                   "disk tier is not", "remote tier is not", "not an lmcache setting", "not implemented yet")
#: The refusals that stay, by file: features kvtier does not have (true today).
EXPECTED_REFUSED = {
    "blend_kv_v1_blending.yaml": {"enable_blending", "use_layerwise"},  # CacheBlend, layer-wise pipelining
    "example.yaml": {"remote_url"},  # lm://, LMCache's own server protocol
    "save_decode_cache.yaml": {"save_decode_cache"},  # decode-phase KV
    "sgl_integration.yaml": {"use_layerwise"},
    "remote_resp.yaml": {"local_cpu"},  # false outside PD: kvtier always has a CPU tier
}


def _doc(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_examples_are_there_with_their_sources() -> None:
    assert len(FILES) >= 12
    sources = (EXAMPLES / "SOURCES.md").read_text()
    for f in FILES:
        assert f"| {f.name} | examples/" in sources, f.name


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_no_refusal_names_a_feature_kvtier_has(path: Path) -> None:
    t = translate_lmcache(_doc(path))
    for key, why in t.refused:
        hit = [w for w in KVTIER_FEATURES if w in why.lower()]
        assert not hit, f"{path.name}: {key} refused with {why!r}, which names {hit}"
    assert {k for k, _ in t.refused} == EXPECTED_REFUSED.get(path.name, set()), t.refused
    assert all(why for _, why in t.ignored)  # every ignored key says why
    accounted = {k for k, *_ in t.mapped} | {k for k, _ in t.refused} | {k for k, _ in t.ignored}
    for key in _doc(path):
        assert key in accounted or any(a.startswith(f"{key}.") for a in accounted), f"{path.name}: {key} unaccounted"


@pytest.mark.parametrize("path", [f for f in FILES if f.name not in EXPECTED_REFUSED], ids=lambda f: f.name)
def test_the_accepted_examples_load_as_kvtier_settings(path: Path, fleet: Any) -> None:
    # A TCP/NIXL peer_listen needs fleet keys (kvtier's peers authenticate; the notes say so).
    keys = fleet.config("a") if translate_lmcache(_doc(path)).settings.get("peer_listen") else {}
    config = load_config({"config_file": path, **keys}, environ={})
    assert config.lmcache_config_file == path


def test_p2p_sharing_maps_to_peer_serving_and_controller_discovery(fleet: Any) -> None:
    for name, port in (("p2p_sharing_example1.yaml", 8200), ("p2p_sharing_example2.yaml", 8202)):
        assert any("fleet_key" in n for n in translate_lmcache(_doc(EXAMPLES / name)).notes)
        c = load_config({"config_file": EXAMPLES / name, **fleet.config("a")}, environ={})
        assert c.peer_listen == f"nixl://localhost:{port}"  # transfer_channel: nixl
        assert c.peer_discovery == "http://localhost:7601" and c.controller == "tcp://localhost:8300"
    v0 = load_config({"config_file": EXAMPLES / "p2p_v0_example1.yaml", **fleet.config("b")}, environ={})
    assert v0.peer_listen == "tcp://localhost:8200" and v0.peer_discovery is None  # LMCache v0 distributed_url
    assert any("peers" in n for n in translate_lmcache(_doc(EXAMPLES / "p2p_v0_example1.yaml")).notes)


def test_disaggregated_prefill_maps_the_roles_and_the_transfer_buffer() -> None:
    roles = {"disagg_1p1d_prefiller.yaml": "prefill", "disagg_1p1d_decoder.yaml": "decode",
             "disagg_xpyd_decoder1.yaml": "decode"}
    for name, role in roles.items():
        assert lmcache_connector_settings(EXAMPLES / name) == {"pd_role": role}
        t = translate_lmcache(_doc(EXAMPLES / name))
        assert t.notes and "pd_port" in t.notes[0]
    dec = load_config({"config_file": EXAMPLES / "disagg_1p1d_decoder.yaml"}, environ={})
    assert dec.cpu_capacity == 1 << 30  # nixl_buffer_size: the CPU tier holds what the prefiller hands over
    assert load_config({"config_file": EXAMPLES / "disagg_xpyd_decoder1.yaml"}, environ={}).cpu_capacity == 2 << 30


def test_resp_maps_to_the_redis_tier_with_the_credentials() -> None:
    doc = dict(_doc(EXAMPLES / "remote_resp.yaml"), local_cpu=True)
    t = translate_lmcache(doc)
    assert t.settings["remote_url"] == "redis://default:YOUR_REDIS_PASSWORD@localhost:6379" and not t.refused
    assert all("***" in shown for k, kk, shown in t.mapped if kk == "remote_url")  # never printed in clear


def test_a_refused_example_fails_the_load_naming_the_true_reason() -> None:
    with pytest.raises(ConfigError, match="CacheBlend"):
        load_config({"config_file": EXAMPLES / "blend_kv_v1_blending.yaml"}, environ={})


def test_numa_mode_is_mapped() -> None:
    assert translate_lmcache({"numa_mode": "auto"}).settings["cpu_numa_node"] == "auto"
    one = translate_lmcache({"numa_mode": "manual", "extra_config": {"gpu_to_numa_mapping": {0: 1}}})
    assert one.settings["cpu_numa_node"] == "1" and not one.refused
    two = translate_lmcache({"numa_mode": "manual", "extra_config": {"gpu_to_numa_mapping": {0: 0, 1: 1}}})
    assert "one engine" in dict(two.refused)["numa_mode"]
    assert "numa_mode" in dict(translate_lmcache({"numa_mode": None}).ignored)
