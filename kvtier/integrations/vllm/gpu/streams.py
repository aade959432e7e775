"""Copy streams: a dedicated CUDA stream with events, or a synchronous stand-in on CPU.

Both satisfy :class:`CopyStream`, so the layer-wise loader/saver
(:mod:`.layerwise`) has one code path; tests drive it with a recording fake.
Semantics follow CUDA's: work given to ``run`` is ordered on the copy stream;
``wait_compute`` orders it after the compute stream's work issued so far;
``record`` returns an event that completes when the copy work issued so far
has; ``Event.block_compute`` makes the compute stream wait for that event
without blocking the host (``cudaStreamWaitEvent``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch


class CopyEvent(Protocol):
    def block_compute(self) -> None:
        """Order the compute stream's later work after this event (host does not wait)."""

    def synchronize(self) -> None:
        """Block the host until the event's work is done."""


class CopyStream(Protocol):
    def run(self, work: Callable[[], None]) -> None:
        """Issue ``work``'s copies on this stream."""

    def wait_compute(self) -> None:
        """Order this stream's later work after the compute stream's work so far."""

    def record(self) -> CopyEvent:
        """An event marking this stream's work so far."""


class _DoneEvent:
    def block_compute(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


class SyncStream:
    """The CPU path: work runs at once on the calling thread; every event is complete."""

    def run(self, work: Callable[[], None]) -> None:
        work()

    def wait_compute(self) -> None:
        return None

    def record(self) -> CopyEvent:
        return _DoneEvent()


class _CudaEvent:
    def __init__(self, event: "torch.cuda.Event", device: "torch.device"):
        self._event = event
        self._device = device

    def block_compute(self) -> None:
        import torch

        torch.cuda.current_stream(self._device).wait_event(self._event)

    def synchronize(self) -> None:
        self._event.synchronize()


class CudaStream:
    """A dedicated ``torch.cuda.Stream`` on ``device`` for KV copies (needs CUDA)."""

    def __init__(self, device: "torch.device"):
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def run(self, work: Callable[[], None]) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            work()

    def wait_compute(self) -> None:
        import torch

        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self) -> CopyEvent:
        import torch

        event = torch.cuda.Event()
        event.record(self.stream)
        return _CudaEvent(event, self.device)


def stream_for(device: "torch.device") -> CopyStream:
    """A :class:`CudaStream` for a CUDA device, else a :class:`SyncStream`."""
    return CudaStream(device) if device.type == "cuda" else SyncStream()
