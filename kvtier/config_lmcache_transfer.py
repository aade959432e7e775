"""LMCache's transfer-mode and placement keys -> kvtier (controller, P2P, PD, NIXL, NUMA).

Part of the LMCache translation (:mod:`kvtier.config_lmcache`); each rule follows
:mod:`kvtier.config_lmcache_values`. Sources: LMCache 0.5.6 ``lmcache/v1/config.py``
(key definitions), ``lmcache/v1/system_detection.py`` (``numa_mode``) and its
``examples/`` (P2P sharing, disaggregated prefill), read while writing this table.

- **Controller**: ``enable_controller`` + ``controller_pull_url`` (``controller_url``)
  -> ``controller = tcp://HOST:PORT``: a ``kvtier controller`` run there
  (``--zmq tcp://0.0.0.0:PORT``) takes the place of LMCache's.
- **P2P**: ``enable_p2p`` with ``p2p_host`` + ``p2p_init_ports`` (LMCache v0:
  ``distributed_url``) -> ``peer_listen = <channel>://HOST:PORT`` (``transfer_channel:
  nixl`` -> ``nixl://``, else ``tcp://``), and with the controller on ->
  ``peer_discovery = http://CONTROLLER_HOST:7601`` (the kvtier controller's HTTP API),
  so a local miss is pulled from the instance the controller names, as in LMCache.
- **PD**: ``enable_pd`` (or ``enable_nixl``, LMCache's earlier PD switch) with
  ``pd_role`` / ``nixl_role`` ``sender`` | ``receiver`` -> the connector setting
  ``pd_role = prefill`` | ``decode`` (:attr:`LmcacheTranslation.connector`). LMCache's
  sender pushes KV to the receiver's address; kvtier's decoder loads it from the shared
  ``kvtier server`` or pulls it from the prefiller's ``peer_listen``, so the receiver's
  and the proxy's addresses have no counterpart (ignored, with the kvtier step in
  :attr:`LmcacheTranslation.notes`). A PD receiver with ``local_cpu: false`` keeps
  only its transfer buffer in LMCache; kvtier's decoder loads through its CPU tier,
  sized by ``pd_buffer_size`` / ``nixl_buffer_size``.
- **NUMA**: ``numa_mode: auto`` -> ``cpu_numa_node = auto``; ``manual`` with
  ``extra_config.gpu_to_numa_mapping`` naming one node -> that node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvtier.config_lmcache_values import Rule, _bool, _get, _Ignore, _number, _on, _Refuse, _unset

#: The kvtier controller's default HTTP port (``kvtier controller --port``), for ``peer_discovery``.
CONTROLLER_HTTP_PORT = 7601
_HOSTPORT = re.compile(r"(?:[a-z]+://)?([A-Za-z0-9._\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})/?")

Mapped = list[tuple[str, Any, str]]


def _host_port(url: Any, what: str) -> tuple[str, int]:
    m = _HOSTPORT.fullmatch(url.strip()) if isinstance(url, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise _Refuse(f"{what} {url!r} is not HOST:PORT")
    return m.group(1), int(m.group(2))


def _first_port(v: Any, what: str) -> int:
    """LMCache port lists (one per worker) or one port: the first (kvtier runs one worker per engine)."""
    port = v[0] if isinstance(v, (list, tuple)) and v else v
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise _Refuse(f"{what} {v!r} is not a port (1-65535) or a list of ports")
    return port


# -- controller ------------------------------------------------------------------------------------
def _enable_controller(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _bool(v):
        raise _Ignore("off (LMCache's default)")
    url = _get(doc, "controller_pull_url")
    if not isinstance(url, str) or not url.strip():
        raise _Refuse("true but no controller_pull_url (controller_url) gives the controller's HOST:PORT")
    host, port = _host_port(url, "controller URL")
    addr = f"tcp://{host}:{port}"
    return [("controller", addr, f"{addr} (run `kvtier controller --zmq tcp://0.0.0.0:{port}` there: "
                                 "LMCache's controller does not speak kvtier's protocol)")]


def _instance_id(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _on(doc, "enable_controller"):
        raise _Ignore("only used with enable_controller (off)")
    if not isinstance(v, str) or not v:
        raise _Refuse(f"{v!r} is not an instance id string")
    return [("instance_id", v, v)]


def _controller_only(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if _on(doc, "enable_controller"):
        raise _Ignore("LMCache's controller wiring; kvtier's agent uses one connection to `controller`")
    raise _Ignore("only used with enable_controller (off)")


# -- P2P -------------------------------------------------------------------------------------------
def _channel(doc: Mapping[str, Any]) -> str:
    ch = _get(doc, "transfer_channel")
    return "nixl" if isinstance(ch, str) and ch.strip().lower() == "nixl" else "tcp"


def _enable_p2p(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _bool(v):
        raise _Ignore("off (LMCache's default)")
    host, port = _get(doc, "p2p_host"), _get(doc, "p2p_init_ports")
    if not _unset(host) and port is not None:
        if not isinstance(host, str):
            raise _Refuse(f"p2p_host {host!r} is not a host name")
        port = _first_port(port, "p2p_init_ports")
    elif not _unset(_get(doc, "distributed_url")):  # LMCache v0's name of the same address
        host, port = _host_port(_get(doc, "distributed_url"), "distributed_url")
    else:
        raise _Refuse("true but neither p2p_host + p2p_init_ports nor distributed_url gives the address "
                      "peers pull from (kvtier: peer_listen)")
    scheme = _channel(doc)
    listen = f"{scheme}://{host}:{port}"
    out = [("peer_listen", listen, f"{listen} (this instance serves its CPU/disk chunks to peers there)")]
    if _on(doc, "enable_controller") and not _unset(_get(doc, "controller_pull_url")):
        chost, _ = _host_port(_get(doc, "controller_pull_url"), "controller URL")
        disc = f"http://{chost}:{CONTROLLER_HTTP_PORT}"
        out.append(("peer_discovery", disc, f"{disc} (the kvtier controller's HTTP API names the instance "
                                            "holding a prefix; kvtier controller --port)"))
    return out


def _p2p_sub(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _on(doc, "enable_p2p"):
        raise _Ignore("only used with enable_p2p (off)")
    raise _Ignore("part of peer_listen (enable_p2p)")


def _p2p_lookup_ports(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _on(doc, "enable_p2p"):
        raise _Ignore("only used with enable_p2p (off)")
    raise _Ignore("kvtier's peer server answers lookups and pulls on the one peer_listen address")


def _lookup_url(v: Any, doc: Mapping[str, Any]) -> Mapped:
    raise _Ignore("LMCache v0's P2P lookup server (LMCache 0.5.6 no longer reads it); kvtier finds peers through "
                  "peer_discovery (its controller) or a peers list")


def _transfer_channel(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if _unset(v):
        raise _Ignore("unset")
    if not isinstance(v, str):
        raise _Refuse(f"{v!r} is not a channel name")
    if _on(doc, "enable_p2p"):
        raise _Ignore(f"the scheme of peer_listen ({_channel(doc)}://)")
    if _pd_on(doc):
        raise _Ignore("kvtier's PD moves KV through the shared kvtier server or the prefiller's peer_listen, whose "
                      "scheme (nixl://, tcp://, shm://) picks the channel")
    raise _Ignore("only used with enable_p2p or enable_pd (both off)")


# -- PD --------------------------------------------------------------------------------------------
def _pd_on(doc: Mapping[str, Any]) -> bool:
    return _on(doc, "enable_pd") or _on(doc, "enable_nixl")


#: LMCache PD roles -> kvtier ``pd_role`` (connector setting).
PD_ROLES = {"sender": "prefill", "receiver": "decode", "prefiller": "prefill", "decoder": "decode",
            "kv_producer": "prefill", "kv_consumer": "decode", "both": "both"}
#: What a kvtier PD deployment needs beyond the mapped role (see README, Prefill/decode disaggregation).
PD_NOTE = ("PD: give the prefiller pd_port (its confirm socket) in kv_connector_extra_config; share a "
           "`kvtier server` between prefiller and decoder on one machine, or across machines set peer_listen "
           "on the prefiller and peers = [that URL] on the decoder; route with `kvtier pd-proxy`")


def _enable_pd(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _bool(v):
        raise _Ignore("off (LMCache's default)")
    role = _get(doc, "pd_role")
    if not isinstance(role, str) or role.strip().lower() not in PD_ROLES:
        raise _Refuse(f"pd_role (nixl_role) {role!r} is not one of {', '.join(sorted(PD_ROLES))}")
    kv_role = PD_ROLES[role.strip().lower()]
    return [("pd_role", kv_role, f"{kv_role} (LMCache {role}; kv_connector_extra_config)")]


def _enable_nixl(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if _on(doc, "enable_pd"):
        if not _bool(v):
            raise _Ignore("off")
        raise _Ignore("enable_pd sets the role")
    return _enable_pd(v, doc)


def _pd_role(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _pd_on(doc):
        raise _Ignore("only used with enable_pd (off)")
    raise _Ignore("mapped with enable_pd (pd_role)")


def _pd_address(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _pd_on(doc):
        raise _Ignore("only used with enable_pd (off)")
    raise _Ignore("LMCache's sender pushes to the receiver's address; kvtier's decoder pulls from the prefiller "
                  "(the shared kvtier server, or peers = [the prefiller's peer_listen] across machines)")


def _pd_proxy(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _pd_on(doc):
        raise _Ignore("only used with enable_pd (off)")
    raise _Ignore("`kvtier pd-proxy --prefill URL --decode URL` takes the engines' addresses; the engines do not "
                  "call the proxy")


def _pd_buffer_size(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _pd_on(doc):
        raise _Ignore("only used with enable_pd (off)")
    if _on(doc, "local_cpu") or _get(doc, "local_cpu") is None:
        raise _Ignore("the CPU tier (max_local_cpu_size) holds the transferred KV in kvtier; no separate buffer")
    nbytes = int(_number(v, "bytes"))
    if nbytes <= 0:
        raise _Refuse(f"{v!r}: the transfer buffer must be positive bytes")
    return [("cpu_capacity", nbytes, f"{nbytes} B (LMCache's transfer buffer, local_cpu: false; in kvtier the "
                                      "KV handed from prefiller to decoder goes through the CPU tier)")]


def _pd_tuning(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if not _pd_on(doc):
        raise _Ignore("only used with enable_pd (off)")
    raise _Ignore("LMCache's PD transfer tuning; kvtier's transfer channel has its own bounds (peer_timeout_s, "
                  "pd_lease_s)")


# -- NUMA ------------------------------------------------------------------------------------------
def _numa_mode(v: Any, doc: Mapping[str, Any]) -> Mapped:
    if _unset(v):
        raise _Ignore("null (LMCache's default: no NUMA placement); kvtier's default cpu_numa_node = auto places "
                      "the CPU tier on the engine's node")
    mode = v.strip().lower() if isinstance(v, str) else v
    if mode == "auto":
        return [("cpu_numa_node", "auto", "auto (the node of the engine's bound cores, else of the GPU's PCI device)")]
    if mode != "manual":
        raise _Refuse(f"{v!r} is not auto or manual")
    extra = _get(doc, "extra_config")
    mapping = extra.get("gpu_to_numa_mapping") if isinstance(extra, Mapping) else None
    if not isinstance(mapping, Mapping) or not mapping:
        raise _Refuse("manual needs extra_config.gpu_to_numa_mapping ({gpu index: node})")
    nodes = set()
    for node in mapping.values():
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise _Refuse(f"gpu_to_numa_mapping node {node!r} is not a node number")
        nodes.add(node)
    if len(nodes) > 1:
        raise _Refuse(f"gpu_to_numa_mapping names nodes {sorted(nodes)}: a kvtier CPU tier belongs to one engine "
                      "(one GPU); give that engine's cpu_numa_node, or numa_mode auto")
    node = nodes.pop()
    return [("cpu_numa_node", str(node), f"{node} (extra_config.gpu_to_numa_mapping)")]


#: The transfer-mode and placement rules (merged into :data:`kvtier.config_lmcache.RULES`).
TRANSFER_RULES: dict[str, Rule] = {
    "enable_controller": _enable_controller,
    "lmcache_instance_id": _instance_id,
    **{k: _controller_only for k in ("controller_pull_url", "controller_reply_url", "lmcache_worker_ports",
                                      "lmcache_worker_ids", "lmcache_worker_heartbeat_delay_time",
                                      "lmcache_worker_heartbeat_time")},
    "enable_p2p": _enable_p2p,
    "p2p_host": _p2p_sub,
    "p2p_init_ports": _p2p_sub,
    "distributed_url": _p2p_sub,
    "p2p_lookup_ports": _p2p_lookup_ports,
    "lookup_url": _lookup_url,
    "transfer_channel": _transfer_channel,
    "enable_pd": _enable_pd,
    "enable_nixl": _enable_nixl,
    "pd_role": _pd_role,
    **{k: _pd_address for k in ("pd_peer_host", "pd_peer_init_port", "pd_peer_alloc_port", "pd_peer_query_port",
                                 "nixl_receiver_host", "nixl_receiver_port", "nixl_peer_port")},
    **{k: _pd_proxy for k in ("pd_proxy_host", "pd_proxy_port", "pd_skip_proxy_notification")},
    "pd_buffer_size": _pd_buffer_size,
    **{k: _pd_tuning for k in ("pd_buffer_device", "pd_allocation_timeout_sec", "pd_shutdown_timeout_sec",
                                "pd_condition_poll_interval_sec", "pd_max_prefill_len", "pd_backend_mode",
                                "pd_bidirectional", "nixl_backends", "nixl_buffer_device", "nixl_enable_gc")},
    "numa_mode": _numa_mode,
}
