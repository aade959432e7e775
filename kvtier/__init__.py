"""kvtier: tiered KV-cache storage for LLM inference engines.

The layers, lowest first (README, "Architecture"; ``tests/test_import_layers.py`` keeps them):
``index`` (chunk keys), ``memory`` (slot pools), ``serde`` (codecs, the chunk record), ``tiers``
(the CPU tier and every lower tier), ``config``, ``storage`` (the storage manager), ``protocol``
(the control plane's messages), ``transfer`` / ``fleet`` / ``controller`` / ``events`` /
``dashboard``, ``service`` (the cache service) and ``router``, ``integrations`` (engine
connectors), ``runtime`` (the composition root that assembles tiers, pools and peer servers),
then ``demo``, ``bench``, ``sim``, ``testing`` and the CLI.

Importing ``kvtier`` imports nothing else: import the module you use.
"""

from kvtier.version import __version__

__all__ = ["__version__"]
