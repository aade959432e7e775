"""LMCache's own benchmark client (``lmcache bench engine``, package ``lmcache-cli``) against a
configuration of ``kvtier bench serve`` that is up.

``lmcache-cli`` ships a ``lmcache`` package of its own, so it goes in a virtual environment of
its own (``--lmcache-cli PATH/bin/lmcache``; ``benchmarks/README.md``); it runs as a child
process against the OpenAI endpoint, and its ``bench_summary.json`` (and per-request
``bench_results.csv``) are read back as it wrote them.

Two of its workloads, scaled like the multi-round QA workload (:func:`workload_args`):

- ``multi-round-chat``: stateful sessions (a system prompt, a pre-filled history, 50-token
  queries, answers appended as history) dispatched round robin at ``--mrc-qps`` for
  ``--mrc-duration`` seconds, one request in flight per session;
- ``long-doc-qa``: documents sent once as a warm-up, then several questions per document in
  random order, ``--ldqa-num-inflight-requests`` in flight.

Both size themselves from a KV volume (GB) and tokens per GB: the bench passes the working
set it wants (``ratio`` x engine KV tokens, as the multi-round QA workload) and SmolLM2's
KV footprint (:data:`TOKENS_PER_GB`), so they get about 16 sessions / documents of 4,000 tokens.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.bench.common import BLOCK_SIZE
from kvtier.bench.serve.options import KV_BYTES_PER_TOKEN, ServeBenchOptions

#: Workloads run against every configuration of the side by side.
LMCACHE_WORKLOADS = ("multi-round-chat", "long-doc-qa")
#: SmolLM2-135M's KV tokens per GB (GB = 2**30 bytes here; it only sets the session count).
TOKENS_PER_GB = (1 << 30) // KV_BYTES_PER_TOKEN
#: Arrival rate (requests/s) of ``multi-round-chat`` when the bench has no ``--qps``.
DEFAULT_QPS = 1.0


#: Tokens ``multi-round-chat`` adds to a session per turn besides the answer (its query).
MRC_QUERY_TOKENS = 50
#: Chat-template tokens around a prompt (SmolLM2's template adds ~41 to a 4,050-token chat).
TEMPLATE_TOKENS = 64


def mrc_history_tokens(opts: ServeBenchOptions, volume_tokens: float, duration_s: float, max_model_len: int | None) -> int:
    """Per-session history of ``multi-round-chat``: the bench's context, cut so that a session's
    last turn still fits ``max_model_len`` (its sessions grow by a query and an answer per turn;
    the engine refuses a longer prompt with HTTP 400, which LMCache's client counts as a failed
    request). Turns per session = requests (qps x duration) / sessions, sessions counted on the
    uncut size (cutting only adds sessions, so fewer turns each). Raises ValueError when not even
    a 128-token history fits."""
    history = opts.context_tokens[1]
    if max_model_len is None:
        return history
    sessions = max(1, int(volume_tokens // (opts.system_tokens + history)))
    turns = math.ceil((opts.qps or DEFAULT_QPS) * duration_s / sessions) + 1
    room = max_model_len - opts.system_tokens - TEMPLATE_TOKENS - turns * (MRC_QUERY_TOKENS + opts.max_tokens)
    if room < BLOCK_SIZE:
        raise ValueError(f"multi-round-chat: {turns} turns per session do not fit max_model_len {max_model_len}")
    return min(history, room)


def workload_args(workload: str, opts: ServeBenchOptions, engine_blocks: int, max_model_len: int | None = None) -> list[str]:
    """``lmcache bench engine`` arguments of ``workload`` (one of :data:`LMCACHE_WORKLOADS`),
    scaled to the bench's workload: session / document = system + context tokens (a session's
    history cut to fit ``max_model_len``, :func:`mrc_history_tokens`), answers ``max_tokens``,
    volume = ``opts.ratio`` x engine KV. Raises ValueError for another name."""
    per = opts.system_tokens + opts.context_tokens[1]
    volume_tokens = opts.ratio * engine_blocks * BLOCK_SIZE
    volume_gb = volume_tokens / TOKENS_PER_GB
    common = ["--kv-cache-volume", f"{volume_gb:.4f}", "--tokens-per-gb-kvcache", str(TOKENS_PER_GB)]
    if workload == "multi-round-chat":
        duration = 20 if opts.quick else 60
        history = mrc_history_tokens(opts, volume_tokens, duration, max_model_len)
        return [*common, "--mrc-shared-prompt-length", str(opts.system_tokens),
                "--mrc-chat-history-length", str(history), "--mrc-user-input-length", str(MRC_QUERY_TOKENS),
                "--mrc-output-length", str(opts.max_tokens), "--mrc-qps", str(opts.qps or DEFAULT_QPS),
                "--mrc-duration", str(duration)]
    if workload == "long-doc-qa":
        return [*common, "--ldqa-document-length", str(per), "--ldqa-query-per-document", "2",
                "--ldqa-shuffle-policy", "random", "--ldqa-num-inflight-requests", str(opts.concurrency),
                "--ldqa-max-output-length", str(opts.max_tokens)]
    raise ValueError(f"workload {workload!r}: use one of {', '.join(LMCACHE_WORKLOADS)}")


def command(cli: Path, url: str, model: str, workload: str, opts: ServeBenchOptions, engine_blocks: int,
            out_dir: Path, max_model_len: int | None = None) -> list[str]:
    """The full ``lmcache bench engine`` argv (non-interactive, JSON and CSV into ``out_dir``)."""
    return [str(cli), "bench", "engine", "--engine-url", url.rstrip("/"), "--model", model, "--workload", workload,
            "--seed", "0", "--no-interactive", "--json", "--quiet", "--output-dir", str(out_dir),
            *workload_args(workload, opts, engine_blocks, max_model_len)]


def read_summary(out_dir: Path) -> dict[str, Any]:
    """``bench_summary.json``'s ``results`` plus ``request_throughput`` (successful requests
    per second of its elapsed time). Raises OSError / ValueError / KeyError on a bad file."""
    data = json.loads((out_dir / "bench_summary.json").read_text())
    res = dict(data["results"])
    elapsed = float(res.get("elapsed_time") or 0.0)
    res["request_throughput"] = float(res.get("successful_requests") or 0) / elapsed if elapsed > 0 else 0.0
    return res


def run_lmcache_bench(cli: Path, url: str, model: str, workload: str, opts: ServeBenchOptions, engine_blocks: int,
                      out_dir: Path, timeout_s: float = 1200.0, max_model_len: int | None = None) -> dict[str, Any]:
    """Run one workload of LMCache's client (prompts sized to fit ``max_model_len`` where
    given); its summary (:func:`read_summary`) plus ``args``,
    ``csv`` (path of its per-request CSV) and ``exit_code`` (1: some request failed).
    Never raises for a failed run: ``{"error": ..., "args": ...}``."""
    from kvtier.integrations.vllm.serve import die_with_parent

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        argv = command(cli, url, model, workload, opts, engine_blocks, out_dir, max_model_len)
    except ValueError as exc:
        return {"error": str(exc), "args": []}
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONPATH": ""}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env,
                              stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    except (subprocess.TimeoutExpired, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:500], "args": argv[3:]}
    (out_dir / "output.log").write_text(proc.stdout + proc.stderr)
    try:
        res = read_summary(out_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"error": f"exit {proc.returncode}, no summary ({exc}): {(proc.stdout + proc.stderr)[-1500:]}",
                "args": argv[3:]}
    csv = out_dir / "bench_results.csv"
    return {**res, "exit_code": proc.returncode, "csv": str(csv) if csv.exists() else None, "args": argv[3:]}


#: A ratio this close to 1 orders nothing (run-to-run spread on this machine is a few percent).
TIE = 0.02


def _get(results: Mapping[str, Any], config: str, workload: str, key: str) -> float | None:
    per = results.get(config)
    v = per.get(workload) if isinstance(per, Mapping) else None
    x = v.get(key) if isinstance(v, Mapping) else None
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) and x > 0 else None


def client_ratios(results: Mapping[str, Mapping[str, Any]], kv: str = "kvtier-cpu",
                  own: Mapping[str, float | None] | None = None) -> dict[str, dict[str, Any]]:
    """Per workload, from LMCache's client: ``ttft_mean_ratio_vs_lmcache`` (lmcache-mp mean TTFT
    / ``kv``'s), ``throughput_ratio_vs_lmcache`` (``kv`` request throughput / lmcache-mp's),
    ``ttft_mean_ratio_vs_vllm`` and ``throughput_ratio_vs_vllm`` (None where one is missing).

    ``own``: the same four ratios from kvtier's own client (the bench's top-level keys); then
    ``same_ordering`` says, per ratio both clients have, whether they put the two
    configurations in the same order (both above 1 or both below 1), or None where either
    ratio is within :data:`TIE` of 1: no order to agree with. LMCache's ``multi-round-chat``
    sends at a fixed rate for a fixed time, so its request throughput is the offered rate on
    every configuration that keeps up (measured 0.99998 on a quiet machine)."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out: dict[str, dict[str, Any]] = {}
    workloads = {w for per in results.values() if isinstance(per, Mapping) for w in per}
    for w in sorted(workloads):
        out[w] = {
            "ttft_mean_ratio_vs_lmcache": ratio(_get(results, "lmcache-mp", w, "mean_ttft_ms"), _get(results, kv, w, "mean_ttft_ms")),
            "throughput_ratio_vs_lmcache": ratio(_get(results, kv, w, "request_throughput"),
                                                 _get(results, "lmcache-mp", w, "request_throughput")),
            "ttft_mean_ratio_vs_vllm": ratio(_get(results, "vllm", w, "mean_ttft_ms"), _get(results, kv, w, "mean_ttft_ms")),
            "throughput_ratio_vs_vllm": ratio(_get(results, kv, w, "request_throughput"),
                                              _get(results, "vllm", w, "request_throughput")),
        }
        if own is not None:
            same: dict[str, bool | None] = {}
            for k, v in list(out[w].items()):
                theirs = own.get(k)
                if isinstance(v, float) and isinstance(theirs, (int, float)):
                    # a ratio that is not a finite positive number orders nothing either
                    unordered = not all(math.isfinite(r) and r > 0 and abs(r - 1) > TIE for r in (v, theirs))
                    same[k] = None if unordered else (v > 1) == (theirs > 1)
            out[w]["same_ordering"] = same
    return out
