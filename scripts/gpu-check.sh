#!/usr/bin/env bash
# GPU check for kvtier's vLLM GPU path (issue 12). Installs nothing: it needs a Python that
# already has a CUDA build of torch (and, for the TTFT demo, of vLLM) plus kvtier's deps.
#   PYTHON=/path/to/python  (default: .venv/bin/python if present, else python3)
#   KVTIER_GPU_MODEL=/path/to/hf-model-folder  (default: kvtier's prepared SmolLM2 folder, if any)
# Steps (each bounded; typically < 10 minutes in all, at most 13):
#   1. environment report (torch/vLLM versions, CUDA device)
#   2. pytest -m cuda on the GPU-path tests (they skip with a reason without CUDA), including the
#      cache service's CUDA IPC copies by block id (a real `kvtier server` process)
#   3. the device-agnostic GPU-path tests (same files, CPU tensors)
#   4. a TTFT demo on GPU vLLM: cold prefill vs kvtier hit, figures printed as JSON
#   5. a real SGLang server with kvtier as its HiCache storage backend (if sglang is importable):
#      identical greedy text and a cached prefix served from kvtier after /flush_cache and after
#      a restart (kvtier/integrations/sglang/gpu_smoke.py)
# Exit status: 0 every step passed on a CUDA device; 1 a step failed; 2 torch is missing;
# 3 no CUDA device: only the CPU-side checks ran (said first, and again at the end).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/kvtier-gpu-check}"
mkdir -p "$OUT"
rc=0
TESTS="tests/test_gpu_path.py tests/test_cuda_ipc.py tests/test_service_block_copy.py"

echo "== 1. environment"
timeout 30 "$PY" - <<'EOF' || { echo "torch is not importable with $PY"; exit 2; }
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
try:
    import vllm
    print("vllm", vllm.__version__)
except Exception as exc:
    print("vllm not importable:", exc)
EOF

HAS_CUDA=0
timeout 30 "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && HAS_CUDA=1
if [ "$HAS_CUDA" = 0 ]; then
  echo "NO CUDA DEVICE: the GPU checks (steps 2 and 4) cannot run here; only the CPU-side checks run (exit 3 if they pass)"
fi

echo "== 2. CUDA-marked tests"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs $TESTS --junitxml="$OUT/cuda-tests.xml" || rc=1

echo "== 3. device-agnostic GPU-path tests"
timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m "not cuda" $TESTS tests/test_gpu_worker.py || rc=1

echo "== 4. TTFT demo on GPU vLLM"
MODEL="${KVTIER_GPU_MODEL:-}"
if [ -z "$MODEL" ] && [ "$HAS_CUDA" = 1 ]; then
  MODEL="$(timeout 30 "$PY" -c 'from kvtier.demo.model import prepare_model; print(prepare_model().path)' 2>/dev/null || true)"
fi
if [ "$HAS_CUDA" = 0 ]; then
  echo "SKIPPED: no CUDA device"
elif [ -z "$MODEL" ] || [ ! -d "$MODEL" ]; then
  echo "SKIPPED: no model folder (set KVTIER_GPU_MODEL)"; rc=1
elif ! timeout 30 "$PY" -c 'import vllm' 2>/dev/null; then
  echo "SKIPPED: vLLM is not importable with $PY"; rc=1
else
  timeout 240 "$PY" -m kvtier.integrations.vllm.gpu.ttft_demo --model "$MODEL" --prefix-tokens 4096 --rounds 4 \
    --json "$OUT/ttft.json" 2>"$OUT/ttft.log" || { echo "TTFT demo failed (log: $OUT/ttft.log)"; tail -20 "$OUT/ttft.log"; rc=1; }
fi
echo "== 5. SGLang HiCache with kvtier's storage backend"
if [ "$HAS_CUDA" = 0 ]; then
  echo "SKIPPED: no CUDA device"
elif ! timeout 60 "$PY" -c 'import sglang' 2>/dev/null; then
  echo "SKIPPED: sglang is not importable with $PY (install SGLang for CUDA to run this step)"
elif [ -z "$MODEL" ] || [ ! -d "$MODEL" ]; then
  echo "SKIPPED: no model folder (set KVTIER_GPU_MODEL)"; rc=1
else
  timeout 300 "$PY" -m kvtier.integrations.sglang.gpu_smoke --model "$MODEL" --json "$OUT/sglang.json" \
    || { echo "SGLang check failed (see the JSON above)"; rc=1; }
fi
if [ "$HAS_CUDA" = 0 ] && [ "$rc" = 0 ]; then
  echo "== done: CPU-side checks passed; NO GPU CHECK RAN (no CUDA device), exit 3; outputs in $OUT"
  exit 3
fi
echo "== done (rc=$rc); outputs in $OUT"
exit $rc
