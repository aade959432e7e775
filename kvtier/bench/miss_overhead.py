"""``kvtier bench miss-overhead``: what kvtier costs when nothing is ever reused.

Workload: distinct random-token prompts of 1,000 to 2,000 tokens with short
outputs, run one at a time through vLLM (SmolLM2-135M, CPU backend, in-process
engine), so every lookup misses. Configurations, each in a fresh subprocess:

- ``off``: no connector (the baseline);
- ``cpu``: connector, CPU tier only, saving every full prompt chunk;
- ``cpu_nosave``: connector, CPU tier, ``save=False`` (lookups only);
- ``disk``: connector, CPU + disk tier (write-behind), saving;
- ``disk_nosave``: connector, CPU + disk tier, ``save=False``.

Saving is real work even without reuse (every prompt is stored), so both are
reported. Each round runs every configuration once on the same prompts (new
prompts each round), in a rotated order, so drift on the shared machine
spreads over all configurations. Per round, throughput = (prompt + output
tokens) / summed request seconds; the ratio with/without is taken per round
and its median reported. Per-request overhead pairs each request with the same
prompt's request in ``off`` of the same round (median of the differences).

Because two engine runs on a shared 2-vCPU machine can differ by 2x in speed,
each run also times the connector's own methods inside the engine step (same
process, same load): ``median_connector_pct`` is kvtier's synchronous share of
each request's time, the noise-robust view of the same overhead (background
disk write-behind is not included in it).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvtier.bench.common import Check, print_checks, write_json

#: Target: at most 2% throughput loss with no reuse.
MISS_RATIO_TARGET = 0.98

CONFIGS: tuple[str, ...] = ("off", "cpu", "cpu_nosave", "disk", "disk_nosave")
#: Bound on every count and length of :class:`MissBenchSizes` (tokens, requests, rounds).
MAX_SIZE = 32_768


@dataclass(frozen=True)
class MissBenchSizes:
    """Sizes of one ``bench miss-overhead`` run.

    Attributes:
        rounds: rounds (each runs every configuration once).
        requests: timed prompts per run.
        min_tokens / max_tokens: prompt length range (tokens).
        output_tokens: generated tokens per request.
        configs: configurations to run (``off`` is always included).
        warmup_requests / warmup_tokens: unrecorded prompts (and their length in tokens)
            each engine runs before the timed ones (first-call costs: kernels, allocator).

    Raises:
        ValueError: a size that is not an integer in its range (counts >= 1, lengths 1..32,768
            tokens, min_tokens <= max_tokens, warm-up no longer than the longest timed prompt's
            context).
    """

    rounds: int = 3
    requests: int = 6
    min_tokens: int = 1000
    max_tokens: int = 2000
    output_tokens: int = 8
    configs: tuple[str, ...] = CONFIGS
    warmup_requests: int = 2
    warmup_tokens: int = 1500

    def __post_init__(self) -> None:
        for name in ("rounds", "requests", "min_tokens", "max_tokens", "output_tokens", "warmup_requests",
                     "warmup_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE:
                raise ValueError(f"bench miss-overhead: {name}={v!r} must be an integer in 1..{MAX_SIZE}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"bench miss-overhead: min_tokens={self.min_tokens} > max_tokens={self.max_tokens}")
        if self.warmup_tokens + self.output_tokens + 16 > max(4096, self.max_tokens + self.output_tokens + 16):
            raise ValueError(f"bench miss-overhead: warmup_tokens={self.warmup_tokens} does not fit the engine's "
                             f"context ({max(4096, self.max_tokens + self.output_tokens + 16)} tokens)")

    @classmethod
    def quick(cls) -> "MissBenchSizes":
        return cls(rounds=1, requests=2, configs=("off", "cpu"))


def kvtier_config(label: str, run_dir: Path) -> dict[str, Any] | None:
    """The ``kv_connector_extra_config`` of a configuration (None: no connector).

    Raises:
        ValueError: unknown label.
    """
    if label == "off":
        return None
    if label not in CONFIGS:
        raise ValueError(f"unknown configuration {label!r}; choose from {CONFIGS}")
    cfg: dict[str, Any] = {"cpu_capacity": "1GiB"}
    if label.startswith("disk"):
        cfg["disk_path"] = str(run_dir / "disk")
    if label.endswith("_nosave"):
        cfg["save"] = False
    return cfg


def make_prompts(sizes: MissBenchSizes, seed: int, vocab_size: int) -> list[list[int]]:
    """Distinct random-token prompts (no shared prefix beyond chance)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sizes.requests):
        n = int(rng.integers(sizes.min_tokens, sizes.max_tokens + 1))
        out.append([int(t) for t in rng.integers(100, vocab_size - 100, size=n)])
    return out


