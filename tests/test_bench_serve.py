"""``kvtier bench serve`` against fake OpenAI-compatible backends (in-process FastAPI, SSE).

No vLLM here: the client's timing math, the workload's shape, the working-set arithmetic,
the JSON's keys and the answer comparison are checked against fakes whose behaviour is known.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from conftest import free_port
from kvtier.bench.common import BenchUsageError
from kvtier.bench.serve import Target, parse_target, run_bench_serve
from kvtier.bench.serve.client import (
    RequestRecord,
    stream_request,
)
from kvtier.bench.serve.configs import (
    hit_rate,
    oracle_hit_rate,
    parse_configs,
    parse_prometheus,
)
from kvtier.bench.serve.run import Phase, ServeBenchOptions, answer_mismatches
from kvtier.bench.serve.workload import (
    WorkloadSpec,
    build_sessions,
    engine_blocks_for_ratio,
    prompt_ids,
    working_set,
)

KEYS = (
    "ttft_mean_ratio_vs_vllm", "throughput_ratio_vs_vllm", "fits_throughput_ratio",
    "router_hit_rate_ratio_vs_round_robin", "router_hit_rate_vs_oracle",
    "max_request_share_ratio_no_reuse", "answers_identical",
)


class WordTokenizer:
    """Word-level tokenizer: a word's id is its crc32 (stable across processes), decode via a table."""

    def __init__(self) -> None:
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for w in text.split():
            i = zlib.crc32(w.encode())
            self.words[i] = w
            out.append(i)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[i] for i in ids)

    def apply_chat_template(self, conversation: Any, tokenize: bool = True, add_generation_prompt: bool = True,
                            **_: Any) -> list[int]:
        text = " ".join(f"<{m['role']}> {m['content']} </{m['role']}>" for m in conversation)
        return self.encode(text + (" <assistant>" if add_generation_prompt else ""))


# -- fake backends -------------------------------------------------------------------------
@dataclass
class Instance:
    """Counters of one fake vLLM instance, exposed as vLLM's /metrics names."""

    seen: list[list[str]] = field(default_factory=list)
    queries: int = 0
    hits: int = 0
    requests: int = 0

    def serve(self, words: list[str]) -> None:
        best = 0
        for p in self.seen:
            n = 0
            while n < min(len(p), len(words)) and p[n] == words[n]:
                n += 1
            best = max(best, n)
        self.queries += len(words)
        self.hits += best
        self.requests += 1
        self.seen.append(words)

    def metrics(self) -> str:
        return (
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="fake"}} {self.queries}\n'
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="fake"}} {self.hits}\n'
            f'vllm:external_prefix_cache_hits_total{{engine="0",model_name="fake"}} 0\n'
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="fake"}} {self.requests}\n'
        )


def fake_app(instances: int = 1, corrupt: str | None = None, first_s: float = 0.0, gap_s: float = 0.0,
             tokens: int = 4) -> FastAPI:
    """An OpenAI-compatible fake: answers depend only on the prompt (except ``corrupt``, a request
    id whose answer is altered); requests spread round robin over ``instances`` counters, each
    with ``/iN/metrics``; ``/metrics`` is instance 0's. Streams ``tokens`` chunks, the first after
    ``first_s`` seconds and the others ``gap_s`` apart, then a usage chunk."""
    app = FastAPI()
    inst = [Instance() for _ in range(instances)]
    turn = {"n": 0}

    def text_of(body: dict[str, Any]) -> str:
        if "messages" in body:
            return " ".join(f"<{m['role']}> {m['content']} </{m['role']}>" for m in body["messages"]) + " <assistant>"
        return str(body["prompt"])

    async def respond(request: Request, chat: bool) -> Any:
        body = await request.json()
        if body.get("model") == "broken":
            return PlainTextResponse("no such model", status_code=404)
        words = text_of(body).split()
        inst[turn["n"] % instances].serve(words)
        turn["n"] += 1
        answer = [f"w{len(words) % 97}", f"x{zlib.crc32(' '.join(words).encode()) % 1000}"] + ["y"] * (tokens - 2)
        if corrupt is not None and request.headers.get("x-request-id") == corrupt:
            answer[0] = "CORRUPT"

        async def gen() -> Any:
            for i, w in enumerate(answer):
                await asyncio.sleep(first_s if i == 0 else gap_s)
                piece = (" " if i else "") + w
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": len(words), "completion_tokens": len(answer)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await respond(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await respond(request, False)

    @app.get("/v1/models")
    async def models() -> Any:
        return {"data": [{"id": "fake"}]}

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(inst[0].metrics())

    @app.get("/i{n}/metrics")
    async def metrics_n(n: int) -> Any:
        return PlainTextResponse(inst[n].metrics())

    return app


