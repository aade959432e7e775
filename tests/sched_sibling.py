"""A second KV connector beside kvtier under vLLM's ``MultiConnector``, for the scheduler harness.

``SiblingConnector`` claims the tokens that ``SiblingConnector.plan`` names for a
request (a synchronous load), and its worker either writes their cold KV into the
request's blocks (``PoisonModel``, like a cache that holds them) or, when the plan
says so, writes nothing and reports the blocks as failed. kvtier learns of such a
failure only from vLLM, after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from sched_audit import Geometry, PoisonModel


@dataclass
class _Load:
    req_id: str
    tokens: list[int]
    block_ids: list[int]  # the request's whole block table
    start: int
    end: int


@dataclass
class SiblingMeta(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


class SiblingConnector(KVConnectorBase_V1):
    #: request id -> (tokens it "holds" for the request, whether its load fails)
    plan: ClassVar[dict[str, tuple[int, bool]]] = {}
    geometry: ClassVar[Geometry] = Geometry()
    loads_done: ClassVar[int] = 0

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._pending: list[_Load] = []
        self._cache: list[np.ndarray] = []
        self._errors: set[int] = set()
        self._model = PoisonModel(self.geometry)

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self.plan.get(request.request_id, (0, False))[0]
        return max(0, n - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            end = self.plan[request.request_id][0]
            self._pending.append(_Load(request.request_id, list(request.prompt_token_ids),
                                       list(blocks.get_block_ids()[0]), end - num_external_tokens, end))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._pending = SiblingMeta(self._pending), []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        import torch

        self._cache = [t.view(torch.int16).numpy().view(np.uint16) for t in kv_caches.values()]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        g, bs = self.geometry, self.geometry.block_size
        for load in meta.loads:
            blocks = load.block_ids[load.start // bs : -(-load.end // bs)]
            if self.plan.get(load.req_id, (0, False))[1]:
                self._errors.update(blocks)
                continue
            SiblingConnector.loads_done += 1
            cold = self._model.cold(load.tokens[: load.end])
            pos = np.arange(load.start, load.end)
            table = np.asarray(load.block_ids, dtype=np.int64)[pos // bs]
            for layer, c in enumerate(self._cache):
                c[table, :, pos % bs, :] = cold[layer][load.start:].reshape(len(pos), g.num_kv_heads, 2 * g.head_dim)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
