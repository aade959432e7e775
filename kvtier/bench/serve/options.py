"""Options of ``kvtier bench serve``: the knobs of a run, and already running targets (``--url``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.bench.common import BenchUsageError
from kvtier.bench.serve.configs import CONFIGS

#: KV bytes per token of SmolLM2-135M (30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes).
KV_BYTES_PER_TOKEN = 23_040
#: Working set over engine KV in phase 1.
WORKING_SET_RATIO = 4.0
#: Fraction of the working set each instance's kvtier CPU tier holds in the two-instance
#: configurations: the pair holds it all only when users are partitioned between them.
FLEET_CPU_FRACTION = 0.6

DEFAULT_CONFIGS = "vllm,kvtier-cpu,kvtier-cpu-disk,rr-2x,router-2x"
#: The side by side with LMCache (issue 30): single-instance configurations only.
LMCACHE_CONFIGS = "vllm,kvtier-cpu,kvtier-cpu-disk,lmcache-mp"
#: ``--workload`` names: the default shape, and LMBenchmark's multi-round QA scaled to
#: SmolLM2 and a 2-core machine (:meth:`ServeBenchOptions.lmbench_defaults`).
WORKLOADS = ("default", "lmbench")


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


@dataclass(frozen=True)
class ServeBenchOptions:
    """Knobs of one run (see :func:`run_bench_serve`)."""

    users: int = 10
    rounds: int = 10
    concurrency: int = 2
    qps: float | None = None
    max_tokens: int = 16
    system_tokens: int = 300
    context_tokens: tuple[int, int] = (1500, 2500)
    ratio: float = WORKING_SET_RATIO
    fleet_cpu_fraction: float = FLEET_CPU_FRACTION
    no_reuse_requests: int = 16
    no_reuse_tokens: int = 384
    vllm_bench: bool = True
    quick: bool = False
    #: reps per configuration of phase 4 (``X@fits``), both servers up, turns in ABBA order (:mod:`.fits_ab`)
    fits_reps: int = 2
    #: run phase 4 at all (``--no-fits`` leaves it out: the side by side with LMCache does not need it)
    fits: bool = True
    #: which preset these values came from (``--workload``, reported in the JSON)
    workload: str = "default"
    #: engine threads of a single-instance configuration (``VLLM_CPU_OMP_THREADS_BIND``): "0-1"
    #: both cores; "1" one thread, which on a machine shared with other jobs avoids OpenMP
    #: barriers waiting for a descheduled thread (same setting for every configuration)
    cpu_cores: str = "0-1"
    #: users of the serial answer check (None: ``users``); enough that a user's first question
    #: has left engine KV when its second comes (a few engine-KV-fulls of prompts)
    check_users: int | None = None
    #: configurations LMCache's client (``--lmcache-cli``) runs against (``--lmcache-cli-configs``);
    #: None: every one of the side by side that ran. Against vLLM alone its two workloads take
    #: about 6 minutes on one core (every request a cold prefill), so a short run may leave it out.
    lmcache_client_configs: tuple[str, ...] | None = None

    @staticmethod
    def quick_defaults() -> ServeBenchOptions:
        """The smaller workload of ``--quick``."""
        return ServeBenchOptions(users=6, rounds=3, concurrency=1, context_tokens=(900, 1100),
                                 no_reuse_requests=8, no_reuse_tokens=256, quick=True)

    @staticmethod
    def lmbench_defaults(quick: bool = False) -> ServeBenchOptions:
        """LMBenchmark's ``synthetic-multi-round-qa`` shape (a shared system prompt, a long
        per-user history, short answers, users x rounds at a fixed rate) scaled to SmolLM2-135M
        (8k context) and 2 cores: 1,000 shared system tokens, 3,000 history tokens per user,
        32-token answers, 12 users x 5 rounds, 2 in flight (a closed loop: the engine always
        has work; working set about 4x engine KV, which holds 2 requests of ~4,300 tokens and
        a few blocks more). LMBenchmark's own defaults (20,000 history tokens, 100-token
        answers) do not fit the model's context. The no-reuse control sends 8 unique prompts of
        the size of a first round; the answer check uses 6 users (their ~24,000 tokens are
        several engine-KV-fulls, so every second question is served from the tiers). ``quick``:
        8 users x 3 rounds of 1,000 + 1,000 tokens, 1 in flight."""
        if quick:
            return ServeBenchOptions(users=8, rounds=3, concurrency=1, max_tokens=32, system_tokens=1000,
                                     context_tokens=(1000, 1000), no_reuse_requests=6, no_reuse_tokens=2000,
                                     quick=True, workload="lmbench")
        return ServeBenchOptions(users=12, rounds=5, concurrency=2, max_tokens=32, system_tokens=1000,
                                 context_tokens=(3000, 3000), no_reuse_requests=8, no_reuse_tokens=4000,
                                 check_users=6, workload="lmbench")

    @staticmethod
    def preset(workload: str, quick: bool) -> ServeBenchOptions:
        """The options of ``--workload`` (one of :data:`WORKLOADS`). Raises BenchUsageError."""
        if workload == "lmbench":
            return ServeBenchOptions.lmbench_defaults(quick)
        if workload == "default":
            return ServeBenchOptions.quick_defaults() if quick else ServeBenchOptions()
        raise BenchUsageError(f"--workload {workload!r}: choose from {', '.join(WORKLOADS)}")
