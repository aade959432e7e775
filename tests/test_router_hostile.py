"""kvtier router against hostile input (issue 24, kind 6): misleading KV events, salted prompts,
oversized bodies and prompts, slow tokenization, huge answers, cut streams, token on argv.

Every test runs the real router (uvicorn on a free loopback port) in front of the fake vLLM
backends of ``test_router`` and fails on the behaviour issue 24 found.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from conftest import free_port, http_status, wait_until
from test_router import BS, DOC, FakeBackend, _blocks, _complete, _router, _stored

from kvtier.events.codec import make_batch
from kvtier.events.publisher import EventPublisher
from kvtier.events.schema import BlockRemoved, BlockStored
from kvtier.router.config import Weights
from kvtier.router.prefix_index import PrefixIndex, chain_keys, index_medium


@pytest.fixture()
def fleet(tmp_path):
    backs = [FakeBackend("a").start(), FakeBackend("b").start()]
    pubs = [EventPublisher(f"ipc://{tmp_path}/ev{i}.sock") for i in range(2)]
    yield backs, pubs, tmp_path
    for b in backs:
        b.stop()
    for p in pubs:
        p.close()


# -- media: an unknown name never outranks a known tier ------------------------------------------


def test_media_names_of_vllm_and_kvtier_and_unknown_ones() -> None:
    assert [index_medium(m) for m in (None, "GPU", "cpu", "STORAGE", "DISK", "REMOTE")] == \
        ["GPU", "GPU", "CPU", "DISK", "DISK", "REMOTE"]
    assert index_medium("STORAGE", "REMOTE") == index_medium("CPU", "REMOTE") == "REMOTE"
    assert index_medium("GPU", "REMOTE") == "GPU"  # the engine's own blocks are local by definition
    assert index_medium("STORAGE", "LOCAL") == "DISK"
    for bad in ("HBM", "NVME", "", "gpu2"):
        assert index_medium(bad) is None
    w = Weights()
    assert w.medium("HBM") == 0.0 < w.remote  # weighs least
    assert w.medium("STORAGE") == w.disk and w.medium(None) == w.gpu


def test_unknown_medium_is_not_indexed_but_links_the_chain() -> None:
    idx = PrefixIndex(["a"])
    half = 4 * BS
    idx.apply("a", make_batch([_stored(DOC[:half], salt=1, medium="HBM_X")]))
    keys = chain_keys(DOC, BS)
    assert idx.match("a", keys, BS).tokens == 0  # not weighed like an engine block
    assert idx.stats()["a"]["unknown_medium"] == 4 and idx.stats()["a"]["stored"] == 0
    # A GPU store whose parent is the unknown-medium block still keys right (the hash linked).
    idx.apply("a", make_batch([_stored(DOC[half:], salt=1, parent=1_000_003 + 4)]))
    assert idx.stats()["a"]["orphans"] == 0
    # Removing an unknown medium removes nothing known.
    idx.apply("a", make_batch([_stored(DOC[:half], salt=1, medium="CPU")]))
    idx.apply("a", make_batch([BlockRemoved(block_hashes=[1_000_003 + 1], medium="HBM_X")]))
    assert idx.match("a", keys, BS).tokens == 8 * BS


def test_unknown_medium_does_not_outrank_a_known_tier(fleet) -> None:
    backs, pubs, _ = fleet
    with contextlib.closing(_router(backs, pubs)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        pubs[0].publish([_stored(DOC, salt=3, medium="STORAGE")])  # a holds it on disk (vLLM's name)
        pubs[1].publish([_stored(DOC, salt=4, medium="HBM_FANCY")])  # b claims a tier nobody knows
        wait_until(lambda: r.router.feeds["b"].batches == 1 and _blocks(r, "a") == 8)
        resp = _complete(c, DOC)
        assert resp.json()["backend"] == "a" and resp.headers["x-kvtier-route-reason"] == "prefix"
        cands = c.get("/router/state").json()["decisions"][-1]["candidates"]
        assert {x["backend"]: x["hit_tokens"] for x in cands} == {"a": 8 * BS, "b": 0}


# -- salted prompts: keyed the way the engine keys them --------------------------------------------


def _vllm_extra_keys(salt: str, blocks: int) -> list[Any] | None:
    """The per-block ``extra_keys`` vLLM 0.32 publishes for a request salted ``salt`` (its own code)."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.kv_events import _extra_keys

    req = SimpleNamespace(cache_salt=salt, lora_request=None, mm_features=[], prompt_embeds=None)
    return _extra_keys(req, 0, BS, blocks)


