"""Client-side load verification: the engine checks each loaded CPU chunk's commit checksum itself,
on a helper thread, ahead of its own copies (``ServiceClient(verify="client")``).

Why. The cache service checks every chunk it serves against the xxh3-64 taken at
commit (:mod:`kvtier.service.integrity`: any client maps the pool read-write and a
buggy one can scribble on slots). Checked by the server before it answers, the hash
(~2x memcpy speed) sat on the load's critical path, serially before the client's
copy: 0.59x of an embedded load in ``kvtier bench server``. Here the server answers at
once with each chunk's commit checksum, and this thread hashes the slots (through the
client's own mapping, in the caller's order, without holding the GIL:
:func:`~kvtier.service.integrity.chunk_sum_nogil`) while the caller copies: the caller's
first access to a handle's ``buffer`` waits only for that chunk's verdict, which is
ready before the caller gets there except for the first chunk.

Safety argument (every load is still verified, with the same checksum):

- a chunk's bytes are compared with its commit checksum before the caller may read
  them: ``buffer`` blocks until its chunk is verified and raises
  :class:`~kvtier.storage.types.ChunkUnavailable` on a mismatch (the vLLM worker
  then reports the chunk and every later one of the request for recompute, as for
  any failed load), so nothing computed over a scribbled chunk is used or stored;
- the bytes checked are the ones the caller copies next, through the same mapping:
  the window in which a scribble goes unseen is from the hash to the copy (the
  server-side check left the round trip back to the client in between as well);
- the server stays the authority on its cache: a mismatch is reported on ``unload``
  (``corrupt``), the server checks the slot again itself and drops the chunk if it
  differs; a client that lies can only make the server re-hash one of its own
  loads, and one that skips the check only serves itself unverified bytes, which
  a client that scribbles could do anyway. Write-behind stays checked by the server.

Measured side by side (``kvtier bench server``: ``load_ratio`` with this, and
``load_ratio_server_verify`` with the server-side check, in one run).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

import numpy as np

from kvtier.service.integrity import chunk_sum_nogil

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
    """One helper thread that hashes handed-in slots in order and records each one's verdict.

    The caller never waits for a chunk the thread has not started: :meth:`wait` takes such a
    chunk out of the queue and hashes it on the caller's thread (so a busy machine, where the
    helper gets no core, costs what checking inline costs: hash, then copy while the chunk is
    still in cache). Started on first use; :meth:`close` stops it (pending handles are then
    left unverified, and their ``buffer`` raises).

    Args:
        helper: run the helper thread (False: every chunk is checked by its caller, inline).
    """

    def __init__(self, helper: bool = True) -> None:
        self.helper = helper
        self._cv = threading.Condition()
        self._queue: deque[Checked] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.checked = 0
        self.mismatches = 0

    def submit(self, handles: list[Checked]) -> None:
        """Queue ``handles`` (in the order the caller will read them)."""
        if not handles:
            return
        with self._cv:
            if self._closed:
                return
            self._queue.extend(handles)
            if self._thread is None and self.helper:
                self._thread = threading.Thread(target=self._run, name="kvtier-load-verify", daemon=True)
                self._thread.start()
            self._cv.notify_all()

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

    def _check(self, h: Checked) -> None:
        ok = chunk_sum_nogil(h.view) == h.expected
        with self._cv:
            self.checked += 1
            if not ok:
                self.mismatches += 1
            h.verdict = GOOD if ok else BAD
            self._cv.notify_all()

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

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
