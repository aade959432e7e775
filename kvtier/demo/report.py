"""Rich output of the demo: one line per request and the summary tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.demo.stats import PHASE_OFF, PHASE_ON, PHASE_RESTART, RequestRecord

PHASE_TITLES = {
    PHASE_OFF: "1 kvtier off",
    PHASE_ON: "2 kvtier on",
    PHASE_RESTART: "3 restart",
}


def request_line(r: RequestRecord) -> str:
    """One request as a line: phase, doc, question, tokens, hit tokens, tier, TTFT, answer start."""
    tag = " [dim](engine-resident repeat)[/]" if r.repeat else ""
    tier_style = {"none": "dim", "cpu": "green", "disk": "cyan"}.get(r.tier, "yellow")
    answer = r.answer.strip().replace("\n", " ")
    if len(answer) > 48:
        answer = answer[:47] + "…"
    return (
        f"{PHASE_TITLES.get(r.phase, r.phase):<12} {r.doc_id:<10} q{r.question_index + 1} "
        f"prompt {r.prompt_tokens:>5}  engine-had {r.engine_hit_tokens:>5}  "
        f"kvtier {r.kvtier_hit_tokens:>5} [{tier_style}]{r.tier:<8}[/]  "
        f"TTFT {r.ttft_s * 1000:>8.1f} ms  [dim]{answer}[/]{tag}"
    )


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1000:.1f} ms"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}x"


def _count(records: list[RequestRecord], phase: str, pred: Any) -> int:
    return sum(1 for r in records if r.phase == phase and pred(r))


def print_summary(console: Console, records: list[RequestRecord], summary: dict[str, Any]) -> None:
    """Print the TTFT table, the token accounting table and the answer check."""
    t = Table(title="Time to first token (median)", show_lines=False)
    t.add_column("case")
    t.add_column("requests", justify="right")
    t.add_column("median TTFT", justify="right")
    t.add_column("speedup vs off", justify="right")
    t.add_column("TTFT / engine-resident hit TTFT", justify="right")  # a cost ratio, not a speedup
    t.add_row(
        "kvtier off (phase 1, all requests)",
        str(_count(records, PHASE_OFF, lambda r: not r.repeat)),
        _ms(summary["ttft_off_median_s"]),
        "1.0x",
        "",
    )
    t.add_row(
        "warm CPU-tier hits (phase 2 revisits)",
        str(_count(records, PHASE_ON, lambda r: not r.first_visit and r.tier == "cpu")),
        _ms(summary["ttft_cpu_hit_median_s"]),
        _x(summary["speedup_cpu_hit_vs_off"]),
        _x(summary["cpu_hit_ttft_over_engine_hit_ttft"]),
    )
    t.add_row(
        "disk-tier hits after restart (phase 3)",
        str(_count(records, PHASE_RESTART, lambda r: r.tier_tokens.get("disk", 0) > 0)),
        _ms(summary["ttft_disk_hit_median_s"]),
        _x(summary["speedup_disk_hit_vs_off"]),
        _x(summary["disk_hit_ttft_over_engine_hit_ttft"]),
    )
    t.add_row(
        "engine-resident hit (vLLM prefix cache)",
        str(_count(records, PHASE_OFF, lambda r: r.repeat)),
        _ms(summary["ttft_engine_hit_median_s"]),
        _x(summary["speedup_engine_hit_vs_off"]),
        "1.0x",
    )
    console.print(t)

    k = Table(title="Prompt tokens: where they came from")
    for col in ("phase", "requests", "prompt", "engine had", "kvtier supplied", "  from CPU", "  from disk", "computed", "hit rate"):
        k.add_column(col, justify="left" if col == "phase" else "right")
    for phase, tok in summary["tokens_by_phase"].items():
        p = tok["prompt_tokens"]
        k.add_row(
            PHASE_TITLES.get(phase, phase),
            str(tok["requests"]),
            str(p),
            str(tok["engine_hit_tokens"]),
            str(tok["kvtier_hit_tokens"]),
            str(tok["cpu_hit_tokens"]),
            str(tok["disk_hit_tokens"]),
            str(tok["computed_tokens"]),
            f"{tok['kvtier_hit_tokens'] / p:.1%}" if p else "—",
        )
    console.print(k)
    console.print(
        f"kvtier hit rate over phases 2+3: [bold]{summary['hit_rate']:.1%}[/] "
        f"({summary['kvtier_hit_tokens']} of {summary['prompt_tokens']} prompt tokens; "
        f"engine already had {summary['engine_hit_tokens']}, computed {summary['computed_tokens']}); "
        f"disk-tier hit tokens after restart: {summary['disk_hit_tokens']}"
    )
    n_kv = summary["tokens_by_phase"]["on"]["requests"] + summary["tokens_by_phase"]["restart"]["requests"]
    if summary["answers_identical"]:
        console.print(
            f"[bold green]Answers identical[/]: {summary['answers_compared']} of {n_kv} kvtier-on answers "
            "(greedy token ids) equal the kvtier-off answer computed with the same cached prefix length."
        )
    else:
        console.print("[bold red]Answers differ[/] between kvtier off and on (same cached prefix length):")
        for m in summary["answer_mismatches"]:
            console.print(f"  {m}", markup=False)
    if summary["answers_not_comparable"]:
        console.print(
            "[yellow]Not comparable[/] (no kvtier-off run with the same cached prefix length): "
            + ", ".join(summary["answers_not_comparable"])
        )
    console.print(
        f"[dim]Not a correctness check, for reference: compared with a cold prefill of the whole prompt "
        f"(no cached prefix), vLLM's own prefix-cache hits gave the same answer in "
        f"{summary['engine_hit_answers_equal_to_cold_off']} of {summary['engine_hit_probes']} probes and "
        f"kvtier hits in {summary['answers_equal_to_cold_off']} of {n_kv} requests: in bf16 or float32 the tokens "
        f"computed after any cached prefix can round differently from a cold prefill, which is why the "
        f"check above compares at the same cached prefix length.[/]"
    )
