"""Value types of the vLLM connector (leaf module: no kvtier imports; vLLM optional).

The scheduler side builds a :class:`KVTierMetadata` per engine step; vLLM hands
it to the worker side, which copies the listed chunks between kvtier slots and
the engine's paged KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - the GPU copy path without vLLM (the device check)

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in base where vLLM is not installed: the copy path's value types
        (:class:`ChunkCopy`, :class:`TransferSpec`) are used without any connector."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stand-in base where vLLM is not installed (see :class:`KVConnectorMetadata`)."""


@dataclass
class ChunkCopy:
    """One chunk to move between a kvtier slot and engine blocks.

    ``block_ids`` are the engine blocks for the chunk's blocks ``offset ..
    blocks_per_chunk - 1`` (``offset > 0`` when vLLM already holds the first
    blocks of the chunk in its own prefix cache).
    """

    key: bytes
    block_ids: tuple[int, ...]
    offset: int = 0
    parent: bytes | None = None  # key of the previous chunk of the prompt
    #: hybrid models (several KV cache groups): groups 1.. block ids for the same positions as
    #: ``block_ids`` (group 0's); a load skips the null block (out of a sliding window). Empty: one group.
    more_blocks: tuple[tuple[int, ...], ...] = ()


@dataclass
class TransferSpec:
    """All chunk copies of one request in one step, in prompt order."""

    req_id: str
    chunks: list[ChunkCopy]
    is_async: bool = False  # load on a worker thread, report through get_finished


@dataclass
class StepBlocks:
    """Which engine blocks this step's forward reads and writes (a copy of vLLM's scheduler output).

    The worker mirrors every running request's block table from these deltas
    (:class:`~kvtier.integrations.vllm.validity.BlockValidity`) so it can tell
    which blocks hold KV computed over a failed load. Block ids are those of
    vLLM's single KV cache group.
    """

    tables: dict[str, list[int]] = field(default_factory=dict)  # new or resumed requests: whole block table
    appended: dict[str, list[int]] = field(default_factory=dict)  # blocks added to a known table
    gone: list[str] = field(default_factory=list)  # finished or preempted since the last step
    computing: dict[str, tuple[int, int]] = field(default_factory=dict)  # tokens [start, end) computed
    # Loads kvtier did not plan (another connector under vLLM's MultiConnector): blocks it
    # fills this step, unverified until its output; then failed (``invalid``) or ``verified``.
    unverified: list[int] = field(default_factory=list)
    invalid: list[int] = field(default_factory=list)  # vLLM's invalid blocks since the last step (any connector)
    verified: list[int] = field(default_factory=list)  # unverified blocks whose step reported no failure


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one per step: loads before the forward, saves after it."""

    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)
    blocks: StepBlocks | None = None  # None: nothing is saved (kv_role consumer, saving off)
    step: int = 0  # this step's number (the worker echoes it in KVTierWorkerMeta)
    pd_holds: list["PDHold"] = field(default_factory=list)  # PD prefill: hold these after they finish
    pd_releases: list[str] = field(default_factory=list)  # PD prefill: end these holds (aborted)
    idle: bool = False  # the step schedules no tokens: the engine only waits for async loads


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: which steps' forwards this output reports (``KVTierMetadata.step``)."""

    steps: tuple[int, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        steps = other.steps if isinstance(other, KVTierWorkerMeta) else ()
        return KVTierWorkerMeta(tuple(sorted(set(self.steps) | set(steps))))


@dataclass
class RequestHits:
    """Where one request's prompt tokens came from (the scheduler side's accounting).

    Attributes:
        prompt_tokens: tokens of the prompt.
        engine_hit_tokens: tokens the engine's own prefix cache already held at the
            last lookup (vLLM's ``num_computed_tokens`` then).
        kvtier_hit_tokens: tokens kvtier loaded into the engine (planned loads minus the
            blocks the worker reported failed).
        tiers: ``kvtier_hit_tokens`` split by the tier that served them ("cpu", "disk", ...).
        load_failures: loads of this request that reported failed blocks.
    """

    prompt_tokens: int
    engine_hit_tokens: int = 0
    kvtier_hit_tokens: int = 0
    tiers: dict[str, int] = field(default_factory=dict)
    load_failures: int = 0

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the engine computed itself (neither engine-held nor from kvtier)."""
        return max(0, self.prompt_tokens - self.engine_hit_tokens - self.kvtier_hit_tokens)

    def to_dict(self) -> dict[str, int | dict[str, int]]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "engine_hit_tokens": self.engine_hit_tokens,
            "kvtier_hit_tokens": self.kvtier_hit_tokens,
            "computed_tokens": self.computed_tokens,
            "tiers": dict(self.tiers),
            "load_failures": self.load_failures,
        }


@dataclass
class PDHold:
    """Prefiller scheduler -> worker: keep ``req_id``'s blocks after it finishes (PD, see ``pd.py``);
    ``keys`` are its stored chunks (full ones, then the partial one), leased while held;
    ``confirm_token`` the value a confirm must carry to end the hold (``kvtier_confirm``)."""

    req_id: str
    keys: list[bytes]
    confirm_token: str = ""
