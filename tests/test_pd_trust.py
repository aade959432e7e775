"""PD disaggregation against hostile clients (issue 24, kind 5): forged confirms, params naming a
prefiller the decoder does not know, client-supplied ``kv_transfer_params`` through the proxy.

The connector checks use the two fake engines and the in-process ``kvtier server`` of
``test_pd_protocol`` (real ZMQ confirm sockets on loopback); the proxy checks use fake
prefill and decode backends of ``test_pd_proxy``.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from conftest import free_port
from test_pd_protocol import CHUNK, cluster, req, tokens_of, wait_sending  # noqa: F401 (fixture)
from test_pd_proxy import PARAMS, backends, serve

from kvtier.integrations.vllm.pd import PDConfirm, PDSettings, RemotePrefill
from kvtier.router.pd_proxy import PDProxyServer, decode_body, prefill_body


def _push(port: int, payload: bytes) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(payload)
    s.close()  # lingers until delivered
    ctx.term()


def test_a_forged_confirm_never_ends_another_requests_hold(cluster) -> None:  # noqa: F811
    port = free_port()
    pre, dec = cluster("prefill", port), cluster("decode")
    prompt = tokens_of(11, 3 * CHUNK + 5)
    _, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    assert params is not None and len(params["kvtier_confirm"]) == 32  # 128 random bits, hex
    pd = pre.worker.worker.pd
    engine = params["remote_engine_id"]
    # A stranger knows (or guesses) the engine and request ids, not the hold's confirm value.
    for forged in (PDConfirm(engine, "p-1"), PDConfirm(engine, "p-1", "0" * 32)):
        _push(port, msgspec.msgpack.encode(forged))
    _push(port, b"\xc1 not msgpack")
    _push(port, b"x" * 100_000)  # beyond the confirm frame bound: that link is cut, nothing read
    first = True
    for _ in range(200):  # bounded: until the forged ones were read (refused)
        sending, _, _ = pre.step(finished={"p-1"} if first else set())
        first = False
        assert "p-1" not in sending, "a forged confirm released the hold"
        if pd.refused >= 3:
            break
        time.sleep(0.01)
    assert pd.refused == 3 and pd.confirms == 0 and "p-1" in pd.held
    # The decoder the params went to confirms with the value: the hold ends.
    dec.sched.scheduler.pd.sender.send(RemotePrefill.parse(params))
    wait_sending(pre, "p-1")
    assert pd.confirms == 1 and not pd.held
    pre.release_blocks("p-1")


@pytest.mark.slow
@pytest.mark.parametrize("known", [None, ["127.0.0.1:{port}"]])
def test_decoder_never_dials_a_prefiller_it_does_not_know(cluster, known: Any) -> None:  # noqa: F811
    port = free_port()
    pre = cluster("prefill", port)
    extra = {} if known is None else {"pd_prefillers": [k.format(port=port) for k in known]}
    dec = cluster("decode", **extra)
    sender = dec.sched.scheduler.pd.sender
    prompt = tokens_of(12, 2 * CHUNK + 3)
    _, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    stranger = free_port()
    forged = [dict(params, remote_host="10.9.8.7"),  # another machine: never on loopback by default
              dict(params, remote_host="evil.example", remote_port=stranger)]
    if known is not None:
        forged.append(dict(params, remote_port=stranger))  # loopback, but not a listed prefiller
    for i, p in enumerate(forged):
        d = req(f"f-{i}", prompt, p)
        dec.sched.get_num_new_matched_tokens(d, 0)
        assert dec.sched.scheduler._trackers[f"f-{i}"].pd_remote is None  # treated as a plain request
        d.status = "FINISHED_ABORTED"
        dec.sched.request_finished(d, [])
    assert sender.sent == 0 and not sender._socks  # nothing sent, nothing even connected
    d = req("d-1", prompt, params)  # the real params: acted on, confirmed
    dec.sched.get_num_new_matched_tokens(d, 0)
    assert dec.sched.scheduler._trackers["d-1"].pd_remote is not None
    d.status = "FINISHED_ABORTED"
    dec.sched.request_finished(d, [])
    assert sender.sent == 1
    wait_sending(pre, "p-1")


def test_pd_prefillers_setting() -> None:
    s = PDSettings.pop_from({"pd_role": "decode", "pd_prefillers": ["tcp://Pre-A:5601", "10.0.0.2:5601", "[::1]:7"]})
    assert s.prefillers == (("pre-a", 5601), ("10.0.0.2", 5601), ("::1", 7))
    assert s.knows("pre-a", 5601) and s.knows("PRE-A", 5601) and not s.knows("pre-a", 5602)
    assert not s.knows("127.0.0.1", 5601)  # listed: only those
    assert PDSettings.pop_from({"pd_prefillers": "a:1,b:2"}).prefillers == (("a", 1), ("b", 2))
    d = PDSettings.pop_from({"pd_role": "decode"})
    assert d.prefillers is None and d.knows("127.0.0.1", 9) and d.knows("localhost", 9) and d.knows("::1", 9)
    assert not d.knows("10.0.0.1", 9) and not d.knows("localhost.evil.example", 9)
    for bad in (["host"], ["host:0"], ["host:x"], [":5"], 5):
        with pytest.raises(ValueError):
            PDSettings.pop_from({"pd_prefillers": bad})


# -- the proxy never forwards a client's kv_transfer_params ---------------------------------------


FORGED = {"do_remote_prefill": True, "remote_engine_id": "victim", "remote_request_id": "someone-else",
          "remote_host": "10.6.6.6", "remote_port": 6666, "remote_block_ids": [1]}


@pytest.mark.slow
@pytest.mark.parametrize("prefill_status", [200, 500])
def test_proxy_drops_client_kv_transfer_params(prefill_status: int) -> None:
    seen: list[dict[str, Any]] = []
    pre, dec = backends(seen, prefill_status=prefill_status)
    body = {"prompt": "hi", "max_tokens": 8, "min_tokens": 2, "echo": True, "kv_transfer_params": FORGED,
            "vllm_xargs": {"kv_transfer_params": FORGED, "other": 1}}
    with serve(pre) as purl, serve(dec) as durl, PDProxyServer([purl], [durl], port=0) as proxy:
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
    prefill, decode = seen
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "min_tokens" not in prefill and "echo" not in prefill  # the 1-token leg is not refused or grown
    assert prefill["vllm_xargs"] == {"other": 1} == decode["vllm_xargs"]
    if prefill_status == 200:
        assert decode["kv_transfer_params"] == PARAMS  # the prefiller's own params, only
    else:  # the prefill was skipped: the decoder gets no params at all, never the client's
        assert "kv_transfer_params" not in decode
    assert decode["min_tokens"] == 2 and decode["echo"] is True  # the decode leg is the client's request


def test_proxy_body_helpers_and_bounds() -> None:
    b = {"prompt": "x", "kv_transfer_params": FORGED, "vllm_xargs": {"kv_transfer_params": FORGED}}
    assert decode_body(b, None) == {"prompt": "x", "vllm_xargs": {}}
    assert decode_body(b, {"a": 1})["kv_transfer_params"] == {"a": 1}
    assert prefill_body({"prompt": "x", "prompt_logprobs": 5})["max_tokens"] == 1
    assert "prompt_logprobs" not in prefill_body({"prompt": "x", "prompt_logprobs": 5})
    seen: list[dict[str, Any]] = []
    pre, dec = backends(seen)
    with serve(pre) as purl, serve(dec) as durl:
        from kvtier.router.app_server import AppServer
        from kvtier.router.pd_proxy import create_pd_app

        app, _ = create_pd_app([purl], [durl], max_body_bytes=1024)
        with AppServer(app, "127.0.0.1", 0, "kvtier pd-proxy") as proxy:
            r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "y" * 2000}, timeout=30)
            assert r.status_code == 413 and not seen
