"""Engine timing parameters fitted from single-instance measurements (never from the run they check).

A calibration file (JSON, written by ``kvtier bench timing-calibrate`` from one vLLM server,
or by hand) holds what one instance measured, every time in seconds:

- ``cold``: ``[{"input_length": L, "ttft_s": t}, ...]``, prompts sharing nothing cached;
- ``cached``: ``[{"input_length": L, "cached_tokens": c, "ttft_s": t}, ...]``, prompts whose
  first ``c`` tokens were in the engine's own prefix cache;
- ``decode``: ``[{"seqs": k, "itl_s": t}, ...]``, the median gap between streamed tokens with
  ``k`` sequences decoding together (at least two distinct ``k``);
- ``tier_hit`` (optional): ``[{"tier": "cpu", "input_length": L, "tier_tokens": c, "ttft_s": t}]``,
  prompts whose first ``c`` tokens came from a kvtier tier;
- ``token_budget``, ``max_seqs``, ``kv_bytes_per_token``; ``machine`` (free-form: load, cores).

Fits (:func:`fit_params`), in this order:

1. decode steps: ``itl = step_overhead + decode_per_seq * k`` (least squares);
2. prefill: ``ttft = c0 + prefill_per_token * n + attention * n * (ctx + n / 2)`` over the cold
   (``ctx = 0``, ``n = L``) and cached (``ctx = c``, ``n = L - c``) points, least squares on
   relative error (each row divided by its ttft, so a 0.1 s hit weighs as much as a 3 s miss);
   repeated measurements of one (ctx, n) enter as their median (a shared machine's outliers);
   ``first_token_overhead = c0 - step_overhead`` (what a time to first token has beyond its
   engine step: HTTP, the first chunk's trip), 0 when negative;
3. a tier's load bandwidth: ``tier_tokens * kv_bytes_per_token / load_s``, the median over its
   points, where ``load_s`` is the point's ttft minus the median measured ttft of the same prompt
   served from the engine's own cache at the same split (a ``cached`` point with that
   ``input_length`` and ``cached_tokens``), or minus the fitted compute of the rest when there is
   none (the preset's figure when no point gives a positive time).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.protocol.decoding import read_json_file
from kvtier.sim.fleet.engine import EngineParams, VLLM_CPU_SMOLLM2
from kvtier.sim.fleet.numbers import MAX_SECONDS, MAX_TOKENS, number


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and the field."""


def _rows(doc: dict[str, Any], key: str, fields: tuple[str, ...], src: str, required: bool = True) -> list[dict]:
    rows = doc.get(key)
    if rows is None and not required:
        return []
    if not isinstance(rows, list) or (required and not rows):
        raise CalibrationError(f"{src}: {key!r} must be a non-empty list of objects with {', '.join(fields)}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise CalibrationError(f"{src}: {key}[{i}] is not an object")
        for f in fields:
            v = r.get(f)
            if f == "tier":
                if not isinstance(v, str):
                    raise CalibrationError(f"{src}: {key}[{i}].{f} must be a tier name")
            else:
                lo, hi, integer, lo_open = _RANGES[f]
                try:
                    number(v, f"{src}: {key}[{i}].{f}", lo, hi, integer, lo_open)
                except ValueError as exc:
                    raise CalibrationError(str(exc)) from None
    return rows


#: Each calibration field's range: (low, high, integer, low excluded). Times divide (weights
#: 1/ttft), so they must be above 0.
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "input_length": (1, MAX_TOKENS, True, False), "cached_tokens": (0, MAX_TOKENS, True, False),
    "tier_tokens": (0, MAX_TOKENS, True, False), "seqs": (1, 1 << 16, True, False),
    "ttft_s": (1e-6, MAX_SECONDS, False, False), "itl_s": (1e-6, MAX_SECONDS, False, False),
}


def _optional_int(doc: dict[str, Any], key: str, default: int, lo: int, hi: int, src: str) -> int:
    v = doc.get(key)
    if v is None:
        return default
    try:
        return int(number(v, f"{src}: {key}", lo, hi, integer=True))
    except ValueError as exc:
        raise CalibrationError(str(exc)) from None


