"""The kvtier control plane: every message that crosses a process boundary.

One package, one of each: framing (:mod:`.framing`), message types and
versioning (:mod:`.messages`: requests as msgspec structs of one tagged union),
their field types and bounds (:mod:`.fields`), the client's typed replies
(:mod:`.replies`), the tier-code table (:mod:`.tiers`, derived from
:data:`kvtier.storage.types.TIER_KINDS`), error codes (:mod:`.errors`; every
protocol error of kvtier derives from :class:`kvtier.errors.BaseProtocolError`), the
reconnect back-off (:mod:`.backoff`) and addresses/socket directories
(:mod:`.transport`). Spoken by the cache service (``kvtier server`` and
:class:`kvtier.service.client.ServiceClient`) and by an engine's
scheduler-to-worker lookup endpoint (:mod:`kvtier.service.lookup_endpoint`).
"""

from kvtier.protocol.backoff import Backoff
from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.protocol.fields import MAX_KEYS, MAX_NAME_CHARS, join_keys, namespace_from_wire, namespace_to_wire
from kvtier.protocol.framing import HEADER, MAX_ARRAY_LEN, MAX_FRAME_BYTES, pack, read_reply, recv_exact, unpack_body
from kvtier.protocol.envelope import Envelope, decode_request, decode_request_body, error_reply, ok_reply
from kvtier.protocol.messages import (
    ONE_WAY_OPS,
    PROTOCOL_VERSION,
    REQUESTS,
    Abort,
    Clear,
    Commit,
    Contains,
    CudaRegister,
    Flush,
    Health,
    KVRegister,
    KVRelease,
    Load,
    LoadBlocks,
    LoadMany,
    Lookup,
    Prefetch,
    Register,
    ReleaseLease,
    Request,
    Reserve,
    ReserveMany,
    ShmBuffer,
    Stats,
    StoreBlocks,
    Unload,
    encode_request,
)
from kvtier.protocol.tiers import TIER_CODES, TIER_NAMES, decode_tiers, encode_tiers
from kvtier.config_base import parse_address
from kvtier.protocol.transport import UnsafeSocketDir, check_socket_dir, make_socket_dir

__all__ = [
    "Abort", "Backoff", "Clear", "Commit", "Contains", "CudaRegister", "Envelope", "ErrorCode", "Flush", "HEADER",
    "Health", "KVRegister", "KVRelease", "Load", "LoadBlocks", "LoadMany", "Lookup", "MAX_ARRAY_LEN", "MAX_FRAME_BYTES", "MAX_KEYS", "MAX_NAME_CHARS", "ONE_WAY_OPS",
    "PROTOCOL_VERSION", "Prefetch", "ProtocolError", "REQUESTS", "Register", "ReleaseLease", "Request", "Reserve",
    "ReserveMany", "ShmBuffer", "Stats", "StoreBlocks", "TIER_CODES", "TIER_NAMES", "Unload", "UnsafeSocketDir", "check_socket_dir",
    "decode_request", "decode_request_body", "decode_tiers", "encode_request", "encode_tiers", "error_reply", "join_keys",
    "make_socket_dir", "namespace_from_wire", "namespace_to_wire", "ok_reply", "pack", "parse_address",
    "read_reply", "recv_exact", "unpack_body",
]
