"""``kvtier demo-pd``: transfer mode on two vLLM instances (SmolLM2-135M, one core each).

Run: ``kvtier demo-pd [--json PATH]``. Prompts are long-document questions
(:mod:`kvtier.demo.workload`, the two shortest documents, ~2,300 and ~3,000 tokens);
each request gets its own ``cache_salt``, so no request shares a prefix with another.
After one warm-up request per leg (first connections), every request is measured.

PD leg: a ``kvtier server`` (its own process) shared by a prefiller (``pd_role=both``,
core 0) and a decoder (``pd_role=decode``, core 1). Per request:

1. same-split reference on the prefiller alone: its prefill leg (``prefill_body``:
   ``max_tokens=1``, ``do_remote_decode``), then its decode leg with the returned
   ``kv_transfer_params`` (the last prompt token is computed, as on a PD decoder);
2. a cold run on the prefiller (reported only: a bf16 split can change greedy tokens);
3. PD: the prefill leg on the prefiller, then a short unmeasured request to the decoder
   (:func:`_wake`), then the decode leg on the decoder (timed);
   decoder computed prompt tokens = prompt - the decoder's local + external
   prefix-cache hits over that leg (vLLM's counters on ``/metrics``), at least 1
   (:func:`computed_prompt_tokens`);
4. engine-resident hit: the same request again on the decoder, whose own prefix
   cache now holds the prompt (timed).

Both timed decoder requests thus follow another request: the decoder idles for seconds
while the prefiller computes steps 1-3 on the other core, and a first request after that
ran slow whatever it was (traced: 110 ms from send to the scheduler and 221 ms from the
end of a 29 ms KV load to the first token, against 14 and 109 ms for the engine hit sent
right after it), which the engine hit, measured second, never paid. The P2P leg wakes B
the same way before its first timed request of each prompt.

P2P leg (no shared store): A (``peer_listen``: shared memory, or TCP on loopback; core 0) answers each prompt cold
and then again (an engine hit: with ``chunk_size`` = vLLM's block size, the same split
as a kvtier chunk hit: the reference). B (``peers=[A]``, core 1, empty) then answers
each prompt (timed; its chunks come from A and are promoted into B's CPU tier), its
prefix cache is reset, and it answers again (timed: a local CPU-tier hit).

TTFT: see :mod:`kvtier.demo.pd_client` (client clock, first streamed token).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvtier.demo.pd_client import (
    KVTIER_HITS,
    Completion,
    DemoRequestError,
    completion_body,
    engine_hit_tokens,
    metric_delta,
    post_json,
    stream_completion,
)
from kvtier.demo.pd_summary import P2PRow, PDRow, print_tables, report

MAX_TOKENS = 16
CHUNK = 128  # = vLLM's CPU block size: a kvtier hit splits the prompt where an engine hit does
NUM_BLOCKS = 80  # engine KV blocks (10,240 tokens): a held prefill plus one more request fit
MAX_MODEL_LEN = 4096
DOCUMENTS = ("apache-2.0", "gpl-1")
QUESTIONS_PER_DOCUMENT = 2
START_TIMEOUT_S = 300.0
TTFT_DEFINITION = ("client-side seconds from sending a streamed /v1/completions request to the first "
                   "generated token (time.perf_counter in the demo process); medians over the requests")


@dataclass(frozen=True)
class Prompt:
    """One measured request: a token-id prompt and its own cache salt."""

    index: int
    doc_id: str
    token_ids: list[int]
    salt: str


def build_prompts(model: str) -> tuple[Prompt, list[Prompt]]:
    """(warm-up prompt, measured prompts) from the demo's documents, chat template applied."""
    from transformers import AutoTokenizer

    from kvtier.demo.workload import load_documents, prompt_token_ids

    tok = AutoTokenizer.from_pretrained(model)
    docs = {d.doc_id: d for d in load_documents()}
    pairs = [(d, q) for q in range(QUESTIONS_PER_DOCUMENT) for d in DOCUMENTS]
    prompts = [Prompt(i, d, prompt_token_ids(tok, docs[d], docs[d].questions[q]), f"demo-pd-{d}-{q}")
               for i, (d, q) in enumerate(pairs)]
    warm = docs[DOCUMENTS[0]]
    return Prompt(-1, warm.doc_id, prompt_token_ids(tok, warm, warm.questions[-1]), "demo-pd-warmup"), prompts


