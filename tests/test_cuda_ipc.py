"""CUDA IPC for ``kvtier server``: the ``cuda_register`` message (CPU) and the real export/import (``cuda``)."""

from __future__ import annotations

import pytest
import torch

from kvtier import protocol as P
from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.service import cuda_ipc
from service_helpers import short_dir, start_server  # noqa: F401 (short_dir is a fixture)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")


def roundtrip(req: P.Request) -> P.Request:
    frame = P.encode_request(req, 3)
    return P.decode_request(P.unpack_body(frame[4:]))[1]


FULL = P.CudaRegister(b"\x01" * 64, 4096, "bfloat16", 1, offset=512, ref_counter_handle=b"/torch_123_4",
                      ref_counter_offset=8, event_handle=b"\x02" * 64, event_sync_required=True)


def test_full_message_round_trips_and_maps_to_torch_arguments() -> None:
    assert roundtrip(FULL) == FULL
    assert cuda_ipc.ipc_args(FULL) == (1, b"\x01" * 64, 4096, 512, b"/torch_123_4", 8, b"\x02" * 64, True)


def test_handle_only_message_still_parses_but_cannot_be_opened() -> None:
    body = {"v": P.PROTOCOL_VERSION, "op": "cuda_register", "id": 1, "handle": b"h" * 64, "size": 10, "dtype": "bf16", "device": 0}
    req = P.decode_request(body)[1]
    assert isinstance(req, P.CudaRegister) and req.offset == 0 and req.ref_counter_handle == b""
    with pytest.raises(ValueError, match="ref_counter_handle"):
        cuda_ipc.ipc_args(req)


@pytest.mark.parametrize("bad", [{"event_sync_required": 1}, {"ref_counter_handle": "s"}, {"offset": -1},
                                 {"event_handle": b"x" * 300}])
def test_ill_typed_ipc_fields_are_refused(bad: dict) -> None:
    body = {"v": P.PROTOCOL_VERSION, "op": "cuda_register", "id": 1, "handle": b"h" * 64, "size": 10, "dtype": "bf16", "device": 0}
    body.update(bad)
    with pytest.raises(ProtocolError) as e:
        P.decode_request(body)
    assert e.value.code == ErrorCode.BAD_MESSAGE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour of a host without CUDA")
def test_without_cuda_export_import_and_the_server_refuse_clearly(short_dir) -> None:  # noqa: F811
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        cuda_ipc.export_handle(torch.zeros(4))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        cuda_ipc.import_handle(FULL)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        cuda_ipc.register_host_memory(0, 4096)
    server = start_server(short_dir)
    try:
        with pytest.raises(ProtocolError) as e:
            server._cuda_register(FULL)
        assert e.value.code == ErrorCode.CUDA_UNAVAILABLE
    finally:
        server.close()


def _export_child(q: "torch.multiprocessing.Queue", done: "torch.multiprocessing.Event") -> None:  # pragma: no cover
    t = torch.arange(1024, dtype=torch.int32, device="cuda").view(torch.uint8)
    req = cuda_ipc.export_handle(t)
    q.put(req.fields_to_wire())
    done.wait(60)  # keep the allocation alive while the parent maps it


@pytest.mark.cuda
@needs_cuda
def test_real_cuda_ipc_export_in_one_process_import_in_another() -> None:
    ctx = torch.multiprocessing.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_export_child, args=(q, done))
    child.start()
    try:
        req = P.CudaRegister.from_fields(q.get(timeout=120))
        req = roundtrip(req)  # through the wire format
        mapped = cuda_ipc.import_handle(req)
        assert mapped.untyped_storage().nbytes() == req.size >= 4096
        got = mapped[req.offset : req.offset + 4096].view(torch.int32)
        assert torch.equal(got.cpu(), torch.arange(1024, dtype=torch.int32))
        del mapped, got
    finally:
        done.set()
        child.join(60)
