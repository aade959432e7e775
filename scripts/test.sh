#!/usr/bin/env bash
# Quick start 2: set up, start the services the tests need (Redis, a Mooncake master), run the suite.
# With no arguments (everything, as CI runs it) the type check runs first; any mypy error fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ $# -eq 0 ]; then
  python -m mypy  # the whole kvtier package; configuration: [tool.mypy] in pyproject.toml
fi
if [ -x .ci/redis.sh ] || [ -f .ci/redis.sh ]; then
  # Stop the Redis servers at the end only if this run started them (a second test run on
  # the same machine reuses the first one's and leaves them to it).
  redis_how="$(bash .ci/redis.sh start)"
  if [ "$redis_how" = started ]; then
    trap 'bash .ci/redis.sh stop || true' EXIT
  fi
fi
if [ -f .ci/mooncake.sh ]; then
  # The Mooncake master the mooncake:// tier's tests use (loopback only; "missing" without
  # Mooncake: those tests then skip). Stopped at the end only if this run started it.
  mooncake_how="$(bash .ci/mooncake.sh start)" || mooncake_how=failed
  if [ "$mooncake_how" = started ]; then
    trap 'bash .ci/mooncake.sh stop || true; [ "${redis_how:-}" = started ] && bash .ci/redis.sh stop || true' EXIT
  fi
fi
python -m pytest -q -rfEs -p no:cacheprovider "$@"
