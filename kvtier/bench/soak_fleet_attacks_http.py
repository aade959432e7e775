"""Issue 24, kinds 4-6 (dashboards and status routes, the PD proxy, the router), as soak attacks.

Each function is one bounded run (:mod:`kvtier.bench.soak_fleet_hostile` loops over them). Kind 4:
``dashboard_scrape`` (every data route of the controller and the servers without a token: success
= a 200 on a route that needs the token, or data on the event stream; every answer's start is kept
for the report's secret scan), ``sse_flood`` (12 tokenless event streams on the controller and on a
server, held: the operator must still read the dashboard, ``operator_lockout``), ``foreign_host``
(``POST /clear`` and dashboard reads with a foreign ``Host:``, as a DNS-rebinding page sends them:
success = 2xx). Kind 5: ``pd_client_params`` (the issue's input: ``kv_transfer_params`` naming
the hostile's own host:port and engine/request ids, top level and in ``vllm_xargs``, with
``min_tokens=2``: success = the decoder received them, which the fake decoder records, or the
hostile's listener was dialled), ``pd_big_body``, ``pd_bad_json``. Kind 6: ``router_huge_prompts`` (six 3 MB text
prompts at once, and token-id prompts beyond the context: success = forwarded, or ordinary
requests stalled), ``router_big_body`` (42 MB, with a length and chunked), ``router_bad_json``
(success = a 5xx or no answer), ``router_huge_answer`` (a 256 MB non-streamed answer read slowly:
``rss_router``), ``router_cut_stream`` (a stream the backend cuts: success = it looks finished to
the client), ``router_slowloris``, ``argv_secrets`` (every fleet process's ``/proc/PID/cmdline``,
kept for the secret scan).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import httpx
import numpy as np

from kvtier.testing.fake_openai import MARKER

if TYPE_CHECKING:
    from kvtier.bench.soak_fleet_attack_base import Hostile, Tally

#: Controller routes that need the operator token (the page itself, ``/``, may load for anyone).
CONTROLLER_GUARDED = ("/dashboard/snapshot", "/instances", "/metrics", "/health", "/check_finish/x")
#: Server routes that need the server token (``/metrics`` and ``/health`` stay open for scrapers).
SERVER_GUARDED = ("/dashboard/snapshot",)
OPEN_ROUTES = ("/", "/metrics", "/health")
SSE_STREAMS = 12
HOLD_S = 3.0
PROMPT_BYTES = 3_000_000
BIG_BODY_BYTES = 42_000_000
SLOW_CONNECTIONS = 32


def _ports(h: Hostile) -> list[tuple[str, str]]:
    """(name, base URL) of every HTTP service a stranger can reach."""
    out = [("controller", h.plan["controller_url"])]
    out += [(n["name"], f"http://127.0.0.1:{n['metrics_port']}") for n in h.plan["instances"]]
    return out


def _get(h: Hostile, t: Tally, url: str, where: str, **kw: Any) -> httpx.Response | None:
    t.act()
    try:
        r = httpx.get(url, timeout=3.0, verify=h.tls, **kw)
    except httpx.HTTPError as exc:
        t.saw(f"error_{type(exc).__name__}")
        return None
    t.saw(f"http_{r.status_code}")
    t.keep(where, r.content)
    return r


def dashboard_scrape(h: Hostile, t: Tally) -> None:
    for name, base in _ports(h):
        guarded = CONTROLLER_GUARDED if name == "controller" else SERVER_GUARDED
        for path in (*guarded, *OPEN_ROUTES):
            r = _get(h, t, base + path, f"{name} GET {path}")
            if r is not None and r.status_code == 200 and path in guarded:
                t.success(f"{name} {path} answered 200 without a token ({len(r.content)} bytes)")
        t.act()
        try:
            with httpx.stream("GET", base + "/dashboard/events", timeout=2.0, verify=h.tls) as r:
                data = b""
                end = time.monotonic() + 1.0
                if r.status_code == 200:
                    for chunk in r.iter_raw():
                        data += chunk
                        if b"data:" in data or time.monotonic() > end or len(data) > 1 << 16:
                            break
                t.keep(f"{name} GET /dashboard/events", data)
                if b"data:" in data:
                    t.success(f"{name} /dashboard/events streamed data without a token")
        except httpx.HTTPError as exc:
            t.saw(f"sse_{type(exc).__name__}")


def _raw(url: str, request: bytes, timeout_s: float = 2.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout_s)
    s.sendall(request)
    return s


def sse_flood(h: Hostile, t: Tally) -> None:
    held: list[socket.socket] = []
    targets = [h.plan["controller_url"], f"http://127.0.0.1:{h.plan['instances'][0]['metrics_port']}"]
    try:
        for base in targets:
            for _ in range(SSE_STREAMS):
                t.act()
                try:
                    held.append(_raw(base, b"GET /dashboard/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                           b"Accept: text/event-stream\r\n\r\n"))
                except OSError:
                    t.saw("connect_failed")
        h.stop.wait(HOLD_S)
    finally:
        for s in held:
            s.close()


def foreign_host(h: Hostile, t: Tally) -> None:
    evil = {"Host": "kvtier.evil.example"}
    for name, base in _ports(h):
        t.act()
        try:
            if name == "controller":
                r = httpx.post(base + "/clear", json={}, headers=evil, timeout=3.0, verify=h.tls)
                t.saw(f"clear_http_{r.status_code}")
                if 200 <= r.status_code < 300:
                    t.success(f"controller POST /clear with a foreign Host answered {r.status_code}")
            r = httpx.get(base + "/dashboard/snapshot", headers=evil, timeout=3.0, verify=h.tls)
            t.saw(f"snapshot_http_{r.status_code}")
            t.keep(f"{name} foreign-host snapshot", r.content)
            if 200 <= r.status_code < 300:
                t.success(f"{name} /dashboard/snapshot with a foreign Host answered {r.status_code}")
        except httpx.HTTPError as exc:
            t.saw(f"error_{type(exc).__name__}")


# -- kind 5: the PD proxy ---------------------------------------------------------------------------------

def _listener(h: Hostile) -> tuple[int, dict[str, int]]:
    """A TCP listener of the hostile's (started once): where its forged params send a decoder; counts dials."""
    got = h.state.get("pd_listener")
    if got is not None:
        return got
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    seen = {"dials": 0}

    def accept() -> None:
        while not h.stop.is_set():
            try:
                c, _ = srv.accept()
                seen["dials"] += 1
                c.close()
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    h.state["pd_listener"] = (srv.getsockname()[1], seen)
    h.state.setdefault("closers", []).append(srv.close)
    return h.state["pd_listener"]


