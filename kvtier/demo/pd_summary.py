"""Rows, summary and targets of ``kvtier demo-pd`` (pure: no vLLM, no network).

Targets (issue 11's "Done when"), each judged on the rows of one run:

- PD answers are token-identical to a single-instance run at the same split;
- the decoder computes at most ``MAX_DECODER_COMPUTED`` prompt tokens per request;
- ``decode_ttft_over_engine_hit`` = median decode-instance TTFT of the PD decode legs /
  median TTFT of an engine-resident hit (same prompt, same instance) <= ``DECODE_TTFT_RATIO``;
- every P2P request on B is served from A (peer hit tokens = all full chunks of its
  prompt) with the same tokens A gives at the same split;
- ``p2p_ttft_over_local_hit`` = median TTFT on B of a peer hit / median TTFT on B of a
  local CPU-tier hit (same prompts) <= ``P2P_TTFT_RATIO``.

Medians, not means: one run has a few requests and a scheduler hiccup would dominate a mean.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MAX_DECODER_COMPUTED = 1
DECODE_TTFT_RATIO = 1.5
P2P_TTFT_RATIO = 1.3


@dataclass
class PDRow:
    """One PD request (TTFTs in seconds, counts in tokens).

    ``decoder_computed_prompt_tokens`` = prompt tokens - the decoder's local + external
    prefix-cache hits over the decode leg (vLLM's own counters), at least 1 (the last
    prompt token is always run to sample the first output token).
    """

    request: int
    doc_id: str
    prompt_tokens: int
    answers_identical: bool  # PD decode leg == same-split single-instance run
    identical_to_cold: bool  # PD decode leg == a cold run on one instance (bf16: may differ, reported only)
    decoder_computed_prompt_tokens: int
    decode_ttft_s: float
    engine_hit_ttft_s: float
    engine_hit_computed_prompt_tokens: int


@dataclass
class P2PRow:
    """One P2P request on instance B (TTFTs in seconds, counts in tokens)."""

    request: int
    doc_id: str
    prompt_tokens: int
    full_chunk_tokens: int  # tokens in the prompt's full chunks (what a store can serve)
    peer_hit_tokens: int  # tokens B loaded from A (kvtier tier "peer")
    local_hit_tokens: int  # tokens B's second run loaded from its own CPU tier
    answers_identical: bool  # B's peer-hit answer == A's answer at the same split
    identical_to_cold: bool  # B's peer-hit answer == A's cold answer (reported only)
    p2p_ttft_s: float
    local_hit_ttft_s: float

    @property
    def served_from_peer(self) -> bool:
        return self.full_chunk_tokens > 0 and self.peer_hit_tokens >= self.full_chunk_tokens


def _ratio(num: Sequence[float], den: Sequence[float]) -> float | None:
    if not num or not den or statistics.median(den) <= 0:
        return None
    return statistics.median(num) / statistics.median(den)


def summarize(pd: Sequence[PDRow], p2p: Sequence[P2PRow]) -> dict[str, Any]:
    """The ``summary`` object: the four headline figures, medians, and pass/fail of each target.

    A leg with no rows fails its targets (its ratios are None).
    """
    decode_ratio = _ratio([r.decode_ttft_s for r in pd], [r.engine_hit_ttft_s for r in pd])
    p2p_ratio = _ratio([r.p2p_ttft_s for r in p2p], [r.local_hit_ttft_s for r in p2p])
    max_computed = max((r.decoder_computed_prompt_tokens for r in pd), default=None)
    targets = {
        "pd_answers_identical": bool(pd) and all(r.answers_identical for r in pd),
        "decoder_computed_le_1": max_computed is not None and max_computed <= MAX_DECODER_COMPUTED,
        "decode_ttft_le_1_5x_engine_hit": decode_ratio is not None and decode_ratio <= DECODE_TTFT_RATIO,
        "p2p_served_from_peer": bool(p2p) and all(r.served_from_peer for r in p2p),
        "p2p_answers_identical": bool(p2p) and all(r.answers_identical for r in p2p),
        "p2p_ttft_le_1_3x_local_hit": p2p_ratio is not None and p2p_ratio <= P2P_TTFT_RATIO,
    }
    med = statistics.median
    return {
        "answers_identical": targets["pd_answers_identical"] and targets["p2p_answers_identical"],
        "max_decoder_computed_prompt_tokens": max_computed,
        "decode_ttft_over_engine_hit": decode_ratio,
        "p2p_ttft_over_local_hit": p2p_ratio,
        "median_decode_ttft_s": med([r.decode_ttft_s for r in pd]) if pd else None,
        "median_engine_hit_ttft_s": med([r.engine_hit_ttft_s for r in pd]) if pd else None,
        "median_p2p_ttft_s": med([r.p2p_ttft_s for r in p2p]) if p2p else None,
        "median_local_hit_ttft_s": med([r.local_hit_ttft_s for r in p2p]) if p2p else None,
        "targets": targets,
        "passed": all(targets.values()),
    }


def report(pd: Sequence[PDRow], p2p: Sequence[P2PRow], settings: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: ``{"settings", "pd": [rows], "p2p": [rows], "summary"}``."""
    return {"settings": dict(settings), "pd": [asdict(r) for r in pd],
            "p2p": [{**asdict(r), "served_from_peer": r.served_from_peer} for r in p2p],
            "summary": summarize(pd, p2p)}


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_tables(doc: dict[str, Any], echo: Callable[[str], None] = print) -> None:
    """Print the per-request rows and the summary as plain-text tables."""
    echo("PD (prefiller core 0 -> decoder core 1)    TTFT in ms")
    echo(f"{'req':>3} {'doc':<10} {'prompt':>6} {'dec.computed':>12} {'decode':>8} {'eng.hit':>8} "
         f"{'same-split':>10} {'=cold':>5}")
    for r in doc["pd"]:
        echo(f"{r['request']:>3} {r['doc_id']:<10} {r['prompt_tokens']:>6} {r['decoder_computed_prompt_tokens']:>12} "
             f"{r['decode_ttft_s'] * 1e3:>8.0f} {r['engine_hit_ttft_s'] * 1e3:>8.0f} "
             f"{r['answers_identical']!s:>10} {r['identical_to_cold']!s:>5}")
    echo("P2P (B pulls from A)    TTFT on B in ms")
    echo(f"{'req':>3} {'doc':<10} {'prompt':>6} {'peer hit':>8} {'cpu hit':>8} {'p2p':>8} {'local':>8} "
         f"{'same-split':>10} {'=cold':>5}")
    for r in doc["p2p"]:
        echo(f"{r['request']:>3} {r['doc_id']:<10} {r['prompt_tokens']:>6} {r['peer_hit_tokens']:>8} "
             f"{r['local_hit_tokens']:>8} {r['p2p_ttft_s'] * 1e3:>8.0f} {r['local_hit_ttft_s'] * 1e3:>8.0f} "
             f"{r['answers_identical']!s:>10} {r['identical_to_cold']!s:>5}")
    s = doc["summary"]
    echo(f"answers_identical {s['answers_identical']}  max_decoder_computed_prompt_tokens "
         f"{s['max_decoder_computed_prompt_tokens']}  decode_ttft_over_engine_hit {_fmt(s['decode_ttft_over_engine_hit'])} "
         f"(<= {DECODE_TTFT_RATIO})  p2p_ttft_over_local_hit {_fmt(s['p2p_ttft_over_local_hit'])} (<= {P2P_TTFT_RATIO})")
    for name, ok in s["targets"].items():
        echo(f"  {'PASS' if ok else 'FAIL'}  {name}")
    echo("PASS" if s["passed"] else "FAIL")
