"""vLLM 0.32's real ``Scheduler`` / ``AsyncScheduler`` driving kvtier's real connector, with an auditing forward.

The harness plays vLLM's engine core and model runner around kvtier's two
connector halves (the scheduler half is built by vLLM's scheduler itself, the
worker half here) on CPU KV tensors:

- **engine core**: ``Scheduler.schedule`` / ``update_from_output``; with
  ``async_scheduling`` the ``AsyncScheduler`` behind a two-deep batch queue, as
  ``EngineCore.step_with_batch_queue`` does (step k+1 is scheduled, and run,
  before step k's output is processed).
- **model runner**: block tables mirrored from each ``SchedulerOutput``; the KV
  connector lifecycle of vLLM's ``KVConnectorModelRunnerMixin`` (bind, sync loads
  before the forward or any loads after it, ``wait_for_save``, transfer results,
  load errors, events, worker metadata); every block vLLM hands out fresh from its
  free pool is scribbled over before the step, so a block nobody filled never
  holds the right KV by accident.
- **forward**: a poisoned-KV model. The KV of position ``p`` at layer 0 is a hash of
  (token, ``p``); at layer ``l > 0`` also of a digest of the layer ``l-1`` KV of
  positions ``0..p`` *as read from the paged cache*; the layers run one after the
  other over the whole batch, so a request sees what another wrote in the same
  step, as attention does. A sampled token is a hash of the top layer's digest.
  So the KV (and every later token) of anything computed over a wrong block is
  wrong, and the KV of a prompt is a pure function of its tokens (its "cold" KV).
- **audit**: every chunk kvtier commits is compared, at commit, with the cold KV
  of its tokens (``Audit.bad_commits``); every read of a block that does not hold
  its cold KV is recorded (``Audit.wrong_reads``) to show a scenario exercised the
  hazard.
- **faults**: the worker's store is wrapped so chosen reads fail (``FaultyStore``).

Sizes: bf16 KV ``[num_blocks, heads, block_size, 2 * head_dim]`` per layer.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch

VOCAB = 50_000

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wraps mod 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 8
    block_size: int = 16

    @property
    def width(self) -> int:
        """uint16 values per (layer, token)."""
        return self.num_kv_heads * 2 * self.head_dim


class PoisonModel:
    """The deterministic forward (see the module doc)."""

    def __init__(self, g: Geometry):
        self.g = g
        rng = np.random.default_rng(1234)
        self._w = rng.integers(1, 2**63, size=g.width, dtype=np.uint64)
        self._cols = np.arange(g.width, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)

    def values(self, layer: int, tokens: np.ndarray, pos: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """KV of ``layer`` at ``pos``: uint16 ``[n, width]``."""
        seed = _mix(tokens.astype(np.uint64) * np.uint64(1_000_003) + pos.astype(np.uint64) * np.uint64(7919)
                    + np.uint64(layer * 104_729 + 1))
        seed = _mix(seed ^ ctx)
        return (_mix(seed[:, None] + self._cols[None, :]) & np.uint64(0xFFFF)).astype(np.uint16)

    def digest(self, rows: np.ndarray) -> np.ndarray:
        """Per position p, a digest of ``rows[0..p]`` (uint64 ``[n]``)."""
        pos = np.arange(len(rows), dtype=np.uint64)
        h = _mix((rows.astype(np.uint64) * self._w[None, :]).sum(axis=1, dtype=np.uint64) + pos * np.uint64(31))
        return np.cumsum(h, dtype=np.uint64)

    def sample(self, top_digest: np.uint64) -> int:
        return int(_mix(np.array([top_digest], dtype=np.uint64))[0] % np.uint64(VOCAB))

    def cold(self, tokens: list[int]) -> list[np.ndarray]:
        """The KV of ``tokens`` computed from scratch: per layer uint16 ``[n, width]``."""
        t = np.asarray(tokens, dtype=np.int64)
        pos = np.arange(len(t))
        out: list[np.ndarray] = []
        for layer in range(self.g.num_layers):
            ctx = np.zeros(len(t), dtype=np.uint64) if layer == 0 else self.digest(out[-1])
            out.append(self.values(layer, t, pos, ctx))
        return out

    def cold_generate(self, prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            top = self.cold(seq)[-1]
            seq.append(self.sample(self.digest(top)[-1]))
        return seq[len(prompt):]


# -- engine configuration ----------------------------------------------------------------------
_MODEL_DIRS: dict[Geometry, str] = {}


def _model_dir(g: Geometry) -> str:
    """A Hugging Face config folder of a tiny Llama of geometry ``g`` (no weights are ever loaded)."""
    if g not in _MODEL_DIRS:
        d = tempfile.mkdtemp(prefix="kvtier-sched-model-")
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": g.num_kv_heads,
            "head_dim": g.head_dim, "num_hidden_layers": g.num_layers, "vocab_size": VOCAB,
            "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
        }
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        _MODEL_DIRS[g] = d
    return _MODEL_DIRS[g]


@dataclass
class EngineSpec:
    """One engine's knobs (vLLM's and kvtier's)."""

    geometry: Geometry = Geometry()
    num_blocks: int = 64
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 16
    max_model_len: int = 2048
    async_scheduling: bool = False
    chunk_size: int = 16
    cpu_chunks: int = 256
    extra: dict[str, Any] = field(default_factory=dict)


