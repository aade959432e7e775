"""The SGLang GPU smoke check's flow (kvtier/integrations/sglang/gpu_smoke.py) against a stub SGLang HTTP server.

A real SGLang run needs a GPU (``scripts/gpu-check.sh`` step 5). Here a stub answers
``/generate`` and ``/flush_cache`` the way SGLang does with ``--enable-cache-report``; it
writes a ``.kvc`` record like kvtier's disk tier on the first generate, and reports a cached
prefix only when the test says kvtier served one, so each check can fail.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvtier.integrations.sglang import gpu_smoke


class Stub:
    def __init__(self, disk: Path):
        self.disk = disk
        self.hit_tokens = 128  # what "kvtier" serves after a flush or restart
        self.text_after_flush = " Record 42."
        self.flushed = False
        self.restarted = False
        self.calls: list[str] = []

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        assert body["sampling_params"]["temperature"] == 0
        first = not self.calls
        self.calls.append("generate")
        if first:
            (self.disk / "ab").mkdir(parents=True, exist_ok=True)
            (self.disk / "ab" / "chunk.kvc").write_bytes(b"x")
            return {"text": " Record 42.", "meta_info": {"cached_tokens": 0}}
        return {"text": self.text_after_flush, "meta_info": {"cached_tokens": self.hit_tokens}}


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[tuple[Stub, str]]:
    st = Stub(tmp_path / "disk")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(n) or b"{}")
            if self.path.startswith("/flush_cache"):
                st.flushed = True
                st.calls.append("flush")
                out: dict[str, Any] = {}
            else:
                out = st.generate(body)
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield st, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


def test_flow_passes_when_kvtier_serves_the_prefix(stub) -> None:
    st, url = stub
    res = gpu_smoke.check_server(url, st.disk, restart=lambda: setattr(st, "restarted", True))
    assert res.passed, res.to_json()
    assert st.calls == ["generate", "flush", "generate", "generate"] and st.restarted
    assert [s.name for s in res.steps] == ["cold", "from_storage", "after_restart"] and res.disk_records == 1


@pytest.mark.slow
@pytest.mark.parametrize("broken,check", [("hit_tokens", "from_storage_hit"), ("text_after_flush", "from_storage_identical")])
def test_flow_fails_on_a_miss_or_different_text(stub, broken: str, check: str) -> None:
    st, url = stub
    setattr(st, broken, 0 if broken == "hit_tokens" else " Record 7.")
    res = gpu_smoke.check_server(url, st.disk, restart=lambda: None)
    assert not res.passed and res.checks[check] is False


def test_command_names_the_kvtier_backend(tmp_path: Path) -> None:
    cmd = gpu_smoke.server_command("m", 30001, tmp_path / "d")
    cfg = json.loads(cmd[cmd.index("--hicache-storage-backend-extra-config") + 1])
    assert cfg["module_path"] == "kvtier.integrations.sglang" and cfg["class_name"] == "KVTierHiCacheStorage"
    assert cfg["kvtier"]["disk_path"] == str(tmp_path / "d")
    assert cmd[cmd.index("--hicache-storage-backend") + 1] == "dynamic" and "--enable-cache-report" in cmd
    assert cmd[cmd.index("--page-size") + 1] == str(gpu_smoke.PAGE)


def test_without_sglang_it_says_so_and_exits_2(capsys) -> None:
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    assert gpu_smoke.main(["--model", "m"]) == 2
    assert "sglang not importable" in capsys.readouterr().out