class Serving:
    def __init__(self, app: FastAPI):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Serving:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def serving() -> Iterator[Any]:
    started: list[Serving] = []

    def start(app: FastAPI) -> Serving:
        s = Serving(app).__enter__()
        started.append(s)
        return s

    yield start
    for s in started:
        s.__exit__()


# -- client ----------------------------------------------------------------------------------
async def _one(url: str, model: str = "fake", **kw: Any) -> RequestRecord:
    async with httpx.AsyncClient() as c:
        return await stream_request(c, url, model, "t-1", **kw)


@pytest.mark.slow
def test_client_ttft_itl_tpot_math(serving: Any) -> None:
    srv = serving(fake_app(first_s=0.15, gap_s=0.05, tokens=5))
    rec = asyncio.run(_one(srv.url, messages=[{"role": "user", "content": "hello there"}]))
    assert rec.ok, rec.error
    assert rec.answer.split()[2:] == ["y", "y", "y"]
    assert rec.output_tokens == 5 and rec.prompt_tokens == len(["<user>", "hello", "there", "</user>", "<assistant>"])
    assert len(rec.itl) == 4
    assert rec.ttft >= 0.15  # the fake sleeps that long before the first token
    assert all(x >= 0.045 for x in rec.itl)
    assert rec.ttft + sum(rec.itl) <= rec.latency + 1e-9
    assert rec.tpot == pytest.approx((rec.latency - rec.ttft) / 4)
    # completions endpoint: same timing fields, text chunks
    rec2 = asyncio.run(_one(srv.url, prompt="one two three"))
    assert rec2.ok and rec2.output_tokens == 5 and len(rec2.itl) == 4


def test_client_reports_http_error_without_raising(serving: Any) -> None:
    srv = serving(fake_app())
    rec = asyncio.run(_one(srv.url, model="broken", prompt="x"))
    assert not rec.ok and "404" in rec.error and rec.answer == ""
    with pytest.raises(ValueError):
        asyncio.run(_one(srv.url, prompt="x", messages=[]))


# -- workload --------------------------------------------------------------------------------
def test_workload_shape_history_grows_and_system_prompt_shared() -> None:
    tok = WordTokenizer()
    spec = WorkloadSpec(users=3, rounds=3, system_tokens=40, context_tokens=(60, 90), max_tokens=4)
    sessions = build_sessions(spec, tok)
    assert len({s.system for s in sessions}) == 1
    assert len({s.context for s in sessions}) == 3
    assert all(60 <= len(tok.encode(s.context)) - 4 <= 90 for s in sessions)  # "Notes of user N:" header
    s = sessions[0]
    answers = ["first answer", "second answer"]
    prev: list[int] = []
    for r in range(3):
        msgs = s.messages(r, answers)
        assert len(msgs) == 2 + 2 * r and msgs[0] == {"role": "system", "content": s.system}
        ids = prompt_ids(tok, msgs)
        if prev:  # the previous round's prompt (minus its generation prompt) is a prefix
            assert ids[: len(prev) - 1] == prev[:-1] and len(ids) > len(prev)
        prev = ids
    with pytest.raises(ValueError):
        s.messages(2, ["only one"])
    # two users share exactly the system prompt's tokens, then diverge
    a, b = (prompt_ids(tok, x.messages(0, [])) for x in sessions[:2])
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared >= len(tok.encode(s.system))


def test_working_set_counts_shared_blocks_once_and_engine_bound() -> None:
    p1 = list(range(10))
    p2 = list(range(14))
    ws = working_set([p1, p2], block_size=4)
    # p1: [0:4] [0:8] [0:10]; p2 adds [0:12] [0:14]
    assert ws.blocks == 5 and ws.max_prompt_tokens == 14 and ws.prompt_tokens == (10, 14)
    # full blocks only ([0:4] [0:8] [0:12]): the partial tails [0:10] and [0:14] are never stored
    assert ws.full_blocks == 3 and ws.full_tokens == 12
    big = working_set([[u] + list(range(1000)) for u in range(8)], block_size=128)
    assert big.blocks == 8 * 8
    blocks = engine_blocks_for_ratio(big, 4.0, concurrency=1, max_model_len=1024, max_tokens=16)
    assert big.blocks >= 4 * blocks and blocks >= 9
    with pytest.raises(ValueError, match="add users"):
        engine_blocks_for_ratio(big, 4.0, concurrency=3, max_model_len=1024, max_tokens=16)


