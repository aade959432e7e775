"""Remote-tier fault workload on the real model in vLLM, with a Redis this script owns.

Run as ``python tests/remote_fault_scenarios.py`` (used by
tests/test_remote_faults_vllm.py); prints one JSON line prefixed ``RESULT ``.

One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the kvtier
connector: CPU tier only as a staging area (emptied before every request, as are
vLLM's prefix cache), no disk tier, remote tier = a throwaway ``redis-server``
on a free loopback port started here. So every kvtier hit comes from Redis.
Prompts: two questions on each of two demo documents; the second question of a
document shares the document's chunks with the first.

Phases, in order (each request's answer must equal its cold answer):

1. ``cold``: kvtier cleared before each request: reference answers and latencies.
2. ``healthy``: q0 stores, q1 hits from Redis.
3. ``killed``: Redis SIGKILLed mid-workload; requests go on without it.
4. ``restarted``: Redis started again, empty; after recovery q0 stores, q1 hits again.
5. ``restart_between``: Redis restarted empty between a lookup that found the
   chunks and their load: the load fails, vLLM recomputes (load error path).
6. ``paused``: Redis SIGSTOPped (a hung server): lookups time out into misses;
   after SIGCONT hits resume.
7. ``paused_between``: Redis paused between lookup and load: the get times out.
8. ``debug_sleep``: ``DEBUG SLEEP`` makes Redis unresponsive during a request.

Every remote call the manager makes is timed (``remote_calls``), so the test
can check that none waited longer than the configured timeout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: kvtier's bound on one remote call (seconds).
REMOTE_TIMEOUT_S = 0.5
MAX_TOKENS = 12
DOCS = ("apache-2.0", "gpl-1")
#: Each document is cut to its first DOC_TOKENS tokens: 4 full 256-token chunks per prompt,
#: 3 of them shared by a document's two questions, at ~40% of the full documents' prefill
#: work (the run is ~26 prefills on the real model; float32 on an AVX2-only CPU).
DOC_TOKENS = 1000


def _prompts(model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kvtier.demo.workload import load_documents, prompt_token_ids

    tok = AutoTokenizer.from_pretrained(str(model))
    docs = {d.doc_id: replace(d, text=tok.decode(tok(d.text)["input_ids"][:DOC_TOKENS])) for d in load_documents()}
    # Order: A q0, A q1, B q0, B q1
    return [prompt_token_ids(tok, docs[d], docs[d].questions[q]) for d in DOCS for q in (0, 1)]


def main() -> dict[str, Any]:
    import redis
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm import flush_all, request_hits
    from kvtier.integrations.vllm_engine import build_llm, kv_transfer_config
    from kvtier.storage import registry
    from kvtier.testing.redis_server import RedisServerProcess

    model = prepare_model().path
    prompts = _prompts(model)
    server = RedisServerProcess(extra_args=("--enable-debug-command", "yes"))
    # Short breaker back-off so recovery is observed within the test.
    url = server.url + "?breaker_backoff_s=0.2&breaker_max_backoff_s=0.5"
    try:
        llm = build_llm(
            str(model),
            max_model_len=4096,
            kv_transfer_config=kv_transfer_config(
                {"cpu_capacity": "128MiB", "remote_url": url, "remote_timeout_s": REMOTE_TIMEOUT_S},
                # The connector sets this itself; said here too so the test does not rely on it.
                kv_load_failure_policy="recompute",
            ),
        )
        (manager,) = registry.active_managers()
        calls: list[dict[str, Any]] = []
        phase = ["start"]
        remote = manager.remote

        def timed(name: str, fn: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.monotonic()
                try:
                    return fn(*args, **kwargs)
                finally:
                    calls.append({
                        "phase": phase[0], "req": len(records), "op": name, "s": time.monotonic() - t0,
                        "thread": threading.current_thread().name,
                    })

            return wrapper

        for op in ("contains_many", "get_many_into", "put_many"):
            setattr(remote, op, timed(op, getattr(remote, op)))

        between: list[Callable[[], None] | None] = [None]
        original_lookup = manager.lookup_keys

        def lookup_with_hook(keys, lease_owner=None):  # type: ignore[no-untyped-def]
            res = original_lookup(keys, lease_owner)
            hook = between[0]
            if hook is not None and "remote" in res.tiers:
                between[0] = None
                hook()  # the fault strikes after the lookup promised the chunks
            return res

        manager.lookup_keys = lookup_with_hook
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        records: list[dict[str, Any]] = []

        def run(name: str, idx: int, hook: Callable[[], None] | None = None) -> dict[str, Any]:
            phase[0] = name
            flush_all(30)
            manager.cpu.clear()
            llm.reset_prefix_cache()
            between[0] = hook
            t0 = time.monotonic()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompts[idx])], params, use_tqdm=False)[0]
            latency = time.monotonic() - t0
            between[0] = None
            rec = {
                "phase": name,
                "prompt": idx,
                "tokens": list(out.outputs[0].token_ids),
                "latency_s": latency,
                "hits": request_hits(out.request_id),
                "load_failures": (request_hits(out.request_id) or {}).get("load_failures", 0),
            }
            records.append(rec)
            print(f"{name} prompt {idx}: {latency:.2f} s hits={rec['hits']}", file=sys.stderr, flush=True)
            return rec

        def wait_recovered(timeout_s: float = 20.0) -> float:
            """Seconds until the remote tier stores again (circuit breaker closed)."""
            t0 = time.monotonic()
            probe = os.urandom(32)
            while not remote.put(probe, b"probe" * 4):
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError("remote tier did not recover")
                time.sleep(0.05)
            remote.delete(probe)
            return time.monotonic() - t0

        recovery: dict[str, float] = {}
        # 1. cold reference
        for i in range(len(prompts)):
            manager.clear()
            run("cold", i)
        manager.clear()
        # 2. healthy: q0 stores, q1 hits the shared document prefix; B q0 stores, then hits
        #    all of its own chunks, B q1 its document prefix. These hit answers are the
        #    references for the same hits in later phases.
        run("healthy", 0)
        run("healthy", 1)
        run("healthy", 2)
        run("healthy", 2)
        run("healthy", 3)
        # 3. killed mid-workload
        run("killed", 2)
        server.kill()
        run("killed", 3)
        run("killed", 1)
        # 4. restarted empty; hits resume
        server.start()
        recovery["restarted"] = wait_recovered()
        run("restarted", 0)  # the new server is empty: a miss (and stores)
        run("restarted", 1)
        # 5. restarted empty between lookup and load
        run("restart_between", 1, hook=lambda: (server.kill(), server.start()))
        recovery["restart_between"] = wait_recovered()
        # 6. paused (SIGSTOP) mid-workload; hits resume after SIGCONT
        run("paused", 2)
        server.pause()
        run("paused", 3)
        run("paused", 0)
        server.resume()
        recovery["paused"] = wait_recovered()
        run("paused", 2)
        run("paused", 3)
        # 7. paused between lookup and load
        run("paused_between", 3, hook=server.pause)
        server.resume()
        recovery["paused_between"] = wait_recovered()
        # 8. DEBUG SLEEP during a request
        run("debug_sleep", 0)
        sleeper = threading.Thread(
            target=lambda: redis.Redis("127.0.0.1", server.port, socket_timeout=30).execute_command(
                "DEBUG", "SLEEP", "3"
            ),
            daemon=True,
        )
        sleeper.start()
        time.sleep(0.2)
        run("debug_sleep", 1)
        sleeper.join(10)
        recovery["debug_sleep"] = wait_recovered()
        run("debug_sleep", 1)
        return {
            "timeout_s": REMOTE_TIMEOUT_S,
            "prompt_tokens": [len(p) for p in prompts],
            "records": records,
            "remote_calls": calls,
            "recovery_s": recovery,
            "stats": manager.stats(),
        }
    finally:
        server.stop()


if __name__ == "__main__":
    result = main()
    print("RESULT " + json.dumps(result), flush=True)
