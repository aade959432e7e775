"""kvtier as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

See :class:`~kvtier.integrations.sglang.backend.KVTierHiCacheStorage`. Importing this
package does not need SGLang; where SGLang is installed the class subclasses SGLang's
``HiCacheStorage``.
"""

from kvtier.integrations.sglang.backend import SGLANG_BASE, KVTierHiCacheStorage
from kvtier.integrations.sglang.namespace import PageKeys, namespace_for_pool

__all__ = ["SGLANG_BASE", "KVTierHiCacheStorage", "PageKeys", "namespace_for_pool"]