def _layer_names(g: Geometry) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(g.num_layers)]


_CONFIGS: dict[tuple, tuple[Any, Any]] = {}


def build_config(spec: EngineSpec, engine_id: str) -> tuple[Any, Any]:
    """``(VllmConfig, KVCacheConfig)`` of an engine with kvtier as its connector.

    vLLM's part is built once per set of vLLM knobs (a few seconds) and reused;
    kvtier's (engine id, extra config) is set on it for each engine.
    """
    g = spec.geometry
    chunk_bytes = g.num_layers * g.block_size * g.width * 2 * (spec.chunk_size // g.block_size)
    extra = {"model_id": "sched-harness", "chunk_size": spec.chunk_size,
             "cpu_capacity": spec.cpu_chunks * chunk_bytes, **spec.extra}
    knobs = (g, spec.num_blocks, spec.max_num_batched_tokens, spec.max_num_seqs, spec.max_model_len,
             spec.async_scheduling)
    if knobs not in _CONFIGS:
        _CONFIGS[knobs] = _build_vllm_config(spec)
    vc, kcc = _CONFIGS[knobs]
    vc.kv_transfer_config.engine_id = engine_id
    vc.kv_transfer_config.kv_connector_extra_config = extra
    vc.kv_transfer_config.kv_load_failure_policy = "recompute"
    return vc, kcc


def _build_vllm_config(spec: EngineSpec) -> tuple[Any, Any]:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    g = spec.geometry
    mc = ModelConfig(model=_model_dir(g), skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=spec.max_model_len, seed=0)
    sc = SchedulerConfig(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                         max_model_len=spec.max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=g.block_size, cache_dtype="auto", enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                          kv_role="kv_both", kv_connector_extra_config={}, engine_id="unset",
                          kv_load_failure_policy="recompute")
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kt,
                    device_config=DeviceConfig("cpu"))
    # vLLM's CPU platform turns async scheduling off (its model runner cannot overlap
    # steps); this harness's runner can, so the engine core's async path is restored.
    vc.scheduler_config.async_scheduling = spec.async_scheduling
    vc.cache_config.num_gpu_blocks = spec.num_blocks
    page = g.block_size * g.width * 2
    names = _layer_names(g)
    kcc = KVCacheConfig(
        num_blocks=spec.num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=g.num_layers * spec.num_blocks * page, layers=names,
                                        layer_stride=spec.num_blocks * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(names, FullAttentionSpec(block_size=g.block_size,
                                                                    num_kv_heads=g.num_kv_heads,
                                                                    head_size=g.head_dim, dtype=torch.bfloat16))],
    )
    return vc, kcc


# -- faults and the commit audit -----------------------------------------------------------------
class FaultyStore:
    """The worker's store with injected read failures; checks every commit against cold KV.

    ``fail_read(key, item_index, reads_so_far)`` decides whether one item of an
    ``open_read_many`` comes back as a miss (a failed read).
    """

    def __init__(self, inner: Any, audit: "Audit"):
        self._inner = inner
        self._audit = audit
        self._bufs: dict[bytes, np.ndarray] = {}
        self.fail_read: Callable[[bytes], bool] = lambda key: False
        self.failed_reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def open_read_many(self, items: Any) -> list[Any]:
        handles = self._inner.open_read_many(items)
        out = []
        for (key, _), h in zip(items, handles):
            if h is not None and self.fail_read(key):
                h.close()
                self.failed_reads += 1
                h = None
            out.append(h)
        return out

    def open_write_many(self, keys: Any, *args: Any, **kwargs: Any) -> list[Any]:
        got = self._inner.open_write_many(keys, *args, **kwargs)
        for k, g in zip(keys, got):
            if isinstance(g, np.ndarray):
                self._bufs[k] = g
        return got

    def commit(self, key: bytes, *args: Any, **kwargs: Any) -> None:
        buf = self._bufs.pop(key, None)
        if buf is not None:
            self._audit.check_commit(key, buf)
        self._inner.commit(key, *args, **kwargs)

    def abort(self, key: bytes) -> None:
        self._bufs.pop(key, None)
        self._inner.abort(key)


