"""Shared pieces of the ``kvtier`` command line: JSON output targets and exit handling."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Optional

import typer

#: ``--json -`` writes the JSON to stdout (the tables then go to stderr).
STDOUT = "-"

#: Help is click's plain layout, not typer's rich panels: the panels cut long option names
#: (``--max-namespaces-per-client``) at 80 columns or in a pipe and tag every flag ``<bool>``;
#: the plain layout wraps the text beside the option instead and reads the same everywhere.
HELP_MARKUP = None


@contextlib.contextmanager
def json_target(json_path: Optional[Path]) -> Iterator[Optional[Path]]:
    """The path a command writes its JSON to; for ``-`` a temporary file copied to stdout at the end,
    with everything the command prints meanwhile sent to stderr (so stdout is pure JSON)."""
    if json_path is None or str(json_path) != STDOUT:
        yield json_path
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-json-") as tmp:
        path = Path(tmp) / "out.json"
        try:
            with contextlib.redirect_stdout(sys.stderr):
                yield path
        finally:  # also when the command ends by typer.Exit
            if path.exists():
                with path.open() as f:
                    shutil.copyfileobj(f, sys.stdout)
                sys.stdout.flush()


#: Top-level module -> the extra that installs it (pyproject.toml's optional dependencies).
MODULE_EXTRAS = {
    "vllm": "vllm-cpu", "torch": "vllm-cpu", "transformers": "vllm-cpu (or controller: the router's tokenizer)",
    "httpx": "controller", "fastapi": "controller", "uvicorn": "controller",
    "zmq": "server", "prometheus_client": "server", "msgspec": "server",
    "redis": "redis", "hiredis": "redis", "matplotlib": "bench",
    "gguf": "demo", "accelerate": "demo", "playwright": "dashboard", "nixl": "nixl",
    "hypothesis": "dev", "pytest": "dev",
}


def missing_module_message(command: str, exc: ModuleNotFoundError) -> str:
    """One line naming the missing module and the extra that installs it."""
    name = (exc.name or "").split(".")[0]
    extra = MODULE_EXTRAS.get(name)
    hint = f"pip install 'kvtier[{extra.split(' ')[0]}]'" + (f" ({extra})" if " " in extra else "") if extra else \
        "see README, Install, for the extra this command needs"
    return f"kvtier {command}: needs the Python module {exc.name!r}, not installed: {hint}"


def finish(command: str, run: Callable[[], int]) -> NoReturn:
    """Run a command and exit with its code; a usage error (bad flag or setting, unreachable
    target, missing extra) is one line on stderr and exit code 2, never a traceback."""
    from kvtier.bench.common import BenchUsageError
    from kvtier.config_base import ConfigError

    try:
        code = run()
    except (BenchUsageError, ConfigError) as exc:
        typer.echo(f"kvtier {command}: {exc}", err=True)
        raise typer.Exit(2) from None
    except ModuleNotFoundError as exc:
        typer.echo(missing_module_message(command, exc), err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)
