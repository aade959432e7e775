"""kvtier: tiered KV-cache storage for LLM inference engines.

Layout:
- ``kvtier.index``: chunk keys (prefix-chained blake3 digests) and namespaces.
- ``kvtier.memory``: the pre-touched CPU slot pool.
- ``kvtier.tiers``: CPU and disk tiers, eviction policies.
- ``kvtier.storage``: the storage manager (lookup, leases, store/load), the entry point.
- ``kvtier.integrations``: engine connectors (vLLM v1).
- ``kvtier.demo``: the long-document QA demo on SmolLM2.
"""

from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature
from kvtier.storage.manager import LookupResult, StorageManager

__version__ = "0.1.0"

__all__ = [
    "ChunkHasher",
    "ConfigError",
    "KVTierConfig",
    "KeyNamespace",
    "LayoutSignature",
    "LookupResult",
    "StorageManager",
    "load_config",
]