def test_oracle_and_metrics_parsing() -> None:
    sys_ = list(range(300))
    reqs = [("u0", sys_ + [1000] * 300), ("u1", sys_ + [2000] * 300), ("u2", sys_ + [3000] * 300),
            ("u0", sys_ + [1000] * 400)]
    o = oracle_hit_rate(reqs, instances=2, chunk_tokens=256)
    # u0 -> i0, u1 -> i1 (fewer requests), u2 -> i0 (tie: lower index; hits the system prompt's
    # 256-token chunk), u0 again -> i0: 600 shared tokens -> 512
    assert o["hit_tokens"] == 256 + 512 and o["prompt_tokens"] == 3 * 600 + 700
    assert o["max_request_share_ratio"] == 3.0
    assert oracle_hit_rate(reqs[:1], instances=2)["max_request_share_ratio"] is None
    m = parse_prometheus('a_total{x="1"} 2\na_total{x="2"} 3.5\n# HELP b\nb 1e3\n')
    assert m == {"a_total": 5.5, "b": 1000.0}
    assert hit_rate({"queries": 100, "hits": 20, "external_hits": 30}) == 0.5
    assert hit_rate({"queries": 0}) == 0.0
    with pytest.raises(ValueError):
        parse_configs("vllm,nope")
    with pytest.raises(BenchUsageError):
        parse_target("bogus=http://x")
    assert parse_target("router-2x=http://r:1,http://a:2,http://b:3") == (
        "router-2x", Target("http://r:1", ("http://a:2", "http://b:3")))


def test_answer_mismatch_detection() -> None:
    def ph(name: str, answers: dict[str, str]) -> Phase:
        return Phase(name, [RequestRecord(k, ok=True, answer=v) for k, v in answers.items()], 1.0, [], None)

    phases = {"vllm": ph("vllm", {"u0-r0": "a", "u1-r0": "b"}), "kvtier-cpu": ph("kvtier-cpu", {"u0-r0": "a", "u1-r0": "B"}),
              "rr-2x": ph("rr-2x", {"u0-r0": "a", "u1-r0": "b"})}
    mm = answer_mismatches(phases)
    assert [(m["config"], m["request_id"]) for m in mm] == [("kvtier-cpu", "u1-r0")]


