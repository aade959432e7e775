"""Which engine blocks may hold wrong KV: the worker's guard that nothing computed over a failed load is stored.

A block holds wrong KV when a load into it failed (nothing or part of it was
copied), or when a forward wrote it while reading a block holding wrong KV
(attention reads every earlier position of the request). It holds right KV
again once a load into it succeeds, or a forward rewrites it from its first
position while reading only right KV. A stored chunk must have been computed
over right KV only: every block of its request from the first up to the chunk's
last one must hold right KV after the step's forward (:meth:`BlockValidity.clean`).

Blocks another connector loads (vLLM's MultiConnector) are held bad from the step
that loads them until that step's output reports no failure for them
(:class:`ForeignLoads`, on the scheduler side): a failure of another connector
reaches kvtier only after the step. Chunks computed over them in that window are
not stored (their KV may be right, but kvtier cannot know yet). Every block vLLM
reports invalid, whichever connector failed, is marked bad with every block after
it in each table holding it.

The worker learns of its own failed loads at once, before any forward reads
those blocks, whatever the scheduler side knows: under vLLM's async scheduling
step k+1 is planned before step k's failures reach the scheduler, and another
request may take blocks being loaded as a local prefix hit in the same step.
So the check is made here, per block, for every request, from the block tables
and token ranges of each step (:class:`~kvtier.integrations.vllm.types.StepBlocks`).

Model of a step (vLLM's forward, layer by layer over the whole batch: a request
reads what another wrote in the same step): for a request computing tokens
``[start, end)`` with block table ``T``, it reads ``T[:ceil(end / bs)]`` and
writes ``T[start // bs : ceil(end / bs)]``; a written block whose first
position is ``>= start`` is rewritten whole. Conservative at block granularity:
a block is clean only if every position of it is known right.

Cost: table deltas are O(blocks added) per step; while no block is bad, nothing
else is done. Bounded: at most the engine's block count of bad blocks, and one
table per live request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable

from kvtier.integrations.vllm.types import StepBlocks, TransferSpec

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger("kvtier.vllm")


class BlockValidity:
    """Mirror of the engine's block tables and the set of blocks that may hold wrong KV.

    Not thread-safe: the worker calls it under its lock (async loads end on a loader thread).
    """

    def __init__(self, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.bad: set[int] = set()
        self._tables: dict[str, list[int]] = {}
        self._where: dict[int, dict[str, int]] = {}  # block -> {request: position in its table}
        self._computing: dict[str, tuple[int, int]] = {}
        self._unverified: set[int] = set()  # bad until the step that loaded them reports no failure
        self._settled = True
        self._unknown_logged = False

    # -- block tables ----------------------------------------------------------------------
    def begin_step(self, step: StepBlocks) -> None:
        """Apply a step's table changes and remember what its forward computes."""
        for r in step.gone:
            self._forget(r)
        for r, table in step.tables.items():
            self._forget(r)
            self._tables[r] = []
            self._extend(r, table)
        for r, added in step.appended.items():
            if r in self._tables:
                self._extend(r, added)
        for b in step.verified:  # no longer unverified if loaded, failed or rewritten since
            if b in self._unverified:
                self._unverified.discard(b)
                self.bad.discard(b)
        for b in step.invalid:
            self.bad.add(b)
            for r, pos in self._where.get(b, {}).items():  # what its holders computed after it
                self.bad.update(self._tables[r][pos:])
        self.bad.update(step.unverified)
        self._unverified.update(step.unverified)
        self._computing = dict(step.computing)
        self._settled = False

    def _extend(self, r: str, blocks: Iterable[int]) -> None:
        table = self._tables[r]
        for b in blocks:
            self._where.setdefault(b, {})[r] = len(table)
            table.append(b)

    def _forget(self, r: str) -> None:
        for b in self._tables.pop(r, ()):
            holders = self._where.get(b)
            if holders is not None:
                holders.pop(r, None)
                if not holders:
                    del self._where[b]

    def table(self, r: str) -> list[int] | None:
        """The mirrored block table of ``r`` (tests compare it with the engine's)."""
        t = self._tables.get(r)
        return None if t is None else list(t)

    # -- loads -----------------------------------------------------------------------------
    def load_failed(self, blocks: Iterable[int]) -> None:
        """Blocks a load left unfilled (reported to vLLM for recompute)."""
        blocks = list(blocks)
        self.bad.update(blocks)
        self._unverified.difference_update(blocks)

    def loaded(self, blocks: Iterable[int]) -> None:
        """Blocks a load filled from a stored chunk."""
        blocks = list(blocks)
        self.bad.difference_update(blocks)
        self._unverified.difference_update(blocks)

    # -- the forward -----------------------------------------------------------------------
    def _first_bad(self, r: str, n: int) -> int | None:
        """Position of the first bad block among ``r``'s first ``n`` blocks (None: all right)."""
        table = self._tables.get(r)
        if table is None or not self.bad:
            return None
        if len(self.bad) < n:
            found = [p for b in self.bad if (p := self._where.get(b, {}).get(r)) is not None and p < n]
            return min(found) if found else None
        return next((p for p, b in enumerate(table[:n]) if b in self.bad), None)

    def settle(self) -> None:
        """Apply this step's forward to the bad set (once per step; after its sync loads)."""
        if self._settled:
            return
        self._settled = True
        if not self.bad:
            return
        bs = self.block_size
        spans: dict[str, tuple[int, int]] = {}  # request -> (first written, blocks read)
        for r, (start, end) in self._computing.items():
            table = self._tables.get(r)
            if table is None or end <= start:
                continue
            n = min(len(table), -(-end // bs))
            rewritten = table[-(-start // bs):n]
            self.bad.difference_update(rewritten)  # rewritten whole: right unless it read wrong KV
            self._unverified.difference_update(rewritten)
            spans[r] = (start // bs, n)
        tainted: set[str] = set()
        changed = True
        while changed:  # a request that read a bad block wrote bad blocks; others may read those
            changed = False
            for r, (w0, n) in spans.items():
                if r not in tainted and self._first_bad(r, n) is not None:
                    tainted.add(r)
                    self.bad.update(self._tables[r][w0:n])
                    changed = True

    # -- saves -----------------------------------------------------------------------------
    def clean(self, specs: list[TransferSpec]) -> list[TransferSpec]:
        """``specs`` cut before the first chunk computed over a bad block (chunks are in prompt order)."""
        self.settle()
        if not self.bad:
            return specs
        out: list[TransferSpec] = []
        for spec in specs:
            keep = len(spec.chunks)
            for i, ch in enumerate(spec.chunks):
                if not self._chunk_ok(spec.req_id, ch.block_ids):
                    keep = i
                    break
            if keep < len(spec.chunks):
                log.info("kvtier: request %s: %d chunk(s) not stored: computed over KV that failed to load",
                         spec.req_id, len(spec.chunks) - keep)
            if keep:
                out.append(TransferSpec(spec.req_id, spec.chunks[:keep], spec.is_async))
        return out

    def _chunk_ok(self, r: str, block_ids: tuple[int, ...]) -> bool:
        if not block_ids:
            return True
        pos = self._where.get(block_ids[-1], {}).get(r)
        if pos is None:  # not in the mirror: its reads are unknown, so it is not stored
            if not self._unknown_logged:
                self._unknown_logged = True
                log.warning("kvtier: request %s saves blocks its block table does not hold; not stored", r)
            return False
        return self._first_bad(r, pos + 1) is None


def step_blocks(scheduler_output: "SchedulerOutput") -> StepBlocks:
    """The block tables and token ranges of one engine step, for every request (vLLM's scheduler output)."""
    out = StepBlocks(gone=list(scheduler_output.finished_req_ids or ()) + list(scheduler_output.preempted_req_ids or ()))
    scheduled = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        out.tables[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
        start = new.num_computed_tokens
        out.computing[new.req_id] = (start, start + scheduled.get(new.req_id, 0))
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        new_blocks = cached.new_block_ids[i]
        if req_id in cached.resumed_req_ids:
            out.tables[req_id] = list(new_blocks[0]) if new_blocks else []
        elif new_blocks and new_blocks[0]:
            out.appended[req_id] = list(new_blocks[0])
        start = cached.num_computed_tokens[i]
        out.computing[req_id] = (start, start + scheduled.get(req_id, 0))
    return out


class ForeignLoads:
    """Scheduler side: blocks loaded by another connector, until their step's output is known.

    Each step's metadata is numbered (``KVTierMetadata.step``); the worker echoes the
    number in its worker metadata, so the output that reports a step's failures is
    matched to that step whatever the scheduler's step overlap. At most
    ``max_steps`` steps wait (an output never reported leaves its blocks bad: saves
    lost, nothing wrong stored).
    """

    def __init__(self, max_steps: int = 1024):
        self._step = 0
        self._pending: OrderedDict[int, list[int]] = OrderedDict()
        self._invalid: set[int] = set()
        self._verified: list[int] = []
        self._max_steps = max_steps

    def fill(self, blocks: StepBlocks) -> int:
        """Give this step's metadata what the worker must learn; returns the step's number."""
        self._step += 1
        blocks.invalid, self._invalid = sorted(self._invalid), set()
        blocks.verified, self._verified = self._verified, []
        if blocks.unverified:
            self._pending[self._step] = list(blocks.unverified)
            while len(self._pending) > self._max_steps:
                self._pending.popitem(last=False)
        return self._step

    def on_output(self, steps: Iterable[int], invalid: set[int]) -> None:
        """An output of the steps ``steps`` with vLLM's ``invalid`` block ids (any connector)."""
        self._invalid |= invalid
        for step in steps:
            for b in self._pending.pop(step, ()):
                if b not in invalid:
                    self._verified.append(b)