def pd_client_params(h: Hostile, t: Tally) -> None:
    port, seen = _listener(h)
    dials = seen["dials"]
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"{MARKER}-{h.run}",
              "remote_request_id": "victim-request", "remote_host": "127.0.0.1", "remote_port": port,
              "remote_block_ids": [1, 2, 3], "kvtier_confirm": MARKER}
    base = {"model": "fake", "prompt": list(range(64)), "max_tokens": 4, "min_tokens": 2}
    for body in ({**base, "kv_transfer_params": params}, {**base, "vllm_xargs": {"kv_transfer_params": params}},
                 {**base, "kv_transfer_params": params, "stream": True}):
        t.act()
        try:
            r = httpx.post(h.plan["pd_url"] + "/v1/completions", json=body, timeout=5.0, verify=h.tls)
            t.saw(f"http_{r.status_code}")
        except httpx.HTTPError as exc:
            t.saw(f"error_{type(exc).__name__}")
    time.sleep(0.1)
    if seen["dials"] > dials:
        t.success(f"the hostile's listener (named in kv_transfer_params) was dialled {seen['dials'] - dials} times")


def _big_body(h: Hostile, nbytes: int) -> bytes:
    """A JSON completion body of about ``nbytes`` of token ids (made once: it costs seconds of CPU)."""
    key = f"big_body_{nbytes}"
    if key not in h.state:
        ids = np.random.default_rng(0).integers(10_000, 50_000, nbytes // 7).tolist()
        h.state[key] = json.dumps({"model": "fake", "prompt": ids, "max_tokens": 1}).encode()
    return h.state[key]


def _post_big(h: Hostile, url: str, t: Tally, nbytes: int, chunked: bool) -> httpx.Response | None:
    body = _big_body(h, nbytes)
    t.act()
    try:
        content: Any = body if not chunked else (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20))
        r = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=30.0, verify=h.tls)
        t.saw(f"{'chunked_' if chunked else ''}http_{r.status_code}")
        return r
    except httpx.HTTPError as exc:
        t.saw(f"error_{type(exc).__name__}")
        return None