# -- the whole run against fakes ------------------------------------------------------------
@pytest.mark.slow
def test_run_bench_serve_against_fakes_writes_issue_keys(serving: Any, tmp_path: Any) -> None:
    vllm = serving(fake_app())
    kv = serving(fake_app(corrupt="check-u1001-q1"))
    rr = serving(fake_app(instances=2))
    router = serving(fake_app(instances=2))
    fits_a, fits_b = serving(fake_app()), serving(fake_app())
    targets = dict(parse_target(t) for t in (
        f"vllm={vllm.url}", f"kvtier-cpu={kv.url}", f"rr-2x={rr.url},{rr.url}/i0,{rr.url}/i1",
        f"router-2x={router.url},{router.url}/i0,{router.url}/i1", f"vllm@fits={fits_a.url}",
        f"kvtier-cpu@fits={fits_b.url}"))
    opts = ServeBenchOptions(users=3, rounds=2, concurrency=2, system_tokens=30, context_tokens=(300, 400),
                             max_tokens=4, no_reuse_requests=6, no_reuse_tokens=20, vllm_bench=False)
    out = tmp_path / "serve.json"
    rc = run_bench_serve(json_path=out, targets=targets, tokenizer=WordTokenizer(), options=opts, enforce=True)
    data = json.loads(out.read_text())
    for k in KEYS:
        assert k in data
    assert rc == 1  # answers differ (and fake speeds meet no target)
    assert data["answers_identical"] is False
    assert [(m["config"], m["request_id"]) for m in data["answer_mismatches"]] == [("kvtier-cpu", "check-u1001-q1")]
    # serial check: 3 users x 2 questions on vllm@fits (reference), kvtier-cpu and kvtier-cpu@fits
    assert data["answer_check"]["compared"] == 12
    assert [r["request_id"] for r in data["answer_check"]["records"]["kvtier-cpu"]] == [
        "check-u1000-q0", "check-u1001-q0", "check-u1002-q0", "check-u1000-q1", "check-u1001-q1", "check-u1002-q1"]
    agree = data["concurrent_answer_agreement"]
    assert agree["kvtier-cpu"] == {"equal": 6, "of": 6, "baseline": "vllm"}
    assert agree["kvtier-cpu@fits"]["baseline"] == "vllm@fits"
    cfg = data["configs"]
    assert set(cfg) == {"vllm", "kvtier-cpu", "rr-2x", "router-2x", "router-2x@noreuse", "vllm@fits", "kvtier-cpu@fits",
                        "vllm@noreuse", "kvtier-cpu@noreuse"}  # the no-reuse control on every single instance
    # vLLM alone runs the check too, paired (q1 right after q0: an engine-resident hit), judged on its own
    assert [r["request_id"] for r in data["answer_check"]["records"]["vllm"]] == [
        "check-u1000-q0", "check-u1000-q1", "check-u1001-q0", "check-u1001-q1", "check-u1002-q0", "check-u1002-q1"]
    assert data["answer_check"]["others"]["vllm"] == {"compared": 6, "mismatches": [], "identical": True}
    assert data["no_reuse_throughput_ratio"] == pytest.approx(
        cfg["kvtier-cpu@noreuse"]["request_throughput"] / cfg["vllm@noreuse"]["request_throughput"])
    assert data["ttft_later_rounds_ratio_vs_vllm"] == data["ttft_mean_ratio_vs_vllm_later_rounds"] is not None
    for k in ("ttft_mean_ratio_vs_lmcache", "throughput_ratio_vs_lmcache", "answers_identical_lmcache"):
        assert k in data and data[k] is None  # no lmcache-mp: null, never a pass
    assert cfg["vllm"]["requests"] == 6 and cfg["vllm"]["errors"] == 0
    ids = [r["request_id"] for r in cfg["vllm"]["records"]]  # round-major, users shuffled per round
    assert sorted(ids[:3]) == ["u0-r0", "u1-r0", "u2-r0"] and sorted(ids[3:]) == ["u0-r1", "u1-r1", "u2-r1"]
    assert ids == [r["request_id"] for r in cfg["kvtier-cpu"]["records"]]  # the same order in every config
    # the fake spreads requests round robin: 3 and 3 on the no-reuse slice
    assert cfg["router-2x@noreuse"]["requests_per_instance"] == [3.0, 3.0]
    assert data["max_request_share_ratio_no_reuse"] == 1.0
    assert 0 < cfg["router-2x"]["hit_rate"] < 1 and 0 < cfg["rr-2x"]["hit_rate"] < 1
    assert data["router_hit_rate_ratio_vs_round_robin"] == pytest.approx(cfg["router-2x"]["hit_rate"] / cfg["rr-2x"]["hit_rate"])
    assert data["router_hit_rate_vs_oracle"] is not None and cfg["router-2x"]["oracle"]["prompt_tokens"] > 0
    assert cfg["vllm"]["prompt_tokens_local_vs_server_mismatches"] == 0
    assert data["working_set_to_engine_kv_ratio"] >= 4.0
    assert isinstance(data["ttft_mean_ratio_vs_vllm"], float) and isinstance(data["fits_throughput_ratio"], float)
    png = tmp_path / "serve.png"
    if pytest.importorskip("matplotlib"):
        assert png.stat().st_size > 1000


@pytest.mark.slow
def test_identical_answers_pass(serving: Any, tmp_path: Any) -> None:
    a, b, c = serving(fake_app()), serving(fake_app()), serving(fake_app())
    targets = {"vllm": Target(a.url), "kvtier-cpu": Target(b.url), "vllm@fits": Target(c.url)}
    opts = ServeBenchOptions(users=2, rounds=2, concurrency=1, system_tokens=20, context_tokens=(30, 40),
                             max_tokens=3, vllm_bench=False)
    run_bench_serve(json_path=tmp_path / "s.json", targets=targets, tokenizer=WordTokenizer(), options=opts)
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["answers_identical"] is True and data["answer_mismatches"] == []
    assert data["answer_check"]["compared"] == 4
    assert data["router_hit_rate_vs_oracle"] is None and data["fits_throughput_ratio"] is None


@pytest.mark.slow
def test_no_reference_means_answers_not_judged(serving: Any, tmp_path: Any) -> None:
    b = serving(fake_app(corrupt="check-u1000-q1"))
    opts = ServeBenchOptions(users=2, rounds=2, concurrency=1, system_tokens=20, context_tokens=(30, 40),
                             max_tokens=3, vllm_bench=False)
    run_bench_serve(json_path=tmp_path / "s.json", targets={"kvtier-cpu": Target(b.url)}, tokenizer=WordTokenizer(),
                    options=opts)
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["answers_identical"] is None  # neither vllm@fits nor vllm: not judged, never "passed"
    assert data["isolated_hit_ttft_ratio_vs_vllm"] is None and data["no_reuse_throughput_ratio"] is None


