"""kvtier.ports: ports below the ephemeral range, never handed out twice by one picker, also across threads."""

from __future__ import annotations

import socket
import threading

import pytest

from kvtier.ports import PortPicker, ephemeral_range, free_port


def test_ports_come_from_below_the_ephemeral_range_and_bind() -> None:
    first, _ = ephemeral_range()
    picker = PortPicker()
    for _ in range(20):
        port = picker.pick()
        assert 20000 <= port < first or first - 20000 < 1000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free at the time


def test_one_picker_never_gives_a_port_twice_even_across_threads() -> None:
    for _ in range(50):
        picker = PortPicker(low=20100, high=20103)
        got: list[int] = []
        threads = [threading.Thread(target=lambda: got.append(picker.pick())) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(got) == [20100, 20101, 20102, 20103]


def test_a_port_in_use_is_skipped_and_an_exhausted_range_says_so() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        held.listen()
        picker = PortPicker(low=port, high=port)
        with pytest.raises(OSError, match="no free TCP port"):
            picker.pick()
    picker = PortPicker(low=port, high=port)
    assert picker.pick() == port
    with pytest.raises(OSError, match="given out"):
        picker.pick()


def test_an_unresolvable_host_fails_at_once_and_ipv6_works() -> None:
    with pytest.raises(OSError, match="cannot pick a port"):
        free_port("no-such-host.invalid")
    if socket.has_ipv6:
        assert free_port("::1") > 0
