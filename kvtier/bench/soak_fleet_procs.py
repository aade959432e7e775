"""The fleet of ``kvtier bench soak-fleet``: its keys, ports and processes.

:class:`SoakFleet` starts, each in its own process and on loopback ports picked free:

- a ``kvtier controller`` with a token (``KVTIER_CONTROLLER_TOKEN``, never on argv) and CURVE keys
  (``--key``/``--members``);
- ``instances`` ``kvtier server`` processes, each a keyed member (``ids=inst-N``): registered with the
  controller over CURVE, serving its chunks to peers over TCP (``peer_listen``, fleet keys), pulling
  misses from the peer the controller names (``peer_discovery``), publishing KV events over CURVE
  TCP (``kv_events_endpoint`` and replay), its dashboard behind the server token (``--token-file``);
- one fake OpenAI process (:mod:`kvtier.testing.fake_openai`) holding one backend per instance, a
  prefiller and a decoder: vLLM engines are too heavy for a 2-core machine and what the soak checks
  is the router's and the PD proxy's own hardening;
- ``kvtier router`` in front of the backends (backend ``i`` is instance ``inst-i``: asked through the
  controller's ``/lookup``, and its KV event stream read over CURVE as member ``router``), and
  ``kvtier pd-proxy`` in front of the prefiller and decoder.

The members file also lists ``auditor`` (roles ``peer,events``: the soak's own prober, which pulls
and subscribes as a member does), ``router`` (roles ``events``) and ``rogue`` (roles ``register,peer``, ``ids=rogue-*``,
``models=rogue/*``: a member key the hostile client holds, so the bounds on what a member may claim
are attacked too). :meth:`SoakFleet.plan` is what the well-behaved processes get (token, key paths);
:meth:`SoakFleet.hostile_plan` only what a stranger can know (addresses, public keys) plus the rogue key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvtier.bench.soak import _die_with_parent, _tail
from kvtier.processes import stop_processes
from kvtier.ports import PortPicker
from kvtier.testing.fleet_keys import FleetKeys, make_fleet

#: Seconds every process gets to come up.
STARTUP_S = 120.0
#: The soak's members besides the instances: its prober, the router, and the member key the hostile client holds.
AUDITOR, ROUTER, ROGUE = "auditor", "router", "rogue"


def router_reads_keyed_events() -> bool:
    """Whether this ``kvtier router`` takes fleet keys (reads keyed KV event streams) and a token file
    (issue 24's router; before it, the token went on argv and the servers' streams were unreadable)."""
    from kvtier.router.config import RouterConfig

    return "fleet_key" in getattr(RouterConfig, "__dataclass_fields__", {})


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(extra or {})
    return env


def spawn(args: Sequence[str], log: Path, extra_env: dict[str, str] | None = None, nice: int = 0) -> subprocess.Popen:
    """``python -m ARGS`` with its output in ``log``, no ``KVTIER_*`` variables but ``extra_env``, at
    ``nice`` (added to this process's); it gets SIGTERM if this process dies."""

    def setup() -> None:  # in the child, between fork and exec
        _die_with_parent()
        if nice:
            os.nice(nice)

    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", *args], env=_env(extra_env), stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=setup)


def get(url: str, token: str | None = None, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of a GET; (0, the error) when it fails."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except Exception as exc:
        return 0, f"{type(exc).__name__}: {exc}".encode()


@dataclass
class Instance:
    """One ``kvtier server`` of the fleet: its id, socket, ports."""

    name: str
    socket: str
    metrics_port: int
    tcp_port: int
    peer_port: int
    events_port: int
    replay_port: int
    backend_port: int

    @property
    def peer_url(self) -> str:
        return f"tcp://127.0.0.1:{self.peer_port}"


@dataclass
class SoakFleet:
    """Keys, ports and processes of one soak (see the module docstring); :meth:`start`, :meth:`stop`."""

    tmp: Path
    instances: int = 3
    cpu_capacity: int = 48 << 20
    router_model: str | None = None
    keys: FleetKeys = field(init=False)
    token: str = field(init=False)
    server_token: str = field(init=False)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.token = os.urandom(24).hex()
        self.server_token = os.urandom(24).hex()
        ports = PortPicker()  # one picker: no two of the fleet's ~24 ports the same
        self.http_port, self.zmq_port = ports.pick(), ports.pick()
        self.router_port, self.pd_port = ports.pick(), ports.pick()
        self.prefill_port, self.decode_port = ports.pick(), ports.pick()
        self.nodes = [Instance(f"inst-{i}", str(self.tmp / f"s{i}" / "s.sock"), *(ports.pick() for _ in range(6)))
                      for i in range(self.instances)]
        options = {n.name: f"ids={n.name}" for n in self.nodes}
        options.update({AUDITOR: "roles=peer,events", ROUTER: "roles=events",
                        ROGUE: "roles=register,peer ids=rogue-* models=rogue/*"})
        self.keys = make_fleet(self.tmp / "keys", ["controller", *(n.name for n in self.nodes), AUDITOR, ROUTER, ROGUE],
                               options)
        for name, secret in (("server-token", self.server_token), ("controller-token", self.token)):
            (self.tmp / name).write_text(secret)
            os.chmod(self.tmp / name, 0o600)

    @property
    def controller_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def pd_url(self) -> str:
        return f"http://127.0.0.1:{self.pd_port}"

    # -- what each side knows ----------------------------------------------------------------------
    def _public(self) -> dict[str, Any]:
        return {
            "controller_url": self.controller_url, "zmq_url": f"tcp://127.0.0.1:{self.zmq_port}",
            "controller_key": self.keys.public("controller"), "router_url": self.router_url, "pd_url": self.pd_url,
            "members_path": str(self.keys.members_path),
            "instances": [{**n.__dict__, "peer_url": n.peer_url, "public": self.keys.public(n.name)} for n in self.nodes],
            "pids": {name: p.pid for name, p in self.procs.items()},
        }

    def plan(self) -> dict[str, Any]:
        """Everything the soak's own (trusted) processes need: the public view, the token, the auditor key."""
        return {**self._public(), "token": self.token, "server_token": self.server_token,
                "auditor_key": str(self.keys.key_path(AUDITOR)),
                "decode_url": f"http://127.0.0.1:{self.decode_port}"}

    def hostile_plan(self) -> dict[str, Any]:
        """What a stranger on the machine can know (addresses, public keys), plus the rogue member's key."""
        return {**self._public(), "rogue_key": str(self.keys.key_path(ROGUE))}

    def secrets(self) -> list[str]:
        """Strings that must never appear where the hostile client can read them."""
        return [self.token, self.server_token, *(k.secret for k in self.keys.keys.values() if k.secret)]

    # -- processes -------------------------------------------------------------------------------------
    def _server_config(self, n: Instance) -> Path:
        cfg = {
            "controller": f"tcp://127.0.0.1:{self.zmq_port}", "instance_id": n.name, "controller_token": self.token,
            "controller_key": self.keys.public("controller"), **self.keys.config(n.name),
            "peer_listen": n.peer_url, "peer_discovery": self.controller_url, "peer_timeout_s": 1.0,
            # vLLM's rule: a wildcard host binds, any other host connects (to a forwarder)
            "kv_events_endpoint": f"tcp://*:{n.events_port}",
            "kv_events_replay_endpoint": f"tcp://127.0.0.1:{n.replay_port}",
        }
        path = self.tmp / f"{n.name}.json"
        path.write_text(json.dumps(cfg))
        os.chmod(path, 0o600)
        return path

    def start(self) -> None:
        """Start every process and wait until each answers (instances registered at the controller).

        Raises:
            RuntimeError: a process exited or did not come up within ``STARTUP_S`` (the message has its log).
        """
        t = self.tmp
        self.procs["controller"] = spawn(
            ["kvtier.cli", "controller", "--host", "127.0.0.1", "--port", str(self.http_port),
             "--zmq", f"tcp://127.0.0.1:{self.zmq_port}", "--key", str(self.keys.key_path("controller")),
             "--members", str(self.keys.members_path)], t / "controller.log", {"KVTIER_CONTROLLER_TOKEN": self.token})
        for n in self.nodes:
            Path(n.socket).parent.mkdir(mode=0o700)
            self.procs[n.name] = spawn(
                ["kvtier.cli", "server", "--socket", n.socket, "--config", str(self._server_config(n)),
                 "--cpu-capacity", str(self.cpu_capacity), "--metrics-host", "127.0.0.1",
                 "--metrics-port", str(n.metrics_port), "--tcp-host", "127.0.0.1", "--tcp-port", str(n.tcp_port),
                 "--token-file", str(t / "server-token")], t / f"{n.name}.log")
        # The router's backends and the PD legs in two processes: one's load never stalls the other's.
        for name, listen in (("backends", [f"backend:{n.backend_port}" for n in self.nodes]),
                             ("pd_backends", [f"prefill:{self.prefill_port}", f"decode:{self.decode_port}"])):
            self.procs[name] = spawn(["kvtier.testing.fake_openai", *(a for x in listen for a in ("--listen", x)),
                                      "--ready", str(t / f"{name}-ready")], t / f"{name}.log")
        for name in ("backends", "pd_backends"):
            self._wait(name, lambda: (t / f"{name}-ready").exists())
        router = ["kvtier.cli", "router", "--port", str(self.router_port), "--controller", self.controller_url]
        keyed = router_reads_keyed_events()
        if keyed:  # backend i's KV events: instance i's CURVE stream, read with the router's own key
            router += ["--controller-token-file", str(t / "controller-token"), "--fleet-key",
                       str(self.keys.key_path(ROUTER)), "--fleet-members", str(self.keys.members_path)]
        else:
            router += ["--controller-token", self.token]
        for n in self.nodes:
            events = f"@tcp://127.0.0.1:{n.events_port},tcp://127.0.0.1:{n.replay_port}" if keyed else ""
            router += ["--backend", f"http://127.0.0.1:{n.backend_port}={n.name}{events}"]
        if self.router_model:
            router += ["--model", self.router_model]
        self.procs["router"] = spawn(router, t / "router.log")
        self.procs["pd_proxy"] = spawn(["kvtier.cli", "pd-proxy", "--prefill", f"http://127.0.0.1:{self.prefill_port}",
                                        "--decode", f"http://127.0.0.1:{self.decode_port}", "--port", str(self.pd_port)],
                                       t / "pd_proxy.log")
        self._wait("controller", lambda: get(f"{self.controller_url}/instances", self.token)[0] == 200)
        self._wait("instances", lambda: self.registered() == {n.name for n in self.nodes})
        self._wait("router", lambda: get(f"{self.router_url}/health")[0] == 200)
        self._wait("pd_proxy", lambda: get(f"{self.pd_url}/health")[0] == 200)

    def registered(self) -> set[str]:
        """Instance ids the controller lists now (empty when it does not answer)."""
        code, body = get(f"{self.controller_url}/instances", self.token)
        if code != 200:
            return set()
        try:
            return {r["instance"] for r in json.loads(body).get("instances", [])}
        except (ValueError, AttributeError, KeyError, TypeError):
            return set()

    def _wait(self, what: str, ready: Any) -> None:
        deadline = time.monotonic() + STARTUP_S
        while not ready():
            dead = [name for name, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {d}.log\n{_tail(self.tmp / f'{d}.log')}" for d in (dead or list(self.procs)))
                raise RuntimeError(f"{what} did not come up ({'exited: ' + ', '.join(dead) if dead else 'timeout'})\n{logs}")
            time.sleep(0.1)

    def dead(self) -> list[str]:
        """Names of the fleet's processes that exited."""
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def stop(self) -> dict[str, int | None]:
        """Stop every process (SIGTERM, then SIGKILL after 20 s); their exit codes."""
        stop_processes(list(self.procs.values()), 20.0)
        return {name: p.returncode for name, p in self.procs.items()}
