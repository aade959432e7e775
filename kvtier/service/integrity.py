"""Checksums of committed CPU chunks: the cache service's shared-memory trust boundary.

Trust boundary. Every client of a namespace maps its whole CPU pool read-write
(it must write the slots it reserves). Any client that may connect (same uid on
the owner-only Unix socket, or a TCP client with the token) is trusted not to
crash the server, but not to keep other clients' chunks intact: a buggy or
hostile client can overwrite any slot at any time. The server therefore takes an
xxh3-64 checksum of a slot at ``commit`` and verifies it

- when the chunk is served to a reader (``load``/``load_many`` from the CPU tier),
- when it leaves the CPU tier (write-behind to disk or remote),

and a chunk whose bytes no longer match is a miss: it is dropped from the CPU
tier, never written below, and counted (``corrupt_chunks``). A client may check a
load itself instead (``LoadMany.client_verifies``, the vLLM connector's client): the
server then answers with each chunk's sum, the client hashes the slot ahead of its
copy and reports a mismatch on ``unload``, which the server checks again before it
drops the chunk (:mod:`kvtier.service.load_verifier` gives the safety argument). What this does not
cover: a scribble between the server's check and the reader's copy (a window of
one round trip), and a client corrupting a slot it reserved before committing it
(its own data). Chunks promoted from disk/remote (checksummed by those tiers) get
a checksum when they land in the CPU tier.

Why not read-only mappings: a client must write the slots it reserves, so it
maps the segment read-write; a second, read-only mapping for its loads would
only guard the client against itself, and a same-uid process can open the
server's segment read-write through ``/proc/<pid>/fd`` (or ptrace the server)
anyway. Same uid is not a security boundary here; the checksum detects the
damage, and other users are kept out by the 0600 socket in a 0700 directory.

Cost (measured on the 2-core dev VM): xxh3 ~25-30 GB/s on 2-6 MiB chunks,
memcpy ~12-13 GB/s, so verifying a served chunk costs about half of the
client's copy out of the slot; ``verify_loads=False`` turns the read check off.

Memory: one 8-byte sum per CPU-resident chunk; entries of evicted chunks are
pruned when the table exceeds twice the pool's slots.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from kvtier.serde.base import byte_view
from kvtier.serde.nogil_hash import xxh3_64_int


def chunk_sum(buf: np.ndarray) -> int:
    """xxh3-64 of a chunk's bytes."""
    return xxhash.xxh3_64_intdigest(byte_view(buf).cast("B"))


def chunk_sum_nogil(buf: np.ndarray) -> int:
    """:func:`chunk_sum` without holding the GIL while hashing (:mod:`kvtier.serde.nogil_hash`), so a
    verifier thread hashes while the caller's thread copies."""
    return xxh3_64_int(buf)


class ChunkSums:
    """Committed chunks' checksums by key (thread-safe, bounded).

    Args:
        num_slots: CPU slots of the pool (bounds the table at ``2 * num_slots``).
        resident: tells whether a key is still in the CPU tier (used to prune).
    """

    def __init__(self, num_slots: int, resident: Callable[[bytes], bool]):
        self._sums: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._limit = 2 * max(1, num_slots)
        self._resident = resident
        self.corrupt = 0

    def record(self, key: bytes, buf: np.ndarray) -> None:
        """Take the checksum of ``key``'s committed bytes."""
        s = chunk_sum(buf)
        with self._lock:
            self._sums[key] = s
            if len(self._sums) > self._limit:
                self._sums = {k: v for k, v in self._sums.items() if self._resident(k)}

    def verify(self, key: bytes, buf: np.ndarray) -> bool:
        """True if ``buf`` matches ``key``'s recorded sum; with none recorded, record it and return True."""
        with self._lock:
            want = self._sums.get(key)
        if want is None:
            self.record(key, buf)
            return True
        if chunk_sum(buf) == want:
            return True
        with self._lock:
            self.corrupt += 1
        return False

    def expected(self, key: bytes, buf: np.ndarray) -> int:
        """``key``'s recorded sum; with none recorded (pruned), record ``buf``'s and return it."""
        with self._lock:
            want = self._sums.get(key)
        if want is None:
            self.record(key, buf)
            with self._lock:
                want = self._sums.get(key)
        return chunk_sum(buf) if want is None else want

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._sums.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sums)


def verify_writes(tier: Any, sums: ChunkSums) -> Any:
    """Make ``tier.put_many`` skip chunks whose CPU bytes fail their checksum (write-behind); returns ``tier``.

    The tier object is kept (its type and every other method unchanged); only
    this instance's ``put_many`` is replaced.
    """
    inner = tier.put_many

    def put_many(writes: Sequence[Any]) -> list[bool]:
        ok = [sums.verify(w.key, np.frombuffer(w.payload, dtype=np.uint8)) for w in writes]
        done = iter(inner([w for w, good in zip(writes, ok) if good]) if any(ok) else [])
        return [bool(next(done, False)) if good else False for good in ok]

    tier.put_many = put_many
    return tier
