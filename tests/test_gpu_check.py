"""``scripts/gpu-check.sh`` on a machine without CUDA: it says so first, every step that can run
without a device runs and passes (the copy bench and the transformers check on CPU tensors), it
writes its summary, and it exits 3. On a CUDA device the same script is the GPU check (README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # over 5 s on 2 cores: out of the fast loop
@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: scripts/gpu-check.sh is the GPU check itself")
def test_gpu_check_runs_its_cpu_steps_and_exits_3_without_cuda(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, GPU_CHECK_PYTEST="0")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 3, out + proc.stderr
    assert out.splitlines()[0].startswith("NO CUDA DEVICE") or "NO CUDA DEVICE" in out.splitlines()[1], out
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert summary == {**summary, "cuda": False, "exit": 3}
    assert status["environment"] == status["dependencies"] == "pass", status
    assert status["copies"] == status["transformers"] == "skip" and "FAIL" not in status.values(), status
    hf = json.loads((tmp_path / "transformers.json").read_text())
    assert hf["pass"] and hf["identical"]["identical"] and hf["restart"]["identical"], hf
    assert hf["identical"]["negative_control"]["changed"], "the negative control must change the output"
    assert json.loads((tmp_path / "copies.json").read_text())["batch_bytes"] > 0


@pytest.mark.slow
def test_gpu_path_tests_need_no_vllm() -> None:
    """The device has no vLLM: the GPU-path test files collect and import without it."""
    code = ("import sys; sys.modules['vllm'] = None; import pytest; "
            "sys.exit(pytest.main(['-q', '--collect-only', '-p', 'no:cacheprovider', "
            "'tests/test_gpu_path.py', 'tests/test_cuda_ipc.py', 'tests/test_service_block_copy.py']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error" not in proc.stdout.lower().split("tests collected")[-1], proc.stdout[-2000:]
