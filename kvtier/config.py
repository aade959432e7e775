"""kvtier configuration: one validated model, three sources.

Precedence, highest first:
1. explicit values (vLLM's ``kv_connector_extra_config``, CLI flags),
2. ``KVTIER_<FIELD>`` environment variables (e.g. ``KVTIER_CPU_CAPACITY=4GiB``),
3. a file: TOML or JSON named by ``config_file`` / ``KVTIER_CONFIG_FILE``, or an
   LMCache YAML config (``config_file`` ending in ``.yaml``/``.yml``,
   ``lmcache_config_file`` / ``KVTIER_LMCACHE_CONFIG_FILE``, or LMCache's own
   ``LMCACHE_CONFIG_FILE`` variable) translated by :mod:`kvtier.config_lmcache`,
4. the defaults below.

Unknown keys are refused in every source, including unknown ``KVTIER_*``
environment variables, so a misspelt setting never silently does nothing.
Byte sizes follow :mod:`kvtier.sizes`: a bare number is bytes; ``"4G"``/``"4GB"``
are SI (4e9 bytes), ``"4GiB"`` is 4 * 2**30 bytes.

Files: TOML (``.toml`` or any other suffix) or JSON (``.json``); settings either
at the top level or all inside one ``[kvtier]`` table (then any other top-level
key is an error). A YAML file is an LMCache config: its keys are translated
(sizes in LMCache's GB = 1024**3 bytes) and any key kvtier cannot honour, or that
is not LMCache's, is an error naming it (see :mod:`kvtier.config_lmcache`).
Naming both a kvtier file and an LMCache file is an error.
Environment variables that start with ``KVTIER_`` but are not settings are
refused too, except the tooling variables in :data:`kvtier.config_sources.NON_SETTING_ENV`.

Values that cannot work are refused with the key and its source named:
durations must be positive and finite; addresses and URLs must parse; a tier
capacity below the smallest possible chunk (``2 * chunk_size`` bytes: a key and
a value of at least one byte per token) is an error. What needs the machine or
the model is checked by :func:`kvtier.config_checks.validate_config` when the tiers open: the disk
path must be a creatable, writable directory, and each capacity must hold one
chunk of the model's real size (below 1 MiB with the size still unknown: a
warning).
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvtier.config_base import ConfigError, parse_address
from kvtier.config_sources import ENV_PREFIX, env_values, file_source
from kvtier.config_urls import check_host_of, check_ports, check_transfer_url
from kvtier.hosts import is_loopback
from kvtier.sizes import SIZE_FORMS, parse_size
from kvtier.urls import mask_url
from kvtier.tiers.policies import POLICIES

#: Log levels ``log_level`` accepts.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Settings a ``kvtier server`` uses; the others only matter in an engine process.
SERVER_KEYS = frozenset(
    {
        "cpu_capacity", "cpu_eviction", "cpu_numa_node", "disk_path", "disk_capacity", "disk_eviction", "disk_fsync",
        "disk_direct_io", "disk_write_queue", "disk_io_threads", "disk_verify_reads", "remote_url", "remote_codec", "remote_ttl_s",
        "remote_timeout_s", "remote_write_queue", "lease_ttl_s", "log_level", "config_file", "lmcache_config_file",
        "controller", "instance_id", "controller_token", "kv_events_endpoint", "kv_events_replay_endpoint",
        "peer_listen", "peers", "peer_timeout_s", "peer_retry_s", "peer_discovery",
        "fleet_key", "fleet_members", "controller_key", "peer_allow_remote", "kv_events_plain",
        "trace_capture_path", "trace_capture_max_bytes",
    }
)

#: A byte size setting (see :mod:`kvtier.sizes`).
Size = Annotated[ByteSize, BeforeValidator(parse_size)]

log = logging.getLogger(__name__)


#: Longest bound on one call (seconds). Beyond it a timeout is no bound at all, and very large values
#: fail later, in the call (``socket.settimeout(1e308)`` raises OverflowError).
MAX_CALL_S = 3600.0
#: Longest expiry, lease or back-off (seconds): a year.
MAX_TTL_S = 365 * 86400.0


class KVTierConfig(BaseModel):
    """Every kvtier setting, with its default and unit."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)
    #: key -> where its value came from ("explicit setting", "environment variable ...", ...).
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    enabled: bool = Field(True, description="Master switch; False makes the connector a no-op (every lookup a miss).")
    chunk_size: int = Field(
        256, ge=16, le=65536, description="Tokens per chunk; must be a multiple of the engine block size."
    )
    cpu_capacity: Size = Field(
        ByteSize(1 << 30),
        description="Bytes of pre-allocated, pre-touched CPU DRAM for the hot tier (per process).",
    )
    cpu_eviction: str = Field("lru", description="CPU tier eviction policy.")
    cpu_numa_node: str = Field(
        "auto",
        description=(
            "NUMA node of the CPU tier's memory (and a kvtier server's shared segments): auto (the node of the "
            "process's bound cores, else of the GPU's PCI device; preferred, falls back when full), a node number "
            "(bound), interleave (every node with memory), or none (the kernel's default)."
        ),
    )
    disk_path: Path | None = Field(None, description="Directory of the local disk tier; unset disables the tier.")
    disk_capacity: Size = Field(ByteSize(16 << 30), description="Byte bound of the disk tier (headers included).")
    disk_eviction: str = Field("lru", description="Disk tier eviction policy.")
    disk_fsync: bool = Field(False, description="fsync each chunk file before publishing it (power-loss safety).")
    disk_direct_io: bool = Field(
        False, description="Read and write chunk files with O_DIRECT (bypass the page cache; falls back if refused)."
    )
    disk_write_queue: int = Field(
        256, ge=1, description="Chunks waiting for write-behind to disk; more are dropped (counted)."
    )
    disk_io_threads: int = Field(
        4, ge=1, le=64, description="Chunk reads/writes of one disk batch in flight at once (1: one at a time)."
    )
    disk_verify_reads: bool = Field(
        True,
        description=(
            "Verify each chunk's xxh3-64 checksum when the disk tier reads it (default). false skips only that "
            "hash: LMCache's trade-off (a silently corrupted file is served as KV); headers, keys, sizes are "
            "still checked and every write still stores the checksum."
        ),
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
        None, gt=0, le=MAX_TTL_S, description="Expiry of remote chunks in seconds; unset keeps them until the store evicts."
    )
    remote_timeout_s: float = Field(
        1.0, gt=0, le=MAX_CALL_S, description="Bound on one remote call (all its round trips); a timeout is a miss."
    )
    remote_write_queue: int = Field(
        64, ge=1, description="Chunks waiting for write-behind to the remote tier; more are dropped (counted)."
    )
    lease_ttl_s: float = Field(
        300.0, gt=0, le=MAX_TTL_S, description="Seconds a lookup's lease pins its chunks if no load/finish ends it."
    )
    trace_capture_path: Path | None = Field(
        None,
        description=(
            "Record this instance's requests (a kvtier server: every lookup; the vLLM connector: every "
            "finished request) as a Mooncake-format trace here, created 0600: chunk keys as small integers, "
            "no token ids or text. Unset: off."
        ),
    )
    trace_capture_max_bytes: Size = Field(
        ByteSize(64 << 20), description="Most bytes of the captured trace; recording stops there."
    )
    lookup_timeout_s: float = Field(
        0.5, gt=0, le=MAX_CALL_S, description="Bound on a scheduler-to-worker lookup call (plus remote_timeout_s when a remote tier is set); a timeout is a miss."
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
    server_timeout_s: float = Field(0.5, gt=0, le=MAX_CALL_S, description="Bound on each call to the kvtier server; a timeout is a miss.")
    server_token: str | None = Field(None, description="Token for a TCP kvtier server (required there).")
    model_id: str | None = Field(
        None,
        description="Model identity in the key namespace; default: model name plus a fingerprint of its weights.",
    )
    reset_shared: bool = Field(
        False,
        description="vLLM's reset_prefix_cache(reset_connector=True) also clears this model's chunks in the remote "
        "tier and on the kvtier server, which other engines share (they lose them too); false: such an engine "
        "clears nothing and answers False.",
    )
    save: bool = Field(True, description="Store newly computed full prompt chunks.")
    load: bool = Field(True, description="Report hits and load cached chunks.")
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = Field(
        "kv_both",
        description="vLLM's kv_role: kv_producer only saves, kv_consumer only loads, kv_both does both "
        "(combined with save/load: see should_save/should_load).",
    )
    controller: str | None = Field(
        None,
        description="Address of a `kvtier controller` (tcp://HOST:PORT) this instance registers with and keeps "
        "informed of its tiers; unset: no controller.",
    )
    instance_id: str | None = Field(
        None,
        description="This instance's id at the controller; default: host:port:pid (host:embedded:pid in an engine).",
    )
    controller_token: str | None = Field(None, description="Bearer token sent to the controller when registering.")
    kv_events_endpoint: str | None = Field(
        None,
        description="ZMQ endpoint where a `kvtier server` publishes its tier changes as vLLM KV events "
        "(e.g. tcp://*:5557); unset: not published. Engines publish through vLLM's --kv-events-config instead.",
    )
    kv_events_replay_endpoint: str | None = Field(
        None, description="ZMQ endpoint of the KV events replay socket (e.g. tcp://*:5558); unset: no replay."
    )
    kv_events_map_chunks: int = Field(
        16384,
        ge=1,
        le=1 << 24,
        description="Chunks whose engine block hashes and tokens the connector remembers to translate kvtier's "
        "tier changes into vLLM KV events (LRU; about 1.5 KiB each); changes of others are counted, not published.",
    )
    peer_listen: str | None = Field(
        None,
        description="Serve this instance's CPU/disk chunks to peers on this URL (tcp://HOST:PORT, shm:///PATH or "
        "nixl://HOST:PORT; port 0: any free port); unset: serve nothing.",
    )
    peers: tuple[str, ...] = Field(
        (),
        description="Peer instances' peer_listen URLs (a list, or one comma-separated string); each is one more "
        "read-only lower tier, last in order: a local miss is pulled from the first peer holding it.",
    )
    peer_discovery: str | None = Field(
        None,
        description="HTTP URL of a `kvtier controller` (http://HOST:PORT) to ask, on a local miss, which live "
        "instance holds the prefix; it is pulled from that instance's peer_listen (one more read-only lower tier, "
        "after peers). The instances register with `controller`; unset: no controller-directed P2P.",
    )
    peer_timeout_s: float = Field(
        1.0, gt=0, le=MAX_CALL_S, description="Bound on one peer call (connect, lookup or pull); a timeout is a miss."
    )
    peer_retry_s: float = Field(
        5.0, gt=0, le=MAX_TTL_S, description="After a peer fails, seconds its calls are misses without trying it again."
    )
    fleet_key: Path | None = Field(
        None,
        description="This instance's fleet key file (Curve25519, owner-only; created on first use): it authenticates "
        "the instance to the controller (CURVE), to peers and to KV event subscribers. See README, the trust model.",
    )
    fleet_members: Path | None = Field(
        None,
        description="Authorized-members file or directory: the public keys this instance admits as peers and event "
        "subscribers (one 'NAME KEY [roles=] [models=] [salts=]' line each; re-read when it changes).",
    )
    controller_key: str | None = Field(
        None,
        description="The controller's public key (40 Z85 characters, `kvtier keys show`): with fleet_key set the "
        "agent connects over CURVE and talks only to that controller.",
    )
    peer_allow_remote: bool = Field(
        False, description="Let peer_listen bind beyond loopback (tcp://0.0.0.0:PORT); off: refused."
    )
    kv_events_plain: bool = Field(
        False,
        description="Publish kv_events_endpoint over plain TCP (vLLM-compatible, anyone who can connect reads it); "
        "off: a TCP endpoint needs fleet_key/fleet_members (CURVE; subscribers need the events role).",
    )
    log_level: str = Field("INFO", description="Log level of kvtier's loggers: DEBUG, INFO, WARNING, ERROR, CRITICAL.")
    config_file: Path | None = Field(
        None, description="TOML or JSON file with any of these keys, or an LMCache YAML config (.yaml/.yml)."
    )
    lmcache_config_file: Path | None = Field(
        None,
        description="LMCache YAML config to translate as the file source (see README, Coming from LMCache); "
        "default: LMCache's LMCACHE_CONFIG_FILE variable when set.",
    )

    @field_validator(
        "disk_path", "config_file", "lmcache_config_file", "model_id", "remote_url", "remote_ttl_s", "server", "server_token", "controller",
        "instance_id", "controller_token", "kv_events_endpoint", "kv_events_replay_endpoint", "peer_listen",
        "peer_discovery", "fleet_key", "fleet_members", "controller_key", mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        # KVTIER_DISK_PATH="" must not mean "the current directory".
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("cpu_capacity")
    @classmethod
    def _cpu_floor(cls, v: ByteSize, info: ValidationInfo) -> ByteSize:
        return _size_floor(v, 2 * int(info.data.get("chunk_size") or 16), info)

    @field_validator("disk_capacity")
    @classmethod
    def _disk_floor(cls, v: ByteSize, info: ValidationInfo) -> ByteSize:
        floor = 2 * int(info.data.get("chunk_size") or 16) if info.data.get("disk_path") is not None else 0
        return _size_floor(v, floor, info)

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().upper() in LOG_LEVELS:
            return v.strip().upper()
        raise ValueError(f"unknown log level {v!r}; choose one of {', '.join(LOG_LEVELS)}")

    @property
    def should_save(self) -> bool:
        """Store chunks: ``save`` and a role that produces KV (not ``kv_consumer``)."""
        return self.save and self.kv_role != "kv_consumer"

    @property
    def should_load(self) -> bool:
        """Report hits and load: ``load`` and a role that consumes KV (not ``kv_producer``)."""
        return self.load and self.kv_role != "kv_producer"

    @field_validator("server")
    @classmethod
    def _server_address(cls, v: str | None) -> str | None:
        if v is not None:
            parse_address(v)
        return v

    @field_validator("controller")
    @classmethod
    def _controller_address(cls, v: str | None) -> str | None:
        if v is None:
            return v
        scheme, sep, rest = v.partition("://")
        host, colon, port = rest.rpartition(":")
        if scheme != "tcp" or not sep or not colon or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise ValueError(f"controller address {v!r} must be tcp://HOST:PORT with a port in 1-65535")
        check_host_of("controller address", v, host, wildcard=False)
        return v

    @field_validator("instance_id")
    @classmethod
    def _instance_id(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 255 or not v.isprintable()):
            raise ValueError(f"instance_id must be 1-255 printable characters, got {v[:64]!r}")
        return v

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        scheme, sep, rest = v.partition("://")
        if scheme not in ("tcp", "ipc", "inproc") or not sep or not rest:
            raise ValueError(f"{info.field_name} {v!r} must be a ZMQ endpoint: tcp://HOST:PORT, ipc://PATH or inproc://NAME")
        if scheme == "tcp":
            host, colon, port = rest.rpartition(":")
            if not colon or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
                raise ValueError(f"{info.field_name} {v!r}: expected tcp://HOST:PORT with a port in 0-65535")
            check_host_of(str(info.field_name), v, host)
        return v

    @field_validator("peer_listen")
    @classmethod
    def _peer_listen_url(cls, v: str | None) -> str | None:
        return v if v is None else check_transfer_url("peer_listen", v, listen=True)

    @field_validator("peer_discovery")
    @classmethod
    def _peer_discovery_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        scheme, sep, rest = v.partition("://")
        host, colon, port = rest.rstrip("/").rpartition(":")
        if scheme not in ("http", "https") or not sep or not colon or not host or "/" in host or not (port.isascii() and port.isdigit()) \
                or not 0 < int(port) < 65536:
            raise ValueError(f"peer_discovery {mask_url(v)!r} must be the controller's HTTP API, http://HOST:PORT "
                             "(port 1-65535)")
        check_host_of("peer_discovery", v, host, wildcard=False)
        return v

    @field_validator("peers", mode="before")
    @classmethod
    def _peer_list(cls, v: Any) -> Any:
        if isinstance(v, str):  # KVTIER_PEERS="tcp://10.0.0.5:7700,tcp://10.0.0.6:7700"
            return tuple(p.strip() for p in v.split(",") if p.strip())
        return v

    @field_validator("peers")
    @classmethod
    def _peer_urls(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        # Each URL in its canonical form (no trailing '/', lowercased host, port without leading
        # zeros), so one peer written two ways is caught as named twice, and this instance's own
        # peer_listen is recognised however it is written.
        v = tuple(check_transfer_url("peers", url, listen=False) for url in v)
        if len(set(v)) != len(v):
            seen: set[str] = set()
            dup = ""
            for u in v:
                if u in seen:
                    dup = u
                    break
                seen.add(u)
            raise ValueError(f"peers names a peer twice: {dup!r} (URLs compared in canonical form; {len(v)} peers)")
        if info.data.get("peer_listen") in v:
            raise ValueError(f"peers names this instance's own peer_listen {info.data['peer_listen']!r}")
        return v

    @field_validator("cpu_numa_node", mode="before")
    @classmethod
    def _numa_form(cls, v: object) -> str:
        from kvtier.memory.numa_topology import SETTING_FORMS

        s = str(v).strip().lower() if isinstance(v, (str, int)) and not isinstance(v, bool) else ""
        if s in ("auto", "none", "interleave") or s.isdigit():
            return str(int(s)) if s.isdigit() else s
        raise ValueError(f"cpu_numa_node {v!r} must be {SETTING_FORMS} (a node this machine lacks is refused at start)")

    @field_validator("controller_key")
    @classmethod
    def _controller_key(cls, v: str | None) -> str | None:
        if v is not None and (len(v) != 40 or not v.isascii() or not v.isprintable() or " " in v):
            raise ValueError(f"controller_key must be the controller's 40-character Z85 public key "
                             f"(kvtier keys show KEYFILE), got {v[:48]!r}")
        return v

    @model_validator(mode="after")
    def _trust(self) -> "KVTierConfig":
        """Settings that would let a stranger in are refused (README, the trust model)."""
        creds = self.fleet_key is not None and self.fleet_members is not None
        if (self.fleet_key is None) != (self.fleet_members is None):
            raise ValueError("fleet_key and fleet_members go together (this instance's key, and whom it admits)")
        if self.controller_key is not None and not creds:
            raise ValueError("controller_key needs fleet_key and fleet_members (the agent's own key)")
        open_urls = [("peer_listen", u) for u in ((self.peer_listen,) if self.peer_listen else ())]
        open_urls += [("peers", u) for u in self.peers]
        open_urls = [(k, u) for k, u in open_urls if not u.startswith("shm://")]
        if open_urls and not creds:
            raise ValueError(f"{open_urls[0][0]} {open_urls[0][1]}: TCP/NIXL peers authenticate with fleet keys: set "
                             "fleet_key and fleet_members (without them, peers share over shm:///PATH between one "
                             "user's processes)")
        if self.peer_listen and not self.peer_listen.startswith("shm://") and not self.peer_allow_remote:
            host = self.peer_listen.split("://", 1)[1].rstrip("/").rpartition(":")[0]
            if not is_loopback(host):
                raise ValueError(f"peer_listen {self.peer_listen}: {host or 'every interface'} is beyond loopback; "
                                 "set peer_allow_remote to serve other machines")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            url = getattr(self, name)
            if url and url.startswith("tcp://") and not creds and not self.kv_events_plain:
                raise ValueError(f"{name} {url}: a TCP event stream is CURVE-authenticated with fleet_key and "
                                 "fleet_members, or plain (vLLM-compatible, readable by anyone who connects) "
                                 "with kv_events_plain; the default ipc:// endpoint is owner-only")
        return self

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
        from kvtier.tiers.registry import available_tiers, check_tier_url

        scheme, sep, rest = v.partition("://")
        if not sep or not scheme or not rest:
            raise ValueError(f"remote_url {mask_url(v)!r} is not a URL (scheme://...)")
        known = available_tiers()
        if scheme.lower() not in known:
            raise ValueError(f"no remote tier for scheme {scheme!r}; available: {', '.join(sorted(known))}")
        check_ports(v, rest)
        check_tier_url(v)
        return v

    @field_validator("remote_codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        from kvtier.serde.registry import CODECS

        if v not in CODECS:
            raise ValueError(f"unknown codec {v!r}; choose one of {sorted(CODECS)}")
        return v

    def source_of(self, key: str) -> str:
        """Where setting ``key`` came from: a file, an environment variable, ``explicit setting`` or ``default``."""
        return self._sources.get(key, "default" if key not in self.model_fields_set else "explicit setting")

    def describe(self, scope: Literal["engine", "server"] = "engine") -> str:
        """One line with the effective settings, for the start-up log (passwords in URLs masked).

        ``scope="server"`` lists only :data:`SERVER_KEYS` (a server ignores the engine-only ones).
        """
        values = self.model_dump()
        if scope == "server":
            values = {k: v for k, v in values.items() if k in SERVER_KEYS}
        if values.get("remote_url"):
            values["remote_url"] = mask_url(values["remote_url"])
        for secret in ("server_token", "controller_token"):
            if values.get(secret):
                values[secret] = "***"
        return " ".join(f"{k}={v}" for k, v in values.items())


def _size_floor(v: ByteSize, floor: int, info: ValidationInfo) -> ByteSize:
    """``v`` if it holds one chunk of the smallest kind (``floor`` bytes), else ValueError naming the forms."""
    if int(v) < floor:
        raise ValueError(
            f"{int(v)} B cannot hold one chunk (at least {floor} B for chunk_size {info.data.get('chunk_size')}); "
            f"did you mean '{int(v)}GiB'? Sizes are {SIZE_FORMS}"
        )
    return v


def _key_named_by(msg: str) -> str:
    """The setting a cross-setting error names first (its message starts with it), or "?"."""
    first = msg.removeprefix("Value error, ").split(" ", 1)[0]
    return first if first in KVTierConfig.model_fields else "?"


def load_config(
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, str] | None = None,
) -> KVTierConfig:
    """Build the effective config from explicit values, environment and file.

    Args:
        overrides: explicit settings (highest precedence), e.g. vLLM's
            ``kv_connector_extra_config``.
        environ: environment to read ``KVTIER_*`` and LMCache's ``LMCACHE_CONFIG_FILE``
            from (default ``os.environ``).
        flags: key -> the command-line flag that gave it (e.g. ``{"cpu_capacity":
            "--cpu-capacity"}``), named as the source in errors instead of
            "explicit setting".

    Raises:
        ConfigError: unknown key, bad value or unreadable file, an LMCache key kvtier
            cannot honour, or a kvtier file and an LMCache file named together; the
            message names the offending key and where it came from.
    """
    overrides = dict(overrides or {})
    environ = os.environ if environ is None else environ
    env = env_values(environ, KVTierConfig.model_fields)
    file_vals, origin, lmcache_file = file_source(overrides, env, environ)
    merged: dict[str, Any] = {**file_vals, **env, **overrides}
    if lmcache_file is not None:  # the effective LMCache file, whichever name gave it
        merged["lmcache_config_file"] = lmcache_file
    origin.update({k: f"environment variable {ENV_PREFIX}{k.upper()}" for k in env})
    origin.update({k: f"flag {flags[k]}" if flags and k in flags else "explicit setting" for k in overrides})
    try:
        config = KVTierConfig(**merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else _key_named_by(str(err["msg"]))
            where = origin.get(key, "default")
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(key, sorted(KVTierConfig.model_fields), n=1)
                hint = f"did you mean {close[0]!r}?" if close else "`kvtier config-check` prints every setting"
                problems.append(f"unknown setting {key!r} (from {where}; {hint})")
            else:
                msg = str(err["msg"]).removeprefix("Value error, ")
                problems.append(f"{key} (from {where}): {msg}")
        raise ConfigError("invalid kvtier config: " + "; ".join(problems)) from None
    config._sources.update(origin)
    return config
