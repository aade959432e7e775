"""Router configuration: backends, policy, controller, score weights.

A backend on the command line is ``URL[=INSTANCE_ID][@EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]``:

* ``URL``: the vLLM OpenAI server's base URL (``http://127.0.0.1:8000``);
* ``INSTANCE_ID``: its kvtier instance id at the fleet controller (for ``/lookup`` answers);
* ``EVENTS_ENDPOINT``: its KV events PUB endpoint (vLLM ``--kv-events-config`` ``endpoint``;
  the router connects to it), optionally followed by the replay ROUTER endpoint.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kvtier.urls import mask_url

log = logging.getLogger("kvtier.router")

#: Environment variable the router reads the controller's bearer token from (the controller's own).
CONTROLLER_TOKEN_ENV = "KVTIER_CONTROLLER_TOKEN"

#: Routing policies.
POLICIES: tuple[str, ...] = ("kv-aware", "round-robin", "least-loaded")


class RouterConfigError(ValueError):
    """A router setting is invalid (the message names it)."""


@dataclass(frozen=True)
class BackendSpec:
    """One vLLM instance behind the router.

    Attributes:
        url: base URL of its OpenAI server, no trailing slash.
        instance_id: its instance id at the fleet controller (``None``: not registered).
        events: its KV events PUB endpoint (``None``: no events; kv-aware then relies on the
            controller, or on load alone).
        replay: its KV events replay endpoint (``None``: gaps are not filled).
    """

    url: str
    instance_id: str | None = None
    events: str | None = None
    replay: str | None = None

    @property
    def name(self) -> str:
        """Display name: the instance id, else ``host:port``."""
        if self.instance_id:
            return self.instance_id
        netloc = urlsplit(self.url).netloc
        return netloc.rpartition("@")[2] if netloc else mask_url(self.url)  # never a user:password@ (answer headers)


#: Where a backend's events part starts: ``@`` followed by a ZMQ endpoint's scheme (a ``user:password@``
#: in the backend URL is not it).
_EVENTS_AT = re.compile(r"@(?=(?:tcp|ipc|inproc)://)")


def parse_backend(text: str) -> BackendSpec:
    """Parse ``URL[=INSTANCE_ID][@EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]`` (the events part starts at the
    first ``@`` followed by ``tcp://``, ``ipc://`` or ``inproc://``, so the URL may carry
    ``user:password@``; errors show the text with its password masked).

    Raises:
        RouterConfigError: no ``http(s)://host:port`` URL, an empty instance id, or an events part
            that is empty or not ZMQ endpoints.
    """
    s = text.strip()
    shown = mask_url(s)
    events = replay = None
    m = _EVENTS_AT.search(s)
    if m is not None or s.endswith("@"):
        s, ev = (s[:m.start()], s[m.end():]) if m is not None else (s[:-1], "")
        parts = [p.strip() for p in ev.split(",")]
        if (not parts[0] or len(parts) > 2 or (len(parts) == 2 and not parts[1])
                or not all(p.startswith(("tcp://", "ipc://", "inproc://")) for p in parts)):
            raise RouterConfigError(f"--backend {shown!r}: events must be ENDPOINT or ENDPOINT,REPLAY_ENDPOINT "
                                    "(tcp://, ipc:// or inproc://)")
        events = parts[0]
        replay = parts[1] if len(parts) == 2 else None
    instance = None
    if "=" in s:
        s, instance = s.split("=", 1)
        if not instance:
            raise RouterConfigError(f"--backend {shown!r}: empty instance id after '='")
    url = s.rstrip("/")
    split = urlsplit(url)
    try:
        port = split.port
    except ValueError:
        port = -1
    if split.scheme not in ("http", "https") or not split.hostname or port == -1:
        raise RouterConfigError(f"--backend {shown!r}: expected an http(s)://host:port URL"
                                " (an events endpoint needs its scheme: @tcp://HOST:PORT)")
    return BackendSpec(url=url, instance_id=instance, events=events, replay=replay)


def controller_token_from(argv_token: str | None, token_file: Path | None,
                          environ: Mapping[str, str] = os.environ) -> str | None:
    """The controller's bearer token: ``--controller-token`` (visible to every user in ``ps``
    and ``/proc``: warned), else the first line of ``--controller-token-file``, else
    ``$KVTIER_CONTROLLER_TOKEN``; ``None``: none given.

    Raises:
        RouterConfigError: both the flag and the file, an unreadable or empty file.
    """
    if argv_token is not None and token_file is not None:
        raise RouterConfigError("give --controller-token or --controller-token-file, not both")
    if argv_token is not None:
        log.warning("kvtier router: --controller-token is visible to every user of this machine (ps, /proc); "
                    "use --controller-token-file or $%s", CONTROLLER_TOKEN_ENV)
        return argv_token or None
    if token_file is not None:
        try:
            lines = token_file.read_text().splitlines()
        except OSError as exc:
            raise RouterConfigError(f"--controller-token-file {token_file}: {exc.strerror or exc}") from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise RouterConfigError(f"--controller-token-file {token_file} is empty")
        if token_file.stat().st_mode & 0o077:
            log.warning("kvtier router: token file %s is readable by other users; chmod 600 it", token_file)
        return token
    return environ.get(CONTROLLER_TOKEN_ENV) or None


@dataclass(frozen=True)
class Weights:
    """Score weights (kv-aware: score = sum of cached prefix tokens x tier weight - load x ``load``).

    Attributes:
        gpu, cpu, disk, remote: value of one cached prompt token by where it is (engine
            blocks > kvtier CPU > disk > remote); must be decreasing and in (0, 1].
        load: penalty per token of load (see :mod:`kvtier.router.load`).
        recent_tokens: load tokens charged per recent assignment (decayed count).
        recent_half_life_s: half life of the recent-assignment count (seconds).
        kv_usage_tokens: load tokens charged at 100 % engine KV usage (scaled linearly).
        external_request_tokens: load tokens per running/waiting request the router did not
            send itself (from the backend's metrics), when no prompt size was seen yet.
    """

    gpu: float = 1.0
    cpu: float = 0.8
    disk: float = 0.5
    remote: float = 0.3
    load: float = 0.5
    recent_tokens: float = 32.0
    recent_half_life_s: float = 10.0
    kv_usage_tokens: float = 256.0
    external_request_tokens: float = 512.0

    def medium(self, medium: str | None) -> float:
        """The weight of an index medium (``None``/``GPU``: engine; ``STORAGE`` = ``DISK``); 0 for a
        name it does not know (such blocks are never indexed: an unknown name weighs least)."""
        if medium is None:
            return self.gpu
        return {"GPU": self.gpu, "CPU": self.cpu, "DISK": self.disk, "STORAGE": self.disk,
                "REMOTE": self.remote}.get(medium.upper(), 0.0)

    def validate(self) -> None:
        """Raises RouterConfigError when a weight is out of range or the tiers are not ordered."""
        tiers = (self.gpu, self.cpu, self.disk, self.remote)
        if any(not 0 < w <= 1 for w in tiers):
            raise RouterConfigError(f"tier weights must be in (0, 1], got {tiers}")
        if not tiers[0] >= tiers[1] >= tiers[2] >= tiers[3]:
            raise RouterConfigError(f"tier weights must satisfy gpu >= cpu >= disk >= remote, got {tiers}")
        for name in ("load", "recent_tokens", "kv_usage_tokens", "external_request_tokens"):
            if getattr(self, name) < 0:
                raise RouterConfigError(f"weight {name} must be >= 0")
        if self.recent_half_life_s <= 0:
            raise RouterConfigError("recent_half_life_s must be > 0")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs.

    Attributes:
        backends: the vLLM instances (at least one, distinct URLs).
        policy: one of :data:`POLICIES`.
        model: the model folder (tokenizer and chat template); ``None``: prompts given as
            token ids only are scored, text prompts are routed by load alone.
        controller_url: fleet controller base URL for ``/lookup`` (``None``: not used).
        controller_token: its bearer token (``None``: none).
        weights: score weights.
        events_topic: KV events topic to subscribe to (``""``: every topic; vLLM's default).
        events_max_message_bytes: largest KV event frame read from a backend (bytes); a larger
            one is dropped with its publisher's connection (a gap: replayed, else the backend's
            routes are dropped).
        health_interval_s: seconds between ``GET /health`` probes of each backend.
        metrics_interval_s: seconds between ``GET /metrics`` polls of each backend.
        connect_timeout_s: connect timeout to a backend (a request then tries another one).
        health_timeout_s: timeout of one health probe.
        read_timeout_s: longest wait for a backend's next bytes once connected.
        controller_timeout_s: timeout of one controller lookup (a slow one is a miss).
        down_after_timeouts: consecutive probe timeouts that take a backend out (a refused
            connection takes it out at once).
        decisions_kept: routing decisions kept for ``/router/state``.
        max_body_bytes: largest request body (bytes); larger is 413 before it is read.
        max_prompt_tokens: longest prompt (tokens; a longer one is 400 before it is forwarded);
            ``None``: the smallest ``max_model_len`` the backends' ``/v1/models`` report, once
            known.
        fleet_key / fleet_members: the router's fleet key file and a members file (see
            :mod:`kvtier.protocol.trust`): a backend whose instance id names a member there has its
            KV events read over CURVE with that member's public key (a ``kvtier server``'s keyed
            stream admits the router if its own members file lists the router's key with the
            ``events`` role); other backends' events (vLLM's publisher) are read plain. Both or
            neither.
    """

    backends: tuple[BackendSpec, ...]
    policy: str = "kv-aware"
    model: str | None = None
    controller_url: str | None = None
    controller_token: str | None = None
    weights: Weights = field(default_factory=Weights)
    events_topic: str = ""
    events_max_message_bytes: int = 16 << 20
    health_interval_s: float = 0.5
    metrics_interval_s: float = 0.5
    connect_timeout_s: float = 1.0
    health_timeout_s: float = 1.0
    read_timeout_s: float = 600.0
    controller_timeout_s: float = 0.25
    down_after_timeouts: int = 2
    decisions_kept: int = 64
    max_body_bytes: int = 16 << 20
    max_prompt_tokens: int | None = None
    fleet_key: str | None = None
    fleet_members: str | None = None

    def validate(self) -> RouterConfig:
        """Check the settings; returns self.

        Raises:
            RouterConfigError: no backend, duplicate URLs or instance ids, unknown policy,
                non-positive intervals/timeouts, bad weights.
        """
        if not self.backends:
            raise RouterConfigError("at least one --backend is required")
        urls = [b.url for b in self.backends]
        if len(set(urls)) != len(urls):
            raise RouterConfigError(f"duplicate backend URLs: {urls}")
        ids = [b.instance_id for b in self.backends if b.instance_id]
        if len(set(ids)) != len(ids):
            raise RouterConfigError(f"duplicate backend instance ids: {ids}")
        if self.policy not in POLICIES:
            raise RouterConfigError(f"unknown policy {self.policy!r}; choose one of {list(POLICIES)}")
        for name in ("health_interval_s", "metrics_interval_s", "connect_timeout_s", "health_timeout_s",
                     "read_timeout_s", "controller_timeout_s"):
            if getattr(self, name) <= 0:
                raise RouterConfigError(f"{name} must be > 0")
        if self.max_body_bytes < 1 or (self.max_prompt_tokens is not None and self.max_prompt_tokens < 1):
            raise RouterConfigError("max_body_bytes and max_prompt_tokens must be >= 1")
        if (self.fleet_key is None) != (self.fleet_members is None):
            raise RouterConfigError("--fleet-key and --fleet-members go together (the router's key, and the "
                                    "publishers' keys by instance id)")
        if self.events_max_message_bytes < 1:
            raise RouterConfigError("events_max_message_bytes must be >= 1")
        if self.down_after_timeouts < 1 or self.decisions_kept < 1:
            raise RouterConfigError("down_after_timeouts and decisions_kept must be >= 1")
        self.weights.validate()
        return self