@pytest.mark.slow
def test_vllm_alone_is_the_reference_without_fits(serving: Any, tmp_path: Any) -> None:
    """Without vllm@fits, vLLM alone's paired check (engine-resident hits) is the reference:
    a kvtier check answer that differs from it fails, a concurrent-phase difference does not."""
    a, b, c = serving(fake_app()), serving(fake_app(corrupt="u0-r1")), serving(fake_app(corrupt="check-u1001-q1"))
    opts = ServeBenchOptions(users=2, rounds=2, concurrency=1, system_tokens=20, context_tokens=(30, 40),
                             max_tokens=3, vllm_bench=False)
    run_bench_serve(json_path=tmp_path / "s.json", targets={"vllm": Target(a.url), "kvtier-cpu": Target(b.url)},
                    tokenizer=WordTokenizer(), options=opts)
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["answer_check"]["reference"] == "vllm" and data["answers_identical"] is True
    assert data["concurrent_answer_agreement"]["kvtier-cpu"]["equal"] < data["concurrent_answer_agreement"]["kvtier-cpu"]["of"]
    assert isinstance(data["isolated_hit_ttft_ratio_vs_vllm"], float)
    run_bench_serve(json_path=tmp_path / "t.json", targets={"vllm": Target(a.url), "kvtier-cpu": Target(c.url)},
                    tokenizer=WordTokenizer(), options=opts)
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["answers_identical"] is False
    assert [m["request_id"] for m in data["answer_mismatches"]] == ["check-u1001-q1"]


