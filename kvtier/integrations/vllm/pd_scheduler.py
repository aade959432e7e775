"""Scheduler side of PD (see ``pd.py``): which requests are PD legs, partial-chunk keys, params, confirms.

Used by :class:`~kvtier.integrations.vllm.scheduler.KVTierScheduler`; it calls
:meth:`PDScheduler.annotate` on each new request tracker and the other methods at
the matching vLLM hooks. Trackers are the scheduler's ``_Tracker`` (duck-typed:
``tokens``, ``keys``, ``block_ids``, ``pd_*`` fields).
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.index.keys import ChunkHasher, KeyExtras
from kvtier.integrations.vllm.pd import (
    ConfirmSender,
    PDSettings,
    RemotePrefill,
    new_confirm_token,
    partial_key,
    prefill_params,
    wants_remote_decode,
)
from kvtier.integrations.vllm.types import ChunkCopy, KVTierMetadata, PDHold, TransferSpec
from kvtier.storage.types import LookupResult

log = logging.getLogger("kvtier.vllm")


class PDScheduler:
    """PD bookkeeping of one scheduler-side connector."""

    def __init__(self, settings: PDSettings, engine_id: str, hasher: ChunkHasher, blocks_per_chunk: int,
                 chunk_bytes: int = 0):
        self.settings = settings
        self.engine_id = engine_id
        self.hasher = hasher
        self.chunk_size = hasher.chunk_size
        self.bpc = blocks_per_chunk
        self.chunk_bytes = chunk_bytes  # bytes of one chunk (all layers): sizes sync loads
        self.sender = ConfirmSender()
        self._releases: list[str] = []  # aborted prefill legs whose hold the worker ends at the next step
        self._sync_bytes = 0  # bytes of sync PD loads planned in the step being scheduled
        self._confirm_tokens: dict[str, str] = {}  # prefill legs marked held -> their hold's confirm value
        self._unknown_warned: set[tuple[str, int]] = set()  # prefillers whose params were ignored (logged once)

    def annotate(self, tr: Any, request: Any, extras: KeyExtras | None) -> None:
        """Mark ``tr`` as a prefill or decode leg from ``request.kv_transfer_params``; key its partial chunk."""
        params = getattr(request, "kv_transfer_params", None)
        if self.settings.prefills and wants_remote_decode(params):
            tr.pd_prefill = True
        elif self.settings.decodes:
            remote = RemotePrefill.parse(params)
            if remote is not None and not self.settings.knows(remote.host, remote.port):
                where = (remote.host, remote.port)
                if where not in self._unknown_warned and len(self._unknown_warned) < 64:
                    self._unknown_warned.add(where)
                    log.warning("kvtier pd: ignoring kv_transfer_params naming prefiller %s:%d, not one this decoder "
                                "knows (pd_prefillers %s); the prompt is computed", remote.host, remote.port,
                                self.settings.prefillers if self.settings.prefillers is not None else "unset: loopback")
                remote = None
            tr.pd_remote = remote
        if not (tr.pd_prefill or tr.pd_remote is not None):
            return
        n = len(tr.tokens) % self.chunk_size
        if n:
            padded = tr.tokens + [0] * (self.chunk_size - n)
            last = self.hasher.keys(padded, request.cache_salt, extras=extras)[-1]
            tr.keys = tr.keys + [partial_key(last, n)]
            tr.pd_partial = n

    # -- decoder ---------------------------------------------------------------------------
    def decode_hit(self, tr: Any, res: LookupResult, num_computed_tokens: int) -> tuple[LookupResult, bool]:
        """The lookup of every key (partial included) as a token count, and whether to load it synchronously.

        Sync (see ``PDSettings.sync_load_bytes``) when every chunk past the engine's own
        ``num_computed_tokens`` is in the CPU tier (memory on this machine) and this
        step's sync PD loads stay within the budget; the hit is then capped at the
        prompt minus its last token (vLLM computes that token in the same step).
        Otherwise the hit is capped at the prompt (an async load; vLLM recomputes the
        last token once it has arrived).
        """
        n = len(tr.tokens)
        hit = min(res.num_tokens, n)
        first = num_computed_tokens // self.chunk_size
        last = -(-min(hit, n - 1) // self.chunk_size)  # chunks [first, last) a sync load copies
        cost = max(0, last - first) * self.chunk_bytes
        sync = (
            self.settings.sync_load_bytes > 0
            and min(hit, n - 1) > num_computed_tokens
            and all(t == "cpu" for t in res.tiers[first:last])
            and self._sync_bytes + cost <= self.settings.sync_load_bytes
        )
        if sync:
            self._sync_bytes += cost
            hit = min(hit, n - 1)
        return LookupResult(hit, list(res.keys), list(res.tiers)), sync

    def confirm(self, tr: Any) -> None:
        """Tell the prefiller its hold can end (once per request)."""
        if tr.pd_remote is not None and not tr.pd_confirmed:
            tr.pd_confirmed = True
            self.sender.send(tr.pd_remote)

    # -- prefiller -------------------------------------------------------------------------
    def on_prompt_computed(self, tr: Any, computed_after_step: int, save: bool, meta: KVTierMetadata) -> None:
        """At the step that completes a prefill leg's prompt: save the partial chunk, mark the hold."""
        if not tr.pd_prefill or tr.pd_marked or computed_after_step < len(tr.tokens):
            return
        if save and tr.pd_partial:
            p = len(tr.keys) - 1
            bs_tokens = self.chunk_size // self.bpc
            nblocks = -(-tr.pd_partial // bs_tokens)
            blocks = tuple(tr.block_ids[p * self.bpc : p * self.bpc + nblocks])
            if len(blocks) == nblocks:
                parent = tr.keys[p - 1] if p else tr.lineage
                meta.saves.append(TransferSpec(tr.req_id, [ChunkCopy(tr.keys[p], blocks, 0, parent)]))
        token = self._confirm_tokens[tr.req_id] = new_confirm_token()
        meta.pd_holds.append(PDHold(tr.req_id, list(tr.keys), token))
        tr.pd_marked = True

    def finished(self, tr: Any, request: Any, block_ids: list[int]) -> dict[str, Any] | None:
        """``request_finished`` of a PD leg: the params to return (prefill) or the confirm (decode)."""
        self.confirm(tr)
        if not tr.pd_marked:
            return None
        token = self._confirm_tokens.pop(tr.req_id, "")
        status = str(getattr(request, "status", ""))
        if "ABORTED" in status.upper():
            self._releases.append(tr.req_id)
            return None
        return prefill_params(self.settings, self.engine_id, tr.req_id, block_ids, len(tr.tokens), token)

    def end_step(self, meta: KVTierMetadata) -> None:
        """Once per engine step (``build_connector_meta``): queue aborted holds' releases, reset the sync budget."""
        meta.pd_releases.extend(self._releases)
        self._releases = []
        self._sync_bytes = 0

    def close(self) -> None:
        self.sender.close()
