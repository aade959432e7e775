"""The cache-service client's copies by engine block id: the server copies chunks to and from the
engine's own paged KV (:mod:`kvtier.service.kv_ops`), which it maps once (``register_kv``).

:class:`EngineBlockCopies` is the part of :class:`~kvtier.service.client.ServiceClient` that
holds that registration: it re-sends it on a new connection (a reconnect makes a new
generation; the server forgets the old one's), and every call of an older generation is a
miss. Failures are misses, as everywhere in the client: ``store_blocks`` answers ``NO_ROOM``,
``load_blocks`` None (recompute the blocks).
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from kvtier.protocol.messages import KVRegister, KVRelease, LoadBlocks, StoreBlocks
from kvtier.protocol.replies import LoadBlocksReply, StoreBlocksReply
from kvtier.service.connection import ServiceConnection
from kvtier.service.reply_checks import write_skip
from kvtier.service.request_split import fits_one_frame, request_or_none
from kvtier.storage.types import WriteSkip

__all__ = ["EngineBlockCopies"]

# One cached decoder per typed reply (kvtier.protocol.replies); built once, never changed.
_STORE_BLOCKS = msgspec.msgpack.Decoder(StoreBlocksReply)
_LOAD_BLOCKS = msgspec.msgpack.Decoder(LoadBlocksReply)


class EngineBlockCopies:
    """Block-id copies over one client's connection (module doc).

    Args:
        link: the client's connection (shared; not owned).
        timeout_s: the client's data-plane bound, seconds (re-registering waits at least 30 s).
    """

    def __init__(self, link: ServiceConnection, timeout_s: float) -> None:
        self._link = link
        self.timeout_s = timeout_s
        self._req: KVRegister | None = None  # the engine KV shared with register_kv (re-sent on a reconnect)
        self._gen = -1  # generation of the connection it was accepted on

    def register_kv(self, request: KVRegister, timeout_s: float = 30.0) -> dict[str, Any] | None:
        """Share the engine's paged KV (:func:`kvtier.service.kv_export.kv_register_request`) with the server.

        Returns the server's reply (``num_layers``, ``num_blocks``, ``page_bytes``,
        ``device``, ``pinned``), or None when refused or unreachable: keep using the
        slot copies. Once accepted, :meth:`store_blocks` / :meth:`load_blocks` re-send it
        on a new connection. The tensors must stay alive until :meth:`release_kv`.
        """
        self._req, self._gen = request, -1
        reply, conn = self._link.call(request, timeout_s=timeout_s)
        if reply is None or conn is None:
            self._req = None
            return None
        self._gen = conn.gen
        return reply

    def release_kv(self) -> bool:
        """Stop sharing the engine KV (the server forgets it; closing the client does too)."""
        had, self._req = self._req is not None, None
        if not had:
            return False
        reply, _ = self._link.call(KVRelease(), gen=self._gen)
        return bool(reply and reply.get("released"))

    def _gen_now(self) -> int | None:
        """The generation on which the engine KV is registered (re-registering after a reconnect), or None."""
        req, conn = self._req, self._link.conn
        if req is None or conn is None:
            return None
        if conn.gen != self._gen:
            reply, c = self._link.call(req, timeout_s=max(self.timeout_s, 30.0))
            if reply is None or c is None:
                return None
            self._gen = c.gen
        return self._gen

    def store_blocks(self, keys: Sequence[bytes], blocks: Sequence[Sequence[int]],
                     parents: Sequence[bytes | None], timeout_s: float = 30.0) -> list[WriteSkip | None]:
        """Store chunks the server copies from engine blocks (after :meth:`register_kv`).

        ``blocks[i]``: chunk ``i``'s ``blocks_per_chunk`` engine block ids, whose writes
        the engine has completed (stream synchronized); ``parents[i]``: its parent
        (required, as for :meth:`open_write_many`). Returns per key None (stored)
        or a :class:`WriteSkip`; every key ``NO_ROOM`` on any failure (nothing stored,
        or no registration: use the slot copies).

        Raises:
            ValueError: ``parents`` is missing or not as long as ``keys``.
        """
        if parents is None or len(parents) != len(keys):
            raise ValueError(f"{'no' if parents is None else len(parents)} parents for {len(keys)} keys: "
                             "pass each chunk's parent (None for a prompt's first chunk)")
        gen = self._gen_now()
        fail: list[WriteSkip | None] = [WriteSkip.NO_ROOM] * len(keys)
        if gen is None or not keys:
            return fail
        if len(keys) > 1 and not fits_one_frame(len(keys), blocks):  # in two frames, as open_write_many
            h = len(keys) // 2
            first = self.store_blocks(keys[:h], blocks[:h], parents[:h], timeout_s)
            if WriteSkip.NO_ROOM in first:
                return first + fail[h:]
            return first + self.store_blocks(keys[h:], blocks[h:], parents[h:], timeout_s)
        req = request_or_none(lambda: StoreBlocks(list(keys), [list(map(int, b)) for b in blocks], list(parents)))
        reply, _ = (None, None) if req is None else self._link.call_typed(req, _STORE_BLOCKS, gen=gen,
                                                                          timeout_s=timeout_s)
        skips = reply.skips if reply is not None else None
        if skips is None or len(skips) != len(keys):
            return fail
        return [None if v == 0 else write_skip(v) for v in skips]

    def load_blocks(self, keys: Sequence[bytes], parents: Sequence[bytes | None], blocks: Sequence[Sequence[int]],
                    offsets: Sequence[int] | None = None, timeout_s: float = 30.0) -> list[str | None]:
        """Load chunks the server copies into engine blocks (after :meth:`register_kv`).

        ``blocks[i]`` receive chunk ``i``'s blocks from ``offsets[i]`` (default 0) on.
        Returns per key the tier it came from, None from the first miss on (a request too
        large for one frame goes as several, a failed one a miss from its first key on); all None
        on any failure (then the blocks' contents are undefined: recompute them).
        """
        gen = self._gen_now()
        if gen is None or not keys:
            return [None] * len(keys)
        offs = [0] * len(keys) if offsets is None else list(offsets)
        if len(keys) > 1 and not fits_one_frame(len(keys), blocks):  # in two frames; a miss ends the prefix
            h = len(keys) // 2
            first = self.load_blocks(keys[:h], parents[:h], blocks[:h], offs[:h], timeout_s)
            if None in first:
                return first + [None] * (len(keys) - h)
            return first + self.load_blocks(keys[h:], parents[h:], blocks[h:], offs[h:], timeout_s)
        req = request_or_none(lambda: LoadBlocks(list(keys), list(parents), [list(map(int, b)) for b in blocks], offs))
        reply, _ = (None, None) if req is None else self._link.call_typed(req, _LOAD_BLOCKS, gen=gen,
                                                                          timeout_s=timeout_s)
        got = reply.sources if reply is not None else None
        if got is None or len(got) != len(keys):
            return [None] * len(keys)
        return got
