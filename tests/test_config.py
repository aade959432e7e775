"""Config: defaults, KVTIER_* environment, TOML/JSON files, precedence, refusal of unknown keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.config import ConfigError, KVTierConfig, load_config

GiB = 1 << 30


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- defaults ----------------------------------------------------------------------


def test_defaults() -> None:
    cfg = load_config(environ={})
    assert cfg == KVTierConfig()
    assert cfg.enabled is True
    assert cfg.chunk_size == 256
    assert int(cfg.cpu_capacity) == GiB
    assert cfg.cpu_eviction == "lru" and cfg.disk_eviction == "lru"
    assert cfg.disk_path is None
    assert int(cfg.disk_capacity) == 16 * GiB
    assert cfg.disk_fsync is False
    assert cfg.disk_write_queue == 256
    assert cfg.lease_ttl_s == 300.0
    assert cfg.model_id is None
    assert cfg.save is True and cfg.load is True
    assert cfg.config_file is None


def test_non_kvtier_environment_is_ignored() -> None:
    assert load_config(environ={"PATH": "/bin", "KVTIERX": "1", "VLLM_FOO": "2"}) == KVTierConfig()


def test_describe_names_every_setting() -> None:
    line = KVTierConfig().describe()
    for name in KVTierConfig.model_fields:
        assert f"{name}=" in line


def test_config_is_frozen() -> None:
    cfg = KVTierConfig()
    with pytest.raises(Exception):
        cfg.chunk_size = 64  # type: ignore[misc]


# -- environment ---------------------------------------------------------------------


def test_environment_values(tmp_path: Path) -> None:
    env = {
        "KVTIER_CHUNK_SIZE": "64",
        "KVTIER_CPU_CAPACITY": "512MiB",
        "KVTIER_DISK_PATH": str(tmp_path),
        "KVTIER_DISK_CAPACITY": "2GB",
        "KVTIER_DISK_FSYNC": "true",
        "KVTIER_ENABLED": "0",
        "KVTIER_LEASE_TTL_S": "2.5",
        "KVTIER_MODEL_ID": "m@abc",
    }
    cfg = load_config(environ=env)
    assert cfg.chunk_size == 64
    assert int(cfg.cpu_capacity) == 512 * (1 << 20)
    assert cfg.disk_path == tmp_path
    assert int(cfg.disk_capacity) == 2_000_000_000
    assert cfg.disk_fsync is True
    assert cfg.enabled is False
    assert cfg.lease_ttl_s == 2.5
    assert cfg.model_id == "m@abc"


def test_unknown_environment_variable_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(environ={"KVTIER_CPU_CAPACTY": "1GiB"})
    assert "KVTIER_CPU_CAPACTY" in str(err.value)
    assert "environment variable" in str(err.value)
    assert "did you mean KVTIER_CPU_CAPACITY?" in str(err.value)
    assert "KVTIER_DISK_PATH" not in str(err.value)  # the likely fix, not the whole list
    with pytest.raises(ConfigError) as err:
        load_config(environ={"KVTIER_ZZZQQQ": "1"})
    assert "KVTIER_DISK_PATH" in str(err.value)  # nothing close: every setting listed


def test_unknown_setting_in_a_file_or_override_suggests_the_closest(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.toml"
    f.write_text('cpu_evicton = "lru"\n')
    with pytest.raises(ConfigError) as err:
        load_config({"config_file": f}, environ={})
    assert "unknown setting 'cpu_evicton'" in str(err.value) and str(f) in str(err.value)
    assert "did you mean 'cpu_eviction'?" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config({"zzzqqq": 1}, environ={})
    assert "kvtier config-check" in str(err.value)


def test_a_disk_path_kvtier_creates_is_owner_only(tmp_path: Path) -> None:
    """The directory that will hold users' cached KV is created 0700 at start (issue 14, item 1)."""
    from kvtier.config_checks import validate_config

    d = tmp_path / "new" / "cache"
    validate_config(load_config({"disk_path": d}, environ={}))
    assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700


# -- files -------------------------------------------------------------------------------


def test_toml_file(tmp_path: Path) -> None:
    f = write(tmp_path / "kv.toml", 'chunk_size = 128\ncpu_capacity = "256MiB"\ncpu_eviction = "lru"\nsave = false\n')
    cfg = load_config({"config_file": f}, environ={})
    assert cfg.chunk_size == 128
    assert int(cfg.cpu_capacity) == 256 << 20
    assert cfg.save is False


