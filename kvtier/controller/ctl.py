"""``kvtier ctl``: render controller API answers as rich tables or JSON (the typer commands are in
:mod:`kvtier.cli`; this module holds their logic so the CLI module stays declarative)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from rich.console import Console
from rich.table import Table

from kvtier.protocol.decoding import json_loads

#: Exit codes: 0 done, 1 the operation failed, 2 usage error or controller unreachable/refusing.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CtlUsageError(ValueError):
    """Bad command-line input (exit code 2)."""


def parse_tokens(tokens: Optional[str], tokens_file: Optional[Path]) -> list[int]:
    """Token ids from ``--tokens 1,2,3`` or ``--tokens-file`` (a JSON list, or ids separated by
    commas/whitespace).

    Raises:
        CtlUsageError: neither or both given, unreadable file, or a non-integer id.
    """
    if (tokens is None) == (tokens_file is None):
        raise CtlUsageError("give exactly one of --tokens or --tokens-file")
    if tokens_file is not None:
        try:
            text = tokens_file.read_text()
        except OSError as exc:
            raise CtlUsageError(f"--tokens-file: {exc}") from None
    else:
        text = tokens or ""
    text = text.strip()
    if text.startswith("["):
        try:
            values = json_loads(text)
        except ValueError as exc:  # not JSON, or nested too deeply
            raise CtlUsageError(f"tokens: not a JSON list: {exc}") from None
    else:
        values = [v for v in re.split(r"[,\s]+", text) if v]
    out = []
    for v in values:
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            raise CtlUsageError(f"tokens: {v!r} is not an integer token id") from None
    if not out:
        raise CtlUsageError("tokens: empty")
    return out


def _console() -> Console:
    return Console(file=sys.stdout, soft_wrap=True)


def _lookup_table(out: dict[str, Any]) -> Table:
    rows = out.get("instances", {})
    tiers = sorted({k for r in rows.values() for k in r if k not in ("longest_matched", "pinned")},
                   key=lambda t: ["CPU", "DISK", "REMOTE", "PEER"].index(t) if t in ("CPU", "DISK", "REMOTE", "PEER") else 9)
    table = Table(title="lookup: cached prefix tokens per instance")
    for col in ["instance", "location", "longest_matched", *tiers, "pinned"]:
        table.add_column(col, justify="left" if col in ("instance", "location") else "right",
                         no_wrap=col == "instance", overflow="fold")  # ids are copied into other commands: never cut
    for inst, r in sorted(rows.items()):
        loc = out.get("layout_info", {}).get(inst, ["-", 0])[0]
        table.add_row(inst, loc, str(r.get("longest_matched", 0)), *(str(r.get(t, 0)) for t in tiers),
                      str(r.get("pinned", 0)))
    return table


def _instances_table(out: dict[str, Any]) -> Table:
    table = Table(title="instances")
    for col in ("instance", "role", "host", "pid", "peer", "tiers", "namespaces", "last seen (s ago)"):
        table.add_column(col, no_wrap=col == "instance", overflow="fold")  # a narrow terminal folds URLs, never cuts them
    for i in out.get("instances", []):
        tiers = ", ".join(f"{t['kind']}:{t['chunks']} chunks" + (" (shared)" if t["shared"] else "") for t in i["tiers"])
        nss = ", ".join(f"{n['model']} C={n['chunk_size']} r{n['rank']}/{n['world_size']}" for n in i["namespaces"])
        table.add_row(i["instance"], i["role"], i["host"], str(i["pid"]), i.get("peer_url") or "-", tiers, nss,
                      f"{i['last_seen_age_s']:.2f}")
    return table


def _health_table(out: dict[str, Any]) -> Table:
    table = Table(title="health")
    for col in ("instance", "tier", "state", "last seen (s ago)"):
        table.add_column(col, no_wrap=col == "instance", overflow="fold")
    for inst, row in sorted(out.get("instances", {}).items()):
        tiers = row.get("tiers") or {}
        if not tiers:
            table.add_row(inst, "-", row.get("error", "no tier health yet (reported per key namespace; none registered, e.g. no engine connected)"), f"{row.get('last_seen_age_s', 0):.2f}")
        for tier, h in sorted(tiers.items()):
            table.add_row(inst, tier, json.dumps(h, sort_keys=True), f"{row.get('last_seen_age_s', 0):.2f}")
    return table


def _op_table(out: dict[str, Any]) -> Table:
    table = Table(title=f"{out.get('op', 'operation')} {out.get('event_id', '')}")
    table.add_column("field")
    table.add_column("value")
    for k in ("state", "reason"):
        if out.get(k):
            table.add_row(k, str(out[k]))
    for k, v in (out.get("result") or {}).items():
        table.add_row(k, json.dumps(v, sort_keys=True, default=str) if isinstance(v, (dict, list)) else str(v))
    return table


def render(kind: str, out: dict[str, Any], as_json: bool) -> int:
    """Print one answer; the exit code (1 when an operation ended ``failed``)."""
    if as_json:
        sys.stdout.write(json.dumps(out, indent=2, sort_keys=True, default=str) + "\n")
    else:
        table = {"lookup": _lookup_table, "instances": _instances_table, "health": _health_table}.get(kind, _op_table)(out)
        _console().print(table)
    return EXIT_FAILED if out.get("state") == "failed" else EXIT_OK


def run(kind: str, call: Callable[[], dict[str, Any]], as_json: bool) -> int:
    """Run one client call and render it; errors become one line on stderr and exit code 2."""
    from kvtier.controller.client import ControllerClientError

    try:
        out = call()
    except (CtlUsageError, ControllerClientError) as exc:
        sys.stderr.write(f"kvtier ctl {kind}: {exc}\n")
        return EXIT_USAGE
    return render(kind, out, as_json)