def engine_env(base: dict[str, str]) -> dict[str, str]:
    """Environment of an engine subprocess: in-process vLLM, 1 GiB of KV space."""
    from kvtier.integrations.vllm_engine import engine_env as vllm_engine_env

    return vllm_engine_env(base, in_process=True)


def _run_engine(spec: dict[str, Any], log_path: Path, timeout_s: float) -> dict[str, Any]:
    spec_path = Path(spec["result_path"]).with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "ab") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier.bench.engine_run", str(spec_path)],
            env=engine_env(dict(os.environ)),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"engine run {spec['label']} failed (exit {proc.returncode}); see {log_path}")
    return json.loads(Path(spec["result_path"]).read_text())


def _throughput(run: dict[str, Any]) -> float:
    reqs = run["requests"]
    tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in reqs)
    return tokens / sum(r["seconds"] for r in reqs)


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Ratios and per-request overheads from engine results.

    Args:
        rounds: per round, ``{label: engine_run result}``; every round has ``"off"``.

    Returns:
        ``{label: {"throughput_ratio", "throughput_ratios", "median_overhead_ms",
        "median_overhead_pct", "tokens_per_s"}}`` for every label but ``off``, plus
        ``off``'s ``tokens_per_s``.

    Raises:
        ValueError: a round lacks ``off`` or runs with different prompts are paired.
    """
    labels = sorted({k for r in rounds for k in r if k != "off"})
    out: dict[str, Any] = {"off": {"tokens_per_s": [_throughput(r["off"]) for r in rounds if "off" in r]}}
    for label in labels:
        ratios, diffs_ms, rel = [], [], []
        tps, hook_pct = [], []
        for r in rounds:
            if "off" not in r:
                raise ValueError("every round needs the 'off' baseline")
            if label not in r:
                continue
            base, run = r["off"], r[label]
            if [q["prompt_tokens"] for q in base["requests"]] != [q["prompt_tokens"] for q in run["requests"]]:
                raise ValueError(f"round with different prompts for 'off' and {label!r}")
            tps.append(_throughput(run))
            ratios.append(_throughput(run) / _throughput(base))
            for a, b in zip(run["requests"], base["requests"]):
                diffs_ms.append((a["seconds"] - b["seconds"]) * 1e3)
                rel.append(a["seconds"] / b["seconds"] - 1)
                if "connector_seconds" in a:
                    hook_pct.append(100 * a["connector_seconds"] / a["seconds"])
        out[label] = {
            "throughput_ratio": statistics.median(ratios),
            "throughput_ratios": ratios,
            "median_overhead_ms": statistics.median(diffs_ms),
            "median_overhead_pct": 100 * statistics.median(rel),
            "tokens_per_s": tps,
            # kvtier's synchronous time inside the engine step, as % of each request
            # (same process, same load: robust to machine noise; see engine_run).
            "median_connector_pct": statistics.median(hook_pct) if hook_pct else None,
        }
    return out


def run_miss_overhead_bench(
    sizes: MissBenchSizes,
    work_dir: Path | None = None,
    log: Callable[[str], None] = print,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Run the rounds (engine subprocesses) and return the JSON document.

    Raises:
        RuntimeError: an engine run failed (its log path is in the message).
        kvtier.demo.model.ModelPrepError: the model cannot be prepared.
    """
    from kvtier.demo.model import prepare_model

    model = prepare_model(on_step=lambda m: log(f"model: {m}")).path
    vocab = int(json.loads((model / "config.json").read_text()).get("vocab_size", 49152))
    configs = ("off",) + tuple(c for c in sizes.configs if c != "off")
    cache = Path.home() / ".cache" / "kvtier"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-miss-", dir=work_dir or cache))
    log_path = tmp / "engines.log"
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        warmup = make_prompts(MissBenchSizes(requests=sizes.warmup_requests, min_tokens=sizes.warmup_tokens,
                                             max_tokens=sizes.warmup_tokens), 10_000, vocab)
        for rnd in range(sizes.rounds):
            prompts = make_prompts(sizes, rnd, vocab)
            order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
            results: dict[str, dict[str, Any]] = {}
            for label in order:
                run_dir = tmp / f"r{rnd}-{label}"
                run_dir.mkdir()
                spec = dict(
                    label=label,
                    model=str(model),
                    prompts=prompts,
                    warmup=warmup,
                    output_tokens=sizes.output_tokens,
                    max_model_len=max(4096, sizes.max_tokens + sizes.output_tokens + 16),
                    kvtier=kvtier_config(label, run_dir),
                    result_path=str(run_dir / "result.json"),
                )
                t0 = time.perf_counter()
                results[label] = _run_engine(spec, log_path, timeout_s)
                log(
                    f"round {rnd + 1}/{sizes.rounds} {label}: {_throughput(results[label]):,.0f} tokens/s "
                    f"({time.perf_counter() - t0:.0f} s with start-up)"
                )
                shutil.rmtree(run_dir / "disk", ignore_errors=True)
            rounds.append(results)
    except Exception:
        kept = cache / "bench-miss-last.log"
        if log_path.exists():
            shutil.copy(log_path, kept)
            log(f"engine logs kept in {kept}")
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize(rounds)
    out: dict[str, Any] = {
        "sizes": asdict(sizes),
        "model": str(model),
        "summary": summary,
        "rounds": rounds,
    }
    if "cpu" in summary:
        out["miss_overhead_ratio"] = summary["cpu"]["throughput_ratio"]
        out["miss_overhead_median_ms"] = summary["cpu"]["median_overhead_ms"]
    for label in configs[1:]:
        if label in summary:
            out[f"miss_overhead_ratio_{label}"] = summary[label]["throughput_ratio"]
    return out


