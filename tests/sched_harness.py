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
from typing import Any, Callable

import numpy as np
import torch

from sched_audit import VOCAB, Audit, FaultyStore, Geometry, PoisonModel, fail_once, tokens  # noqa: F401 (re-exported)

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
    sibling: bool = False  # kvtier second under vLLM's MultiConnector, after sched_sibling.SiblingConnector


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
             spec.async_scheduling, spec.sibling)
    if knobs not in _CONFIGS:
        _CONFIGS[knobs] = _build_vllm_config(spec)
    vc, kcc = _CONFIGS[knobs]
    vc.kv_transfer_config.engine_id = engine_id
    vc.kv_transfer_config.kv_load_failure_policy = "recompute"
    if spec.sibling:
        vc.kv_transfer_config.kv_connector_extra_config = {"connectors": [
            {"kv_connector": "SiblingConnector", "kv_connector_module_path": "sched_sibling", "kv_role": "kv_both"},
            {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
             "kv_role": "kv_both", "kv_connector_extra_config": extra, "kv_load_failure_policy": "recompute"},
        ]}
    else:
        vc.kv_transfer_config.kv_connector_extra_config = extra
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
    if spec.sibling:
        kt = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", engine_id="unset",
                              kv_connector_extra_config={"connectors": []}, kv_load_failure_policy="recompute")
    else:
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
        if spec.sibling:
            from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

            self.worker = MultiConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.kv_worker = self.worker.sub_connectors[1]
        else:
            self.worker = KVTierConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.kv_worker = self.worker
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
        self.connector = self.sched.connector.sub_connectors[1] if spec.sibling else self.sched.connector
        self.model = PoisonModel(g)
        self.audit = Audit(self.model, g, spec.chunk_size)
        self.store = FaultyStore(self.kv_worker.worker.store, self.audit)
        self.kv_worker.worker.store = self.store
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
        self.expect_foreign = False  # another connector loads blocks (MultiConnector tests)

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
        meta = so.kv_connector_metadata
        blocks = getattr(meta, "blocks", None)
        # kvtier is the only connector here: any block it takes for another's load is a
        # misdetection that would silently cost saves.
        assert blocks is None or not blocks.unverified or self.expect_foreign, f"foreign loads {blocks.unverified}"
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