# -- phase 4 interleaved (fits_ab.py) ---------------------------------------------------------
def test_fits_turns_are_abba_on_fresh_users() -> None:
    from kvtier.bench.serve.fits_ab import abba_order, rep_spec

    assert abba_order(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    with pytest.raises(ValueError):
        abba_order(["a", "b"], 0)
    spec = WorkloadSpec(users=3, rounds=2, system_tokens=20, context_tokens=(30, 40))
    assert [rep_spec(spec, k).user_offset for k in range(3)] == [0, 3, 6]
    tok = WordTokenizer()
    users = [{s.user for s in build_sessions(rep_spec(spec, k), tok)} for k in range(2)]
    assert users == [{0, 1, 2}, {3, 4, 5}]  # no rep reuses another's users (nothing of its own cached)


def test_merge_phases_sums_wall_and_metrics() -> None:
    from kvtier.bench.serve.fits_ab import merge_phases

    a = Phase("x", [RequestRecord("u0-r0", ok=True)], 2.0, [{"hits": 1.0}], 10, {"working_set_blocks_measured": 5})
    b = Phase("x", [RequestRecord("u1-r0", ok=True), RequestRecord("u1-r1")], 3.0, [{"hits": 2.0, "q": 1.0}], 10,
              {"working_set_blocks_measured": 7, "prompt_tokens_local_vs_server_mismatches": 1})
    m = merge_phases("x", [a, b])
    assert [r.request_id for r in m.records] == ["u0-r0", "u1-r0", "u1-r1"]
    assert m.wall_s == 5.0 and m.metrics == [{"hits": 3.0, "q": 1.0}]
    assert m.extra == {"working_set_blocks_measured": 7, "prompt_tokens_local_vs_server_mismatches": 1}
    assert m.summary()["request_throughput"] == pytest.approx(2 / 5.0)


@pytest.mark.slow
def test_fits_phase_interleaved_against_fakes(serving: Any, tmp_path: Any) -> None:
    fits_a, fits_b = serving(fake_app()), serving(fake_app(gap_s=0.002))
    targets = {"vllm@fits": Target(fits_a.url), "kvtier-cpu@fits": Target(fits_b.url)}
    opts = ServeBenchOptions(users=2, rounds=2, concurrency=1, system_tokens=20, context_tokens=(30, 40),
                             max_tokens=3, vllm_bench=False, fits_reps=3)
    run_bench_serve(json_path=tmp_path / "s.json", targets=targets, tokenizer=WordTokenizer(), options=opts)
    data = json.loads((tmp_path / "s.json").read_text())
    info = data["fits_interleaved"]
    assert info["order"] == [["vllm@fits", "kvtier-cpu@fits"], ["kvtier-cpu@fits", "vllm@fits"],
                             ["vllm@fits", "kvtier-cpu@fits"]]
    assert len(info["pair_ratios"]) == 3 and info["min"] <= info["median"] <= info["max"]
    cfg = data["configs"]
    for label in ("vllm@fits", "kvtier-cpu@fits"):
        ids = [r["request_id"] for r in cfg[label]["records"]]
        assert sorted(ids) == sorted(f"u{u}-r{r}" for u in range(6) for r in range(2))  # 3 reps x 2 fresh users
        assert cfg[label]["wall_s"] > 0
    rates = info["rep_throughput"]
    pooled = cfg["kvtier-cpu@fits"]["request_throughput"] / cfg["vllm@fits"]["request_throughput"]
    assert data["fits_throughput_ratio"] == pytest.approx(pooled)
    assert info["pair_ratios"] == pytest.approx([k / v for k, v in zip(rates["kvtier-cpu@fits"], rates["vllm@fits"])])


# -- the side by side with LMCache (issue 30) ------------------------------------------------
@pytest.mark.slow
def test_lmcache_side_by_side_figures_against_fakes(serving: Any, tmp_path: Any) -> None:
    """lmcache-mp given as a running target: the issue's top-level ratios come from the right
    configurations (a slower fake LMCache: its TTFT ratio > 1), its check answers are reported
    on their own and do not decide ``answers_identical``."""
    vllm, kv = serving(fake_app()), serving(fake_app())
    lmc = serving(fake_app(first_s=0.05, corrupt="check-u1000-q1"))
    targets = {"vllm": Target(vllm.url), "kvtier-cpu": Target(kv.url), "lmcache-mp": Target(lmc.url)}
    opts = ServeBenchOptions(users=2, rounds=2, concurrency=1, system_tokens=20, context_tokens=(30, 40),
                             max_tokens=3, vllm_bench=False, no_reuse_requests=3, no_reuse_tokens=10)
    run_bench_serve(json_path=tmp_path / "s.json", targets=targets, tokenizer=WordTokenizer(), options=opts)
    data = json.loads((tmp_path / "s.json").read_text())
    cfg = data["configs"]
    assert data["ttft_mean_ratio_vs_lmcache"] == pytest.approx(
        cfg["lmcache-mp"]["ttft_s"]["mean"] / cfg["kvtier-cpu"]["ttft_s"]["mean"])
    assert data["ttft_mean_ratio_vs_lmcache"] > 1.0
    assert data["throughput_ratio_vs_lmcache"] == pytest.approx(
        cfg["kvtier-cpu"]["request_throughput"] / cfg["lmcache-mp"]["request_throughput"])
    assert data["no_reuse_throughput_ratio_lmcache"] == pytest.approx(
        cfg["lmcache-mp@noreuse"]["request_throughput"] / cfg["vllm@noreuse"]["request_throughput"])
    assert data["isolated_hit_ttft_ratio_lmcache_vs_vllm"] > 1.0
    assert data["answers_identical"] is True  # kvtier's answers
    assert data["answers_identical_lmcache"] is False  # LMCache's, reported beside
    assert data["answer_check"]["others"]["lmcache-mp"]["mismatches"][0]["request_id"] == "check-u1000-q1"
    assert set(data["side_by_side"]) == {"vllm", "kvtier-cpu", "lmcache-mp"}
    row = data["side_by_side"]["lmcache-mp"]
    assert row["ttft_mean_s"] == cfg["lmcache-mp"]["ttft_s"]["mean"] and row["isolated_hit_ttft_s"] > 0.05


def test_lmcache_mp_needs_its_venv(tmp_path: Any) -> None:
    from kvtier.bench.serve.lmcache_mp import LMCacheVenv

    with pytest.raises(BenchUsageError, match="--lmcache-venv"):
        run_bench_serve(configs="vllm,lmcache-mp", tokenizer=WordTokenizer(), model_path=str(tmp_path),
                        options=ServeBenchOptions(users=2, rounds=1, system_tokens=20, context_tokens=(30, 40)))
    with pytest.raises(BenchUsageError, match="no .*bin/python"):
        LMCacheVenv(tmp_path).check()


def test_lmcache_server_command_and_l1_size() -> None:
    from pathlib import Path

    from kvtier.bench.serve.lmcache_mp import LMCacheVenv, connector_config, l1_size_gib, server_command

    assert l1_size_gib(3 << 29) == 1.5  # LMCache multiplies --l1-size-gb by 2**30
    with pytest.raises(ValueError):
        l1_size_gib(0)
    argv = server_command(LMCacheVenv(Path("/v"), chunk_size=128), 5001, 5002, 1 << 30, "seg")
    assert argv[:2] == ["/v/bin/lmcache", "server"]
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert flags["--chunk-size"] == "128" and float(flags["--l1-size-gb"]) == 1.0 and flags["--shm-name"] == "seg"
    assert flags["--supported-transfer-mode"] == "engine_driven"  # without it vLLM hangs 300 s at start
    assert flags["--port"] == "5001" and flags["--http-port"] == "5002"
    extra = connector_config(5001)["kv_connector_extra_config"]
    assert extra == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5001}


