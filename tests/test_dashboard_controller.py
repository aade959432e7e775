"""The controller's dashboard routes (issue 13), without a browser.

Failing inputs: the page behind the token (it must load without; its data must not, see
``test_dashboard_access``); operations without the token; an operation on a chain the controller does not hold;
lookups not feeding the hot prefixes and per-instance hit counters of ``/metrics``; a
stopped controller waiting on an open event stream.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.dashboard.samples import parse_exposition
from kvtier.fleet.agent import FleetAgent, namespace_info, tier_infos
from kvtier.testing.fleet_cluster import FleetCluster, FleetInstance, wait_until

TOKEN = "dash-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class TokenCluster(FleetCluster):
    """A fleet whose controller requires :data:`TOKEN` (agents present it)."""

    def start_agent(self, inst: FleetInstance) -> FleetAgent:
        agent = FleetAgent(self.controller.zmq_url, inst.name, "embedded",
                           {self.ns.digest(): (namespace_info(self.ns), inst.ops)}, tier_infos(inst.manager),
                           token=TOKEN)
        inst.agent = agent.start()
        return agent


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TokenCluster]:
    monkeypatch.setenv("KVTIER_CONTROLLER_TOKEN", TOKEN)
    monkeypatch.delenv("KVTIER_DASHBOARD_TOKENIZER", raising=False)
    c = TokenCluster("disk", tmp_path, n=2, cpu_chunks=64).start()
    try:
        yield c
    finally:
        c.close()


def call(url: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, h), timeout=10) as r:
            raw = r.read()
            return r.status, json.loads(raw) if r.headers.get_content_type() == "application/json" else raw
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def prompt(i: int, n: int = 128) -> list[int]:
    return [100 * (i + 1) + j for j in range(n)]


def test_data_and_operations_with_the_token(fleet: TokenCluster) -> None:
    a, b = fleet.instances
    a.store(prompt(0))
    b.store(prompt(1))
    fleet.settle()
    base = fleet.controller.http_url
    for _ in range(3):
        assert call(base + "/lookup", {"tokens": prompt(0) + [1] * 32}, AUTH)[0] == 200
    assert call(base + "/lookup", {"tokens": prompt(1)}, AUTH)[0] == 200

    code, page = call(base + "/")
    assert code == 200 and b"kvtier" in page  # the page loads for anyone; its data needs the token
    assert call(base + "/dashboard/snapshot")[0] == 401
    code, snap = call(base + "/dashboard/snapshot", headers=AUTH)
    assert code == 200 and snap["kind"] == "controller" and snap["ops"]["token_required"] is True
    assert {i["instance"] for i in snap["instances"]} == {a.name, b.name}
    hot = {h["head"]: h for h in snap["hot"]}
    assert len(hot) == 2 and sorted(h["count"] for h in hot.values()) == [1, 3]
    top = snap["hot"][0]
    assert top["count"] == 3 and top["instance"] == a.name and top["hit_tokens"] == 128
    assert "tokens" not in top  # token ids never leave the controller
    metrics = parse_exposition(call(base + "/metrics", headers=AUTH)[1].decode())
    for series, value in snap["metrics"].items():
        if not series.startswith("kvtier_controller_lookup_seconds"):
            assert metrics[series] == value, series
    assert metrics['kvtier_controller_instance_asked_tokens_total{instance="inst-0"}'] == 3 * 160 + 128
    assert metrics['kvtier_controller_instance_found_tokens_total{instance="inst-0"}'] == 3 * 128
    assert metrics["kvtier_controller_lookup_asked_tokens_total"] == 3 * 160 + 128

    assert call(base + "/dashboard/ops/clear", {"instance": a.name, "tier": "cpu"})[0] == 401
    assert len(a.manager.cpu) == 8
    assert call(base + "/dashboard/ops/pin", {"head": "0" * 32}, AUTH)[0] == 404  # not a hot chain
    assert call(base + "/dashboard/ops/compress", {"head": top["head"], "codec": "nope"}, AUTH)[0] == 422

    code, rec = call(base + "/dashboard/ops/pin", {"head": top["head"]}, AUTH)
    assert code == 200, rec
    wait_until(lambda: call(base + f"/check_finish/{rec['event_id']}", headers=AUTH)[1]["state"] == "done", 10)
    assert a.manager.stats()["pinned_chunks"] == 8  # the real pins, on the instance that holds the chain
    fleet.settle()
    snap = call(base + "/dashboard/snapshot", headers=AUTH)[1]
    assert next(h for h in snap["hot"] if h["head"] == top["head"])["pinned_tokens"] == 128

    code, rec = call(base + "/dashboard/ops/clear", {"instance": b.name, "tier": "cpu"}, AUTH)
    assert code == 200
    wait_until(lambda: call(base + f"/check_finish/{rec['event_id']}", headers=AUTH)[1]["state"] == "done", 10)
    assert len(b.manager.cpu) == 0 and len(a.manager.cpu) == 8


def test_stop_ends_open_event_streams(fleet: TokenCluster) -> None:
    base = fleet.controller.http_url
    got: list[bytes] = []

    def read() -> None:
        with urllib.request.urlopen(urllib.request.Request(base + "/dashboard/events", headers=AUTH), timeout=30) as r:
            while chunk := r.read1(65536):
                got.append(chunk)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    wait_until(lambda: b"event: snapshot" in b"".join(got), 10)
    fleet.controller.stop()
    t.join(15)
    assert not t.is_alive()  # the stream ended with the controller (it did not wait for the client)
