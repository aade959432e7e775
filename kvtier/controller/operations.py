"""Fleet operations composed from instance operations, and the tracker of asynchronous ones.

``lookup``, ``instances`` and ``health`` answer from the controller's own state. Every
other operation (clear, pin, unpin, move, compress, decompress) is asynchronous: it is
validated synchronously (bad input raises :class:`BadRequest` / :class:`UnknownInstance`
before anything is sent), gets an ``event_id`` and runs on a worker thread; its record
goes pending -> running -> done | failed (with a reason) and always reaches a terminal
state by its deadline (:meth:`OpTracker.get` fails an overdue record itself).

Instance operations (``OpRequest.args``): ``keys``/``parents`` are binaries of ``n * 32``
bytes, tiers are labels (``cpu``/``disk``/``remote``), plus ``codec``, ``ttl_s``,
``pin_id``, ``copy``, ``src``, ``dst``, ``tier``.
"""

from __future__ import annotations

import sys
import threading
import time
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvtier.controller.endpoint import Endpoint, InstanceOpError
from kvtier.controller.index import SaltScopeError
from kvtier.controller.registry import InstanceRecord, NamespaceEntry
from kvtier.controller.state import FleetState
from kvtier.protocol.fleet import join_parents
from kvtier.storage.types import TIER_KINDS

#: Default deadline of one fleet operation (seconds).
DEFAULT_OP_DEADLINE_S = 10.0
#: Terminal operation records kept for ``check_finish``.
DEFAULT_HISTORY = 10000
#: Tier labels always reported by lookup's per-tier shape.
REPORTED_TIERS = ("cpu", "disk", "remote")

TERMINAL = ("done", "failed")
#: ``array`` type code of an unsigned 32-bit int ('I' on every platform kvtier runs on).
_U32 = "I" if array("I").itemsize == 4 else "L"
_FAST_U32 = array(_U32).itemsize == 4 and sys.byteorder == "little"


