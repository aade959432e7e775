"""Every command's --help is whole at 80 columns and in a pipe (what a fresh user reads first)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import typer
from typer.testing import CliRunner

from kvtier.cli import app


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    # typer vendors its own click: walk by attribute, not by click's classes
    yield path, cmd
    if getattr(cmd, "commands", None):
        for name, sub in sorted(cmd.commands.items()):
            yield from _commands(sub, path + (name,))


ROOT = typer.main.get_command(app)
COMMANDS = list(_commands(ROOT))


def test_the_walk_reaches_nested_commands() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"server", "bench peers", "ctl lookup"} <= names, sorted(names)


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) or "kvtier" for p, _ in COMMANDS])
def test_help_names_every_option_whole_at_80_columns(path: tuple[str, ...], cmd: Any) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "…" not in out, out  # a cut option name or help text
    assert "<bool>" not in out, out
    assert "``" not in out, out  # reST markup from a docstring
    for param in cmd.params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("-"):
                assert opt in out, f"{opt} missing from {' '.join(path)} --help:\n{out}"
    assert max(len(line) for line in out.splitlines()) <= 80, out
