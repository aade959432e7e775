"""The fleet timing check: a real run's records replayed through FleetSim (hand-computed
TTFTs), the error figure, the calibration fit, and the CLI's bad input. No vLLM needed."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli import app
from kvtier.sim.fleet.calibrate import CalibrationError, fit_params, load_calibration
from kvtier.sim.fleet.engine import VLLM_CPU_SMOLLM2, EngineParams
from kvtier.sim.fleet.timing import TimingInputError, load_serve_run, replay, trace_records, ttft_error

#: Round numbers so TTFTs can be computed by hand: a step costs 0.01 s + 1 ms per prefill token
#: + 1 us per attended pair + 2 ms per decoding sequence; 5 ms more per first token.
P = replace(VLLM_CPU_SMOLLM2, name="hand", step_overhead_s=0.01, prefill_s_per_token=1e-3, attention_s_per_pair=1e-6,
            decode_s_per_seq=0.002, token_budget=2048, max_seqs=8, first_token_overhead_s=0.005)


def _run_file(tmp_path: Path, reqs: list[dict], name: str = "rr-2x", **over: object) -> Path:
    """A ``kvtier bench serve`` JSON of the shape the check reads (only the fields it uses)."""
    records = [{"request_id": r["id"], "ok": True, "start": r["start"], "ttft": r["ttft"],
                "prompt_tokens": r["len"], "output_tokens": r.get("out", 2), "backend": r.get("backend", "")}
               for r in reqs]
    blocks = {r["id"]: {"input_length": r["len"], "hash_ids": r["ids"]} for r in reqs}
    phase = {"records": records, "engine_blocks": 59, "metrics_delta_per_instance": [{}, {}],
             "prompt_blocks": {"block_size": 128, "requests": blocks}}
    doc = {"configs": {name: phase}, "kvtier_cpu_bytes": {"per_instance_of_two": 0}, "workload": {"users": 2}}
    doc.update(over)
    p = tmp_path / "run.json"
    p.write_text(json.dumps(doc))
    return p


def test_one_request_alone_is_one_prefill_step(tmp_path: Path) -> None:
    run = load_serve_run(_run_file(tmp_path, [{"id": "u0-r0", "start": 3.0, "ttft": 0.4, "len": 300, "ids": [0, 1, 2],
                                               "backend": "i0"}]))
    pred, workers, _ = replay(run, P)
    # 0.01 + 300 * 1e-3 + 1e-6 * 300 * (0 + 150) + 0.005 first-token overhead
    assert pred == [pytest.approx(0.01 + 0.3 + 0.045 + 0.005)]
    assert workers == [0]
    assert trace_records(run)[0].timestamp_ms == 0.0  # timestamps from the first send


def test_two_requests_on_one_instance_queue_and_on_two_do_not(tmp_path: Path) -> None:
    a = {"id": "u0-r0", "start": 0.0, "ttft": 0.4, "len": 300, "ids": [0, 1, 2], "backend": "i0"}
    b = {"id": "u1-r0", "start": 0.1, "ttft": 0.5, "len": 200, "ids": [3, 4], "backend": "i0"}
    pred, _, _ = replay(load_serve_run(_run_file(tmp_path, [a, b])), P)
    a_step = 0.01 + 0.3 + 0.045  # A's prefill step, running when B arrives at 0.1
    b_step = 0.01 + 0.002 + 0.2 + 1e-6 * 200 * 100  # B's prefill beside A's one decode
    assert pred[0] == pytest.approx(a_step + 0.005)
    assert pred[1] == pytest.approx(a_step + b_step - 0.1 + 0.005)
    # B on the other instance: no wait, no decode beside it
    other = {"id": "u9-r0", "start": 0.1, "ttft": 0.5, "len": 200, "ids": [3, 4], "backend": "i1"}
    pred2, workers, _ = replay(load_serve_run(_run_file(tmp_path, [a, other])), P)
    assert workers == [0, 1]
    assert pred2[1] == pytest.approx(0.01 + 0.2 + 0.02 + 0.005)


def test_a_prefix_cached_in_the_engine_is_not_computed_again(tmp_path: Path) -> None:
    a = {"id": "u0-r0", "start": 0.0, "ttft": 0.4, "len": 300, "ids": [0, 1, 2], "backend": "i0", "out": 1}
    b = {"id": "u0-r1", "start": 5.0, "ttft": 0.1, "len": 320, "ids": [0, 1, 7], "backend": "i0", "out": 1}
    pred, _, _ = replay(load_serve_run(_run_file(tmp_path, [a, b])), P)
    # 256 tokens (2 full blocks) cached: 64 computed after them
    assert pred[1] == pytest.approx(0.01 + 0.064 + 1e-6 * 64 * (256 + 32) + 0.005)


def test_without_backends_the_runs_policy_routes(tmp_path: Path) -> None:
    a = {"id": "u0-r0", "start": 0.0, "ttft": 0.4, "len": 300, "ids": [0, 1, 2]}
    b = {"id": "u1-r0", "start": 0.1, "ttft": 0.5, "len": 200, "ids": [3, 4]}
    pred, workers, fleet = replay(load_serve_run(_run_file(tmp_path, [a, b])), P)
    assert workers == [0, 1] and not fleet["assigned_from_run"]  # round robin
    assert pred[1] == pytest.approx(0.01 + 0.2 + 0.02 + 0.005)


def test_ttft_error_is_the_mean_gap_over_the_measured_mean() -> None:
    e = ttft_error([1.0, 3.0], [1.5, 2.9])
    assert e["ttft_error"] == pytest.approx(0.1)
    assert e["signed_error"] == pytest.approx(0.1)
    assert e["n_requests"] == 2
    assert e["per_request_rel_error"]["max"] == pytest.approx(0.5)
    assert e["per_request_rel_error"]["min"] == pytest.approx(-0.1 / 3)
    assert e["per_request_rel_error"]["within_20pct"] == 0.5
    assert ttft_error([2.0], [1.0])["ttft_error"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        ttft_error([], [])
    with pytest.raises(ValueError):
        ttft_error([1.0], [1.0, 2.0])


def _calibration(p: EngineParams) -> dict:
    def prefill(c: int, n: int) -> float:
        return p.first_token_overhead_s + p.step_overhead_s + p.prefill_s(n, c)

    return {"cold": [{"input_length": n, "ttft_s": prefill(0, n)} for n in (200, 600, 1000, 1600)],
            "cached": [{"input_length": 1500, "cached_tokens": 1408, "ttft_s": prefill(1408, 92)}],
            "decode": [{"seqs": k, "itl_s": p.step_overhead_s + k * p.decode_s_per_seq} for k in (1, 2, 4)],
            "tier_hit": [{"tier": "cpu", "input_length": 1500, "tier_tokens": 1408,
                          "ttft_s": prefill(1408, 92) + 1408 * 23_040 / 5e9}],
            "token_budget": 2048, "max_seqs": 128}


def test_calibration_fit_recovers_the_parameters_it_was_made_from() -> None:
    got, report = fit_params(_calibration(P))
    assert got.step_overhead_s == pytest.approx(0.01)
    assert got.decode_s_per_seq == pytest.approx(0.002)
    assert got.prefill_s_per_token == pytest.approx(1e-3, rel=1e-6)
    assert got.attention_s_per_pair == pytest.approx(1e-6, rel=1e-6)
    assert got.first_token_overhead_s == pytest.approx(0.005, abs=1e-9)
    assert got.load_gbps["cpu"] == pytest.approx(5.0, rel=1e-6)
    assert got.max_seqs == 128 and got.name == "vllm-cpu-calibrated"
    assert all(abs(r["rel_error"]) < 1e-9 for r in report["prefill_points"])


def test_calibration_with_bad_fields_says_which() -> None:
    doc = _calibration(P)
    with pytest.raises(CalibrationError, match="decode"):
        fit_params({**doc, "decode": [{"seqs": 1, "itl_s": 0.01}]})
    with pytest.raises(CalibrationError, match=r"cold\[0\].ttft_s"):
        fit_params({**doc, "cold": [{"input_length": 200}]})
    with pytest.raises(CalibrationError, match="'cold'"):
        fit_params({k: v for k, v in doc.items() if k != "cold"})


def test_run_file_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(TimingInputError, match="no such file"):
        load_serve_run(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TimingInputError, match="not JSON"):
        load_serve_run(tmp_path / "bad.json")
    p = _run_file(tmp_path, [{"id": "u0-r0", "start": 0.0, "ttft": 0.4, "len": 300, "ids": [0, 1, 2]}], name="vllm")
    with pytest.raises(TimingInputError, match="no two-instance configuration"):
        load_serve_run(p)
    doc = json.loads(_run_file(tmp_path, [{"id": "u0-r0", "start": 0.0, "ttft": 0.4, "len": 300, "ids": [0, 1, 2]}]).read_text())
    del doc["configs"]["rr-2x"]["prompt_blocks"]
    p.write_text(json.dumps(doc))
    with pytest.raises(TimingInputError, match="prompt_blocks"):
        load_serve_run(p)


def test_cli_bad_input_is_a_one_line_usage_error(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", "timing-check", "--run", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "no such file" in r.output
    (tmp_path / "x.json").write_text(json.dumps({"configs": {"rr-2x": {"records": []}}}))
    r = CliRunner().invoke(app, ["bench", "timing-check", "--run", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "prompt_blocks" in r.output and "Traceback" not in r.output
    run = _run_file(tmp_path, [{"id": "u0-r0", "start": 0.0, "ttft": 0.36, "len": 300, "ids": [0, 1, 2]}])
    r = CliRunner().invoke(app, ["bench", "timing-check", "--run", str(run), "--calibration", str(tmp_path / "no-cal.json")])
    assert r.exit_code == 2 and "no-cal.json: no such file" in r.output
    r = CliRunner().invoke(app, ["bench", "timing-check", "--run", str(run), "--load-before", "high"])
    assert r.exit_code == 2 and "load averages" in r.output
    (tmp_path / "t.json").write_text(json.dumps({"ttft_error": 0.1}))
    r = CliRunner().invoke(app, ["bench", "fleet", "--trace", str(run), "--timing-check", str(tmp_path / "t.json")])
    assert r.exit_code == 2 and "missing field(s)" in r.output


def test_cli_check_writes_what_bench_fleet_reads(tmp_path: Path) -> None:
    from kvtier.bench.fleet_timing import read_timing_check

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(_calibration(P)))
    run = _run_file(tmp_path, [{"id": "u0-r0", "start": 0.0, "ttft": 0.36, "len": 300, "ids": [0, 1, 2], "backend": "i0"}])
    out, trace = tmp_path / "check.json", tmp_path / "trace.jsonl"
    r = CliRunner().invoke(app, ["bench", "timing-check", "--run", str(run), "--calibration", str(cal), "--json", str(out),
                                 "--trace", str(trace), "--load-before", "1.0 0.5 0.2", "--load-after", "2 1 0.5"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["ttft_error"] == pytest.approx(0.0, abs=1e-6)
    assert doc["machine_load"] == {"loadavg_before": [1.0, 0.5, 0.2], "loadavg_after": [2.0, 1.0, 0.5]}
    assert json.loads(trace.read_text().splitlines()[0]) == {"timestamp": 0, "input_length": 300, "output_length": 2,
                                                            "hash_ids": [0, 1, 2]}
    t = read_timing_check(out)
    assert t["ttft_error"] == doc["ttft_error"] and t["n_requests"] == 1
    assert t["measured_mean_ttft_ms"] == pytest.approx(360.0)


@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "deep", "too-large", "not-utf8"])
def test_every_json_input_is_read_bounded(tmp_path: Path, kind: str) -> None:
    """The run, calibration and timing-check files go through one bounded reader: a FIFO, a
    directory or /dev/zero never hangs or fills memory; deep nesting is 'not JSON', not a RecursionError."""
    from kvtier.protocol.decoding import read_json_file

    p = tmp_path / "in.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    elif kind == "device":
        p = Path("/dev/zero")
    elif kind == "deep":
        p.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "too-large":
        p.write_text(json.dumps({"x": "y" * 2048}))
    else:
        p.write_bytes(b'{"a": "\xff"}')
    words = {"fifo": "not a regular file", "directory": "not a regular file", "device": "not a regular file",
             "deep": "not JSON", "too-large": "larger than 1024 bytes", "not-utf8": "not JSON"}[kind]
    with pytest.raises(ValueError, match=words):
        read_json_file(p, max_bytes=1024 if kind == "too-large" else 1 << 20)
    if kind != "too-large":
        with pytest.raises(TimingInputError, match=words):
            load_serve_run(p)
        with pytest.raises(CalibrationError, match=words):
            load_calibration(p)


@pytest.mark.parametrize("field, value, words", [
    ("ttft_s", 0, r"cold\[0\].ttft_s must be a number in"),  # weights 1/ttft: hung lstsq
    ("ttft_s", 5e-324, "ttft_s must be a number in"),
    ("ttft_s", float("nan"), "ttft_s must be a number in"),
    ("ttft_s", float("inf"), "ttft_s must be a number in"),
    ("input_length", 10**300, "input_length must be an integer in"),
    ("input_length", 200.5, "input_length must be an integer"),
])
def test_calibration_numbers_are_bounded(field: str, value: object, words: str) -> None:
    doc = _calibration(P)
    doc["cold"][0] = {**doc["cold"][0], field: value}
    with pytest.raises(CalibrationError, match=words):
        fit_params(doc)


@pytest.mark.parametrize("key, value", [("kv_bytes_per_token", "abc"), ("kv_bytes_per_token", -5),
                                        ("token_budget", "x"), ("max_seqs", 0.5), ("max_seqs", -1)])
def test_calibration_engine_settings_are_bounded(key: str, value: object) -> None:
    with pytest.raises(CalibrationError, match=key):
        fit_params({**_calibration(P), key: value})


@pytest.mark.parametrize("change, words", [
    (lambda d: d["configs"]["rr-2x"]["records"][0].update(prompt_tokens=10**15), "prompt_tokens"),
    (lambda d: d["configs"]["rr-2x"].update(metrics_delta_per_instance=[{}] * 100_000), "instances"),
    (lambda d: d["configs"]["rr-2x"]["prompt_blocks"].update(block_size=0), "block_size"),
    (lambda d: d["configs"]["rr-2x"].update(engine_blocks=0), "engine_blocks"),
    (lambda d: d["configs"]["rr-2x"]["prompt_blocks"]["requests"]["u0-r0"].update(hash_ids=[-1]), r"hash_ids\[0\]"),
    (lambda d: d["configs"]["rr-2x"]["prompt_blocks"]["requests"]["u0-r0"].update(hash_ids=["a"]), r"hash_ids\[0\]"),
    (lambda d: d["configs"]["rr-2x"]["prompt_blocks"]["requests"]["u0-r0"].update(hash_ids=[10**400]), r"hash_ids\[0\]"),
    (lambda d: d["configs"]["rr-2x"]["records"][0].update(start=float("nan")), "start"),
    (lambda d: d["configs"]["rr-2x"]["records"][0].update(ttft=-1), "ttft"),
    (lambda d: d["configs"]["rr-2x"]["records"][0].update(output_tokens=-3), "output_tokens"),
    (lambda d: d["configs"]["rr-2x"]["records"].append(dict(d["configs"]["rr-2x"]["records"][0])), "appears twice"),
])
def test_run_numbers_are_bounded(tmp_path: Path, change, words: str) -> None:
    """A few hundred bytes must not make the replay build 10**13 block ids or 100k instances."""
    p = _run_file(tmp_path, [{"id": "u0-r0", "start": 0.0, "ttft": 0.4, "len": 300, "ids": [0, 1, 2]}])
    doc = json.loads(p.read_text())
    change(doc)
    p.write_text(json.dumps(doc))
    with pytest.raises(TimingInputError, match=words):
        load_serve_run(p)


def test_timing_outputs_and_checks_are_refused_before_any_work(tmp_path: Path) -> None:
    run = _run_file(tmp_path, [{"id": "u0-r0", "start": 0.0, "ttft": 0.36, "len": 300, "ids": [0, 1, 2]}])
    (tmp_path / "adir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for flag, target in (("--json", tmp_path / "adir"), ("--trace", tmp_path / "fifo"), ("--trace", "-")):
        r = CliRunner().invoke(app, ["bench", "timing-check", "--run", str(run), flag, str(target)])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(app, ["bench", "timing-check", "--run", str(run), "--json", "-"])
    assert r.exit_code in (0, 1) and '"ttft_error"' in r.output and not Path("-").exists()
    for bad in ({"measured_mean_ttft_s": "0.4"}, {"measured_mean_ttft_s": None}, {"ttft_error": "bad"},
                {"measured_mean_ttft_s": 10**400}):
        doc = {"ttft_error": 0.1, "measured_mean_ttft_s": 0.4, "predicted_mean_ttft_s": 0.36, "n_requests": 1,
               "source_run": "r", **bad}
        (tmp_path / "t.json").write_text(json.dumps(doc))
        r = CliRunner().invoke(app, ["bench", "fleet", "--trace", str(run), "--timing-check", str(tmp_path / "t.json")])
        assert r.exit_code == 2 and "Traceback" not in r.output, (bad, r.output)
    cal = str(tmp_path / "cal.json")
    r = CliRunner().invoke(app, ["bench", "timing-calibrate", "--json", cal, "--cores", "0", "--neighbour", "0"])
    assert r.exit_code == 2 and "shares a core" in r.output
    r = CliRunner().invoke(app, ["bench", "timing-calibrate", "--json", cal, "--cores", "999"])
    assert r.exit_code == 2 and "not available" in r.output
