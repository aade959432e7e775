"""Who may read the dashboards (issue 24, kind 4): the controller's and the server's data behind
their token (bearer or the login cookie), prompt text only with the token, bounded event
streams that no set of streams can lock a viewer out with, a Host check on tokenless loopback
services (DNS rebinding), and passwords masked wherever a URL is shown.

Everything runs on loopback with free ports: a real controller with two embedded instances
(``kvtier.testing.fleet_cluster``) and an in-process ``kvtier server``.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from service_helpers import connect, short_dir, start_server  # noqa: F401 (fixture)
from test_dashboard_controller import AUTH, TOKEN, TokenCluster, prompt

from kvtier.dashboard.access import DashboardAccess, Denied, StreamSlots, host_name
from kvtier.testing.fleet_cluster import FleetCluster, wait_until
from kvtier.urls import mask_url


def request(base: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
            source: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request with exactly ``headers`` (``Host`` too, when given); ``source``: the
    client's address (another loopback address is another client)."""
    host, port = base.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10,
                                      source_address=(source, 0) if source else None)
    data = None if body is None else json.dumps(body).encode()
    h = dict(headers or {})
    if data is not None:
        h.setdefault("Content-Type", "application/json")
    conn.putrequest(method, path, skip_host="Host" in h, skip_accept_encoding=True)
    for k, v in h.items():
        conn.putheader(k, v)
    if data is not None:
        conn.putheader("Content-Length", str(len(data)))
    conn.endheaders(data)
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    conn.close()
    return out


def login(base: str, token: str = TOKEN) -> str:
    code, headers, body = request(base, "POST", "/dashboard/login", {"token": token})
    assert code == 204, body
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    return cookie.split(";", 1)[0]  # name=value, as a browser sends it back


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TokenCluster]:
    monkeypatch.setenv("KVTIER_CONTROLLER_TOKEN", TOKEN)
    monkeypatch.delenv("KVTIER_DASHBOARD_TOKENIZER", raising=False)
    c = TokenCluster("disk", tmp_path, n=2, cpu_chunks=64).start()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def open_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetCluster]:
    monkeypatch.delenv("KVTIER_CONTROLLER_TOKEN", raising=False)
    monkeypatch.delenv("KVTIER_DASHBOARD_TOKENIZER", raising=False)
    c = FleetCluster("disk", tmp_path, n=2, cpu_chunks=64).start()
    try:
        yield c
    finally:
        c.close()


# -- the controller: data behind the token -------------------------------------------------------