@dataclass
class Audit:
    """What the harness saw: commits that differ from cold KV, reads of wrong blocks."""

    model: PoisonModel
    geometry: Geometry
    chunk_size: int
    chunk_tokens: dict[bytes, list[int]] = field(default_factory=dict)  # key -> tokens up to the chunk's end
    bad_commits: list[tuple[bytes, int]] = field(default_factory=list)  # (key, chunk index)
    unknown_commits: list[bytes] = field(default_factory=list)
    commits: int = 0
    wrong_reads: list[tuple[int, str, int]] = field(default_factory=list)  # (step, request, block index)

    def matches(self, buf: np.ndarray, tokens: list[int]) -> bool:
        """Whether a stored chunk holds the cold KV of the chunk of ``tokens`` that ends at
        ``len(tokens)`` (a PD partial chunk: only its first ``len(tokens) % chunk_size`` positions)."""
        g, cs = self.geometry, self.chunk_size
        n = len(tokens) % cs or cs
        start = len(tokens) - n
        cold = self.model.cold(tokens)
        bpc = cs // g.block_size
        got = buf.view(np.uint16).reshape(g.num_layers, bpc, g.num_kv_heads, g.block_size, 2 * g.head_dim)
        got = got.transpose(0, 1, 3, 2, 4).reshape(g.num_layers, cs, g.width)[:, :n]
        return bool(np.array_equal(got, np.stack([c[start:] for c in cold])))

    def check_commit(self, key: bytes, buf: np.ndarray) -> None:
        self.commits += 1
        tokens = self.chunk_tokens.get(key)
        if tokens is None:
            self.unknown_commits.append(key)
            return
        if not self.matches(buf, tokens):
            self.bad_commits.append((key, -(-len(tokens) // self.chunk_size) - 1))

    def check_store(self, manager: Any) -> list[bytes]:
        """Keys of chunks resident in the CPU tier whose bytes differ from cold KV (or are unknown)."""
        bad = []
        for key, _ in manager.cpu.resident():
            buf = manager.cpu.acquire(key)
            if buf is None:
                continue
            try:
                tokens = self.chunk_tokens.get(key)
                if tokens is None or not self.matches(buf, tokens):
                    bad.append(key)
            finally:
                manager.cpu.release(key)
        return bad


# -- the engine -----------------------------------------------------------------------------------
@dataclass
class _RunnerReq:
    table: list[int]
    seq: list[int]  # prompt, then tokens sampled by this runner (by position)


class Engine:
    """One engine: vLLM's scheduler (with kvtier's scheduler half), kvtier's worker half, the runner."""

    _counter = 0

    def __init__(self, spec: EngineSpec, engine_id: str | None = None):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvtier.integrations.vllm import KVTierConnector

        Engine._counter += 1
        self.engine_id = engine_id or f"sched-harness-{os.getpid()}-{Engine._counter}"
        self.spec = spec
        g = self.g = spec.geometry
        self.vllm_config, self.kv_cache_config = build_config(spec, self.engine_id)
        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(g.block_size, sha256)
        # The worker half first: it owns the tiers; the scheduler half finds them in this process.
        self.worker = KVTierConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        per_layer = spec.num_blocks * g.num_kv_heads * g.block_size * 2 * g.head_dim
        flat = torch.empty(g.num_layers * per_layer, dtype=torch.bfloat16)
        shape = (spec.num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_dim)
        tensors = [flat[i * per_layer:(i + 1) * per_layer].view(shape) for i in range(g.num_layers)]
        self.kv_caches = dict(zip(_layer_names(g), tensors))
        self.worker.register_kv_caches(self.kv_caches)
        self.cache = [t.view(torch.int16).numpy().view(np.uint16) for t in tensors]  # [nb, heads, bs, 2hd]
        for c in self.cache:
            c[...] = 0xFFFF
        cls = AsyncScheduler if spec.async_scheduling else Scheduler
        self.sched = cls(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                         structured_output_manager=StructuredOutputManager(self.vllm_config),
                         block_size=g.block_size, log_stats=True)
        self.connector = self.sched.connector
        self.model = PoisonModel(g)
        self.audit = Audit(self.model, g, spec.chunk_size)
        self.store = FaultyStore(self.worker.worker.store, self.audit)
        self.worker.worker.store = self.store
        self.manager = self.store._inner
        self._rng = np.random.default_rng(7)
        self._fresh: list[int] = []
        pool = self.sched.kv_cache_manager.block_pool
        original = pool.get_new_blocks

        def get_new_blocks(num_blocks: int) -> list[Any]:
            blocks = original(num_blocks)
            self._fresh.extend(b.block_id for b in blocks)
            return blocks

        pool.get_new_blocks = get_new_blocks  # type: ignore[method-assign]
        self._reqs: dict[str, _RunnerReq] = {}
        self._seqs: dict[str, list[int]] = {}  # tokens of preempted requests
        self.trace: list[str] | None = None  # set to a list to record what happened, step by step
        self._queue: deque[tuple[Any, Any]] = deque()
        self.step_no = 0
        self.outputs: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}  # request id -> finish status name
        self.transfer_params: dict[str, dict[str, Any]] = {}  # kv_transfer_params a request finished with
        self.preemptions = 0
        self.hooks: list[Callable[["Engine", Any], None]] = []  # called with each SchedulerOutput

    # -- requests ---------------------------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1,
            kv_transfer_params: dict[str, Any] | None = None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        cs = self.spec.chunk_size
        for ci, key in enumerate(self.manager.keys(prompt)):
            self.audit.chunk_tokens[key] = list(prompt[: (ci + 1) * cs])
        if kv_transfer_params and len(prompt) % cs:  # a PD leg stores its last partial chunk too
            from kvtier.integrations.vllm.pd import partial_key

            padded = list(prompt) + [0] * (cs - len(prompt) % cs)
            self.audit.chunk_tokens[partial_key(self.manager.keys(padded)[-1], len(prompt) % cs)] = list(prompt)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
        req = Request(req_id, list(prompt), sp, None, block_hasher=self._block_hasher)
        self.prompts[req_id] = list(prompt)
        self.sched.add_request(req)

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.finished.setdefault(req_id, "aborted")

    def reset_prefix_cache(self) -> bool:
        return self.sched.reset_prefix_cache()

    @property
    def busy(self) -> bool:
        return self.sched.has_requests() or bool(self._queue)

    # -- engine core ------------------------------------------------------------------------
    def step(self) -> None:
        """One engine-core step (sync: schedule, run, update; async: the batch-queue step)."""
        if not self.spec.async_scheduling:
            so = self.sched.schedule()
            out = self._execute(so)
            self._update(so, out)
            return
        if self.sched.has_requests():
            so = self.sched.schedule()
            out = self._execute(so)
            self._queue.appendleft((so, out))
            if len(self._queue) < 2 and (so.total_num_scheduled_tokens > 0 or self.sched.has_requests()):
                return
        if not self._queue:
            return
        so, out = self._queue.pop()
        self._update(so, out)

    def run(self, max_steps: int = 5_000, between: Callable[["Engine"], None] | None = None) -> None:
        """Step until every request finished (and the batch queue drained)."""
        for _ in range(max_steps):
            if not self.busy:
                return
            self.step()
            if between is not None:
                between(self)
        raise AssertionError(f"engine still busy after {max_steps} steps: {self.sched.get_num_unfinished_requests()} left")

    def _update(self, so: Any, out: Any) -> None:
        outputs = self.sched.update_from_output(so, out)
        for eco in outputs.values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)
                if o.kv_transfer_params:
                    self.transfer_params[o.request_id] = o.kv_transfer_params
        self.connector.check_invariants()

    # -- model runner -----------------------------------------------------------------------
    def _execute(self, so: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.step_no += 1
        for hook in self.hooks:
            hook(self, so)
        for b in self._fresh:  # a block nobody wrote holds garbage, never last use's KV
            for c in self.cache:
                c[b] = self._rng.integers(0, 0x10000, size=c[b].shape, dtype=np.uint16)
        self._fresh = []
        self.preemptions += len(so.preempted_req_ids or ())
        for rid in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            rr = self._reqs.pop(rid, None)
            if rr is not None and rid not in so.finished_req_ids:
                self._seqs[rid] = rr.seq  # its blocks are freed; its tokens come back when it resumes
        batch: list[tuple[str, int, int]] = []
        for new in so.scheduled_new_reqs:
            self._reqs[new.req_id] = _RunnerReq(list(new.block_ids[0]), list(self.prompts[new.req_id]))
            batch.append((new.req_id, new.num_computed_tokens, so.num_scheduled_tokens[new.req_id]))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            rr = self._reqs.get(rid)
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids or rr is None:
                seq = rr.seq if rr is not None else self._seqs.pop(rid, None) or list(self.prompts[rid])
                rr = self._reqs[rid] = _RunnerReq(list(nb[0]) if nb else [], seq)
            elif nb:
                rr.table.extend(nb[0])
            batch.append((rid, cached.num_computed_tokens[i], so.num_scheduled_tokens[rid]))
        conn = self.worker
        conn.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            conn.start_load_kv(None)
        sampled = self._forward(batch) if batch else {}
        if not so.has_sync_kv_loads:
            conn.start_load_kv(None)
        conn.wait_for_save()
        results = conn.get_transfer_results(so.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_cache_events=conn.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=conn.build_connector_worker_meta(),
        )
        conn.clear_connector_metadata()
        req_ids = [rid for rid, _, _ in batch]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[sampled[rid]] if rid in sampled else [] for rid in req_ids],
            kv_connector_output=kv_out,
        )

    def _rows(self, layer: int, table: list[int], end: int) -> np.ndarray:
        pos = np.arange(end)
        blocks = np.asarray(table, dtype=np.int64)[pos // self.g.block_size]
        return self.cache[layer][blocks, :, pos % self.g.block_size, :].reshape(end, self.g.width)

    def _forward(self, batch: list[tuple[str, int, int]]) -> dict[str, int]:
        """Compute each request's scheduled positions, layer by layer over the whole batch."""
        g, bs = self.g, self.g.block_size
        work = []
        for rid, start, n in batch:
            rr = self._reqs[rid]
            end = start + n
            assert len(rr.seq) >= end, f"{rid}: runner has {len(rr.seq)} tokens, step ends at {end}"
            assert len(rr.table) * bs >= end, f"{rid}: {len(rr.table)} blocks for {end} tokens"
            req = self.sched.requests[rid]
            work.append((rid, rr, start, end, not req.is_prefill_chunk))
        for layer in range(g.num_layers):
            for rid, rr, start, end, _ in work:
                pos = np.arange(start, end)
                toks = np.asarray(rr.seq[start:end], dtype=np.int64)
                ctx = np.zeros(len(pos), dtype=np.uint64) if layer == 0 else self.model.digest(
                    self._rows(layer - 1, rr.table, end))[start:end]
                vals = self.model.values(layer, toks, pos, ctx)
                blocks = np.asarray(rr.table, dtype=np.int64)[pos // bs]
                self.cache[layer][blocks, :, pos % bs, :] = vals.reshape(len(pos), g.num_kv_heads, 2 * g.head_dim)
        for rid, rr, start, end, _ in work:
            # What it read without writing it (as it stands after the whole batch's
            # writes, which attention sees): the cold KV, or a wrong read.
            if start:
                cold = self.model.cold(rr.seq[:start])
                for layer in range(g.num_layers):
                    wrong = np.any(self._rows(layer, rr.table, start) != cold[layer], axis=1)
                    for bi in sorted(set((np.nonzero(wrong)[0] // bs).tolist())):
                        self.audit.wrong_reads.append((self.step_no, rid, int(bi)))
        sampled: dict[str, int] = {}
        for rid, rr, start, end, samples in work:
            if samples:
                top = self.model.digest(self._rows(g.num_layers - 1, rr.table, end))[end - 1]
                tok = self.model.sample(top)
                del rr.seq[end:]
                rr.seq.append(tok)
                sampled[rid] = tok
        return sampled

    # -- results ----------------------------------------------------------------------------
    def hits(self, req_id: str) -> Any:
        return self.connector.scheduler.ledger.get(req_id)

    def wrong_outputs(self) -> list[str]:
        """Finished (not aborted) requests whose tokens differ from a cold run's."""
        bad = []
        for rid, toks in self.outputs.items():
            if "abort" in self.finished.get(rid, "").lower() or rid not in self.finished:
                continue
            if toks != self.model.cold_generate(self.prompts[rid], len(toks)):
                bad.append(rid)
        return bad

    def shutdown(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()


def tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids."""
    return np.random.default_rng(seed).integers(1, VOCAB, size=n).tolist()


def fail_once(keys: Iterable[bytes]) -> Callable[[bytes], bool]:
    """A read plan: the first read of each of ``keys`` fails, later ones succeed."""
    pending = set(keys)

    def plan(key: bytes) -> bool:
        if key in pending:
            pending.discard(key)
            return True
        return False

    return plan


# -- randomised request mixes ---------------------------------------------------------------------
@dataclass
class MixResult:
    """What one mix did and saw (every field is summed over mixes by the randomised test)."""

    seed: int
    async_scheduling: bool
    requests: int = 0
    failed_reads: int = 0
    wrong_reads: int = 0
    preemptions: int = 0
    aborts: int = 0
    commits: int = 0
    kvtier_hit_tokens: int = 0
    bad_commits: int = 0
    bad_resident: int = 0
    unknown_commits: int = 0
    mirror_mismatches: int = 0
    wrong_outputs: int = 0


def check_mirror(engine: Engine) -> int:
    """Requests whose block table, as kvtier's worker mirrors it, differs from the runner's."""
    worker = engine.worker.worker
    return sum(1 for rid, rr in engine._reqs.items() if worker.mirrored_table(rid) != rr.table)


def run_mix(seed: int, async_scheduling: bool, p_fail: float = 0.3,
            tweak: Callable[[Engine], None] | None = None) -> MixResult:
    """One randomised mix: shared prefixes, a small KV cache (preemptions), failing reads, aborts.

    Phase 1 stores some prompts; the engine's prefix cache is reset; phase 2 sends
    requests over shared prefixes at random steps while each chunk read fails with
    probability ``p_fail``, some requests are aborted and the prefix cache is reset
    when idle. ``tweak`` may break the engine on purpose (the audit must notice).
    """
    rng = np.random.default_rng(seed)
    chunk = int(rng.choice([16, 32]))
    spec = EngineSpec(
        num_blocks=int(rng.integers(12, 32)), max_num_batched_tokens=int(rng.choice([16, 32, 48, 96])),
        max_num_seqs=8, async_scheduling=async_scheduling, chunk_size=chunk, cpu_chunks=int(rng.integers(4, 64)),
    )
    eng = Engine(spec)
    res = MixResult(seed, async_scheduling)
    try:
        if tweak is not None:
            tweak(eng)
        segs = [tokens(seed * 100 + i, int(rng.integers(12, 64))) for i in range(4)]

        def prompt() -> list[int]:
            parts = [segs[int(i)] for i in rng.choice(4, size=int(rng.integers(1, 4)))]
            if rng.random() < 0.8:  # most prompts share one of two heads
                parts[0] = segs[int(rng.integers(0, 2))]
            p = [t for part in parts for t in part] + tokens(int(rng.integers(1 << 30)), int(rng.integers(1, 20)))
            return p[: spec.num_blocks * spec.geometry.block_size // 2]  # fits the KV cache with room to spare

        n = 0
        for _ in range(int(rng.integers(2, 6))):
            eng.add(f"w{n}", prompt(), max_tokens=1)
            n += 1
        eng.run()
        eng.reset_prefix_cache()
        eng.store.fail_read = lambda key: bool(rng.random() < p_fail)
        pending = int(rng.integers(4, 13))
        for _ in range(4000):
            if pending and (not eng.busy or rng.random() < 0.4):
                for _ in range(int(rng.integers(1, 3))):
                    if pending:
                        eng.add(f"r{n}", prompt(), max_tokens=int(rng.integers(1, 9)))
                        n += 1
                        pending -= 1
            if not eng.busy:
                if not pending:
                    break
                continue
            eng.step()
            res.mirror_mismatches += check_mirror(eng)
            live = [r for r in eng.sched.requests]
            if live and rng.random() < 0.03:
                eng.abort(str(rng.choice(live)))
                res.aborts += 1
            if rng.random() < 0.05:
                eng.reset_prefix_cache()  # succeeds only when nothing runs
        else:
            raise AssertionError(f"mix {seed}: still busy")
        res.requests = n
        res.failed_reads = eng.store.failed_reads
        res.wrong_reads = len(eng.audit.wrong_reads)
        res.preemptions = eng.preemptions
        res.commits = eng.audit.commits
        res.bad_commits = len(eng.audit.bad_commits)
        res.unknown_commits = len(eng.audit.unknown_commits)
        res.bad_resident = len(eng.audit.check_store(eng.manager))
        res.wrong_outputs = len(eng.wrong_outputs())
        res.kvtier_hit_tokens = sum(h.kvtier_hit_tokens for h in (eng.hits(f"r{i}") for i in range(n)) if h)
        return res
    finally:
        eng.shutdown()