def test_toml_file_with_kvtier_table(tmp_path: Path) -> None:
    f = write(tmp_path / "kv.toml", '[kvtier]\nchunk_size = 512\ndisk_capacity = "1GiB"\n')
    cfg = load_config({"config_file": str(f)}, environ={})
    assert cfg.chunk_size == 512
    assert int(cfg.disk_capacity) == GiB


def test_json_file(tmp_path: Path) -> None:
    f = write(tmp_path / "kv.json", json.dumps({"chunk_size": 64, "disk_capacity": 3 * GiB, "load": False}))
    cfg = load_config({"config_file": f}, environ={})
    assert cfg.chunk_size == 64
    assert int(cfg.disk_capacity) == 3 * GiB
    assert cfg.load is False


def test_file_named_by_environment(tmp_path: Path) -> None:
    f = write(tmp_path / "kv.toml", "chunk_size = 1024\n")
    cfg = load_config(environ={"KVTIER_CONFIG_FILE": str(f)})
    assert cfg.chunk_size == 1024


def test_unreadable_or_invalid_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({"config_file": tmp_path / "missing.toml"}, environ={})
    bad_toml = write(tmp_path / "bad.toml", "chunk_size = = 3\n")
    with pytest.raises(ConfigError, match="not valid"):
        load_config({"config_file": bad_toml}, environ={})
    bad_json = write(tmp_path / "bad.json", "{chunk_size: 3")
    with pytest.raises(ConfigError, match="not valid"):
        load_config({"config_file": bad_json}, environ={})
    not_table = write(tmp_path / "list.json", "[1, 2]")
    with pytest.raises(ConfigError, match="table"):
        load_config({"config_file": not_table}, environ={})


@pytest.mark.parametrize("name, text", [
    ("deep.json", '{"chunk_size": ' + "[" * 5000 + "]" * 5000 + "}"),
    ("deep.toml", "chunk_size = " + "[" * 5000 + "]" * 5000 + "\n"),
    ("inline.toml", "chunk_size = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n"),
])
def test_a_file_nested_too_deeply_is_a_config_error(tmp_path: Path, name: str, text: str) -> None:
    # json and tomllib give up past the recursion limit with RecursionError, not their parse error
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config({"config_file": write(tmp_path / name, text)}, environ={})


# -- precedence ------------------------------------------------------------------------


def test_precedence_explicit_over_env_over_file(tmp_path: Path) -> None:
    f = write(
        tmp_path / "kv.toml",
        'chunk_size = 1024\ncpu_capacity = "1MiB"\ndisk_capacity = "1GiB"\nlease_ttl_s = 7\n',
    )
    env = {"KVTIER_CONFIG_FILE": str(f), "KVTIER_CPU_CAPACITY": "2MiB", "KVTIER_CHUNK_SIZE": "512"}
    cfg = load_config({"chunk_size": 64}, environ=env)
    assert cfg.chunk_size == 64  # explicit beats env and file
    assert int(cfg.cpu_capacity) == 2 << 20  # env beats file
    assert int(cfg.disk_capacity) == GiB  # file beats default
    assert cfg.lease_ttl_s == 7.0
    assert cfg.model_id is None  # default where nobody sets it


def test_explicit_config_file_beats_env_config_file(tmp_path: Path) -> None:
    env_file = write(tmp_path / "env.toml", "chunk_size = 1024\n")
    explicit_file = write(tmp_path / "explicit.json", '{"chunk_size": 2048}')
    cfg = load_config({"config_file": explicit_file}, environ={"KVTIER_CONFIG_FILE": str(env_file)})
    assert cfg.chunk_size == 2048


# -- unknown keys and bad values name the key and its source ---------------------------------


