"""The HOST of every address setting is checked when the config is read (kvtier.hosts).

The hostile trial of stop 32 found ``peer_listen = "tcp://[::1:0"`` accepted by the config and by
``kvtier config-check`` (exit 0), failing only at start. The kind: a host never validated, only the
port. Every address setting is tried with each bad host form, and good forms still pass.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import KVTierConfig
from kvtier.config_base import parse_address
from kvtier.hosts import check_host

BAD_HOSTS = ["[::1", "::1", "a]", "[zz]", "[]", "ho st", "a/b", "h@x", "-", "x?y"]
GOOD_HOSTS = ["127.0.0.1", "localhost", "node-1.example.com", "[::1]", "[fe80::1]", "eth0"]


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_bad_hosts_are_refused_with_the_host_named(host: str) -> None:
    with pytest.raises(ValueError, match="host"):
        check_host(host)


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_good_hosts_pass(host: str) -> None:
    assert check_host(host) == host


def test_the_wildcard_only_where_a_listener_may_take_it() -> None:
    assert check_host("*") == "*"
    with pytest.raises(ValueError):
        check_host("*", wildcard=False)


def _setting(name: str, host: str) -> dict:
    return {
        "peers": {"peers": [f"tcp://{host}:5555"]},
        "controller": {"controller": f"tcp://{host}:5555"},
        "peer_discovery": {"peer_discovery": f"http://{host}:8080"},
        "kv_events_endpoint": {"kv_events_endpoint": f"tcp://{host}:5557"},
        "server": {"server": f"tcp://{host}:5555"},
    }[name]


SETTINGS = ["peers", "controller", "peer_discovery", "kv_events_endpoint", "server"]


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("host", ["[::1", "::1", "ho st", "[zz]"])
def test_every_address_setting_refuses_a_bad_host(name: str, host: str) -> None:
    with pytest.raises(ValueError, match=f"{name if name != 'server' else 'TCP address'}.*host"):
        KVTierConfig(**_setting(name, host))


@pytest.mark.parametrize("name", SETTINGS)
def test_every_address_setting_takes_a_good_host(name: str) -> None:
    from kvtier.config_urls import check_transfer_url as _check_transfer_url

    for host in ("127.0.0.1", "[::1]", "localhost"):
        if name == "peers":  # (TCP peers also need fleet keys: a cross-setting rule, not the host's)
            assert _check_transfer_url("peers", f"tcp://{host}:5555", listen=False)
        else:
            KVTierConfig(**_setting(name, host), kv_events_plain=name == "kv_events_endpoint")


def test_peer_listen_with_an_open_bracket_fails_config_check_not_the_start(tmp_path: Path) -> None:
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text('peer_listen = "tcp://[::1:0"\n')
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "config-check", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "peer_listen" in proc.stdout + proc.stderr and "bracket" in proc.stdout + proc.stderr


def test_parse_address_keeps_accepting_bracketed_ipv6_and_refuses_an_open_bracket() -> None:
    assert parse_address("tcp://[::1]:5555") == ("tcp", ("::1", 5555))
    with pytest.raises(ValueError, match="bracket"):
        parse_address("tcp://[::1:5555")


@pytest.mark.parametrize("host", [
    "[::1%x]@0.0.0.0:27011#]",  # zone id text that a URL reader splits: passed as loopback, bound 0.0.0.0
    "[fe80::1%]]", "[::1%\n]", "a..b", "a" * 64, ".", "user:pw@ctl",
])
def test_hostile_trial_hosts_are_refused(host: str) -> None:
    with pytest.raises(ValueError) as err:
        check_host(host)
    assert "pw" not in str(err.value)  # a password before '@' is never echoed


@pytest.mark.parametrize("host", ["localhost.", "kvtier-ctl.kvtier.svc.cluster.local.", "[fe80::1%eth0]", "_svc",
                                  "[::ffff:127.0.0.1]"])
def test_absolute_names_zone_ids_and_underscores_pass(host: str) -> None:
    assert check_host(host) == host


def test_a_password_in_peer_discovery_is_not_echoed() -> None:
    from kvtier.config import load_config

    with pytest.raises(ValueError) as err:  # (what users see: load_config's ConfigError, not pydantic's repr)
        load_config({"peer_discovery": "http://user:s3cret@ctl:8080"}, environ={})
    assert "s3cret" not in str(err.value) and "user[:password]@" in str(err.value)


@pytest.mark.parametrize("port", ["５５５５", "²", "+1", "0x10"])
def test_ports_are_ascii_digits(port: str) -> None:
    with pytest.raises(ValueError, match="port"):
        KVTierConfig(controller=f"tcp://127.0.0.1:{port}")


@pytest.mark.parametrize("content", [b"\xef\xbb\xbfcpu_capacity = \"64MiB\"\n"])
def test_a_utf8_bom_is_read(tmp_path: Path, content: bytes) -> None:
    from kvtier.config import load_config

    f = tmp_path / "c.toml"
    f.write_bytes(content)
    assert int(load_config({"config_file": str(f)}, environ={}).cpu_capacity) == 64 << 20


def test_config_files_that_would_hang_or_eat_memory_are_refused(tmp_path: Path) -> None:
    import os

    from kvtier.config import load_config
    from kvtier.config_base import ConfigError

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'cpu_capacity = "\xff"\n')
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    for path, why in ((fifo, "not a regular file"), (Path("/dev/zero"), "not a regular file"),
                      (bad, "not UTF-8"), (big, "larger than"), (tmp_path, "not a regular file")):
        with pytest.raises(ConfigError, match=why):
            load_config({"config_file": str(path)}, environ={})


def test_ipv6_listeners_bind_what_the_config_accepts() -> None:
    """The config accepts [::1]: the peer listener and the KV event sockets must then bind it (they
    used to fail at start: an AF_INET socket, a ZeroMQ socket without IPV6)."""
    import socket

    from kvtier.events import BlockRemoved, EventPublisher, EventSubscriber
    from kvtier.transfer.tcp import TcpListener

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    listener = TcpListener("::1", 0)
    try:
        assert listener.address[0] == "::1" and listener.address[1] > 0
    finally:
        listener.close()
    pub = EventPublisher("tcp://[::1]:0", replay_endpoint="tcp://[::1]:0", topic="", plain=True)
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, topic="")
    try:
        got = None
        for i in range(200):
            pub.publish([BlockRemoved(block_hashes=[i], medium="CPU")])
            got = sub.poll(0.05)
            if got is not None:
                break
        assert got is not None
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("settings", [{"server": "tcp://*:5555"}])
def test_the_zeromq_wildcard_is_refused_where_a_plain_socket_binds(settings: dict) -> None:
    with pytest.raises(ValueError, match="host"):
        KVTierConfig(**settings)


def test_a_name_the_idna_codec_refuses_is_a_transfer_error_so_the_peer_tier_backs_off() -> None:
    """(Config refuses such names now; a peer URL given to the tier directly still must not raise
    UnicodeError, which the peer tier does not take for a failed dial: no back-off, a traceback per call.)"""
    from kvtier.transfer.errors import TransferError
    from kvtier.transfer.tcp import dial_tcp

    with pytest.raises(TransferError, match="cannot connect"):
        dial_tcp("a..b", 5555, 1.0, "tcp")


@pytest.mark.parametrize("value", [99999999999999999999999999999999999999, "2000000TiB", 1e30])
def test_sizes_past_any_machine_are_refused_when_read(value: object) -> None:
    from kvtier.config import load_config
    from kvtier.config_base import ConfigError

    with pytest.raises(ConfigError, match="cpu_capacity"):
        load_config({"cpu_capacity": value}, environ={})


@pytest.mark.parametrize("args", [["ctl", "health", "--url", "http://[::1"],
                                  ["ctl", "check-finish", "x" * 100_000, "--url", "http://127.0.0.1:9"]])
def test_ctl_with_a_bad_url_or_a_huge_argument_says_so_without_a_traceback(args: list[str], tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "╭" not in proc.stderr, proc.stderr[-2000:]
    assert "not a URL" in proc.stderr or "too long" in proc.stderr, proc.stderr[-2000:]
