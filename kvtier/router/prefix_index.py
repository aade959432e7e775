"""Where each backend holds which prompt prefix, learned from its KV events.

vLLM's block hashes are seeded per process (its ``NONE_HASH`` is random unless
``PYTHONHASHSEED`` is set), so the router never recomputes them: it keys its index by its
own chain of token blocks, ``key(block) = blake3(key(parent) || lora || token ids)`` (the root
parent is 32 zero bytes; token ids as little-endian uint32), and learns, per backend, which
engine hash stands for which chain key from ``BlockStored.token_ids`` and
``parent_block_hash``. Two backends holding the same tokens thus have the same chain keys
whatever their seeds.

Per backend it keeps ``chain key -> set of mediums`` (``GPU``: engine-resident; ``CPU``,
``DISK``, ``REMOTE``: kvtier tiers). Both vocabularies are read: vLLM's (``GPU``, ``CPU``,
``STORAGE``, with ``locality="REMOTE"`` for a copy held elsewhere) and kvtier's (``CPU``,
``DISK``, ``REMOTE``); see :func:`index_medium`. A medium neither names is not indexed (its
hashes still link chains), so a publisher cannot make its blocks outrank the engine's by
naming a tier the router does not know. ``BlockRemoved`` removes a medium (all of them when it
names none), ``AllBlocksCleared`` and :meth:`PrefixIndex.drop` (a restarted backend) forget
everything of that backend. Blocks with extra hash inputs (LoRA, multimodal, cache salt) get
those mixed into their key, so they never match a plain prompt.

:class:`EventFeed` runs one thread per backend reading its events with
:class:`kvtier.events.subscriber.EventSubscriber` and applying them here.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import msgspec
import numpy as np

from kvtier.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, normalize_medium

log = logging.getLogger("kvtier.router")

ROOT_KEY = bytes(32)
#: Medium names as indexed (a ``None`` medium is the engine's).
GPU = "GPU"


def chain_keys(tokens: Sequence[int] | np.ndarray, block_size: int, lora_name: str | None = None,
               extra_keys: Sequence[object | None] | None = None, parent: bytes = ROOT_KEY) -> list[bytes]:
    """The router's chain keys of every full block of ``tokens``.

    Args:
        tokens: token ids (each in ``[0, 2**32)``).
        block_size: tokens per block (> 0); a trailing partial block gets no key.
        lora_name: LoRA adapter name mixed into every key (``None``: none).
        extra_keys: per block, extra hash inputs (``None`` entries: none).
        parent: the key of the block before the first one.

    Returns:
        One 32-byte key per full block, in order.

    Raises:
        ValueError: ``block_size <= 0`` or a token id out of range.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    data = arr.astype("<u4").tobytes()
    lora = b"" if lora_name is None else b"lora:" + lora_name.encode("utf-8")
    out: list[bytes] = []
    step = 4 * block_size
    for i in range(len(arr) // block_size):
        h = blake3.blake3(parent)
        h.update(len(lora).to_bytes(4, "little"))
        h.update(lora)
        if extra_keys is not None and i < len(extra_keys) and extra_keys[i] is not None:
            h.update(b"extra:" + msgspec.msgpack.encode(extra_keys[i]))
        h.update(data[i * step:(i + 1) * step])
        parent = h.digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class PrefixMatch:
    """The cached prefix of a prompt on one backend.

    Attributes:
        tokens: matched prefix length (tokens; full blocks).
        segments: ``(end_token, medium)`` runs covering ``[0, tokens)``, the best medium of
            each run (engine first).
        per_medium: tokens of the prefix whose best copy is in each medium.
    """

    tokens: int
    segments: tuple[tuple[int, str], ...]
    per_medium: dict[str, int]


_MEDIUM_RANK = {"GPU": 0, "CPU": 1, "DISK": 2, "REMOTE": 3}


def index_medium(medium: str | None, locality: str | None = None) -> str | None:
    """The index's medium (``GPU``, ``CPU``, ``DISK``, ``REMOTE``) of a published one.

    Args:
        medium: the event's ``medium`` (``None``: the engine's own blocks, ``GPU``); vLLM's
            names (``GPU``, ``CPU``, ``STORAGE``) and kvtier's (``CPU``, ``DISK``, ``REMOTE``),
            any letter case.
        locality: vLLM's ``locality``; ``"REMOTE"`` (a copy another machine holds) makes any
            tier below the engine ``REMOTE``.

    Returns:
        The index's name, or ``None`` for a medium it does not know (not indexed: an unknown
        name must never weigh like an engine-resident block).
    """
    if medium is None:
        return GPU
    if not isinstance(medium, str):
        return None
    loc = locality.upper() if isinstance(locality, str) else None
    name = normalize_medium(medium.upper(), loc)  # the one reading of vLLM's and kvtier's names
    if name == GPU:
        return GPU  # the engine's own blocks are local by definition
    if name in ("CPU", "DISK") and loc == "REMOTE":
        return "REMOTE"
    return name if name in _MEDIUM_RANK else None


def _best(mediums: set[str]) -> str:
    return min(mediums, key=lambda m: (_MEDIUM_RANK.get(m, 9), m))


class _Blocks:
    """One backend's blocks (guarded by the index lock)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.hash_key: OrderedDict[bytes | int, bytes] = OrderedDict()  # engine hash -> chain key (LRU)
        self.present: OrderedDict[bytes, set[str]] = OrderedDict()       # chain key -> mediums
        self.block_size: int | None = None

    def clear(self) -> None:
        self.hash_key.clear()
        self.present.clear()


class PrefixIndex:
    """Per-backend chain-keyed block index (thread-safe).

    Args:
        backends: backend names (the keys used in every call).
        max_blocks: most blocks remembered per backend (oldest dropped first).

    Counters (per backend, in :meth:`stats`): ``stored``/``removed`` blocks applied,
    ``unknown_medium`` (blocks of a medium :func:`index_medium` does not know: not indexed),
    ``orphans`` (a ``BlockStored`` whose parent hash is unknown: skipped), ``clears``,
    ``drops``.
    """

    def __init__(self, backends: Sequence[str], max_blocks: int = 1 << 20) -> None:
        self._lock = threading.Lock()
        self._blocks = {b: _Blocks(max_blocks) for b in backends}
        self._stats = {b: {"stored": 0, "removed": 0, "orphans": 0, "clears": 0, "drops": 0,
                           "bad_events": 0, "unknown_medium": 0} for b in backends}

    def apply(self, backend: str, batch: KVEventBatch) -> None:
        """Apply one batch of ``backend``'s events. Malformed events are counted, never raised.

        Raises:
            KeyError: an unknown backend.
        """
        with self._lock:
            blocks = self._blocks[backend]
            st = self._stats[backend]
            for ev in batch.events:
                try:
                    if isinstance(ev, BlockStored):
                        self._stored(blocks, st, ev)
                    elif isinstance(ev, BlockRemoved):
                        self._removed(blocks, st, ev)
                    elif isinstance(ev, AllBlocksCleared):
                        blocks.clear()
                        st["clears"] += 1
                except (ValueError, TypeError):
                    st["bad_events"] += 1

    def _stored(self, blocks: _Blocks, st: dict[str, int], ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        if ev.block_size <= 0 or len(ev.token_ids) != n * ev.block_size:
            st["bad_events"] += 1  # no tokens (kvtier's own publisher without them): cannot key
            return
        if ev.parent_block_hash is None:
            parent = ROOT_KEY
        else:
            known = blocks.hash_key.get(ev.parent_block_hash)
            if known is None:
                st["orphans"] += 1
                return
            parent = known
        blocks.block_size = ev.block_size
        medium = index_medium(ev.medium, ev.locality)
        keys = chain_keys(ev.token_ids, ev.block_size, ev.lora_name, ev.extra_keys, parent)
        for h, k in zip(ev.block_hashes, keys):
            blocks.hash_key[h] = k
            blocks.hash_key.move_to_end(h)
            if medium is None:  # linked (a later block may name it as parent), never matched
                continue
            m = blocks.present.get(k)
            if m is None:
                blocks.present[k] = {medium}
            else:
                m.add(medium)
                blocks.present.move_to_end(k)
        st["stored" if medium is not None else "unknown_medium"] += n
        while len(blocks.present) > blocks.max_blocks:
            blocks.present.popitem(last=False)
        while len(blocks.hash_key) > 2 * blocks.max_blocks:
            blocks.hash_key.popitem(last=False)

    def _removed(self, blocks: _Blocks, st: dict[str, int], ev: BlockRemoved) -> None:
        medium = None if ev.medium is None else index_medium(ev.medium, ev.locality)
        if ev.medium is not None and medium is None:
            st["unknown_medium"] += len(ev.block_hashes)  # nothing of it was indexed
            return
        for h in ev.block_hashes:
            k = blocks.hash_key.get(h)
            if k is None:
                continue
            m = blocks.present.get(k)
            if m is None:
                continue
            if medium is None:
                m.clear()
            else:
                m.discard(medium)
            if not m:
                del blocks.present[k]
            st["removed"] += 1

    def drop(self, backend: str) -> None:
        """Forget everything about ``backend`` (it restarted, or its events were lost)."""
        with self._lock:
            self._blocks[backend].clear()
            self._stats[backend]["drops"] += 1

    def block_size(self, backend: str) -> int | None:
        """The block size ``backend``'s events use (``None``: none seen yet)."""
        with self._lock:
            return self._blocks[backend].block_size

    def match(self, backend: str, keys: Sequence[bytes], block_size: int) -> PrefixMatch:
        """The longest prefix of ``keys`` (chain keys of ``block_size``-token blocks) that
        ``backend`` holds in any medium, with the best medium of each block."""
        segments: list[tuple[int, str]] = []
        per: dict[str, int] = {}
        n = 0
        with self._lock:
            present = self._blocks[backend].present
            for k in keys:
                m = present.get(k)
                if not m:
                    break
                best = _best(m)
                n += block_size
                per[best] = per.get(best, 0) + block_size
                if segments and segments[-1][1] == best:
                    segments[-1] = (n, best)
                else:
                    segments.append((n, best))
        return PrefixMatch(tokens=n, segments=tuple(segments), per_medium=per)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per backend: ``blocks`` held now, ``block_size`` and the counters."""
        with self._lock:
            return {b: {"blocks": len(blk.present), "block_size": blk.block_size or 0, **self._stats[b]}
                    for b, blk in self._blocks.items()}


class EventFeed:
    """Reads one backend's KV events on a thread and applies them to a :class:`PrefixIndex`.

    A publisher restart (its seq starts again) or events lost beyond replay drop the
    backend's entries before anything newer is applied.

    Args:
        index: the index to fill.
        backend: the backend's name in ``index``.
        endpoint: its PUB endpoint; ``replay``: its replay endpoint (``None``: none).
        topic: topic filter (``""``: all).
        on_restart: called (on the feed thread) when the publisher restarted.
        max_message_bytes: largest event frame accepted (bytes; ``None``: the subscriber's
            default, :data:`kvtier.events.subscriber.MAX_MESSAGE_BYTES`).
        credentials / server_key: the router's fleet credentials and the publisher's public key
            (a CURVE stream); ``None``: plain (vLLM's publisher).
    """

    def __init__(self, index: PrefixIndex, backend: str, endpoint: str, replay: str | None = None,
                 topic: str = "", on_restart: Callable[[str], None] | None = None,
                 max_message_bytes: int | None = None, credentials: Any = None,
                 server_key: str | None = None) -> None:
        self._max_message_bytes = max_message_bytes
        self._curve = {"credentials": credentials, "server_key": server_key} if server_key else {}
        self._index = index
        self._backend = backend
        self._endpoint = endpoint
        self._replay = replay
        self._topic = topic
        self._on_restart = on_restart
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.batches = 0
        self.error: str | None = None
        self._sub_stats: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name=f"kvtier-router-events-{backend}", daemon=True)

    def start(self, timeout_s: float = 5.0) -> EventFeed:
        """Start the thread; returns once its socket is connected (or ``timeout_s``)."""
        self._thread.start()
        self._ready.wait(timeout_s)
        return self

    def stats(self) -> dict[str, object]:
        """Batches applied, subscriber counters, last error."""
        return {"endpoint": self._endpoint, "curve": bool(self._curve), "batches": self.batches, **self._sub_stats,
                "error": self.error}

    def _run(self) -> None:
        from kvtier.events.subscriber import EventSubscriber

        try:
            kw: dict[str, Any] = dict(self._curve)
            if self._max_message_bytes is not None:
                kw["max_message_bytes"] = self._max_message_bytes
            sub = EventSubscriber(self._endpoint, self._replay, topic=self._topic, **kw)
        except Exception as exc:  # noqa: BLE001 - a bad endpoint: the backend is routed without events
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("kvtier router: events of %s at %s: %s", self._backend, self._endpoint, self.error)
            self._ready.set()
            return
        self._ready.set()
        restarts = missed = 0
        try:
            while not self._stop.is_set():
                item = sub.poll(0.05)
                if sub.restarts != restarts or sub.missed != missed:
                    self._index.drop(self._backend)
                    if sub.restarts != restarts and self._on_restart is not None:
                        self._on_restart(self._backend)
                    restarts, missed = sub.restarts, sub.missed
                if item is not None:
                    self._index.apply(self._backend, item[1])
                    self.batches += 1
                self._sub_stats = sub.stats()
        except Exception as exc:  # never let one backend's stream take the router down
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("kvtier router: event feed of %s failed", self._backend)
        finally:
            sub.close()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and close its socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
