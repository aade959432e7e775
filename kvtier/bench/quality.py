"""``kvtier bench quality``: what each remote codec does to real KV and to the model's answers.

For every codec (raw, shuffle-zstd, int8, cachegen) on KV of the real model
(SmolLM2-135M-Instruct through vLLM's CPU backend) over the demo's documents:

- compression ratio (payload bytes / stored bytes, envelope included) and
  encode / decode speed in GB/s (one thread, payload bytes per second), and the
  reconstruction error (relative RMS, max |error|) of the lossy ones;
- answer agreement with uncompressed KV: every prompt is answered cold (full
  prefill, greedy), then again with every chunk but the last loaded from a
  remote tier (``fs://``) written with that codec; reported are the exact
  match rate of whole answers, the token match rate (tokens before the first
  divergence / answer tokens) and each answer's first divergence position,
  against the cold answers and against the answers from raw (uncompressed)
  KV loaded the same way. The second comparison isolates the codec: a prefill
  that starts from cached KV runs other kernels on other splits than a full
  prefill, so even bit-exact KV can flip a near-tie greedy token. The control
  row ``vllm prefix cache`` shows this without kvtier: each prompt run again
  on vLLM's own prefix cache, compared with its cold answer.

Method: one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the
kvtier connector whose remote tier is a temporary directory. The cold runs
store their chunks in the CPU tier; the chunk payloads are copied out (the real
KV corpus). Per codec, the remote directory is cleared and refilled with those
chunks encoded by the codec (the same ``put_many`` the write-behind uses);
before each warm run the engine's prefix cache and kvtier's CPU tier are
emptied, so the KV really comes from the remote tier through the codec's
decoder (checked: the request's kvtier hits must be labelled ``remote``).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvtier.serde.base import ValueSpec, byte_view
from kvtier.serde.envelope import encode_value, read_value_into
from kvtier.serde.registry import make_codec
from kvtier.tiers.base import ChunkWrite

#: Codecs measured, in table order: (label, codec name, options). The cachegen
#: variants trade ratio for fidelity through the shallow/middle/deep bit depths.
CODECS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("raw", "raw", {}),
    ("shuffle-zstd", "shuffle-zstd", {}),
    ("int8", "int8", {}),
    ("cachegen", "cachegen", {}),
    ("cachegen 6/5/4", "cachegen", {"bits": (6, 5, 4)}),
    ("cachegen 8/7/6", "cachegen", {"bits": (8, 7, 6)}),
)


@dataclass
class CodecFigures:
    """Codec figures on real chunks (bytes, GB/s = 10^9 B/s)."""

    payload_bytes: int
    stored_bytes: int
    ratio: float
    encode_gbps: float
    decode_gbps: float
    rel_rms_error: float
    max_abs_error: float


@dataclass
class Agreement:
    """Greedy answers with codec'd KV vs cold answers.

    ``first_divergence``: per prompt, the index of the first differing answer
    token, or None when the answers are identical.
    """

    answers: int
    answers_identical: int
    exact_match_rate: float
    token_match_rate: float
    first_divergence: list[int | None] = field(default_factory=list)


def _as_f32(payload: np.ndarray) -> np.ndarray:
    return (payload.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def codec_figures(chunks: Sequence[np.ndarray], spec: ValueSpec, codec_name: str, **options: Any) -> CodecFigures:
    """Encode and decode every chunk (uint8 payloads of ``spec``) through the stored envelope."""
    codec = make_codec(codec_name, **options)
    decoders = {codec.name: codec}
    key = b"q" * 32
    payload = stored = 0
    enc_s = dec_s = 0.0
    err_sq = ref_sq = 0.0
    max_err = 0.0
    scratch = bytearray()

    def scratch_view(n: int) -> memoryview:
        nonlocal scratch
        if len(scratch) < n:
            scratch = bytearray(n)
        return memoryview(scratch)

    for chunk in chunks:
        t0 = time.perf_counter()
        ev = encode_value(key, chunk, codec, spec)
        blob = b"".join(bytes(byte_view(p).cast("B")) for p in ev.parts)
        enc_s += time.perf_counter() - t0
        out = np.empty_like(chunk)
        view = memoryview(blob)
        pos = 0

        def read_exact(dst: memoryview) -> None:
            nonlocal pos
            dst[:] = view[pos : pos + len(dst)]
            pos += len(dst)

        t0 = time.perf_counter()
        read_value_into(read_exact, len(blob), key, byte_view(out), decoders, scratch_view)
        dec_s += time.perf_counter() - t0
        payload += chunk.nbytes
        stored += len(blob)
        if spec.dtype == "bfloat16":
            x, y = _as_f32(chunk), _as_f32(out)
            d = (x - y).astype(np.float64)
            err_sq += float(d @ d)
            ref_sq += float(x.astype(np.float64) @ x.astype(np.float64))
            max_err = max(max_err, float(np.abs(d).max()))
    return CodecFigures(
        payload_bytes=payload,
        stored_bytes=stored,
        ratio=payload / stored if stored else 0.0,
        encode_gbps=payload / enc_s / 1e9 if enc_s else 0.0,
        decode_gbps=payload / dec_s / 1e9 if dec_s else 0.0,
        rel_rms_error=(err_sq / ref_sq) ** 0.5 if ref_sq else 0.0,
        max_abs_error=max_err,
    )


def agreement(cold: Sequence[Sequence[int]], warm: Sequence[Sequence[int]]) -> Agreement:
    """Compare answers token by token (see :class:`Agreement`).

    Raises:
        ValueError: different numbers of answers.
    """
    if len(cold) != len(warm):
        raise ValueError("cold and warm answer lists differ in length")
    first: list[int | None] = []
    matched = total = 0
    for a, b in zip(cold, warm):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        same = list(a) == list(b)
        first.append(None if same else n)
        matched += len(a) if same else n
        total += len(a)
    identical = sum(1 for f in first if f is None)
    return Agreement(
        answers=len(cold),
        answers_identical=identical,
        exact_match_rate=identical / len(cold) if cold else 0.0,
        token_match_rate=matched / total if total else 0.0,
        first_divergence=first,
    )


def _prompts(model_path: Path, questions: int) -> list[tuple[str, list[int]]]:
    from transformers import AutoTokenizer

    from kvtier.demo.workload import load_documents, prompt_token_ids

    tok = AutoTokenizer.from_pretrained(str(model_path))
    out = []
    for doc in load_documents():
        for qi, q in enumerate(doc.questions[:questions]):
            out.append((f"{doc.doc_id}/q{qi}", prompt_token_ids(tok, doc, q)))
    return out


def measure(questions: int = 1, max_tokens: int = 32, log: Any = print) -> dict[str, Any]:
    """Run the whole measurement (starts vLLM in this process); returns the JSON-ready result."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm import flush_all, request_hits
    from kvtier.integrations.vllm_engine import build_llm
    from kvtier.storage import registry
    from kvtier.storage.lower_tiers import chunk_spec
    from kvtier.tiers.registry import load_tier_class

    model = prepare_model().path
    prompts = _prompts(model, questions)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    with tempfile.TemporaryDirectory(prefix="kvtier-quality-") as tmp:
        url = f"fs://{tmp}/remote"
        llm = build_llm(str(model), {"cpu_capacity": "768MiB", "remote_url": url}, max_model_len=8192)
        (manager,) = registry.active_managers()
        spec = chunk_spec(manager.namespace)
        cs = manager.namespace.chunk_size

        def generate(tokens: list[int], reset: bool = True) -> tuple[list[int], dict | None]:
            if reset:
                llm.reset_prefix_cache()
            out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
            return list(out.outputs[0].token_ids), request_hits(out.request_id)

        cold: list[list[int]] = []
        engine_cached: list[list[int]] = []
        for name, tokens in prompts:
            t0 = time.perf_counter()
            answer, _ = generate(tokens)
            cold.append(answer)
            log(f"cold {name}: {len(tokens)} tokens, {time.perf_counter() - t0:.1f} s")
            engine_cached.append(generate(tokens, reset=False)[0])  # control: vLLM's own prefix cache
        flush_all()
        # The real KV corpus: every loadable chunk of every prompt, copied out of the CPU tier.
        chunks: dict[bytes, np.ndarray] = {}
        for _, tokens in prompts:
            for key in manager.keys(tokens)[: (len(tokens) - 1) // cs]:
                h = manager.open_read(key)
                if h is None:
                    raise RuntimeError("a chunk stored by the cold run is missing from the CPU tier")
                with h:
                    chunks[key] = h.buffer.copy()
        log(f"captured {len(chunks)} chunks of real KV ({sum(c.nbytes for c in chunks.values()) / 1e6:.0f} MB)")

        results: dict[str, Any] = {}
        raw_warm: list[list[int]] = []
        for label, codec, options in CODECS:
            figures = codec_figures(list(chunks.values()), spec, codec, **options)
            manager.clear()
            # (open_tier cannot pass "spec": its first parameter has that name.)
            tier = load_tier_class("fs").from_url(
                url, codec=make_codec(codec, **options), spec=spec, namespace=manager.namespace.digest()
            )
            stored = tier.put_many([ChunkWrite(k, None, v) for k, v in chunks.items()])
            tier.close()
            if not all(stored):
                raise RuntimeError(f"codec {label}: the remote tier refused some chunks")
            warm: list[list[int]] = []
            remote_tokens = 0
            for name, tokens in prompts:
                manager.cpu.clear()
                answer, hits = generate(tokens)
                warm.append(answer)
                remote_tokens += (hits or {}).get("tiers", {}).get("remote", 0)
            expected = sum((len(t) - 1) // cs * cs for _, t in prompts)
            agree = agreement(cold, warm)
            if label == "raw":
                raw_warm = warm
            vs_raw = agreement(raw_warm, warm)
            results[label] = {
                **asdict(figures),
                **asdict(agree),
                "vs_raw_identical": vs_raw.answers_identical,
                "vs_raw_token_match_rate": vs_raw.token_match_rate,
                "vs_raw_first_divergence": vs_raw.first_divergence,
                "remote_hit_tokens": remote_tokens,
                "expected_hit_tokens": expected,
            }
            log(
                f"{label}: ratio {figures.ratio:.2f}x, enc {figures.encode_gbps:.3f} GB/s, "
                f"dec {figures.decode_gbps:.3f} GB/s, identical answers {agree.answers_identical}/{agree.answers}, "
                f"remote hit tokens {remote_tokens}/{expected}"
            )
        manager.clear()
        return {
            "model": "SmolLM2-135M-Instruct (bf16) via vLLM CPU backend",
            "prompts": [name for name, _ in prompts],
            "prompt_tokens": [len(t) for _, t in prompts],
            "max_tokens": max_tokens,
            "chunks": len(chunks),
            "chunk_bytes": manager.chunk_bytes,
            "codecs": results,
            "vllm_prefix_cache_control": asdict(agreement(cold, engine_cached)),
        }


def print_table(result: dict[str, Any]) -> None:
    """The codec table (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Codecs on real KV ({result['chunks']} chunks, {len(result['prompts'])} prompts, "
        f"{result['max_tokens']} greedy tokens each)"
    )
    for col in (
        "codec", "ratio", "encode GB/s", "decode GB/s", "rel. RMS err", "= cold",
        "token match (cold)", "first divergence (cold)", "= raw-loaded", "remote hits",
    ):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for label, r in result["codecs"].items():
        table.add_row(
            label,
            f"{r['ratio']:.2f}x",
            f"{r['encode_gbps']:.3f}",
            f"{r['decode_gbps']:.3f}",
            f"{r['rel_rms_error']:.4f}",
            f"{r['answers_identical']}/{r['answers']}",
            f"{r['token_match_rate']:.1%}",
            ",".join("-" if f is None else str(f) for f in r["first_divergence"]),
            f"{r['vs_raw_identical']}/{r['answers']}",
            f"{r['remote_hit_tokens']}/{r['expected_hit_tokens']}",
        )
    c = result["vllm_prefix_cache_control"]
    table.add_row(
        "vllm prefix cache", "", "", "", "", f"{c['answers_identical']}/{c['answers']}",
        f"{c['token_match_rate']:.1%}", ",".join("-" if f is None else str(f) for f in c["first_divergence"]),
        "", "(control, no kvtier)",
    )
    Console().print(table)


def run_quality(json_path: Path | None = None, questions: int = 1, max_tokens: int = 32) -> int:
    """CLI entry: measure, print the table, write JSON.

    Exit code 1 if the harness did not work: some loads did not come from the
    remote tier, or a lossless codec answered differently from raw-loaded KV.
    """
    from kvtier.bench.common import write_json

    result = measure(questions=questions, max_tokens=max_tokens)
    print_table(result)
    write_json(json_path, result)
    broken = [
        label
        for label, r in result["codecs"].items()
        if r["remote_hit_tokens"] != r["expected_hit_tokens"]
        or (label in ("raw", "shuffle-zstd") and r["vs_raw_identical"] != r["answers"])
    ]
    if broken:
        print(f"harness check failed for {broken}: missing remote hits or lossless codecs that changed answers")
        return 1
    return 0
