"""P2P settings: ``peer_listen`` / ``peers`` validation and the lower-tier order they give."""

from __future__ import annotations

import pytest

from conftest import CHUNK, small_namespace
from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.transfer.assembly import open_lower_tiers
from kvtier.transfer.peer_open import UrlPeerTier


def test_defaults_share_nothing():
    c = load_config(environ={})
    assert c.peer_listen is None and c.peers == ()
    assert c.peer_timeout_s > 0 and c.peer_retry_s > 0


def test_env_comma_list_and_file_list(tmp_path, fleet):
    keys = {"KVTIER_FLEET_KEY": str(fleet.key_path("a")), "KVTIER_FLEET_MEMBERS": str(fleet.members_path)}
    c = load_config(environ={"KVTIER_PEERS": "tcp://10.0.0.5:7700, shm:///run/kv.sock", "KVTIER_PEER_LISTEN": "",
                             **keys})
    assert c.peers == ("tcp://10.0.0.5:7700", "shm:///run/kv.sock") and c.peer_listen is None
    f = tmp_path / "kv.toml"
    f.write_text('peer_listen = "tcp://0.0.0.0:7700"\npeers = ["tcp://10.0.0.6:7700"]\npeer_allow_remote = true\n')
    c = load_config({"config_file": str(f)}, environ=keys)
    assert c.peer_listen == "tcp://0.0.0.0:7700" and c.peers == ("tcp://10.0.0.6:7700",)


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"peers": ["http://10.0.0.5:7700"]}, "scheme must be one of"),
        ({"peers": ["10.0.0.5:7700"]}, "scheme must be one of"),
        ({"peers": ["tcp://10.0.0.5"]}, "port in 1-65535"),
        ({"peers": ["tcp://10.0.0.5:0"]}, "port in 1-65535"),
        ({"peers": ["tcp://10.0.0.5:70000"]}, "port in 1-65535"),
        ({"peers": ["tcp://10.0.0.5:77x"]}, "port in 1-65535"),
        ({"peers": ["shm://relative.sock"]}, "absolute socket path"),
        ({"peers": ["tcp://a:1", "tcp://a:1"]}, "names a peer twice"),
        # one peer written two ways (trailing '/', host case, leading zeros) is still one peer
        ({"peers": ["tcp://a:1", "tcp://a:1/"]}, "names a peer twice"),
        ({"peers": ["tcp://Peer.Example:7700", "tcp://peer.example:7700"]}, "names a peer twice"),
        ({"peers": ["nixl://[::1]:7700", "nixl://[::1]:07700"]}, "names a peer twice"),
        ({"peer_listen": "udp://0.0.0.0:7700"}, "scheme must be one of"),
        ({"peer_listen": "tcp://0.0.0.0:65536"}, "port in 0-65535"),
        ({"peer_listen": "tcp://h:7700", "peers": ["tcp://h:7700"]}, "own peer_listen"),
        ({"peer_listen": "tcp://h:7700", "peers": ["tcp://H:7700/"]}, "own peer_listen"),
        ({"peer_listen": "tcp://h:7700/", "peers": ["tcp://h:7700"]}, "own peer_listen"),
        # one address, two IP spellings; one socket, two path spellings (hostile trial)
        ({"peers": ["tcp://[::1]:7700", "tcp://[0:0:0:0:0:0:0:1]:7700"]}, "names a peer twice"),
        ({"peer_listen": "tcp://[::1]:7700", "peers": ["tcp://[0::1]:7700"]}, "own peer_listen"),
        ({"peer_listen": "shm:///tmp/a.sock", "peers": ["shm:///tmp//a.sock"]}, "own peer_listen"),
        ({"peers": ["shm:///tmp/a.sock", "shm:///tmp/./a.sock/"]}, "names a peer twice"),
        ({"peers": ["tcp://127.1:7700"]}, "not a dotted-decimal IPv4"),
        ({"peers": ["tcp://2130706433:7700"]}, "not a dotted-decimal IPv4"),
        ({"peers": ["tcp://0x7f.0.0.1:7700"]}, "not a dotted-decimal IPv4"),
        ({"peers": ["tcp://127.000.000.001:7700"]}, "not a dotted-decimal IPv4"),
        ({"peers": ["tcp://0.0.0.0:7700"]}, "not a wildcard"),
        ({"peers": ["tcp://[::]:7700"]}, "not a wildcard"),
        ({"peers": ["shm:///tmp/a\x00b"]}, "no NUL"),
        ({"peers": ["shm:///tmp/a.sock#y"]}, "no NUL, '?' or '#'"),
        ({"peers": ["shm:///" + "d" * 120]}, "at most 107 bytes"),
        ({"peers": ["tcp://h:" + "0" * 5000 + "7700"]}, "port in 1-65535"),
        ({"peer_timeout_s": 0}, "greater than 0"),
        ({"peer_retry_s": -1}, "greater than 0"),
    ],
)
def test_bad_settings_are_refused_with_the_key_named(settings, words, fleet):
    keys = {} if "peer_timeout_s" in settings or "peer_retry_s" in settings else fleet.config("a")
    with pytest.raises(ConfigError) as err:
        load_config({**settings, **keys}, environ={})
    key = next(iter(settings)) if "own" not in words and "twice" not in words else "peers"
    assert words in str(err.value) and key in str(err.value)
    assert len(str(err.value)) < 2000  # a long or repeated input is not echoed whole


