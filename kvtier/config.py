"""kvtier configuration: one validated model, three sources.

Precedence, highest first:
1. explicit values (vLLM's ``kv_connector_extra_config``, CLI flags),
2. ``KVTIER_<FIELD>`` environment variables (e.g. ``KVTIER_CPU_CAPACITY=4GiB``),
3. a TOML or JSON file named by ``config_file`` / ``KVTIER_CONFIG_FILE``,
4. the defaults below.

Unknown keys are refused in every source, including unknown ``KVTIER_*``
environment variables, so a misspelt setting never silently does nothing.
Byte sizes accept integers (bytes) or strings such as ``"512MiB"``/``"4GB"``.

Values that cannot work are refused with the key and its source named:
durations must be positive and finite; addresses and URLs must parse; a tier
capacity below the smallest possible chunk (``2 * chunk_size`` bytes: a key and
a value of at least one byte per token) is an error. What needs the machine or
the model is checked by :func:`validate_config` when the tiers open: the disk
path must be a creatable, writable directory, and each capacity must hold one
chunk of the model's real size (below 1 MiB with the size still unknown: a
warning).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Mapping

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from kvtier.tiers.policies import POLICIES

ENV_PREFIX = "KVTIER_"
#: Below this a capacity is legal but almost surely a unit mistake (warned when the chunk size is unknown).
WARN_CAPACITY_BYTES = 1 << 20

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration value or source is invalid; the message names the key and the source."""


