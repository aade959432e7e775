"""NUMA placement of the CPU tier's memory: set a policy on a mapping before its pages are touched,
then check where a sample of its pages landed.

Mechanism (Linux ``mbind(2)``, ``get_mempolicy(2)``, ``move_pages(2)``), called through ``ctypes``
as raw system calls, so libnuma need not be installed:

- :func:`bind` sets the range's policy (``MPOL_BIND`` / ``MPOL_PREFERRED`` /
  ``MPOL_INTERLEAVE`` from a :class:`~kvtier.memory.numa_topology.Placement`) with
  ``MPOL_MF_MOVE`` (pages already there move too). The pool calls it on fresh memory
  before pre-touching it, so every page is allocated on the chosen node(s).
- :func:`policy_of` reads the policy back (``get_mempolicy`` with ``MPOL_F_ADDR``).
- :func:`nodes_of_pages` asks ``move_pages`` (no move: ``nodes = NULL``) the node of
  up to ``sample`` evenly spaced pages.

:func:`place` does all three and returns a :class:`NumaReport` (logged at start,
kept in the tier's stats as ``cpu_numa_node``, ``cpu_numa_mode``,
``cpu_numa_pages_on_node``). Where the calls are missing (not Linux, another
architecture, a seccomp filter) an ``auto`` placement becomes a warning and no
policy; an explicit node raises :class:`NumaUnavailable`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kvtier.memory.numa_topology import Placement

log = logging.getLogger("kvtier.memory.numa")

#: System call numbers: (mbind, get_mempolicy, move_pages, set_mempolicy) per machine (asm/unistd.h).
_SYSCALLS = {"x86_64": (237, 239, 279, 238), "aarch64": (235, 236, 239, 237), "arm64": (235, 236, 239, 237)}
#: linux/mempolicy.h
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 0, 1, 2, 3
MPOL_F_ADDR = 1 << 1
MPOL_MF_MOVE = 1 << 1
_MODES = {"bind": MPOL_BIND, "preferred": MPOL_PREFERRED, "interleave": MPOL_INTERLEAVE}
MODE_NAMES = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind", MPOL_INTERLEAVE: "interleave"}
#: Nodes a node mask covers (bits); more than any machine kvtier runs on.
MAX_NODES = 1024
_PAGE = mmap.PAGESIZE


class NumaUnavailable(OSError):
    """The placement cannot be applied here (no such system call, or the kernel refused it)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _numbers() -> tuple[int, int, int, int]:
    nums = _SYSCALLS.get(platform.machine())
    if not sys.platform.startswith("linux") or nums is None:
        raise NumaUnavailable(errno.ENOSYS, f"NUMA system calls are not known on {sys.platform}/{platform.machine()}")
    return nums


