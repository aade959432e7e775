"""The fleet control plane: messages between a kvtier instance's agent and the controller.

Transport: ZeroMQ. The controller binds a ``ROUTER`` socket (``tcp://host:port``);
every instance (an embedded connector's worker, a ``kvtier server`` process) runs an
agent with one ``DEALER`` socket connected to it, its ZMQ identity set to the
instance id. Every frame is one msgpack document, a tagged union encoded with
msgspec (``{"type": "<tag>", ...fields}``); bytes fields are msgpack binaries.
Chunk keys are the kvtier chunk keys (:mod:`kvtier.index.keys`, 32 bytes): the
controller computes the same keys from tokens with the instance's registered
:class:`~kvtier.index.keys.KeyNamespace`, so there is one hash scheme fleet-wide.

Agent -> controller
-------------------
``Register``   on start and whenever the controller does not know it (``Ack.known``
               false): who it is, its namespaces and tiers, and (``peer_url``, optional)
               the URL its peer server listens on (``peer_listen`` with the real port).
               A new ``epoch`` (random per process start) tells the controller the
               instance restarted: its old index is dropped.
``Snapshot``   the full index of one (namespace, tier), in parts; the controller swaps
               it in when the part with ``last=True`` arrives (``resync_id`` ties parts).
``Changes``    admitted/removed/cleared chunks since the last ``Changes``, numbered by
               ``seq`` (1, 2, 3... per epoch). A gap (a lost message) makes the
               controller ask for a resync.
``Heartbeat``  every ``heartbeat_s`` (default 0.25 s): carries the last ``seq`` sent so a
               lost final ``Changes`` is noticed within one heartbeat.
``OpResult``   the outcome of an ``OpRequest``.

Controller -> agent
-------------------
``Ack``        reply to ``Register`` and ``Heartbeat``: ``known`` false asks the agent to
               register again (a restarted controller); ``resync`` true asks for a full
               ``Snapshot`` (a gap was seen).
``OpRequest``  run one operation (:data:`OPS`) and answer with ``OpResult``.

Invariant kept by the pair: after the agent's last ``Changes``/``Snapshot`` is applied
the controller's index for that instance equals the instance's tier state; every
message loss is detected by ``seq`` (in ``Changes`` and ``Heartbeat``) and repaired by a
``Snapshot``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from kvtier.errors import BaseProtocolError
from kvtier.protocol.decoding import decode

#: Version of this message set; a ``Register`` with another version is refused.
FLEET_PROTOCOL_VERSION = 1
#: Default agent heartbeat period (seconds).
DEFAULT_HEARTBEAT_S = 0.25
#: The controller forgets an instance silent for this long (seconds).
DEFAULT_EXPIRY_S = 0.9
#: Most keys in one ``Snapshot`` part or ``Changes`` entry.
MAX_KEYS_PER_PART = 65536
#: Operations an ``OpRequest`` may ask for (args documented in :mod:`kvtier.storage.instance_ops`).
OPS = ("clear", "delete", "pin", "unpin", "move_local", "export", "import", "compress",
       "decompress", "verify", "health", "stats")
#: Parent "none" in the ``parents`` binary of a Snapshot/Changes (32 zero bytes).
NO_PARENT = b"\x00" * 32

# -- bounds on what an agent may send (issue 24: every size a peer chooses is bounded) -------------
#: Most namespaces one ``Register`` may carry (a ``kvtier server`` hosts at most 8 by default).
MAX_NAMESPACES = 64
#: Most tiers one ``Register`` may carry.
MAX_TIERS = 16
#: Longest namespace spec (canonical JSON, bytes).
MAX_SPEC_BYTES = 4096
#: Most entries of one ``Changes`` message (each at most ``MAX_KEYS_PER_PART`` keys).
MAX_CHANGES = 1024
#: Largest encoded ``Heartbeat`` whose health report is kept (bytes); a larger one only counts as a sign of life.
MAX_HEALTH_BYTES = 64 << 10
#: Largest message the controller's and the agents' sockets accept (``ZMQ_MAXMSGSIZE``): a full
#: ``Snapshot`` part is 65536 keys and parents (4 MiB) plus its pinned keys.
MAX_MESSAGE_BYTES = 16 << 20

_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
_Short = Annotated[str, msgspec.Meta(max_length=255)]
_Digest = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
_KeyBlob = Annotated[bytes, msgspec.Meta(max_length=MAX_KEYS_PER_PART * 32)]


class NamespaceInfo(msgspec.Struct, frozen=True):
    """One key namespace an instance stores.

    Attributes:
        digest: ``KeyNamespace.digest()`` (32 bytes).
        spec: ``KeyNamespace.canonical_bytes()`` (JSON, UTF-8): enough to rebuild the
            namespace and compute its chunk keys from tokens.
        chunk_size: tokens per chunk.
        chunk_bytes: payload bytes per chunk.
    """

    digest: _Digest
    spec: Annotated[bytes, msgspec.Meta(max_length=MAX_SPEC_BYTES)]
    chunk_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 34)]


class TierInfo(msgspec.Struct, frozen=True):
    """One tier of an instance: ``kind`` in ``TIER_KINDS``, ``name`` (e.g. ``redis://h:6379/0``),
    ``capacity_bytes`` (0: unbounded or unknown), ``shared`` (True: other instances see the same
    store, e.g. Redis or a shared filesystem)."""

    kind: _Short
    name: Annotated[str, msgspec.Meta(max_length=1024)]
    capacity_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    shared: bool = False


class Register(msgspec.Struct, tag="register", frozen=True):
    instance: _Id
    epoch: _Short
    version: int
    role: Literal["embedded", "server"]
    host: _Short
    pid: int
    namespaces: Annotated[list[NamespaceInfo], msgspec.Meta(max_length=MAX_NAMESPACES)]
    tiers: Annotated[list[TierInfo], msgspec.Meta(max_length=MAX_TIERS)]
    token: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    #: The instance's peer server URL (``tcp://HOST:PORT``, ``shm:///PATH``, ``nixl://HOST:PORT``); "" when
    #: it serves no peers. Added compatibly: older agents omit it, older controllers ignore it.
    peer_url: str = ""


class Snapshot(msgspec.Struct, tag="snapshot", frozen=True):
    """Part of a full index resync of one (namespace, tier).

    ``keys`` is ``n * 32`` bytes; ``parents`` is ``n * 32`` bytes (:data:`NO_PARENT` where none).
    ``pinned`` lists keys (``m * 32`` bytes) pinned on the instance.
    """

    instance: _Id
    epoch: _Short
    resync_id: int
    namespace: _Digest
    tier: Annotated[str, msgspec.Meta(max_length=1024)]
    keys: _KeyBlob
    parents: _KeyBlob
    last: bool
    #: ``seq`` of the last ``Changes`` folded into this snapshot (changes after it follow).
    seq: int = 0
    pinned: _KeyBlob = b""


class Change(msgspec.Struct, frozen=True, array_like=True):
    """``op``: ``"s"`` stored, ``"r"`` removed, ``"c"`` tier cleared (``keys`` empty)."""

    op: Literal["s", "r", "c"]
    namespace: _Digest
    tier: Annotated[str, msgspec.Meta(max_length=1024)]
    keys: _KeyBlob = b""
    parents: _KeyBlob = b""


class Changes(msgspec.Struct, tag="changes", frozen=True):
    instance: _Id
    epoch: _Short
    seq: int
    changes: Annotated[list[Change], msgspec.Meta(max_length=MAX_CHANGES)]


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    instance: _Id
    epoch: _Short
    seq: int
    #: Per-tier health, as :meth:`kvtier.storage.instance_ops.InstanceOps.health` returns it.
    health: dict[str, Any] = {}


class OpResult(msgspec.Struct, tag="op_result", frozen=True):
    op_id: _Short
    ok: bool
    result: dict[str, Any] = {}
    error: str = ""


class Ack(msgspec.Struct, tag="ack", frozen=True):
    controller_epoch: str
    known: bool
    resync: bool = False
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    #: Why the controller refused the ``Register`` this answers (``known`` is then False): a
    #: missing or wrong token, another protocol version, a bad tier; "" otherwise.
    refused: str = ""
    #: With ``refused``: seconds after which registering again may succeed (the id is held by a live
    #: connection that may be this instance's previous one); 0: the agent's own back-off.
    retry_s: float = 0.0


class OpRequest(msgspec.Struct, tag="op", frozen=True):
    op_id: str
    op: str
    namespace: bytes
    args: dict[str, Any] = {}
    #: Unused (older controllers sent an absolute wall-clock deadline; clocks of two machines differ).
    deadline: float = 0.0
    #: The agent answers ``ok=False, error="deadline"`` this many seconds after it received the request
    #: (its own monotonic clock); 0: no deadline of its own.
    timeout_s: float = 0.0


class PeerLocation(msgspec.Struct, frozen=True):
    """One live instance that serves peers, in a ``POST /locate`` reply (JSON).

    Attributes:
        instance: its id at the controller.
        peer_url: the URL its peer server listens on.
        chunks: leading asked keys its local tiers (CPU, disk) hold, per the controller's index.
        key: the Z85 public key it authenticated with (the asker's peer tier requires the peer server
            at ``peer_url`` to prove it); "" for a same-user ``shm://`` peer of an open controller.
    """

    instance: str
    peer_url: str
    chunks: int
    key: str = ""


class LocateReply(msgspec.Struct, frozen=True):
    """The controller's ``POST /locate`` answer: every live instance with a peer URL in the asked
    namespace (the asker excluded), longest run first; ``chunks`` may be 0."""

    namespace: str
    instances: list[PeerLocation]


#: Most keys one ``POST /locate`` may ask about.
MAX_LOCATE_KEYS = 4096
#: Longest ``Register.peer_url`` the controller accepts (characters).
MAX_PEER_URL = 1024
#: Schemes a ``Register.peer_url`` may use (:mod:`kvtier.transfer.urls`).
PEER_URL_SCHEMES = ("tcp", "shm", "nixl")


AgentMessage = Union[Register, Snapshot, Changes, Heartbeat, OpResult]
ControllerMessage = Union[Ack, OpRequest]

_ENCODER = msgspec.msgpack.Encoder()
_AGENT_DECODER = msgspec.msgpack.Decoder(AgentMessage)
_CONTROLLER_DECODER = msgspec.msgpack.Decoder(ControllerMessage)


class FleetProtocolError(BaseProtocolError, ValueError):
    """A frame that is not a valid fleet message (the receiver drops it and counts it)."""


def encode(msg: AgentMessage | ControllerMessage) -> bytes:
    """msgpack bytes of one message."""
    return _ENCODER.encode(msg)


def decode_agent_message(frame: bytes) -> AgentMessage:
    """Decode a frame an agent sent.

    Raises:
        FleetProtocolError: not msgpack, unknown ``type``, or a field of the wrong type.
    """
    try:
        return decode(_AGENT_DECODER, frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FleetProtocolError(f"malformed agent message: {exc}") from exc


def decode_controller_message(frame: bytes) -> ControllerMessage:
    """Decode a frame the controller sent.

    Raises:
        FleetProtocolError: not msgpack, unknown ``type``, or a field of the wrong type.
    """
    try:
        return decode(_CONTROLLER_DECODER, frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FleetProtocolError(f"malformed controller message: {exc}") from exc


def split_keys(blob: bytes) -> list[bytes]:
    """The 32-byte keys of a ``keys``/``parents``/``pinned`` binary.

    Raises:
        FleetProtocolError: the length is not a multiple of 32.
    """
    if len(blob) % 32:
        raise FleetProtocolError(f"key list of {len(blob)} bytes is not a multiple of 32")
    return [blob[i : i + 32] for i in range(0, len(blob), 32)]


def join_parents(parents: list[bytes | None]) -> bytes:
    """The ``parents`` binary of a list of parents (None -> :data:`NO_PARENT`)."""
    return b"".join(NO_PARENT if p is None else p for p in parents)