class KVTierConfig(BaseModel):
    """Every kvtier setting, with its default and unit."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)
    #: key -> where its value came from ("explicit setting", "environment variable ...", ...).
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    enabled: bool = Field(True, description="Master switch; False makes the connector a no-op (every lookup a miss).")
    chunk_size: int = Field(
        256, ge=16, le=65536, description="Tokens per chunk; must be a multiple of the engine block size."
    )
    cpu_capacity: ByteSize = Field(
        ByteSize(1 << 30),
        description="Bytes of pre-allocated, pre-touched CPU DRAM for the hot tier (per process).",
    )
    cpu_eviction: str = Field("lru", description="CPU tier eviction policy.")
    disk_path: Path | None = Field(None, description="Directory of the local disk tier; unset disables the tier.")
    disk_capacity: ByteSize = Field(ByteSize(16 << 30), description="Byte bound of the disk tier (headers included).")
    disk_eviction: str = Field("lru", description="Disk tier eviction policy.")
    disk_fsync: bool = Field(False, description="fsync each chunk file before publishing it (power-loss safety).")
    disk_direct_io: bool = Field(
        False, description="Read and write chunk files with O_DIRECT (bypass the page cache; falls back if refused)."
    )
    disk_write_queue: int = Field(
        256, ge=1, description="Chunks waiting for write-behind to disk; more are dropped (counted)."
    )
    remote_url: str | None = Field(
        None,
        description=(
            "URL of the remote tier below CPU and disk (redis://, rediss://, unix://, redis+cluster://, "
            "fs:///path, or a plug-in's scheme); unset disables it."
        ),
    )
    remote_codec: str = Field("raw", description="Codec of chunks written to the remote tier.")
    remote_ttl_s: float | None = Field(
        None, gt=0, description="Expiry of remote chunks in seconds; unset keeps them until the store evicts."
    )
    remote_timeout_s: float = Field(
        1.0, gt=0, description="Bound on one remote call (all its round trips); a timeout is a miss."
    )
    remote_write_queue: int = Field(
        64, ge=1, description="Chunks waiting for write-behind to the remote tier; more are dropped (counted)."
    )
    lease_ttl_s: float = Field(
        300.0, gt=0, description="Seconds a lookup's lease pins its chunks if no load/finish ends it."
    )
    lookup_timeout_s: float = Field(
        0.5, gt=0, description="Bound on a scheduler-to-worker lookup call (plus remote_timeout_s when a remote tier is set); a timeout is a miss."
    )
    async_load: bool = Field(
        True,
        description="Load hits held only below the CPU tier (disk, remote) asynchronously, "
        "so the engine keeps serving other requests meanwhile.",
    )
    server: str | None = Field(
        None,
        description="Address of a shared `kvtier server` (unix:///path.sock or tcp://127.0.0.1:PORT); "
        "unset runs the tiers embedded in the engine.",
    )
    server_timeout_s: float = Field(0.5, gt=0, description="Bound on each call to the kvtier server; a timeout is a miss.")
    server_token: str | None = Field(None, description="Token for a TCP kvtier server (required there).")
    model_id: str | None = Field(
        None,
        description="Model identity in the key namespace; default: model name plus a fingerprint of its weights.",
    )
    save: bool = Field(True, description="Store newly computed full prompt chunks.")
    load: bool = Field(True, description="Report hits and load cached chunks.")
    config_file: Path | None = Field(None, description="TOML or JSON file with any of these keys.")

    @field_validator("disk_path", "config_file", "model_id", "remote_url", "remote_ttl_s", "server", "server_token", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        # KVTIER_DISK_PATH="" must not mean "the current directory".
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("cpu_capacity")
    @classmethod
    def _cpu_floor(cls, v: ByteSize, info: ValidationInfo) -> ByteSize:
        floor = 2 * int(info.data.get("chunk_size") or 16)
        if int(v) < floor:
            raise ValueError(
                f"{int(v)} B cannot hold one chunk (at least {floor} B for chunk_size "
                f"{info.data.get('chunk_size')}); sizes are bytes, e.g. '4GiB'"
            )
        return v

    @field_validator("disk_capacity")
    @classmethod
    def _disk_floor(cls, v: ByteSize, info: ValidationInfo) -> ByteSize:
        floor = 2 * int(info.data.get("chunk_size") or 16) if info.data.get("disk_path") is not None else 0
        if int(v) < floor:
            raise ValueError(
                f"{int(v)} B cannot hold one chunk (at least {floor} B for chunk_size "
                f"{info.data.get('chunk_size')}); sizes are bytes, e.g. '16GiB'"
            )
        return v

    @field_validator("server")
    @classmethod
    def _server_address(cls, v: str | None) -> str | None:
        if v is not None:
            from kvtier.protocol.transport import parse_address

            parse_address(v)
        return v

    @field_validator("cpu_eviction", "disk_eviction")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown eviction policy {v!r}; choose one of {sorted(POLICIES)}")
        return v

    @field_validator("remote_url")
    @classmethod
    def _known_tier(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from kvtier.tiers.registry import available_tiers

        scheme, sep, rest = v.partition("://")
        if not sep or not scheme or not rest:
            raise ValueError(f"remote_url {mask_url(v)!r} is not a URL (scheme://...)")
        known = available_tiers()
        if scheme.lower() not in known:
            raise ValueError(f"no remote tier for scheme {scheme!r}; available: {', '.join(sorted(known))}")
        _check_ports(v, rest)
        return v

    @field_validator("remote_codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        from kvtier.serde.registry import CODECS

        if v not in CODECS:
            raise ValueError(f"unknown codec {v!r}; choose one of {sorted(CODECS)}")
        return v

    def describe(self) -> str:
        """One line with the effective settings, for the start-up log (passwords in URLs masked)."""
        values = self.model_dump()
        if values.get("remote_url"):
            values["remote_url"] = mask_url(values["remote_url"])
        if values.get("server_token"):
            values["server_token"] = "***"
        return " ".join(f"{k}={v}" for k, v in values.items())


def _check_ports(url: str, rest: str) -> None:
    """Every ``host:port`` of the URL's authority has a port in 1-65535 (cluster URLs list several)."""
    netloc = rest.split("/", 1)[0].rpartition("@")[2]
    for part in filter(None, netloc.split(",")):
        host, sep, port = part.rpartition(":") if not part.endswith("]") else ("", "", "")
        if sep and (not port.isdigit() or not 0 < int(port) < 65536):
            raise ValueError(f"remote_url {mask_url(url)!r}: port {port!r} is not a number in 1-65535")


def _source(config: KVTierConfig, key: str) -> str:
    return config._sources.get(key, "default" if key not in config.model_fields_set else "explicit setting")


