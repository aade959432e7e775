"""Helpers shared by the peer-tier and P2P storage tests."""

from __future__ import annotations

from conftest import payload_for, small_namespace
from kvtier.storage.manager import StorageManager

#: Bytes of one chunk in :func:`conftest.small_namespace`.
CB = small_namespace().chunk_bytes


def store_chain(mgr: StorageManager, tokens: list[int]) -> list[bytes]:
    """Write and commit every chunk key of ``tokens`` in ``mgr`` (payload: ``payload_for(key, CB)``); the keys."""
    keys = mgr.keys(tokens)
    parent = None
    for k in keys:
        buf = mgr.open_write(k, parent)
        assert buf is not None
        buf[:] = payload_for(k, CB)
        mgr.commit(k, parent)
        parent = k
    return keys
