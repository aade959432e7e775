"""Local disk tier (a :class:`~kvtier.tiers.base.LowerTier`): one chunk record per file.

- :mod:`.tier`: :class:`DiskTier` (opening, queries, removal, closing), assembled from
  :mod:`.core` (fields, introspection, shared helpers), :mod:`.writes` (the write path)
  and :mod:`.reads` (the read path).
- :mod:`.record_io`: reading and writing one record file (checksummed as it goes).
- :mod:`.parallel`: the bounded pool of I/O threads of one batch.
- :mod:`.index`: the in-memory index and its prefix-closure invariant.
- :mod:`.scan`: the ownership lock and the index rebuild at open.
- :mod:`.fileops`: the file-system seam (:class:`FileOps`) and O_DIRECT helpers.

The record format is :mod:`kvtier.serde.record`.
"""

from kvtier.serde.record import ALIGN, HEADER_BYTES, SUFFIX, encode_payload_header, record_relpath
from kvtier.tiers.disk.fileops import FileOps
from kvtier.tiers.disk.scan import DiskTierLocked
from kvtier.tiers.disk.tier import MAX_READ_ERRORS, DiskTier

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "MAX_READ_ERRORS",
    "SUFFIX",
    "DiskTier",
    "DiskTierLocked",
    "FileOps",
    "encode_payload_header",
    "record_relpath",
]