def probe_dir(path: Path) -> None:
    """Create ``path`` (and parents) if missing and write, then delete, a temporary file in it.

    Raises:
        OSError: the directory cannot be created or written.
    """
    path.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".kvtier-probe-", dir=path)
    os.close(fd)
    os.unlink(name)


def validate_config(config: KVTierConfig, chunk_bytes: int | None = None) -> None:
    """Check what needs the machine or the model, when the tiers open (server start, manager open).

    Args:
        config: the effective settings.
        chunk_bytes: bytes of one chunk of the model (None: not known yet, e.g.
            a server before any engine registers; then capacities below 1 MiB
            only log a warning).

    Raises:
        ConfigError: ``disk_path`` is not a creatable, writable directory, or
            ``cpu_capacity``/``disk_capacity`` is below one chunk; the message
            names the key, its source and the value.
    """
    if config.disk_path is not None:
        try:
            probe_dir(Path(config.disk_path))
        except OSError as exc:
            raise ConfigError(
                f"invalid kvtier config: disk_path (from {_source(config, 'disk_path')}): "
                f"{config.disk_path} is not a creatable, writable directory: {exc.strerror or exc}"
            ) from None
    sizes = [("cpu_capacity", int(config.cpu_capacity))]
    if config.disk_path is not None:
        sizes.append(("disk_capacity", int(config.disk_capacity)))
    for key, value in sizes:
        if chunk_bytes is not None and value < chunk_bytes:
            raise ConfigError(
                f"invalid kvtier config: {key} (from {_source(config, key)}): {value} B is below one chunk "
                f"({chunk_bytes} B for this model and chunk_size {config.chunk_size})"
            )
        if chunk_bytes is None and value < WARN_CAPACITY_BYTES:
            log.warning(
                "kvtier config: %s (from %s) is only %d B; sizes are bytes (e.g. '4GiB'), "
                "and a tier smaller than one chunk is refused when the model is known",
                key, _source(config, key), value,
            )


def mask_url(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    if "@" not in netloc:
        return url
    cred, _, host = netloc.rpartition("@")
    user, colon, _ = cred.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}{slash}{path}"


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read kvtier config file {path}: {exc}") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"kvtier config file {path} is not valid {path.suffix or 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"kvtier config file {path} must hold a table/object of settings")
    data = data.get("kvtier", data)  # allow a [kvtier] table
    if not isinstance(data, dict):
        raise ConfigError(f"kvtier config file {path}: 'kvtier' must be a table of settings")
    data = dict(data)
    data.pop("config_file", None)
    return data


def _env_values(environ: Mapping[str, str]) -> dict[str, str]:
    fields = set(KVTierConfig.model_fields)
    out: dict[str, str] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in fields:
            raise ConfigError(
                f"unknown environment variable {name}; kvtier settings are "
                + ", ".join(ENV_PREFIX + f.upper() for f in sorted(fields))
            )
        out[key] = value
    return out


def load_config(
    overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> KVTierConfig:
    """Build the effective config from explicit values, environment and file.

    Args:
        overrides: explicit settings (highest precedence), e.g. vLLM's
            ``kv_connector_extra_config``.
        environ: environment to read ``KVTIER_*`` from (default ``os.environ``).

    Raises:
        ConfigError: unknown key, bad value or unreadable file; the message names
            the offending key and where it came from.
    """
    overrides = dict(overrides or {})
    env = _env_values(os.environ if environ is None else environ)
    file_path = overrides.get("config_file") or env.get("config_file")
    file_vals = _read_file(Path(file_path)) if file_path else {}
    merged: dict[str, Any] = {**file_vals, **env, **overrides}
    origin = {k: f"config file {file_path}" for k in file_vals}
    origin.update({k: f"environment variable {ENV_PREFIX}{k.upper()}" for k in env})
    origin.update({k: "explicit setting" for k in overrides})
    try:
        config = KVTierConfig(**merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else "?"
            where = origin.get(key, "default")
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown setting {key!r} (from {where})")
            else:
                problems.append(f"{key} (from {where}): {err['msg']}")
        raise ConfigError("invalid kvtier config: " + "; ".join(problems)) from None
    config._sources.update(origin)
    return config
