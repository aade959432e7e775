"""The disk tier's write path: reserve room, write records on the I/O threads, publish in batch order."""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass
from typing import Sequence

from kvtier.serde.base import Codec
from kvtier.serde.record import (
    HEADER_BYTES,
    align_up,
    encode_header,
    encode_payload_header,
)
from kvtier.tiers.base import ChunkWrite, as_chunk_write
from kvtier.tiers.disk.core import DiskCore
from kvtier.tiers.disk.record_io import payload_view, unlink_quietly
from kvtier.tiers.disk.scan import STOP_WRITES, TMP_SUFFIX

log = logging.getLogger("kvtier.tiers.disk")


@dataclass(frozen=True)
class _Write:
    """One planned record write: batch position, chunk, reserved file bytes, ``.tmp`` and final paths."""

    index: int
    key: bytes
    parent: bytes | None
    data: memoryview
    size: int
    direct: bool
    tmp: str
    final: str


class DiskWrites(DiskCore):
    """``put_many`` of :class:`~kvtier.tiers.disk.tier.DiskTier` (crash safety: ``.tmp`` + rename)."""

    def put_many_with_codec(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        """Rewrite chunks with ``codec``: the disk record format stores raw payloads only.

        Raises:
            NotImplementedError: ``codec`` is not ``raw`` (the disk tier reads raw records only).
        """
        if codec.name != "raw":
            raise NotImplementedError(
                f"the disk tier stores raw records only; codec {codec.name!r} is unsupported there"
            )
        return self.put_many(items)

    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """Write the chunks, up to ``io_threads`` files in flight; True where a chunk is on disk afterwards.

        Three steps: reserve room for every chunk in batch order (under the lock); write
        each record to its ``.tmp`` file on the I/O threads (checksum, ``pwritev``,
        optional fsync, close); then, in batch order on the caller's thread, rename each
        complete file into place and index it. So records are published parent before
        child, exactly as one-at-a-time writes did, and a kill at any point leaves only
        complete records under final names (plus ``.tmp`` leftovers, dropped at open).

        A key already on disk is rewritten (its recorded parent is kept). A chunk
        whose parent failed earlier in the same batch is not published (it could not
        be hit); one whose parent is simply absent is (out-of-order write-behind).
        A key given twice in one batch is written once.

        Raises:
            TypeError/ValueError: a bad key or parent, or a payload that is empty or
                not C-contiguous (before any write).
        """
        items = [as_chunk_write(it) for it in items]
        views = [payload_view(it.payload) for it in items]
        out = [False] * len(items)
        if self._closed or not self._writable:
            self.counters.add(puts=len(items), put_failed=len(items), skipped_calls=1)
            return out
        failed: set[bytes] = set()
        first: dict[bytes, int] = {}
        plans: list[_Write] = []
        for i, it in enumerate(items):
            if it.key in first:
                continue
            first[it.key] = i
            # a chunk whose parent failed in this batch could not be hit: skip it
            pending = it.parent is not None and it.parent in first
            w = None if it.parent in failed else self._reserve(i, it.key, views[i], it.parent, pending)
            if w is None:
                failed.add(it.key)
            else:
                plans.append(w)
        written = 0
        for w, (size, exc) in zip(plans, self._pool.ordered(self._write_file, plans)):
            n = self._publish(w, size, exc, w.parent in failed)
            if n:
                out[w.index] = True
                written += n
            else:
                failed.add(w.key)
        for i, it in enumerate(items):  # duplicates share the first write's outcome
            out[i] = out[first[it.key]]
        ok = sum(out)
        self.counters.add(puts=len(items), put_ok=ok, put_failed=len(items) - ok, bytes_written=written)
        return out

    def _reserve(
        self, index: int, key: bytes, data: memoryview, parent: bytes | None, parent_pending: bool
    ) -> _Write | None:
        """Reserve room for one record (None: not written, no room or not writable).

        ``parent_pending``: the parent is planned earlier in this batch (published first)."""
        if not self._writable or self._closed:
            return None
        direct = self.direct_io
        size = HEADER_BYTES + (align_up(len(data)) if direct else len(data))
        with self._lock:
            if not self._index.reserve(key, size, parent, parent_pending):
                self.dropped_writes += 1
                return None
        final = self.file_of(key)
        tmp = str(final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"))
        return _Write(index, key, parent, data, size, direct, tmp, str(final))

    def _write_file(self, w: _Write) -> tuple[int, OSError | None]:
        """I/O thread: write ``w``'s complete record to its ``.tmp`` file; (file bytes, None) or (0, error)."""
        try:
            if w.direct and self.direct_io:
                header = encode_payload_header(w.key, self.namespace, w.data, w.parent, stored_len=w.size - HEADER_BYTES)
                try:
                    return self._io.write_record(w.tmp, w.final, header, w.data, True), None
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    unlink_quietly(self.fs, w.tmp)
                    self._disable_direct_io(exc)
            n = len(w.data)

            def hashed_header(body_sum: bytes) -> bytes:
                return encode_header(key=w.key, namespace=self.namespace, parent=w.parent, payload_len=n,
                                     body_len=n, body_sum=body_sum)

            return self._io.write_record_hashed(w.tmp, w.final, hashed_header, w.data), None
        except OSError as exc:
            unlink_quietly(self.fs, w.tmp)
            return 0, exc

    def _publish(self, w: _Write, size: int, exc: OSError | None, parent_failed: bool) -> int:
        """Caller's thread, batch order: rename ``w``'s file into place and index it; its file bytes (0: not)."""
        if parent_failed or not self._writable or self._closed:
            # It could not be hit, or writes stopped meanwhile (an earlier chunk of the batch hit
            # ENOSPC: one-at-a-time writes would not have tried this one, so neither is it counted).
            unlink_quietly(self.fs, w.tmp)
            with self._lock:
                self._index.unreserve(w.key)
            return 0
        if exc is None:
            try:
                self._io.publish(w.tmp, w.final)
            except OSError as e:
                unlink_quietly(self.fs, w.tmp)
                exc = e
        if exc is not None:
            with self._lock:
                self._index.unreserve(w.key)
                self.failed_writes += 1
            self.counters.add(errors=1)
            if exc.errno in STOP_WRITES:
                self._stop_writes(exc)
            else:
                log.warning("kvtier disk tier: write of chunk %s failed: %s", w.key.hex()[:16], exc)
            return 0
        with self._lock:
            self._index.commit(w.key, size, w.parent)
            self.written_chunks += 1
        return size
