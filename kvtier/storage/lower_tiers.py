"""Opening the storage manager's lower tiers from the config, fastest first.

- the disk tier when ``disk_path`` is set (:class:`kvtier.tiers.disk.DiskTier`);
- the remote tier named by ``remote_url``, found by URL scheme through
  :mod:`kvtier.tiers.registry` (built-ins and ``kvtier.tiers`` entry points),
  given the namespace digest (``namespace``: its ``clear`` removes only this
  model's chunks) and the chunk's dtype and shape (:func:`chunk_spec`), so codecs
  can exploit the KV structure.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable

from kvtier.config import KVTierConfig
from kvtier.urls import mask_url
from kvtier.index.keys import KeyNamespace
from kvtier.serde.base import DTYPE_ITEMSIZE, ValueSpec
from kvtier.tiers.base import LowerTier
from kvtier.tiers.policies import make_policy
from kvtier.tiers.registry import load_tier_class

log = logging.getLogger(__name__)


def chunk_spec(namespace: KeyNamespace) -> ValueSpec:
    """dtype and logical shape of one chunk payload of ``namespace``.

    For the ``LBHNC`` layout (vLLM's CPU backend) the connector stores a chunk as
    ``[num_layers, blocks_per_chunk, num_kv_heads, block_size, 2 * head_dim]``
    elements (inside each head's block, K is stored transposed as ``[head_dim,
    block_size]`` followed by V as ``[block_size, head_dim]``). Other layouts get
    ``[num_layers, blocks_per_chunk, elements_per_block]``. A dtype codecs do not
    know becomes ``uint8`` with no shape (lossy codecs then refuse the chunk and
    the write is counted as failed; lossless ones still work).
    """
    lay = namespace.layout
    nbytes = namespace.chunk_bytes
    if lay.dtype not in DTYPE_ITEMSIZE:
        return ValueSpec("uint8", None)
    item = DTYPE_ITEMSIZE[lay.dtype]
    bpc = namespace.blocks_per_chunk
    if lay.kv_layout == "LBHNC":
        shape: tuple[int, ...] = (lay.num_layers, bpc, lay.num_kv_heads, lay.block_size, 2 * lay.head_dim)
    else:
        shape = (lay.num_layers, bpc, nbytes // (lay.num_layers * bpc * item))
    n = 1
    for d in shape:
        n *= d
    if n * item != nbytes:
        return ValueSpec(lay.dtype, None)
    return ValueSpec(lay.dtype, shape)


def _accepts(cls: type, name: str) -> bool:
    """True if ``cls(...)`` takes keyword ``name`` (explicitly or through ``**options``)."""
    try:
        # The class's own __init__, read off the class object (mypy's instance-access warning does not apply).
        params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def open_storage_tiers(
    config: KVTierConfig, namespace: KeyNamespace, is_pinned: Callable[[bytes], bool]
) -> list[LowerTier]:
    """The storage layer's lower tiers ``config`` names, fastest first: disk (if ``disk_path``), then remote.

    Peer tiers (``peers``, ``peer_discovery``) are opened one layer up, after these
    (:func:`kvtier.transfer.assembly.open_lower_tiers`).

    ``is_pinned`` tells the disk tier which keys leases hold (never evicted).

    Raises:
        ValueError: see :func:`open_remote_tier`.
        DiskTierLocked: the disk directory is owned by another live process.
        OSError: the disk directory cannot be created or listed.
    """
    tiers: list[LowerTier] = []
    try:
        if config.disk_path is not None:
            tiers.append(open_disk_tier(config, namespace, is_pinned))
        remote = open_remote_tier(config, namespace)
        if remote is not None:
            tiers.append(remote)
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers


def open_disk_tier(config: KVTierConfig, namespace: KeyNamespace, is_pinned: Callable[[bytes], bool]) -> LowerTier:
    """The disk tier at ``config.disk_path`` (its index rebuilt from the files there)."""
    from kvtier.tiers.disk import DiskTier  # the disk module is only needed with a disk tier

    assert config.disk_path is not None
    tier = DiskTier(
        config.disk_path,
        int(config.disk_capacity),
        namespace.digest(),
        make_policy(config.disk_eviction),
        is_pinned,
        fsync=config.disk_fsync,
        direct_io=config.disk_direct_io,
        io_threads=config.disk_io_threads,
        verify_reads=config.disk_verify_reads,
    )
    log.info("kvtier disk tier %s opened", config.disk_path)
    if not config.disk_verify_reads:
        log.warning("kvtier disk tier %s: reads are not checksum-verified (disk_verify_reads = false)", config.disk_path)
    return tier


def open_remote_tier(config: KVTierConfig, namespace: KeyNamespace) -> LowerTier | None:
    """The remote tier named by ``config.remote_url`` (None when unset).

    Passes ``namespace`` (the 32-byte namespace digest, to tiers that take it),
    ``codec``, ``spec``, ``ttl_s`` (if set) and ``timeout_s`` (to tiers that take
    it; the fs tier's calls are bounded by the filesystem instead).

    After opening, a tier's optional ``check_store()`` (one bounded round trip)
    is asked for problems, each logged at WARNING: an unreachable store, a Redis
    without ``maxmemory`` or with ``noeviction``.

    Raises:
        ValueError: unknown scheme or options the tier refuses (a configuration
            error). An unreachable store is not an error: its calls miss.
    """
    url = config.remote_url
    if url is None:
        return None
    cls = load_tier_class(url.split("://", 1)[0])
    options: dict[str, object] = {"codec": config.remote_codec, "spec": chunk_spec(namespace)}
    if config.remote_ttl_s is not None:
        options["ttl_s"] = config.remote_ttl_s
    if _accepts(cls, "namespace"):
        options["namespace"] = namespace.digest()
    else:
        log.warning(
            "kvtier remote tier %s takes no namespace: its clear() may remove other models' chunks", cls.__name__
        )
    if _accepts(cls, "timeout_s"):
        options["timeout_s"] = config.remote_timeout_s
    else:
        log.info("kvtier remote tier %s has no timeout option; its calls take as long as the store", cls.__name__)
    try:
        tier = cls.from_url(url, **options)
    except TypeError as exc:
        raise ValueError(f"remote tier {mask_url(url)!r} refused its options: {exc}") from None
    log.info("kvtier remote tier %s (%s, codec %s)", mask_url(url), cls.__name__, config.remote_codec)
    check = getattr(tier, "check_store", None)
    if callable(check):  # bounded by the tier's timeout; a dead or unbounded store is worth a WARNING
        try:
            for problem in check():
                log.warning("kvtier %s", problem)
        except Exception as exc:  # a plug-in's check must not stop the tiers from opening
            log.warning("kvtier remote tier %s: store check failed: %s", mask_url(url), exc)
    return tier
