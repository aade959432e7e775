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
