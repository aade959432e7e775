#!/usr/bin/env bash
# The GPU check: kvtier's CUDA code on a real device, as one bounded script (issue 27).
#
# Made for the accelerator machine this project is sometimes lent (one H200; Python 3.12 with a
# CUDA build of torch and transformers, pytest, hypothesis, numpy, msgpack, pyyaml, rich, typer,
# xxhash, prometheus-client; no vLLM, no SGLang, no network). kvtier's other pure dependencies
# travel as wheels:
#   bash scripts/gpu-check.sh --prepare      # here: download them into .gpu-wheels/ (gitignored, ~10 MB)
#   bash scripts/gpu-check.sh                # there (the device tool: carry [".gpu-wheels"]); also here
# Steps, each bounded by a timeout, each writing JSON under $OUT (default /tmp/kvtier-gpu-check):
#   1. environment        python, torch, CUDA device, vLLM/SGLang presence       env.json
#   2. dependencies       missing pure deps installed from .gpu-wheels (--target)  deps.json
#   3. cuda tests         pytest -m cuda: pinned pool, layer-wise copies on CUDA streams and
#                         events, gather/scatter on CUDA tensors, the cache server's CUDA IPC
#                         copies by block id (a real `kvtier server` process), its release of a
#                         killed engine's KV                                        cuda-tests.json
#   4. agnostic tests     the same files' device-agnostic tests (CPU tensors)        agnostic-tests.json
#   5. copies             pinned-pool H2D/D2H of 5.9 MB chunks and 118 MB batches, layer-wise
#                         gather/scatter, vs torch's raw copy_, pinned vs pageable   copies.json
#   6. transformers       KVTierHF on a SmolLM2-shaped model (seeded, no weights): identical greedy
#                         tokens hit vs cold at the same split, a hit after a restart through the
#                         disk tier, a negative control, TTFT cold vs hit on an 8k prefix  transformers.json
#   7. vLLM TTFT demo     only where vLLM is installed (not on the lent machine)     ttft.json
#   8. SGLang HiCache     only where SGLang is installed (not on the lent machine)   sglang.json
# One summary line per step, then summary.json. Under 8 minutes on the lent machine.
# Exit status: 0 on a CUDA device when steps 1-6 all ran and passed (7-8 count only where they
# can run); 1 a step failed; 2 torch is missing; 3 no CUDA device: said first, then every step
# that can run without one runs (exit 3 if those pass).
#   PYTHON=/path/to/python   (default: .venv/bin/python if present, else python3)
#   KVTIER_GPU_MODEL=DIR     a model folder for steps 7-8 (where vLLM / SGLang are installed)
#   GPU_CHECK_PYTEST=0       skip steps 3-4 (the test suite runs those files itself)
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
# kvtier's pure dependencies the lent machine lacks: distribution==version (the versions of this
# project's own environment) and the module that shows it is installed.
DEPS="blake3==1.0.11:blake3 pydantic==2.14.4:pydantic pydantic_core==2.50.5:pydantic_core
annotated-types==0.8.0:annotated_types typing-inspection==0.4.5:typing_inspection zstandard==0.25.0:zstandard
msgspec==0.23.0:msgspec pyzmq==27.3.0:zmq"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

if [ "${1:-}" = "--prepare" ]; then
  PYVER="${GPU_CHECK_PYTHON_VERSION:-3.12}"
  mkdir -p "$WHEELS"
  specs=$(for d in $DEPS; do echo "${d%%:*}"; done)
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" $specs || { echo "gpu-check: downloading the wheels failed" >&2; exit 1; }
  echo "gpu-check: $(ls "$WHEELS" | wc -l) wheels for Python $PYVER in $WHEELS ($(du -sh "$WHEELS" | cut -f1)); carry it: [\"$WHEELS\"]"
  exit 0
fi

OUT="${OUT:-/tmp/kvtier-gpu-check}"
mkdir -p "$OUT"
: >"$OUT/steps.jsonl"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
rc=0

step() {  # name status seconds line: one summary line, one JSON record
  printf '%-16s %-5s %5ss  %s\n' "$1" "$2" "$3" "$4"
  "$PY" -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "status": sys.argv[2], "seconds": float(sys.argv[3]), "line": sys.argv[4]}))' \
    "$1" "$2" "$3" "$4" >>"$OUT/steps.jsonl"
  [ "$2" = FAIL ] && rc=1
  return 0
}
now() { date +%s.%N; }
since() { "$PY" -c "import sys; print(round($(now) - float(sys.argv[1]), 1))" "$1"; }

