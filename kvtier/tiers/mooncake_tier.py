"""Mooncake Store tier: chunk records in a Mooncake distributed memory pool (``mooncake://``).

URL: ``mooncake://MASTER_HOST:RPC_PORT`` with tier options as query parameters
(:mod:`kvtier.tiers.mooncake_url`), e.g.
``mooncake://127.0.0.1:50051?segment_bytes=1GiB``. Needs ``pip install
'kvtier[mooncake]'`` (the ``mooncake-transfer-engine-non-cuda`` wheel) and
``libibverbs1`` (loaded even for TCP).

Data model: one Mooncake object per chunk under
``<key_prefix><namespace-hex[:16]>:<key.hex()>``, holding a chunk record
(:mod:`kvtier.tiers.mooncake_io`: 4096-byte checksummed header + body). Reads
verify the record (key, namespace, lengths, codec, body checksum) before a hit.

Memory: the pool is the sum of the segments its clients mount. Each tier
instance is a Mooncake client that mounts ``segment_bytes`` of memory Mooncake
allocates inside *this* process (the kvtier server, or the engine when the tiers
run embedded); chunks the master placed there vanish when this process exits or
closes the tier. ``segment_bytes=0`` contributes none: the chunks then live in
other clients' segments, e.g. a dedicated ``mooncake_client`` process that
outlives kvtier restarts. Nothing is durable: a master restart loses every key.

Mooncake's semantics and what the tier does with each:

- ``put`` on an existing key succeeds and keeps the old bytes: a write removes
  the keys first (``batch_remove``, one master round trip per part), then puts, so
  the newest record wins (re-encoding with another codec works); a key under a read
  lease (another client reads it now) is not removed: its record, which holds the
  same chunk (keys are content digests), is kept and the write counts as stored;
- ``get`` gives empty bytes for a miss and an error alike: the tier never uses it;
  a get first asks the master for each value's replica and size
  (``batch_get_replica_desc``; keys it does not list are confirmed with
  ``batch_is_exist``, whose codes tell absent from failed), then transfers only
  present values of a size it can take;
- a read (``get``, ``is_exist``) leases the key for 10 s and ``remove`` answers
  -706 inside the lease: deletes and ``clear`` pass ``force=True`` (a reader then
  misses: its record fails the checks if the memory was reused meanwhile);
- a full store fails ``put`` at once with -200 while it evicts in the background:
  a dropped write (``put_failed``), not a failure of the store (the breaker stays closed);
- Mooncake evicts and loses keys by itself (eviction at its high watermark, a
  segment whose owner exited, a master restart): ``contains_many_known`` tells an
  answered absence from a failure, so the storage manager reports such chunks
  removed to the controller (:mod:`kvtier.storage.stale_remote`). Mooncake's
  eviction is not leaf-first; a chunk whose parent it evicted is never used (a
  lookup stops at the first gap) and ages out;
- ``setup()`` against a dead master blocks ~90 s and calls block ~4 s while
  ``health_check()`` may say healthy: every call runs off the caller's thread,
  bounded by ``timeout_s`` (``remote_timeout_s``), with a circuit breaker and
  back-off (:mod:`kvtier.tiers.mooncake_calls`).

Time bound: every call returns within ``timeout_s`` (plus scheduling slack),
except a get or put whose transfer had begun by then: Mooncake cannot cancel a
transfer that writes into (or reads) the caller's memory, so the call waits for it
at most ``transfer_grace_s`` more rather than return while bytes may still land in
(or be read from) a CPU slot that is then reused. A part not started by the
deadline never starts. Past the grace (a segment owner that stalls, not dies) the
call returns a miss and counts ``late_transfers``.

Batches are cut into ``parallel`` parts on idle workers whose transfers run one after
another (:class:`~kvtier.tiers.mooncake_calls.TransferRelay`): one part's CPU work (xxh3
checksums of the records it puts or has just read) overlaps the next part's transfer, so
only one part's checksums are not hidden behind a transfer.

Zero-copy: with the raw codec a put hands Mooncake the header and the CPU slot
(``batch_put_from_multi_buffers``) and a get receives into the same two
(``batch_get_into_multi_buffers``); the storage manager registers the CPU tier's
memory with the client (:meth:`MooncakeTier.register_host_memory`, Mooncake's
``register_buffer``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Mapping, Sequence

from kvtier.serde.base import Buffer, Codec
from kvtier.serde.record import HEADER_BYTES, KeepRecord, RecordError, UnknownCodec
from kvtier.serde.registry import decoders_with, make_codec
from kvtier.tiers.base import ChunkWrite, LowerTier, TierCounters, check_key, destination_views
from kvtier.tiers.mooncake_calls import (
    NO_AVAILABLE_HANDLE,
    OBJECT_HAS_LEASE,
    MooncakeCalls,
    TimedOut,
    TransferRelay,
    Unavailable,
    codes_answered,
    is_failure,
)
from kvtier.serde.envelope import as_bytes_view
from kvtier.tiers.mooncake_io import ReadPlan, address, encode_puts, plan_reads, verify_direct, verify_whole
from kvtier.tiers.mooncake_url import TIER_QUERY_OPTIONS, MooncakeTierOptions, parse_url

log = logging.getLogger(__name__)

__all__ = ["MooncakeTier", "MooncakeTierOptions", "TIER_QUERY_OPTIONS", "TransferRelay"]


class MooncakeTier(LowerTier):
    """Chunk records in Mooncake Store. See the module doc for semantics.

    Args:
        url: ``mooncake://HOST:PORT`` of the master (query options allowed).
        decoders: extra codecs readers may decode (name -> instance).
        options: :class:`MooncakeTierOptions` fields as keywords.

    Raises:
        ValueError: bad URL or options. ImportError: Mooncake is not installed. Nothing
            is waited for at construction: the client opens in the background, and an
            unreachable master only makes calls miss.
    """

    name = "mooncake"
    kind = "remote"
    schemes = ("mooncake",)

    def __init__(self, url: str, decoders: Mapping[str, Codec] | None = None, **options: Any):
        target = parse_url(url, options)
        try:
            self.options = opts = MooncakeTierOptions(**options)
        except TypeError as exc:
            raise ValueError(f"bad Mooncake tier option: {exc}") from None
        self.codec = make_codec(opts.codec, **dict(opts.codec_options))
        self.decoders = decoders_with(decoders)
        self.namespace = bytes(opts.namespace)
        self.url = target.url
        #: Prefix of every Mooncake key of this namespace (``clear`` removes exactly these).
        self.namespace_prefix = f"{opts.key_prefix}{self.namespace.hex()[:16]}:"
        self.counters = TierCounters()
        self.oversize_skipped = 0  # values above max_value_bytes a get did not read
        self._closed = False
        self._regions: list[tuple[int, int]] = []
        self._registered: set[tuple[int, int, int]] = set()  # (setup count, address, bytes)
        self._reg_lock = threading.Lock()
        self.calls = MooncakeCalls(opts, target.master, lambda n: self.counters.add(errors=n))

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "MooncakeTier":
        return cls(url, **options)

    @classmethod
    def check_url(cls, url: str) -> None:
        """Validate ``url`` and its options at config time, contacting nothing (and not
        importing Mooncake).

        Raises:
            ValueError: bad URL, unknown option (the message lists the accepted ones).
        """
        opts: dict[str, Any] = {}
        parse_url(url, opts)
        try:
            MooncakeTierOptions(**opts)
        except TypeError as exc:  # pragma: no cover - parse_url admits known names only
            raise ValueError(f"bad Mooncake tier option: {exc}") from None

    @property
    def location(self) -> str:
        """The master's URL and key prefix (tiers with both equal share chunks)."""
        return f"{self.url}#{self.options.key_prefix}"

    def mooncake_key(self, key: bytes) -> str:
        """The Mooncake key of chunk ``key`` in this tier's namespace."""
        return self.namespace_prefix + key.hex()

    # -- plumbing ----------------------------------------------------------------
    def _deadline(self) -> float:
        return time.monotonic() + self.options.timeout_s

    def _call(self, fn: Any, deadline: float | None = None, answered: Any = codes_answered) -> Any:
        """``fn(client)`` through :meth:`MooncakeCalls.call` (``answered`` judges the result for
        the breaker); None, counted as a skipped call, when the store was not reached in time."""
        if self._closed:
            self.counters.add(skipped_calls=1)
            return None
        try:
            return self.calls.call(lambda s: fn(self._store_with_regions(s)), deadline or self._deadline(), answered)
        except (TimedOut, Unavailable):
            self.counters.add(skipped_calls=1)
            return None

    def _store_with_regions(self, store: Any) -> Any:
        """``store`` after registering the host memory regions with it (once per client)."""
        if self._regions:
            gen = self.calls.setups
            with self._reg_lock:
                for addr, n in self._regions:
                    if (gen, addr, n) not in self._registered:
                        rc = store.register_buffer(addr, n)
                        if rc == 0:
                            self._registered.add((gen, addr, n))
                        else:
                            log.warning("kvtier mooncake: register_buffer(%d B) failed with %s", n, rc)
        return store

    def register_host_memory(self, addr: int, nbytes: int) -> None:
        """Register ``nbytes`` at ``addr`` (the CPU tier's slots) with the Mooncake client, so
        transfers to and from it need no staging (Mooncake's ``register_buffer``); done again
        by itself after the client reopens. The memory must outlive the tier."""
        if nbytes > 0:
            self._regions.append((int(addr), int(nbytes)))

    # -- existence ----------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.contains_many_known(keys)[0]

    def contains_many_known(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool]]:
        """``batch_is_exist`` in one master round trip; ``answered[i]`` is False where the
        master did not answer for key ``i`` (timeout, RPC failure, breaker open)."""
        for k in keys:
            check_key(k)
        found, answered = [False] * len(keys), [False] * len(keys)
        if not keys:
            return found, answered
        codes = self._call(lambda s: list(s.batch_is_exist([self.mooncake_key(k) for k in keys])))
        if codes is not None and len(codes) == len(keys):
            for i, c in enumerate(codes):
                found[i], answered[i] = c == 1, c in (0, 1)
        self.counters.add(contains_keys=len(keys), contains_hits=sum(found))
        return found, answered

    # -- writes ----------------------------------------------------------------------
    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        return self._put_many(items, self.codec)

    def put_many_with_codec(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        """:meth:`put_many` encoding with ``codec`` (the record names it), replacing stored chunks."""
        return self._put_many(items, codec)

    def _put_many(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        for item in items:
            if not isinstance(item, ChunkWrite):
                raise TypeError(f"put_many takes ChunkWrite items, got {type(item).__name__}")
            check_key(item.key)
            if item.parent is not None:
                check_key(item.parent)
        out = [False] * len(items)
        if not items:
            return out
        if self._closed:
            self.counters.add(puts=len(items), put_failed=len(items), skipped_calls=1)
            return out
        for item in items:  # a payload that is not C-contiguous is refused before any I/O
            as_bytes_view(item.payload)
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.options.replicas

        def put(part: list[int], j: int, relay: TransferRelay) -> Any:
            def run(store: Any) -> tuple[list[int], list[int], list[int]]:
                mkeys = [self.mooncake_key(items[i].key) for i in part]
                try:
                    # The checksums are taken while the previous part transfers.
                    batch, carried = encode_puts([items[i] for i in part], self.namespace, codec, self.options.spec)
                    if not relay.wait_turn(j):
                        return [], [], []  # the deadline came before this part's turn: nothing touched
                    # Mooncake's put keeps an existing key's old bytes: remove first so the newest
                    # wins (in the part's turn, so a part that never gets one removes nothing; only
                    # the chunks the codec carried, so a refused chunk keeps its stored record). Not
                    # forced: a key another client reads now (a 10 s read lease, -706) keeps its
                    # record, which is this chunk's too (keys are content digests): treated as
                    # stored, never yanked from under its reader.
                    removed = list(store.batch_remove([mkeys[n] for n in carried], False)) if carried else []
                    leased = [carried[m] for m, c in enumerate(removed) if c == OBJECT_HAS_LEASE]
                    kept = set(leased)
                    send = [m for m, n in enumerate(carried) if n not in kept]
                    if send and time.monotonic() >= relay.deadline:
                        # The remove outlived the deadline (a stalled master): the caller may have
                        # returned and reused the payload buffers, so the put must not start now.
                        send = []
                    codes = list(store.batch_put_from_multi_buffers(
                        [mkeys[carried[m]] for m in send], [batch.ptrs[m] for m in send],
                        [batch.sizes[m] for m in send], config,
                    )) if send else []
                finally:
                    relay.pass_turn(j)
                if len(codes) != len(send):
                    return [], [], []
                return ([part[n] for n in leased] + [part[carried[m]] for m in send], [0] * len(leased) + codes,
                        [0] * len(leased) + [batch.nbytes[m] for m in send])
            return run

        parts = self._parts(list(range(len(items))))
        deadline = self._deadline()
        relay = TransferRelay(len(parts), deadline)
        results = self._call_parts([put(p, j, relay) for j, p in enumerate(parts)], deadline,
                                   lambda r: codes_answered(r[1]), self.options.transfer_grace_s, relay)
        written = full = 0
        for res in results:
            if res is None or len(res[1]) != len(res[0]):
                continue
            for i, c, nbytes in zip(*res):
                if c == 0:
                    out[i] = True
                    written += nbytes
                full += c == NO_AVAILABLE_HANDLE
        if full:
            log.debug("kvtier mooncake: store full, %d of %d writes dropped", full, len(items))
        ok = sum(out)
        self.counters.add(puts=len(items), put_ok=ok, put_failed=len(items) - ok, bytes_written=written)
        return out

    def _parts(self, idx: list[int]) -> list[list[int]]:
        """``idx`` cut into at most ``parallel`` contiguous parts (fewer when workers are busy)."""
        k = max(1, min(self.options.parallel, len(idx), self.calls.idle))
        step = -(-len(idx) // k)
        return [idx[i : i + step] for i in range(0, len(idx), step)]

    def _call_parts(self, fns: list[Any], deadline: float, answered: Any, grace_s: float = 0.0,
                    relay: TransferRelay | None = None) -> list[Any]:
        """:meth:`MooncakeCalls.call_parts`; every part None (a skipped call) when nothing was started.
        With ``relay``, part ``j``'s turn is passed when its job ends however it ends (also when it
        fails before its body runs, e.g. registering host memory), so no later part waits for it."""
        if self._closed:
            self.counters.add(skipped_calls=1)
            return [None] * len(fns)

        def job(s: Any, fn: Any, j: int) -> Any:
            try:
                return fn(self._store_with_regions(s))
            finally:
                if relay is not None:
                    relay.pass_turn(j)

        wrap = [lambda s, fn=fn, j=j: job(s, fn, j) for j, fn in enumerate(fns)]
        try:
            results = self.calls.call_parts(wrap, deadline, answered, grace_s)
        except Unavailable:
            self.counters.add(skipped_calls=1)
            return [None] * len(fns)
        if any(r is None for r in results):
            self.counters.add(skipped_calls=1)
        return results

    # -- reads ---------------------------------------------------------------------------
    def _sizes(self, store: Any, mkeys: list[str]) -> list[int] | None:
        """Stored bytes of each key (0: absent), or None if the master did not answer."""
        desc = store.batch_get_replica_desc(mkeys)
        sizes = [0] * len(mkeys)
        unlisted = []
        for i, mk in enumerate(mkeys):
            for rep in desc.get(mk, ()):
                if rep.is_memory_replica() and str(rep.status).endswith("COMPLETE"):
                    sizes[i] = int(rep.get_memory_descriptor().buffer_descriptor.size)
                    break
            else:
                unlisted.append(i)
        if unlisted:  # absent, or the master failed: batch_is_exist's codes tell which
            codes = store.batch_is_exist([mkeys[i] for i in unlisted])
            if any(is_failure(c) for c in codes):
                return None
        return sizes

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = destination_views(items)
        n = len(items)
        out = [False] * n
        if not n:
            return out
        first: dict[bytes, int] = {}
        dups: list[tuple[int, int]] = []  # (index of a repeated key, index of its first ask)
        for i, (k, _) in enumerate(items):
            if k in first:
                dups.append((i, first[k]))
            else:
                first[k] = i
        if dups:
            # A key asked twice is read once: two reads of one key in one batch made Mooncake hand
            # one destination a broken record, judged corrupt, and the good record was removed.
            uniq = sorted(first.values())
            for pos, ok in zip(uniq, self.get_many_into([items[i] for i in uniq])):
                out[pos] = ok
            for d, f in dups:
                if out[f] and len(views[d]) == len(views[f]):
                    views[d][:] = views[f]
                    out[d] = True
            return out
        keys = [k for k, _ in items]
        mkeys = [self.mooncake_key(k) for k in keys]
        deadline = self._deadline()
        got = self._call(lambda s: (self._sizes(s, mkeys),), deadline, lambda r: r[0] is not None)
        sizes = None if got is None else got[0]
        if sizes is None:
            self.counters.add(gets=n, get_misses=n)
            return out
        plan = plan_reads(sizes, views, self.options.max_value_bytes)
        corrupt: list[int] = list(plan.tiny)  # unusable records: counted
        drop: list[int] = list(plan.tiny)  # of them, those removed from the store
        read = 0
        todo = plan.direct + plan.whole
        if todo:
            parts = self._parts(todo)
            late = deadline + self.options.transfer_grace_s
            relay = TransferRelay(len(parts), deadline)
            results = self._call_parts([self._read_part(p, j, relay, plan, mkeys, keys, views, sizes)
                                        for j, p in enumerate(parts)], deadline,
                                       lambda r: codes_answered(r[0]), self.options.transfer_grace_s, relay)
            for res in results:
                if res is None:
                    continue
                _, hits, bad, gone = res
                for i in hits:
                    out[i], read = True, read + sizes[i]
                corrupt += bad
                drop += gone
            if any(r is None for r in results) and time.monotonic() >= late:
                log.warning("kvtier mooncake: a transfer outlived %.1f s; its chunks are misses",
                            self.options.timeout_s + self.options.transfer_grace_s)
        hits = sum(out)
        self.counters.add(gets=n, get_hits=hits, get_misses=n - hits - len(corrupt),
                          get_corrupt=len(corrupt), bytes_read=read)
        if plan.too_big:
            self.oversize_skipped += len(plan.too_big)
            log.debug("kvtier mooncake: %d values above max_value_bytes were not read", len(plan.too_big))
        if drop:
            self._call(lambda s: list(s.batch_remove([mkeys[i] for i in drop], True)))
        return out

    def _read_part(self, part: list[int], j: int, relay: TransferRelay, plan: ReadPlan, mkeys: list[str],
                   keys: Sequence[bytes], views: list[memoryview], sizes: list[int]) -> Any:
        """A worker job: in part ``j``'s turn, move the part's values (direct ones into a header
        buffer + ``out``, whole ones into scratch), then verify each record there while the next
        part transfers. Returns (codes, hits, corrupt, to remove). The job holds every buffer it
        writes into until it returns, even past the caller's deadline."""
        slot = {i: n for n, i in enumerate(plan.direct)}
        direct = [i for i in part if i in slot]
        whole = [i for i in part if i not in slot]
        hb = address(plan.headers)

        def header(i: int) -> memoryview:
            j = slot[i]
            return memoryview(plan.headers.data)[j * HEADER_BYTES : (j + 1) * HEADER_BYTES]

        def run(store: Any) -> tuple[list[int], list[int], list[int], list[int]]:
            codes: list[int] = []
            try:
                if not relay.wait_turn(j):
                    return [], [], [], []  # the deadline came before this part's turn: nothing moved
                if direct:
                    codes += list(store.batch_get_into_multi_buffers(
                        [mkeys[i] for i in direct], [[hb + slot[i] * HEADER_BYTES, address(views[i])] for i in direct],
                        [[HEADER_BYTES, len(views[i])] for i in direct]))
                if whole:
                    codes += list(store.batch_get_into([mkeys[i] for i in whole],
                                                       [address(plan.scratch[i]) for i in whole],
                                                       [sizes[i] for i in whole]))
            finally:
                relay.pass_turn(j)
            hits: list[int] = []
            bad: list[int] = []
            gone: list[int] = []
            for i, c in zip(direct + whole, codes):
                if c != sizes[i]:
                    continue  # vanished or could not be moved: a miss
                if i in slot:
                    check = (lambda i=i: verify_direct(header(i), views[i], keys[i], self.namespace, self.decoders))
                else:
                    check = (lambda i=i: verify_whole(plan.scratch[i], views[i], keys[i], self.namespace, self.decoders))
                if self._verified(check, i, bad, gone):
                    hits.append(i)
            return codes, hits, bad, gone

        return run

    @staticmethod
    def _verified(check: Any, i: int, corrupt: list[int], drop: list[int]) -> bool:
        """Run ``check``; on a bad record note ``i`` as corrupt (and to remove, unless another
        reader may use it: a codec this reader lacks is counted but kept, another size is a
        plain miss)."""
        try:
            check()
            return True
        except KeepRecord as exc:
            log.debug("kvtier mooncake: chunk %d kept unused: %s", i, exc)
            if isinstance(exc, UnknownCodec):
                corrupt.append(i)
            return False
        except RecordError as exc:
            log.warning("kvtier mooncake: corrupt chunk record (%s); removing it", exc)
            corrupt.append(i)
            drop.append(i)
            return False

    # -- removal ---------------------------------------------------------------------------
    def delete_many(self, keys: Sequence[bytes]) -> int:
        """``batch_remove(force=True)`` (a read lease does not stop it); how many existed."""
        for k in keys:
            check_key(k)
        if not keys:
            return 0
        codes = self._call(lambda s: list(s.batch_remove([self.mooncake_key(k) for k in keys], True)))
        if codes is None:
            return 0
        n: int = sum(c == 0 for c in codes)
        self.counters.add(deletes=n)
        return n

    def clear(self) -> int:
        """Remove every key of this namespace (``remove_by_regex`` on the prefix, ``force``);
        other namespaces sharing the pool keep theirs. 0 on failure."""
        pattern = "^" + re.escape(self.namespace_prefix)
        n = self._call(lambda s: int(s.remove_by_regex(pattern, True)), answered=lambda r: not is_failure(r))
        if n is None or n < 0:
            return 0
        self.counters.add(deletes=int(n))
        return int(n)

    def stored_sizes(self, keys: Sequence[bytes]) -> list[int]:
        """Stored bytes (record header included) of each key; 0 where absent or on failure."""
        for k in keys:
            check_key(k)
        if not keys:
            return []
        mkeys = [self.mooncake_key(k) for k in keys]
        got = self._call(lambda s: (self._sizes(s, mkeys),), answered=lambda r: r[0] is not None)
        return got[0] if got is not None and got[0] is not None else [0] * len(keys)

    # -- lifecycle ----------------------------------------------------------------------------
    def check_store(self) -> list[str]:
        """Problems an operator should fix: the client did not open within ``timeout_s``
        (the master is down or unreachable). Never raises."""
        try:
            self.calls.call(lambda s: s.health_check(), self._deadline(), lambda rc: rc == 0)
        except (Unavailable, TimedOut) as exc:
            return [f"remote tier {self.url}: the Mooncake master does not answer ({exc}); its calls miss until it does"]
        return []

    def close(self) -> None:
        self._closed = True
        self.calls.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.counters.snapshot()
        out["breaker"] = self.calls.breaker.state
        out["breakers"] = {self.calls.master: self.calls.breaker.state}  # per node, as the Redis tier's
        out["breaker_trips"] = self.calls.breaker.trips
        out["client_open"] = self.calls.is_open
        out["setups"] = self.calls.setups
        out["busy_workers"] = self.calls.busy
        out["late_calls"] = self.calls.late_calls
        out["late_transfers"] = self.calls.overruns  # jobs still moving bytes past deadline + grace
        out["oversize_skipped"] = self.oversize_skipped
        out["codec"] = self.codec.name
        return out
