"""Value types of the vLLM connector (leaf module: no kvtier imports; vLLM optional).

The scheduler side builds a :class:`KVTierMetadata` per engine step; vLLM hands
it to the worker side, which copies the listed chunks between kvtier slots and
the engine's paged KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # pragma: no cover - the GPU copy path without vLLM (the device check)

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in base where vLLM is not installed: the copy path's value types
        (:class:`ChunkCopy`, :class:`TransferSpec`) are used without any connector."""


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


@dataclass
class TransferSpec:
    """All chunk copies of one request in one step, in prompt order."""

    req_id: str
    chunks: list[ChunkCopy]
    is_async: bool = False  # load on a worker thread, report through get_finished


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one per step: loads before the forward, saves after it."""

    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)
    pd_holds: list["PDHold"] = field(default_factory=list)  # PD prefill: hold these after they finish
    pd_releases: list[str] = field(default_factory=list)  # PD prefill: end these holds (aborted)
    idle: bool = False  # the step schedules no tokens: the engine only waits for async loads


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
