"""The JSON document of ``kvtier bench serve``: the issue's top-level figures (see
:mod:`kvtier.bench.serve.run`), every phase in detail, and the checks against the targets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.bench.common import BLOCK_SIZE, Check
from kvtier.bench.serve.answer_check import compare_answers, concurrent_agreement, hit_ttft
from kvtier.bench.serve.client import RequestRecord
from kvtier.bench.serve.options import ServeBenchOptions
from kvtier.bench.serve.phase import Phase


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


#: The configurations of the side by side with LMCache (issue 30), in table order.
SIDE_BY_SIDE = ("vllm", "kvtier-cpu", "kvtier-cpu-disk", "lmcache-mp")


def side_by_side(s: dict[str, Any], check_runs: dict[str, Sequence[RequestRecord]]) -> dict[str, dict[str, Any]]:
    """Per configuration of :data:`SIDE_BY_SIDE` that ran: the figures the issue compares
    (seconds, requests per second): multi-round QA mean TTFT (all rounds, rounds 2+),
    throughput and hit rate, the no-reuse control's throughput, the isolated hit's TTFT."""
    out: dict[str, dict[str, Any]] = {}
    for name in SIDE_BY_SIDE:
        ph, nr = s.get(name), s.get(name + "@noreuse")
        if ph is None and nr is None and name not in check_runs:
            continue
        out[name] = {
            "ttft_mean_s": ((ph or {}).get("ttft_s") or {}).get("mean"),
            "ttft_later_rounds_mean_s": ((ph or {}).get("ttft_later_rounds_s") or {}).get("mean"),
            "request_throughput": (ph or {}).get("request_throughput"),
            "hit_rate": (ph or {}).get("hit_rate"),
            "errors": (ph or {}).get("errors"),
            "no_reuse_request_throughput": (nr or {}).get("request_throughput"),
            "isolated_hit_ttft_s": hit_ttft(check_runs.get(name, ())),
        }
    return out


def summarize(phases: dict[str, Phase], opts: ServeBenchOptions, ws: Any, engine_blocks: int,
              fits_blocks: int, max_model_len: int,
              check_runs: Mapping[str, Sequence[RequestRecord]] | None = None) -> dict[str, Any]:
    """The JSON document: the issue's top-level figures, then every phase in detail.

    ``check_runs``: the answer check's records per configuration (:mod:`.answer_check`)."""
    s = {k: p.summary() for k, p in phases.items()}
    sbs = side_by_side(s, dict(check_runs or {}))

    def col(name: str, key: str) -> Any:
        return (sbs.get(name) or {}).get(key)

    def get(name: str, *path: str) -> Any:
        v: Any = s.get(name)
        for p in path:
            if not isinstance(v, dict):
                return None
            v = v.get(p)
        return v

    kv = "kvtier-cpu" if "kvtier-cpu" in s else "kvtier-cpu-disk"
    fits_kv = "kvtier-cpu@fits" if "kvtier-cpu@fits" in s else f"{kv}@fits"
    router_oracle = get("router-2x", "oracle", "hit_rate")
    nr = s.get("router-2x@noreuse")
    share = None
    if nr:
        counts = nr["requests_per_instance"]
        share = max(counts) / min(counts) if counts and min(counts) > 0 else None
    check = compare_answers(dict(check_runs or {}))
    view = get("router-2x", "router")
    # A kv-aware router that received no KV events routes by load alone: its hit rate would
    # be luck, so the router figures say so instead of passing or failing silently.
    router_blind = ([n for n, b in view.items() if not b.get("events_batches")]
                    if isinstance(view, dict) else None)
    later = _ratio(get("vllm", "ttft_later_rounds_s", "mean"), get(kv, "ttft_later_rounds_s", "mean"))
    lmc = check["others"].get("lmcache-mp") or {}
    return {
        # issue 30: the side by side with LMCache (None where lmcache-mp did not run)
        "ttft_mean_ratio_vs_lmcache": _ratio(get("lmcache-mp", "ttft_s", "mean"), get(kv, "ttft_s", "mean")),
        "throughput_ratio_vs_lmcache": _ratio(get(kv, "request_throughput"), get("lmcache-mp", "request_throughput")),
        "ttft_later_rounds_ratio_vs_vllm": later,
        "no_reuse_throughput_ratio": _ratio(col(kv, "no_reuse_request_throughput"), col("vllm", "no_reuse_request_throughput")),
        "no_reuse_throughput_ratio_lmcache": _ratio(col("lmcache-mp", "no_reuse_request_throughput"),
                                                    col("vllm", "no_reuse_request_throughput")),
        "isolated_hit_ttft_ratio_vs_vllm": _ratio(col(kv, "isolated_hit_ttft_s"), col("vllm", "isolated_hit_ttft_s")),
        "isolated_hit_ttft_ratio_lmcache_vs_vllm": _ratio(col("lmcache-mp", "isolated_hit_ttft_s"),
                                                          col("vllm", "isolated_hit_ttft_s")),
        "ttft_later_rounds_ratio_lmcache_vs_vllm": _ratio(get("vllm", "ttft_later_rounds_s", "mean"),
                                                          get("lmcache-mp", "ttft_later_rounds_s", "mean")),
        "answers_identical_lmcache": lmc.get("identical"),
        "side_by_side": sbs,
        "ttft_mean_ratio_vs_vllm": _ratio(get("vllm", "ttft_s", "mean"), get(kv, "ttft_s", "mean")),
        "ttft_mean_ratio_vs_vllm_later_rounds": later,
        "throughput_ratio_vs_vllm": _ratio(get(kv, "request_throughput"), get("vllm", "request_throughput")),
        "fits_throughput_ratio": _ratio(get(fits_kv, "request_throughput"), get("vllm@fits", "request_throughput")),
        "router_hit_rate_ratio_vs_round_robin": _ratio(get("router-2x", "hit_rate"), get("rr-2x", "hit_rate")),
        "router_hit_rate_vs_oracle": _ratio(get("router-2x", "hit_rate"), router_oracle),
        "max_request_share_ratio_no_reuse": share,
        "router_backends_without_kv_events": router_blind,
        "answers_identical": check["identical"],
        "answer_mismatches": check["mismatches"],
        "answer_check": {"reference": check["reference"], "compared": check["compared"], "others": check["others"],
                         "records": {k: [r.as_dict() for r in v] for k, v in (check_runs or {}).items()}},
        "concurrent_answer_agreement": concurrent_agreement(phases),
        "kvtier_config_in_ratios": kv,
        "working_set_blocks": ws.blocks,
        "working_set_full_blocks": ws.full_blocks,
        "engine_kv_blocks": engine_blocks,
        "working_set_to_engine_kv_ratio": ws.blocks / engine_blocks,
        "working_set_to_engine_kv_ratio_measured": (
            get("vllm", "working_set_blocks_measured") or get(kv, "working_set_blocks_measured") or 0) / engine_blocks,
        "fits_engine_kv_blocks": fits_blocks,
        "block_size": BLOCK_SIZE,
        "max_model_len": max_model_len,
        "workload": {
            "users": opts.users, "rounds": opts.rounds, "concurrency": opts.concurrency, "qps": opts.qps,
            "max_tokens": opts.max_tokens, "system_tokens": opts.system_tokens,
            "context_tokens": list(opts.context_tokens), "fleet_cpu_fraction": opts.fleet_cpu_fraction, "no_reuse_requests": opts.no_reuse_requests,
            "no_reuse_tokens": opts.no_reuse_tokens, "quick": opts.quick, "endpoint": "/v1/chat/completions",
            "temperature": 0.0, "stream": True, "preset": opts.workload, "fits": opts.fits,
            "cpu_cores": opts.cpu_cores, "check_users": opts.check_users or opts.users,
            "lmcache_client_configs": list(opts.lmcache_client_configs or SIDE_BY_SIDE),
        },
        "configs": s,
    }


