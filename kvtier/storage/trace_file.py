"""Mooncake-format request traces: a validating streaming reader and a bounded, private recorder.

The format (Mooncake FAST'25 trace release, also read by NVIDIA Dynamo's trace replay and
SGLang's ``bench_serving --dataset-name mooncake``) is JSON Lines, one request a line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

- ``timestamp``: arrival time, milliseconds from the trace start (non-decreasing);
- ``input_length`` / ``output_length``: prompt and answer lengths, tokens;
- ``hash_ids``: one id per ``block_size``-token block of the prompt (the last block may be
  partial), remapped prefix hashes: two requests whose first ``k`` ids are equal share their
  first ``k * block_size`` prompt tokens. No token ids, no text.

:func:`iter_trace` streams a file (memory independent of its length) and stops at the first
bad line with a :class:`TraceFormatError` naming the line and the field.
:class:`TraceRecorder` writes such a trace from live traffic (kvtier's chunk keys remapped to
small integers in order of first sight), into a file created ``0600``, up to a byte bound.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

#: Longest line :func:`iter_trace` reads (bytes); a longer one is an error, not a memory spike.
MAX_LINE_BYTES = 8 << 20
#: Largest ``input_length`` accepted (tokens).
MAX_INPUT_TOKENS = 1 << 24
#: Largest hash id accepted (ids are non-negative and fit in 63 bits).
MAX_HASH_ID = (1 << 63) - 1
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceFormatError(ValueError):
    """A trace line is malformed. ``line`` is 1-based; ``field`` is None for the line as a whole."""

    def __init__(self, source: str, line: int, field: str | None, message: str):
        self.source, self.line, self.field = source, line, field
        where = f"{source} line {line}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival, milliseconds from the trace start (float; files hold ints).
        input_length: prompt tokens.
        output_length: answer tokens.
        hash_ids: one id per block of the prompt (``ceil(input_length / block_size)``).
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int_field(obj: dict[str, Any], name: str, lo: int, hi: int, err: Callable[[str, str], TraceFormatError]) -> int:
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise err(name, f"expected an integer, got {type(v).__name__} {str(v)[:40]!r}")
    if not lo <= v <= hi:
        raise err(name, f"{v} is outside [{lo}, {hi}]")
    return v


def parse_line(text: str, line: int, block_size: int, source: str = "trace", prev_ts: float = 0.0) -> TraceRecord:
    """Parse and check one trace line.

    Args:
        text: the line (without or with its newline).
        line: its 1-based number (for errors).
        block_size: tokens per hash id.
        source: the file's name (for errors).
        prev_ts: the previous line's timestamp (timestamps must not go back).

    Raises:
        TraceFormatError: not a JSON object, a field missing or of the wrong type or range, a
            timestamp before the previous one, or a ``hash_ids`` count that does not match
            ``input_length`` at ``block_size``.
    """

    def err(name: str | None, msg: str) -> TraceFormatError:
        return TraceFormatError(source, line, name, msg)

    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise err(None, f"not JSON ({exc})") from None
    except RecursionError:  # json recurses per nesting level (a line of a few thousand "[")
        raise err(None, "not JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise err(None, f"expected a JSON object, got {type(obj).__name__}")
    for name in FIELDS:
        if name not in obj:
            raise err(name, "missing")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts == ts or ts < 0 or ts == float("inf"):
        raise err("timestamp", f"expected a finite number >= 0 (milliseconds), got {str(ts)[:40]!r}")
    if ts < prev_ts:
        raise err("timestamp", f"{ts} is before the previous line's {prev_ts} (a trace is in arrival order)")
    n_in = _int_field(obj, "input_length", 1, MAX_INPUT_TOKENS, err)
    n_out = _int_field(obj, "output_length", 0, MAX_INPUT_TOKENS, err)
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise err("hash_ids", f"expected a list of integers, got {type(ids).__name__}")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID:
            raise err("hash_ids", f"item {i} is {str(h)[:40]!r}, expected an integer in [0, 2**63)")
    want = -(-n_in // block_size)
    if len(ids) != want:
        raise err("hash_ids", f"{len(ids)} ids for input_length {n_in} at {block_size}-token blocks "
                              f"(expected {want}; is --block-size right?)")
    return TraceRecord(float(ts), n_in, n_out, tuple(ids))


def iter_trace(path: str | os.PathLike[str], block_size: int = 512) -> Iterator[TraceRecord]:
    """Stream the records of a Mooncake-format trace file (blank lines are skipped).

    Memory: one line at a time (at most :data:`MAX_LINE_BYTES`).

    Raises:
        TraceFormatError: the first malformed line (see :func:`parse_line`), or a line longer
            than :data:`MAX_LINE_BYTES`.
        OSError: the file cannot be read.
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    source = Path(path).name
    prev = 0.0
    with open(path, "rb") as f:
        line = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            line += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise TraceFormatError(source, line, None, f"longer than {MAX_LINE_BYTES} bytes")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(source, line, None, f"not UTF-8 ({exc})") from None
            if not text.strip():
                continue
            rec = parse_line(text, line, block_size, source, prev)
            prev = rec.timestamp_ms
            yield rec