FAKE_LMCACHE_CLI = r'''#!{python}
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--output-dir") + 1]
wl = args[args.index("--workload") + 1]
slow = "lmc" in args[args.index("--engine-url") + 1]
with open(os.path.join(out, "bench_summary.json"), "w") as f:
    json.dump({{"config": {{"workload": wl}}, "results": {{"successful_requests": 10, "failed_requests": 0,
               "elapsed_time": 20.0 if slow else 10.0, "mean_ttft_ms": 300.0 if slow else 100.0}}}}, f)
open(os.path.join(out, "bench_results.csv"), "w").write("request_id\n")
print("ran", wl)
'''


def test_lmcache_client_runs_and_ratios(tmp_path: Any) -> None:
    import stat
    import sys

    from kvtier.bench.serve.lmcache_client import LMCACHE_WORKLOADS, client_ratios, command, run_lmcache_bench

    cli = tmp_path / "lmcache"
    cli.write_text(FAKE_LMCACHE_CLI.format(python=sys.executable))
    cli.chmod(cli.stat().st_mode | stat.S_IXUSR)
    opts = ServeBenchOptions.lmbench_defaults()
    argv = command(cli, "http://h:1/", "m", "multi-round-chat", opts, 131, tmp_path / "o")
    flags = {a: (b if not b.startswith("--") else "") for a, b in zip(argv[3:], argv[4:] + ["--"]) if a.startswith("--")}
    assert {"--no-interactive", "--json"} <= flags.keys()
    assert argv[1:3] == ["bench", "engine"] and flags["--engine-url"] == "http://h:1"
    assert flags["--mrc-shared-prompt-length"] == "1000" and flags["--mrc-chat-history-length"] == "3000"
    assert flags["--mrc-output-length"] == "32"
    # the volume is ratio x engine KV: sessions of 4,000 tokens -> about 16 of them
    sessions = float(flags["--kv-cache-volume"]) * int(flags["--tokens-per-gb-kvcache"]) / 4000
    assert 16 <= sessions < 17
    with pytest.raises(ValueError):
        command(cli, "u", "m", "nope", opts, 131, tmp_path)
    results: dict[str, Any] = {}
    for name, url in (("kvtier-cpu", "http://kv"), ("lmcache-mp", "http://lmc")):
        for wl in LMCACHE_WORKLOADS:
            results.setdefault(name, {})[wl] = run_lmcache_bench(cli, url, "m", wl, opts, 131, tmp_path / name / wl)
    got = results["kvtier-cpu"]["long-doc-qa"]
    assert got["request_throughput"] == 1.0 and got["exit_code"] == 0 and got["csv"].endswith("bench_results.csv")
    r = client_ratios(results)["multi-round-chat"]
    assert r["ttft_mean_ratio_vs_lmcache"] == 3.0 and r["throughput_ratio_vs_lmcache"] == 2.0
    assert r["ttft_mean_ratio_vs_vllm"] is None
    r = client_ratios(results, own={"ttft_mean_ratio_vs_lmcache": 1.5, "throughput_ratio_vs_lmcache": 0.9})["long-doc-qa"]
    assert r["same_ordering"] == {"ttft_mean_ratio_vs_lmcache": True, "throughput_ratio_vs_lmcache": False}
    # a ratio within 2% of 1 on either side orders nothing (a fixed-rate workload's throughput)
    r = client_ratios(results, own={"ttft_mean_ratio_vs_lmcache": 1.01, "throughput_ratio_vs_lmcache": 0.9})["long-doc-qa"]
    assert r["same_ordering"] == {"ttft_mean_ratio_vs_lmcache": None, "throughput_ratio_vs_lmcache": False}
    # hostile trial: NaN, inf, zero or negative figures order nothing; a config without results is skipped
    for odd in (float("nan"), float("inf"), 0.0, -2.0):
        r = client_ratios(results, own={"ttft_mean_ratio_vs_lmcache": odd})["long-doc-qa"]
        assert r["same_ordering"] == {"ttft_mean_ratio_vs_lmcache": None}
    weird = {"kvtier-cpu": None, "lmcache-mp": {"w": {"mean_ttft_ms": float("inf"), "request_throughput": 1.0}}}
    assert client_ratios(weird)["w"]["ttft_mean_ratio_vs_lmcache"] is None
    bad = run_lmcache_bench(tmp_path / "missing", "http://kv", "m", "long-doc-qa", opts, 131, tmp_path / "bad")
    assert "error" in bad


