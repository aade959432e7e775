"""Measuring one configuration that is up: the multi-round QA workload (phases 1 and 4) and
the no-reuse slice (phase 2), each with the instances' /metrics read before and after."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from kvtier.bench.common import BLOCK_SIZE
from kvtier.bench.serve.client import OnDone, run_prompts, run_sessions, run_sync
from kvtier.bench.serve.configs import delta, oracle_hit_rate, scrape
from kvtier.bench.serve.options import ServeBenchOptions
from kvtier.bench.serve.phase import Phase
from kvtier.bench.serve.workload import (
    Session,
    Tokenizer,
    WorkloadSpec,
    no_reuse_prompts,
    prompt_hash_ids,
    working_set,
    workload_prompts,
)


def measure_sessions(name: str, url: str, model: str, instances: Sequence[str], blocks: int | None,
                     sessions: Sequence[Session], spec: WorkloadSpec, tokenizer: Tokenizer,
                     opts: ServeBenchOptions, on_done: OnDone) -> Phase:
    """Run ``sessions`` (``spec.rounds`` rounds) against ``url``; a :class:`Phase` named ``name``.

    ``blocks``: the engine KV bound the servers were started with (``None``: not ours).
    ``extra`` gets ``working_set_blocks_measured`` (real answers as history),
    ``prompt_tokens_local_vs_server_mismatches``, ``prompt_blocks`` (request id -> local prompt
    length and Mooncake-format ``hash_ids`` of its ``BLOCK_SIZE``-token blocks: with the records'
    start, ttft and backend, a trace ``kvtier bench timing-check`` replays) and, with several
    instances, ``oracle``.
    ``on_done`` is called once per finished request. Raises httpx.HTTPError when /metrics
    cannot be read.
    """
    before = [scrape(u) for u in instances]
    recs, wall = run_sync(run_sessions(
        url, model, sessions, concurrency=opts.concurrency, qps=opts.qps, max_tokens=opts.max_tokens,
        on_done=on_done))
    after = [scrape(u) for u in instances]
    ph = Phase(name, recs, wall, [delta(b, a) for b, a in zip(before, after)], blocks)
    prompts = workload_prompts(sessions, tokenizer)  # real answers as history
    ph.extra["working_set_blocks_measured"] = working_set(prompts, BLOCK_SIZE).blocks
    usage = {r.request_id: r.prompt_tokens for r in recs}
    ids = [s.request_id(r) for r in range(spec.rounds) for s in sessions]
    ph.extra["prompt_tokens_local_vs_server_mismatches"] = sum(
        1 for rid, p in zip(ids, prompts) if usage.get(rid) and usage[rid] != len(p))
    ph.extra["prompt_blocks"] = {"block_size": BLOCK_SIZE, "requests": {
        rid: {"input_length": len(p), "hash_ids": h}
        for rid, p, h in zip(ids, prompts, prompt_hash_ids(prompts, BLOCK_SIZE))}}
    if len(instances) > 1:
        ph.extra["router"] = router_view(url)
        by_id = dict(zip(ids, prompts))
        order = sorted((r for r in recs), key=lambda r: r.start)
        ph.extra["oracle"] = oracle_hit_rate(
            [(r.request_id.split("-")[0], by_id[r.request_id]) for r in order], len(instances), BLOCK_SIZE)
    return ph


def measure_no_reuse(name: str, url: str, model: str, instances: Sequence[str], tokenizer: Tokenizer,
                     opts: ServeBenchOptions, on_done: OnDone) -> Phase:
    """``opts.no_reuse_requests`` unique prompts against ``url``; a :class:`Phase` named
    ``name@noreuse``. Raises httpx.HTTPError when /metrics cannot be read."""
    prompts = no_reuse_prompts(opts.no_reuse_requests, tokenizer, opts.no_reuse_tokens)
    before = [scrape(u) for u in instances]
    recs, wall = run_sync(run_prompts(url, model, prompts, opts.concurrency, opts.max_tokens, on_done=on_done))
    after = [scrape(u) for u in instances]
    return Phase(name + "@noreuse", recs, wall, [delta(b, a) for b, a in zip(before, after)], None)


def router_view(url: str) -> dict[str, Any] | None:
    """Per backend of the ``kvtier router`` at ``url``: its prefix index and KV-event feed
    (``events_batches``, ``events_silent``); None when ``url`` is no kvtier router."""
    try:
        r = httpx.get(url.rstrip("/") + "/router/state", timeout=10)
        r.raise_for_status()
        backends = r.json()["backends"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return {n: {"index": b.get("index"), "events_batches": (b.get("events") or {}).get("batches"),
                "events_silent": b.get("events_silent"), "served": b.get("served")} for n, b in backends.items()}