# -- 1. environment -------------------------------------------------------------------------
t=$(now)
if ! timeout 60 "$PY" - "$OUT/env.json" <<'EOF'
import importlib.util, json, platform, sys
import torch
cuda = torch.cuda.is_available()
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "cuda_available": cuda, "device": torch.cuda.get_device_name(0) if cuda else None,
       "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
       "vllm": importlib.util.find_spec("vllm") is not None, "sglang": importlib.util.find_spec("sglang") is not None}
open(sys.argv[1], "w").write(json.dumps(env))
EOF
then
  echo "torch is not importable with $PY"; exit 2
fi
HAS_CUDA=0
timeout 60 "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && HAS_CUDA=1
if [ "$HAS_CUDA" = 0 ]; then
  echo "NO CUDA DEVICE: no GPU check can run here; the steps that run without one follow (exit 3 if they pass)"
fi
step environment pass "$(since "$t")" "$(cat "$OUT/env.json")"

# -- 2. dependencies ------------------------------------------------------------------------
t=$(now)
missing=""
for d in $DEPS; do
  "$PY" -c "import ${d##*:}" 2>/dev/null || missing="$missing ${d%%:*}"
done
if [ -z "$missing" ]; then
  step dependencies pass "$(since "$t")" "all of kvtier's dependencies are importable"
else
  TARGET="${TMPDIR:-/tmp}/kvtier-gpu-deps"
  files=""
  for spec in $missing; do
    name=${spec%%==*}; ver=${spec##*==}
    f=$(ls "$WHEELS"/"$(echo "$name" | tr - _)"-"$ver"-*.whl 2>/dev/null | head -n 1)
    [ -n "$f" ] && files="$files $f"
  done
  # shellcheck disable=SC2086
  if [ -n "$files" ] && timeout 120 "$PY" -m pip install -q --no-index --no-deps --target "$TARGET" $files >"$OUT/deps.log" 2>&1 \
     && PYTHONPATH="$PYTHONPATH:$TARGET" timeout 60 "$PY" -c "import kvtier.storage.manager, kvtier.service.server" 2>>"$OUT/deps.log"; then
    export PYTHONPATH="$PYTHONPATH:$TARGET"
    step dependencies pass "$(since "$t")" "installed from $WHEELS:$missing"
  else
    step dependencies FAIL "$(since "$t")" "missing:$missing (run 'bash scripts/gpu-check.sh --prepare' here and carry $WHEELS; log $OUT/deps.log)"
    echo "== done: dependencies missing, nothing else can run; outputs in $OUT"; exit 1
  fi
fi
printf '{"missing": "%s"}\n' "${missing# }" >"$OUT/deps.json"

TESTS="tests/test_gpu_path.py tests/test_cuda_ipc.py tests/test_service_block_copy.py"
junit_line() {  # xml: "N passed, N failed, N skipped"; exit 1 if any failed/errored
  "$PY" - "$1" "$2" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"no test report ({exc})"); sys.exit(1)
n = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
for s in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
    for k in n:
        n[k] += int(s.get(k, 0))
ok = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
json.dump({"passed": ok, **n}, open(sys.argv[2], "w"))
print(f"{ok} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped")
sys.exit(1 if n["failures"] or n["errors"] else 0)
EOF
}

# -- 3-4. tests -----------------------------------------------------------------------------
if [ "${GPU_CHECK_PYTEST:-1}" = 0 ]; then
  step cuda-tests skip 0 "GPU_CHECK_PYTEST=0"
  step agnostic-tests skip 0 "GPU_CHECK_PYTEST=0"
else
  t=$(now)
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs $TESTS --junitxml="$OUT/cuda-tests.xml" >"$OUT/cuda-tests.log" 2>&1
  line=$(junit_line "$OUT/cuda-tests.xml" "$OUT/cuda-tests.json"); ok=$?
  if [ "$HAS_CUDA" = 0 ]; then
    [ $ok = 0 ] && step cuda-tests skip "$(since "$t")" "no CUDA device: $line" || step cuda-tests FAIL "$(since "$t")" "$line"
  elif [ $ok = 0 ] && "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d["skipped"] == 0 and d["passed"] > 0 else 1)' "$OUT/cuda-tests.json"; then
    step cuda-tests pass "$(since "$t")" "$line"
  else
    step cuda-tests FAIL "$(since "$t")" "$line (a CUDA test that skips on a GPU did not run; log $OUT/cuda-tests.log)"
  fi
  t=$(now)
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m "not cuda" $TESTS --junitxml="$OUT/agnostic-tests.xml" >"$OUT/agnostic-tests.log" 2>&1
  line=$(junit_line "$OUT/agnostic-tests.xml" "$OUT/agnostic-tests.json") && step agnostic-tests pass "$(since "$t")" "$line" \
    || step agnostic-tests FAIL "$(since "$t")" "$line (log $OUT/agnostic-tests.log)"
fi