def test_unknown_explicit_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"chunk_sise": 64}, environ={})
    msg = str(err.value)
    assert "chunk_sise" in msg and "explicit" in msg


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_unknown_file_key(tmp_path: Path, suffix: str) -> None:
    body = 'cpu_capacityy = "1GiB"\n' if suffix == ".toml" else '{"cpu_capacityy": "1GiB"}'
    f = write(tmp_path / f"kv{suffix}", body)
    with pytest.raises(ConfigError) as err:
        load_config({"config_file": f}, environ={})
    msg = str(err.value)
    assert "cpu_capacityy" in msg and "config file" in msg and str(f) in msg


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("chunk_size", 0),
        ("chunk_size", -256),
        ("chunk_size", "many"),
        ("cpu_eviction", "lfu-ish"),
        ("disk_eviction", "random"),
        ("cpu_capacity", "12 parsecs"),
        ("disk_capacity", "-1GiB"),
        ("lease_ttl_s", 0),
        ("disk_write_queue", 0),
    ],
)
def test_bad_explicit_values(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({key: value}, environ={})
    msg = str(err.value)
    assert key in msg and "explicit" in msg


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(environ={"KVTIER_CPU_EVICTION": "mru"})
    msg = str(err.value)
    assert "cpu_eviction" in msg and "KVTIER_CPU_EVICTION" in msg and "lru" in msg


def test_bad_file_value_names_the_file(tmp_path: Path) -> None:
    f = write(tmp_path / "kv.toml", "chunk_size = 0\n")
    with pytest.raises(ConfigError) as err:
        load_config({"config_file": f}, environ={})
    msg = str(err.value)
    assert "chunk_size" in msg and str(f) in msg


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("512MiB", 512 << 20), ("4GB", 4_000_000_000), ("1GiB", 1 << 30), ("2048", 2048), (4096, 4096), ("1.5KiB", 1536)],
)
def test_byte_sizes(text: object, nbytes: int) -> None:
    assert int(load_config({"cpu_capacity": text}, environ={}).cpu_capacity) == nbytes
    assert int(load_config(environ={"KVTIER_DISK_CAPACITY": str(text)}).disk_capacity) == nbytes


# -- settings that cannot work (issue 8, failing input 7) ----------------------------------------
def test_tiny_cpu_capacity_from_the_environment_is_refused() -> None:
    """``KVTIER_CPU_CAPACITY=12`` (12 bytes, not one chunk) was accepted."""
    with pytest.raises(ConfigError) as err:
        load_config(environ={"KVTIER_CPU_CAPACITY": "12"})
    msg = str(err.value)
    assert "cpu_capacity" in msg and "KVTIER_CPU_CAPACITY" in msg and "12 B" in msg and "one chunk" in msg


@pytest.mark.parametrize(
    ("key", "value", "extra"),
    [
        ("cpu_capacity", 0, {}),
        ("cpu_capacity", -1, {}),
        ("cpu_capacity", 63, {"chunk_size": 32}),  # below 2 B per token of one chunk
        ("disk_capacity", 100, {"disk_path": "/tmp/kvtier-never-created"}),
        ("disk_capacity", -5, {}),
        ("remote_timeout_s", 0, {}),
        ("remote_timeout_s", -1.0, {}),
        ("remote_timeout_s", "inf", {}),
        ("lookup_timeout_s", "nan", {}),
        ("server_timeout_s", 0, {}),
        ("lease_ttl_s", float("inf"), {}),
        ("remote_ttl_s", -3, {}),
        # finite but absurd: socket.settimeout(1e308) raises OverflowError in the call, not at start
        ("peer_timeout_s", 1e308, {}),
        ("remote_timeout_s", 7200, {}),
        ("peer_retry_s", 1e308, {}),
        ("lease_ttl_s", 1e12, {}),
        ("remote_ttl_s", 1e308, {}),
        ("remote_write_queue", 0, {}),
        ("remote_url", "redis://127.0.0.1:notaport", {}),
        ("remote_url", "redis://127.0.0.1:70000", {}),
        ("remote_url", "redis+cluster://127.0.0.1:7100,127.0.0.1:x", {}),
        ("remote_url", "nonsense", {}),
        ("server", "127.0.0.1:9000", {}),
        ("server", "tcp://127.0.0.1", {}),
        ("server", "tcp://127.0.0.1:0", {}),
        ("server", "unix://relative.sock", {}),
    ],
)
def test_nonsense_sizes_durations_and_addresses_are_refused(key: str, value: object, extra: dict) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({key: value, **extra}, environ={})
    assert key in str(err.value) and "explicit" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_url", "redis://127.0.0.1:6399/0"),
        ("remote_url", "redis+cluster://127.0.0.1:7100,127.0.0.1:7101"),
        ("remote_url", "redis://:secret@localhost"),
        ("server", "unix:///run/kvtier.sock"),
        ("server", "tcp://[::1]:9000"),
        ("cpu_capacity", 64),  # legal floor for chunk_size 32: the real chunk size is checked at open
    ],
)
def test_sensible_values_still_pass(key: str, value: object) -> None:
    load_config({key: value, "chunk_size": 32}, environ={})