def test_controller_dashboard_data_needs_the_token(fleet: TokenCluster) -> None:
    a, _ = fleet.instances
    a.store(prompt(0))
    fleet.settle()
    base = fleet.controller.http_url
    assert request(base, "POST", "/lookup", {"tokens": prompt(0)}, AUTH)[0] == 200
    for path in ("/dashboard/snapshot", "/dashboard/events"):  # what /instances and /metrics refuse
        code, headers, _ = request(base, "GET", path)
        assert code == 401 and headers["www-authenticate"] == "Bearer", path
        assert request(base, "GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert request(base, "GET", "/")[0] == 200  # the bare page (no data) for anyone
    code, _, body = request(base, "GET", "/dashboard/snapshot", headers=AUTH)
    assert code == 200 and {i["instance"] for i in json.loads(body)["instances"]} == {x.name for x in fleet.instances}
    # A browser: sign in once, then the cookie (the token never stays in the page).
    assert request(base, "POST", "/dashboard/login", {"token": "wrong"})[0] == 401
    cookie = login(base)
    code, _, body = request(base, "GET", "/dashboard/snapshot", headers={"Cookie": cookie})
    assert code == 200 and json.loads(body)["kind"] == "controller"
    assert request(base, "GET", "/dashboard/snapshot", headers={"Cookie": cookie + "x"})[0] == 401
    assert request(base, "GET", "/instances", headers={"Cookie": cookie})[0] == 401  # the API wants the bearer
    # Operations by cookie need the CSRF header; by bearer they do not.
    code, _, body = request(base, "POST", "/dashboard/ops/clear", {"instance": a.name, "tier": "cpu"},
                            {"Cookie": cookie})
    assert code == 403 and b"x-kvtier-dashboard" in body and len(a.manager.cpu) > 0
    code, _, body = request(base, "POST", "/dashboard/ops/clear", {"instance": a.name, "tier": "cpu"},
                            {"Cookie": cookie, "X-Kvtier-Dashboard": "1"})
    assert code == 200
    event = json.loads(body)["event_id"]
    wait_until(lambda: json.loads(request(base, "GET", f"/dashboard/op/{event}",
                                          headers={"Cookie": cookie, "X-Kvtier-Dashboard": "1"})[2])["state"] == "done", 10)
    assert len(a.manager.cpu) == 0
    assert request(base, "GET", f"/dashboard/op/{event}")[0] == 401
    # Signing out ends the session.
    assert request(base, "POST", "/dashboard/logout", headers={"Cookie": cookie})[0] == 204
    assert request(base, "GET", "/dashboard/snapshot", headers={"Cookie": cookie})[0] == 401


@pytest.mark.slow
def test_prompt_text_only_for_a_viewer_holding_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """With a tokenizer configured, hot prefixes as text reach only viewers that presented the
    controller's token; a tokenless controller (anyone on the machine reads it) shows keys."""
    import kvtier.dashboard.source as source

    monkeypatch.setenv("KVTIER_DASHBOARD_TOKENIZER", "fake-tokenizer")
    monkeypatch.setattr(source, "tokenizer_from_env", lambda: (lambda ids: "Patient Jane Roe, SSN " + str(ids[0])))
    for token in (TOKEN, None):
        if token:
            monkeypatch.setenv("KVTIER_CONTROLLER_TOKEN", token)
            c: FleetCluster = TokenCluster("disk", tmp_path / "t", n=1, cpu_chunks=64)
        else:
            monkeypatch.delenv("KVTIER_CONTROLLER_TOKEN", raising=False)
            c = FleetCluster("disk", tmp_path / "o", n=1, cpu_chunks=64)
        with caplog.at_level("WARNING", logger="kvtier.dashboard.fastapi_routes"):
            c.start()
        try:
            c.instances[0].store(prompt(3))
            c.settle()
            base = c.controller.http_url
            auth = AUTH if token else {}
            assert request(base, "POST", "/lookup", {"tokens": prompt(3)}, auth)[0] == 200
            code, _, body = request(base, "GET", "/dashboard/snapshot", headers=auth)
            hot = json.loads(body)["hot"]
            assert code == 200 and len(hot) == 1
            if token:
                assert hot[0]["text"] is not None and "Jane Roe" in hot[0]["text"]
            else:
                assert hot[0]["text"] is None and b"Jane Roe" not in body
                assert any("no token" in m for m in caplog.messages)
            assert "tokens" not in hot[0]  # token ids never leave the controller
        finally:
            c.close()


# -- tokenless services: loopback Host names only (DNS rebinding) --------------------------------


def test_tokenless_controller_refuses_a_foreign_host_header(open_fleet: FleetCluster) -> None:
    a, _ = open_fleet.instances
    a.store(prompt(1))
    open_fleet.settle()
    base = open_fleet.controller.http_url
    port = open_fleet.controller.http_port
    held = len(a.manager.cpu)
    for evil in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "10.0.0.1"):
        code, _, body = request(base, "POST", "/clear", {"instance": a.name, "wait": True}, {"Host": evil})
        assert code == 403 and b"Host" in body, evil
        assert request(base, "GET", "/dashboard/snapshot", headers={"Host": evil})[0] == 403
        assert request(base, "GET", "/instances", headers={"Host": evil})[0] == 403
    assert len(a.manager.cpu) == held  # nothing was cleared
    for ok in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "127.0.0.2"):
        assert request(base, "GET", "/dashboard/snapshot", headers={"Host": ok})[0] == 200, ok
    code, _, _ = request(base, "POST", "/clear", {"instance": a.name, "wait": True}, {"Host": f"localhost:{port}"})
    assert code == 200 and len(a.manager.cpu) == 0
    # No token: nothing to sign in to.
    assert request(base, "POST", "/dashboard/login", {"token": "x"})[0] == 400


