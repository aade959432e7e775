"""The human side of ``kvtier bench serve``: the per-configuration table and the PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.bench.serve.phase import Phase


def print_table(phases: dict[str, Phase], console: Any) -> None:
    """Print one row per phase to ``console`` (a rich Console), at least 150 columns wide."""
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


def print_side_by_side(sbs: dict[str, dict[str, Any]], console: Any) -> None:
    """The side by side of issue 30 (``summarize``'s ``side_by_side``): one row per configuration
    of vllm, kvtier-cpu, kvtier-cpu-disk and lmcache-mp that ran (nothing when fewer than two)."""
    if len(sbs) < 2:
        return
    from rich.table import Table

    t = Table(title="side by side: multi-round QA, no-reuse control, isolated hit")
    for col in ("config", "TTFT mean", "TTFT rounds 2+", "req/s", "hit rate", "no-reuse req/s", "isolated hit TTFT"):
        t.add_column(col, justify="left" if col == "config" else "right")

    def ms(x: Any) -> str:
        return f"{x * 1000:.0f} ms" if isinstance(x, (int, float)) else "-"

    def num(x: Any, fmt: str) -> str:
        return format(x, fmt) if isinstance(x, (int, float)) else "-"

    for name, row in sbs.items():
        t.add_row(name, ms(row["ttft_mean_s"]), ms(row["ttft_later_rounds_mean_s"]), num(row["request_throughput"], ".3f"),
                  num(row["hit_rate"], ".1%"), num(row["no_reuse_request_throughput"], ".3f"), ms(row["isolated_hit_ttft_s"]))
    from rich.console import Console

    Console(file=console.file, width=max(console.width, 120)).print(t)


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
