"""``kvtier bench serve``: vLLM's OpenAI server alone, with kvtier, and two instances behind a
router, driven side by side by real clients.

Phases, all in one run (each configuration on freshly started servers, see
:mod:`kvtier.bench.serve.configs`):

1. **Multi-round QA, working set >= 4x engine KV** (:mod:`.workload`): every configuration
   in ``configs``, same users, rounds and concurrency. Engine KV is bounded with
   ``num_gpu_blocks_override`` to ``working set / ratio`` blocks (block size 128; the working
   set is counted prefix-aware from the prompts, sized before the run with ``max_tokens``
   placeholder answers and re-counted after it from the real ones).
2. **No-reuse slice** on ``router-2x``: unique prompts; requests per instance give
   ``max_request_share_ratio_no_reuse`` (max over min).
3. **vLLM's benchmark client** (``prefix_repetition`` and ``random`` datasets) against
   ``vllm`` and ``kvtier-cpu`` (``kvtier-cpu`` only with ``quick``), results as it reports them.
4. **Fits**: ``vllm`` and ``kvtier-cpu`` again, engine KV holding the whole working set
   (``fits_throughput_ratio``).

Top-level JSON figures (None when a configuration they need was not run):

- ``ttft_mean_ratio_vs_vllm``: mean TTFT of ``vllm`` / mean TTFT of ``kvtier-cpu`` (phase 1);
- ``throughput_ratio_vs_vllm``: request throughput of ``kvtier-cpu`` / ``vllm`` (phase 1);
- ``fits_throughput_ratio``: the same ratio in phase 4;
- ``router_hit_rate_ratio_vs_round_robin``: prefix hit rate of ``router-2x`` / ``rr-2x``;
- ``router_hit_rate_vs_oracle``: hit rate of ``router-2x`` / the oracle's on its requests;
- ``max_request_share_ratio_no_reuse``: phase 2 (None if an instance got no request);
- ``answers_identical``: every answer of every other configuration equals ``vllm``'s for
  the same request id (phases 1 and 4); mismatches listed under ``answer_mismatches``.

Request throughput is successful requests per second of wall time of the phase.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.common import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    BenchUsageError,
    Check,
    print_checks,
    write_json,
)
from kvtier.bench.serve.client import RequestRecord, run_prompts, run_sessions, run_sync
from kvtier.bench.serve.configs import (
    CONFIGS,
    ConfigSpec,
    delta,
    hit_rate,
    oracle_hit_rate,
    parse_configs,
    scrape,
)
from kvtier.bench.serve.workload import (
    Tokenizer,
    WorkloadSpec,
    build_sessions,
    engine_blocks_for_ratio,
    no_reuse_prompts,
    placeholder_answers,
    working_set,
    workload_prompts,
)

#: KV bytes per token of SmolLM2-135M (30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes).
KV_BYTES_PER_TOKEN = 23_040
#: Working set over engine KV in phase 1.
WORKING_SET_RATIO = 4.0

DEFAULT_CONFIGS = "vllm,kvtier-cpu,kvtier-cpu-disk,rr-2x,router-2x"


@dataclass(frozen=True)
class Target:
    """An already running configuration: the URL requests go to, and the instances' URLs
    whose /metrics are read (default: the same URL)."""

    url: str
    metrics_urls: tuple[str, ...] = ()

    @property
    def instances(self) -> tuple[str, ...]:
        return self.metrics_urls or (self.url,)


def parse_target(text: str) -> tuple[str, Target]:
    """``NAME=URL[,METRICS_URL...]`` (NAME a configuration, ``NAME@fits`` for phase 4).

    Raises BenchUsageError on a malformed value or unknown name.
    """
    name, sep, rest = text.partition("=")
    base = name.split("@", 1)[0]
    urls = [u.strip() for u in rest.split(",") if u.strip()]
    if not sep or base not in CONFIGS or not urls or name.count("@") > 1 or ("@" in name and not name.endswith("@fits")):
        raise BenchUsageError(f"--url {text!r}: expected NAME[@fits]=URL[,METRICS_URL...] with NAME in {list(CONFIGS)}")
    return name, Target(urls[0].rstrip("/"), tuple(u.rstrip("/") for u in urls[1:]))


@dataclass
class Phase:
    """One configuration's run of one workload."""

    config: str
    records: list[RequestRecord]
    wall_s: float
    metrics: list[dict[str, float]]
    engine_blocks: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.records if r.ok]
        total = {k: sum(m.get(k, 0.0) for m in self.metrics) for k in (self.metrics[0] if self.metrics else {})}
        return {
            "config": self.config,
            "requests": len(self.records),
            "errors": len(self.records) - len(ok),
            "error_samples": [f"{r.request_id}: {r.error}" for r in self.records if not r.ok][:5],
            "wall_s": self.wall_s,
            "request_throughput": len(ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "output_token_throughput": sum(r.output_tokens for r in ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_s": stats([r.ttft for r in ok]),
            "tpot_s": stats([r.tpot for r in ok if r.output_tokens > 1]),
            "itl_s": stats([x for r in ok for x in r.itl]),
            "latency_s": stats([r.latency for r in ok]),
            "hit_rate": hit_rate(total) if total else None,
            "metrics_delta_per_instance": self.metrics,
            "requests_per_instance": [m.get("requests", 0.0) for m in self.metrics],
            "engine_blocks": self.engine_blocks,
            **self.extra,
            "records": [_record(r) for r in self.records],
        }


def _record(r: RequestRecord) -> dict[str, Any]:
    d = r.as_dict()
    d["itl"] = [round(x, 6) for x in d["itl"]]
    return d


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0-100) of a non-empty sequence."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: Sequence[float]) -> dict[str, float] | None:
    """mean, p50, p95, p99, min, max (seconds); None for no samples."""
    if not xs:
        return None
    return {
        "mean": statistics.fmean(xs), "p50": percentile(xs, 50), "p95": percentile(xs, 95),
        "p99": percentile(xs, 99), "min": min(xs), "max": max(xs), "n": float(len(xs)),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def answer_mismatches(phases: dict[str, Phase], baseline: str = "vllm") -> list[dict[str, str]]:
    """Every (config, request id) whose answer differs from ``baseline``'s for the same id.

    Phases named ``X@fits`` compare with ``vllm@fits``. Failed requests count as mismatches
    (their answer is unknown).
    """
    out = []
    for name, ph in phases.items():
        base_name = baseline + ("@fits" if name.endswith("@fits") else "")
        if name == base_name or base_name not in phases or name.endswith("@noreuse"):
            continue
        ref = {r.request_id: r for r in phases[base_name].records}
        for r in ph.records:
            b = ref.get(r.request_id)
            if b is None:
                continue
            if not (r.ok and b.ok) or r.answer != b.answer:
                out.append({"config": name, "request_id": r.request_id, "vllm": b.answer, "got": r.answer,
                            "error": r.error or b.error})
    return out


# -- servers --------------------------------------------------------------------------------
@dataclass
class Running:
    """Servers of one configuration: where requests go, and the instances' URLs."""

    url: str
    instances: list[str]
    model: str


def _wait_http(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        for path in ("/health", "/v1/models"):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + path, timeout=2).status_code == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not answering after {timeout_s:.0f} s")


_ROUTER_SCRIPT = (
    "import sys\n"
    "from kvtier.router.app import RouterServer\n"
    "from kvtier.router.config import RouterConfig, parse_backend\n"
    "policy, model, port, *backends = sys.argv[1:]\n"
    "cfg = RouterConfig(backends=tuple(parse_backend(b) for b in backends), policy=policy, model=model).validate()\n"
    "RouterServer(cfg, port=int(port)).serve_forever()\n"
)


def router_command(backend_args: Sequence[str], model_path: str, policy: str, port: int) -> list[str]:
    """``python -m kvtier.cli router ...`` when the CLI has the command, else the same router
    started from :class:`kvtier.router.app.RouterServer` in a child process."""
    from kvtier import cli

    names = {c.name or getattr(c.callback, "__name__", "") for c in cli.app.registered_commands}
    names |= {g.name for g in cli.app.registered_groups}
    if "router" in names:
        return [sys.executable, "-m", "kvtier.cli", "router", *backend_args, "--model", model_path,
                "--policy", policy, "--port", str(port)]
    return [sys.executable, "-c", _ROUTER_SCRIPT, policy, model_path, str(port),
            *[b for b in backend_args if b != "--backend"]]


@contextlib.contextmanager
def start_config(
    cfg: ConfigSpec, model_path: str, engine_blocks: int, max_model_len: int, kvtier_cpu_bytes: int,
    workdir: Path, tag: str,
) -> Iterator[Running]:
    """Start a configuration's servers (and router); stop them all on exit.

    Raises BenchUsageError when a server or the router does not come up (the message
    names the log file).
    """
    from kvtier.integrations.vllm.serve import ApiServer, ServerSpec, free_port

    servers: list[Any] = []
    router: subprocess.Popen | None = None
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    try:
        specs = []
        for i in range(cfg.instances):
            kv: dict[str, Any] | None = None
            if cfg.kvtier:
                cpu = kvtier_cpu_bytes // 2 if cfg.disk else kvtier_cpu_bytes
                kv = {"cpu_capacity": f"{max(64, cpu >> 20)}MiB"}
                if cfg.disk:
                    disk = workdir / f"disk-{tag}-{i}"
                    disk.mkdir(parents=True, exist_ok=True)
                    kv.update(disk_path=str(disk), disk_capacity=f"{max(256, (4 * kvtier_cpu_bytes) >> 20)}MiB")
            cores = "0-1" if cfg.instances == 1 else str(i % 2)
            events = f"tcp://127.0.0.1:{free_port()}" if cfg.instances > 1 else None
            specs.append((ServerSpec(model=model_path, kvtier=kv, cpu_cores=cores, num_gpu_blocks_override=engine_blocks,
                                     max_model_len=max_model_len, kv_events_endpoint=events), events))
        servers = [ApiServer(s, log_path=str(workdir / f"{tag}-{i}.log")) for i, (s, _) in enumerate(specs)]
        # Started side by side from worker threads kept alive until the servers stop: ApiServer sets
        # PR_SET_PDEATHSIG, which fires when the *thread* that started the child exits.
        pool = concurrent.futures.ThreadPoolExecutor(len(servers))
        futs = [pool.submit(s.start, 300) for s in servers]
        errs = [f.exception() for f in futs]
        if any(errs):
            raise BenchUsageError(f"{tag}: a vLLM server did not start: {str([e for e in errs if e][0])[-1500:]}")
        url = servers[0].url
        if cfg.instances > 1:
            port = free_port()
            backends = []
            for i, (srv, (_, ev)) in enumerate(zip(servers, specs)):
                backends += ["--backend", f"{srv.url}=i{i}" + (f"@{ev}" if ev else "")]
            log = open(workdir / f"{tag}-router.log", "ab")
            router = subprocess.Popen(
                router_command(backends, model_path, cfg.policy or "kv-aware", port),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
            log.close()
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_http(url, router, 120)
            except RuntimeError as exc:
                raise BenchUsageError(f"{tag}: kvtier router did not start ({exc}); log {workdir / (tag + '-router.log')}")

        yield Running(url, [s.url for s in servers], servers[0].served_model_name)
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                router.wait(10)
            if router.poll() is None:
                router.kill()
        for s in servers:
            with contextlib.suppress(Exception):
                s.stop()
        if pool is not None:
            pool.shutdown(wait=True)


def _served_model(url: str) -> str:
    r = httpx.get(url + "/v1/models", timeout=10)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


# -- the run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeBenchOptions:
    """Knobs of one run (see :func:`run_bench_serve`)."""

    users: int = 12
    rounds: int = 3
    concurrency: int = 2
    qps: float | None = None
    max_tokens: int = 16
    system_tokens: int = 300
    context_tokens: tuple[int, int] = (1500, 3000)
    ratio: float = WORKING_SET_RATIO
    no_reuse_requests: int = 16
    no_reuse_tokens: int = 384
    vllm_bench: bool = True
    quick: bool = False

    @staticmethod
    def quick_defaults() -> ServeBenchOptions:
        return ServeBenchOptions(users=6, rounds=2, concurrency=1, context_tokens=(900, 1100),
                                 no_reuse_requests=8, no_reuse_tokens=256, quick=True)


def _load_tokenizer(model_path: str) -> Tokenizer:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


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
) -> int:
    """Run the serving benchmark: print the table, write JSON (``json_path``) and a PNG plot
    (``plot_path``, default ``json_path`` with ``.png``).

    ``targets``: configurations already running (``NAME`` or ``NAME@fits`` -> :class:`Target`);
    then only those are measured, nothing is started and ``tokenizer`` may be given instead
    of loading the model's. Returns 0, or 1 when ``enforce`` and a target of the issue was
    missed or requests failed.

    Raises:
        BenchUsageError: unknown configuration, a working set that cannot be ``ratio`` x
            engine KV, a server that does not start.
    """
    opts = options or (ServeBenchOptions.quick_defaults() if quick else ServeBenchOptions())
    over = {k: v for k, v in dict(users=users, rounds=rounds, concurrency=concurrency, qps=qps).items() if v is not None}
    if vllm_bench is not None:
        over["vllm_bench"] = vllm_bench
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
    per_req = math.ceil((ws.max_prompt_tokens + opts.max_tokens) / BLOCK_SIZE)
    fits_blocks = ws.blocks + opts.concurrency * per_req + 8
    kvtier_cpu_bytes = max(256 << 20, 2 * ws.tokens * KV_BYTES_PER_TOKEN)

    names = [c.name for c in cfgs]
    fits_names = [n for n in ("vllm", "kvtier-cpu") if n in names] if (targets is None) else [
        n.split("@")[0] for n in targets if n.endswith("@fits")]
    bench_names = [n for n in (("kvtier-cpu",) if opts.quick else ("vllm", "kvtier-cpu")) if n in names] if opts.vllm_bench else []
    n_requests = len(sessions) * spec.rounds
    total = n_requests * (len(names) + len(fits_names)) + (opts.no_reuse_requests if "router-2x" in names else 0)

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
    vllm_bench_results: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def measure(name: str, running_url: str, model: str, instances: Sequence[str], blocks: int | None,
                progress: Progress, task: Any) -> Phase:
        before = [scrape(u) for u in instances]
        recs, wall = run_sync(run_sessions(
            running_url, model, sessions, concurrency=opts.concurrency, qps=opts.qps, max_tokens=opts.max_tokens,
            on_done=lambda r: progress.advance(task)))
        after = [scrape(u) for u in instances]
        ph = Phase(name, recs, wall, [delta(b, a) for b, a in zip(before, after)], blocks)
        prompts = workload_prompts(sessions, tokenizer)  # real answers as history
        ph.extra["working_set_blocks_measured"] = working_set(prompts, BLOCK_SIZE).blocks
        usage = {r.request_id: r.prompt_tokens for r in recs}
        ids = [s.request_id(r) for r in range(spec.rounds) for s in sessions]
        ph.extra["prompt_tokens_local_vs_server_mismatches"] = sum(
            1 for rid, p in zip(ids, prompts) if usage.get(rid) and usage[rid] != len(p))
        if len(instances) > 1:
            by_id = dict(zip(ids, prompts))
            order = sorted((r for r in recs), key=lambda r: r.start)
            ph.extra["oracle"] = oracle_hit_rate(
                [(r.request_id.split("-")[0], by_id[r.request_id]) for r in order], len(instances), CHUNK_SIZE)
        return ph

    def no_reuse(name: str, url: str, model: str, instances: Sequence[str], progress: Progress, task: Any) -> Phase:
        prompts = no_reuse_prompts(opts.no_reuse_requests, tokenizer, opts.no_reuse_tokens)
        before = [scrape(u) for u in instances]
        recs, wall = run_sync(run_prompts(url, model, prompts, opts.concurrency, opts.max_tokens,
                                          on_done=lambda r: progress.advance(task)))
        after = [scrape(u) for u in instances]
        return Phase(name + "@noreuse", recs, wall, [delta(b, a) for b, a in zip(before, after)], None)

    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            task = progress.add_task("requests", total=total)
            plan: list[tuple[str, ConfigSpec, int | None]] = [(c.name, c, engine_blocks) for c in cfgs]
            plan += [(f"{n}@fits", CONFIGS[n], fits_blocks) for n in fits_names]
            if targets is not None:
                plan = [(label, cfg, b) for label, cfg, b in plan if label in targets]
            for label, cfg, blocks in plan:
                progress.update(task, description=f"{label}: starting")
                try:
                    with contextlib.ExitStack() as stack:
                        if targets is not None:
                            t = targets[label]
                            url, instances, model = t.url, list(t.instances), _served_model(t.url)
                            blocks = None
                        else:
                            run = stack.enter_context(start_config(
                                cfg, str(model_path), int(blocks or 0), max_model_len, kvtier_cpu_bytes, workdir,
                                label.replace("@", "-")))
                            url, instances, model = run.url, run.instances, run.model
                        progress.update(task, description=f"{label}: multi-round QA")
                        phases[label] = measure(label, url, model, instances, blocks, progress, task)
                        if label == "router-2x":
                            progress.update(task, description=f"{label}: no-reuse slice")
                            phases[label + "@noreuse"] = no_reuse(label, url, model, instances, progress, task)
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
    finally:
        shutil.rmtree(workdir / "disk", ignore_errors=True)
        for p in workdir.glob("disk-*"):
            shutil.rmtree(p, ignore_errors=True)

    result = summarize(phases, opts, ws, engine_blocks, fits_blocks, max_model_len)
    result["vllm_bench_serve"] = vllm_bench_results
    result["config_errors"] = errors
    result["server_logs"] = str(workdir)
    print_table(phases, console)
    checks = checks_of(result)
    print_checks("kvtier bench serve (issue 10 targets)", checks)
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


def summarize(phases: dict[str, Phase], opts: ServeBenchOptions, ws: Any, engine_blocks: int,
              fits_blocks: int, max_model_len: int) -> dict[str, Any]:
    """The JSON document: the issue's top-level figures, then every phase in detail."""
    s = {k: p.summary() for k, p in phases.items()}

    def get(name: str, *path: str) -> Any:
        v: Any = s.get(name)
        for p in path:
            if not isinstance(v, dict):
                return None
            v = v.get(p)
        return v

    kv = "kvtier-cpu" if "kvtier-cpu" in s else "kvtier-cpu-disk"
    router_oracle = get("router-2x", "oracle", "hit_rate")
    nr = s.get("router-2x@noreuse")
    share = None
    if nr:
        counts = nr["requests_per_instance"]
        share = max(counts) / min(counts) if counts and min(counts) > 0 else None
    mism = answer_mismatches(phases)
    has_base = "vllm" in phases and len(phases) > 1
    return {
        "ttft_mean_ratio_vs_vllm": _ratio(get("vllm", "ttft_s", "mean"), get(kv, "ttft_s", "mean")),
        "throughput_ratio_vs_vllm": _ratio(get(kv, "request_throughput"), get("vllm", "request_throughput")),
        "fits_throughput_ratio": _ratio(get(f"{kv}@fits", "request_throughput"), get("vllm@fits", "request_throughput")),
        "router_hit_rate_ratio_vs_round_robin": _ratio(get("router-2x", "hit_rate"), get("rr-2x", "hit_rate")),
        "router_hit_rate_vs_oracle": _ratio(get("router-2x", "hit_rate"), router_oracle),
        "max_request_share_ratio_no_reuse": share,
        "answers_identical": (not mism) if has_base else None,
        "answer_mismatches": mism,
        "kvtier_config_in_ratios": kv,
        "working_set_blocks": ws.blocks,
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
            "context_tokens": list(opts.context_tokens), "no_reuse_requests": opts.no_reuse_requests,
            "no_reuse_tokens": opts.no_reuse_tokens, "quick": opts.quick, "endpoint": "/v1/chat/completions",
            "temperature": 0.0, "stream": True,
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
    if result.get("answers_identical") is not None:
        out.append(Check("answers identical to vLLM alone", 1.0 if result["answers_identical"] else 0.0, 1.0, True,
                         note=f"{len(result['answer_mismatches'])} mismatches"))
    return out


def print_table(phases: dict[str, Phase], console: Any) -> None:
    from rich.table import Table

    t = Table(title="kvtier bench serve: per configuration")
    for col in ("config", "requests", "errors", "req/s", "TTFT mean", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50",
                "hit rate", "req per instance"):
        t.add_column(col, justify="left" if col == "config" else "right")

    def ms(x: dict[str, float] | None, k: str) -> str:
        return f"{x[k] * 1000:.0f} ms" if x else "-"

    for name, ph in phases.items():
        s = ph.summary()
        t.add_row(name, str(s["requests"]), str(s["errors"]), f"{s['request_throughput']:.3f}",
                  ms(s["ttft_s"], "mean"), ms(s["ttft_s"], "p50"), ms(s["ttft_s"], "p99"), ms(s["tpot_s"], "p50"),
                  ms(s["itl_s"], "p50"), f"{s['hit_rate']:.1%}" if s["hit_rate"] is not None else "-",
                  "/".join(f"{x:.0f}" for x in s["requests_per_instance"]))
    from rich.console import Console

    Console(file=console.file, width=max(console.width, 150)).print(t)


def plot(phases: dict[str, Phase], path: Path) -> None:
    """PNG: TTFT CDF per configuration (left), request throughput bars (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for name, ph in phases.items():
        if name.endswith("@noreuse"):
            continue
        xs = sorted(r.ttft for r in ph.records if r.ok)
        if xs:
            ax1.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("time to first token (s, log scale)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT CDF, multi-round QA")
    ax1.legend(fontsize=8)
    bars = [(n, p.summary()["request_throughput"]) for n, p in phases.items() if not n.endswith("@noreuse")]
    ax2.bar([n for n, _ in bars], [v for _, v in bars], color=["C%d" % i for i in range(len(bars))])
    ax2.set_ylabel("requests / s")
    ax2.set_title("request throughput")
    ax2.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
