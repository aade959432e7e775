"""``trace_capture_path`` in a ``kvtier server``: every lookup becomes a line of a Mooncake trace.

The server sees chunk keys, not prompts: a lookup of ``k`` keys is recorded as a request of
``k * chunk_size`` input tokens and ``output_length`` 0 (:class:`kvtier.storage.trace_file.TraceRecorder`
does the key remapping, the 0600 file and the byte bound). A lookup of no key is not recorded;
namespaces whose chunk size differs from the server's ``chunk_size`` are counted and skipped
(one trace has one block size).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from kvtier.storage.trace_file import TraceRecorder

log = logging.getLogger(__name__)


class ServerTraceCapture:
    """The server's recorder (thread-safe; a failure to write is logged once, never raised).

    Raises (constructor):
        OSError: the file cannot be created.
    """

    def __init__(self, path: Path, chunk_size: int, max_bytes: int) -> None:
        self.recorder = TraceRecorder(path, chunk_size, max_bytes)
        self.skipped_chunk_size = 0
        self._warned = False

    def lookup(self, chunk_size: int, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        if chunk_size != self.recorder.chunk_size:
            self.skipped_chunk_size += 1
            return
        try:
            self.recorder.record(keys, len(keys) * chunk_size)
        except (OSError, ValueError) as exc:
            if not self._warned:
                self._warned = True
                log.warning("kvtier server: trace capture stopped: %s", exc)

    def stats(self) -> dict[str, object]:
        return {**self.recorder.stats(), "skipped_chunk_size": self.skipped_chunk_size}

    def close(self) -> None:
        self.recorder.close()