def test_salted_prompt_routes_to_the_holder_of_its_salt(fleet) -> None:
    backs, pubs, _ = fleet
    ev = _stored(DOC, salt=9)
    ev = BlockStored(**{f: getattr(ev, f) for f in ev.__struct_fields__ if f != "extra_keys"},
                     extra_keys=_vllm_extra_keys("tenant-1", len(DOC) // BS))
    assert ev.extra_keys is not None and ev.extra_keys[0] == ("tenant-1",)
    with contextlib.closing(_router(backs, pubs)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        pubs[1].publish([ev])  # b holds DOC under tenant-1's salt
        wait_until(lambda: _blocks(r, "b") == 8)
        resp = _complete(c, DOC, cache_salt="tenant-1")
        assert resp.json()["backend"] == "b" and resp.headers["x-kvtier-route-reason"] == "prefix"
        assert int(resp.headers["x-kvtier-predicted-hit-tokens"]) == 8 * BS
        for other in ({}, {"cache_salt": "tenant-2"}):  # another tenant (or none) never matches it
            resp = _complete(c, DOC, **other)
            assert resp.headers["x-kvtier-predicted-hit-tokens"] == "0", other
        assert backs[1].requests[0]["cache_salt"] == "tenant-1"  # forwarded unchanged


def test_salted_controller_lookup_asks_within_the_salt(fleet) -> None:
    backs, _, _ = fleet
    asked: list[str | None] = []
    ctl = FastAPI()

    @ctl.post("/lookup")
    async def lookup(request: Request) -> dict[str, Any]:
        salt = request.query_params.get("cache_salt")
        asked.append(salt)
        n = len(await request.body()) // 4 if salt == "t1" else 0
        return {"instances": {"a": {"longest_matched": 0, "CPU": 0},
                              "b": {"longest_matched": n, "CPU": n}}}

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(ctl, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    wait_until(lambda: srv.started)
    try:
        with contextlib.closing(_router(backs, None, controller_url=f"http://127.0.0.1:{port}")) as r, \
                httpx.Client(base_url=r.url, timeout=10) as c:
            got = _complete(c, DOC, cache_salt="t1")
            assert got.json()["backend"] == "b", (r.router.controller_last_error, asked)
            assert _complete(c, DOC).headers["x-kvtier-predicted-hit-tokens"] == "0"
        assert asked == ["t1", None]
    finally:
        srv.should_exit = True
        th.join(10)


# -- the controller token never needs argv -------------------------------------------------------


def test_controller_token_from_file_or_env_not_only_argv(tmp_path, monkeypatch, caplog) -> None:
    from typer.testing import CliRunner

    import kvtier.router.server as server_mod
    from kvtier.cli import app
    from kvtier.router.config import RouterConfigError, controller_token_from

    started: list[Any] = []

    class NoServe:
        url = "http://x"

        def __init__(self, cfg: Any, host: str, port: int) -> None:
            started.append(cfg)

        def serve_forever(self) -> None:
            return

    monkeypatch.setattr(server_mod, "RouterServer", NoServe)  # the CLI imports it from there
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    f.chmod(0o600)
    args = ["router", "--backend", "http://127.0.0.1:1", "--controller", "http://127.0.0.1:2"]
    monkeypatch.setenv("KVTIER_CONTROLLER_TOKEN", "from-env")
    assert CliRunner().invoke(app, args).exit_code == 0
    assert CliRunner().invoke(app, args + ["--controller-token-file", str(f)]).exit_code == 0
    monkeypatch.delenv("KVTIER_CONTROLLER_TOKEN")
    assert CliRunner().invoke(app, args).exit_code == 0
    assert [c.controller_token for c in started] == ["from-env", "from-file", None]
    (tmp_path / "empty").write_text("\n")
    res = CliRunner().invoke(app, args + ["--controller-token-file", str(tmp_path / "empty")])
    assert res.exit_code == 2 and "is empty" in res.output
    with caplog.at_level("WARNING", logger="kvtier.router"):
        assert controller_token_from("on-argv", None, {}) == "on-argv"
    assert any("visible to every user" in m for m in caplog.messages)
    with pytest.raises(RouterConfigError):
        controller_token_from("a", f, {})


# -- KV event frames are bounded -----------------------------------------------------------------


@pytest.mark.slow
def test_event_frames_beyond_the_bound_are_never_read(fleet) -> None:
    import zmq

    from kvtier.events.codec import encode_batch

    backs, _, tmp_path = fleet
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    endpoint = f"ipc://{tmp_path}/raw.sock"
    raw.bind(endpoint)
    big_tokens = [70_000] * (40_000 * BS)  # 0.64M token ids of 5 bytes: a 3.4 MB frame
    big = encode_batch(make_batch([_stored(big_tokens, salt=5)]))
    small = encode_batch(make_batch([_stored(DOC, salt=6)]))
    assert len(big) > 1 << 20 > len(small)
    from kvtier.router.config import BackendSpec, RouterConfig
    from kvtier.router.server import RouterServer

    cfg = RouterConfig(backends=(BackendSpec(url=backs[0].url, instance_id="a", events=endpoint),),
                       events_max_message_bytes=1 << 20)
    try:
        with contextlib.closing(RouterServer(cfg, port=0).start()) as r:
            seq = 0

            def send(payload: bytes) -> None:
                nonlocal seq
                raw.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                seq += 1

            feed = r.router.feeds["a"]
            for _ in range(250):  # bounded: until the subscriber has joined
                send(small)
                if feed.batches:
                    break
                threading.Event().wait(0.02)
            wait_until(lambda: feed.batches >= 1)
            n = -1
            while n != feed.batches:  # nothing more in flight
                n = feed.batches
                threading.Event().wait(0.3)
            send(big)
            for _ in range(250):  # two batches read after the big one's seq: it was read or dropped
                send(small)
                if feed.batches >= n + 2:
                    break
                threading.Event().wait(0.02)
            assert feed.batches >= n + 2 and feed.stats()["disconnects"] >= 1  # cut, then read again
            st = r.router.index.stats()["a"]
            # every batch applied was a small one: the big frame never reached the index
            assert st["stored"] == 8 * r.router.feeds["a"].batches, st
            assert r.router.index.match("a", chain_keys(big_tokens[: 4 * BS], BS), BS).tokens == 0
    finally:
        raw.close(linger=0)
        ctx.term()


# -- answers pass through as they come; a cut is a cut -------------------------------------------


class AppBackend:
    """A backend serving ``app`` (plus /health and /metrics) on a free loopback port."""

    def __init__(self, app: FastAPI) -> None:
        from fastapi.responses import PlainTextResponse, Response

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse("vllm:num_requests_running 0\n")

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                                   lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10)
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = "x"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _router_over(*backs: AppBackend):
    from kvtier.router.config import BackendSpec, RouterConfig
    from kvtier.router.server import RouterServer

    cfg = RouterConfig(backends=tuple(BackendSpec(url=b.url) for b in backs), policy="round-robin")
    return RouterServer(cfg, port=0).start()


def test_non_streamed_answer_is_passed_through_not_held_whole() -> None:
    from fastapi.responses import StreamingResponse

    release = threading.Event()
    app = FastAPI()
    part = b'{"choices": [{"text": "' + b"x" * 65536

    @app.post("/v1/completions")
    async def complete() -> Any:
        async def gen():
            yield part
            while not release.is_set():  # the rest only once the client has the first part
                await __import__("asyncio").sleep(0.01)
            yield b'"}]}'
        return StreamingResponse(gen(), media_type="application/json")

    back = AppBackend(app)
    try:
        with contextlib.closing(_router_over(back)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}) as resp:
                got = b""
                chunks = resp.iter_raw()
                while len(got) < len(part):  # fails by read timeout when the router holds the answer
                    got += next(chunks)
                release.set()
                got += b"".join(chunks)
            assert got == part + b'"}]}' and resp.status_code == 200
    finally:
        release.set()
        back.stop()


def _cutting_app(stream: bool) -> FastAPI:
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def complete() -> Any:
        async def gen():
            if stream:
                yield b'data: {"i": 0}\n\n'
                yield b'data: {"i": 1}\n\n'
            else:
                yield b'{"choices": [{"text": "half'
            await __import__("asyncio").sleep(0.05)
            raise RuntimeError("backend died mid-answer")  # uvicorn closes the connection mid-body
        headers = {} if stream else {"content-length": "4000"}
        return StreamingResponse(gen(), media_type="text/event-stream" if stream else "application/json",
                                 headers=headers)

    return app


@pytest.mark.slow
@pytest.mark.parametrize("via", ["router", "pd-proxy"])
def test_stream_cut_by_the_backend_reaches_the_client_as_an_error(via: str) -> None:
    from kvtier.router.pd_proxy import PDProxyServer

    back = AppBackend(_cutting_app(stream=True))
    front = _router_over(back) if via == "router" else PDProxyServer([back.url], [back.url], port=0).start()
    try:
        lines: list[str] = []
        with contextlib.closing(front), httpx.Client(base_url=front.url, timeout=10) as c:
            with pytest.raises(httpx.RemoteProtocolError):  # incomplete body: never a clean end
                with c.stream("POST", "/v1/completions", json={"prompt": [1], "stream": True}) as resp:
                    for line in resp.iter_lines():
                        lines.append(line)
        data = [x for x in lines if x.startswith("data: ")]
        assert data[:2] == ['data: {"i": 0}', 'data: {"i": 1}'], lines
        assert "error" in data[-1] and "cut" in data[-1] and "[DONE]" not in "".join(lines)
    finally:
        back.stop()


def test_non_streamed_answer_cut_by_the_backend_is_never_a_clean_finish() -> None:
    back = AppBackend(_cutting_app(stream=False))
    try:
        with contextlib.closing(_router_over(back)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                c.post("/v1/completions", json={"prompt": [1]})
            assert r.router.metrics.cut.labels(r.router.pool.backends[0].name)._value.get() == 1
    finally:
        back.stop()


# -- bodies, prompt lengths and the work a request makes the router do ---------------------------


class _CharTok:
    """One token per character; records every text it encodes; blocks on texts longer than
    ``block_over`` characters until ``release`` is set (a slow tokenization, made deterministic)."""

    def __init__(self, block_over: int | None = None) -> None:
        self.encoded: list[int] = []
        self.block_over = block_over
        self.release = threading.Event()
        self.blocked = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        if self.block_over is not None and len(text) > self.block_over:
            self.blocked += 1
            assert self.release.wait(30), "never released"
        return [ord(c) % 50_000 for c in text]

    def apply_chat_template(self, conv: Any, **kw: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in conv)


def test_body_beyond_the_bound_is_413_before_it_is_read(fleet) -> None:
    backs, _, _ = fleet
    with contextlib.closing(_router(backs, None, max_body_bytes=1 << 20)) as r, \
            httpx.Client(base_url=r.url, timeout=10) as c:
        big = b'{"prompt": [' + b"1," * (600 << 10) + b'1]}'
        resp = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert resp.status_code == 413 and "limit of 1048576 bytes" in resp.json()["error"]["message"]

        def chunked():  # no Content-Length: refused once the bytes received pass the bound
            for _ in range(40):
                yield b" " * (64 << 10)

        resp = c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert resp.status_code == 413
        assert not backs[0].requests and not backs[1].requests
        assert _complete(c, [1, 2, 3]).status_code == 200  # an ordinary one still goes through


def test_prompt_beyond_the_context_is_400_and_costs_a_bounded_tokenization(fleet) -> None:
    backs, _, _ = fleet
    tok = _CharTok()
    with contextlib.closing(_router(backs, None, tokenizer=tok, max_prompt_tokens=1000)) as r, \
            httpx.Client(base_url=r.url, timeout=30) as c:
        resp = _complete(c, list(range(1001)))  # token ids: counted
        assert resp.status_code == 400 and "1001 tokens" in resp.json()["error"]["message"]
        assert "context of 1000" in resp.json()["error"]["message"]
        assert _complete(c, list(range(1000))).status_code == 200
        resp = _complete(c, "x" * 3_000_000)  # a 3 MB text prompt
        assert resp.status_code == 400 and "at least" in resp.json()["error"]["message"]
        assert sum(tok.encoded) <= 16 * 1001, tok.encoded  # a few prefixes, never the 3 MB
        tok.encoded.clear()
        chat = {"messages": [{"role": "user", "content": "y" * 3_000_000}]}
        resp = c.post("/v1/chat/completions", json=chat)
        assert resp.status_code == 400 and sum(tok.encoded) <= 16 * 1001
        assert _complete(c, "z" * 990).status_code == 200
        assert len(backs[0].requests) + len(backs[1].requests) == 2  # only the two that fit
        text = c.get("/metrics").text
        assert 'kvtier_router_refused_total{status="400"} 3.0' in text


def test_context_is_learned_from_the_backends_max_model_len() -> None:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "m", "max_model_len": 64}]}

    @app.post("/v1/completions")
    async def complete() -> dict[str, Any]:
        return {"choices": [{"text": "ok"}]}

    back = AppBackend(app)
    try:
        with contextlib.closing(_router_over(back)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
            assert r.router.max_prompt_tokens == 64
            assert c.post("/v1/completions", json={"prompt": [1] * 65}).status_code == 400
            assert c.post("/v1/completions", json={"prompt": [1] * 64}).status_code == 200
    finally:
        back.stop()


def test_request_template_is_never_run_by_the_router(fleet) -> None:
    backs, _, _ = fleet
    calls: list[dict[str, Any]] = []

    class Tok(_CharTok):
        def apply_chat_template(self, conv: Any, **kw: Any) -> str:
            calls.append(kw)
            return super().apply_chat_template(conv, **kw)

    with contextlib.closing(_router(backs, None, tokenizer=Tok())) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        loop = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
        msg = [{"role": "user", "content": "hi"}]
        for body in ({"messages": msg, "chat_template": loop},
                     {"messages": msg, "chat_template_kwargs": {"chat_template": loop}},
                     {"messages": msg, "chat_template_kwargs": "not an object"}):
            assert c.post("/v1/chat/completions", json=body).status_code == 200  # forwarded, routed on load
        assert calls == []
        assert c.post("/v1/chat/completions", json={"messages": msg}).status_code == 200 and len(calls) == 1


def test_big_bodies_are_parsed_off_the_event_loop(fleet, monkeypatch) -> None:
    import json as json_mod

    import kvtier.router.request_body as rb

    backs, _, _ = fleet
    release = threading.Event()
    parsing = threading.Event()
    real_decoder, real_loads = rb._DECODER, json_mod.loads

    def slow(decode):
        def run(data, *a, **kw):
            if len(data) > 1 << 20:
                parsing.set()
                assert release.wait(30)
            return decode(data, *a, **kw)
        return run

    class SlowDecoder:
        decode = staticmethod(slow(real_decoder.decode))

    monkeypatch.setattr(rb, "_DECODER", SlowDecoder())
    monkeypatch.setattr(json_mod, "loads", slow(real_loads))  # whichever parser the router uses
    with contextlib.closing(_router(backs, None)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        big = json_mod.dumps({"prompt": [1] * (1 << 20)}).encode()  # ~3 MB of token ids
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(c.post("/v1/completions", content=big).status_code))
        t.start()
        assert parsing.wait(10)
        with httpx.Client(base_url=r.url, timeout=5) as c2:  # the loop still serves others meanwhile
            assert c2.get("/health").status_code == 200
            assert _complete(c2, [1, 2]).status_code == 200
        release.set()
        t.join(30)
        assert out == [200]


@pytest.mark.slow
def test_large_prompts_never_make_small_ones_wait(fleet) -> None:
    """Six 3 MB prompts whose tokenization does not end (until released) and ordinary 8 KiB
    prompts: the small ones are served meanwhile (a lane of their own), the large ones queue
    within the client's bound, and a client beyond its bound gets 429 at once."""
    import concurrent.futures as cf

    backs, _, _ = fleet
    tok = _CharTok(block_over=100_000)
    with contextlib.closing(_router(backs, None, tokenizer=tok)) as r, httpx.Client(base_url=r.url, timeout=60) as c:
        with cf.ThreadPoolExecutor(8) as ex:
            big = [ex.submit(_complete, c, "w" * 3_000_000) for _ in range(6)]
            wait_until(lambda: tok.blocked >= 2, 20)
            with httpx.Client(base_url=r.url, timeout=10) as c2:
                for i in range(5):  # fails by read timeout when a small prompt waits behind a large one
                    assert _complete(c2, "s" * 8192 + str(i)).status_code == 200
                r.router.admission._large.per_client_queue = 4  # a smaller queue, to see its bound
                wait_until(lambda: r.router.admission._large.clients.get("127.0.0.1") is not None
                      and r.router.admission._large.clients["127.0.0.1"].users == 6, 20)
                resp = _complete(c2, "v" * 200_000)
                assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
            tok.release.set()
            assert [f.result().status_code for f in big] == [200] * 6
        assert r.router.admission._large.clients == {}  # nothing left behind


# -- a keyed kvtier event stream: the router reads it with its fleet key -------------------------


@pytest.mark.slow
def test_router_reads_a_keyed_event_stream_with_its_fleet_key(tmp_path) -> None:
    from kvtier.router.config import BackendSpec, RouterConfig
    from kvtier.router.server import RouterServer
    from kvtier.testing.fleet_keys import make_fleet

    back = FakeBackend("srv").start()
    fleet = make_fleet(tmp_path / "keys", ["srv", "router", "reader"],
                       {"router": "roles=events", "reader": "roles=peer"})
    pub = EventPublisher("tcp://127.0.0.1:0", credentials=fleet.credentials("srv"), topic="")
    spec = BackendSpec(url=back.url, instance_id="srv", events=pub.endpoint)
    keyed = RouterConfig(backends=(spec,), fleet_key=str(fleet.key_path("router")),
                         fleet_members=str(fleet.members_path))
    no_role = RouterConfig(backends=(spec,), fleet_key=str(fleet.key_path("reader")),
                           fleet_members=str(fleet.members_path))
    plain = RouterConfig(backends=(spec,))
    routers = [RouterServer(cfg, port=0).start() for cfg in (keyed, plain, no_role)]
    try:
        assert [r.router.feeds["srv"].stats()["curve"] for r in routers] == [True, False, True]
        for _ in range(200):  # bounded: until the keyed router has joined
            pub.publish([_stored(DOC, salt=2)])
            if routers[0].router.feeds["srv"].batches:
                break
            threading.Event().wait(0.02)
        assert _blocks(routers[0], "srv") == 8
        for _ in range(25):
            pub.publish([_stored(DOC, salt=2)])
            threading.Event().wait(0.02)
        assert [r.router.feeds["srv"].batches for r in routers[1:]] == [0, 0]  # a plain SUB, a non-reader
    finally:
        for r in routers:
            r.close()
        pub.close()
        back.stop()
    with pytest.raises(Exception, match="go together"):
        RouterConfig(backends=(spec,), fleet_key=str(fleet.key_path("router"))).validate()


def test_a_burst_of_ordinary_requests_from_one_client_is_queued_not_refused(fleet) -> None:
    """A benchmark's 48 concurrent small prompts from one address wait their turn (2 tokenize at once)."""
    import concurrent.futures as cf

    backs, _, _ = fleet
    tok = _CharTok(block_over=8)  # every prompt's tokenization waits until released
    with contextlib.closing(_router(backs, None, tokenizer=tok)) as r, httpx.Client(base_url=r.url, timeout=60) as c:
        with cf.ThreadPoolExecutor(48) as ex:
            futs = [ex.submit(_complete, c, f"prompt number {i}") for i in range(48)]
            wait_until(lambda: r.router.admission._small.clients.get("127.0.0.1") is not None
                  and r.router.admission._small.clients["127.0.0.1"].users == 48, 30)
            assert tok.blocked == 2  # the client's bound: two at once
            tok.release.set()
            assert [f.result().status_code for f in futs] == [200] * 48


def test_a_tokenizer_that_chokes_routes_on_load_never_500(fleet) -> None:
    backs, _, _ = fleet

    class Choking(_CharTok):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise OverflowError("tokenizer internal error")

    with contextlib.closing(_router(backs, None, tokenizer=Choking())) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        assert _complete(c, "any text").status_code == 200
        assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 200
        assert 'kvtier_router_untokenized_total 2.0' in c.get("/metrics").text


def _stalled_bodies(url: str, n: int, declared: int, sent: int) -> list[Any]:
    """``n`` connections that each declare ``declared`` body bytes, send ``sent`` of them and stall."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    socks = []
    for _ in range(n):
        s = socket.create_connection((u.hostname, u.port), timeout=10)
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {declared}\r\n\r\n").encode() + b" " * sent)
        socks.append(s)
    return socks


def test_stalled_large_bodies_hold_a_bounded_total_and_time_out(fleet) -> None:
    """Hostile trial (December 7): connections declaring 16 MB that stall before the last bytes held
    ~15.6 MB each without end (60: RSS 79 -> 1,022 MB). Bodies still arriving hold at most
    ``max_reading_bytes`` together (beyond: 503), and each must arrive within ``body_timeout_s`` (408)."""
    backs, _, _ = fleet
    with contextlib.closing(_router(backs, None, max_body_bytes=4 << 20)) as r, \
            httpx.Client(base_url=r.url, timeout=10) as c:
        adm = r.router.admission
        adm.max_reading_bytes = 3 << 20  # three 1 MiB stalled bodies fit
        adm.body_timeout_s = 2.0
        held = _stalled_bodies(r.url, 3, 4 << 20, 1 << 20)
        try:
            wait_until(lambda: adm.reading_bytes >= 3 << 20, 10, "three stalled bodies counted")
            late = _stalled_bodies(r.url, 1, 4 << 20, 1 << 20)[0]
            assert http_status(late) == 503  # the fourth would pass the total: refused, not held
            late.close()
            assert adm.reading_bytes <= adm.max_reading_bytes
            assert _complete(c, [1, 2, 3]).status_code == 200  # a small request is never counted
            assert [http_status(s) for s in held] == [408] * 3  # the stalled ones time out
            wait_until(lambda: adm.reading_bytes == 0, 10, "every stalled body released")
        finally:
            for s in held:
                s.close()
        assert len(backs[0].requests) + len(backs[1].requests) == 1  # only the small completion