def _start_all(servers: list[Any], ex: cf.ThreadPoolExecutor) -> None:
    """Start API servers side by side (their spawning threads stay alive in ``ex``: PR_SET_PDEATHSIG)."""
    for f in [ex.submit(s.start, START_TIMEOUT_S) for s in servers]:
        f.result()


def _spec(model: str, core: str, kvtier: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    from kvtier.integrations.vllm.serve import ServerSpec

    return ServerSpec(model=model, cpu_cores=core, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                      kvtier=kvtier, extra_args=["--enable-prompt-tokens-details"], env=dict(env or {}))


def _start_cache_server(sock: Path, log_path: Path, timeout_s: float = 60.0) -> subprocess.Popen:
    """``kvtier server`` in its own process (as deployed; not a thread of this client), ready on ``sock``.

    Raises:
        RuntimeError: it exited or did not answer ``/health`` within ``timeout_s``.
    """
    from kvtier.ports import free_port

    port = free_port()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "server", "--socket", str(sock), "--cpu-capacity",
                                 "512MiB", "--metrics-port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"kvtier server did not start (log: {log_path})")


def computed_prompt_tokens(prompt_tokens: int, hit_tokens: int) -> int:
    """Prompt tokens an engine computed: those its hit counters did not cover, and at least 1.

    When a load covers the whole prompt, vLLM counts every token as a hit at admission
    but still runs the last one to sample (``Scheduler._update_waiting_for_remote_kv``).
    """
    return max(1, prompt_tokens - hit_tokens)


def _metrics_after(server: Any, before: dict[str, float], prompt_tokens: int, wait_s: float = 5.0) -> dict[str, float]:
    """``/metrics`` once its prompt-token counter counts the request just answered (bounded wait)."""
    deadline = time.monotonic() + wait_s
    while (after := server.metrics()) and time.monotonic() < deadline:
        if metric_delta(after, before, "vllm:prompt_tokens_total") >= prompt_tokens:
            break
        time.sleep(0.05)
    return after


def run_pd_leg(model: str, prompts: list[Prompt], warm: Prompt, work: Path, client: httpx.Client,
               log: Callable[[str], None]) -> list[PDRow]:
    """The PD leg (module docstring); one row per prompt."""
    from kvtier.integrations.vllm.serve import ApiServer
    from kvtier.ports import free_port
    from kvtier.router.pd_proxy import prefill_body

    sock = work / "kvtier.sock"
    cache = _start_cache_server(sock, work / "kvtier-server.log")
    common = {"server": f"unix://{sock}", "chunk_size": CHUNK, "server_timeout_s": 5.0}
    pre = ApiServer(_spec(model, "0", {**common, "pd_role": "both", "pd_port": free_port()}),
                    log_path=str(work / "pd-prefill.log"))
    dec = ApiServer(_spec(model, "1", {**common, "pd_role": "decode"}), log_path=str(work / "pd-decode.log"))
    ex = cf.ThreadPoolExecutor(2)
    rows: list[PDRow] = []
    try:
        log("PD leg: starting the prefiller (core 0) and the decoder (core 1)")
        _start_all([pre, dec], ex)
        name = pre.served_model_name

        def prefill(body: dict[str, Any]) -> dict[str, Any]:
            params = post_json(client, pre.url + "/v1/completions", prefill_body(body)).get("kv_transfer_params")
            if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                raise DemoRequestError(f"the prefill leg returned no kv_transfer_params: {params!r}")
            return params

        for p in [warm, *prompts]:
            body = completion_body(name, p.token_ids, MAX_TOKENS, p.salt)
            ref_body = {**body, "cache_salt": p.salt + "-same-split"}
            ref = stream_completion(client, pre.url, {**ref_body, "kv_transfer_params": prefill(ref_body)})
            cold = stream_completion(client, pre.url, {**body, "cache_salt": p.salt + "-cold"})
            params = prefill(body)
            _wake(client, dec.url, name, p)
            before = dec.metrics()
            pd = stream_completion(client, dec.url, {**body, "kv_transfer_params": params})
            mid = _metrics_after(dec, before, len(p.token_ids))
            hit = stream_completion(client, dec.url, body)
            after = _metrics_after(dec, mid, len(p.token_ids))
            if p.index < 0:
                continue
            n = len(p.token_ids)
            rows.append(PDRow(p.index, p.doc_id, n, pd.token_ids == ref.token_ids, pd.token_ids == cold.token_ids,
                              computed_prompt_tokens(n, engine_hit_tokens(mid, before)), pd.ttft_s, hit.ttft_s,
                              computed_prompt_tokens(n, engine_hit_tokens(after, mid))))
            log(f"  PD request {p.index}: {n} prompt tokens, decoder computed {rows[-1].decoder_computed_prompt_tokens}, "
                f"TTFT decode {pd.ttft_s * 1e3:.0f} ms / engine hit {hit.ttft_s * 1e3:.0f} ms")
    finally:
        for s in (pre, dec):
            s.stop()
        ex.shutdown()
        cache.terminate()
        cache.wait(30)
    return rows


def _wake(client: httpx.Client, url: str, model: str, p: Prompt) -> None:
    """A short unmeasured request (the prompt's first 32 tokens under their own salt, 1 output
    token) so the timed request after it does not run on an engine that just woke from idling
    (module docstring). It shares no prefix with any timed request."""
    stream_completion(client, url, completion_body(model, p.token_ids[:32], 1, p.salt + "-wake"))


def _reset_prefix_cache(client: httpx.Client, url: str, tries: int = 20) -> None:
    """Empty an instance's own prefix cache (vLLM dev endpoint), retried while blocks are held; else DemoRequestError."""
    for _ in range(tries):
        r = client.post(url + "/reset_prefix_cache")
        if r.status_code == 200 and r.json().get("success"):
            return
        time.sleep(0.1)
    raise DemoRequestError(f"{url}/reset_prefix_cache did not succeed")


def run_p2p_leg(model: str, prompts: list[Prompt], warm: Prompt, work: Path, client: httpx.Client,
                log: Callable[[str], None], channel: str = "shm") -> list[P2PRow]:
    """The P2P leg (module docstring); one row per prompt. ``channel``: "shm" or "tcp" (A's ``peer_listen``)."""
    from kvtier.integrations.vllm.serve import ApiServer
    from kvtier.ports import free_port

    base = {"cpu_capacity": "512MiB", "chunk_size": CHUNK, "peer_timeout_s": 10.0}
    peer_url = f"shm://{work / 'peer-a.sock'}" if channel == "shm" else f"tcp://127.0.0.1:{free_port()}"
    keys_a: dict[str, Any] = {}
    keys_b: dict[str, Any] = {}
    if channel == "tcp":  # TCP peers authenticate (issue 24): each instance its own key, both members
        from kvtier.testing.fleet_keys import make_fleet

        fleet = make_fleet(work / "fleet-keys", ["a", "b"])
        keys_a, keys_b = fleet.config("a"), fleet.config("b")
    a = ApiServer(_spec(model, "0", {**base, "peer_listen": peer_url, **keys_a}), log_path=str(work / "p2p-a.log"))
    b = ApiServer(_spec(model, "1", {**base, "peers": [peer_url], **keys_b}, env={"VLLM_SERVER_DEV_MODE": "1"}),
                  log_path=str(work / "p2p-b.log"))
    ex = cf.ThreadPoolExecutor(2)
    rows: list[P2PRow] = []
    try:
        log(f"P2P leg: starting A (core 0, peer_listen {peer_url}) and B (core 1, peers=[A])")
        _start_all([a, b], ex)
        name = a.served_model_name
        on_a: dict[int, tuple[Completion, Completion]] = {}
        for p in [warm, *prompts]:  # A computes every prefix (cold), then hits its own prefix cache
            body = completion_body(name, p.token_ids, MAX_TOKENS, p.salt)
            on_a[p.index] = (stream_completion(client, a.url, body), stream_completion(client, a.url, body))
        time.sleep(0.5)  # A's last chunks reach its CPU tier
        for p in [warm, *prompts]:
            body = completion_body(name, p.token_ids, MAX_TOKENS, p.salt)
            _wake(client, b.url, name, p)
            before = b.metrics()
            peer = stream_completion(client, b.url, body)
            mid = _metrics_after(b, before, len(p.token_ids))
            _reset_prefix_cache(client, b.url)
            local = stream_completion(client, b.url, body)
            after = _metrics_after(b, mid, len(p.token_ids))
            if p.index < 0:
                continue
            n = len(p.token_ids)
            cold, ref = on_a[p.index]
            rows.append(P2PRow(p.index, p.doc_id, n, (n - 1) // CHUNK * CHUNK,
                               metric_delta(mid, before, KVTIER_HITS, tier="peer"),
                               metric_delta(after, mid, KVTIER_HITS, tier="cpu"),
                               peer.token_ids == ref.token_ids, peer.token_ids == cold.token_ids,
                               peer.ttft_s, local.ttft_s))
            r = rows[-1]
            log(f"  P2P request {p.index}: {n} prompt tokens, peer hit {r.peer_hit_tokens}, cpu hit "
                f"{r.local_hit_tokens}, TTFT peer {peer.ttft_s * 1e3:.0f} ms / local {local.ttft_s * 1e3:.0f} ms")
    finally:
        for s in (a, b):
            s.stop()
        ex.shutdown()
    return rows


def run_pd_demo(json_path: Path | None = None, p2p_channel: str = "shm", log: Callable[[str], None] = print) -> int:
    """Run both legs, print the tables, write the JSON (``settings``, ``pd``, ``p2p``, ``summary``).

    ``p2p_channel``: "shm" (same machine: shared memory) or "tcp" (the cross-machine channel, on loopback).
    Returns 0 when every target passed, else 1. Raises :class:`DemoRequestError` or
    ``ServerStartError`` when a request or an instance fails (logs stay in a temp folder);
    ``ValueError`` for another channel.
    """
    from kvtier.demo.model import prepare_model

    if p2p_channel not in ("shm", "tcp"):
        raise ValueError(f"p2p_channel must be shm or tcp, got {p2p_channel!r}")

    model = str(prepare_model().path)
    warm, prompts = build_prompts(model)
    work = Path(tempfile.mkdtemp(prefix="kvtier-demo-pd-", dir="/tmp"))
    t0 = time.monotonic()
    ok = False
    try:
        with httpx.Client(timeout=300) as client:
            pd_rows = run_pd_leg(model, prompts, warm, work, client, log)
            p2p_rows = run_p2p_leg(model, prompts, warm, work, client, log, p2p_channel)
        settings = {"model": model, "chunk_size": CHUNK, "block_size": CHUNK, "num_gpu_blocks": NUM_BLOCKS,
                    "max_tokens": MAX_TOKENS, "cores": {"prefiller/A": "0", "decoder/B": "1"},
                    "p2p_channel": p2p_channel, "warmup_requests_per_leg": 1,
                    "ttft": TTFT_DEFINITION, "wall_s": round(time.monotonic() - t0, 1)}
        doc = report(pd_rows, p2p_rows, settings)
        print_tables(doc, log)
        if json_path is not None:
            Path(json_path).write_text(json.dumps(doc, indent=1))
        ok = bool(doc["summary"]["passed"])
    finally:
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"server logs kept in {work}")
    return 0 if ok else 1
