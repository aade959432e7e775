"""``kvtier ctl ...`` (a running controller's HTTP API) and ``kvtier keys ...`` (fleet key files).
Each command imports its module lazily, so ``kvtier --help`` does not import the controller."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NoReturn, Optional

import typer

from kvtier.cli_common import HELP_MARKUP

__all__ = ["ctl_app", "keys_app"]

ctl_app = typer.Typer(
    help="Talk to a running `kvtier controller` over HTTP. Exit codes: 0 done, 1 the operation failed, "
    "2 usage error or controller unreachable/refusing.",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)
keys_app = typer.Typer(
    help="Fleet keys (README, the trust model): each instance, controller and router has its own; the "
    "authorized-members file lists the public keys a node admits. Exit codes: 0 done, 2 usage error.",
    no_args_is_help=True,
)


@keys_app.command("new")
def keys_new(
    path: Path = typer.Argument(..., help="Where to write the key file (0600; its directory is created 0700)."),
    name: str = typer.Option("", "--name", help="A label stored in the file (e.g. the instance's name)."),
) -> None:
    """Make a key pair; prints the members-file line of its public key (NAME PUBLIC_KEY)."""
    from kvtier.protocol.trust import FleetKey, TrustError

    try:
        key = FleetKey.generate(name)
        key.save(path)
    except TrustError as exc:
        typer.echo(f"kvtier keys: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{name or path.stem} {key.public}")


@keys_app.command("show")
def keys_show(path: Path = typer.Argument(..., help="A key file made by `kvtier keys new` (or pyzmq).")) -> None:
    """Print a key file's public key (what members files and controller_key take)."""
    from kvtier.protocol.trust import FleetKey, TrustError

    try:
        key = FleetKey.load(path)
    except TrustError as exc:
        typer.echo(f"kvtier keys: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(key.public)


_CTL_URL = typer.Option("http://127.0.0.1:7601", "--url", help="Controller HTTP URL.")
_CTL_TOKEN = typer.Option(None, "--token", help="Bearer token (default $KVTIER_CONTROLLER_TOKEN).")
_CTL_JSON = typer.Option(False, "--json", help="Print the JSON answer instead of a table.")
_CTL_TOKENS = typer.Option(None, "--tokens", help="Token ids, comma separated: 1,2,3.")
_CTL_TOKENS_FILE = typer.Option(None, "--tokens-file", help="File of token ids (JSON list or comma/space separated).")
_CTL_INSTANCE = typer.Option(None, "--instance", help="Only this instance (default: every instance).")
_CTL_TIER = typer.Option(None, "--tier", help="Only this tier: cpu, disk, remote.")
_CTL_SALT = typer.Option(None, "--cache-salt", help="Tenant cache salt the keys were made with.")
_CTL_WAIT = typer.Option(True, "--wait/--no-wait", help="Wait for the operation's terminal state.")


def _ctl(kind: str, url: str, token: Optional[str], as_json: bool, call: Callable[..., dict]) -> NoReturn:
    from kvtier.controller.client import ControllerClient, ControllerClientError
    from kvtier.controller.ctl import run

    try:
        client = ControllerClient(url, token)
    except ControllerClientError as exc:  # a --url that is not a URL
        typer.echo(f"kvtier ctl {kind}: {exc}", err=True)
        raise typer.Exit(2) from None
    with client:
        raise typer.Exit(run(kind, lambda: call(client), as_json))


def _ctl_tokens(tokens: Optional[str], tokens_file: Optional[Path]) -> list[int]:
    from kvtier.controller.ctl import CtlUsageError, parse_tokens

    try:
        return parse_tokens(tokens, tokens_file)
    except CtlUsageError as exc:
        typer.echo(f"kvtier ctl: {exc}", err=True)
        raise typer.Exit(2) from None


@ctl_app.command("lookup")
def ctl_lookup(
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    keys: Optional[str] = typer.Option(None, "--keys", help="Chunk keys (hex, comma separated) instead of tokens."),
    cache_salt: Optional[str] = _CTL_SALT, instance: Optional[str] = _CTL_INSTANCE,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Longest cached prefix of a prompt per instance and tier."""
    ids = None if keys is not None else _ctl_tokens(tokens, tokens_file)
    key_list = [k for k in keys.split(",") if k] if keys is not None else None
    _ctl("lookup", url, token, as_json, lambda c: c.lookup(ids, key_list, cache_salt, instance))


@ctl_app.command("clear")
def ctl_clear(
    instance: Optional[str] = _CTL_INSTANCE, tier: Optional[str] = _CTL_TIER,
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Clear the cache of the fleet, one instance, one tier or one tenant salt."""
    _ctl("clear", url, token, as_json, lambda c: c.clear(instance, tier, cache_salt, wait))


@ctl_app.command("pin")
def ctl_pin(
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    instance: Optional[str] = _CTL_INSTANCE,
    ttl: Optional[float] = typer.Option(None, "--ttl", min=0.001, help="Seconds the pin lasts (default: until unpinned)."),
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Pin the cached prefix of a prompt (it survives eviction)."""
    ids = _ctl_tokens(tokens, tokens_file)
    _ctl("pin", url, token, as_json, lambda c: c.pin(ids, instance, ttl, cache_salt, wait))


@ctl_app.command("unpin")
def ctl_unpin(
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    instance: Optional[str] = _CTL_INSTANCE, pin_id: Optional[str] = typer.Option(None, "--pin-id"),
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Release pins: the one named --pin-id, or every pin covering the prompt's chunks (evictable again)."""
    ids = None if (tokens is None and tokens_file is None and pin_id) else _ctl_tokens(tokens, tokens_file)
    _ctl("unpin", url, token, as_json, lambda c: c.unpin(ids, instance, pin_id, cache_salt, wait))


@ctl_app.command("move")
def ctl_move(
    from_instance: str = typer.Option(..., "--from", help="Source instance."),
    to_tier: str = typer.Option(..., "--to-tier", help="Target tier: cpu, disk, remote."),
    to_instance: Optional[str] = typer.Option(None, "--to", help="Target instance (default: the source)."),
    from_tier: Optional[str] = typer.Option(None, "--from-tier", help="Source tier (default: the one holding most)."),
    copy: bool = typer.Option(False, "--copy", help="Keep the source copy."),
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Move (or copy) a prompt's cached prefix between tiers or instances, verified on the target."""
    ids = _ctl_tokens(tokens, tokens_file)
    _ctl("move", url, token, as_json,
         lambda c: c.move(ids, from_instance, to_tier, to_instance, from_tier, copy, cache_salt, wait))


@ctl_app.command("compress")
def ctl_compress(
    codec: str = typer.Option(..., "--codec", help="raw, shuffle-zstd, int8, cachegen."),
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    instance: Optional[str] = _CTL_INSTANCE, tier: Optional[str] = _CTL_TIER,
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Re-encode a prompt's stored chunks with a codec, in place."""
    ids = _ctl_tokens(tokens, tokens_file)
    _ctl("compress", url, token, as_json, lambda c: c.compress(ids, codec, instance, tier, cache_salt, wait))


@ctl_app.command("decompress")
def ctl_decompress(
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    instance: Optional[str] = _CTL_INSTANCE, tier: Optional[str] = _CTL_TIER,
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Re-encode a prompt's stored chunks raw, in place."""
    ids = _ctl_tokens(tokens, tokens_file)
    _ctl("decompress", url, token, as_json, lambda c: c.decompress(ids, instance, tier, cache_salt, wait))


@ctl_app.command("health")
def ctl_health(
    instance: Optional[str] = _CTL_INSTANCE,
    live: bool = typer.Option(False, "--live", help="Ask each instance now instead of its last heartbeat."),
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Per-instance, per-tier health."""
    _ctl("health", url, token, as_json, lambda c: c.health(instance, live))


@ctl_app.command("instances")
def ctl_instances(url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON) -> None:
    """Registered instances, their tiers, namespaces and last heartbeat."""
    _ctl("instances", url, token, as_json, lambda c: c.instances())


@ctl_app.command("check-finish")
def ctl_check_finish(
    event_id: str = typer.Argument(..., help="The event_id an operation returned."),
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """State of an asynchronous operation (pending, running, done, failed with a reason)."""
    _ctl("check-finish", url, token, as_json, lambda c: c.check_finish(event_id))