def checks_of(result: dict[str, Any]) -> list[Check]:
    checks = []
    for label, s in result["summary"].items():
        if label == "off":
            continue
        checks.append(
            Check(
                f"with/without throughput, {label}",
                s["throughput_ratio"],
                MISS_RATIO_TARGET,
                True,
                "x",
                f"median per-request overhead {s['median_overhead_ms']:+.1f} ms ({s['median_overhead_pct']:+.2f}%)"
                + (
                    f"; connector time in step {s['median_connector_pct']:.2f}%"
                    if s.get("median_connector_pct") is not None
                    else ""
                ),
            )
        )
    return checks


def run_miss_overhead(
    json_path: Path | None = None,
    quick: bool = False,
    rounds: int | None = None,
    requests: int | None = None,
    sizes: MissBenchSizes | None = None,
    enforce: bool = False,
) -> int:
    """``kvtier bench miss-overhead``: run, print the table, write JSON.

    Returns 1 if ``enforce`` (the CLI) and the target was missed, else 0 (reported only).
    """
    from rich.console import Console

    console = Console(stderr=True)
    sizes = sizes or (MissBenchSizes.quick() if quick else MissBenchSizes())
    if rounds is not None or requests is not None:
        sizes = replace(sizes, rounds=rounds or sizes.rounds, requests=requests or sizes.requests)
    result = run_miss_overhead_bench(sizes, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    checks = checks_of(result)
    result["checks"] = [{**asdict(c), "passed": c.passed} for c in checks]
    print_checks("kvtier bench miss-overhead (no reuse; kvtier on / off, same prompts)", checks)
    write_json(json_path, result)
    return 1 if enforce and not all(c.passed for c in checks) else 0
