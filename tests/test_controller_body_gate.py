"""The controller reads no body of a token route from a client without the token, and bounds
every body (hostile trial, December 7: tokenless 64 MiB bodies on /locate held ~64 MB each and got
a 422, parsed, before the 401; ``kvtier.controller.body_gate``)."""

from __future__ import annotations

import socket

import httpx
import pytest

from conftest import http_status
from kvtier.controller.api import API_BODY_ROUTES, MAX_BODY_BYTES
from kvtier.controller.body_gate import SMALL_BODY
from kvtier.controller.server import Controller


@pytest.fixture
def keyed():
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0", token="s3cret").start()
    yield ctl
    ctl.stop()


def _raw(ctl: Controller, head: bytes, body: bytes = b"") -> int:
    """Send ``head`` (and ``body``) on a fresh connection; the answer's status."""
    with socket.create_connection(("127.0.0.1", ctl.http_port), timeout=5) as s:
        s.sendall(head + body)
        return http_status(s, 5.0)


@pytest.mark.parametrize("path", API_BODY_ROUTES)
def test_a_stranger_declaring_a_huge_body_gets_401_before_sending_it(keyed, path):
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {64 << 20}\r\n\r\n").encode()
    assert _raw(keyed, head, b"{") == 401  # one byte of 64 MiB sent: the answer comes anyway
    wrong = head.replace(b"Host:", b"Authorization: Bearer nope\r\nHost:")
    assert _raw(keyed, wrong, b"{") == 401


def test_a_junk_body_without_the_token_is_401_not_422(keyed):
    for path in ("/lookup", "/locate"):
        r = httpx.post(keyed.http_url + path, content=b"\x00junk", timeout=10)
        assert r.status_code == 401, (path, r.status_code, r.text)
    r = httpx.post(keyed.http_url + "/locate", content=b"\x00junk", timeout=10,
                   headers={"Authorization": "bearer s3cret"})  # scheme case-insensitive, as HTTPBearer
    assert r.status_code == 422


def test_bodies_over_the_limits_are_413_with_the_token_too(keyed):
    auth = b"Authorization: Bearer s3cret\r\n"
    head = (f"POST /lookup HTTP/1.1\r\nHost: 127.0.0.1\r\n").encode() + auth + \
        f"Content-Type: application/json\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode()
    assert _raw(keyed, head, b"{") == 413
    # Chunked (no Content-Length): counted as it arrives and cut at the limit.
    big = b'{"tokens": [' + b"1," * (SMALL_BODY // 2 + 10) + b"1]}"
    r = httpx.post(keyed.http_url + "/dashboard/login", content=iter([big]), timeout=10)
    assert r.status_code == 413
    r = httpx.post(keyed.http_url + "/dashboard/login", content=big, timeout=10)
    assert r.status_code == 413
    # And a legal lookup with the token still answers.
    r = httpx.post(keyed.http_url + "/lookup", json={"tokens": list(range(512))}, timeout=10,
                   headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200, r.text


def test_a_tokenless_controller_still_answers_without_a_token():
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0", token="").start()
    try:
        r = httpx.post(ctl.http_url + "/lookup", json={"tokens": list(range(512))}, timeout=10)
        assert r.status_code == 200, r.text
    finally:
        ctl.stop()
