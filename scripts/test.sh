#!/usr/bin/env bash
# Quick start 2: set up, start the services the tests need (Redis), run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ -x .ci/redis.sh ] || [ -f .ci/redis.sh ]; then
  # Stop the Redis servers at the end only if this run started them (a second test run on
  # the same machine reuses the first one's and leaves them to it).
  redis_how="$(bash .ci/redis.sh start)"
  if [ "$redis_how" = started ]; then
    trap 'bash .ci/redis.sh stop || true' EXIT
  fi
fi
python -m pytest -q -rs -p no:cacheprovider "$@"
