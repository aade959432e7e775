"""The ``kvtier`` command line (typer). Each command lives in its own module and
is imported lazily, so ``kvtier --help`` does not import vLLM or torch."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="kvtier: tiered KV-cache storage for LLM inference engines.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print ratios measured side by side in one run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@app.command()
def demo(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the per-request numbers and summary here."),
    cache_dir: Optional[Path] = typer.Option(
        None, help="Where the converted model and the demo's disk tier live (default ~/.cache/kvtier)."
    ),
    quick: bool = typer.Option(False, help="Fewer documents and questions (for smoke tests)."),
) -> None:
    """Long-document QA on SmolLM2-135M through vLLM: kvtier off, on, and after a restart."""
    from kvtier.demo.run import run_demo

    raise typer.Exit(run_demo(json_path=json_path, cache_dir=cache_dir, quick=quick))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
