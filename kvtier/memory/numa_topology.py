"""Which NUMA node the CPU tier's memory should live on (selection only; the mechanism is :mod:`.numa`).

The setting ``cpu_numa_node`` (:class:`~kvtier.config.KVTierConfig`) is one of:

- ``auto`` (default; *preferred*: the kernel falls back to another node when this one is
  full, never an allocation failure at start): the node holding every CPU this process may run on
  (``sched_getaffinity``: an engine bound to its cores, e.g. vLLM's CPU backend
  with ``VLLM_CPU_OMP_THREADS_BIND``, or a machine with one node); else the node
  of the GPU's PCI device (``/sys/bus/pci/devices/<bus id>/numa_node``, as LMCache's
  ``numa_mode: auto``); else none (the kernel's default, first-touch placement).
- a node number (``"1"``): bound to that node (*bind*: the operator's choice is kept, and a
  node without room fails the start-up allocation); a node this machine does not have is an error.
- ``interleave``: pages spread round-robin over every node with memory.
- ``none``: no policy (the kernel's default).

The topology is read from sysfs (``<root>/devices/system/node/node<N>/cpulist``,
``<root>/devices/system/node/has_memory``); ``root`` is injectable so tests can
describe a two-node machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Literal

#: Accepted forms of ``cpu_numa_node``.
SETTING_FORMS = "auto, none, interleave, or a node number such as 0"
_NODE_DIR = re.compile(r"node(\d+)")

Mode = Literal["none", "bind", "preferred", "interleave"]


class NumaError(ValueError):
    """A ``cpu_numa_node`` this machine cannot honour (unknown form, or a node it does not have)."""


def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11} (sysfs list format; empty text: empty set).

    Raises:
        ValueError: malformed list.
    """
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(a, b + 1))
    return frozenset(out)


def _fmt(nodes: AbstractSet[int]) -> str:
    return ",".join(str(n) for n in sorted(nodes)) or "none"


@dataclass(frozen=True)
class Topology:
    """NUMA nodes of a machine: node -> its CPUs, and the nodes that have memory."""

    cpus: dict[int, frozenset[int]]
    memory_nodes: frozenset[int]
    root: Path = field(default=Path("/sys"))

    @classmethod
    def read(cls, root: str | os.PathLike[str] = "/sys") -> "Topology":
        """The topology under ``root`` (a machine without NUMA sysfs: one node 0 with every CPU)."""
        base = Path(root) / "devices" / "system" / "node"
        cpus: dict[int, frozenset[int]] = {}
        try:
            entries = list(base.iterdir())
        except OSError:
            entries = []
        for d in entries:
            m = _NODE_DIR.fullmatch(d.name)
            if m:
                try:
                    cpus[int(m.group(1))] = parse_cpulist((d / "cpulist").read_text())
                except (OSError, ValueError):
                    cpus[int(m.group(1))] = frozenset()
        if not cpus:
            cpus = {0: frozenset(range(os.cpu_count() or 1))}
        try:
            mem = parse_cpulist((base / "has_memory").read_text()) & frozenset(cpus)
        except (OSError, ValueError):
            mem = frozenset(cpus)
        return cls(cpus, mem or frozenset(cpus), Path(root))

    @property
    def nodes(self) -> frozenset[int]:
        return frozenset(self.cpus)

    def node_of_cpus(self, cpus: AbstractSet[int]) -> int | None:
        """The one node holding every CPU in ``cpus`` (None: they span nodes, or none is known)."""
        found = {n for n, cs in self.cpus.items() if cs & cpus}
        known = frozenset().union(*self.cpus.values())
        return next(iter(found)) if len(found) == 1 and cpus <= known else None

    def node_of_pci(self, bus_id: str) -> int | None:
        """NUMA node of PCI device ``bus_id`` (``0000:3b:00.0``); None when unknown (-1) or absent."""
        try:
            n = int((self.root / "bus" / "pci" / "devices" / bus_id.lower() / "numa_node").read_text())
        except (OSError, ValueError):
            return None
        return n if n in self.nodes else None


@dataclass(frozen=True)
class Placement:
    """Where the pool's pages go: ``mode`` and ``nodes``, and why (for the start-up log and metrics)."""

    mode: Mode
    nodes: tuple[int, ...] = ()
    reason: str = ""

    @property
    def node(self) -> int:
        """The one node of a bind/preferred placement; -1 otherwise (metrics)."""
        return self.nodes[0] if self.mode in ("bind", "preferred") and self.nodes else -1

    def describe(self) -> str:
        if self.mode == "none":
            return f"no NUMA placement ({self.reason})"
        what = "interleaved over nodes" if self.mode == "interleave" else "on NUMA node"
        return f"{what} {_fmt(set(self.nodes))} ({self.reason})"


def gpu_pci_bus_id() -> str | None:
    """The current CUDA device's PCI bus id (``0000:3b:00.0``) when torch is loaded and sees a GPU."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:  # noqa: BLE001 - no GPU information: auto falls back
        return None


def choose(
    setting: str | int | None,
    topology: Topology | None = None,
    cpus: AbstractSet[int] | None = None,
    gpu_bus_id: str | None = None,
) -> Placement:
    """The placement ``setting`` (see module doc) asks for on ``topology``.

    Args:
        setting: ``cpu_numa_node``'s value (None: ``auto``).
        topology: default :meth:`Topology.read` of ``/sys``.
        cpus: the CPUs this process may run on (default ``os.sched_getaffinity(0)``).
        gpu_bus_id: the engine's GPU PCI bus id (default: asked of torch when it is loaded).

    Raises:
        NumaError: an unknown form, or a node this machine does not have (the message lists them).
    """
    topo = topology or Topology.read()
    s = "auto" if setting is None else str(setting).strip().lower()
    if s == "none":
        return Placement("none", (), "cpu_numa_node = none")
    if s == "interleave":
        return Placement("interleave", tuple(sorted(topo.memory_nodes)), "cpu_numa_node = interleave")
    if s.isdigit():
        node = int(s)
        if node not in topo.nodes:
            raise NumaError(f"cpu_numa_node = {node}: this machine has no NUMA node {node} "
                            f"(its nodes: {_fmt(topo.nodes)})")
        if node not in topo.memory_nodes:
            raise NumaError(f"cpu_numa_node = {node}: NUMA node {node} has no memory "
                            f"(nodes with memory: {_fmt(topo.memory_nodes)})")
        return Placement("bind", (node,), f"cpu_numa_node = {node}")
    if s != "auto":
        raise NumaError(f"cpu_numa_node = {setting!r} is not {SETTING_FORMS}")
    mine = frozenset(cpus if cpus is not None else os.sched_getaffinity(0))
    cnode = topo.node_of_cpus(mine)
    if cnode is not None and cnode in topo.memory_nodes:
        return Placement("preferred", (cnode,), f"auto: this process's CPUs {_cpu_span(mine)} are on node {cnode}")
    bus = gpu_bus_id if gpu_bus_id is not None else gpu_pci_bus_id()
    gnode = topo.node_of_pci(bus) if bus else None
    if gnode is not None and gnode in topo.memory_nodes:
        return Placement("preferred", (gnode,), f"auto: the GPU {bus} is on node {gnode}")
    return Placement("none", (), f"auto: this process's CPUs {_cpu_span(mine)} span nodes and no GPU node is known")


def _cpu_span(cpus: AbstractSet[int]) -> str:
    c = sorted(cpus)
    if not c:
        return "(none)"
    return f"{c[0]}-{c[-1]}" if c == list(range(c[0], c[-1] + 1)) and len(c) > 1 else ",".join(map(str, c))