def fit_params(doc: dict[str, Any], base: EngineParams = VLLM_CPU_SMOLLM2, name: str = "vllm-cpu-calibrated",
               src: str = "calibration") -> tuple[EngineParams, dict[str, Any]]:
    """Fit :class:`EngineParams` from a calibration document (see the module doc).

    Returns the parameters and a report (each fitted figure, residuals of every point).
    Raises CalibrationError naming the missing or bad field.
    """
    if not isinstance(doc, dict):
        raise CalibrationError(f"{src}: expected a JSON object")
    cold = _rows(doc, "cold", ("input_length", "ttft_s"), src)
    cached = _rows(doc, "cached", ("input_length", "cached_tokens", "ttft_s"), src, required=False)
    decode = _rows(doc, "decode", ("seqs", "itl_s"), src)
    tier = _rows(doc, "tier_hit", ("tier", "input_length", "tier_tokens", "ttft_s"), src, required=False)
    ks = sorted({float(r["seqs"]) for r in decode})
    if len(ks) < 2:
        raise CalibrationError(f"{src}: 'decode' needs at least two distinct 'seqs' to separate the step "
                               f"overhead from the per-sequence cost, got {ks}")
    if len({int(r["input_length"]) for r in cold}) + len(cached) < 3:
        raise CalibrationError(f"{src}: the prefill fit needs at least 3 distinct points (cold lengths + cached)")
    for i, r in enumerate(cached):
        if r["cached_tokens"] >= r["input_length"]:
            raise CalibrationError(f"{src}: cached[{i}].cached_tokens must be below input_length")

    a = np.array([[1.0, float(r["seqs"])] for r in decode])
    y = np.array([float(r["itl_s"]) for r in decode])
    (s0, d), *_ = np.linalg.lstsq(a, y, rcond=None)

    groups: dict[tuple[float, float, str], list[float]] = {}
    for r in cold:
        groups.setdefault((0.0, float(r["input_length"]), "cold"), []).append(float(r["ttft_s"]))
    for r in cached:
        groups.setdefault((float(r["cached_tokens"]), float(r["input_length"] - r["cached_tokens"]), "cached"),
                          []).append(float(r["ttft_s"]))
    pts = [(c, n, statistics.median(ts), k) for (c, n, k), ts in groups.items()]
    spread = {f"{k} ctx {int(c)} new {int(n)}": ts for (c, n, k), ts in groups.items() if len(ts) > 1}
    a = np.array([[1.0, n, n * (c + n / 2)] for c, n, _, _ in pts])
    y = np.array([t for _, _, t, _ in pts])
    w = 1.0 / y
    (c0, p, att), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    notes = []
    if p < 0 or att < 0:
        notes.append(f"unconstrained fit gave prefill {p:.3g} s/token, attention {att:.3g} s/pair; refitted with "
                     "the negative term at 0")
        if att < 0:
            (c0, p), *_ = np.linalg.lstsq(a[:, :2] * w[:, None], y * w, rcond=None)
            att = 0.0
        else:
            (c0, att), *_ = np.linalg.lstsq(a[:, [0, 2]] * w[:, None], y * w, rcond=None)
            p = 0.0
    step = max(0.0, float(s0))
    first = float(c0) - step
    if first < 0:
        notes.append(f"prefill intercept {c0:.4f} s is below the decode step overhead {step:.4f} s: "
                     "first-token overhead set to 0")
        first = 0.0
    kvb = _optional_int(doc, "kv_bytes_per_token", base.kv_bytes_per_token, 1, 1 << 30, src)
    budget = _optional_int(doc, "token_budget", base.token_budget, 1, MAX_TOKENS, src)
    seqs = _optional_int(doc, "max_seqs", base.max_seqs, 1, 1 << 16, src)
    out_params = replace(
        base, name=name, step_overhead_s=step, prefill_s_per_token=float(p), attention_s_per_pair=float(att),
        decode_s_per_seq=max(0.0, float(d)), token_budget=budget,
        max_seqs=seqs, kv_bytes_per_token=kvb,
        first_token_overhead_s=first, load_gbps=dict(base.load_gbps))

    def predict(c: float, n: float) -> float:
        return first + step + out_params.prefill_s(int(n), int(c))

    gb: dict[str, list[float]] = {}
    tier_rows = []
    for r in tier:
        rest = r["input_length"] - r["tier_tokens"]
        same = groups.get((float(r["tier_tokens"]), float(rest), "cached"))
        base_s = statistics.median(same) if same else predict(r["tier_tokens"], rest)
        load_s = r["ttft_s"] - base_s
        gbps = r["tier_tokens"] * kvb / load_s / 1e9 if load_s > 0 else None
        tier_rows.append({**r, "load_s": load_s, "gbps": gbps,
                          "against": "measured engine hit" if same else "fitted compute"})
        if gbps is not None:
            gb.setdefault(r["tier"], []).append(gbps)
    if gb:
        out_params = replace(out_params, load_gbps={**out_params.load_gbps,
                                                    **{t: statistics.median(v) for t, v in gb.items()}})
    residuals = [{"kind": k, "ctx": int(c), "new_tokens": int(n), "measured_s": t, "fitted_s": predict(c, n),
                  "rel_error": (predict(c, n) - t) / t} for c, n, t, k in pts]
    decode_res = [{"seqs": r["seqs"], "measured_s": r["itl_s"], "fitted_s": step + out_params.decode_s_per_seq * r["seqs"]}
                  for r in decode]
    out_params = replace(out_params, source=f"fitted by kvtier.sim.fleet.calibrate from {src}")
    report = {"params": params_dict(out_params), "prefill_points": residuals, "decode_points": decode_res,
              "tier_points": tier_rows, "repeated_points_s": spread, "notes": notes, "machine": doc.get("machine")}
    return out_params, report


def params_dict(p: EngineParams) -> dict[str, Any]:
    return {"name": p.name, "step_overhead_s": p.step_overhead_s, "prefill_s_per_token": p.prefill_s_per_token,
            "attention_s_per_pair": p.attention_s_per_pair, "decode_s_per_seq": p.decode_s_per_seq,
            "token_budget": p.token_budget, "max_seqs": p.max_seqs, "kv_bytes_per_token": p.kv_bytes_per_token,
            "load_gbps": dict(p.load_gbps), "first_token_overhead_s": p.first_token_overhead_s, "source": p.source}


def load_calibration(path: Path, base: EngineParams = VLLM_CPU_SMOLLM2) -> tuple[EngineParams, dict[str, Any]]:
    """:func:`fit_params` of a calibration file. Raises CalibrationError (missing file, not JSON, bad fields)."""
    path = Path(path)
    try:
        doc = read_json_file(path)
    except ValueError as exc:
        raise CalibrationError(f"--calibration {path}: {exc}") from None
    return fit_params(doc, base, src=str(path))
