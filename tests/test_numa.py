"""NUMA placement of the CPU tier (kvtier/memory/numa.py, numa_topology.py).

Selection on a fake two-node machine (a sysfs tree in a temporary directory); the
mechanism on this machine (one node here: the policy is still set, read back with
get_mempolicy and the pages' node asked of move_pages).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.memory import numa
from kvtier.memory.numa_topology import NumaError, Placement, Topology, choose, parse_cpulist
from kvtier.memory.pool import ChunkPool
from kvtier.memory.shared_segment import SharedSegment

try:
    numa.policy_of(np.zeros(1).ctypes.data)
    HAVE_NUMA_CALLS = True
except numa.NumaUnavailable:  # pragma: no cover - not Linux x86_64/aarch64, or a seccomp filter
    HAVE_NUMA_CALLS = False
needs_calls = pytest.mark.skipif(not HAVE_NUMA_CALLS, reason="mbind/get_mempolicy/move_pages unavailable here")
HERE = Topology.read()
NODE = min(HERE.memory_nodes)
GPU = "0000:3b:00.0"


def two_nodes(root: Path, memory: str = "0-1") -> Topology:
    """A machine with nodes 0 (CPUs 0-3) and 1 (CPUs 4-7), a GPU on node 1."""
    base = root / "devices" / "system" / "node"
    for n, cpus in ((0, "0-3"), (1, "4-7")):
        (base / f"node{n}").mkdir(parents=True)
        (base / f"node{n}" / "cpulist").write_text(cpus + "\n")
    (base / "has_memory").write_text(memory + "\n")
    (base / "possible").write_text("0-1\n")
    dev = root / "bus" / "pci" / "devices" / GPU
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    return Topology.read(root)


# -- selection -------------------------------------------------------------------------------------
def test_auto_takes_the_node_of_the_bound_cores_else_of_the_gpu(tmp_path: Path) -> None:
    topo = two_nodes(tmp_path)
    assert topo.nodes == {0, 1} and topo.cpus[1] == frozenset(range(4, 8))
    p = choose("auto", topo, cpus={4, 5})
    assert (p.mode, p.nodes) == ("preferred", (1,)) and "4-5" in p.reason and p.node == 1
    assert choose("auto", topo, cpus={0, 2}, gpu_bus_id="").nodes == (0,)
    p = choose("auto", topo, cpus=set(range(8)), gpu_bus_id=GPU)  # cores span both nodes: the GPU's node
    assert (p.mode, p.nodes) == ("preferred", (1,)) and GPU in p.reason
    p = choose(None, topo, cpus={3, 4}, gpu_bus_id="")  # None is auto; spanning, no GPU: no placement
    assert p.mode == "none" and p.node == -1 and "span" in p.reason
    assert choose("auto", topo, cpus={3, 4}, gpu_bus_id="0000:99:00.0").mode == "none"  # no such PCI device


def test_an_explicit_node_binds_and_a_missing_one_is_a_clear_error(tmp_path: Path) -> None:
    topo = two_nodes(tmp_path)
    assert choose("1", topo).mode == "bind" and choose(1, topo).nodes == (1,)
    with pytest.raises(NumaError, match=r"no NUMA node 2 \(its nodes: 0,1\)"):
        choose("2", topo)
    memless = two_nodes(tmp_path / "m", memory="0")
    with pytest.raises(NumaError, match="node 1 has no memory"):
        choose("1", memless)
    assert choose("interleave", topo).nodes == (0, 1) and choose("interleave", memless).nodes == (0,)
    assert choose("none", topo).mode == "none"
    with pytest.raises(NumaError, match="auto, none, interleave"):
        choose("socket0", topo)


def test_topology_without_numa_sysfs_is_one_node_and_cpulists_parse(tmp_path: Path) -> None:
    assert Topology.read(tmp_path / "nothing").nodes == {0}
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and parse_cpulist("") == set()
    with pytest.raises(ValueError):
        parse_cpulist("5-2")


def test_the_setting_is_checked_and_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    assert KVTierConfig().cpu_numa_node == "auto"
    assert KVTierConfig(cpu_numa_node=" Interleave ").cpu_numa_node == "interleave"
    assert KVTierConfig(cpu_numa_node=1).cpu_numa_node == "1"
    assert load_config({}, environ={"KVTIER_CPU_NUMA_NODE": "none"}).cpu_numa_node == "none"
    with pytest.raises(ConfigError, match="cpu_numa_node"):
        load_config({"cpu_numa_node": "near"}, environ={})


@contextlib.contextmanager
def recorded_binds() -> Iterator[list[str]]:
    """The placement mode of every ``numa.bind`` call made inside the block (each still applied)."""
    modes: list[str] = []
    real_bind = numa.bind

    def recording_bind(addr: int, length: int, placement: Placement) -> None:
        modes.append(placement.mode)
        real_bind(addr, length, placement)

    numa.bind = recording_bind  # type: ignore[assignment]
    try:
        yield modes
    finally:
        numa.bind = real_bind  # type: ignore[assignment]


# -- mechanism, on this machine ----------------------------------------------------------------------
@needs_calls
def test_the_pool_is_bound_before_the_pretouch_and_verified_after() -> None:
    pool = ChunkPool(1 << 20, 8, numa=choose(str(NODE)))
    rep = pool.numa
    assert rep is not None and rep.applied and rep.policy == "bind"
    # the binding is on the pool's memory itself (fails when the pool skips mbind)
    assert numa.policy_of(pool.view(3).ctypes.data) == ("bind", (NODE,))
    assert rep.pages and set(rep.pages) == {NODE} and rep.on_node == 1.0
    assert pool.numa_stats() == {"cpu_numa_node": NODE, "cpu_numa_bound": 1, "cpu_numa_pages_on_node": 1.0}
    assert f"{len(rep.pages)} of {len(rep.pages)} sampled pages" in rep.describe()
    # A pool without a placement makes no mbind call. (Its pages' policy is not asserted: freed heap
    # memory that an earlier bound pool used comes back with that policy, as full runs showed.)
    with recorded_binds() as modes:
        plain = ChunkPool(1 << 20, 2)
    assert plain.numa is None and plain.numa_stats() == {} and modes == []


@needs_calls
def test_the_storage_manager_places_its_cpu_tier_and_reports_it() -> None:
    from kvtier.index.keys import KeyNamespace, LayoutSignature
    from kvtier.storage.manager import StorageManager

    layout = LayoutSignature(engine="t", attn_backend="numpy", kv_layout="LBHNC", block_size=16, num_layers=2,
                             num_kv_heads=1, head_dim=8, dtype="bfloat16")
    ns = KeyNamespace("t/numa", layout, 32)

    def manager(node: str, chunks: int = 64) -> StorageManager:
        return StorageManager(KVTierConfig(chunk_size=32, cpu_capacity=chunks * ns.chunk_bytes, cpu_numa_node=node), ns)

    m = manager(str(NODE))
    try:
        st = m.stats()
        assert st["cpu_numa_node"] == NODE and st["cpu_numa_bound"] == 1 and st["cpu_numa_pages_on_node"] == 1.0
        assert numa.policy_of(m.cpu.pool.view(0).ctypes.data) == ("bind", (NODE,))
    finally:
        m.close()
    auto = manager("auto")  # one node here: preferred on it
    try:
        assert numa.policy_of(auto.cpu.pool.view(0).ctypes.data)[0] == "preferred"
        assert auto.stats()["cpu_numa_node"] == NODE
    finally:
        auto.close()
    # 'none' sets no policy: kvtier makes no mbind call and reports nothing bound. (What policy the
    # pool's pages then have is the allocator's business: freed memory an earlier bound pool used can
    # come back with that pool's policy, as a run of the whole suite showed, so it is not asserted.)
    with recorded_binds() as modes:
        off = manager("none", chunks=(40 << 20) // ns.chunk_bytes)
    try:
        assert off.stats()["cpu_numa_bound"] == 0 and set(modes) <= {"none"}  # bind() is a no-op for none
        assert off.cpu.pool.numa is not None and not off.cpu.pool.numa.applied
    finally:
        off.close()
    missing = max(HERE.nodes) + 7
    with pytest.raises(NumaError, match=f"no NUMA node {missing}"):
        manager(str(missing))


@needs_calls
@pytest.mark.parametrize("sparse", [False, True])
def test_a_shared_segment_is_placed_too(sparse: bool) -> None:
    seg = SharedSegment.create(4 << 20, "kvtier-numa-test", sparse=sparse, numa=choose(str(NODE)))
    try:
        assert seg.numa is not None and seg.numa.applied
        assert numa.policy_of(seg.array.ctypes.data) == ("bind", (NODE,))
        if sparse:
            assert all(p < 0 for p in seg.numa.pages)  # nothing backed yet
            seg.array[: 1 << 20] = 7  # a client's first store backs pages under the segment's policy
            assert seg.numa.stats()["cpu_numa_pages_on_node"] == 1.0 and any(p >= 0 for p in seg.numa.pages)
        else:
            assert set(seg.numa.pages) == {NODE}
    finally:
        seg.close()


@needs_calls
def test_interleave_and_a_refused_bind() -> None:
    m = mmap.mmap(-1, 2 << 20)
    a = np.frombuffer(m, dtype=np.uint8)
    rep = numa.place(a.ctypes.data, a.size, choose("interleave"), lambda: a.fill(1))
    assert rep.policy == "interleave" and rep.on_node == 1.0
    del a
    m.close()
    from kvtier.memory.numa_topology import Placement

    bad = Placement("bind", (NODE + 900,), "test")  # a node the kernel does not have
    buf = np.zeros(1 << 20, dtype=np.uint8)
    with pytest.raises(numa.NumaUnavailable, match="cannot bind"):
        numa.place(buf.ctypes.data, buf.size, bad)
    rep = numa.place(buf.ctypes.data, buf.size, Placement("preferred", (NODE + 900,), "test"))
    assert not rep.applied and rep.error and rep.stats()["cpu_numa_bound"] == 0  # auto: a warning, no failure


@needs_calls
def test_the_policy_is_set_before_the_pages_are_touched() -> None:
    m = mmap.mmap(-1, 1 << 20)
    a = np.frombuffer(m, dtype=np.uint8)
    seen: list[object] = []

    def touch() -> None:
        seen.append(numa.policy_of(a.ctypes.data))  # the policy the first touch allocates under
        seen.append(numa.nodes_of_pages(a.ctypes.data, a.size, 4))  # no page backed yet
        a.fill(1)

    numa.place(a.ctypes.data, a.size, choose(str(NODE)), touch)
    assert seen[0] == ("bind", (NODE,)) and all(p < 0 for p in seen[1])  # type: ignore[union-attr]
    del a
    m.close()


@needs_calls
def test_a_server_namespace_places_its_segment_and_exports_the_gauges() -> None:
    from kvtier.index.keys import KeyNamespace, LayoutSignature
    from kvtier.service.metrics import _numa
    from kvtier.service.namespace_host import NamespaceHost

    layout = LayoutSignature(engine="t", attn_backend="numpy", kv_layout="LBHNC", block_size=16, num_layers=2,
                             num_kv_heads=1, head_dim=8, dtype="bfloat16")
    ns = KeyNamespace("t/numa-server", layout, 32)
    host = NamespaceHost(KVTierConfig(chunk_size=32, cpu_numa_node=str(NODE)), ns, 16 * ns.chunk_bytes, 0)
    try:
        assert numa.policy_of(host.segment.array.ctypes.data) == ("bind", (NODE,))
        st = host.stats()
        assert st["cpu_numa_node"] == NODE and st["cpu_numa_bound"] == 1
        typed = host.typed_stats()
        half = replace(typed, manager=replace(typed.manager, cpu_numa_pages_on_node=0.5))
        got = {m.name: m.samples[0].value for m in _numa([typed, half])}
        assert got == {"kvtier_cpu_numa_node": NODE, "kvtier_cpu_numa_bound": 1, "kvtier_cpu_numa_pages_on_node": 0.5}
        unplaced = replace(typed, manager=replace(typed.manager, cpu_numa_node=None, cpu_numa_bound=None,
                                                  cpu_numa_pages_on_node=None))
    finally:
        host.close()
    assert list(_numa([unplaced])) == []  # no placement: no gauge