class TraceRecorder:
    """Records requests as a Mooncake-format trace (thread-safe).

    Chunk keys become small integers in order of first sight (the first key ever seen is 0),
    so the file carries the prefix structure and nothing else: no token id, no text, no key.
    A prompt whose length is not a multiple of ``chunk_size`` ends in a partial block, which
    kvtier never stores: it gets an id of its own that no other request shares.

    The file is created (or truncated) with mode ``0600`` and never follows a symlink.
    Recording stops for good, with the file complete up to its last whole line, once the
    next line would pass ``max_bytes`` or ``max_ids`` distinct ids were handed out (both
    bound the recorder's memory and disk use); :attr:`dropped` counts what was left out.

    Args:
        path: the trace file.
        chunk_size: tokens per chunk (the trace's block size).
        max_bytes: most bytes written.
        max_ids: most distinct ids (the key map holds this many keys at most).
        clock: seconds, monotonic (tests inject one); timestamps are ms since construction.

    Raises:
        OSError: the file cannot be created (an existing symlink at ``path`` included).
        ValueError: ``chunk_size`` or a bound below 1.
    """

    def __init__(self, path: str | os.PathLike[str], chunk_size: int, max_bytes: int = 64 << 20,
                 max_ids: int = 1 << 22, clock: Callable[[], float] = time.monotonic) -> None:
        if chunk_size < 1 or max_bytes < 1 or max_ids < 1:
            raise ValueError("chunk_size, max_bytes and max_ids must be >= 1")
        self.path = Path(path)
        self.chunk_size = chunk_size
        self.max_bytes = max_bytes
        self.max_ids = max_ids
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()
        self._ids: dict[bytes, int] = {}
        self._next_id = 0
        self._last_ts = 0
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
        self._f = os.fdopen(fd, "w", encoding="utf-8")
        self.records = 0
        self.bytes = 0
        self.dropped = 0
        self.full = False

    def record(self, keys: Sequence[bytes], input_length: int, output_length: int = 0,
               at: float | None = None) -> bool:
        """Append one request; returns False when it was left out (recorder full or closed).

        Args:
            keys: the chunk keys of the prompt's full chunks, in prompt order.
            input_length: prompt tokens (at least ``len(keys) * chunk_size``).
            output_length: answer tokens (0 when unknown, e.g. at the cache server).
            at: arrival time on ``clock`` (default: now).

        Raises:
            ValueError: ``input_length`` smaller than the keys cover, or beyond
                :data:`MAX_INPUT_TOKENS` (nothing recorded).
        """
        if input_length < max(1, len(keys) * self.chunk_size) or input_length > MAX_INPUT_TOKENS:
            raise ValueError(f"input_length {input_length} does not cover {len(keys)} chunks of {self.chunk_size}")
        with self._lock:
            if self.full or self._f.closed:
                self.dropped += 1
                return False
            partial = input_length % self.chunk_size != 0 or not keys
            new = sum(1 for k in dict.fromkeys(keys) if k not in self._ids) + (1 if partial else 0)
            if self._next_id + new > self.max_ids:
                return self._stop()
            ids = []
            for k in keys:
                i = self._ids.get(k)
                if i is None:
                    i = self._ids[k] = self._next_id
                    self._next_id += 1
                ids.append(i)
            if partial:
                ids.append(self._next_id)
                self._next_id += 1
            now = self._clock() if at is None else at
            ts = max(self._last_ts, int(round((now - self._t0) * 1000)))
            line = json.dumps({"timestamp": ts, "input_length": int(input_length),
                               "output_length": int(max(0, output_length)), "hash_ids": ids},
                              separators=(", ", ": ")) + "\n"
            size = len(line.encode("utf-8"))
            if self.bytes + size > self.max_bytes:
                return self._stop()
            self._f.write(line)
            self._f.flush()
            self._last_ts = ts
            self.bytes += size
            self.records += 1
            return True

    def _stop(self) -> bool:
        self.full = True
        self.dropped += 1
        self._ids.clear()  # never needed again: free the map
        return False

    def stats(self) -> dict[str, int | bool | str]:
        """``records``, ``bytes``, ``dropped``, ``full``, ``path``."""
        with self._lock:
            return {"records": self.records, "bytes": self.bytes, "dropped": self.dropped,
                    "full": self.full, "path": str(self.path)}

    def close(self) -> None:
        """Flush and close the file (idempotent); later records are dropped."""
        with self._lock:
            if not self._f.closed:
                self._f.close()
