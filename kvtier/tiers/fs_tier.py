"""Shared-filesystem tier: one chunk record per file in a directory many machines mount.

URL: ``fs:///absolute/path`` (tier options may follow as query parameters, e.g.
``?codec=shuffle-zstd&ttl_s=86400``). Layout:
``<root>/<namespace hex[:32]>/<2 hex>/<key hex>.kvc`` (directories 0700, files
0600), each file a chunk record (:mod:`kvtier.serde.record`) whose body is the
payload encoded by the tier's codec (the record names the codec and its
version; readers decode with the codec the record names).

Invariants:
- Writers create ``.<name>.<host>.<pid>.<thread>.tmp`` in the target directory
  and ``rename`` it into place (atomic on POSIX and NFS within one directory),
  so readers see a whole value or none; concurrent writers of one key each
  publish a whole value and the last rename wins.
- The tier keeps no index: other machines add and remove files at any time, so
  every call asks the filesystem. A file that fails validation is a miss,
  counted and removed (a record with a codec this reader lacks is a counted
  miss but kept: other readers may have it).
- Scoped to one namespace: each namespace has its own subdirectory; ``clear``
  removes that subdirectory's records only.
- The root directory is never created after start-up: if it vanishes (unmounted
  share) puts fail and gets miss, instead of filling the local disk below the
  mount point.
- **Expiry is leaf-first (prefix closure).** With ``ttl_s`` a record whose
  mtime is older than ``ttl_s`` is a miss (removed when met). Every record's
  mtime is at most its parent's: a new record takes its parent's mtime when the
  parent exists (else now), and ``touch_many`` refreshes a hit chain head first
  (walking up to the chain's first chunk). So a head never expires before its
  tails; a chain's age counts from its last touch or from its head's write.
  :meth:`FsTier.check_invariants` asserts this over the directory.

Capacity: the tier does not evict (machines would have to agree); bound the
share with a quota and, optionally, ``ttl_s``. Time bound: calls are plain file
I/O and return as fast as the filesystem does; a hung network mount blocks
them, so mount with ``soft``/``timeo`` (NFS) to bound that.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence
from urllib.parse import parse_qsl, unquote, urlsplit

from kvtier.serde.base import Buffer, Codec, CodecError, ValueSpec, byte_view
from kvtier.serde.envelope import as_bytes_view
from kvtier.serde.record import (
    HEADER_BYTES,
    MAX_FIELDS_BYTES,
    NAMESPACE_BYTES,
    SUFFIX,
    KeepRecord,
    RecordError,
    RecordHeader,
    UnknownCodec,
    decode_header,
    encode_record,
    read_record_into,
    record_relpath,
)
from kvtier.serde.registry import decoders_with, make_codec
from kvtier.tiers.base import ChunkWrite, LowerTier, TierCounters, as_chunk_write, check_key, destination_views

log = logging.getLogger(__name__)

_STALE_TMP_S = 3600.0
#: Namespace of a tier opened without one (tools and tests): 32 zero bytes.
UNNAMED_NAMESPACE = bytes(NAMESPACE_BYTES)
#: Longest chain ``touch_many`` walks up to find a chain's first chunk.
_MAX_CHAIN = 100_000
_DIR_MODE = 0o700
_FILE_MODE = 0o600


class FsTier(LowerTier):
    """Chunk records as files under ``root`` on a (shared) filesystem.

    Args:
        root: directory; created at start-up if ``create`` is set.
        namespace: 32-byte namespace digest (default: :data:`UNNAMED_NAMESPACE`).
        codec: write codec name or instance; ``codec_options`` its options.
        spec: dtype and shape hint of payloads.
        ttl_s: chains older than this (seconds, by mtime; see the module doc) are
            misses and get removed; None: no expiry.
        fsync: fsync each file before publishing it (survives a server crash, slower).
        create: create ``root`` if missing; if it stays missing (share not mounted)
            the tier opens anyway and every call misses until it appears.
        decoders: extra codecs readers may decode.

    Raises:
        ValueError: bad options (ttl_s, namespace length, codec).
        NotADirectoryError: ``root`` exists and is not a directory.
    """

    name = "fs"
    kind = "remote"
    schemes = ("fs",)

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: bytes = UNNAMED_NAMESPACE,
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
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError(f"namespace digests are {NAMESPACE_BYTES} bytes, got {len(namespace)}")
        self.root = Path(root)
        self.namespace = bytes(namespace)
        #: This namespace's subdirectory.
        self.dir = self.root / self.namespace.hex()[:32]
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
                self.root.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
        except OSError as exc:
            log.warning("kvtier fs tier: cannot create %s (%s); calls miss until it exists", self.root, exc)
        if not self.root.is_dir():
            # A share not mounted yet: not an error, every call misses until it appears.
            log.warning("kvtier fs tier: %s is not available; calls miss until it is", self.root)
        else:
            self._note_old_layout()


    @property
    def location(self) -> str:
        """``fs://<root>`` (tiers on the same root directory share chunks)."""
        return f"fs://{self.root.resolve()}"
    def _note_old_layout(self) -> None:
        """One log line if ``root`` holds the previous layout (``<2 hex>/<key>.kvv``, no namespace level)."""
        try:
            old = [e.name for e in os.scandir(self.root) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        if old:
            log.warning(
                "kvtier fs tier: %s holds %d directories of the previous file layout (e.g. %s/); "
                "they are never read; remove them to free the space",
                self.root, len(old), old[0],
            )

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

    def path_of(self, key: bytes) -> Path:
        """The record file of ``key`` in this tier's namespace (whether or not it exists)."""
        return self.dir / record_relpath(key)

    def _expired_ns(self, mtime_ns: int) -> bool:
        return self.ttl_s is not None and time.time_ns() - mtime_ns > self.ttl_s * 1e9

    def _scratch(self, n: int) -> memoryview:
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._tls.buf = bytearray(n)
        return memoryview(buf)[:n]

    def _remove(self, path: Path) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("kvtier fs tier: cannot remove %s: %s", path, exc)
            return False

    # -- queries --------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.contains_many_known(keys)[0]

    def contains_many_known(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool]]:
        """``stat`` per key; answered where the file system said present, absent or expired
        (another error, e.g. a dead NFS mount's EIO, leaves the key unanswered)."""
        for k in keys:
            check_key(k)
        out = [False] * len(keys)
        answered = [False] * len(keys)
        if self._closed:
            self.counters.add(skipped_calls=1)
            return out, answered
        for i, key in enumerate(keys):
            path = self.path_of(key)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                answered[i] = True
                continue
            except OSError as exc:
                self.counters.add(errors=1)
                log.debug("kvtier fs tier: stat %s failed: %s", path, exc)
                continue
            answered[i] = True
            if self._expired_ns(st.st_mtime_ns):
                self._remove(path)
                continue
            out[i] = True
        self.counters.add(contains_keys=len(keys), contains_hits=sum(out))
        return out, answered

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Refresh a hit chain's expiry, head first (ancestors of ``keys[0]`` included).

        Only does work with ``ttl_s`` set; stops at the first missing or expired
        key (the rest of the chain is unreachable). Never raises for a store failure.
        """
        if self._closed or self.ttl_s is None or not keys:
            return
        for k in keys:
            check_key(k)
        try:
            chain = self._ancestors(keys[0])[::-1] + list(keys)
            now = time.time_ns()
            for key in chain:
                path = self.path_of(key)
                st = os.stat(path)
                if self._expired_ns(st.st_mtime_ns):
                    return
                os.utime(path, ns=(st.st_atime_ns, now))
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                self.counters.add(errors=1)
                log.debug("kvtier fs tier: touch failed: %s", exc)

    def _ancestors(self, key: bytes) -> list[bytes]:
        """Resident ancestors of ``key``, nearest first (read from the record headers)."""
        out: list[bytes] = []
        seen = {key}
        hdr = self._header(key)
        while hdr is not None and hdr.parent is not None and hdr.parent not in seen and len(out) < _MAX_CHAIN:
            out.append(hdr.parent)
            seen.add(hdr.parent)
            hdr = self._header(hdr.parent)
        return out

    def _header(self, key: bytes) -> RecordHeader | None:
        try:
            with open(self.path_of(key), "rb", buffering=0) as f:
                hdr = decode_header(f.read(MAX_FIELDS_BYTES), full=False)
        except (OSError, RecordError):
            return None
        return hdr if hdr.key == key and hdr.namespace == self.namespace else None

    # -- writes ---------------------------------------------------------------------
    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """Store each chunk (a key already stored is replaced); True where stored.

        A chunk whose parent failed earlier in the same batch is not written.

        Raises:
            TypeError/ValueError: a bad key or parent, or a payload that is not C-contiguous.
        """
        return self._put_many(items, self.codec)

    def put_many_with_codec(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        """:meth:`put_many` with ``codec`` instead of the tier's codec (the record names it, so
        every reader decodes it). Raises as :meth:`put_many`."""
        return self._put_many(items, codec)

    def _put_many(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        writes = [as_chunk_write(it) for it in items]
        views = [as_bytes_view(w.payload) for w in writes]
        out = [False] * len(writes)
        if self._closed:
            self.counters.add(skipped_calls=1, puts=len(writes), put_failed=len(writes))
            return out
        written = 0
        failed: set[bytes] = set()
        for i, w in enumerate(writes):
            if w.parent in failed:  # its parent failed in this batch: it could not be hit
                failed.add(w.key)
                continue
            failed.add(w.key)  # until written
            try:
                parts, nbytes = encode_record(w.key, self.namespace, w.parent, views[i], codec, self.spec)
            except (CodecError, ValueError) as exc:
                log.warning("kvtier fs tier: chunk %s not stored: %s", w.key.hex()[:16], exc)
                continue
            if self._write(w.key, w.parent, parts):
                out[i] = True
                failed.discard(w.key)
                written += nbytes
        ok = sum(out)
        self.counters.add(puts=len(writes), put_ok=ok, put_failed=len(writes) - ok, bytes_written=written)
        return out

    def _write(self, key: bytes, parent: bytes | None, parts: list[Buffer]) -> bool:
        final = self.path_of(key)
        tmp = final.with_name(f".{final.name}.{self._host}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            if not self.root.is_dir():
                raise FileNotFoundError(f"fs tier root {self.root} is gone")
            try:
                final.parent.mkdir(exist_ok=True, mode=_DIR_MODE)
            except FileNotFoundError:  # the namespace's first record here
                self.dir.mkdir(exist_ok=True, mode=_DIR_MODE)
                final.parent.mkdir(exist_ok=True, mode=_DIR_MODE)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, _FILE_MODE)
            try:
                _writev_all(fd, parts)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if self.ttl_s is not None and parent is not None:
                self._inherit_mtime(tmp, parent)
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

    def _inherit_mtime(self, tmp: Path, parent: bytes) -> None:
        """Give a new record its parent's mtime if that is older (the chain expires leaf-first)."""
        try:
            pst = os.stat(self.path_of(parent))
        except FileNotFoundError:
            return
        st = os.stat(tmp)
        if pst.st_mtime_ns < st.st_mtime_ns:
            os.utime(tmp, ns=(st.st_atime_ns, pst.st_mtime_ns))

    # -- reads ------------------------------------------------------------------------
    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = destination_views(items)
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
        path = self.path_of(key)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if self._expired_ns(st.st_mtime_ns):
                    self._remove(path)
                    return "miss", 0
                read_record_into(f.readinto, st.st_size, key, self.namespace, dst, self.decoders, self._scratch)
                return "hit", st.st_size
        except FileNotFoundError:
            return "miss", 0
        except KeepRecord as exc:  # sound, but not for this reader: other readers may use it
            log.warning("kvtier fs tier: chunk %s is a miss: %s", key.hex()[:16], exc)
            return ("corrupt" if isinstance(exc, UnknownCodec) else "miss"), 0
        except RecordError as exc:
            log.warning("kvtier fs tier: chunk %s is a miss: %s; removing it", key.hex()[:16], exc)
            self._remove(path)
            return "corrupt", 0
        except OSError as exc:
            self.counters.add(errors=1)
            log.warning("kvtier fs tier: read of chunk %s failed: %s", key.hex()[:16], exc)
            return "miss", 0

    # -- listing ------------------------------------------------------------------------------
    def parent_of(self, key: bytes) -> bytes | None:
        """The parent recorded in ``key``'s record header (None: a first chunk, absent or unreadable)."""
        hdr = self._header(key)
        return None if hdr is None else hdr.parent

    def scan_keys(self) -> Iterator[tuple[bytes, bytes | None]]:
        """``(key, parent)`` of every record of this namespace (reads each record's header;
        O(records) file opens). Expired, unreadable and foreign records are skipped."""
        if self._closed:
            return
        try:
            subdirs = [e.path for e in os.scandir(self.dir) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for sub in subdirs:
            try:
                names = [e.name for e in os.scandir(sub) if e.name.endswith(SUFFIX) and not e.name.startswith(".")]
            except OSError:
                continue
            for name in names:
                path = os.path.join(sub, name)
                try:
                    with open(path, "rb", buffering=0) as f:
                        if self._expired_ns(os.fstat(f.fileno()).st_mtime_ns):
                            continue
                        hdr = decode_header(f.read(MAX_FIELDS_BYTES), full=False)
                except (OSError, RecordError):
                    continue
                if hdr.namespace == self.namespace and self.path_of(hdr.key) == Path(path):
                    yield hdr.key, hdr.parent

    def stored_sizes(self, keys: Sequence[bytes]) -> list[int]:
        """File bytes of each key's record (0 where absent or unreadable)."""
        out = []
        for k in keys:
            check_key(k)
            try:
                out.append(os.stat(self.path_of(k)).st_size)
            except OSError:
                out.append(0)
        return out

    # -- removal and lifecycle -------------------------------------------------------------
    def delete_many(self, keys: Sequence[bytes]) -> int:
        for k in keys:
            check_key(k)
        if self._closed:
            return 0
        n = sum(self._remove(self.path_of(k)) for k in keys)
        self.counters.add(deletes=n)
        return n

    def clear(self) -> int:
        """Remove this namespace's records (and its temp files older than an hour); other
        namespaces' subdirectories are left alone. To wipe every namespace, remove ``root``'s
        contents by hand."""
        if self._closed:
            return 0
        removed = 0
        now = time.time()
        try:
            subdirs = [e for e in os.scandir(self.dir) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return 0
        except OSError as exc:
            self.counters.add(errors=1)
            log.warning("kvtier fs tier: cannot list %s: %s", self.dir, exc)
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

    def check_invariants(self) -> None:
        """Assert leaf-first expiry over this namespace's records: no record is newer
        (mtime) than its parent's, and each record sits under its own key's name.
        Reads every header: for tests and debugging."""
        for sub in self.dir.glob("??"):
            for p in sub.glob("*" + SUFFIX):
                with open(p, "rb") as f:
                    hdr = decode_header(f.read(HEADER_BYTES))
                assert self.path_of(hdr.key) == p, f"{p} holds another key's record"
                if hdr.parent is None:
                    continue
                try:
                    parent_mtime = os.stat(self.path_of(hdr.parent)).st_mtime_ns
                except FileNotFoundError:
                    continue  # written before (or without) its parent: never a hit
                assert p.stat().st_mtime_ns <= parent_mtime, f"{p.name} would outlive its parent"

    def close(self) -> None:
        self._closed = True

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.counters.snapshot()
        out["codec"] = self.codec.name
        return out


def _writev_all(fd: int, parts: Sequence[Buffer]) -> None:
    views = [byte_view(p).cast("B") if byte_view(p).format != "B" else byte_view(p) for p in parts]
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
