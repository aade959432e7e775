"""``kvtier config-check``: load the configuration (kvtier's or an LMCache YAML) and show it.

Prints the effective settings with where each came from and, for an LMCache
config, the translation's mapped / refused / ignored tables (see
:mod:`kvtier.config_lmcache`). Exit code 0 when the config loads, 2 when it is
refused (the tables are still printed, then the error).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig, load_config
from kvtier.config_sources import ENV_PREFIX, is_yaml
from kvtier.config_base import ConfigError, read_config_text
from kvtier.urls import mask_url
from kvtier.config_lmcache import LMCACHE_ENV, LmcacheTranslation, translate_lmcache

#: Settings whose values are secrets (shown as ``***``).
SECRETS = ("server_token", "controller_token")


def lmcache_path(config_file: Path | None, environ: Mapping[str, str]) -> Path | None:
    """The LMCache file a load with ``config_file`` and ``environ`` would translate, if any (for display)."""
    if config_file is not None and is_yaml(config_file):
        return config_file
    names = [f"{ENV_PREFIX}LMCACHE_CONFIG_FILE", LMCACHE_ENV]
    if config_file is None:
        names.insert(0, f"{ENV_PREFIX}CONFIG_FILE")
    for name in names:
        value = environ.get(name, "").strip()
        if value and (name != f"{ENV_PREFIX}CONFIG_FILE" or is_yaml(value)):
            return Path(value)
    return None


def _translation(path: Path | None) -> tuple[LmcacheTranslation | None, str | None]:
    """The translation of ``path`` for display (None when no file or it cannot be parsed), and a parse error."""
    if path is None:
        return None, None
    try:
        import yaml

        doc = yaml.safe_load(read_config_text(path, "LMCache config file")) or {}
        return translate_lmcache(doc), None
    except (OSError, ValueError, yaml.YAMLError) as exc:  # ConfigError is a ValueError
        return None, str(exc)
    except RecursionError:
        return None, "nested too deeply"



def _settings(config: KVTierConfig) -> dict[str, Any]:
    values = config.model_dump(mode="json")
    if values.get("remote_url"):
        values["remote_url"] = mask_url(values["remote_url"])
    for key in SECRETS:
        if values.get(key):
            values[key] = "***"
    return values


def report(config_file: Path | None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Load the config and describe it as a JSON-ready dict.

    Returns:
        ``{"ok": bool, "error": str | None, "settings": {key: value}, "sources": {key: source},
        "lmcache": None | {"file", "mapped": [[lmcache key, kvtier key, shown]], "refused": [[key, reason]],
        "ignored": [[key, reason]]}}``; ``settings`` is empty when the config is refused.
    """
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {"ok": True, "error": None, "settings": {}, "sources": {}, "lmcache": None}
    try:
        config = load_config({"config_file": config_file} if config_file is not None else {}, environ=environ)
    except ConfigError as exc:
        out.update(ok=False, error=str(exc))
        path = lmcache_path(config_file, environ)
    else:
        out["settings"] = _settings(config)
        out["sources"] = {k: config.source_of(k) for k in out["settings"]}
        path = config.lmcache_config_file
    translation, parse_error = _translation(Path(path) if path is not None else None)
    if translation is not None:
        out["lmcache"] = {
            "file": str(path),
            "mapped": [list(r) for r in translation.mapped],
            "refused": [list(r) for r in translation.refused],
            "ignored": [list(r) for r in translation.ignored],
            "connector": dict(translation.connector),
            "notes": list(translation.notes),
        }
    elif parse_error and out["ok"]:  # pragma: no cover - the load parsed the same file
        out["lmcache"] = {"file": str(path), "error": parse_error}
    return out


def config_check(config_file: Path | None, as_json: bool) -> int:
    """Print :func:`report` as tables (rich) or JSON; 0 when the config loads, 2 when refused."""
    data = report(config_file)
    if as_json:
        print(json.dumps(data, indent=2))
        return 0 if data["ok"] else 2
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    lm = data["lmcache"]
    if lm and "mapped" in lm:
        for title, columns, rows in (
            (f"LMCache {lm['file']}: mapped", ("LMCache key", "kvtier key", "value"), lm["mapped"]),
            (f"LMCache {lm['file']}: refused (the load fails)", ("LMCache key", "why"), lm["refused"]),
            (f"LMCache {lm['file']}: ignored (no change in kvtier)", ("LMCache key", "why"), lm["ignored"]),
        ):
            if rows:
                table = Table(title=title, title_justify="left")
                for c in columns:
                    table.add_column(c, overflow="fold")
                for r in rows:
                    table.add_row(*[Text(str(x)) for x in r])
                console.print(table)
        if lm.get("connector"):
            console.print("vLLM connector settings from the file (kv_connector_extra_config): "
                          + ", ".join(f"{k}={v}" for k, v in lm["connector"].items()))
        for note in lm.get("notes", []):
            console.print(Text(f"note: {note}"))
    if data["ok"]:
        table = Table(title="effective kvtier settings", title_justify="left")
        table.add_column("setting")
        table.add_column("value", overflow="fold")
        table.add_column("from", overflow="fold")
        for key, value in data["settings"].items():
            table.add_row(key, Text(str(value)), Text(data["sources"][key]))
        console.print(table)
        return 0
    console.print(Text(f"kvtier config-check: {data['error']}", style="bold red"))
    return 2
