"""The asynchronous cache operations of the fleet: ``clear``, ``pin`` and ``unpin``.

Each validates synchronously (raising :class:`~kvtier.controller.errors.BadRequest` /
:class:`~kvtier.controller.errors.UnknownInstance` before anything is sent), then runs on
the :class:`~kvtier.controller.op_context.OpContext`'s pool and returns its
:class:`~kvtier.controller.tracker.OpRecord`.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.controller.endpoint import InstanceOpError
from kvtier.controller.errors import BadRequest
from kvtier.controller.op_context import OpContext
from kvtier.controller.tracker import OpRecord


def clear(ctx: OpContext, instance: str | None = None, tier: str | None = None, cache_salt: str | None = None) -> OpRecord:
    """Clear every chunk of the scope (all instances/tiers unless narrowed).

    Result: ``{"tokens": total, "chunks": total, "instances": {id: {"tokens", "chunks", "result"}}}``
    (the instance's own ``chunks`` count where it reports one, else the index's at the start). With
    ``cache_salt`` the chunks whose chain starts at that salt's lineage marker
    (``KeyNamespace.lineage``, recorded as the first chunk's parent) are deleted, with their
    descendants in prefix-closed tiers; ``unattributed_chunks`` counts chunks of the scope whose
    lineage is unknown (written without a marker), which are left.

    Raises:
        UnknownInstance, BadRequest (an instance lacks the tier).
    """
    recs = ctx.targets(instance, tier)
    plan: list[tuple[str, bytes, int, int, list[bytes] | None]] = []
    unattributed: dict[str, int] = {}
    with ctx.state.lock:
        for r in recs:
            for digest, entry in r.namespaces.items():
                if cache_salt is not None:
                    keys, unknown = ctx.state.index.keys_of_salt(
                        r.instance, digest, entry.namespace.lineage(cache_salt), tier)
                    unattributed[r.instance] = unattributed.get(r.instance, 0) + unknown
                    n = len(keys)
                else:
                    keys = None
                    n = len(ctx.state.index.keys_in(r.instance, digest, tier))
                plan.append((r.instance, digest, n, entry.namespace.chunk_size, keys))

    def run(rec: OpRecord) -> dict[str, Any]:
        per: dict[str, dict[str, Any]] = {}
        errors = []
        for inst, digest, n, chunk_size, keys in plan:
            args: dict[str, Any] = {} if tier is None else {"tier": tier}
            try:
                if keys is None:
                    res = ctx.call(rec, inst, "clear", digest, args)
                elif keys:
                    res = ctx.call(rec, inst, "delete", digest, {**args, "keys": b"".join(keys)})
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
        if cache_salt is not None:
            # chunks with no recorded lineage cannot be attributed to a salt: left, and counted
            result["unattributed_chunks"] = sum(unattributed.values())
        if errors:
            raise InstanceOpError("; ".join(errors))
        return result

    return ctx.submit("clear", {"instance": instance, "tier": tier, "cache_salt": cache_salt}, run)


def pin(ctx: OpContext, tokens: Sequence[int], instance: str | None = None, ttl_s: float | None = None,
        cache_salt: str | None = None) -> OpRecord:
    """Pin the cached prefix of ``tokens`` on each target instance (instance op ``pin`` with
    ``pin_id`` = this operation's ``event_id``; the controller remembers which keys each pin covers).

    Result: ``{"tokens": total, "pin_id": event_id, "instances": {id: tokens}}``.

    Raises:
        UnknownInstance, BadRequest.
    """
    recs = ctx.targets(instance)
    hashed = ctx.hash_all(recs, tokens, None, cache_salt)
    plan: list[tuple[str, bytes, list[bytes], int]] = []
    with ctx.state.lock:
        for r in recs:
            for digest, entry in r.namespaces.items():
                ks = hashed[digest]
                n = ctx.state.index.match(r.instance, digest, ks).longest
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
                ctx.call(rec, inst, "pin", digest, args)
            except InstanceOpError as exc:
                errors.append(str(exc))
                continue
            with ctx.state.lock:
                ctx.pins[(inst, rec.event_id)] = (digest, set(ks))
                ctx.state.index.set_pins(inst, digest, ks, True)
            per[inst] += len(ks) * chunk_size
        if errors:
            raise InstanceOpError("; ".join(errors))
        return {"tokens": sum(per.values()), "pin_id": rec.event_id, "instances": per}

    return ctx.submit("pin", {"instance": instance, "ttl_s": ttl_s, "cache_salt": cache_salt,
                                "num_tokens": len(tokens)}, run)


def unpin(ctx: OpContext, tokens: Sequence[int] | None = None, instance: str | None = None, pin_id: str | None = None,
          cache_salt: str | None = None) -> OpRecord:
    """Release pins: the one named ``pin_id``, or every pin this controller made that covers a
    chunk of ``tokens`` (instance op ``unpin(pin_id)``), on the target instances.

    Result: ``{"pins": released pin ids, "instances": {id: unpinned chunks}}``.

    Raises:
        UnknownInstance, BadRequest (neither tokens nor pin_id).
    """
    if tokens is None and pin_id is None:
        raise BadRequest("give tokens or pin_id", "tokens")
    recs = ctx.targets(instance)
    hashed = ctx.hash_all(recs, tokens, None, cache_salt) if tokens is not None else {}
    plan: list[tuple[str, str, bytes]] = []
    with ctx.state.lock:
        for r in recs:
            if pin_id is not None:
                digest = ctx.pins.get((r.instance, pin_id), (next(iter(r.namespaces), b""), set()))[0]
                plan.append((r.instance, pin_id, digest))
                continue
            for (inst, pid), (digest, keys) in ctx.pins.items():
                if inst == r.instance and digest in hashed and keys.intersection(hashed[digest]):
                    plan.append((inst, pid, digest))

    def run(rec: OpRecord) -> dict[str, Any]:
        per: dict[str, int] = {r.instance: 0 for r in recs}
        released: list[str] = []
        errors = []
        for inst, pid, digest in plan:
            try:
                res = ctx.call(rec, inst, "unpin", digest, {"pin_id": pid})
            except InstanceOpError as exc:
                errors.append(str(exc))
                continue
            released.append(pid)
            per[inst] += int(res.get("unpinned", 0) or 0)
            with ctx.state.lock:
                _, keys = ctx.pins.pop((inst, pid), (digest, set()))
                still = set().union(*(k for (i, _), (d, k) in ctx.pins.items() if i == inst and d == digest))
                ctx.state.index.set_pins(inst, digest, list(keys - still), False)
        if errors:
            raise InstanceOpError("; ".join(errors))
        return {"pins": sorted(set(released)), "instances": per}

    return ctx.submit("unpin", {"instance": instance, "pin_id": pin_id, "cache_salt": cache_salt,
                                  "num_tokens": len(tokens) if tokens is not None else 0}, run)
