"""Where kvtier settings come from besides explicit values: ``KVTIER_*`` variables and a config file.

:func:`kvtier.config.load_config` merges them (see :mod:`kvtier.config` for the precedence and
formats). The file is kvtier's TOML/JSON or an LMCache YAML translated by
:mod:`kvtier.config_lmcache`; every unknown key or variable is refused by name.
"""

from __future__ import annotations

import difflib
import json
import logging
import tomllib
from pathlib import Path
from typing import Any, Iterable, Mapping

from kvtier.config_base import ConfigError, read_config_text

__all__ = ["ENV_PREFIX", "NON_SETTING_ENV", "is_yaml", "read_settings_file", "file_source", "env_values"]

log = logging.getLogger("kvtier.config")

ENV_PREFIX = "KVTIER_"
#: ``KVTIER_*`` environment variables used by kvtier's own tooling, not settings (never refused).
NON_SETTING_ENV = frozenset({
    "KVTIER_REDIS_STATE", "KVTIER_TEST_FAULTS_JSON_OUT",  # test tooling
    "KVTIER_TEST_REQUIRE",  # tests/skip_guard.py: dependencies whose skips fail the run (.ci/run sets it)
    "KVTIER_DASHBOARD_TOKENIZER",  # the dashboard's hot-prefix text (kvtier.dashboard.source)
    "KVTIER_TEST_ARTIFACTS", "KVTIER_UPDATE_DOCS",  # browser tests' screenshots
    "KVTIER_GPU_MODEL",  # scripts/gpu-check.sh: the model folder of its TTFT demo
})


def is_yaml(path: Path | str) -> bool:
    """True for a ``.yaml``/``.yml`` file: an LMCache config, translated rather than read as kvtier's."""
    return Path(path).suffix.lower() in (".yaml", ".yml")


def read_settings_file(path: Path) -> dict[str, Any]:
    """The settings of a kvtier TOML/JSON file (top level, or all of one ``[kvtier]`` table).

    Raises:
        ConfigError: unreadable, not TOML/JSON (JSON that reads as TOML is named so), nested too
            deeply, not a table, keys outside ``[kvtier]``, or ``lmcache_config_file`` in it.
    """
    text = read_config_text(path)
    kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
    try:
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except RecursionError:  # json and tomllib recurse per nesting level and give up past the limit
        raise ConfigError(f"kvtier config file {path} is not valid {kind}: nested too deeply") from None
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        hint = ""
        if kind == "JSON":
            try:
                tomllib.loads(text)
                hint = "; it reads as TOML: name it .toml"
            except (ValueError, RecursionError):
                pass
        raise ConfigError(
            f"kvtier config file {path} is not valid {kind} (kvtier reads TOML, or JSON for a .json file): {exc}{hint}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"kvtier config file {path} must hold a table/object of settings")
    if "kvtier" in data:  # a [kvtier] table: then it holds every setting
        others = sorted(k for k in data if k != "kvtier")
        if others:
            raise ConfigError(
                f"kvtier config file {path}: keys outside the [kvtier] table would be ignored: "
                f"{', '.join(others)}; move them into [kvtier] or remove the table"
            )
        data = data["kvtier"]
    if not isinstance(data, dict):
        raise ConfigError(f"kvtier config file {path}: 'kvtier' must be a table of settings")
    data = dict(data)
    data.pop("config_file", None)
    for key in ("lmcache_config_file",):
        if key in data:
            raise ConfigError(
                f"kvtier config file {path}: {key} cannot be set in a file (give it explicitly or by environment)"
            )
    return data


def file_source(
    overrides: Mapping[str, Any], env: Mapping[str, str], environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str], Path | None]:
    """The file source: (settings, key -> origin, the LMCache file used or None).

    A kvtier file comes from ``config_file``; an LMCache file from ``config_file`` ending in
    .yaml/.yml, ``lmcache_config_file`` or ``LMCACHE_CONFIG_FILE`` (in that order of precedence
    among the LMCache names). Naming a kvtier file and an LMCache file together is an error.
    """
    from kvtier.config_lmcache import LMCACHE_ENV, read_lmcache_file

    cfg = overrides.get("config_file") or env.get("config_file")
    cfg_where = "explicit setting" if overrides.get("config_file") else f"environment variable {ENV_PREFIX}CONFIG_FILE"
    lm, lm_where = None, ""
    if cfg and is_yaml(cfg):
        lm, lm_where, cfg = cfg, "config_file", None
    for value, where in (
        (overrides.get("lmcache_config_file"), "lmcache_config_file"),
        (env.get("lmcache_config_file"), f"environment variable {ENV_PREFIX}LMCACHE_CONFIG_FILE"),
        (environ.get(LMCACHE_ENV), f"environment variable {LMCACHE_ENV}"),
    ):
        if not value or (isinstance(value, str) and not value.strip()):
            continue
        if lm is not None and str(value) != str(lm):
            raise ConfigError(
                f"two LMCache config files: {lm} (from {lm_where}) and {value} (from {where}); name one"
            )
        if lm is None:
            lm, lm_where = value, where
    if cfg and lm:
        raise ConfigError(
            f"both a kvtier config file {cfg} (from {cfg_where}) and an LMCache config file {lm} (from {lm_where}) "
            "are named; use one file source (unset the other)"
        )
    if lm:
        settings, translation = read_lmcache_file(Path(lm))
        origin = {k: f"LMCache config file {lm}, key {translation.origin(k)}" for k in settings}
        origin["lmcache_config_file"] = lm_where if lm_where != "config_file" else cfg_where
        if translation.ignored:
            log.info(
                "kvtier: LMCache config %s: ignored keys (no change in kvtier): %s",
                lm, "; ".join(f"{k}: {why}" for k, why in translation.ignored),
            )
        return settings, origin, Path(lm)
    if cfg:
        settings = read_settings_file(Path(cfg))
        return settings, {k: f"config file {cfg}" for k in settings}, None
    return {}, {}, None


def env_values(environ: Mapping[str, str], fields: Iterable[str]) -> dict[str, str]:
    """The ``KVTIER_<FIELD>`` variables of ``environ`` as ``{field: value}``.

    Raises:
        ConfigError: a ``KVTIER_*`` variable that is neither a setting in ``fields`` nor in
            :data:`NON_SETTING_ENV` (the closest setting named).
    """
    fields = set(fields)
    out: dict[str, str] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NON_SETTING_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            if close:  # the likely fix alone; the whole list only when nothing is close
                raise ConfigError(f"unknown environment variable {name} (did you mean {ENV_PREFIX}{close[0].upper()}?)")
            raise ConfigError(
                f"unknown environment variable {name}; kvtier settings are "
                + ", ".join(ENV_PREFIX + f.upper() for f in sorted(fields))
                + " (tooling variables allowed: " + ", ".join(sorted(NON_SETTING_ENV)) + ")"
            )
        out[key] = value
    return out
