"""``kvtier bench serve``: vLLM's OpenAI server alone, with kvtier, and two instances behind a
router, driven side by side by real clients.

Phases, all in one run (each configuration on freshly started servers, see
:mod:`kvtier.bench.serve.configs`):

1. **Multi-round QA, working set >= 4x engine KV** (:mod:`.workload`): every configuration
   in ``configs``, in the order given, same users, rounds, concurrency and rate. Engine KV
   is bounded with ``num_gpu_blocks_override`` to ``working set / ratio`` blocks (block size
   128; the working set is counted prefix-aware from the prompts, sized before the run with
   ``max_tokens`` placeholder answers and re-counted after it from the real ones).
   ``--workload lmbench`` gives it LMBenchmark's multi-round QA shape
   (:meth:`.options.ServeBenchOptions.lmbench_defaults`).
2. **No-reuse control** on every single-instance configuration and ``router-2x``: unique
   prompts (``no_reuse_throughput_ratio``); on ``router-2x`` requests per instance give
   ``max_request_share_ratio_no_reuse`` (max over min).
3. **vLLM's benchmark client** (``prefix_repetition`` and ``random`` datasets) against
   ``vllm`` and ``kvtier-cpu`` (``kvtier-cpu`` only with ``quick``), results as it reports
   them; with ``lmcache_cli``, **LMCache's client** (``lmcache bench engine``, workloads
   ``multi-round-chat`` and ``long-doc-qa``) against vllm, kvtier-cpu, kvtier-cpu-disk and
   lmcache-mp (:mod:`.lmcache_client`).
4. **Fits** (unless ``--no-fits``): ``vllm`` and ``kvtier-cpu`` again, engine KV holding the
   whole working set (``fits_throughput_ratio``): both servers up, ``fits_reps`` reps each
   on fresh users, turns in ABBA order (:mod:`.fits_ab`; per-rep ratios under ``fits_interleaved``).
5. **Answer check**, one request at a time on ``vllm`` (paired order: engine-resident hits),
   ``vllm@fits``, ``kvtier-cpu``, ``kvtier-cpu-disk``, ``kvtier-cpu@fits`` and ``lmcache-mp``
   (see :mod:`.answer_check`); its hits' TTFT give ``isolated_hit_ttft_ratio_vs_vllm``.

kvtier's CPU tier holds twice the working set's stored footprint (its full blocks: kvtier
stores no partial chunk) in ``kvtier-cpu`` (half of it in ``kvtier-cpu-disk``, the disk
below), and ``fleet_cpu_fraction`` (0.6) of it on each of the two instances of ``rr-2x`` and ``router-2x``: the pair holds the whole working set only
when each user's requests stay on one instance, which is what a KV-aware router buys a
fleet (round robin makes every instance cache every user).

Top-level JSON figures (None when a configuration they need was not run):

- issue 30, the side by side with LMCache (``side_by_side`` has the per-configuration
  figures): ``ttft_mean_ratio_vs_lmcache`` (mean TTFT of ``lmcache-mp`` / ``kvtier-cpu``'s,
  phase 1), ``throughput_ratio_vs_lmcache`` (request throughput of ``kvtier-cpu`` /
  ``lmcache-mp``'s), ``ttft_later_rounds_ratio_vs_vllm`` (= ``ttft_mean_ratio_vs_vllm_later_rounds``),
  ``no_reuse_throughput_ratio`` (phase 2, ``kvtier-cpu`` / ``vllm``; LMCache's beside it as
  ``no_reuse_throughput_ratio_lmcache``), ``isolated_hit_ttft_ratio_vs_vllm`` (phase 5: mean
  TTFT of kvtier's hits / vLLM's engine-resident hits on the same prompts; LMCache's as
  ``isolated_hit_ttft_ratio_lmcache_vs_vllm``), ``answers_identical_lmcache``, and
  ``lmcache_bench_engine`` / ``lmcache_bench_engine_ratios`` (LMCache's client, as it reports);

- ``ttft_mean_ratio_vs_vllm``: mean TTFT of ``vllm`` / mean TTFT of ``kvtier-cpu`` (phase 1,
  every request, first rounds included); ``ttft_mean_ratio_vs_vllm_later_rounds``: the
  same over rounds 2.. only (a user's first round is a miss everywhere);
- ``throughput_ratio_vs_vllm``: request throughput of ``kvtier-cpu`` / ``vllm`` (phase 1);
- ``fits_throughput_ratio``: the same ratio in phase 4, pooled over its reps (each rep's
  ratio, the turn order and the spread under ``fits_interleaved``);
- ``router_hit_rate_ratio_vs_round_robin``: prefix hit rate of ``router-2x`` / ``rr-2x``;
- ``router_hit_rate_vs_oracle``: hit rate of ``router-2x`` / the oracle's on its requests;
- ``max_request_share_ratio_no_reuse``: phase 2 (None if an instance got no request);
- ``answers_identical``: the serial answer check (:mod:`.answer_check`): every kvtier
  answer equals ``vllm@fits``'s (else ``vllm``'s) engine-resident hit at the same split; mismatches under
  ``answer_mismatches``. The concurrent phases' answers are compared for information only
  (``concurrent_answer_agreement``): batching changes bf16 rounding, vLLM alone included.

Request throughput is successful requests per second of wall time of the phase.

Modules: :mod:`.options` (knobs, ``--url`` targets), :mod:`.servers` (start-up of a
configuration), :mod:`.measure` (one configuration's phases), :mod:`.phase` (a phase, its
statistics, answer comparison), :mod:`.figures` (the JSON keys, checks), :mod:`.report`
(table, plot). Their public names are importable from here too.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import httpx

from kvtier.bench.common import BLOCK_SIZE, BenchUsageError, print_checks, write_json
from kvtier.bench.serve.answer_check import CHECKED, PAIRED, check_sessions, run_check
from kvtier.bench.serve.client import RequestRecord
from kvtier.bench.serve.configs import CONFIGS, ConfigSpec, delta, parse_configs
from kvtier.bench.serve.figures import SIDE_BY_SIDE, checks_of, summarize
from kvtier.bench.serve.lmcache_client import LMCACHE_WORKLOADS, client_ratios
from kvtier.bench.serve.lmcache_mp import LMCacheVenv, l1_size_gib, scrape_lmcache
from kvtier.bench.serve.fits_ab import fits_working_set, run_fits_interleaved
from kvtier.bench.serve.measure import measure_no_reuse, measure_sessions
from kvtier.bench.serve.options import (
    DEFAULT_CONFIGS,
    KV_BYTES_PER_TOKEN,
    WORKING_SET_RATIO,
    ServeBenchOptions,
    Target,
    parse_target,
)
from kvtier.bench.serve.phase import Phase, answer_mismatches, percentile, stats
from kvtier.bench.serve.report import plot, print_side_by_side, print_table
from kvtier.bench.serve.servers import (
    Running,
    router_command,
    served_model,
    start_config,
)
from kvtier.bench.serve.workload import (
    Tokenizer,
    WorkloadSpec,
    build_sessions,
    engine_blocks_for_ratio,
    placeholder_answers,
    working_set,
    workload_prompts,
)

__all__ = [
    "DEFAULT_CONFIGS", "KV_BYTES_PER_TOKEN", "WORKING_SET_RATIO", "Phase", "Running", "ServeBenchOptions", "Target",
    "answer_mismatches", "checks_of", "parse_target", "percentile", "plot", "print_table", "router_command",
    "run_bench_serve", "served_model", "start_config", "stats", "summarize",
]


def _load_tokenizer(model_path: str) -> Tokenizer:
    from transformers import AutoTokenizer

    # transformers types decode() as ``str | list[str]`` (ids in one flat list decode to a str).
    return cast(Tokenizer, AutoTokenizer.from_pretrained(model_path))


def run_bench_serve(
    json_path: Path | None = None,
    configs: str = DEFAULT_CONFIGS,
    users: int | None = None,
    rounds: int | None = None,
    concurrency: int | None = None,
    qps: float | None = None,
    quick: bool = False,
    targets: dict[str, Target] | None = None,
    vllm_bench: bool | None = None,
    model_path: str | None = None,
    tokenizer: Tokenizer | None = None,
    plot_path: Path | None = None,
    options: ServeBenchOptions | None = None,
    enforce: bool = False,
    workload: str = "default",
    fits: bool | None = None,
    lmcache_venv: Path | None = None,
    lmcache_chunk_size: int = BLOCK_SIZE,
    lmcache_cli: Path | None = None,
    cpu_cores: str | None = None,
    lmcache_cli_configs: str | None = None,
    no_reuse_requests: int | None = None,
) -> int:
    """Run the serving benchmark: print the table, write JSON (``json_path``) and a PNG plot
    (``plot_path``, default ``json_path`` with ``.png``).

    ``targets``: configurations already running (``NAME`` or ``NAME@fits`` -> :class:`Target`);
    then only those are measured, nothing is started and ``tokenizer`` may be given instead
    of loading the model's. ``workload``: the preset of :data:`.options.WORKLOADS` (ignored
    when ``options`` is given). ``fits``: run phase 4 (default: the options'). ``lmcache_venv``:
    LMCache's virtual environment, needed by ``lmcache-mp`` (:mod:`.lmcache_mp`; LMCache's
    chunk ``lmcache_chunk_size`` tokens). ``lmcache_cli``: LMCache's ``lmcache`` command of
    the ``lmcache-cli`` package; with it, ``lmcache bench engine`` runs against every
    configuration of the side by side (:mod:`.lmcache_client`), or only those of
    ``lmcache_cli_configs`` (comma-separated). ``no_reuse_requests``: prompts of the no-reuse
    control (default the preset's). Returns 0, or 1 when
    ``enforce`` and a target of the issue was missed or requests failed.

    Raises:
        BenchUsageError: unknown configuration or workload, a working set that cannot be
            ``ratio`` x engine KV, a server that does not start, ``lmcache-mp`` without a
            usable ``lmcache_venv``.
    """
    opts = options or ServeBenchOptions.preset(workload, quick)
    over: dict[str, Any] = {k: v for k, v in dict(users=users, rounds=rounds, concurrency=concurrency, qps=qps,
                                  no_reuse_requests=no_reuse_requests).items() if v is not None}
    if vllm_bench is not None:
        over["vllm_bench"] = vllm_bench
    if fits is not None:
        over["fits"] = fits
    if cpu_cores is not None:
        over["cpu_cores"] = cpu_cores
    if lmcache_cli_configs is not None:
        picked = tuple(n.strip() for n in lmcache_cli_configs.split(",") if n.strip())
        if not picked or any(n not in SIDE_BY_SIDE for n in picked):
            raise BenchUsageError(f"--lmcache-cli-configs {lmcache_cli_configs!r}: choose from {', '.join(SIDE_BY_SIDE)}")
        over["lmcache_client_configs"] = picked
    opts = ServeBenchOptions(**{**opts.__dict__, **over})
    try:
        cfgs = parse_configs(configs) if not targets else [CONFIGS[n.split("@")[0]] for n in dict.fromkeys(
            n.split("@")[0] for n in targets)]
        spec = WorkloadSpec(users=opts.users, rounds=opts.rounds, system_tokens=opts.system_tokens,
                            context_tokens=opts.context_tokens, max_tokens=opts.max_tokens)
    except ValueError as exc:
        raise BenchUsageError(str(exc)) from None
    if opts.concurrency < 1:
        raise BenchUsageError("--concurrency must be >= 1")
    lmc: LMCacheVenv | None = None
    if any(c.lmcache for c in cfgs) and not targets:
        if lmcache_venv is None:
            raise BenchUsageError("lmcache-mp needs --lmcache-venv PATH (LMCache and vLLM in their own venv; "
                                  "see benchmarks/README.md)")
        lmc = LMCacheVenv(Path(lmcache_venv).expanduser(), lmcache_chunk_size).check()
    if lmcache_cli is not None and not os.access(Path(lmcache_cli).expanduser(), os.X_OK):
        raise BenchUsageError(f"--lmcache-cli {lmcache_cli}: not an executable (LMCache's `lmcache` command)")

    if targets is None or model_path is not None or tokenizer is None:
        if model_path is None:
            from kvtier.demo.model import prepare_model

            model_path = str(prepare_model().path)
        if tokenizer is None:
            tokenizer = _load_tokenizer(model_path)
    assert tokenizer is not None
    sessions = build_sessions(spec, tokenizer)
    ws = working_set(workload_prompts(sessions, tokenizer, placeholder_answers(spec)), BLOCK_SIZE)
    max_model_len = math.ceil((ws.max_prompt_tokens + opts.max_tokens + 128) / BLOCK_SIZE) * BLOCK_SIZE
    try:
        engine_blocks = engine_blocks_for_ratio(ws, opts.ratio, opts.concurrency, max_model_len, opts.max_tokens)
    except ValueError as exc:
        if targets is None:
            raise BenchUsageError(str(exc)) from None
        engine_blocks = max(1, int(ws.blocks // opts.ratio))  # given servers: their bound is not ours
    # Phase 4 runs ``fits_reps`` workloads on other users each (fits_ab.py): size on the largest.
    fits_ws, fits_longest = fits_working_set(spec, tokenizer, opts.fits_reps, BLOCK_SIZE)
    per_req = math.ceil((max(ws.max_prompt_tokens, fits_longest) + opts.max_tokens) / BLOCK_SIZE)
    fits_blocks = max(ws.blocks, fits_ws) + opts.concurrency * per_req + 8
    fits_model_len = max(max_model_len, per_req * BLOCK_SIZE + 128)
    # Tier capacities on the stored footprint (full chunks; chunk = engine block here): kvtier
    # never stores a prompt's partial last block, so sizing on ``ws.blocks`` gave each
    # instance of the pair ~0.9 of what it stores instead of fleet_cpu_fraction.
    kvtier_cpu_bytes = max(256 << 20, 2 * ws.full_tokens * KV_BYTES_PER_TOKEN)
    fleet_cpu_bytes = max(4 * ws.max_prompt_tokens * KV_BYTES_PER_TOKEN,
                          int(opts.fleet_cpu_fraction * ws.full_tokens * KV_BYTES_PER_TOKEN))

    names = [c.name for c in cfgs]
    fits_names = ([n for n in ("vllm", "kvtier-cpu") if n in names] if opts.fits else []) if (targets is None) else [
        n.split("@")[0] for n in targets if n.endswith("@fits")]
    bench_names = [n for n in (("kvtier-cpu",) if opts.quick else ("vllm", "kvtier-cpu")) if n in names] if opts.vllm_bench else []
    n_requests = len(sessions) * spec.rounds
    check_users = check_sessions(spec, tokenizer, opts.check_users or opts.users)
    n_checked = sum(1 for n in [*names, *(f + "@fits" for f in fits_names)] if n in CHECKED)
    interleave = {"vllm", "kvtier-cpu"} <= set(fits_names)  # phase 4 as ABBA turns (fits_ab.py)
    no_reuse_names = [c.name for c in cfgs if c.instances == 1 or c.name == "router-2x"]
    total = (n_requests * (len(names) + len(fits_names) * (opts.fits_reps if interleave else 1))
             + opts.no_reuse_requests * len(no_reuse_names) + n_checked * 2 * len(check_users))

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console()
    console.print(
        f"kvtier bench serve: {opts.users} users x {opts.rounds} rounds, concurrency {opts.concurrency}, "
        f"working set {ws.blocks} blocks of {BLOCK_SIZE} = {ws.blocks / engine_blocks:.2f}x engine KV "
        f"({engine_blocks} blocks); configs {', '.join(names)}"
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-"))
    phases: dict[str, Phase] = {}
    check_runs: dict[str, list[RequestRecord]] = {}
    vllm_bench_results: dict[str, Any] = {}
    lmcache_client_results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    fits_info: dict[str, Any] | None = None

    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            task = progress.add_task("requests", total=total)

            def on_done(_r: RequestRecord) -> None:
                progress.advance(task)

            plan: list[tuple[str, ConfigSpec, int | None]] = [(c.name, c, engine_blocks) for c in cfgs]
            plan += [(f"{n}@fits", CONFIGS[n], fits_blocks) for n in fits_names if not interleave]
            if targets is not None:
                plan = [(label, cfg, b) for label, cfg, b in plan if label in targets]
            for label, cfg, blocks in plan:
                progress.update(task, description=f"{label}: starting")
                try:
                    with contextlib.ExitStack() as stack:
                        lmc_http: str | None = None
                        if targets is not None:
                            t = targets[label]
                            url, instances, model = t.url, list(t.instances), served_model(t.url)
                            blocks = None
                        else:
                            run = stack.enter_context(start_config(
                                cfg, str(model_path), int(blocks or 0), max_model_len,
                                fleet_cpu_bytes if cfg.instances > 1 else kvtier_cpu_bytes, workdir,
                                label.replace("@", "-"), lmcache=lmc, cores=opts.cpu_cores))
                            url, instances, model = run.url, run.instances, run.model
                            lmc_http = run.lmcache_http
                        progress.update(task, description=f"{label}: multi-round QA")
                        lmc_before = scrape_lmcache(lmc_http) if lmc_http else None
                        phases[label] = measure_sessions(label, url, model, instances, blocks, sessions, spec,
                                                         tokenizer, opts, on_done)
                        if lmc_http and lmc_before is not None:
                            phases[label].extra["lmcache_server"] = delta(lmc_before, scrape_lmcache(lmc_http))
                        if label in CHECKED:
                            progress.update(task, description=f"{label}: answer check (serial)")
                            check_runs[label] = run_check(url, model, check_users, opts.max_tokens, on_done,
                                                          paired=label in PAIRED)
                        if label in no_reuse_names:
                            progress.update(task, description=f"{label}: no-reuse control")
                            phases[label + "@noreuse"] = measure_no_reuse(label, url, model, instances, tokenizer,
                                                                          opts, on_done)
                        if (lmcache_cli is not None and label in (opts.lmcache_client_configs or SIDE_BY_SIDE)
                                and model_path is not None):
                            from kvtier.bench.serve.lmcache_client import run_lmcache_bench

                            for wl in LMCACHE_WORKLOADS:
                                progress.update(task, description=f"{label}: lmcache bench engine {wl}")
                                lmcache_client_results.setdefault(label, {})[wl] = run_lmcache_bench(
                                    Path(lmcache_cli).expanduser(), url, model, wl, opts, engine_blocks,
                                    workdir / f"lmcache-bench-{label}-{wl}", max_model_len=max_model_len)
                        if label in bench_names and model_path is not None:
                            for ds in ("prefix_repetition", "random"):
                                progress.update(task, description=f"{label}: vllm bench serve {ds}")
                                from kvtier.bench.serve.vllm_client import (
                                    run_vllm_bench,
                                )

                                vllm_bench_results.setdefault(label, {})[ds] = run_vllm_bench(
                                    url, model, str(model_path), ds, opts.concurrency, opts.quick)
                except (BenchUsageError, httpx.HTTPError, OSError, RuntimeError) as exc:
                    if targets is not None and isinstance(exc, BenchUsageError):
                        raise
                    errors[label] = str(exc)[-2000:]
                    console.print(f"[red]{label}: {str(exc)[:500]}[/red]")
            if interleave:
                fits_info = run_fits_interleaved(targets, model_path, fits_blocks, fits_model_len, kvtier_cpu_bytes, workdir,
                                              spec, tokenizer, opts, on_done, check_users, phases, check_runs, errors,
                                              progress, task, console)
    finally:
        shutil.rmtree(workdir / "disk", ignore_errors=True)
        for p in workdir.glob("disk-*"):
            shutil.rmtree(p, ignore_errors=True)

    result = summarize(phases, opts, ws, engine_blocks, fits_blocks, max_model_len, check_runs)
    result["kvtier_cpu_bytes"] = {"single_instance": kvtier_cpu_bytes, "per_instance_of_two": fleet_cpu_bytes}
    result["vllm_bench_serve"] = vllm_bench_results
    result["lmcache_bench_engine"] = lmcache_client_results
    result["lmcache_bench_engine_ratios"] = client_ratios(lmcache_client_results, own={
        "ttft_mean_ratio_vs_lmcache": result["ttft_mean_ratio_vs_lmcache"],
        "throughput_ratio_vs_lmcache": result["throughput_ratio_vs_lmcache"],
        "ttft_mean_ratio_vs_vllm": result["ttft_mean_ratio_vs_vllm"],
        "throughput_ratio_vs_vllm": result["throughput_ratio_vs_vllm"]})
    result["lmcache"] = None if lmc is None else {"venv": str(lmc.root), "chunk_size": lmc.chunk_size,
                                                  "l1_size_gib": l1_size_gib(kvtier_cpu_bytes)}
    result["config_errors"] = errors
    result["fits_interleaved"] = fits_info
    result["server_logs"] = str(workdir)
    print_table(phases, console)
    print_side_by_side(result["side_by_side"], console)
    checks = checks_of(result)
    print_checks("kvtier bench serve (targets of issues 10 and 30)", checks)
    write_json(json_path, result)
    png = plot_path or (Path(json_path).with_suffix(".png") if json_path is not None and str(json_path) != "-" else None)
    if png is not None:
        try:
            plot(phases, png)
            result["plot"] = str(png)
            write_json(json_path, result)
        except ModuleNotFoundError:
            console.print("matplotlib is not installed (pip install 'kvtier[bench]'): no plot")
    console.print(f"server logs: {workdir}")
    if enforce and (errors or any(not c.passed for c in checks)):
        return 1
    return 0
