"""What besides tokens and cache salt decides a vLLM request's KV: LoRA adapter, multimodal items.

vLLM's own block hash folds "extra keys" into every block
(``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``): the LoRA
adapter (name and path), each multimodal item overlapping the block (its
content hash and offset), the cache salt (first block) and hashes of prompt
embeddings. kvtier's keys must distinguish the same requests, or a prompt
stored under one adapter or image is served to another.

- LoRA: :class:`AdapterFingerprints` turns ``request.lora_request`` into
  ``"<name>\\x00<fingerprint>"``. The fingerprint is a blake3 content digest of
  the adapter's files (relative name, size, bytes), so a same-name reload with
  new weights gets new keys while the same adapter copied to another machine
  (another mtime) still shares KV through a shared tier. Digests are memoized
  per ``(path, [(file, size, mtime_ns)])``: each request costs a few ``stat``
  calls; files are read once per adapter version. A path that is not a local
  file or directory (a hub id vLLM resolves elsewhere) is keyed by the path
  string, as vLLM's own hash does (logged once: a same-path reload is not seen).
- Multimodal: each ``request.mm_features`` item becomes an
  :class:`~kvtier.index.keys.MMItem` (identifier = vLLM's content hash,
  placeholder offset and length).
- Prompt embeddings: not keyed. Such requests are refused per request
  (:class:`UnkeyableRequest`: a miss and no store, logged once).
- Any other extra-key source a future vLLM adds: :func:`check_engine_extra_keys`
  refuses to start with a clear error.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any

import blake3

from kvtier.index.keys import KeyExtras, MMItem

log = logging.getLogger("kvtier.vllm")

#: vLLM's extra-key sources (``_gen_*_extra_hash_keys`` in kv_cache_utils) kvtier handles.
KNOWN_EXTRA_KEY_SOURCES = frozenset(
    {"_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys", "_gen_prompt_embeds_extra_hash_keys"}
)
_READ_BYTES = 1 << 20


class UnkeyableRequest(Exception):
    """The request's KV depends on an input kvtier cannot key (e.g. prompt embeddings)."""


def check_engine_extra_keys(kv_cache_utils: Any = None) -> None:
    """Refuse to start when vLLM keys its blocks on a source kvtier does not know.

    Args:
        kv_cache_utils: the module to inspect (default ``vllm.v1.core.kv_cache_utils``).

    Raises:
        ValueError: the engine folds an unknown extra key into its block hashes.
    """
    if kv_cache_utils is None:
        from vllm.v1.core import kv_cache_utils
    sources = {n for n in dir(kv_cache_utils) if n.startswith("_gen_") and n.endswith("_extra_hash_keys")}
    unknown = sorted(sources - KNOWN_EXTRA_KEY_SOURCES)
    if unknown:
        raise ValueError(
            f"kvtier: this vLLM folds extra keys kvtier does not know into its block hashes ({', '.join(unknown)}); "
            "kvtier's chunk keys would not distinguish requests that differ in them, so the connector refuses "
            "to start. Upgrade kvtier (or report it) for this vLLM version."
        )


class AdapterFingerprints:
    """LoRA adapter identities ``"<name>\\x00<fingerprint>"`` (bounded memo, one per connector)."""

    def __init__(self, max_entries: int = 256):
        self._memo: OrderedDict[tuple[str, tuple[tuple[str, int, int], ...]], str] = OrderedDict()
        self._max = max_entries
        self._warned: set[str] = set()

    def identity(self, lora_request: Any) -> str | None:
        """The adapter identity of ``lora_request`` (vLLM ``LoRARequest``), None for the base model.

        Raises:
            UnkeyableRequest: the adapter's files cannot be read.
        """
        if not lora_request:
            return None
        name = str(lora_request.lora_name)
        path = str(getattr(lora_request, "lora_path", "") or "")
        return f"{name}\x00{self.fingerprint(path)}"

    def fingerprint(self, path: str) -> str:
        """Hex blake3 digest of the adapter files under ``path`` (or of the path string if not local)."""
        if not path or not os.path.exists(path):
            if path not in self._warned and len(self._warned) < 1024:
                self._warned.add(path)
                log.warning("kvtier: LoRA path %r is not a local file or directory: its KV is keyed by the path "
                            "string (a same-path reload with new weights is not detected)", path)
            return "path:" + blake3.blake3(path.encode()).hexdigest()
        try:
            files = _adapter_files(path)
            sig = tuple((rel, st.st_size, st.st_mtime_ns) for rel, st in ((r, os.stat(a)) for r, a in files))
            memo_key = (os.path.abspath(path), sig)
            digest = self._memo.get(memo_key)
            if digest is None:
                digest = _content_digest(files)
                self._memo[memo_key] = digest
                while len(self._memo) > self._max:
                    self._memo.popitem(last=False)
            else:
                self._memo.move_to_end(memo_key)
            return digest
        except OSError as exc:
            raise UnkeyableRequest(f"LoRA adapter files under {path!r} cannot be read: {exc}") from exc


def _adapter_files(path: str) -> list[tuple[str, str]]:
    """``(name relative to path, absolute path)`` of every regular file under ``path``, sorted."""
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    out = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for n in names:
            full = os.path.join(root, n)
            if os.path.isfile(full):
                out.append((os.path.relpath(full, path), full))
    return sorted(out)


def _content_digest(files: list[tuple[str, str]]) -> str:
    h = blake3.blake3(b"kvtier/lora/v1\x00")
    for rel, full in files:
        name = rel.encode()
        h.update(len(name).to_bytes(8, "little") + name)
        with open(full, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(size.to_bytes(8, "little"))
            while chunk := f.read(_READ_BYTES):
                h.update(chunk)
    return h.hexdigest()


def request_extras(request: Any, adapters: AdapterFingerprints) -> KeyExtras | None:
    """The :class:`KeyExtras` of a vLLM ``Request`` (None when it has none).

    Raises:
        UnkeyableRequest: the request carries prompt embeddings, or its adapter cannot be read.
    """
    if getattr(request, "prompt_embeds", None) is not None:
        raise UnkeyableRequest("prompt embeddings are not part of kvtier's chunk keys")
    adapter = adapters.identity(getattr(request, "lora_request", None))
    try:
        items = tuple(
            MMItem(str(f.identifier or ""), int(f.mm_position.offset), int(f.mm_position.length))
            for f in (getattr(request, "mm_features", None) or ())
        )
    except (AttributeError, TypeError, ValueError) as exc:
        raise UnkeyableRequest(f"a multimodal item has no usable content hash or placeholder range ({exc})") from exc
    extras = KeyExtras(adapter, items)
    return extras if extras else None