def test_peer_urls_are_kept_in_canonical_form(fleet):
    c = load_config({"peer_listen": "tcp://LocalHost:07700/", "peers": ["tcp://[FE80::1%Eth0]:7701/"],
                     **fleet.config("a")}, environ={})
    assert c.peer_listen == "tcp://localhost:7700"
    assert c.peers == ("tcp://[fe80::1%Eth0]:7701",)  # an interface name keeps its case


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="KVTIER_PEERS"):
        load_config(environ={"KVTIER_PEERS": "tcp://h:1,redis://h:2"})


def test_peers_are_the_last_lower_tiers_in_order(tmp_path, fleet):
    cfg = KVTierConfig(
        chunk_size=CHUNK, cpu_capacity=1 << 20, disk_path=tmp_path / "d", disk_capacity=1 << 20,
        peers=["tcp://127.0.0.1:9", f"shm://{tmp_path}/p.sock"], peer_timeout_s=0.25, peer_retry_s=7,
        **fleet.config("a"),
    )
    tiers = open_lower_tiers(cfg, small_namespace(), lambda k: False)
    try:
        assert [t.kind for t in tiers] == ["disk", "peer", "peer"]
        assert isinstance(tiers[1], UrlPeerTier) and tiers[1].location == "tcp://127.0.0.1:9"
        assert tiers[2].location == f"shm://{tmp_path}/p.sock"
        assert tiers[1].timeout_s == 0.25 and tiers[1].retry_s == 7
        assert not tiers[1].writable  # write-behind never sends chunks to a peer
    finally:
        for t in tiers:
            t.close()


@pytest.mark.parametrize(
    "settings, words",
    [  # issue 24, kind 3: no setting serves chunks or keys to a stranger without saying so
        ({"peer_listen": "tcp://127.0.0.1:7700"}, "authenticate with fleet keys"),
        ({"peer_listen": "nixl://127.0.0.1:7700"}, "authenticate with fleet keys"),
        ({"peers": ["tcp://10.0.0.5:7700"]}, "authenticate with fleet keys"),
        ({"kv_events_endpoint": "tcp://*:5557"}, "kv_events_plain"),
        ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "kv_events_plain"),
        ({"fleet_key": "/tmp/k.key"}, "go together"),
        ({"controller_key": "x" * 40}, "needs fleet_key"),
    ],
)
def test_open_fleet_surfaces_are_refused_without_credentials(settings, words):
    with pytest.raises(ConfigError) as err:
        load_config(settings, environ={})
    assert words in str(err.value) and next(iter(settings)) in str(err.value)


def test_a_peer_server_beyond_loopback_needs_the_opt_in(fleet):
    for host in ("0.0.0.0", "10.0.0.5", "[::]"):
        with pytest.raises(ConfigError, match="peer_allow_remote"):
            load_config({"peer_listen": f"tcp://{host}:7700", **fleet.config("a")}, environ={})
    c = load_config({"peer_listen": "tcp://0.0.0.0:7700", "peer_allow_remote": True, **fleet.config("a")}, environ={})
    assert c.peer_listen == "tcp://0.0.0.0:7700"
    assert load_config({"peer_listen": "shm:///tmp/x.sock"}, environ={}).peer_listen  # tokenless: same user only
    assert load_config({"kv_events_endpoint": "tcp://*:5557", "kv_events_plain": True}, environ={}).kv_events_plain
