"""``kvtier pd-proxy`` (kvtier/router/pd_proxy.py) against fake prefill and decode backends."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from conftest import free_port
from kvtier.router.pd_proxy import PDProxyServer, prefill_body

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r1",
          "remote_host": "127.0.0.1", "remote_port": 5999, "remote_block_ids": [3, 4]}


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "backend did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        t.join(10)
        sock.close()


def backends(seen: list[dict[str, Any]], prefill_status: int = 200) -> tuple[FastAPI, FastAPI]:
    pre, dec = FastAPI(), FastAPI()

    @pre.post("/v1/completions")
    async def p(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append({"leg": "prefill", **body})
        return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}, status_code=prefill_status)

    @dec.post("/v1/completions")
    async def d(request: Request) -> Any:
        body = await request.json()
        seen.append({"leg": "decode", **body})
        if body.get("stream"):
            async def gen() -> Any:
                for i in range(3):
                    yield f"data: {json.dumps({'i': i})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "decoded"}]})

    return pre, dec


def test_prefill_leg_then_decode_with_returned_params() -> None:
    seen: list[dict[str, Any]] = []
    pre, dec = backends(seen)
    with serve(pre) as purl, serve(dec) as durl, PDProxyServer([purl], [durl], port=0) as proxy:
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 20}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        assert r.headers["x-kvtier-prefill"] == purl
        with httpx.stream("POST", proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                                        "stream": True}, timeout=30) as s:
            events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and len(events) == 4
    legs = [(x["leg"], x["max_tokens"], x.get("stream"), x["kv_transfer_params"]) for x in seen]
    assert legs[0] == ("prefill", 1, False, {"do_remote_decode": True, "do_remote_prefill": False})
    assert legs[1] == ("decode", 20, None, PARAMS)
    assert legs[2][:3] == ("prefill", 1, False) and legs[3] == ("decode", 5, True, PARAMS)


def test_failed_prefiller_is_skipped_and_dead_decoder_is_502() -> None:
    seen: list[dict[str, Any]] = []
    pre, dec = backends(seen, prefill_status=500)
    with serve(pre) as purl, serve(dec) as durl, PDProxyServer([purl], [durl], port=0) as proxy:
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvtier-prefill"] == "skipped"
        assert "kv_transfer_params" not in seen[-1]  # the decoder computes the prompt itself
    dead = f"http://127.0.0.1:{free_port()}"
    with PDProxyServer([dead], [dead], port=0) as proxy:
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 502 and proxy.stats.prefill_skipped == 1


def test_prefill_body_and_bad_config() -> None:
    b = prefill_body({"prompt": "x", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
                      "stream_options": {"include_usage": True}})
    assert (b["max_tokens"], b["max_completion_tokens"], b["stream"]) == (1, 1, False) and "stream_options" not in b
    with pytest.raises(ValueError):
        PDProxyServer([], ["http://x"], port=0)


def test_backend_passwords_never_reach_clients() -> None:
    """A prefiller or decoder URL with user:password@ (a backend behind basic auth): the proxy's
    answer headers named them raw, so every client read the password."""
    seen: list[dict[str, Any]] = []
    pre, dec = backends(seen)
    with serve(pre) as purl, serve(dec) as durl:
        auth = lambda u: u.replace("http://", "http://op:s3cret@")  # noqa: E731
        with PDProxyServer([auth(purl)], [auth(durl)], port=0) as proxy:
            r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
            assert "s3cret" not in r.headers["x-kvtier-prefill"] + r.headers["x-kvtier-decode"]
            assert r.headers["x-kvtier-prefill"] == purl.replace("http://", "http://op:***@")
    dead = f"http://op:s3cret@127.0.0.1:{free_port()}"
    with PDProxyServer([dead], [dead], port=0) as proxy:
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 502 and "s3cret" not in r.text + str(r.headers)


def test_router_backend_names_carry_no_password() -> None:
    from kvtier.router.config import parse_backend

    assert parse_backend("http://op:s3cret@h:8000@tcp://h:5557").name == "h:8000"
