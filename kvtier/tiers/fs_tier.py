"""Shared-filesystem tier: one enveloped file per chunk in a directory many machines mount.

URL: ``fs:///absolute/path`` (tier options may follow as query parameters, e.g.
``?codec=shuffle-zstd&ttl_s=86400``). Layout: ``<root>/<2 hex>/<key hex>.kvv``,
each file the checksummed envelope of :mod:`kvtier.serde.envelope`.

Invariants:
- Writers create ``.<name>.<host>.<pid>.<thread>.tmp`` in the target directory
  and ``rename`` it into place (atomic on POSIX and NFS within one directory),
  so readers see a whole value or none; concurrent writers of one key each
  publish a whole value and the last rename wins.
- The tier keeps no index: other machines add and remove files at any time, so
  every call asks the filesystem. A file that fails validation is a miss,
  counted and removed.
- The root directory is never created after start-up: if it vanishes (unmounted
  share) puts fail and gets miss, instead of filling the local disk below the
  mount point.

Capacity: the tier does not evict (machines would have to agree); bound the
share with a quota and, optionally, ``ttl_s``: files older than that are misses
and are removed when met. Time bound: calls are plain file I/O and return as
fast as the filesystem does; a hung network mount blocks them, so mount with
``soft``/``timeo`` (NFS) to bound that.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import parse_qsl, unquote, urlsplit

from kvtier.serde.base import Buffer, Codec, ValueSpec
from kvtier.serde.envelope import ValueMiss, encode_value, read_value_into
from kvtier.serde.registry import decoders_with, make_codec
from kvtier.tiers.base import RemoteTier, TierCounters, check_key, writable_view

log = logging.getLogger(__name__)

SUFFIX = ".kvv"
_STALE_TMP_S = 3600.0


class FsTier(RemoteTier):
    """Chunk payloads as files under ``root`` on a (shared) filesystem.

    Args:
        root: directory; created at start-up if ``create`` is set.
        codec: write codec name or instance; ``codec_options`` its options.
        spec: dtype and shape hint of payloads.
        ttl_s: files older than this (by mtime) are misses and get removed; None: no expiry.
        fsync: fsync each file before publishing it (survives a server crash, slower).
        create: create ``root`` if missing; if it stays missing (share not mounted)
            the tier opens anyway and every call misses until it appears.
        decoders: extra codecs readers may decode.

    Raises:
        ValueError: bad options.
        NotADirectoryError: ``root`` exists and is not a directory.
    """

    name = "fs"
    schemes = ("fs",)

    def __init__(
        self,
        root: str | os.PathLike,
        codec: str | Codec = "raw",
        codec_options: Mapping[str, Any] | None = None,
        spec: ValueSpec = ValueSpec(),
        ttl_s: float | None = None,
        fsync: bool = False,
        create: bool = True,
        decoders: Mapping[str, Codec] | None = None,
    ):
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError("ttl_s must be positive (or None for no expiry)")
        self.root = Path(root)
        self.codec = make_codec(codec, **dict(codec_options or {}))
        self.spec = spec
        self.ttl_s = ttl_s
        self.fsync = fsync
        self.decoders = decoders_with(decoders)
        self.counters = TierCounters()
        self._host = socket.gethostname().replace("/", "_")[:32]
        self._tls = threading.local()
        self._closed = False
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"fs tier root {self.root} is not a directory")
        try:
            if create:
                self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("kvtier fs tier: cannot create %s (%s); calls miss until it exists", self.root, exc)
        if not self.root.is_dir():
            # A share not mounted yet: not an error, every call misses until it appears.
            log.warning("kvtier fs tier: %s is not available; calls miss until it is", self.root)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "FsTier":
        parts = urlsplit(url)
        if parts.scheme != "fs" or parts.netloc not in ("", "localhost"):
            raise ValueError(f"fs tier URLs look like fs:///absolute/path, got {url!r}")
        for k, v in parse_qsl(parts.query):
            if k == "codec":
                options.setdefault("codec", v)
            elif k == "ttl_s":
                options.setdefault("ttl_s", float(v))
            elif k == "fsync":
                options.setdefault("fsync", v.lower() in ("1", "true", "yes"))
            else:
                raise ValueError(f"unknown fs tier URL option {k!r}")
        return cls(unquote(parts.path), **options)

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + SUFFIX)

    def _expired(self, mtime: float) -> bool:
        return self.ttl_s is not None and time.time() - mtime > self.ttl_s

    def _scratch(self, n: int) -> memoryview:
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._tls.buf = bytearray(n)
        return memoryview(buf)

    def _remove(self, path: Path) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("kvtier fs tier: cannot remove %s: %s", path, exc)
            return False

    # -- operations ----------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        for k in keys:
            check_key(k)
        out = [False] * len(keys)
        if self._closed:
            self.counters.add(skipped_calls=1)
            return out
        for i, key in enumerate(keys):
            path = self._path(key)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self.counters.add(errors=1)
                log.debug("kvtier fs tier: stat %s failed: %s", path, exc)
                continue
            if self._expired(st.st_mtime):
                self._remove(path)
                continue
            out[i] = True
        self.counters.add(contains_keys=len(keys), contains_hits=sum(out))
        return out

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        for k, _ in items:
            check_key(k)
        out = [False] * len(items)
        if self._closed:
            self.counters.add(skipped_calls=1, puts=len(items), put_failed=len(items))
            return out
        written = 0
        for i, (key, payload) in enumerate(items):
            try:
                ev = encode_value(key, payload, self.codec, self.spec)
            except ValueError as exc:
                log.warning("kvtier fs tier: chunk %s not stored: %s", key.hex()[:16], exc)
                continue
            if self._write(key, ev.parts):
                out[i] = True
                written += ev.nbytes
        ok = sum(out)
        self.counters.add(puts=len(items), put_ok=ok, put_failed=len(items) - ok, bytes_written=written)
        return out

    def _write(self, key: bytes, parts: list[Buffer]) -> bool:
        final = self._path(key)
        tmp = final.with_name(f".{final.name}.{self._host}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            if not self.root.is_dir():
                raise FileNotFoundError(f"fs tier root {self.root} is gone")
            final.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _writev_all(fd, parts)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            return True
        except OSError as exc:
            self.counters.add(errors=1)
            log.warning("kvtier fs tier: write of chunk %s failed: %s", key.hex()[:16], exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = []
        for k, buf in items:
            check_key(k)
            views.append(writable_view(buf))
        out = [False] * len(items)
        if self._closed:
            self.counters.add(skipped_calls=1, gets=len(items), get_misses=len(items))
            return out
        hits = corrupt = nbytes = 0
        for i, (key, _) in enumerate(items):
            status, n = self._read(key, views[i])
            if status == "hit":
                out[i] = True
                hits += 1
                nbytes += n
            elif status == "corrupt":
                corrupt += 1
        self.counters.add(
            gets=len(items), get_hits=hits, get_misses=len(items) - hits - corrupt,
            get_corrupt=corrupt, bytes_read=nbytes,
        )
        return out

    def _read(self, key: bytes, dst: memoryview) -> tuple[str, int]:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if self._expired(st.st_mtime):
                    self._remove(path)
                    return "miss", 0

                def read_exact(view: memoryview) -> None:
                    got = 0
                    while got < view.nbytes:
                        n = f.readinto(view[got:])
                        if not n:
                            raise ValueMiss("file shorter than its envelope", -1)
                        got += n

                read_value_into(read_exact, st.st_size, key, dst, self.decoders, self._scratch)
                return "hit", st.st_size
        except FileNotFoundError:
            return "miss", 0
        except ValueMiss as miss:
            log.warning("kvtier fs tier: chunk %s is a miss: %s; removing it", key.hex()[:16], miss.reason)
            self._remove(path)
            return "corrupt", 0
        except OSError as exc:
            self.counters.add(errors=1)
            log.warning("kvtier fs tier: read of chunk %s failed: %s", key.hex()[:16], exc)
            return "miss", 0

    def delete_many(self, keys: Sequence[bytes]) -> int:
        for k in keys:
            check_key(k)
        if self._closed:
            return 0
        n = sum(self._remove(self._path(k)) for k in keys)
        self.counters.add(deletes=n)
        return n

    def clear(self) -> int:
        """Remove every chunk file (and temp files older than an hour) under ``root``."""
        if self._closed:
            return 0
        removed = 0
        now = time.time()
        try:
            subdirs = [e for e in os.scandir(self.root) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            self.counters.add(errors=1)
            log.warning("kvtier fs tier: cannot list %s: %s", self.root, exc)
            return 0
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue
            for ent in entries:
                if ent.name.endswith(SUFFIX) and not ent.name.startswith("."):
                    removed += self._remove(Path(ent.path))
                elif ent.name.endswith(".tmp"):
                    try:
                        if now - ent.stat().st_mtime > _STALE_TMP_S:
                            self._remove(Path(ent.path))
                    except OSError:
                        pass
        self.counters.add(deletes=removed)
        return removed

    def close(self) -> None:
        self._closed = True

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.counters.snapshot()
        out["codec"] = self.codec.name
        return out


def _writev_all(fd: int, parts: Sequence[Buffer]) -> None:
    views = [memoryview(p).cast("B") if memoryview(p).format != "B" else memoryview(p) for p in parts]
    while views:
        n = os.writev(fd, views[:512])
        while n > 0:
            if n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
        while views and views[0].nbytes == 0:
            views.pop(0)
