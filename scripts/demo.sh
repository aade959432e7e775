#!/usr/bin/env bash
# Quick start 1: set up, then run the main job (kvtier demo) on the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec kvtier demo "$@"