def test_token_controller_answers_any_host_to_a_token_holder(fleet: TokenCluster) -> None:
    base = fleet.controller.http_url
    assert request(base, "GET", "/dashboard/snapshot", headers={"Host": "ctl.example", **AUTH})[0] == 200
    assert request(base, "GET", "/dashboard/snapshot", headers={"Host": "ctl.example"})[0] == 401


@pytest.mark.slow
def test_server_dashboard_host_check_and_token(short_dir: Path) -> None:  # noqa: F811
    with start_server(short_dir, metrics_port=0) as srv:  # no token: loopback only
        base = f"http://127.0.0.1:{srv.metrics_port}"
        for path in ("/metrics", "/dashboard/snapshot", "/health"):
            assert request(base, "GET", path, headers={"Host": "evil.example"})[0] == 403, path
            assert request(base, "GET", path, headers={"Host": f"127.0.0.1:{srv.metrics_port}"})[0] == 200, path
        assert request(base, "GET", "/dashboard/snapshot")[0] == 200  # no Host (HTTP/1.0 tools)
    d2 = short_dir / "t"
    d2.mkdir()
    with start_server(d2, metrics_port=0, token="srv-secret") as srv:
        base = f"http://127.0.0.1:{srv.metrics_port}"
        assert request(base, "GET", "/metrics", headers={"Host": "evil.example"})[0] == 200  # scrapes stay open
        for path in ("/dashboard/snapshot", "/dashboard/events"):
            assert request(base, "GET", path)[0] == 401
        assert request(base, "GET", "/dashboard/snapshot", headers={"Authorization": "Bearer srv-secret"})[0] == 200
        assert request(base, "POST", "/dashboard/login", {"token": "nope"})[0] == 401
        code, headers, _ = request(base, "POST", "/dashboard/login", {"token": "srv-secret"})
        cookie = headers["set-cookie"].split(";", 1)[0]
        assert code == 204 and cookie.startswith(f"kvtier_dash_{srv.metrics_port}=")
        code, _, body = request(base, "GET", "/dashboard/snapshot", headers={"Cookie": cookie})
        assert code == 200 and json.loads(body)["kind"] == "server"
        assert request(base, "POST", "/dashboard/logout", headers={"Cookie": cookie})[0] == 204
        assert request(base, "GET", "/dashboard/snapshot", headers={"Cookie": cookie})[0] == 401


def test_tokenless_server_beyond_loopback_keeps_metrics_but_not_the_dashboard(short_dir: Path) -> None:  # noqa: F811
    with start_server(short_dir, metrics_port=0, metrics_host="0.0.0.0") as srv:
        base = f"http://127.0.0.1:{srv.metrics_port}"
        assert request(base, "GET", "/metrics", headers={"Host": "10.1.2.3:9477"})[0] == 200  # a remote scrape
        code, _, body = request(base, "GET", "/dashboard/snapshot")
        assert code == 403 and b"beyond loopback" in body


# -- event streams: bounded, and never a lock-out ------------------------------------------------