@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KVTIER_PEERS", "tcp://u:s3cr3t@h:99999"),
        ("KVTIER_PEERS", "ftp://u:s3cr3t@h:1"),
        ("KVTIER_PEER_LISTEN", "tcp://u:s3cr3t@0.0.0.0:70000"),
        ("KVTIER_PEER_DISCOVERY", "http://:s3cr3t@h:99999"),
        ("KVTIER_REMOTE_URL", "redis://:s3cr3t@h:99999"),
    ],
)
def test_an_address_refused_never_shows_its_password(variable: str, value: str) -> None:
    """Every URL an error shows goes through mask_url (the hostile trial found peers, peer_listen
    and peer_discovery errors printing theirs verbatim)."""
    with pytest.raises(ConfigError) as err:
        load_config(environ={variable: value})
    assert variable in str(err.value) and "s3cr3t" not in str(err.value)

def test_disk_path_must_be_a_writable_directory(tmp_path: Path) -> None:
    from kvtier.config_checks import validate_config

    for bad in ("/proc/x", str(write(tmp_path / "a-file", "x")), "/proc/x/y/z"):
        cfg = load_config(environ={"KVTIER_DISK_PATH": bad})
        with pytest.raises(ConfigError) as err:
            validate_config(cfg)
        msg = str(err.value)
        assert "disk_path" in msg and bad in msg and "KVTIER_DISK_PATH" in msg
    good = tmp_path / "new" / "disk"
    validate_config(load_config({"disk_path": good}, environ={}))
    assert good.is_dir() and list(good.iterdir()) == []  # the probe leaves nothing behind


def test_capacity_below_one_real_chunk_is_refused_when_the_chunk_size_is_known(caplog) -> None:
    from kvtier.config_checks import validate_config

    cfg = load_config({"cpu_capacity": 4096, "chunk_size": 32}, environ={})
    validate_config(cfg, chunk_bytes=4096)
    with pytest.raises(ConfigError, match=r"cpu_capacity \(from explicit setting\): 4096 B is below one chunk"):
        validate_config(cfg, chunk_bytes=4097)
    with caplog.at_level("WARNING"):
        validate_config(cfg)  # chunk size unknown: legal but loud
    assert "cpu_capacity" in caplog.text and "4096 B" in caplog.text


@pytest.mark.slow
def test_server_refuses_bad_settings_and_never_says_ready(tmp_path: Path) -> None:
    """``kvtier server --disk-path /proc/x`` reported ready; ``KVTIER_CPU_CAPACITY=12`` was accepted."""
    import os
    import subprocess
    import sys

    sock = tmp_path / "run" / "s.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    base = [sys.executable, "-m", "kvtier.cli", "server", "--socket", str(sock), "--no-metrics"]
    cases = [
        (base + ["--disk-path", "/proc/x"], env, "disk_path"),
        (base, {**env, "KVTIER_CPU_CAPACITY": "12"}, "KVTIER_CPU_CAPACITY"),
    ]
    for cmd, e, needle in cases:
        out = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=120)
        text = out.stdout + out.stderr
        assert out.returncode != 0 and "ready" not in text and needle in text, text


