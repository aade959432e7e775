"""Copy-then-verify of received chunks, with the verification of a large chunk overlapped.

A receiver must check every payload it copied (xxh3-64 of the *destination* bytes, so
what the caller gets is exactly what was checked, even if the source changed during
the copy). Done inline, the hash is a second pass over the payload after the copy.
:class:`Verifier` instead copies a large chunk in a few pieces and hashes each piece on
one helper thread while the caller copies the next piece (and the next chunk):
``np.copyto`` and ``xxhash`` both release the GIL, so the hash trails the copy by one
piece and its time is hidden behind the copy. Small chunks are
copied and hashed inline, piecewise while each piece is still in cache (a thread
hand-off costs more than hashing a few KiB).

Nothing is reported received before its hash matched; :meth:`Check.wait` is bounded.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.transfer.errors import TransferTimeout

#: Piece size of the inline copy-and-hash (stays in L2, so the hash reads cached bytes).
PIECE_BYTES = 512 << 10
#: Chunks at least this large (bytes) are verified on the helper thread.
OVERLAP_BYTES = 1 << 20


def copy_and_hash(src: np.ndarray, dst: np.ndarray) -> bytes:
    """Copy ``src`` into ``dst`` (equal-size ``uint8`` arrays) piecewise; the xxh3-64 digest
    (8 bytes, as ``xxh3_64_digest``) of the bytes written into ``dst``."""
    h = xxhash.xxh3_64()
    for pos in range(0, len(src), PIECE_BYTES):
        piece = dst[pos : pos + PIECE_BYTES]
        np.copyto(piece, src[pos : pos + PIECE_BYTES])
        h.update(piece)
    return h.digest()


@dataclass
class Check:
    """The verification of one copied chunk: destination ``slot`` of chunk ``index`` of a batch."""

    index: int
    slot: int
    nbytes: int
    expected: bytes
    digest: "Future[bytes] | bytes"
    #: Set by the channel once the verdict is counted.
    recorded: bool = False

    @property
    def done(self) -> bool:
        """Whether the digest is known already (computed inline)."""
        return isinstance(self.digest, bytes)

    def wait(self, timeout_s: float) -> bool:
        """True if the destination's digest equals ``expected``.

        Raises:
            TransferTimeout: the hash did not finish within ``timeout_s`` seconds.
        """
        if isinstance(self.digest, bytes):
            return self.digest == self.expected
        try:
            return self.digest.result(timeout=max(timeout_s, 0.0)) == self.expected
        except FutureTimeout:
            raise TransferTimeout("verifying a received chunk timed out") from None


class Verifier:
    """Copies chunks into destinations and verifies them (one helper thread, started lazily)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def copy(self, index: int, slot: int, src: np.ndarray, dst: np.ndarray, expected: bytes,
             overlap: bool = True) -> Check:
        """Copy ``src`` into ``dst`` (equal-size ``uint8`` arrays) now; its check (pending for a
        large chunk: do not write ``dst`` before :meth:`Check.wait` returned).

        ``overlap=False``: copy and hash inline (piecewise, in cache) even for a large chunk:
        when the sender is busy copying into its staging ring, a third thread on a 2-core
        machine slows the transfer (staged shm measured 0.53x memcpy with it, 0.74x without).
        """
        if not overlap or len(src) < OVERLAP_BYTES:
            return Check(index, slot, len(src), expected, copy_and_hash(src, dst))
        pool = self._pool
        if pool is None:
            pool = self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-verify")
        h = xxhash.xxh3_64()
        n = len(src)
        step = max(OVERLAP_BYTES, -(-n // 4))  # a few pieces: the hash trails the copy by one piece
        try:
            for pos in range(0, n, step):
                np.copyto(dst[pos : pos + step], src[pos : pos + step])
                pool.submit(h.update, dst[pos : pos + step])  # one worker: updates run in order
            digest: "Future[bytes] | bytes" = pool.submit(h.digest)
        except RuntimeError:  # closed meanwhile (by another thread): copy and hash here
            digest = copy_and_hash(src, dst)
        return Check(index, slot, n, expected, digest)

    def close(self) -> None:
        """Stop the helper thread (idempotent; a hash in progress finishes on its own)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