def checks_of(result: dict[str, Any]) -> list[Check]:
    """The issue's targets for the figures present (absent figures are not judged)."""
    spec = [
        ("mean TTFT, vLLM / kvtier (ws >= 4x)", "ttft_mean_ratio_vs_vllm", 10.0, True, "x"),
        ("request throughput, kvtier / vLLM", "throughput_ratio_vs_vllm", 3.0, True, "x"),
        ("throughput when it fits, kvtier / vLLM", "fits_throughput_ratio", 0.98, True, "x"),
        ("hit rate, router / round robin", "router_hit_rate_ratio_vs_round_robin", 2.0, True, "x"),
        ("hit rate, router / oracle", "router_hit_rate_vs_oracle", 0.9, True, "x"),
        ("no-reuse request share, max / min", "max_request_share_ratio_no_reuse", 1.5, False, "x"),
    ]
    out = [Check(n, float(result[k]), t, hib, u) for n, k, t, hib, u in spec if result.get(k) is not None]
    # issue 30 (LMCache side by side); kvtier's TTFT judged as a share of LMCache's
    r = result.get("ttft_mean_ratio_vs_lmcache")
    if r:
        out.append(Check("mean TTFT, kvtier / LMCache (multi-round QA)", 1.0 / float(r), 0.7, False, "x"))
    spec30 = [
        ("request throughput, kvtier / LMCache", "throughput_ratio_vs_lmcache", 1.2, True, "x"),
        ("rounds 2+ mean TTFT, vLLM / kvtier", "ttft_later_rounds_ratio_vs_vllm", 8.0, True, "x"),
        ("isolated hit TTFT, kvtier / vLLM's engine hit", "isolated_hit_ttft_ratio_vs_vllm", 1.15, False, "x"),
        ("no-reuse throughput, kvtier / vLLM", "no_reuse_throughput_ratio", 0.98, True, "x"),
    ]
    out += [Check(n, float(result[k]), t, hib, u) for n, k, t, hib, u in spec30 if result.get(k) is not None]
    blind = result.get("router_backends_without_kv_events")
    if blind is not None:
        out.append(Check("router instances without KV events", float(len(blind)), 0.0, False,
                         note=", ".join(blind)))
    if result.get("answers_identical") is not None:
        out.append(Check("answers identical to vLLM alone", 1.0 if result["answers_identical"] else 0.0, 1.0, True,
                         note=f"{len(result['answer_mismatches'])} of {result['answer_check']['compared']} differ"))
    return out