# -- 5. copy bandwidth ----------------------------------------------------------------------
t=$(now)
if [ "$HAS_CUDA" = 1 ]; then
  line=$(timeout 120 "$PY" -m kvtier.bench.gpu_copies --device cuda --json "$OUT/copies.json" 2>"$OUT/copies.log" | tail -n 1)
  case "$line" in *PASS) step copies pass "$(since "$t")" "$line" ;; *) step copies FAIL "$(since "$t")" "${line:-failed (log $OUT/copies.log)}" ;; esac
else
  line=$(timeout 120 "$PY" -m kvtier.bench.gpu_copies --device cpu --rounds 3 --batch-chunks 4 --json "$OUT/copies.json" 2>"$OUT/copies.log" | tail -n 1) \
    && step copies skip "$(since "$t")" "no CUDA device, CPU run: $line" || step copies FAIL "$(since "$t")" "failed on the CPU (log $OUT/copies.log)"
fi

# -- 6. transformers ------------------------------------------------------------------------
t=$(now)
if [ "$HAS_CUDA" = 1 ]; then
  line=$(timeout 300 "$PY" -m kvtier.integrations.transformers.gpu_check --device cuda --json "$OUT/transformers.json" 2>"$OUT/transformers.log" | tail -n 1)
  case "$line" in *PASS) step transformers pass "$(since "$t")" "$line" ;; *) step transformers FAIL "$(since "$t")" "${line:-failed (log $OUT/transformers.log)}" ;; esac
else
  line=$(timeout 300 "$PY" -m kvtier.integrations.transformers.gpu_check --device cpu --small --json "$OUT/transformers.json" 2>"$OUT/transformers.log" | tail -n 1)
  case "$line" in *PASS) step transformers skip "$(since "$t")" "no CUDA device, small model on the CPU: $line" ;;
    *) step transformers FAIL "$(since "$t")" "${line:-failed (log $OUT/transformers.log)}" ;; esac
fi

# -- 7-8. engines that are not on the lent machine -------------------------------------------
MODEL="${KVTIER_GPU_MODEL:-}"
t=$(now)
if [ "$HAS_CUDA" = 0 ]; then
  step vllm-ttft skip 0 "no CUDA device"
elif ! timeout 60 "$PY" -c 'import vllm' 2>/dev/null; then
  step vllm-ttft skip 0 "vLLM is not installed here: kvtier's vLLM GPU path stays unverified"
elif [ -z "$MODEL" ] || [ ! -d "$MODEL" ]; then
  step vllm-ttft FAIL 0 "vLLM is installed but no model folder (set KVTIER_GPU_MODEL)"
else
  timeout 240 "$PY" -m kvtier.integrations.vllm.gpu.ttft_demo --model "$MODEL" --prefix-tokens 4096 --rounds 4 \
    --json "$OUT/ttft.json" 2>"$OUT/ttft.log" && step vllm-ttft pass "$(since "$t")" "$OUT/ttft.json" \
    || step vllm-ttft FAIL "$(since "$t")" "log $OUT/ttft.log"
fi
t=$(now)
if [ "$HAS_CUDA" = 0 ]; then
  step sglang skip 0 "no CUDA device"
elif ! timeout 60 "$PY" -c 'import sglang' 2>/dev/null; then
  step sglang skip 0 "SGLang is not installed here: kvtier's HiCache backend on a GPU stays unverified"
elif [ -z "$MODEL" ] || [ ! -d "$MODEL" ]; then
  step sglang FAIL 0 "SGLang is installed but no model folder (set KVTIER_GPU_MODEL)"
else
  timeout 300 "$PY" -m kvtier.integrations.sglang.gpu_smoke --model "$MODEL" --json "$OUT/sglang.json" >"$OUT/sglang.log" 2>&1 \
    && step sglang pass "$(since "$t")" "$OUT/sglang.json" || step sglang FAIL "$(since "$t")" "log $OUT/sglang.log"
fi

"$PY" - "$OUT" "$HAS_CUDA" "$rc" <<'EOF'
import json, sys
out, cuda, rc = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
steps = [json.loads(l) for l in open(f"{out}/steps.jsonl")]
exit_code = rc if rc else (0 if cuda else 3)
json.dump({"cuda": cuda, "exit": exit_code, "steps": steps}, open(f"{out}/summary.json", "w"), indent=2)
EOF
if [ "$rc" != 0 ]; then
  echo "== done: a step FAILED (rc=1); outputs in $OUT"; exit 1
fi
if [ "$HAS_CUDA" = 0 ]; then
  echo "== done: the steps that run without a GPU passed; NO GPU CHECK RAN (no CUDA device), exit 3; outputs in $OUT"
  exit 3
fi
echo "== done: every GPU step ran and passed; outputs in $OUT"
exit 0