def _mask(nodes: tuple[int, ...]) -> ctypes.Array[ctypes.c_ulong]:
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    arr = (ctypes.c_ulong * (MAX_NODES // bits))()
    for n in nodes:
        if not 0 <= n < MAX_NODES:
            raise ValueError(f"NUMA node {n} outside 0..{MAX_NODES - 1}")
        arr[n // bits] |= 1 << (n % bits)
    return arr


def _span(addr: int, length: int) -> tuple[int, int]:
    """The whole pages inside ``[addr, addr + length)``: (page-aligned start, length)."""
    start = -(-addr // _PAGE) * _PAGE
    end = (addr + length) // _PAGE * _PAGE
    return start, max(0, end - start)


def bind(addr: int, length: int, placement: Placement) -> None:
    """Set ``placement``'s policy on the whole pages of ``[addr, addr + length)`` (no-op for ``none``).

    Raises:
        NumaUnavailable: the kernel refused it (errno in the exception) or the call is unknown here.
    """
    if placement.mode == "none":
        return
    nr_mbind = _numbers()[0]
    start, n = _span(addr, length)
    if n == 0:
        return
    mask = _mask(placement.nodes)
    libc = _libc()
    rc = libc.syscall(ctypes.c_long(nr_mbind), ctypes.c_void_p(start), ctypes.c_ulong(n),
                      ctypes.c_int(_MODES[placement.mode]), mask, ctypes.c_ulong(MAX_NODES + 1),
                      ctypes.c_uint(MPOL_MF_MOVE))
    if rc != 0:
        e = ctypes.get_errno()
        raise NumaUnavailable(e, f"mbind({placement.mode} {list(placement.nodes)}): {os.strerror(e)}")


def policy_of(addr: int) -> tuple[str, tuple[int, ...]]:
    """(mode name, nodes) of the policy on the page holding ``addr`` (``get_mempolicy``, ``MPOL_F_ADDR``).

    Raises:
        NumaUnavailable: the call failed or is unknown here.
    """
    nr_get = _numbers()[1]
    mode = ctypes.c_int(0)
    mask = _mask(())
    rc = _libc().syscall(ctypes.c_long(nr_get), ctypes.byref(mode), mask, ctypes.c_ulong(MAX_NODES + 1),
                         ctypes.c_void_p(addr // _PAGE * _PAGE), ctypes.c_ulong(MPOL_F_ADDR))
    if rc != 0:
        e = ctypes.get_errno()
        raise NumaUnavailable(e, f"get_mempolicy: {os.strerror(e)}")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    nodes = tuple(i for i in range(MAX_NODES) if mask[i // bits] >> (i % bits) & 1)
    return MODE_NAMES.get(mode.value & 0xFF, str(mode.value)), nodes


def nodes_of_pages(addr: int, length: int, sample: int = 64) -> list[int]:
    """The NUMA node of up to ``sample`` evenly spaced pages of the range (``move_pages`` query).

    A page not backed yet reports ``-errno.ENOENT`` (a negative errno, as the kernel gives it).

    Raises:
        NumaUnavailable: the call failed or is unknown here.
    """
    nr_move = _numbers()[2]
    start, n = _span(addr, length)
    pages = n // _PAGE
    if pages == 0 or sample <= 0:
        return []
    k = min(sample, pages)
    addrs = (ctypes.c_void_p * k)(*[start + (i * pages // k) * _PAGE for i in range(k)])
    status = (ctypes.c_int * k)()
    rc = _libc().syscall(ctypes.c_long(nr_move), ctypes.c_int(0), ctypes.c_ulong(k), addrs, None, status,
                         ctypes.c_int(0))
    if rc != 0:
        e = ctypes.get_errno()
        raise NumaUnavailable(e, f"move_pages: {os.strerror(e)}")
    return list(status)


@contextlib.contextmanager
def thread_policy(placement: Placement | None) -> Iterator[None]:
    """This thread's memory policy is ``placement``'s inside the block (``set_mempolicy``), the
    previous one after: for memory touched as it is allocated (CUDA pinned host memory).
    A no-op for None / ``none``, or where the calls are unavailable (logged)."""
    if placement is None or placement.mode == "none":
        yield
        return
    try:
        nr_get, nr_set = _numbers()[1], _numbers()[3]
    except NumaUnavailable as exc:
        log.warning("kvtier CPU tier: thread NUMA policy not set: %s", exc.strerror or exc)
        yield
        return
    libc = _libc()
    old_mode, old_mask = ctypes.c_int(0), _mask(())
    saved = libc.syscall(ctypes.c_long(nr_get), ctypes.byref(old_mode), old_mask, ctypes.c_ulong(MAX_NODES + 1),
                         None, ctypes.c_ulong(0)) == 0
    mask = _mask(placement.nodes)
    if libc.syscall(ctypes.c_long(nr_set), ctypes.c_int(_MODES[placement.mode]), mask,
                    ctypes.c_ulong(MAX_NODES + 1)) != 0:
        log.warning("kvtier CPU tier: set_mempolicy: %s", os.strerror(ctypes.get_errno()))
        yield
        return
    try:
        yield
    finally:
        mode, m = (old_mode.value, old_mask) if saved else (MPOL_DEFAULT, _mask(()))
        libc.syscall(ctypes.c_long(nr_set), ctypes.c_int(mode), m, ctypes.c_ulong(MAX_NODES + 1))


@dataclass
class NumaReport:
    """What :func:`place` did: the placement, the policy read back and the sampled pages' nodes."""

    placement: Placement
    applied: bool = False
    policy: str = "default"
    pages: list[int] = field(default_factory=list)
    error: str = ""
    span: tuple[int, int, int] = (0, 0, 0)  # (address, length, sample) checked

    @property
    def on_node(self) -> float:
        """Share of the sampled backed pages on the placement's node(s) (1.0 with no placement or
        no page backed yet, as in a sparse segment before its first store)."""
        backed = [p for p in self.pages if p >= 0]
        if self.placement.mode == "none" or not backed:
            return 1.0 if self.placement.mode == "none" or self.applied else 0.0
        return sum(p in self.placement.nodes for p in backed) / len(backed)

    def refresh(self) -> None:
        """Sample the pages again (a sparse segment's are backed as chunks arrive); errors keep the last."""
        addr, length, sample = self.span
        if self.applied and length:
            try:
                self.pages = nodes_of_pages(addr, length, sample)
            except NumaUnavailable:
                pass

    def stats(self) -> dict[str, int | float]:
        """Metrics (pages sampled again): ``cpu_numa_node`` (-1: none or interleaved), ``cpu_numa_bound``
        (1 if the policy is on the memory), ``cpu_numa_pages_on_node`` (share of sampled backed pages on
        the chosen node(s))."""
        self.refresh()
        return {"cpu_numa_node": self.placement.node, "cpu_numa_bound": int(self.applied),
                "cpu_numa_pages_on_node": round(self.on_node, 4)}

    def describe(self) -> str:
        if self.error:
            return f"{self.placement.describe()}: not applied ({self.error})"
        if self.placement.mode == "none":
            return self.placement.describe()
        backed = [p for p in self.pages if p >= 0]
        return (f"{self.placement.describe()}; policy {self.policy}; {sum(p in self.placement.nodes for p in backed)}"
                f" of {len(backed)} sampled pages there")


def place(addr: int, length: int, placement: Placement, touch: Callable[[], None] | None = None,
          sample: int = 64) -> NumaReport:
    """Apply ``placement`` to the range, run ``touch`` (the caller's pre-touch), then verify.

    ``touch`` runs whether or not the policy could be set. An explicit node (``bind``) that
    cannot be applied raises; ``auto`` (``preferred``) and ``interleave`` log a warning.

    Raises:
        NumaUnavailable: a ``bind`` placement the kernel refused.
    """
    rep = NumaReport(placement, span=(addr, length, sample))
    try:
        bind(addr, length, placement)
        rep.applied = placement.mode != "none"
    except NumaUnavailable as exc:
        if placement.mode == "bind":
            raise NumaUnavailable(exc.errno, f"kvtier CPU tier: cannot bind to NUMA node {placement.node}: "
                                             f"{exc.strerror or exc}") from None
        rep.error = str(exc.strerror or exc)
        log.warning("kvtier CPU tier: %s", rep.describe())
    if touch is not None:
        touch()
    if rep.applied:
        try:
            start, _ = _span(addr, length)
            rep.policy = policy_of(start)[0]
            rep.pages = nodes_of_pages(addr, length, sample)
        except NumaUnavailable as exc:
            rep.error = f"verification failed: {exc.strerror or exc}"
    return rep