def test_server_options_refuse_nonsense_bounds(tmp_path: Path) -> None:
    from kvtier.service.server import ServerOptions

    for bad in (dict(max_clients=0), dict(max_holds_per_client=-1), dict(prefetch_queue=0), dict(tcp_port=70000),
                dict(metrics_port=-1), dict(max_namespaces=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerOptions(socket_path=str(tmp_path / "s.sock"), **bad)  # type: ignore[arg-type]


# -- sizes an operator cannot misread (issue 14, item 11) -----------------------------------------
@pytest.mark.parametrize(
    ("value", "needle"),
    [(-1, "-1 is negative"), ("-1", "'-1' is negative"), ("10XB", "unknown unit 'XB'"), ("4.5", "fraction"),
     (4.5, "4.5"), ("1e3", "'1e3'"), (True, "True")],
)
def test_bad_sizes_show_the_value_and_the_accepted_units(value: object, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"cpu_capacity": value}, environ={})
    msg = str(err.value)
    assert needle in msg and "cpu_capacity (from explicit setting)" in msg
    assert "GiB" in msg and "bare numbers are bytes" in msg and "Value error" not in msg


def test_a_bare_lmcache_style_size_is_refused_with_a_hint() -> None:
    """An LMCache user writes ``cpu_capacity = 4`` meaning 4 GB: 4 bytes, refused, '4GiB' suggested."""
    path_env = {"KVTIER_CPU_CAPACITY": "4"}
    with pytest.raises(ConfigError) as err:
        load_config(environ=path_env)
    msg = str(err.value)
    assert "KVTIER_CPU_CAPACITY" in msg and "4 B" in msg and "did you mean '4GiB'" in msg


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4G", 4 * 10**9), ("4g", 4 * 10**9), ("4GB", 4 * 10**9), ("4GiB", 4 << 30), ("4 gib", 4 << 30),
     ("1.5GiB", 3 << 29), ("512K", 512_000), ("2T", 2 * 10**12), (4.0e9, 4 * 10**9)],
)
def test_size_units_si_and_binary(text: object, nbytes: int) -> None:
    assert int(load_config({"cpu_capacity": text}, environ={}).cpu_capacity) == nbytes


# -- config holes (issue 14, item 15) ----------------------------------------------------------------
def test_keys_outside_the_kvtier_table_are_refused(tmp_path: Path) -> None:
    f = write(tmp_path / "k.toml", 'cpu_capacity = "2GiB"\n[kvtier]\ndisk_capacity = "1GiB"\n')
    with pytest.raises(ConfigError, match=r"outside the \[kvtier\] table.*cpu_capacity"):
        load_config({"config_file": f}, environ={})


def test_json_parse_errors_name_json(tmp_path: Path) -> None:
    f = write(tmp_path / "k.json", "{nope")
    with pytest.raises(ConfigError, match="not valid JSON") as err:
        load_config({"config_file": f}, environ={})
    assert "reads as TOML" not in str(err.value)


def test_a_toml_file_named_json_is_told_to_be_named_toml(tmp_path: Path) -> None:
    f = write(tmp_path / "k.json", 'cpu_capacity = "2GiB"\n')
    with pytest.raises(ConfigError, match=r"not valid JSON.*reads as TOML: name it \.toml"):
        load_config({"config_file": f}, environ={})


@pytest.mark.parametrize("name", ["KVTIER_REDIS_STATE", "KVTIER_TEST_FAULTS_JSON_OUT"])
def test_tooling_environment_variables_are_not_settings(name: str) -> None:
    """Exporting the CI Redis script's own variable stopped every engine from starting."""
    assert load_config(environ={name: "/tmp/x"}).cpu_capacity == 1 << 30


def test_log_level_setting() -> None:
    assert load_config(environ={"KVTIER_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    with pytest.raises(ConfigError, match="log_level.*'LOUD'.*DEBUG, INFO"):
        load_config({"log_level": "LOUD"}, environ={})


@pytest.mark.parametrize(
    ("role", "save", "load"), [("kv_both", True, True), ("kv_producer", True, False), ("kv_consumer", False, True)]
)
def test_kv_role_gates_save_and_load(role: str, save: bool, load: bool) -> None:
    cfg = load_config({"kv_role": role}, environ={})
    assert (cfg.should_save, cfg.should_load) == (save, load)
    assert not load_config({"kv_role": role, "save": False, "load": False}, environ={}).should_save
    with pytest.raises(ConfigError, match="kv_role"):
        load_config({"kv_role": "kv_both_ways"}, environ={})


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis://127.0.0.1:6399/0?key_prefx=kv:", "unknown option key_prefx"),
        ("redis://127.0.0.1:6399/0?ttl_s=soon", "ttl_s='soon' is not a float"),
        ("redis://127.0.0.1:6399/0?breaker_failures=2.5", "breaker_failures='2.5' is not an int"),
        ("redis://:hunter2@127.0.0.1:6399/0?bogus=1", "unknown option bogus"),
    ],
)
def test_remote_url_options_are_validated_by_the_tier_at_config_time(url: str, needle: str) -> None:
    """``?key_prefx=`` passed validation and failed later with a TypeError inside redis-py."""
    pytest.importorskip("redis")
    with pytest.raises(ConfigError) as err:
        load_config({"remote_url": url}, environ={})
    msg = str(err.value)
    assert needle in msg and "remote_url (from explicit setting)" in msg and "hunter2" not in msg
    if "unknown option" in needle:
        assert "kvtier options: " in msg and "key_prefix" in msg  # the accepted ones are listed


