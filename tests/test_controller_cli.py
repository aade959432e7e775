"""``kvtier ctl`` and ``kvtier controller`` against a live controller and a fake agent."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from fleet_fakes import CHUNK, FakeAgent
from kvtier.cli import app
from kvtier.controller.server import Controller

PROMPT = list(range(4 * CHUNK))
TOKENS = ",".join(map(str, PROMPT))


@pytest.fixture
def live():
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0", op_deadline_s=2.0, token="tkn").start()
    agent = FakeAgent("inst-a", ctl.zmq_url, token="tkn").start()
    agent.store(PROMPT, "cpu")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        out = ctl.ops.lookup(tokens=PROMPT)
        if out["instances"].get("inst-a", {}).get("CPU") == len(PROMPT):
            break
        time.sleep(0.01)
    yield ctl, agent
    agent.kill()
    ctl.stop()


def ctl_cmd(ctl: Controller, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["ctl", *args, "--url", ctl.http_url, "--token", "tkn"])
    return r.exit_code, r.output


def test_ctl_lookup_json_and_table(live, tmp_path):
    ctl, _ = live
    code, out = ctl_cmd(ctl, "lookup", "--tokens", TOKENS, "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["layout_info"] == {"inst-a": ["CPU", len(PROMPT)]}
    f = tmp_path / "toks.json"
    f.write_text(json.dumps(PROMPT))
    code, out = ctl_cmd(ctl, "lookup", "--tokens-file", str(f))
    assert code == 0 and "inst-a" in out and str(len(PROMPT)) in out
    code, out = ctl_cmd(ctl, "instances")
    assert code == 0 and "inst-a" in out


def test_ctl_ops_reach_agent_and_check_finish(live):
    ctl, agent = live
    code, out = ctl_cmd(ctl, "pin", "--tokens", TOKENS, "--json")
    assert code == 0, out
    assert agent.pinned == set(agent.keys(PROMPT))
    code, out = ctl_cmd(ctl, "clear", "--instance", "inst-a", "--tier", "cpu", "--json")
    assert code == 0, out
    event_id = json.loads(out)["event_id"]
    assert agent.local["cpu"] == {}
    code, out = ctl_cmd(ctl, "check-finish", event_id, "--json")
    assert code == 0 and json.loads(out)["state"] == "done"
    code, out = ctl_cmd(ctl, "health", "--json")
    assert code == 0 and "inst-a" in json.loads(out)["instances"]


def test_ctl_errors_exit_2_with_a_message(live):
    ctl, _ = live
    code, out = ctl_cmd(ctl, "lookup", "--tokens", "1,x")
    assert code == 2 and "not an integer" in out
    code, out = ctl_cmd(ctl, "clear", "--instance", "ghost")
    assert code == 2 and "ghost" in out
    r = CliRunner().invoke(app, ["ctl", "instances", "--url", ctl.http_url, "--token", "bad"])
    assert r.exit_code == 2 and "401" in r.output and "KVTIER_CONTROLLER_TOKEN" in r.output
    r = CliRunner().invoke(app, ["ctl", "instances", "--url", "http://127.0.0.1:9"])
    assert r.exit_code == 2 and "not reachable" in r.output
    r = CliRunner().invoke(app, ["ctl", "instances", "--url", "http://op:s3cr3t@127.0.0.1:9"])
    assert r.exit_code == 2 and "not reachable" in r.output and "s3cr3t" not in r.output


@pytest.mark.slow
def test_ctl_failed_op_exits_1(live):
    ctl, agent = live
    agent.silent = True
    code, out = ctl_cmd(ctl, "pin", "--tokens", TOKENS, "--json")
    assert code == 1 and "timeout" in json.loads(out)["reason"]


def test_controller_refuses_public_address_without_token(monkeypatch):
    monkeypatch.delenv("KVTIER_CONTROLLER_TOKEN", raising=False)
    r = CliRunner().invoke(app, ["controller", "--host", "0.0.0.0", "--port", "0", "--zmq", "tcp://127.0.0.1:0"])
    assert r.exit_code == 2 and "token" in r.output


def test_instances_table_folds_long_values_at_80_columns_instead_of_cutting_them() -> None:
    from rich.console import Console

    from kvtier.controller.ctl import _instances_table

    out = {"instances": [{"instance": "myhost:12345", "role": "server", "host": "myhost", "pid": 12345,
                          "peer_url": "tcp://127.0.0.1:42121",
                          "tiers": [{"kind": "disk", "chunks": 12, "shared": False}],
                          "namespaces": [{"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "chunk_size": 256, "rank": 0,
                                          "world_size": 1}], "last_seen_age_s": 0.2}]}
    with open("/dev/null", "w") as sink:
        con = Console(width=80, record=True, file=sink)
        con.print(_instances_table(out))
    text = con.export_text()
    assert "…" not in text
    body = [line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│")]  # one row, folded
    columns = ["".join(r[i].strip() for r in body) for i in range(len(body[0]))]
    for value in ("myhost:12345", "tcp://127.0.0.1:42121", "HuggingFaceTB/SmolLM2-135M-InstructC=256r0/1"):
        assert value in columns, (value, columns)


def test_a_tokens_list_nested_too_deeply_is_a_usage_error() -> None:
    from kvtier.controller.ctl import CtlUsageError, parse_tokens

    with pytest.raises(CtlUsageError, match="nested too deeply"):
        parse_tokens("[" * 5000 + "]" * 5000, None)
