"""What the SGLang backend needs that depends on SGLang being installed, plus tensor/byte views.

``HiCacheStorageBase`` is SGLang's ``HiCacheStorage`` where SGLang imports (its dynamic
loader checks ``issubclass``), else a stand-in with the one concrete method the backend
relies on (``register_mem_pool_host``), so the backend imports without SGLang.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

try:  # the real base class where SGLang is installed (its factory checks issubclass)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as HiCacheStorageBase

    SGLANG_BASE = True
except Exception:  # SGLang absent (CPU CI): same method names, no dependency
    SGLANG_BASE = False

    class HiCacheStorageBase:  # type: ignore[no-redef]
        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host



def as_tensor(buf: np.ndarray) -> torch.Tensor:
    """A uint8 tensor sharing ``buf`` (read-only buffers too: readers only copy out of it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(buf.reshape(-1))


def page_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as uint8 numpy (a view when contiguous on CPU)."""
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().reshape(-1)
