"""Documents nested deeper than the interpreter's recursion limit are malformed input, everywhere a
client or a peer chooses the bytes (issue 24, found by ``kvtier bench soak-fleet``).

The soak's hostile client sent ``[`` * 100,000 to the router and the PD proxy: every one was a 500
(``RecursionError`` out of msgspec / ``json``, which the request paths did not take for bad JSON).
By kind: msgspec's typed decoders recurse too, and walk a field their Struct does not have, so a
deep value in an unknown field passed every fleet, peer and PD confirm decoder as an unexpected
error (a vLLM prefiller's confirm drain raised into the engine). Each decode now goes through
:mod:`kvtier.protocol.decoding`; these tests feed every such entry point a deep document at the top
level and in an unknown field.
"""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
from service_helpers import short_dir, start_server  # noqa: F401 (fixture)
from test_pd_protocol import CHUNK, cluster, free_port, req, tokens_of  # noqa: F401 (fixture)
from test_pd_proxy import backends, serve
from test_pd_trust import _push
from test_router import FakeBackend, _router

from kvtier.protocol.decoding import decode, json_dumps, json_loads
from kvtier.protocol.fleet import FleetProtocolError, decode_agent_message, decode_controller_message
from kvtier.router.pd_proxy import PDProxyServer, _parse_and_prefill_leg
from kvtier.router.request_body import BadBody, prepare
from kvtier.router.tokenize import PromptTokenizer
from kvtier.transfer.errors import ProtocolError
from kvtier.transfer.frames import decode_header

DEPTH = 100_000
DEEP_JSON = b"[" * DEPTH
DEEP_JSON_FIELD = b'{"prompt": "x", "zz": ' + b"[" * DEPTH
#: msgpack: an array of one, nested (then nil); and a map whose unknown field holds it.
DEEP_MSGPACK = b"\x91" * DEPTH + b"\xc0"


class _Small(msgspec.Struct):
    a: int


def _msgpack_field(tag: dict[str, str], depth: int = DEPTH) -> bytes:
    head = bytes([0x80 | (len(tag) + 1)]) + b"".join(msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v)
                                                     for k, v in tag.items())
    return head + msgspec.msgpack.encode("zz_unknown") + b"\x91" * depth + b"\xc0"


def test_the_decoding_helpers_take_too_deep_for_malformed() -> None:
    with pytest.raises(msgspec.DecodeError, match="too deeply"):
        decode(msgspec.json.Decoder(), DEEP_JSON)
    with pytest.raises(msgspec.DecodeError, match="too deeply"):
        decode(msgspec.msgpack.Decoder(), DEEP_MSGPACK)
    with pytest.raises(ValueError, match="too deeply"):
        json_loads(DEEP_JSON)
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match="too deeply"):
        json_dumps(deep)
    with pytest.raises(msgspec.DecodeError, match="too deeply"):  # a typed decoder walks an unknown field
        decode(msgspec.json.Decoder(_Small), b'{"a": 1, "zz": ' + DEEP_JSON)
    assert json_loads(b'{"a": [1]}') == {"a": [1]} and json_dumps({"a": [1]}) == b'{"a": [1]}'


@pytest.mark.parametrize("payload", [_msgpack_field({"type": "heartbeat"}), _msgpack_field({"type": "register"})])
def test_fleet_frames_nested_too_deeply_are_malformed(payload: bytes) -> None:
    with pytest.raises(FleetProtocolError):
        decode_agent_message(payload)
    with pytest.raises(FleetProtocolError):
        decode_controller_message(payload)


@pytest.mark.parametrize("payload", [_msgpack_field({"type": "Chunk"}), _msgpack_field({})])
def test_peer_frame_headers_nested_too_deeply_are_malformed(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_header(payload)


@pytest.mark.parametrize("body", [DEEP_JSON, DEEP_JSON_FIELD])
def test_router_and_pd_bodies_nested_too_deeply_are_bad_bodies(body: bytes) -> None:
    with pytest.raises(BadBody):
        prepare(body, False, PromptTokenizer(None), None)
    with pytest.raises(ValueError):
        _parse_and_prefill_leg(body)


def test_router_answers_400_to_a_body_nested_too_deeply() -> None:
    back = FakeBackend("b0").start()
    try:
        r = _router([back], None)
        try:
            with httpx.Client(base_url=r.url, timeout=30) as c:
                for path in ("/v1/completions", "/v1/chat/completions"):
                    for body in (DEEP_JSON, DEEP_JSON_FIELD):
                        got = c.post(path, content=body, headers={"content-type": "application/json"})
                        assert got.status_code == 400, (path, got.status_code, got.text[:200])
                assert c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}).status_code == 200
        finally:
            r.close()
    finally:
        back.stop()


def test_pd_proxy_answers_400_to_a_body_nested_too_deeply() -> None:
    seen: list = []
    pre, dec = backends(seen)
    with serve(pre) as purl, serve(dec) as durl, PDProxyServer([purl], [durl], port=0) as proxy:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in (DEEP_JSON, DEEP_JSON_FIELD):
                r = httpx.post(proxy.url + path, content=body, headers={"content-type": "application/json"},
                               timeout=30)
                assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert not seen  # nothing reached a backend
        assert httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 200


def test_a_confirm_nested_too_deeply_is_dropped_not_raised_into_the_engine(cluster) -> None:  # noqa: F811
    """A stranger reaching a prefiller's confirm socket sends a 3 KB confirm (under the 4 KiB frame
    bound) whose unknown field nests 3,000 deep: the drain counts it refused; the engine's step goes on
    and the hold stays until the real decoder confirms."""
    port = free_port()
    pre = cluster("prefill", port)
    _, params = pre.prefill(req("p-1", tokens_of(11, 3 * CHUNK + 5), {"do_remote_decode": True}))
    assert params is not None
    pd = pre.worker.worker.pd
    _push(port, _msgpack_field({"engine_id": params["remote_engine_id"]}, depth=3000))
    deadline = time.monotonic() + 10.0
    while pd.refused < 1:
        sending, _, _ = pre.step()  # raised RecursionError out of the worker before
        assert "p-1" not in sending
        assert time.monotonic() < deadline, "the confirm was never read"
        time.sleep(0.01)
    assert pd.refused == 1 and pd.confirms == 0 and "p-1" in pd.held
    pre.release_blocks("p-1")


def test_a_server_dashboard_login_nested_too_deeply_is_a_400(short_dir) -> None:  # noqa: F811
    """The kvtier server's dashboard (stdlib HTTP) reads a login body of at most 8 KiB with ``json``:
    8,000 ``[`` raised out of the handler (the connection was dropped without an answer)."""
    import http.client

    with start_server(short_dir, metrics_port=0, token="srv-secret") as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.metrics_port, timeout=10)
        conn.request("POST", "/dashboard/login", body=b"[" * 8000, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 400, r.read()[:200]
        conn.close()
