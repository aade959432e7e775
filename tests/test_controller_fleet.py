"""The controller with 3 fake agents over real ZMQ and HTTP (ephemeral ports).

Every assertion on an operation checks the fake agent's real state (its tier dicts),
not only the controller's reply.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from conftest import wait_until
from fleet_fakes import CHUNK, FakeAgent, SharedStore
from kvtier.controller.server import Controller, ControllerConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "controller"
PROMPT = list(range(100, 100 + 8 * CHUNK))  # 8 chunks
DEADLINE_S = 2.0


def post(ctl: Controller, path: str, body: dict[str, Any], token: str = "") -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(ctl.http_url + path, json=body, headers=headers, timeout=30)


def lookup(ctl: Controller, tokens: list[int] = PROMPT, **kw: Any) -> dict[str, Any]:
    r = post(ctl, "/lookup", {"tokens": tokens, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def truth_rows(agents: list[FakeAgent], tokens: list[int] = PROMPT) -> dict[str, dict[str, int]]:
    out = {}
    for a in agents:
        t = a.truth(tokens)
        out[a.instance] = {"longest_matched": t["longest_matched"], "CPU": t.get("CPU", 0),
                           "DISK": t.get("DISK", 0), "REMOTE": t.get("REMOTE", 0)}
    return out


def view_rows(out: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {i: {k: r[k] for k in ("longest_matched", "CPU", "DISK", "REMOTE")} for i, r in out["instances"].items()}


@pytest.fixture
def fleet():
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0", op_deadline_s=DEADLINE_S).start()
    shared = SharedStore()
    agents = [FakeAgent(f"inst-{x}", ctl.zmq_url, shared=shared, seed=i).start() for i, x in enumerate("abc")]
    wait_until(lambda: len(ctl.ops.instances()) == 3)
    yield ctl, agents, shared
    for a in agents:
        a.kill()
    ctl.stop()


def populate(agents: list[FakeAgent]) -> None:
    a, b, c = agents
    a.store(PROMPT, "cpu")
    a.store(PROMPT[: 4 * CHUNK], "disk")
    b.store(PROMPT[: 6 * CHUNK], "disk")
    c.store(PROMPT[: 3 * CHUNK], "remote")


def test_lookup_both_shapes_match_fixtures_and_agent_state(fleet):
    ctl, agents, _ = fleet
    populate(agents)
    want_layout = json.loads((FIXTURES / "lookup_layout_info.json").read_text())
    want_inst = json.loads((FIXTURES / "lookup_instances.json").read_text())
    wait_until(lambda: lookup(ctl)["instances"] == want_inst)
    out = lookup(ctl)
    assert out["layout_info"] == want_layout
    assert view_rows(out) == truth_rows(agents)
    # One instance only; keys instead of tokens give the same answer.
    keys = [k.hex() for k in agents[1].keys(PROMPT)]
    r = post(ctl, "/lookup", {"keys": keys, "instance": "inst-b"}).json()
    assert r["instances"] == {"inst-b": want_inst["inst-b"]}
    # Another salt is another key chain: nothing cached.
    assert lookup(ctl, cache_salt="tenant")["layout_info"] == {}


def metric(ctl: Controller, name: str, **labels: str) -> float:
    text = httpx.get(ctl.http_url + "/metrics").text
    lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}\{{{lab}\}} (\S+)$" if labels else rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} {labels} not in /metrics"
    return float(m.group(1))


def test_clear_reaches_agent_tiers_and_metrics(fleet):
    ctl, agents, shared = fleet
    a, b, c = agents
    populate(agents)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    assert metric(ctl, "kvtier_controller_tier_chunks", instance="inst-a", tier="cpu") == 8
    r = post(ctl, "/clear", {"instance": "inst-a", "tier": "cpu", "wait": True}).json()
    assert r["state"] == "done", r
    assert r["result"]["tokens"] == 8 * CHUNK
    assert a.local["cpu"] == {} and len(a.local["disk"]) == 4  # only that scope
    wait_until(lambda: metric(ctl, "kvtier_controller_tier_chunks", instance="inst-a", tier="cpu") == 0)
    assert metric(ctl, "kvtier_controller_tier_bytes", instance="inst-a", tier="cpu") == 0
    r = post(ctl, "/clear", {"wait": True}).json()
    assert r["state"] == "done", r
    assert all(not ag.local[t] for ag in agents for t in ag.local) and shared.entries == {}
    wait_until(lambda: all(v == 0 for row in view_rows(lookup(ctl)).values() for v in row.values()))


def test_clear_by_salt_removes_exactly_that_tenants_chains(fleet):
    ctl, agents, _ = fleet
    a = agents[0]
    other = list(range(5000, 5000 + 3 * CHUNK))
    mine = a.store(PROMPT[: 4 * CHUNK], "cpu", salt="tenant")
    theirs = a.store(PROMPT[: 4 * CHUNK], "cpu", salt="other")  # same tokens, another tenant
    plain = a.store(other, "cpu")  # no salt
    legacy = a.store(list(range(9000, 9000 + 2 * CHUNK)), "cpu", salt="tenant", lineage=False)
    wait_until(lambda: lookup(ctl, tokens=PROMPT[: 4 * CHUNK], cache_salt="tenant")["instances"]
               .get("inst-a", {}).get("CPU") == 4 * CHUNK)
    r = post(ctl, "/clear", {"cache_salt": "tenant", "instance": "inst-a", "wait": True}).json()
    assert r["state"] == "done", r
    assert r["result"]["tokens"] == 4 * CHUNK and r["result"]["unattributed_chunks"] == 2
    cpu = a.local["cpu"]
    assert not any(k in cpu for k in mine)  # the tenant's chain is gone from the tier itself
    assert all(k in cpu for k in theirs + plain + legacy)  # other tenants, no salt, no lineage: kept


def test_pin_and_unpin_reach_agent_and_show_in_lookup(fleet):
    ctl, agents, _ = fleet
    a = agents[0]
    populate(agents)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    r = post(ctl, "/pin", {"tokens": PROMPT, "instance": "inst-a", "ttl_s": 60, "wait": True}).json()
    assert r["state"] == "done" and r["result"]["tokens"] == 8 * CHUNK, r
    assert a.pinned == set(a.keys(PROMPT))
    assert lookup(ctl)["instances"]["inst-a"]["pinned"] == 8 * CHUNK
    pin_req = [o for o in a.ops_seen if o.op == "pin"][-1]
    assert pin_req.args["ttl_s"] == 60.0 and len(pin_req.args["keys"]) == 8 * 32
    assert pin_req.args["pin_id"] == r["event_id"] == r["result"]["pin_id"]
    # Unpin by tokens releases every pin covering them.
    r = post(ctl, "/unpin", {"tokens": PROMPT[: 2 * CHUNK], "instance": "inst-a", "wait": True}).json()
    assert r["state"] == "done" and r["result"]["pins"] == [pin_req.args["pin_id"]], r
    assert a.pinned == set() and a.pins == {}
    assert lookup(ctl)["instances"]["inst-a"]["pinned"] == 0
    # Unpin by pin id; a pin on a prefix b holds only in part covers what it holds.
    r = post(ctl, "/pin", {"tokens": PROMPT, "instance": "inst-b", "wait": True}).json()
    assert r["result"]["tokens"] == 6 * CHUNK and agents[1].pinned == set(agents[1].keys(PROMPT)[:6])
    r = post(ctl, "/unpin", {"pin_id": r["result"]["pin_id"], "wait": True}).json()
    assert r["state"] == "done" and agents[1].pinned == set(), r


def test_move_local_and_across_instances_through_the_shared_tier(fleet):
    ctl, agents, shared = fleet
    a, b, _ = agents
    populate(agents)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    ka = a.keys(PROMPT)
    r = post(ctl, "/move", {"tokens": PROMPT, "from_instance": "inst-a", "from_tier": "cpu", "to_tier": "disk",
                            "wait": True}).json()
    assert r["state"] == "done", r
    assert a.local["cpu"] == {} and set(a.local["disk"]) == set(ka)
    # b's 6 disk chunks to a's cpu, through the shared remote tier, not a copy.
    r = post(ctl, "/move", {"tokens": PROMPT, "from_instance": "inst-b", "from_tier": "disk", "to_instance": "inst-a",
                            "to_tier": "cpu", "wait": True}).json()
    assert r["state"] == "done", r
    assert [s["op"] for s in r["result"]["steps"]] == ["export", "import", "verify", "delete"]
    assert set(a.local["cpu"]) == set(ka[:6]) and b.local["disk"] == {}
    assert set(ka[:6]) <= set(shared.entries)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    # Moving to a tier the instance lacks, or between instances with no shared tier, is refused up front.
    r = post(ctl, "/move", {"tokens": PROMPT, "from_instance": "inst-a", "to_tier": "peer"})
    assert r.status_code == 400 and "peer" in r.json()["detail"]


def test_compress_and_decompress_reach_agent(fleet):
    ctl, agents, _ = fleet
    a = agents[0]
    populate(agents)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    r = post(ctl, "/compress", {"tokens": PROMPT, "codec": "shuffle-zstd", "instance": "inst-a", "tier": "disk",
                                "wait": True}).json()
    assert r["state"] == "done" and r["result"]["tokens"] == 4 * CHUNK, r
    assert a.codecs == {k: "shuffle-zstd" for k in a.keys(PROMPT)[:4]}
    # No tier: every lower tier holding the prefix (disk: 4 chunks, the shared remote: 3).
    r = post(ctl, "/decompress", {"tokens": PROMPT, "instance": "inst-a", "wait": True}).json()
    assert r["state"] == "done" and set(r["result"]["instances"]["inst-a"]) == {"disk", "remote"}, r
    assert a.codecs == {k: "raw" for k in a.keys(PROMPT)[:4]}
    r = post(ctl, "/compress", {"tokens": PROMPT, "codec": "int8", "tier": "cpu"})
    assert r.status_code == 400 and r.json()["field"] == "tier"


@pytest.mark.slow
def test_killed_agent_disappears_from_lookup_within_a_second(fleet):
    ctl, agents, _ = fleet
    populate(agents)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    agents[1].kill()
    t0 = time.monotonic()
    wait_until(lambda: "inst-b" not in lookup(ctl)["instances"], timeout_s=3.0)
    # Expiry is 0.9 s of silence; allow scheduling noise on a loaded machine.
    assert time.monotonic() - t0 < 1.5
    assert "inst-b" not in lookup(ctl)["layout_info"]


def test_restarted_controller_is_consistent_within_a_second(fleet):
    ctl, agents, shared = fleet
    populate(agents)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    http_port, zmq_url = ctl.http_port, ctl.zmq_url
    ctl.stop()
    agents[0].store(PROMPT[: 2 * CHUNK], "disk")  # a change while the controller is down
    ctl2 = Controller(http_port=http_port, zmq_endpoint=zmq_url, op_deadline_s=DEADLINE_S)
    try:
        ctl2.start()
        t0 = time.monotonic()
        wait_until(lambda: view_rows(lookup(ctl2)) == truth_rows(agents), timeout_s=3.0)
        assert time.monotonic() - t0 < 1.5
        assert len(lookup(ctl2)["instances"]) == 3
    finally:
        ctl2.stop()


@pytest.mark.slow
def test_dropped_changes_leave_no_stale_answer_after_a_second():
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0", op_deadline_s=DEADLINE_S).start()
    shared = SharedStore()
    agents = [FakeAgent(f"inst-{x}", ctl.zmq_url, shared=shared, drop_changes=0.1, seed=i).start()
              for i, x in enumerate("abc")]
    try:
        wait_until(lambda: len(ctl.ops.instances()) == 3)
        rng = random.Random(7)
        prompts = [[rng.randrange(50000) for _ in range(rng.randrange(1, 9) * CHUNK)] for _ in range(12)]
        for _ in range(300):
            ag = rng.choice(agents)
            p = rng.choice(prompts)
            tier = rng.choice(["cpu", "disk", "remote"])
            if rng.random() < 0.7:
                ag.store(p[: rng.randrange(1, len(p) // CHUNK + 1) * CHUNK], tier)
            else:
                ks = ag.keys(p)
                ag.remove(ks[rng.randrange(len(ks)):], tier)
            time.sleep(0.001)
        assert sum(a.dropped for a in agents) > 0

        def stale() -> list[list[int]]:
            return [p[:3] for p in prompts if view_rows(lookup(ctl, p)) != truth_rows(agents, p)]

        try:
            wait_until(lambda: not stale(), 10.0, "the view repaired")
        except AssertionError:
            assert stale() == []
    finally:
        for a in agents:
            a.kill()
        ctl.stop()


def test_bad_input_is_4xx_naming_the_field(fleet):
    ctl, _, _ = fleet
    r = post(ctl, "/lookup", {"tokens": [1, 2, 3], "instance": "nope"})
    assert r.status_code == 404 and "'nope'" in r.json()["detail"]
    r = post(ctl, "/pin", {"tokens": [1, -2], "instance": "inst-a"})
    assert r.status_code == 422 and "tokens.1" in r.json()["detail"]
    r = post(ctl, "/pin", {"tokens": [1, 2**32]})
    assert r.status_code == 422 and "tokens.1" in r.json()["detail"]
    r = post(ctl, "/pin", {"tokens": [1, 2.5]})
    assert r.status_code == 422 and "tokens.1" in r.json()["detail"]
    r = post(ctl, "/lookup", {"keys": ["zz"]})
    assert r.status_code == 422 and "keys.0" in r.json()["detail"]
    r = post(ctl, "/clear", {"tier": "floppy"})
    assert r.status_code == 422 and "tier" in r.json()["detail"]
    r = post(ctl, "/compress", {"tokens": [1], "codec": "gzip"})
    assert r.status_code == 422 and "codec" in r.json()["detail"]
    r = post(ctl, "/lookup", {})
    assert r.status_code == 422 and "tokens" in r.json()["detail"]
    r = post(ctl, "/move", {"tokens": [1], "from_instance": "ghost", "to_tier": "cpu"})
    assert r.status_code == 404 and "'ghost'" in r.json()["detail"]
    assert httpx.get(ctl.http_url + "/check_finish/unknown").status_code == 404


@pytest.mark.slow
def test_op_to_silent_agent_fails_with_reason_within_deadline(fleet):
    ctl, agents, _ = fleet
    populate(agents)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    agents[0].silent = True
    t0 = time.monotonic()
    r = post(ctl, "/pin", {"tokens": PROMPT, "instance": "inst-a", "wait": True}).json()
    elapsed = time.monotonic() - t0
    assert r["state"] == "failed" and "timeout" in r["reason"] and "inst-a" in r["reason"], r
    assert elapsed < DEADLINE_S + 1.5


@pytest.mark.slow
def test_op_on_instance_that_dies_fails_fast_with_reason(fleet):
    ctl, agents, _ = fleet
    populate(agents)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    agents[2].silent = True
    rec = post(ctl, "/clear", {"instance": "inst-c"}).json()
    agents[2].kill()
    out = ctl.ops.tracker.wait(rec["event_id"], DEADLINE_S + 2)
    assert out["state"] == "failed" and "inst-c" in out["reason"], out


@pytest.mark.slow
def test_check_finish_is_terminal_for_every_op(fleet):
    ctl, agents, _ = fleet
    populate(agents)
    wait_until(lambda: view_rows(lookup(ctl)) == truth_rows(agents))
    agents[1].silent = True  # some ops will fail: they must still end
    bodies = [("/pin", {"tokens": PROMPT}), ("/unpin", {"tokens": PROMPT}),
              ("/compress", {"tokens": PROMPT, "codec": "int8"}), ("/decompress", {"tokens": PROMPT}),
              ("/move", {"tokens": PROMPT, "from_instance": "inst-a", "to_tier": "disk", "copy": True}),
              ("/clear", {"instance": "inst-c", "tier": "disk"}), ("/clear", {})]
    ids = []
    for path, body in bodies:
        r = post(ctl, path, body)
        assert r.status_code == 200, r.text
        ids.append(r.json()["event_id"])
    deadline = time.monotonic() + DEADLINE_S + 3
    states: dict[str, str] = {}
    while time.monotonic() < deadline and len(states) < len(ids):
        for eid in ids:
            out = httpx.get(f"{ctl.http_url}/check_finish/{eid}").json()
            if out["state"] in ("done", "failed"):
                states[eid] = out["state"]
                if out["state"] == "failed":
                    assert out["reason"]
        time.sleep(0.05)
    assert len(states) == len(ids)
    assert "failed" in states.values() and "done" in states.values()


def test_auth_token_for_http_and_agents():
    with pytest.raises(ControllerConfigError, match="token"):
        Controller(http_host="0.0.0.0", http_port=0, zmq_endpoint="tcp://127.0.0.1:0", token="")
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0", token="s3cret").start()
    good = FakeAgent("inst-good", ctl.zmq_url, token="s3cret").start()
    bad = FakeAgent("inst-bad", ctl.zmq_url, token="nope").start()
    try:
        assert post(ctl, "/lookup", {"tokens": PROMPT}).status_code == 401
        assert post(ctl, "/lookup", {"tokens": PROMPT}, token="wrong").status_code == 401
        wait_until(lambda: "inst-good" in post(ctl, "/lookup", {"tokens": PROMPT}, token="s3cret").json()["instances"])
        wait_until(lambda: ctl.state.counters["refused_registrations"] >= 1)
        out = post(ctl, "/lookup", {"tokens": PROMPT}, token="s3cret").json()
        assert "inst-bad" not in out["instances"]
    finally:
        good.kill()
        bad.kill()
        ctl.stop()


def test_malformed_frames_are_dropped_and_counted(fleet):
    import zmq

    ctl, agents, _ = fleet
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, b"junk")
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ctl.zmq_url)
    for frame in (b"not msgpack \xff", b"\x81\xa4type\xa3bad", b""):
        s.send(frame)
    s.send_multipart([b"x", b"y", b"z"])
    wait_until(lambda: ctl.state.counters["malformed_frames"] >= 4)
    s.close(0)
    ctx.term()
    assert len(lookup(ctl)["instances"]) == 3  # the endpoint kept serving