def test_lmbench_preset_is_lmbenchmarks_shape_at_4x() -> None:
    """--workload lmbench: LMBenchmark's multi-round QA shape (shared system prompt, long
    per-user history, 32-token answers); an unknown preset is a usage error."""
    o = ServeBenchOptions.preset("lmbench", quick=False)
    assert (o.system_tokens, o.context_tokens, o.max_tokens, o.workload) == (1000, (3000, 3000), 32, "lmbench")
    assert ServeBenchOptions.preset("default", quick=True) == ServeBenchOptions.quick_defaults()
    with pytest.raises(BenchUsageError, match="--workload"):
        ServeBenchOptions.preset("nope", quick=False)
    tok = WordTokenizer()
    q = ServeBenchOptions.preset("lmbench", quick=True)
    spec = WorkloadSpec(users=q.users, rounds=q.rounds, system_tokens=q.system_tokens,
                        context_tokens=q.context_tokens, max_tokens=q.max_tokens)
    sessions = build_sessions(spec, tok)
    assert len({s.system for s in sessions}) == 1  # one system prompt shared by every user
    ws = working_set([prompt_ids(tok, s.messages(r, ["a " * q.max_tokens] * r)) for r in range(q.rounds)
                      for s in sessions], 64)
    mml = -(-(ws.max_prompt_tokens + q.max_tokens + 64) // 64) * 64
    assert ws.blocks >= 4 * engine_blocks_for_ratio(ws, 4.0, q.concurrency, mml, q.max_tokens)


def test_lmcache_cli_configs_must_name_side_by_side_configurations(tmp_path: Any) -> None:
    """--lmcache-cli-configs: a name outside the side by side is a usage error before any
    server starts (a typo would otherwise silently run LMCache's client against nothing)."""
    opts = ServeBenchOptions(users=2, rounds=1, system_tokens=20, context_tokens=(30, 40))
    for bad in ("kvtier-cpu,nope", "rr-2x", " , "):
        with pytest.raises(BenchUsageError, match="--lmcache-cli-configs"):
            run_bench_serve(configs="vllm,kvtier-cpu", tokenizer=WordTokenizer(), model_path=str(tmp_path),
                            options=opts, lmcache_cli_configs=bad)


@pytest.mark.slow
def test_no_reuse_requests_override(serving: Any, tmp_path: Any) -> None:
    """--no-reuse-requests overrides the preset's count of the no-reuse control's prompts."""
    vllm, kv = serving(fake_app()), serving(fake_app())
    opts = ServeBenchOptions(users=2, rounds=1, concurrency=1, system_tokens=20, context_tokens=(30, 40),
                             max_tokens=3, vllm_bench=False, no_reuse_requests=5, no_reuse_tokens=10)
    run_bench_serve(json_path=tmp_path / "s.json", targets={"vllm": Target(vllm.url), "kvtier-cpu": Target(kv.url)},
                    tokenizer=WordTokenizer(), options=opts, no_reuse_requests=2)
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["workload"]["no_reuse_requests"] == 2
    for label in ("vllm@noreuse", "kvtier-cpu@noreuse"):
        assert len(data["configs"][label]["records"]) == 2


def test_lmcache_mrc_sessions_fit_the_engines_context(tmp_path: Any) -> None:
    """multi-round-chat's sessions grow by a query and an answer per turn: the history is cut so
    that the last turn of a session still fits max_model_len (a 4,352-token engine refused 10 of
    60 requests of an uncut 3,000-token history with HTTP 400); too small a context is an error
    the run reports, not a crash."""
    from kvtier.bench.serve.lmcache_client import (
        DEFAULT_QPS,
        MRC_QUERY_TOKENS,
        TEMPLATE_TOKENS,
        run_lmcache_bench,
        workload_args,
    )

    opts = ServeBenchOptions.lmbench_defaults()
    for engine_blocks, mml in ((85, 4352), (94, 4480), (131, 8192)):
        args = workload_args("multi-round-chat", opts, engine_blocks, mml)
        flag = dict(zip(args[::2], args[1::2]))
        history, duration = int(flag["--mrc-chat-history-length"]), float(flag["--mrc-duration"])
        sessions = int(float(flag["--kv-cache-volume"]) * int(flag["--tokens-per-gb-kvcache"]) // (1000 + history))
        turns = -(-DEFAULT_QPS * duration // sessions)  # requests per session, rounded up
        last = 1000 + history + TEMPLATE_TOKENS + turns * (MRC_QUERY_TOKENS + opts.max_tokens)
        assert last <= mml and history <= 3000
    assert workload_args("multi-round-chat", opts, 131, 8192)[7] == "3000"  # room to spare: uncut
    bad = run_lmcache_bench(tmp_path / "cli", "http://kv", "m", "multi-round-chat", opts, 94, tmp_path / "o",
                            max_model_len=1500)
    assert "max_model_len 1500" in bad["error"]
