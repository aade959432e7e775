"""kvtier router against fake vLLM backends (in-process FastAPI apps) and fake KV events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)

from conftest import free_port, wait_until
from kvtier.events.publisher import EventPublisher
from kvtier.events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.router.server import RouterServer
from kvtier.router.config import (
    BackendSpec,
    RouterConfig,
    RouterConfigError,
    Weights,
    parse_backend,
)
from kvtier.router.load import LoadTracker, parse_vllm_metrics
from kvtier.router.prefix_index import PrefixIndex, chain_keys
from kvtier.router.scoring import Candidate, rank, weighted_hit
from kvtier.router.tokenize import PromptTokenizer, TokenizeError

BS = 16  # fake engine block size


class FakeBackend:
    """A tiny vLLM look-alike: /v1/completions (+SSE), /v1/chat/completions, /health, /metrics."""

    def __init__(self, name: str, port: int | None = None, delay_s: float = 0.0) -> None:
        self.name = name
        self.port = port or free_port()
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        self.running = 0
        self.hang = False
        self.start_time = time.time()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _app(self) -> FastAPI:
        app = FastAPI()

        async def complete(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            self.running += 1
            try:
                while self.hang:
                    await asyncio.sleep(0.05)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
            finally:
                self.running -= 1
            if body.get("stream"):
                async def gen():
                    for i in range(5):
                        yield f"data: {json.dumps({'backend': self.name, 'i': i})}\n\n".encode()
                        await asyncio.sleep(0.01)
                    yield b"data: [DONE]\n\n"
                return StreamingResponse(gen(), media_type="text/event-stream")
            return JSONResponse({"backend": self.name, "choices": [{"text": "ok"}]})

        app.post("/v1/completions")(complete)
        app.post("/v1/chat/completions")(complete)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake", "owned_by": self.name}]}

        @app.get("/health")
        async def health() -> Response:
            while self.hang:
                await asyncio.sleep(0.05)
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(
                "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="fake"}} {self.running}\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="fake"}} 0.0\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="fake"}} 0.0\n'
                f"process_start_time_seconds {self.start_time}\n")

        return app

    def start(self) -> FakeBackend:
        self.start_time = time.time()
        self._server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port,
                                                     log_level="error", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "fake backend did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.hang = False
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
            assert self._thread is not None
            self._thread.join(10)
            self._server = None


def _stored(tokens: list[int], salt: int, parent: int | None = None, medium: str = "GPU") -> BlockStored:
    """Engine-style BlockStored for full blocks of ``tokens`` with hashes seeded by ``salt``
    (different processes seed differently: the router must not care)."""
    n = len(tokens) // BS
    hashes = [salt * 1_000_003 + i + (0 if parent is None else parent) for i in range(1, n + 1)]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens[: n * BS],
                       block_size=BS, lora_id=None, medium=medium, lora_name=None)


@pytest.fixture()
def fleet(tmp_path: Path):
    backs = [FakeBackend("a").start(), FakeBackend("b").start()]
    pubs = [EventPublisher(f"ipc://{tmp_path}/ev{i}.sock") for i in range(2)]
    yield backs, pubs, tmp_path
    for b in backs:
        b.stop()
    for p in pubs:
        p.close()


def _router(backs: list[FakeBackend], pubs: list[EventPublisher] | None = None, policy: str = "kv-aware",
            tokenizer: Any = None, **kw: Any) -> RouterServer:
    specs = tuple(BackendSpec(url=b.url, instance_id=b.name, events=pubs[i].endpoint if pubs else None)
                  for i, b in enumerate(backs))
    cfg = RouterConfig(backends=specs, policy=policy, **kw)
    return RouterServer(cfg, tokenizer=tokenizer, port=0).start()


def _complete(client: httpx.Client, prompt: Any, **kw: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 4, **kw})


def _blocks(router: RouterServer, name: str) -> int:
    return router.router.index.stats()[name]["blocks"]


DOC = list(range(1000, 1000 + 8 * BS))  # an 8-block "document"


# -- pure units ---------------------------------------------------------------------------------


def test_parse_backend() -> None:
    b = parse_backend("http://h:1/=inst-a@tcp://h:5557,tcp://h:5558")
    assert (b.url, b.instance_id, b.events, b.replay) == ("http://h:1", "inst-a", "tcp://h:5557", "tcp://h:5558")
    assert parse_backend("http://h:2").name == "h:2"
    for bad in ("h:1", "http://h:1=", "http://h:1@", "ftp://h:1"):
        with pytest.raises(RouterConfigError):
            parse_backend(bad)
    # a backend URL with user:password@ was split at its "@": url "http://u:s3cret" (the password shown
    # unmasked wherever the URL is), events "h:8000"
    b = parse_backend("http://u:s3cret@h:8000=i@tcp://h:5557")
    assert (b.url, b.instance_id, b.events) == ("http://u:s3cret@h:8000", "i", "tcp://h:5557")
    assert parse_backend("http://u:s3cret@h:8000").events is None
    for bad in ("http://u:s3cret@h:port", "http://u:s3cret@h:8000@tcp://h:1,h:2", "http://u:s3cret@"):
        with pytest.raises(RouterConfigError) as exc:
            parse_backend(bad)
        assert "s3cret" not in str(exc.value), exc.value
    with pytest.raises(RouterConfigError):
        RouterConfig(backends=(parse_backend("http://h:1"),), policy="random").validate()
    with pytest.raises(RouterConfigError):
        RouterConfig(backends=(parse_backend("http://h:1"), parse_backend("http://h:1"))).validate()
    with pytest.raises(RouterConfigError):
        Weights(gpu=0.5, cpu=0.9).validate()


def test_index_keys_ignore_engine_seeds_and_honour_removals() -> None:
    idx = PrefixIndex(["a", "b"])
    from kvtier.events.codec import make_batch

    # Same tokens, different per-process hashes, split over two events (parent link).
    idx.apply("a", make_batch([_stored(DOC[: 4 * BS], salt=1)]))
    idx.apply("a", make_batch([_stored(DOC[4 * BS:], salt=1, parent=1_000_003 + 4)]))
    idx.apply("b", make_batch([_stored(DOC[: 2 * BS], salt=7, medium="CPU")]))
    keys = chain_keys(DOC, BS)
    ma, mb = idx.match("a", keys, BS), idx.match("b", keys, BS)
    assert ma.tokens == 8 * BS and ma.per_medium == {"GPU": 8 * BS}
    assert mb.tokens == 2 * BS and mb.per_medium == {"CPU": 2 * BS}
    # A different prompt sharing 3 blocks matches 3 blocks.
    other = DOC[: 3 * BS] + [5] * (2 * BS)
    assert idx.match("a", chain_keys(other, BS), BS).tokens == 3 * BS
    # Removing block 3 of a cuts the prefix there; an orphan store is skipped.
    idx.apply("a", make_batch([BlockRemoved(block_hashes=[1_000_003 + 3], medium="GPU")]))
    assert idx.match("a", keys, BS).tokens == 2 * BS
    idx.apply("b", make_batch([_stored(DOC[2 * BS: 3 * BS], salt=7, parent=999)]))
    assert idx.stats()["b"]["orphans"] == 1
    idx.apply("a", make_batch([AllBlocksCleared()]))
    assert idx.match("a", keys, BS).tokens == 0
    assert idx.match("b", keys, BS).tokens == 2 * BS


def test_weighted_hit_and_ranking() -> None:
    # Engine holds 32 tokens, controller says CPU holds 64: 32 x 1.0 + 32 x 0.8.
    assert weighted_hit([(32, 1.0)], [(64, 0.8)]) == (64, pytest.approx(57.6))
    assert weighted_hit([], []) == (0, 0.0)
    a = Candidate("a", 0, hit_tokens=64, hit_score=64.0, load_tokens=10)
    b = Candidate("b", 1, load_tokens=0)
    d = rank("kv-aware", [a, b], load_weight=0.5)
    assert d.choice.name == "a" and d.reason == "prefix"
    # Equal everything: deterministic, first configured; then least recently assigned.
    x, y = Candidate("x", 0), Candidate("y", 1)
    for _ in range(5):
        assert rank("kv-aware", [y, x], 0.5).choice.name == "x"
    assert rank("kv-aware", [Candidate("x", 0, last_assigned=3), y], 0.5).choice.name == "y"
    assert rank("kv-aware", [Candidate("x", 0, last_assigned=3), y], 0.5).reason == "tie-least-recent"
    assert rank("least-loaded", [Candidate("x", 0, load_tokens=5), y], 0.5).choice.name == "y"
    assert [rank("round-robin", [x, y], 0.5, rr_next=i).choice.name for i in range(3)] == ["x", "y", "x"]


def test_metrics_parser_and_load_terms() -> None:
    m = parse_vllm_metrics('vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 1\n'
                           'vllm:num_requests_waiting{engine="0"} 3\nvllm:kv_cache_usage_perc{a="b"} 0.5\n'
                           'garbage\nprocess_start_time_seconds 12.5\nvllm:num_requests_waiting_x 9\n')
    assert (m.running, m.waiting, m.kv_usage, m.start_time) == (3.0, 3.0, 0.5, 12.5)
    now = [0.0]
    restarted: list[str] = []
    lt = LoadTracker(["a", "b"], Weights(), on_restart=restarted.append, clock=lambda: now[0])
    lt.begin("a", 100)
    assert lt.breakdown("a")["inflight_tokens"] == 100
    lt.end("a", 100)
    # Idle, but a was assigned recently: it carries more load than b.
    assert lt.load_tokens("a") > lt.load_tokens("b") == 0
    now[0] += 1000
    assert lt.load_tokens("a") == pytest.approx(0, abs=1e-6)
    # Metrics: 6 requests seen, 1 of them the router's: 5 external.
    lt.note_metrics("b", m, router_max_inflight=1)
    assert lt.breakdown("b")["external_requests"] == 5
    lt.note_metrics("b", parse_vllm_metrics("process_start_time_seconds 99\n"), 0)
    assert restarted == ["b"]


class _FakeTok:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, conv: Any, tokenize: bool = True, add_generation_prompt: bool = False,
                            **kw: Any) -> str:
        s = "".join(f"<{m['role']}>{m['content']}" for m in conv)
        return s + ("<assistant>" if add_generation_prompt else "")


def test_tokenize_shapes() -> None:
    t = PromptTokenizer(_FakeTok())
    assert t.completion({"prompt": "ab"}) == [1, 97, 98]
    assert t.completion({"prompt": [5, 6]}) == [5, 6]
    assert t.completion({"prompt": [[7], [8]]}) == [7]
    assert t.completion({"prompt": ["ab", "c"], "add_special_tokens": False}) == [97, 98]
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert t.chat(chat) == [ord(c) for c in "<user>hi<assistant>"]
    with pytest.raises(TokenizeError):
        PromptTokenizer(None).completion({"prompt": "x"})
    with pytest.raises(TokenizeError):
        t.completion({"prompt": [-1]})


# -- against fake backends ----------------------------------------------------------------------


def test_kv_aware_routes_to_prefix_holder(fleet) -> None:
    backs, pubs, _ = fleet
    with contextlib.closing(_router(backs, pubs)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        # b (second in order, so not the default) announces the document.
        pubs[1].publish([_stored(DOC, salt=42)])
        wait_until(lambda: _blocks(r, "b") == 8)
        for i in range(6):  # with load between: still the holder
            resp = _complete(c, DOC + [i, i + 1])
            assert resp.status_code == 200
            assert resp.json()["backend"] == "b"
            assert resp.headers["x-kvtier-route-reason"] == "prefix"
            assert int(resp.headers["x-kvtier-predicted-hit-tokens"]) == 8 * BS
        assert len(backs[1].requests) == 6 and not backs[0].requests
        # A prompt sharing nothing is not pulled to b.
        first = _complete(c, [3] * 40).json()["backend"]
        assert first == "a"
        state = c.get("/router/state").json()
        assert state["decisions"][-1]["reason"] != "prefix"
        text = c.get("/metrics").text
        assert 'kvtier_router_decisions_total{policy="kv-aware",reason="prefix"} 6.0' in text
        assert f'kvtier_router_predicted_hit_tokens_total{{backend="b"}} {6 * 8 * BS}.0' in text


@pytest.mark.slow
def test_paced_no_reuse_requests_spread(fleet) -> None:
    backs, pubs, _ = fleet
    with contextlib.closing(_router(backs, pubs)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        seen = Counter()
        for i in range(40):
            resp = _complete(c, [10_000 + i] * (BS + i))  # distinct prompts, no reuse
            seen[resp.json()["backend"]] += 1
            time.sleep(0.01)  # paced: nothing in flight when the next arrives
        assert seen["a"] + seen["b"] == 40
        assert max(seen["a"], seen["b"]) <= 1.5 * min(seen["a"], seen["b"]), seen
        # And the backends saw exactly that.
        assert (len(backs[0].requests), len(backs[1].requests)) == (seen["a"], seen["b"])


@pytest.mark.slow
def test_dead_backend_skipped_and_returns(fleet) -> None:
    backs, pubs, _ = fleet
    with contextlib.closing(_router(backs, pubs)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        pubs[0].publish([_stored(DOC, salt=3)])
        wait_until(lambda: _blocks(r, "a") == 8)
        backs[0].stop()
        t0 = time.monotonic()
        # Requests right away: never hang, never fail (retried on b), even for a's prefix.
        for i in range(5):
            t = time.monotonic()
            resp = _complete(c, DOC + [i])
            assert time.monotonic() - t < 3.0
            assert resp.status_code == 200 and resp.json()["backend"] == "b"
        wait_until(lambda: not r.router.pool.by_name["a"].healthy, timeout_s=2.0 - (time.monotonic() - t0) + 0.5)
        assert _blocks(r, "a") == 0  # its routes were dropped with it
        assert c.get("/router/state").json()["backends"]["a"]["healthy"] is False
        # Recovery: it comes back and gets traffic again.
        backs[0].start()
        wait_until(lambda: r.router.pool.by_name["a"].healthy, timeout_s=3.0)
        got = Counter(_complete(c, [20_000 + i] * BS).json()["backend"] for i in range(6))
        assert got["a"] >= 2, got


@pytest.mark.slow
def test_hung_backend_does_not_hang_requests(fleet) -> None:
    backs, pubs, _ = fleet
    with contextlib.closing(_router(backs, pubs)) as r, httpx.Client(base_url=r.url, timeout=15) as c:
        pubs[0].publish([_stored(DOC, salt=3)])
        wait_until(lambda: _blocks(r, "a") == 8)
        backs[0].hang = True  # accepts connections, answers nothing (health included)
        t = time.monotonic()
        resp = _complete(c, DOC + [1])  # routed to a by prefix, a hangs: retried on b once a leaves
        elapsed = time.monotonic() - t
        assert resp.status_code == 200 and resp.json()["backend"] == "b"
        assert elapsed < 6.0, elapsed
        assert not r.router.pool.by_name["a"].healthy
        backs[0].hang = False


@pytest.mark.slow
@pytest.mark.parametrize("how", ["clear", "publisher-restart", "backend-restart"])
def test_no_stale_routes_after_clear_or_restart(fleet, how: str) -> None:
    backs, pubs, _ = fleet
    with contextlib.closing(_router(backs, pubs)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        pubs[1].publish([_stored(DOC, salt=5)])
        wait_until(lambda: _blocks(r, "b") == 8)
        assert _complete(c, DOC + [0]).headers["x-kvtier-route-reason"] == "prefix"
        if how == "clear":
            pubs[1].publish([AllBlocksCleared()])
        elif how == "publisher-restart":  # same endpoint, seq starts over, other blocks
            endpoint = pubs[1].endpoint
            pubs[1].close()
            pubs[1] = EventPublisher(endpoint)

            def restarted_and_seen() -> bool:  # publish until the reconnected subscriber delivers it
                pubs[1].publish([_stored([9] * BS, salt=6)])
                return _blocks(r, "b") == 1

            wait_until(restarted_and_seen, 10, "the restarted publisher's block indexed, the old ones dropped")
        else:  # the server restarts (new process start time, empty cache), quickly
            backs[1].stop()
            backs[1].start()
        wait_until(lambda: _blocks(r, "b") == (1 if how == "publisher-restart" else 0), 10, "b's stale blocks dropped")
        stale = 0
        for i in range(10):
            resp = _complete(c, DOC + [i])
            assert resp.status_code == 200
            stale += int(resp.headers["x-kvtier-predicted-hit-tokens"]) > 0
        assert stale == 0
        assert _blocks(r, "b") == (1 if how == "publisher-restart" else 0)


def test_streaming_passes_chunks_in_order(fleet) -> None:
    backs, pubs, _ = fleet
    with contextlib.closing(_router(backs, pubs)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": [1, 2, 3], "stream": True}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert [e["i"] for e in events] == list(range(5))
        assert len({e["backend"] for e in events}) == 1


def test_chat_uses_template_tokens(fleet) -> None:
    backs, pubs, _ = fleet
    tok = _FakeTok()
    msgs = [{"role": "system", "content": "x" * (4 * BS)}, {"role": "user", "content": "hello"}]
    rendered = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    with contextlib.closing(_router(backs, pubs, tokenizer=tok)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        n = len(rendered) // BS * BS
        pubs[1].publish([_stored(rendered[:n], salt=8)])
        wait_until(lambda: _blocks(r, "b") == n // BS)
        resp = c.post("/v1/chat/completions", json={"model": "fake", "messages": msgs})
        assert resp.json()["backend"] == "b"
        assert int(resp.headers["x-kvtier-predicted-hit-tokens"]) == n
        assert c.get("/v1/models").json()["data"][0]["id"] == "fake"


@pytest.mark.slow
def test_round_robin_and_least_loaded(fleet) -> None:
    backs, pubs, _ = fleet
    with contextlib.closing(_router(backs, pubs, policy="round-robin")) as r, \
            httpx.Client(base_url=r.url, timeout=10) as c:
        pubs[1].publish([_stored(DOC, salt=1)])
        wait_until(lambda: _blocks(r, "b") == 8)
        order = [_complete(c, DOC).json()["backend"] for _ in range(6)]
        assert order == ["a", "b"] * 3  # the prefix does not matter
    backs[0].delay_s = 1.0  # a is slow: its requests stay in flight
    with contextlib.closing(_router(backs, None, policy="least-loaded")) as r, \
            httpx.Client(base_url=r.url, timeout=10) as c:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(4) as ex:
            first = ex.submit(_complete, c, [1] * 64)
            wait_until(lambda: backs[0].running >= 1, 10, "the first request in flight at a")
            rest = [ex.submit(_complete, c, [2] * 64) for _ in range(3)]
            names = [first.result().json()["backend"]] + [f.result().json()["backend"] for f in rest]
        assert names[0] == "a"  # tie -> first configured
        assert Counter(names[1:])["b"] >= 2  # a is loaded: the others go to b


def test_no_healthy_backend_is_503_quickly(tmp_path: Path) -> None:
    dead = BackendSpec(url=f"http://127.0.0.1:{free_port()}", instance_id="dead")
    with contextlib.closing(RouterServer(RouterConfig(backends=(dead,)), port=0).start()) as r, \
            httpx.Client(base_url=r.url, timeout=10) as c:
        t = time.monotonic()
        assert _complete(c, [1, 2]).status_code == 503
        assert time.monotonic() - t < 2.0
        assert c.get("/health").status_code == 503


def test_controller_lookup_counts_kvtier_tiers(fleet) -> None:
    """kvtier-tier hits known only to the fleet controller (no events) also route."""
    backs, _, _ = fleet
    seen: list[bytes] = []
    ctl = FastAPI()

    @ctl.post("/lookup")
    async def lookup(request: Request) -> dict[str, Any]:
        body = await request.body()
        seen.append(body)
        n = len(body) // 4
        return {"instances": {"a": {"longest_matched": 0, "CPU": 0, "DISK": 0, "REMOTE": 0, "pinned": 0},
                              "b": {"longest_matched": n - 1, "CPU": 0, "DISK": n - 1, "REMOTE": 0, "pinned": 0}}}

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(ctl, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    wait_until(lambda: srv.started)
    try:
        with contextlib.closing(_router(backs, None, controller_url=f"http://127.0.0.1:{port}")) as r, \
                httpx.Client(base_url=r.url, timeout=10) as c:
            resp = _complete(c, DOC)
            assert resp.json()["backend"] == "b" and resp.headers["x-kvtier-route-reason"] == "prefix"
            assert int(resp.headers["x-kvtier-predicted-hit-tokens"]) == len(DOC) - 1
            assert seen[-1] == b"".join(t.to_bytes(4, "little") for t in DOC)  # binary lookup body
            cand = c.get("/router/state").json()["decisions"][-1]["candidates"][0]
            assert cand["per_tier"] == {"controller_disk": len(DOC) - 1}
    finally:
        srv.should_exit = True
        th.join(10)


def test_backend_whose_events_never_arrive_is_reported_silent(fleet, caplog) -> None:
    """The silent-0% failure: a backend publishes nowhere the router listens (vLLM *connects*
    its publisher for tcp://HOST:PORT). The router serves on, but says so: events_silent in
    /router/state and one WARNING, while a backend whose events arrive is not flagged."""
    backs, pubs, tmp_path = fleet
    specs = (BackendSpec(url=backs[0].url, instance_id="a", events=f"ipc://{tmp_path}/nobody.sock"),
             BackendSpec(url=backs[1].url, instance_id="b", events=pubs[1].endpoint))
    cfg = RouterConfig(backends=specs, policy="round-robin")
    with contextlib.closing(RouterServer(cfg, port=0).start()) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        pubs[1].publish([_stored(DOC, salt=7)])
        wait_until(lambda: _blocks(r, "b") == 8)
        with caplog.at_level("WARNING", logger="kvtier.router"):
            for i in range(2 * r.router.SILENT_AFTER_REQUESTS):
                assert _complete(c, [5, i]).status_code == 200
        state = c.get("/router/state").json()["backends"]
        assert state["a"]["events_silent"] is True and state["a"]["served"] == r.router.SILENT_AFTER_REQUESTS
        assert state["b"]["events_silent"] is False
        warnings = [m for m in caplog.messages if "no KV events from a" in m]
        assert len(warnings) == 1 and "tcp://*:PORT" in warnings[0]
