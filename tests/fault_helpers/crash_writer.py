"""Child process of the crash tests: writes chunks into a DiskTier in a loop until killed.

Usage::

    crash_writer.py DIR LOG SEED CAPACITY [--fsync] [--direct] [--count N] [--clean]
                    [--piece BYTES [--piece-delay S]] [--batch N [--chain]]

Prints ``ready <direct_io>`` once the tier is open. Chunk ``i`` has key
``key_for(SEED, i)`` and payload ``payload_for_key(key)``; every third chunk is
written with ``put``, the others with ``put_many`` in batches of ``--batch`` (default 2;
with ``--chain`` each batch is one prompt's chain of chunks). After a chunk
is on disk under its final name, its key (hex) is appended to LOG with a single
unbuffered ``write`` (a SIGKILL cannot leave half a line in the kernel).
With ``--count N`` it stops after N chunks; with ``--clean`` it then closes the
tier and prints ``closed``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fault_helpers.payloads import CRASH_NS, key_for, payload_for_key  # noqa: E402

from kvtier.tiers.base import ChunkWrite  # noqa: E402
from kvtier.tiers.disk import DiskTier, FileOps  # noqa: E402


class PiecewiseFileOps(FileOps):
    """Writes at most ``piece`` bytes per ``write`` call (a multiple of 4096, so O_DIRECT stays aligned).

    A SIGKILL cannot interrupt one ``write`` to the page cache halfway, so without
    this a killed writer rarely leaves a torn file; small pieces make the torn
    window (file created, payload partly written) wide enough to hit.
    """

    def __init__(self, piece: int, delay_s: float):
        self.piece = piece
        self.delay_s = delay_s

    def write(self, fd: int, data: memoryview) -> int:
        n = super().write(fd, data[: self.piece])
        time.sleep(self.delay_s)  # a slow disk: most of the run is spent inside a file
        return n

    def pwritev(self, fd: int, buffers, offset: int) -> int:  # type: ignore[no-untyped-def]
        """At most ``piece`` bytes of the vectored write (the caller resumes the rest)."""
        cut, left = [], self.piece
        for b in buffers:
            if left <= 0:
                break
            cut.append(b[:left])
            left -= len(cut[-1])
        n = super().pwritev(fd, cut, offset)
        time.sleep(self.delay_s)
        return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("log")
    ap.add_argument("seed", type=int)
    ap.add_argument("capacity", type=int)
    ap.add_argument("--fsync", action="store_true")
    ap.add_argument("--direct", action="store_true")
    ap.add_argument("--count", type=int, default=None)
    ap.add_argument("--clean", action="store_true")
    ap.add_argument("--piece", type=int, default=0, help="bytes per write call (0: unlimited)")
    ap.add_argument("--piece-delay", type=float, default=0.0, help="seconds to sleep after each piece")
    ap.add_argument("--batch", type=int, default=2, help="chunks per put_many (the rest of every third chunk)")
    ap.add_argument("--chain", action="store_true", help="each batch is one prompt: chunk i's parent is chunk i-1")
    a = ap.parse_args()

    tier = DiskTier(
        a.dir,
        a.capacity,
        CRASH_NS,
        fsync=a.fsync,
        direct_io=a.direct,
        fs=PiecewiseFileOps(a.piece, a.piece_delay) if a.piece else None,
    )
    log_fd = os.open(a.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    log_lock = threading.Lock()

    def record(key: bytes) -> None:
        with log_lock:
            os.write(log_fd, (key.hex() + "\n").encode())

    print("ready", int(tier.direct_io), flush=True)
    i = 0
    batch: list[ChunkWrite] = []
    while a.count is None or i < a.count:
        key = key_for(a.seed, i)
        payload = payload_for_key(key)
        if i % 3 == 0:
            if tier.put(key, payload):
                record(key)
        else:  # the rest in batches of two (what the storage manager's write-behind sends)
            parent = batch[-1].key if a.chain and batch else None
            batch.append(ChunkWrite(key, parent, payload))
            if len(batch) == a.batch:
                for w, ok in zip(batch, tier.put_many(batch)):
                    if ok:
                        record(w.key)
                batch = []
        i += 1
    for w, ok in zip(batch, tier.put_many(batch)):
        if ok:
            record(w.key)
    if a.clean:
        tier.close()
        print("closed", flush=True)


if __name__ == "__main__":
    main()
