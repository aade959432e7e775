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

    @staticmethod
    def quick_defaults() -> ServeBenchOptions:
        """The smaller workload of ``--quick``."""
        return ServeBenchOptions(users=6, rounds=3, concurrency=1, context_tokens=(900, 1100),
                                 no_reuse_requests=8, no_reuse_tokens=256, quick=True)
