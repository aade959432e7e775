"""``kvtier bench transfer``: each transfer channel against its physical baseline, side by side.

A sender process (multiprocessing ``spawn``, as a real peer is another process) holds
``chunks`` chunks of ``chunk_bytes`` random bytes: once in a shared segment (as chunks
live in ``kvtier server``'s pool) and once in private memory. This process receives
every batch into the same pre-touched destination buffers. Rounds are interleaved (ABBA,
one warm-up each, a :class:`~kvtier.bench.common.CacheEvictor` pass before every run)
and summarised by medians (see :mod:`kvtier.bench.common`). Each timed run starts when
this process tells the sender to go (a pipe message) and ends when the last chunk is in
its destination.

Figures (JSON keys, seconds per batch unless named ``_gbps``):

- ``shm_s`` / ``memcpy_s`` / ``shm_ratio`` (= memcpy_s / shm_s, target >= 0.8): the
  shared-memory channel from the sender's shared segment vs ``np.copyto`` of the same
  mapped bytes into the same destinations in this process.
  The receiver copies and verifies two chunks at a time (one on a helper thread; the
  sender, whose chunks lie in its shared pool, only writes small frames meanwhile).
- ``shm_inline_s`` / ``shm_inline_ratio`` (information): the same, with every chunk copied
  and verified on the receiving thread alone (``ShmChannel.overlap = False``).
- ``shm_staged_s`` / ``shm_staged_ratio`` (information): payloads in the sender's
  private memory (staged through the channel's ring: two copies, concurrent).
- ``tcp_s`` / ``raw_tcp_s`` / ``tcp_ratio`` (= raw_tcp_s / tcp_s, target >= 0.8): the TCP
  channel over loopback vs a raw loopback socket between the same two processes
  (``sendall`` of each payload, ``recv_into`` each destination; no headers, no checksums).
- ``nixl_s`` / ``nixl_raw_s`` / ``nixl_ratio`` (= nixl_raw_s / nixl_s, information: the NIXL
  channel is optional and has no target; it does not decide the exit code): the NIXL
  channel (UCX, CPU to CPU) vs NIXL's own READ of the same sender memory into the same
  destinations (no frames, no checksums); null with ``nixl_reason`` when NIXL is missing.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvtier.serde.base import byte_view
from kvtier.bench.common import (
    BenchUsageError,
    CacheEvictor,
    Check,
    gbps,
    interleaved,
    median,
    print_checks,
    write_json,
)

SHM_TARGET = 0.8
TCP_TARGET = 0.8
#: One 256-token chunk of SmolLM2-135M (bytes).
DEFAULT_CHUNK_BYTES = 5_898_240


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(4, "little") * 8 for i in range(n)]


def _sender_main(cmds: Any, shm_path: str, tcp_addr: tuple[str, int], raw_addr: tuple[str, int], nixl_port: int,
                 nchunks: int, chunk_bytes: int, timeout_s: float) -> None:
    """The sender process: serves each command (``shm``, ``staged``, ``tcp``, ``raw``, ``nixl``) until ``stop``."""
    import xxhash

    from kvtier.memory.shared_segment import SharedSegment
    from kvtier.transfer.shm import ShmChannel
    from kvtier.transfer.tcp import TcpChannel

    rng = np.random.default_rng(7)
    private = [rng.integers(0, 256, chunk_bytes, dtype=np.uint8) for _ in range(nchunks)]
    pool = SharedSegment.create(nchunks * chunk_bytes, name="kvtier-bench-pool")
    for i, p in enumerate(private):
        pool.array[i * chunk_bytes : (i + 1) * chunk_bytes] = p
    keys = _keys(nchunks)
    # Pool chunks carry the checksum taken at commit, as ``kvtier server`` records it (integrity.py).
    in_pool = [(k, v, xxhash.xxh3_64_intdigest(byte_view(v)))
               for k, v in ((k, pool.array[i * chunk_bytes : (i + 1) * chunk_bytes]) for i, k in enumerate(keys))]
    in_private = list(zip(keys, private))
    shm = ShmChannel.connect(shm_path, timeout_s, staging_bytes=max(4 * chunk_bytes, 64 << 20))
    shm.share_segment(pool)
    tcp = TcpChannel.connect(*tcp_addr, timeout_s=timeout_s)
    raw = socket.create_connection(raw_addr)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nixl = None
    cmds.send("ready")
    while (cmd := cmds.recv()) != "stop":
        if cmd == "shm":
            shm.send(in_pool)
        elif cmd == "staged":
            shm.send(in_private)
        elif cmd == "tcp":
            tcp.send(in_private)
        elif cmd == "nixl-connect" and nixl_port:  # only now: NIXL's progress threads stay out of the other rounds
            from kvtier.transfer.nixl import NixlChannel

            nixl = NixlChannel.connect("127.0.0.1", nixl_port, timeout_s)
            for p in private:
                nixl.register_region(p)
        elif cmd == "nixl" and nixl is not None:
            nixl.send(in_private)
        elif cmd == "raw":
            for p in private:
                raw.sendall(p)  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer on 3.12+ only
    for c in (shm, tcp, nixl):
        if c is not None:
            c.close()
    raw.close()
    pool.close()


def _nixl_listener(timeout_s: float) -> tuple[Any, str | None]:
    """A NIXL listener, or None and why not (NIXL missing or its backend cannot start)."""
    try:
        from kvtier.transfer.nixl_listener import NixlListener

        return NixlListener(timeout_s=timeout_s), None
    except Exception as exc:  # ChannelUnavailable, or a native failure
        return None, f"NIXL channel not measured: {exc}"


def _recv_raw(sock: socket.socket, dests: list[np.ndarray]) -> None:
    for d in dests:
        view, pos, n = byte_view(d), 0, d.nbytes
        while pos < n:
            got = sock.recv_into(view[pos:], n - pos)
            if not got:
                raise RuntimeError("bench transfer: the raw socket closed early")
            pos += got


def run_bench_transfer(json_path: Path | None = None, chunks: int = 16, chunk_mb: float = DEFAULT_CHUNK_BYTES / 1e6,
                       rounds: int = 7, enforce: bool = True, timeout_s: float = 60.0) -> int:
    """Measure, print the checks, write the JSON; 0 if every target is met (or not ``enforce``), else 1.

    Args:
        chunks: chunks per batch. chunk_mb: bytes per chunk / 10^6. rounds: interleaved timed rounds.

    Raises:
        BenchUsageError: a non-positive size or count.
    """
    if chunks < 1 or rounds < 1 or not chunk_mb > 0:
        raise BenchUsageError("--chunks and --rounds must be >= 1 and --chunk-mb > 0")
    from kvtier.transfer.shm_listener import ShmListener
    from kvtier.transfer.tcp import TcpListener

    chunk_bytes = max(1, int(chunk_mb * 1e6))
    keys = _keys(chunks)
    dests = [np.ones(chunk_bytes, dtype=np.uint8) for _ in range(chunks)]
    slots = list(zip(keys, dests))
    total = chunks * chunk_bytes
    nixl_l, nixl_reason = _nixl_listener(timeout_s)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    with ShmListener(timeout_s=timeout_s) as shm_l, TcpListener(timeout_s=timeout_s) as tcp_l, \
            socket.create_server(("127.0.0.1", 0)) as raw_l:
        child = ctx.Process(target=_sender_main, daemon=True, args=(
            theirs, shm_l.path, tcp_l.address, raw_l.getsockname()[:2], nixl_l.address[1] if nixl_l else 0,
            chunks, chunk_bytes, timeout_s))
        child.start()
        try:
            shm = shm_l.accept(timeout_s)
            tcp = tcp_l.accept(timeout_s)
            raw_l.settimeout(timeout_s)
            raw, _ = raw_l.accept()
            raw.settimeout(timeout_s)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not mine.poll(timeout_s) or mine.recv() != "ready":
                raise RuntimeError("bench transfer: the sender process did not start")

            def channel_run(cmd: str, chan: Any) -> Callable[[], float]:
                def run() -> float:
                    t0 = time.perf_counter()
                    mine.send(cmd)
                    got = chan.recv_into(slots)
                    dt = time.perf_counter() - t0
                    if not all(got):
                        raise RuntimeError(f"bench transfer: {cmd} lost chunks: {got}")
                    return dt
                return run

            def raw_run() -> float:
                t0 = time.perf_counter()
                mine.send("raw")
                _recv_raw(raw, dests)
                return time.perf_counter() - t0

            channel_run("shm", shm)()  # maps the sender's pool here
            src = shm.peer_segment(0)

            def memcpy_run() -> float:
                t0 = time.perf_counter()
                for i, d in enumerate(dests):
                    np.copyto(d, src[i * chunk_bytes : (i + 1) * chunk_bytes])
                return time.perf_counter() - t0

            evict = CacheEvictor()
            def shm_inline_run() -> float:
                shm.overlap = False
                try:
                    return channel_run("shm", shm)()
                finally:
                    shm.overlap = True

            shm_s = interleaved({"shm": channel_run("shm", shm), "memcpy": memcpy_run, "shm_inline": shm_inline_run},
                                rounds, evict)
            staged_s = interleaved({"staged": channel_run("staged", shm)}, rounds, evict)
            tcp_s = interleaved({"tcp": channel_run("tcp", tcp), "raw": raw_run}, rounds, evict)
            nixl_s: dict[str, list[float]] = {}
            nixl = None
            if nixl_l is not None:
                mine.send("nixl-connect")
                nixl = nixl_l.accept(timeout_s)
                channel_run("nixl", nixl)()  # learns the sender's addresses
                sources = nixl.last_sources

                def nixl_raw_run() -> float:
                    from kvtier.transfer.channel import Deadline

                    t0 = time.perf_counter()
                    nixl.read_raw(sources, Deadline(timeout_s))
                    return time.perf_counter() - t0

                nixl_s = interleaved({"nixl": channel_run("nixl", nixl), "nixl_raw": nixl_raw_run}, rounds, evict)
            mine.send("stop")
            child.join(timeout_s)
            for c in (shm, tcp, raw, nixl):
                if c is not None:
                    c.close()
        finally:
            if nixl_l is not None:
                nixl_l.close()
            if child.is_alive():
                child.kill()
                child.join(5)
    med = {n: median(v) for d in (shm_s, staged_s, tcp_s, nixl_s) for n, v in d.items()}
    result: dict[str, Any] = {
        "chunks": chunks, "chunk_bytes": chunk_bytes, "batch_bytes": total, "rounds": rounds,
        "shm_s": med["shm"], "memcpy_s": med["memcpy"], "shm_ratio": med["memcpy"] / med["shm"],
        "shm_inline_s": med["shm_inline"], "shm_inline_ratio": med["memcpy"] / med["shm_inline"],
        "shm_staged_s": med["staged"], "shm_staged_ratio": med["memcpy"] / med["staged"],
        "tcp_s": med["tcp"], "raw_tcp_s": med["raw"], "tcp_ratio": med["raw"] / med["tcp"],
        "nixl_ratio": med["nixl_raw"] / med["nixl"] if "nixl" in med else None,
        "nixl_s": med.get("nixl"), "nixl_raw_s": med.get("nixl_raw"), "nixl_reason": nixl_reason,
        **{f"{n}_gbps": gbps(total, s) for n, s in med.items()},
        # Every timed run (seconds, in run order) and each round's own memcpy/shm ratio: the spread.
        "samples_s": {n: v for d in (shm_s, staged_s, tcp_s, nixl_s) for n, v in d.items()},
        "shm_ratio_per_round": [m / x for m, x in zip(shm_s["memcpy"], shm_s["shm"])],
    }
    checks = [
        Check("shm channel / memcpy (bandwidth)", result["shm_ratio"], SHM_TARGET, True, "x",
              f"{result['shm_gbps']:.2f} vs {result['memcpy_gbps']:.2f} GB/s; one thread "
              f"{result['shm_inline_ratio']:.2f}x; staged "
              f"{result['staged_gbps']:.2f} GB/s ({result['shm_staged_ratio']:.2f}x)"),
        Check("tcp channel / raw loopback socket (bandwidth)", result["tcp_ratio"], TCP_TARGET, True, "x",
              f"{result['tcp_gbps']:.2f} vs {result['raw_gbps']:.2f} GB/s"),
    ]
    result["checks"] = {c.name: {"measured": c.measured, "target": c.target, "passed": c.passed} for c in checks}
    print_checks(f"kvtier bench transfer ({chunks} x {chunk_bytes:,} B, {rounds} rounds, medians)", checks)
    if result["nixl_ratio"] is not None:
        print(f"  info  nixl channel / NIXL's own READ (bandwidth): {result['nixl_ratio']:.2f}x "
              f"({result['nixl_gbps']:.2f} vs {result['nixl_raw_gbps']:.2f} GB/s; optional channel, no target)")
    else:
        print(f"  info  nixl channel: not measured ({nixl_reason})")
    write_json(json_path, result)
    return 0 if all(c.passed for c in checks) or not enforce else 1