def test_good_remote_url_options_pass_and_cluster_seed_lists_open() -> None:
    pytest.importorskip("redis")
    from kvtier.tiers.redis_tier import RedisTier

    load_config({"remote_url": "redis://127.0.0.1:6399/0?key_prefix=kv:&ttl_s=60&socket_keepalive=true"}, environ={})
    tier = RedisTier.from_url("redis+cluster://127.0.0.1:7100,127.0.0.1:7101?timeout_s=0.5")
    assert tier.options.seeds == ("127.0.0.1:7101",) and tier.options.timeout_s == 0.5
    tier.close()


def test_a_disk_path_locked_by_another_process_is_refused(tmp_path: Path) -> None:
    """A second server on the same disk_path said ready and then missed for every engine."""
    import fcntl
    import os

    from kvtier.config_checks import validate_config

    ns_dir = tmp_path / "ns-0123"
    ns_dir.mkdir()
    fd = os.open(ns_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"4242\n")
    cfg = load_config({"disk_path": tmp_path}, environ={})
    validate_config(cfg)  # a lock file nobody holds (owner died) is fine
    fcntl.flock(fd, fcntl.LOCK_EX)  # held through another open file description: like another process
    try:
        with pytest.raises(ConfigError, match=r"disk_path .*in use by another process \(pid 4242\)"):
            validate_config(cfg)
    finally:
        os.close(fd)
    validate_config(cfg)


def test_every_kvtier_environment_name_in_the_code_is_a_setting_or_declared_tooling() -> None:
    """A ``KVTIER_*`` variable that code or the test tooling reads but that is neither a
    setting nor in NON_SETTING_ENV makes every config load fail while it is set (an operator
    following the README, e.g. KVTIER_DASHBOARD_TOKENIZER on the controller, would be refused).
    Scan the package, the tests' environment reads and the scripts for such names."""
    import re
    from pathlib import Path

    from kvtier.config import KVTierConfig
    from kvtier.config_sources import ENV_PREFIX, NON_SETTING_ENV

    root = Path(__file__).resolve().parents[1]
    settings = {ENV_PREFIX + f.upper() for f in KVTierConfig.model_fields}
    read = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\(|setenv\(|_ENV\s*=\s*|\b[A-Z_]+=)\s*["']?(KVTIER_[A-Z0-9_]+)""")
    found: dict[str, str] = {}
    files = [*root.joinpath("kvtier").rglob("*.py"), *root.joinpath("tests").rglob("*.py"),
             *root.joinpath("scripts").glob("*.sh"), *root.joinpath(".ci").glob("*")]
    # Shell scripts and the README also set and expand them: `KVTIER_X=... cmd`, `${KVTIER_X:-}`.
    shell = re.compile(r"""(?:\$\{?|(?<![A-Za-z0-9_])(?=KVTIER_[A-Z0-9_]+=))(KVTIER_[A-Z0-9_]+)""")
    files.append(root / "README.md")
    for f in files:
        if f.is_file():
            text = f.read_text(errors="replace")
            names = read.findall(text)
            if f.suffix in (".sh", ".md", "") or f.parent.name == ".ci":
                names += shell.findall(text)
            for name in names:
                found.setdefault(name, str(f.relative_to(root)))
    assert "KVTIER_DASHBOARD_TOKENIZER" in found  # the scan sees constants and environ reads
    unknown = {n: where for n, where in found.items()
               if n not in settings and n not in NON_SETTING_ENV and n != "KVTIER_CPU_CAPACTY"}  # a deliberate typo
    assert not unknown, f"KVTIER_* names neither settings nor NON_SETTING_ENV: {unknown}"
