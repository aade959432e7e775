#!/usr/bin/env bash
# Quick start 2: set up, start the services the tests need (Redis), run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ -x .ci/redis.sh ] || [ -f .ci/redis.sh ]; then
  bash .ci/redis.sh start
  trap 'bash .ci/redis.sh stop || true' EXIT
fi
python -m pytest -q -rs -p no:cacheprovider "$@"