def _stream(base: str, headers: dict[str, str] | None = None, source: str | None = None) -> tuple[socket.socket, bytes]:
    host, port = base.rsplit("/", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0) if source else None)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    s.sendall(f"GET /dashboard/events HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        got = s.recv(4096)
        if not got:
            break
        head += got
    return s, head


def _reads_to_eof(s: socket.socket, within_s: float = 10.0) -> bool:
    """True when the stream ends within ``within_s`` (a live stream sends a frame every second)."""
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            if not s.recv(65536):
                return True
        return False
    except OSError:
        return False
    finally:
        s.close()


def test_unauthenticated_streams_cannot_lock_the_operator_out(fleet: TokenCluster) -> None:
    base = fleet.controller.http_url
    strangers = [_stream(base) for _ in range(8)]
    assert all(head.startswith(b"HTTP/1.1 401") for _, head in strangers)  # refused: no slot taken
    s, head = _stream(base, AUTH)
    assert head.startswith(b"HTTP/1.1 200")
    s.close()
    for x, _ in strangers:
        x.close()


@pytest.mark.slow  # over 5 s on 2 cores: out of the fast loop
@pytest.mark.parametrize("kind", ["controller", "server"])
def test_streams_are_bounded_and_a_new_viewer_always_gets_one(kind: str, open_fleet: FleetCluster,
                                                              short_dir: Path) -> None:  # noqa: F811
    srv = None
    if kind == "controller":
        base = open_fleet.controller.http_url
    else:
        srv = start_server(short_dir, metrics_port=0)
        base = f"http://127.0.0.1:{srv.metrics_port}"
    try:
        mine = [_stream(base) for _ in range(4)]  # one client's bound (all from 127.0.0.1)
        assert all(h.split(b"\r\n", 1)[0].endswith(b"200 OK") for _, h in mine)
        s5, h5 = _stream(base)  # a fifth from the same client: served; its oldest stream ends
        assert h5.split(b"\r\n", 1)[0].endswith(b"200 OK")
        assert _reads_to_eof(mine[0][0])
        others = [_stream(base, source=f"127.0.0.{i}") for i in (2, 3, 4, 5)]  # other clients: 8 in all
        assert all(h.split(b"\r\n", 1)[0].endswith(b"200 OK") for _, h in others)
        s9, h9 = _stream(base, source="127.0.0.9")  # beyond the total: the oldest overall closes
        assert h9.split(b"\r\n", 1)[0].endswith(b"200 OK")
        assert _reads_to_eof(mine[1][0])
        for s, _ in mine[2:] + others + [(s5, b""), (s9, b"")]:
            s.close()
    finally:
        if srv is not None:
            srv.close()


def test_stream_slots_unit() -> None:
    slots = StreamSlots(max_streams=3, per_client=2)
    a1, a2 = slots.open("a"), slots.open("a")
    a3 = slots.open("a")
    assert a1.is_set() and not a2.is_set() and not a3.is_set() and slots.count() == 2
    b1 = slots.open("b")
    c1 = slots.open("c")  # total 4 > 3: the oldest overall (a2) ends
    assert a2.is_set() and not b1.is_set() and not c1.is_set() and slots.count() == 3
    slots.close(a3)
    assert slots.count() == 2 and slots.evicted == 2
    with pytest.raises(ValueError):
        StreamSlots(0, 1)


def test_access_unit() -> None:
    now = [0.0]
    acc = DashboardAccess(lambda: "tok", "127.0.0.1", lambda: 7601, max_sessions=2, clock=lambda: now[0])
    with pytest.raises(Denied) as e:
        acc.check_read(None, None, None)
    assert e.value.status == 401
    acc.check_read("anything", "Bearer tok", None)
    sids = [acc.login("tok") for _ in range(3)]  # at most 2 sessions: the oldest is dropped
    assert len(set(sids)) == 3 and all(len(s) >= 43 for s in sids)
    with pytest.raises(Denied):
        acc.check_read(None, None, f"kvtier_dash_7601={sids[0]}")
    acc.check_read(None, None, f"other=1; kvtier_dash_7601={sids[2]}")
    with pytest.raises(Denied):
        acc.check_read(None, None, f"kvtier_dash_9999={sids[2]}")  # another port's cookie
    now[0] += 13 * 3600  # expired
    with pytest.raises(Denied):
        acc.check_read(None, None, f"kvtier_dash_7601={sids[2]}")
    with pytest.raises(Denied):
        acc.login("tok2")
    assert host_name("[::1]:80") == "::1" and host_name("h:80") == "h" and host_name("h") == "h"
    open_acc = DashboardAccess(lambda: None, "127.0.0.1", lambda: 1)
    assert open_acc.host_ok("localhost:1") and not open_acc.host_ok("evil:1") and open_acc.host_ok(None)
    wide = DashboardAccess(lambda: None, "0.0.0.0", lambda: 1)
    assert wide.host_ok("10.0.0.1:1")
    with pytest.raises(Denied) as e:
        wide.check_read("10.0.0.1:1", None, None)
    assert e.value.status == 403


# -- passwords masked wherever a URL is shown ------------------------------------------------------


def test_mask_url_covers_query_passwords() -> None:
    from kvtier.config import mask_url as config_mask
    from kvtier.tiers.redis_url import masked

    cases = {
        "redis://h:6379/0?password=s3cret": "redis://h:6379/0?password=***",
        "redis://h:6379/0?db=1&PassWord=s3cret&x=1": "redis://h:6379/0?db=1&PassWord=***&x=1",
        "redis://h:6379/0?pass%77ord=s3cret": "redis://h:6379/0?pass%77ord=***",  # redis-py decodes the name
        "redis://u:s3cret@h:6379/0": "redis://u:***@h:6379/0",
        "rediss://:s3cret@h/0?ssl_cert_reqs=none": "rediss://:***@h/0?ssl_cert_reqs=none",
        "unix:///run/redis.sock?password=s3cret&db=2": "unix:///run/redis.sock?password=***&db=2",
        "s3://bucket/p?token=abc#frag": "s3://bucket/p?token=***#frag",
        "redis://h:6379/0?key_prefix=kv": "redis://h:6379/0?key_prefix=kv",
        "not a url": "not a url",
        # a password holding "/" or "#" (base64 holds "/"): the userinfo ends at the last "@" before "?"
        "redis://u:pa/ss+Q==@h:6379/0": "redis://u:***@h:6379/0",
        "redis://:ab#cd@h:6379": "redis://:***@h:6379",
        "fs:///data/x@y/z": "fs:///data/x@y/z",
        "redis://h/0?x=a@b:c": "redis://h/0?x=a@b:c",
        # a query value that is itself a URL with a password (a Mooncake metadata server)
        "mooncake://m:50051?metadata=http://u:s3cret@meta:8080": "mooncake://m:50051?metadata=http://u:***@meta:8080",
        "mooncake://m:1?metadata=http%3A%2F%2Fu%3As3cret%40meta": "mooncake://m:1?metadata=http://u:***@meta",
        "mooncake://m:1?metadata=P2PHANDSHAKE": "mooncake://m:1?metadata=P2PHANDSHAKE",
    }
    for url, want in cases.items():
        assert mask_url(url) == config_mask(url) == masked(url) == want, url


def test_instances_show_tier_urls_masked(open_fleet: FleetCluster) -> None:
    from kvtier.fleet.agent import FleetAgent, namespace_info
    from kvtier.protocol.fleet import TierInfo

    inst = open_fleet.instances[0]
    tiers = [TierInfo("cpu", "cpu", 1 << 20, False),
             TierInfo("remote", "redis://h:6379/0?password=s3cret#kvtier", 0, True)]  # as an old agent sends it
    agent = FleetAgent(open_fleet.controller.zmq_url, "leaky", "embedded",
                       {open_fleet.ns.digest(): (namespace_info(open_fleet.ns), inst.ops)}, tiers,
                       peer_url="tcp://u:pw@127.0.0.1:1")
    agent.start()
    try:
        base = open_fleet.controller.http_url
        wait_until(lambda: any(i["instance"] == "leaky" for i in
                               json.loads(request(base, "GET", "/instances")[2])["instances"]), 10)
        code, _, body = request(base, "GET", "/instances")
        _, _, snap = request(base, "GET", "/dashboard/snapshot")
        assert code == 200 and b"s3cret" not in body and b"s3cret" not in snap and b":pw@" not in body
        leaky = next(i for i in json.loads(body)["instances"] if i["instance"] == "leaky")
        assert leaky["tiers"][1]["name"] == "redis://h:6379/0?password=***#kvtier"
    finally:
        agent.close()