class BadRequest(ValueError):
    """Invalid operation input (HTTP 400); ``field`` names the offending field."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class UnknownInstance(LookupError):
    """An instance id that is not registered (HTTP 404)."""

    def __init__(self, instance: str):
        super().__init__(f"unknown instance {instance!r} (not registered or expired)")
        self.instance = instance


@dataclass
class OpRecord:
    """One asynchronous operation.

    Attributes:
        event_id: its id (hex).
        op: operation name.
        state: ``pending``, ``running``, ``done`` or ``failed``.
        reason: why it failed ("" otherwise).
        result: the outcome (per instance, tokens affected).
        created_at / finished_at: wall-clock seconds (finished_at 0 until terminal).
        deadline: ``time.monotonic()`` by which it is terminal.
    """

    event_id: str
    op: str
    params: dict[str, Any]
    deadline: float
    state: str = "pending"
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    finished_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"event_id": self.event_id, "op": self.op, "state": self.state, "reason": self.reason,
                "result": self.result, "params": self.params, "created_at": self.created_at,
                "finished_at": self.finished_at}


class OpTracker:
    """Operation records by id, bounded (the oldest terminal records are forgotten first)."""

    def __init__(self, history: int = DEFAULT_HISTORY, grace_s: float = 1.0):
        self._ops: OrderedDict[str, OpRecord] = OrderedDict()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._history = history
        self._grace_s = grace_s

    def create(self, op: str, params: dict[str, Any], deadline_s: float) -> OpRecord:
        import os

        rec = OpRecord(os.urandom(8).hex(), op, params, time.monotonic() + deadline_s)
        with self._lock:
            self._ops[rec.event_id] = rec
            if len(self._ops) > self._history:
                for k in [k for k, r in self._ops.items() if r.state in TERMINAL][: len(self._ops) - self._history]:
                    del self._ops[k]
        return rec

    def _finish(self, rec: OpRecord, state: str, reason: str = "", result: dict[str, Any] | None = None) -> None:
        with self._lock:
            if rec.state in TERMINAL:
                return
            rec.state = state
            rec.reason = reason
            if result is not None:
                rec.result = result
            rec.finished_at = time.time()
            self._cond.notify_all()

    def running(self, rec: OpRecord) -> None:
        with self._lock:
            if rec.state == "pending":
                rec.state = "running"

    def done(self, rec: OpRecord, result: dict[str, Any]) -> None:
        self._finish(rec, "done", result=result)

    def failed(self, rec: OpRecord, reason: str, result: dict[str, Any] | None = None) -> None:
        self._finish(rec, "failed", reason, result)

    def _overdue(self, rec: OpRecord, now: float) -> None:
        if rec.state not in TERMINAL and now > rec.deadline + self._grace_s:
            self._finish(rec, "failed", f"timeout: {rec.op} did not finish by its deadline")

    def get(self, event_id: str) -> dict[str, Any] | None:
        """The record as JSON, or None if unknown (never issued or forgotten)."""
        with self._lock:
            rec = self._ops.get(event_id)
        if rec is None:
            return None
        self._overdue(rec, time.monotonic())
        with self._lock:
            return rec.to_json()

    def wait(self, event_id: str, timeout_s: float) -> dict[str, Any] | None:
        """Wait until the record is terminal or ``timeout_s`` passes; the record as JSON."""
        end = time.monotonic() + timeout_s
        with self._lock:
            rec = self._ops.get(event_id)
            while rec is not None and rec.state not in TERMINAL and time.monotonic() < end:
                self._cond.wait(min(0.05, max(0.0, end - time.monotonic())))
        return self.get(event_id)

    def counts(self) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            recs = list(self._ops.values())
        out = {"pending": 0, "running": 0, "done": 0, "failed": 0}
        for rec in recs:
            self._overdue(rec, now)
            out[rec.state] = out.get(rec.state, 0) + 1
        return out


def _chain_parents(keys: list[bytes]) -> bytes:
    return join_parents([None] + keys[:-1]) if keys else b""


def _tokens(n_chunks: int, entry: NamespaceEntry) -> int:
    return n_chunks * entry.namespace.chunk_size


class FleetOps:
    """The fleet operations (see the module docstring).

    Args:
        state: fleet state (registry + index).
        endpoint: sends instance operations.
        deadline_s: default deadline of one operation (seconds).
        workers: operations run at once; more wait pending.
    """

    def __init__(self, state: FleetState, endpoint: Endpoint, deadline_s: float = DEFAULT_OP_DEADLINE_S,
                 workers: int = 8, history: int = DEFAULT_HISTORY):
        self.state = state
        self.endpoint = endpoint
        self.deadline_s = deadline_s
        self.tracker = OpTracker(history)
        #: (instance, pin_id) -> (namespace digest, keys): the pins this controller made.
        self._pins: dict[tuple[str, str], tuple[bytes, set[bytes]]] = {}
        state.on_drop.append(self._forget_pins)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-controller-op")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget_pins(self, instance: str) -> None:
        with self.state.lock:
            for k in [k for k in self._pins if k[0] == instance]:
                del self._pins[k]

    # -- helpers ------------------------------------------------------------------

    def _targets(self, instance: str | None, tier: str | None = None) -> list[InstanceRecord]:
        with self.state.lock:
            if instance is not None:
                rec = self.state.registry.get(instance)
                if rec is None:
                    raise UnknownInstance(instance)
                if tier is not None and tier not in rec.tiers:
                    raise BadRequest(f"instance {instance!r} has no tier {tier!r} (it has {sorted(rec.tiers)})", "tier")
                return [rec]
            recs = self.state.registry.records()
        return [r for r in recs if tier is None or tier in r.tiers]

    def _keys(self, entry: NamespaceEntry, tokens: Sequence[int] | np.ndarray, cache_salt: str | None) -> list[bytes]:
        try:
            return entry.hasher.keys(tokens, cache_salt=cache_salt)
        except ValueError as exc:
            raise BadRequest(str(exc), "tokens") from None

    @staticmethod
    def _token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token ids as ``<u4`` (a list goes through ``array('I')``: 4x faster than numpy's conversion).

        Raises:
            BadRequest: an id that is not an integer in ``[0, 2**32)``.
        """
        if isinstance(tokens, np.ndarray) or not _FAST_U32:
            return np.asarray(tokens)
        try:
            return np.frombuffer(array(_U32, tokens), dtype="<u4")
        except (OverflowError, TypeError) as exc:
            raise BadRequest(f"token ids must be integers in [0, 2**32): {exc}", "tokens") from None

    def _submit(self, op: str, params: dict[str, Any], fn: Callable[[OpRecord], dict[str, Any]]) -> OpRecord:
        rec = self.tracker.create(op, params, self.deadline_s)

        def run() -> None:
            if time.monotonic() > rec.deadline:
                self.tracker.failed(rec, f"timeout: {op} waited past its deadline before it could start")
                return
            self.tracker.running(rec)
            try:
                result = fn(rec)
            except (InstanceOpError, BadRequest, SaltScopeError) as exc:
                self.tracker.failed(rec, str(exc))
            except Exception as exc:  # noqa: BLE001 - reported as the op's failure
                self.tracker.failed(rec, f"internal error: {type(exc).__name__}: {exc}")
            else:
                self.tracker.done(rec, result)

        self._pool.submit(run)
        return rec

    def _call(self, rec: OpRecord, instance: str, op: str, ns: bytes, args: dict[str, Any]) -> dict[str, Any]:
        """Run one instance op within ``rec``'s deadline; its result map.

        Raises:
            InstanceOpError: not answered in time, unreachable, or answered ``ok=False``.
        """
        remaining = rec.deadline - time.monotonic()
        if remaining <= 0:
            raise InstanceOpError(f"timeout: no time left for {op} on instance {instance!r}")
        fut = self.endpoint.request(instance, op, ns, args, remaining)
        try:
            res = fut.result(timeout=remaining + 1.0)
        except TimeoutError:
            raise InstanceOpError(f"timeout: instance {instance!r} did not answer {op} within {remaining:.3g} s") from None
        if not res.ok:
            raise InstanceOpError(f"instance {instance!r}: {op} failed: {res.error or 'no reason given'}")
        return dict(res.result)

    def _hash_all(self, recs: list[InstanceRecord], tokens: Sequence[int] | None, keys: list[bytes] | None,
                  cache_salt: str | None) -> dict[bytes, list[bytes]]:
        out: dict[bytes, list[bytes]] = {}
        if keys is None:
            tokens = self._token_array(tokens if tokens is not None else [])
        for r in recs:
            for digest, entry in r.namespaces.items():
                if digest not in out:
                    out[digest] = list(keys) if keys is not None else self._keys(entry, tokens, cache_salt)
        return out

    # -- synchronous --------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | None = None, keys: list[bytes] | None = None,
               cache_salt: str | None = None, instance: str | None = None) -> dict[str, Any]:
        """Longest cached prefix per instance, in both response shapes.

        Returns:
            ``{"layout_info": {instance: [LOCATION, tokens]}, "instances": {instance:
            {"longest_matched", "CPU", "DISK", "REMOTE", "pinned"}}}`` (tokens; LOCATION is
            the upper-cased fastest tier holding the longest single-tier prefix; only
            instances with a match appear in ``layout_info``).

        Raises:
            UnknownInstance, BadRequest.
        """
        if (tokens is None) == (keys is None):
            raise BadRequest("give exactly one of tokens or keys", "tokens")
        recs = self._targets(instance)
        hashed = self._hash_all(recs, tokens, keys, cache_salt)
        layout: dict[str, list[Any]] = {}
        per_inst: dict[str, dict[str, int]] = {}
        with self.state.lock:
            for r in recs:
                best = None
                for digest, entry in r.namespaces.items():
                    m = self.state.index.match(r.instance, digest, hashed[digest])
                    if best is None or m.longest > best[0].longest:
                        best = (m, entry)
                row = {"longest_matched": 0, **{t.upper(): 0 for t in REPORTED_TIERS}, "pinned": 0}
                for label in r.tiers:
                    row.setdefault(label.upper(), 0)
                if best is not None:
                    m, entry = best
                    row["longest_matched"] = _tokens(m.longest, entry)
                    row["pinned"] = _tokens(m.pinned, entry)
                    for label, n in m.per_tier.items():
                        row[label.upper()] = _tokens(n, entry)
                    if m.longest > 0:
                        top = max(m.per_tier.values(), default=0)
                        loc = next((t for t in TIER_KINDS if m.per_tier.get(t, -1) == top), "cpu")
                        layout[r.instance] = [loc.upper(), row["longest_matched"]]
                per_inst[r.instance] = row
        return {"layout_info": layout, "instances": per_inst}

    def instances(self) -> list[dict[str, Any]]:
        """Registered instances: ids, roles, tiers (with indexed chunks/bytes), namespaces, heartbeat age."""
        now = time.monotonic()
        out = []
        with self.state.lock:
            for r in self.state.registry.records():
                tiers = []
                for label, info in r.tiers.items():
                    chunks = sum(self.state.index.tier_chunks(r.instance, d, label) for d in r.namespaces)
                    nbytes = sum(self.state.index.tier_chunks(r.instance, d, label) * e.info.chunk_bytes
                                 for d, e in r.namespaces.items())
                    tiers.append({"kind": label, "name": info.name, "capacity_bytes": info.capacity_bytes,
                                  "shared": info.shared, "chunks": chunks, "bytes": nbytes})
                out.append({
                    "instance": r.instance, "epoch": r.epoch, "role": r.role, "host": r.host, "pid": r.pid,
                    "registered_at": r.registered_at, "last_heartbeat": r.last_heartbeat,
                    "last_seen_age_s": round(now - r.last_seen, 4), "tiers": tiers,
                    "namespaces": [{"digest": d.hex(), "model": e.namespace.model, "chunk_size": e.info.chunk_size,
                                    "chunk_bytes": e.info.chunk_bytes, "rank": e.namespace.rank,
                                    "world_size": e.namespace.world_size} for d, e in r.namespaces.items()],
                })
        return out

    def health(self, instance: str | None = None, live: bool = False) -> dict[str, Any]:
        """Per instance: last heartbeat's tier health (``live``: ask each instance now, within the deadline,
        with ``probe``: every tier must answer one bounded round trip to count as reachable)."""
        recs = self._targets(instance)
        now = time.monotonic()
        out: dict[str, Any] = {}
        for r in recs:
            row: dict[str, Any] = {"last_seen_age_s": round(now - r.last_seen, 4), "tiers": dict(r.health)}
            out[r.instance] = row
        if live:
            rec = OpRecord("live-health", "health", {}, time.monotonic() + self.deadline_s)
            for r in recs:
                ns = next(iter(r.namespaces), b"")
                try:
                    # live: each tier answers a bounded round trip (a dead store is unreachable at once)
                    out[r.instance]["tiers"] = self._call(rec, r.instance, "health", ns, {"probe": True})
                    out[r.instance]["reachable"] = True
                except InstanceOpError as exc:
                    out[r.instance]["reachable"] = False
                    out[r.instance]["error"] = str(exc)
        return {"instances": out}

    def check_finish(self, event_id: str) -> dict[str, Any] | None:
        return self.tracker.get(event_id)

    # -- asynchronous -------------------------------------------------------------

    def clear(self, instance: str | None = None, tier: str | None = None, cache_salt: str | None = None) -> OpRecord:
        """Clear every chunk of the scope (all instances/tiers unless narrowed).

        Result: ``{"tokens": total, "chunks": total, "instances": {id: {"tokens", "chunks", "result"}}}``
        (the instance's own ``chunks`` count where it reports one, else the index's at the start). With ``cache_salt`` the chunks whose chain starts at
        that salt's root are deleted.

        Raises:
            UnknownInstance, BadRequest (an instance lacks the tier; a salt scope that cannot
            be resolved from the index).
        """
        recs = self._targets(instance, tier)
        plan: list[tuple[str, bytes, int, int, list[bytes] | None]] = []
        with self.state.lock:
            for r in recs:
                for digest, entry in r.namespaces.items():
                    if cache_salt is not None:
                        try:
                            keys = self.state.index.keys_of_salt(r.instance, digest, entry.namespace.root(cache_salt), tier)
                        except SaltScopeError as exc:
                            raise BadRequest(str(exc), "cache_salt") from None
                        n = len(keys)
                    else:
                        keys = None
                        n = len(self.state.index.keys_in(r.instance, digest, tier))
                    plan.append((r.instance, digest, n, entry.namespace.chunk_size, keys))

        def run(rec: OpRecord) -> dict[str, Any]:
            per: dict[str, dict[str, Any]] = {}
            errors = []
            for inst, digest, n, chunk_size, keys in plan:
                args: dict[str, Any] = {} if tier is None else {"tier": tier}
                try:
                    if keys is None:
                        res = self._call(rec, inst, "clear", digest, args)
                    elif keys:
                        res = self._call(rec, inst, "delete", digest, {**args, "keys": b"".join(keys)})
                    else:
                        res = {}
                except InstanceOpError as exc:
                    errors.append(str(exc))
                    continue
                row = per.setdefault(inst, {"tokens": 0, "chunks": 0, "result": {}})
                got = res.get("chunks")  # the tier's own count where the instance reports one
                n_done = got if isinstance(got, int) and not isinstance(got, bool) else n
                row["chunks"] += n_done
                row["tokens"] += n_done * chunk_size
                row["result"][digest.hex()] = res
            result = {"tokens": sum(r["tokens"] for r in per.values()),
                      "chunks": sum(r["chunks"] for r in per.values()), "instances": per}
            if errors:
                raise InstanceOpError("; ".join(errors))
            return result

        return self._submit("clear", {"instance": instance, "tier": tier, "cache_salt": cache_salt}, run)

    def pin(self, tokens: Sequence[int], instance: str | None = None, ttl_s: float | None = None,
            cache_salt: str | None = None) -> OpRecord:
        """Pin the cached prefix of ``tokens`` on each target instance (instance op ``pin`` with
        ``pin_id`` = this operation's ``event_id``; the controller remembers which keys each pin covers).

        Result: ``{"tokens": total, "pin_id": event_id, "instances": {id: tokens}}``.

        Raises:
            UnknownInstance, BadRequest.
        """
        recs = self._targets(instance)
        hashed = self._hash_all(recs, tokens, None, cache_salt)
        plan: list[tuple[str, bytes, list[bytes], int]] = []
        with self.state.lock:
            for r in recs:
                for digest, entry in r.namespaces.items():
                    ks = hashed[digest]
                    n = self.state.index.match(r.instance, digest, ks).longest
                    if n:
                        plan.append((r.instance, digest, ks[:n], entry.namespace.chunk_size))

        def run(rec: OpRecord) -> dict[str, Any]:
            per: dict[str, int] = {r.instance: 0 for r in recs}
            errors = []
            for inst, digest, ks, chunk_size in plan:
                args: dict[str, Any] = {"keys": b"".join(ks), "pin_id": rec.event_id}
                if ttl_s is not None:
                    args["ttl_s"] = float(ttl_s)
                try:
                    self._call(rec, inst, "pin", digest, args)
                except InstanceOpError as exc:
                    errors.append(str(exc))
                    continue
                with self.state.lock:
                    self._pins[(inst, rec.event_id)] = (digest, set(ks))
                    self.state.index.set_pins(inst, digest, ks, True)
                per[inst] += len(ks) * chunk_size
            if errors:
                raise InstanceOpError("; ".join(errors))
            return {"tokens": sum(per.values()), "pin_id": rec.event_id, "instances": per}

        return self._submit("pin", {"instance": instance, "ttl_s": ttl_s, "cache_salt": cache_salt,
                                    "num_tokens": len(tokens)}, run)

    def unpin(self, tokens: Sequence[int] | None = None, instance: str | None = None, pin_id: str | None = None,
              cache_salt: str | None = None) -> OpRecord:
        """Release pins: the one named ``pin_id``, or every pin this controller made that covers a
        chunk of ``tokens`` (instance op ``unpin(pin_id)``), on the target instances.

        Result: ``{"pins": released pin ids, "instances": {id: unpinned chunks}}``.

        Raises:
            UnknownInstance, BadRequest (neither tokens nor pin_id).
        """
        if tokens is None and pin_id is None:
            raise BadRequest("give tokens or pin_id", "tokens")
        recs = self._targets(instance)
        hashed = self._hash_all(recs, tokens, None, cache_salt) if tokens is not None else {}
        plan: list[tuple[str, str, bytes]] = []
        with self.state.lock:
            for r in recs:
                if pin_id is not None:
                    digest = self._pins.get((r.instance, pin_id), (next(iter(r.namespaces), b""), set()))[0]
                    plan.append((r.instance, pin_id, digest))
                    continue
                for (inst, pid), (digest, keys) in self._pins.items():
                    if inst == r.instance and digest in hashed and keys.intersection(hashed[digest]):
                        plan.append((inst, pid, digest))

        def run(rec: OpRecord) -> dict[str, Any]:
            per: dict[str, int] = {r.instance: 0 for r in recs}
            released: list[str] = []
            errors = []
            for inst, pid, digest in plan:
                try:
                    res = self._call(rec, inst, "unpin", digest, {"pin_id": pid})
                except InstanceOpError as exc:
                    errors.append(str(exc))
                    continue
                released.append(pid)
                per[inst] += int(res.get("unpinned", 0) or 0)
                with self.state.lock:
                    _, keys = self._pins.pop((inst, pid), (digest, set()))
                    still = set().union(*(k for (i, _), (d, k) in self._pins.items() if i == inst and d == digest))
                    self.state.index.set_pins(inst, digest, list(keys - still), False)
            if errors:
                raise InstanceOpError("; ".join(errors))
            return {"pins": sorted(set(released)), "instances": per}

        return self._submit("unpin", {"instance": instance, "pin_id": pin_id, "cache_salt": cache_salt,
                                      "num_tokens": len(tokens) if tokens is not None else 0}, run)

    def move(self, tokens: Sequence[int], src_instance: str, dst_tier: str, dst_instance: str | None = None,
             src_tier: str | None = None, copy: bool = False, cache_salt: str | None = None) -> OpRecord:
        """Move (or copy) the cached prefix of ``tokens`` from one instance/tier to another.

        Same instance: ``move_local``. Across instances: ``export`` on the source into a
        shared tier both have, ``import`` on the target, ``verify`` on the target, then
        ``delete`` on the source unless ``copy``.

        Result: ``{"tokens": moved, "steps": [...]}``.

        Raises:
            UnknownInstance, BadRequest (missing tier, no shared tier, same source and target).
        """
        src = self._targets(src_instance, src_tier)[0]
        dst_name = dst_instance or src_instance
        dst = self._targets(dst_name, dst_tier)[0]
        hashed = self._hash_all([src], tokens, None, cache_salt)
        with self.state.lock:
            best = None
            for digest, entry in src.namespaces.items():
                m = self.state.index.match(src.instance, digest, hashed[digest])
                if best is None or m.longest > best[0].longest:
                    best = (m, digest, entry)
        if best is None:
            raise BadRequest(f"instance {src_instance!r} registered no namespace", "from_instance")
        m, digest, entry = best
        if src_tier is None:
            top = max(m.per_tier.values(), default=0)
            src_tier = next((t for t in TIER_KINDS if m.per_tier.get(t, -1) == top), next(iter(src.tiers)))
        n = m.per_tier.get(src_tier, 0)
        if digest not in dst.namespaces:
            raise BadRequest(f"instance {dst_name!r} does not store namespace {digest.hex()[:16]} of "
                             f"{src_instance!r}", "to_instance")
        shared = None
        if dst.instance != src.instance:
            shared = next((lab for lab, info in src.tiers.items() if info.shared and lab in dst.tiers
                           and dst.tiers[lab].shared and dst.tiers[lab].name == info.name), None)
            if shared is None:
                raise BadRequest(f"instances {src.instance!r} and {dst.instance!r} share no tier to move through",
                                 "to_instance")
        elif src_tier == dst_tier:
            raise BadRequest(f"source and target are both {src_instance!r}/{src_tier}", "to_tier")
        if shared is not None and dst_tier not in (shared, "cpu", "disk"):
            raise BadRequest(f"to_tier: a move between instances lands in cpu, disk or the shared {shared!r} tier",
                             "to_tier")
        keys = hashed[digest][:n]
        chunk_size = entry.namespace.chunk_size

        def run(rec: OpRecord) -> dict[str, Any]:
            steps: list[dict[str, Any]] = []
            if not keys:
                return {"tokens": 0, "steps": steps, "note": f"{src.instance} holds no prefix in {src_tier}"}
            kb, pb = b"".join(keys), _chain_parents(keys)

            def step(inst: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
                res = self._call(rec, inst, op, digest, args)
                steps.append({"instance": inst, "op": op, "result": res})
                return res

            if shared is None:
                step(src.instance, "move_local", {"keys": kb, "parents": pb, "src": src_tier, "dst": dst_tier,
                                                  "copy": copy})
            else:
                if src_tier != shared:
                    step(src.instance, "export", {"keys": kb, "parents": pb, "tier": shared})
                if dst_tier != shared:
                    step(dst.instance, "import", {"keys": kb, "parents": pb, "dst": dst_tier})
                res = step(dst.instance, "verify", {"keys": kb, "tier": dst_tier})
                bad = {k: _count(res.get(k)) for k in ("missing", "corrupt")}
                if any(bad.values()):
                    raise InstanceOpError(f"verify on instance {dst.instance!r} ({dst_tier}) found "
                                          f"{bad['missing']} chunks missing, {bad['corrupt']} corrupt")
                if not copy and src_tier != shared:
                    step(src.instance, "delete", {"keys": kb, "tier": src_tier})
            return {"tokens": len(keys) * chunk_size, "steps": steps}

        return self._submit("move", {"from_instance": src_instance, "from_tier": src_tier, "to_instance": dst_name,
                                     "to_tier": dst_tier, "copy": copy, "num_tokens": len(tokens)}, run)

    def compress(self, tokens: Sequence[int], codec: str, instance: str | None = None, tier: str | None = None,
                 cache_salt: str | None = None) -> OpRecord:
        """Re-encode the stored chunks of the cached prefix of ``tokens`` with ``codec`` in place
        (``"raw"``: instance op ``decompress``), in ``tier`` or every lower tier holding them.

        The CPU tier holds raw KV only, so only lower tiers (disk, remote) are re-encoded.
        Result: ``{"tokens": total, "instances": {id: {tier: {"tokens", "result"}}}}`` (the
        instance's result carries sizes and, for lossy codecs, ``max_abs_error``).

        Raises:
            UnknownInstance, BadRequest (unknown codec, missing tier, ``cpu``).
        """
        from kvtier.serde.registry import CODECS

        if codec not in CODECS:
            raise BadRequest(f"unknown codec {codec!r}; choose one of {sorted(CODECS)}", "codec")
        if tier == "cpu":
            raise BadRequest("tier: the CPU tier holds raw KV; compress re-encodes lower tiers (disk, remote)", "tier")
        recs = self._targets(instance, tier)
        hashed = self._hash_all(recs, tokens, None, cache_salt)
        plan: list[tuple[str, bytes, str, list[bytes], int]] = []
        with self.state.lock:
            for r in recs:
                for digest, entry in r.namespaces.items():
                    m = self.state.index.match(r.instance, digest, hashed[digest])
                    for label in ([tier] if tier else [t for t in r.tiers if t != "cpu"]):
                        n = m.per_tier.get(label, 0)
                        if n:
                            plan.append((r.instance, digest, label, hashed[digest][:n], entry.namespace.chunk_size))
        op = "decompress" if codec == "raw" else "compress"

        def run(rec: OpRecord) -> dict[str, Any]:
            per: dict[str, dict[str, Any]] = {}
            errors = []
            total = 0
            for inst, digest, label, ks, chunk_size in plan:
                args: dict[str, Any] = {"keys": b"".join(ks), "tier": label}
                if op == "compress":
                    args["codec"] = codec
                try:
                    res = self._call(rec, inst, op, digest, args)
                except InstanceOpError as exc:
                    errors.append(str(exc))
                    continue
                per.setdefault(inst, {})[label] = {"tokens": len(ks) * chunk_size, "result": res}
                total += len(ks) * chunk_size
            if errors:
                raise InstanceOpError("; ".join(errors))
            return {"tokens": total, "instances": per}

        return self._submit(op, {"instance": instance, "tier": tier, "codec": codec, "num_tokens": len(tokens)}, run)


def _count(v: Any) -> int:
    """A count reported as an int or as a list of items."""
    if isinstance(v, (list, tuple, set)):
        return len(v)
    return int(v or 0)
