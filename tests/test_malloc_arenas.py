"""kvtier.malloc_arenas: the router caps glibc's malloc arenas before it starts threads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.malloc_arenas import limit_arenas


def _in_child(code: str, env_extra: dict[str, str] | None = None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_cap_is_set_on_glibc_and_an_operators_variable_wins() -> None:
    code = "from kvtier.malloc_arenas import limit_arenas; print(limit_arenas())"
    import platform

    expected = "True" if platform.libc_ver()[0] == "glibc" else "False"
    assert _in_child(code) == expected
    assert _in_child(code, {"MALLOC_ARENA_MAX": "4"}) == "False"  # the operator's setting is left alone


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="arenas must be >= 1"):
        limit_arenas(0)


def test_the_router_command_caps_the_arenas_before_building_its_server() -> None:
    import inspect

    from kvtier import cli

    src = inspect.getsource(cli.router)
    assert src.index("limit_arenas()") < src.index("RouterServer(")
