"""The asynchronous data-movement operations of the fleet: ``move`` and ``compress``.

Each validates synchronously (raising :class:`~kvtier.controller.errors.BadRequest` /
:class:`~kvtier.controller.errors.UnknownInstance` before anything is sent), then runs on
the :class:`~kvtier.controller.op_context.OpContext`'s pool and returns its
:class:`~kvtier.controller.tracker.OpRecord`. Instance op args: ``keys``/``parents`` are
binaries of ``n * 32`` bytes.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.controller.endpoint import InstanceOpError
from kvtier.controller.errors import BadRequest
from kvtier.controller.op_context import OpContext
from kvtier.controller.tracker import OpRecord
from kvtier.protocol.fleet import join_parents
from kvtier.storage.types import TIER_KINDS


def _chain_parents(keys: list[bytes]) -> bytes:
    return join_parents([None] + keys[:-1]) if keys else b""


def _count(v: Any) -> int:
    """A count reported as an int or as a list of items."""
    if isinstance(v, (list, tuple, set)):
        return len(v)
    return int(v or 0)


def move(ctx: OpContext, tokens: Sequence[int], src_instance: str, dst_tier: str, dst_instance: str | None = None,
         src_tier: str | None = None, copy: bool = False, cache_salt: str | None = None) -> OpRecord:
    """Move (or copy) the cached prefix of ``tokens`` from one instance/tier to another.

    Same instance: ``move_local``. Across instances: ``export`` on the source into a
    shared tier both have, ``import`` on the target, ``verify`` on the target, then
    ``delete`` on the source unless ``copy``.

    Result: ``{"tokens": moved, "steps": [...]}``.

    Raises:
        UnknownInstance, BadRequest (missing tier, no shared tier, same source and target).
    """
    src = ctx.targets(src_instance, src_tier)[0]
    dst_name = dst_instance or src_instance
    dst = ctx.targets(dst_name, dst_tier)[0]
    hashed = ctx.hash_all([src], tokens, None, cache_salt)
    with ctx.state.lock:
        best = None
        for digest, entry in src.namespaces.items():
            m = ctx.state.index.match(src.instance, digest, hashed[digest])
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
            res = ctx.call(rec, inst, op, digest, args)
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

    return ctx.submit("move", {"from_instance": src_instance, "from_tier": src_tier, "to_instance": dst_name,
                                 "to_tier": dst_tier, "copy": copy, "num_tokens": len(tokens)}, run)


def compress(ctx: OpContext, tokens: Sequence[int], codec: str, instance: str | None = None, tier: str | None = None,
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
    recs = ctx.targets(instance, tier)
    hashed = ctx.hash_all(recs, tokens, None, cache_salt)
    plan: list[tuple[str, bytes, str, list[bytes], int]] = []
    with ctx.state.lock:
        for r in recs:
            for digest, entry in r.namespaces.items():
                m = ctx.state.index.match(r.instance, digest, hashed[digest])
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
                res = ctx.call(rec, inst, op, digest, args)
            except InstanceOpError as exc:
                errors.append(str(exc))
                continue
            per.setdefault(inst, {})[label] = {"tokens": len(ks) * chunk_size, "result": res}
            total += len(ks) * chunk_size
        if errors:
            raise InstanceOpError("; ".join(errors))
        return {"tokens": total, "instances": per}

    return ctx.submit(op, {"instance": instance, "tier": tier, "codec": codec, "num_tokens": len(tokens)}, run)
