"""Client-side load verification: the engine checks each loaded CPU chunk's commit checksum itself,
as it copies the chunk (``ServiceClient(verify="client")``, the vLLM connector's client).

Why. The cache service checks every chunk it serves against the xxh3-64 taken at
commit (:mod:`kvtier.service.integrity`: any client maps the pool read-write and a
buggy one can scribble on slots). Checked by the server before it answers, the hash
is a pass of its own over the chunk's memory, serially before the client's copy
(another pass): 0.59x of an embedded load in ``kvtier bench server``, and on the
2-vCPU VM under load the hash alone ran as slowly as the copy (both bound by memory).
Here the server answers at once with each chunk's commit checksum and the client
checks the chunk while it copies it, in one of two ways (the vLLM worker's copy,
:func:`kvtier.integrations.block_copy.load_handle`):

- by default (``verify_helper=False``) the copy takes the checksum
  (:meth:`ServiceReadHandle.claim`) and hashes each copied run from its destination right
  after writing it, while it is in the CPU cache (:func:`~kvtier.integrations.block_copy.load_blocks_checked`):
  the hash covers exactly the bytes the engine received. This is the vLLM worker's copy on
  the CPU backend, hybrid models included (:func:`~kvtier.integrations.block_copy.load_handle_grouped`);
  its CUDA copies read :attr:`ServiceReadHandle.buffer`, checked just before they copy, which
  leaves the window of the server-side check between the two reads;
- with a helper thread (``verify_helper=True``, opt-in): as each chunk's copy starts the
  copier hands the chunk to the helper (:meth:`ServiceReadHandle.check_beside`), which
  hashes the whole slot without the GIL while the copier copies it, then the copy waits
  for the verdict. Faster where a core is free, but the hash may read a region before the
  copy does (the copier descheduled), so a scribble landing between the two reads passes:
  the guarantee of the server-side check, not of the default. Not the connector's default
  for that reason (the hostile trial of December 6 showed it with a delayed copier).

Measured side by side in ``kvtier bench server`` on 2 vCPUs (16 x 5.9 MB, medians of 9):
the default (hashed in the copy) 0.69-0.70x of an embedded load, the helper beside the copy
0.74-0.76x, the server checking first 0.55-0.59x; handing every chunk to the helper at once,
so that it hashes ahead of the copies (another pass over memory), measured 0.60-0.69x. A
caller that reads ``buffer`` instead gets the chunk checked just before, in its own thread.

Safety argument (every load is still verified, against the same checksum):

- no KV computed over a scribbled chunk is used or stored: a ``buffer`` reader gets
  the bytes only after they matched (else :class:`~kvtier.storage.types.ChunkUnavailable`);
  the fused copy writes the engine's blocks first and raises ``ChunkUnavailable`` when the
  whole slot does not match, and the vLLM worker then reports that chunk's blocks and
  every later one of the request for recompute, as for any failed load;
- the bytes checked are the bytes copied: by default each copied run is hashed from its
  destination right after the copy wrote it (the server-side check, and the opt-in helper,
  read the slot apart from the copy, so a scribble between the two reads can pass). Runs
  the load does not need are hashed from the slot, since the checksum covers the whole slot;
- the server stays the authority on its cache: a mismatch is reported on ``unload``
  (``corrupt``), the server checks the slot again itself and drops the chunk if it
  differs; a client that lies can only make the server re-hash one of its own
  loads, and one that skips the check only serves itself unverified bytes, which a
  client that scribbles could do anyway. Write-behind stays checked by the server.

Measured side by side in ``kvtier bench server`` (``load_ratio``: the connector's way;
``load_ratio_server_verify``: the server checks first; ``load_ratio_client_helper``: the
opt-in helper thread).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Protocol

import numpy as np

from kvtier.service.integrity import chunk_sum_nogil

log = logging.getLogger(__name__)

#: Verdicts of one handle.
PENDING, GOOD, BAD = 0, 1, 2
#: Most seconds ``buffer`` waits for a verdict before it gives up (the chunk is then a miss).
VERDICT_TIMEOUT_S = 10.0


class Checked(Protocol):
    """What the verifier needs of a handle: its slot view, expected sum and verdict."""

    view: np.ndarray
    expected: int
    verdict: int
    closed: bool
    taken: bool


class LoadVerifier:
    """One helper thread that hashes handed-in slots (:meth:`submit_now`: the one being copied,
    first) and records each one's verdict.

    The caller never waits for a chunk the thread has not started: :meth:`wait` takes such a
    chunk out of the queue and hashes it on the caller's thread (so a busy machine, where the
    helper gets no core, costs what checking inline costs: hash, then copy while the chunk is
    still in cache). Started on first use; :meth:`close` stops it (pending handles are then
    left unverified, and their ``buffer`` raises).

    Args:
        helper: run the helper thread (started by the first :meth:`submit_now`). Default
            False: each chunk is checked by its caller, as it copies it (:meth:`claim`,
            :func:`kvtier.integrations.block_copy.load_blocks_checked`) or, for a caller
            reading ``buffer``, just before.
    """

    def __init__(self, helper: bool = False) -> None:
        self.helper = helper
        self._cv = threading.Condition()
        self._queue: deque[Checked] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.checked = 0
        self.mismatches = 0

    def submit_now(self, handle: Checked) -> bool:
        """Have the helper thread hash ``handle`` next, while the caller copies it; False (nothing
        queued) without a helper or once closed. Handing chunks over one at a time as each copy
        starts, rather than all at once ahead, keeps the helper on the chunk being copied: the
        two passes share its reads from memory (measured in ``kvtier bench server``)."""
        if not self.helper:
            return False
        with self._cv:
            if self._closed or (self._thread is not None and not self._thread.is_alive()):
                return False  # no helper left to hash it: the caller checks it in its copy
            if handle.taken or handle.verdict != PENDING:
                return False
            if any(h is handle for h in self._queue):  # handed over already (a retried copy)
                return True
            self._queue.appendleft(handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-load-verify", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return True

    def wait(self, handle: Checked, timeout_s: float = VERDICT_TIMEOUT_S) -> int:
        """``handle``'s verdict (``GOOD`` or ``BAD``), waiting up to ``timeout_s`` (then ``PENDING``)."""
        if handle.verdict != PENDING:
            return handle.verdict
        with self._cv:
            mine = not handle.taken and not self._closed
            if mine:  # not started by the helper: check it here instead of waiting
                handle.taken = True
                try:
                    self._queue.remove(handle)
                except ValueError:
                    pass
            else:
                self._cv.wait_for(lambda: handle.verdict != PENDING or self._closed, timeout_s)
                return handle.verdict
        self._check(handle)
        return handle.verdict

    def claim(self, handle: Checked) -> bool:
        """Take ``handle`` for a check its caller makes itself (as it copies); False if taken already."""
        with self._cv:
            if handle.taken or handle.verdict != PENDING:
                return False
            handle.taken = True
            try:
                self._queue.remove(handle)
            except ValueError:
                pass
            return True

    def unclaim(self, handle: Checked) -> None:
        """Undo :meth:`claim` for a check that did not finish (no verdict was reached)."""
        with self._cv:
            if handle.verdict == PENDING:
                handle.taken = False

    def settle(self, handle: Checked, ok: bool) -> None:
        """Record the verdict of a check made by the caller after :meth:`claim` (a handle's first
        verdict stands: it is never overwritten by a later one)."""
        with self._cv:
            if handle.verdict != PENDING:
                return
            self.checked += 1
            if not ok:
                self.mismatches += 1
            handle.verdict = GOOD if ok else BAD
            self._cv.notify_all()

    def _check(self, h: Checked) -> None:
        try:
            ok = chunk_sum_nogil(h.view) == h.expected
        except Exception:  # noqa: BLE001 - an unhashable slot is unverified: a miss, never a stuck helper
            log.exception("kvtier: hashing a loaded chunk failed; it is treated as a mismatch")
            ok = False
        self.settle(h, ok)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                h = self._queue.popleft()
                h.taken = True
            if h.closed:  # closed unread: its slot may already hold another chunk
                continue
            self._check(h)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (pending handles stay unverified)."""
        return self._closed

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