def pd_big_body(h: Hostile, t: Tally) -> None:
    r = _post_big(h, h.plan["pd_url"] + "/v1/completions", t, BIG_BODY_BYTES, False)
    if r is not None and r.status_code == 200:
        t.success("the PD proxy forwarded a 42 MB body")


# -- kind 6: the router -------------------------------------------------------------------------------------

def router_huge_prompts(h: Hostile, t: Tally) -> None:
    url = h.plan["router_url"] + "/v1/completions"
    if "huge_prompt_bodies" not in h.state:  # encoded once: 3 MB of JSON per body is the hostile's CPU, not the router's
        words = " ".join(["patient", "record", "soak", "kvtier", "hostile"] * (PROMPT_BYTES // 30))[:PROMPT_BYTES]
        text = json.dumps({"model": "fake", "prompt": words, "max_tokens": 1}).encode()
        ids = json.dumps({"model": "fake", "prompt": list(range(400_000)), "max_tokens": 1}).encode()  # beyond the context
        h.state["huge_prompt_bodies"] = [("str", text)] * 6 + [("list", ids)]
    bodies: list[tuple[str, bytes]] = h.state["huge_prompt_bodies"]
    codes: list[Any] = []

    def send(body: tuple[str, bytes]) -> None:
        try:
            r = httpx.post(url, content=body[1], headers={"content-type": "application/json"}, timeout=60.0, verify=h.tls)
            codes.append((body[0], r.status_code))
        except httpx.HTTPError as exc:
            codes.append(("error", type(exc).__name__))

    threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
    for th in threads:
        t.act()
        th.start()
    for th in threads:
        th.join(90.0)
    for kind, code in codes:
        t.saw(f"{kind}_{code}")
        if code == 200 and (kind == "list" or h.plan.get("router_tokenizer")):
            t.success(f"a {kind} prompt beyond the model's context was forwarded (200)")


def router_big_body(h: Hostile, t: Tally) -> None:
    for chunked in (False, True):
        r = _post_big(h, h.plan["router_url"] + "/v1/completions", t, BIG_BODY_BYTES, chunked)
        if r is not None and r.status_code == 200:
            t.success(f"the router forwarded a 42 MB body ({'chunked' if chunked else 'with a length'})")


BAD_BODIES: tuple[bytes, ...] = (
    b"{", b"[" * 100_000, b'{"prompt": "\xff\xfe\xfd"}', b'"just a string"', b'{"prompt": {"a": 1}}',
    b'{"prompt": [1.5, "x", null]}', b'{"prompt": "' + b"\\" * 999_999 + b'"}', b"\x00" * 1024,
    b'{"messages": "not a list", "model": "fake"}',
)


def _bad_json(h: Hostile, base: str, what: str, t: Tally) -> None:
    """Every body of :data:`BAD_BODIES` to both completion routes of ``base``: a 5xx or no answer is a success."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in BAD_BODIES:
            t.act()
            try:
                r = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=10.0, verify=h.tls)
                t.saw(f"http_{r.status_code}")
                if r.status_code >= 500:
                    t.success(f"{path}: {body[:24]!r}... made the {what} answer {r.status_code}")
            except httpx.HTTPError as exc:
                t.saw(f"error_{type(exc).__name__}")
                t.success(f"{path}: {body[:24]!r}... got no answer from the {what} ({type(exc).__name__})")


def pd_bad_json(h: Hostile, t: Tally) -> None:
    _bad_json(h, h.plan["pd_url"], "PD proxy", t)


def router_bad_json(h: Hostile, t: Tally) -> None:
    _bad_json(h, h.plan["router_url"], "router", t)


def router_huge_answer(h: Hostile, t: Tally) -> None:
    t.act()
    try:
        with httpx.stream("POST", h.plan["router_url"] + "/v1/completions", timeout=30.0, verify=h.tls,
                          json={"model": "fake-huge", "prompt": [1, 2, 3], "max_tokens": 1}) as r:
            t.saw(f"http_{r.status_code}")
            got = 0
            for chunk in r.iter_raw(65536):
                got += len(chunk)
                if got >= 1 << 20:
                    break
            h.stop.wait(2.0)  # a slow reader: the router must not buffer the rest
    except httpx.HTTPError as exc:
        t.saw(f"error_{type(exc).__name__}")


def router_cut_stream(h: Hostile, t: Tally) -> None:
    t.act()
    lines: list[str] = []
    try:
        with httpx.stream("POST", h.plan["router_url"] + "/v1/completions", timeout=10.0, verify=h.tls,
                          json={"model": "fake-cut", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}) as r:
            for line in r.iter_lines():
                lines.append(line)
    except httpx.HTTPError as exc:
        t.saw(f"cut_seen_{type(exc).__name__}")
        return
    text = "\n".join(lines)
    if "[DONE]" in text or '"error"' not in text:
        t.success(f"a stream the backend cut looked finished to the client ({len(lines)} lines, "
                  f"{'[DONE]' if '[DONE]' in text else 'no error event'})")
    else:
        t.saw("error_event_seen")


def router_slowloris(h: Hostile, t: Tally) -> None:
    held: list[socket.socket] = []
    try:
        for _ in range(SLOW_CONNECTIONS):
            t.act()
            try:
                held.append(_raw(h.plan["router_url"], b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"))
            except OSError:
                t.saw("connect_failed")
        end = time.monotonic() + HOLD_S
        while time.monotonic() < end and not h.stop.is_set():
            for s in held:
                try:
                    s.send(b"X")
                except OSError:
                    t.saw("closed_by_server")
            h.stop.wait(0.5)
    finally:
        for s in held:
            s.close()


def argv_secrets(h: Hostile, t: Tally) -> None:
    for name, pid in h.plan.get("pids", {}).items():
        t.act()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                t.keep(f"/proc/{name}/cmdline", f.read().replace(b"\0", b" "))
        except OSError:
            t.saw("unreadable")


#: name -> (kind, attack, monitor events meaning it achieved its aim)
HTTP_ATTACKS: dict[str, tuple[int, Callable[[Hostile, Tally], None], tuple[str, ...]]] = {
    "dashboard_scrape": (4, dashboard_scrape, ()),
    "sse_flood": (4, sse_flood, ("operator_lockout",)),
    "foreign_host": (4, foreign_host, ()),
    "pd_client_params": (5, pd_client_params, ()),
    "pd_big_body": (5, pd_big_body, ()),
    "pd_bad_json": (5, pd_bad_json, ()),
    "router_huge_prompts": (6, router_huge_prompts, ("router_stall",)),
    "router_big_body": (6, router_big_body, ("router_stall", "rss_router")),
    "router_bad_json": (6, router_bad_json, ("router_stall",)),
    "router_huge_answer": (6, router_huge_answer, ("rss_router",)),
    "router_cut_stream": (6, router_cut_stream, ()),
    "router_slowloris": (6, router_slowloris, ("router_stall",)),
    "argv_secrets": (6, argv_secrets, ()),
}
