"""Dynamo's trace replay as a peer, run in Dynamo's own Python (:mod:`.dynamo_driver`).

:func:`run_dynamo` starts ``PYTHON dynamo_driver.py TRACE --cells JSON`` (``DYN_LOG=warn``: the
replay logs every routing decision otherwise) with a timeout, and returns the driver's cells.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Sequence

DRIVER = Path(__file__).with_name("dynamo_driver.py")


class DynamoError(RuntimeError):
    """Dynamo's replay could not run (the message says why)."""


def dynamo_cell(workers: int, router: str, blocks: int, block_size: int, speed: float) -> dict:
    """A cell for the driver: ``router`` is ``kv_router`` or ``round_robin``; ``blocks`` per worker."""
    return {"workers": workers, "router": router, "blocks": blocks, "block_size": block_size, "speed": speed}


def run_dynamo(python: Path, trace: Path, cells: Sequence[dict], timeout_s: float = 1800.0) -> dict:
    """Run the cells through Dynamo's replay; returns ``{"dynamo_version", "cells": [...]}``.

    Raises:
        DynamoError: ``python`` is not there, the driver failed, timed out or printed no JSON.
    """
    if not Path(python).exists():
        raise DynamoError(f"--dynamo-python {python}: no such file")
    env = {**os.environ, "DYN_LOG": os.environ.get("DYN_LOG", "warn")}
    env.pop("PYTHONPATH", None)  # Dynamo's venv, not this tree
    try:
        proc = subprocess.run([str(python), str(DRIVER), str(trace), "--cells", json.dumps(list(cells))],
                              capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(Path(trace).parent))
    except subprocess.TimeoutExpired:
        raise DynamoError(f"Dynamo's replay took longer than {timeout_s:.0f} s") from None
    except OSError as exc:
        raise DynamoError(f"cannot run {python}: {exc}") from None
    if proc.returncode != 0:
        raise DynamoError(f"Dynamo's replay exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    raise DynamoError(f"Dynamo's replay printed no JSON: {proc.stdout[-400:]!r} {proc.stderr[-400:]!r}")
