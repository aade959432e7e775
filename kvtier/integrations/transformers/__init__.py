"""kvtier for Hugging Face transformers: reuse stored prefixes in ``model.generate()``.

See :class:`~kvtier.integrations.transformers.engine.KVTierHF` and, for the key
namespace and payload layout, :mod:`~kvtier.integrations.transformers.layout`.
"""

from kvtier.integrations.transformers.engine import KVTierHF, PrefixLoad, open_store
from kvtier.integrations.transformers.layout import UnsupportedModel, check_transformers, hf_namespace
from kvtier.integrations.transformers.reference import cold_generate_split

__all__ = [
    "KVTierHF", "PrefixLoad", "UnsupportedModel", "check_transformers", "cold_generate_split", "hf_namespace", "open_store",
]
