"""Prefill/decode disaggregation (PD) over the shared store: settings, ``kv_transfer_params``, confirms.

Protocol (the one vLLM's own disaggregation connectors and proxy use):

1. A proxy sends the request to a *prefiller* with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": True}``. Its worker saves every full
   prompt chunk (as in storage mode) plus the last partial chunk under a derived key
   (:func:`partial_key`) into the store both instances share (a ``kvtier server``).
   ``request_finished`` keeps the request's blocks (``delay_free=True``) and returns
   ``do_remote_prefill=True`` with ``remote_engine_id``, ``remote_request_id``,
   ``remote_block_ids``, ``remote_host``, ``remote_port``, ``kvtier_prompt_tokens`` and
   ``kvtier_confirm`` (a random 128-bit value drawn for this hold).
2. The proxy sends the request with those params to a *decoder*. Its scheduler side
   keys its own prompt (so a different prompt can only miss, never load wrong KV)
   and looks up every chunk including the partial one. When every chunk to load is
   already in memory on this machine (the shared server's CPU tier) and the step's
   such loads stay within ``pd_sync_load_bytes``, it loads them synchronously in the
   step that schedules the request (vLLM computes the last prompt token in that same
   step); otherwise it loads asynchronously (``WAITING_FOR_REMOTE_KVS``) and vLLM
   recomputes the last prompt token after the load. Either way the decoder computes
   exactly the last prompt token. Unavailable chunks are reported as load errors and
   recomputed.
3. When its load is over (or the request is aborted, or nothing was found) the decoder
   sends a :class:`PDConfirm` over ZMQ to ``remote_host:remote_port``; the prefiller's
   worker then reports the request in ``finished_sending`` (vLLM frees its blocks) and
   releases its store lease on the chunks. Without a confirm the hold ends after
   ``pd_lease_s`` seconds (counted from the request's finish, acted on at the next step).

Trust: ``kv_transfer_params`` reach a decoder from whoever sends it a request, so a decoder
acts only on those naming a prefiller it knows (:meth:`PDSettings.knows`: the ``pd_prefillers``
it was given, else any on loopback); others are ignored (the prompt is computed as for any
request) and never dialled. A confirm releases a hold only if it carries that hold's
``kvtier_confirm`` value, which only the prefiller's own answer ever carried: knowing (or
guessing) an engine and request id is not enough to end another request's hold early.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import blake3
import msgspec

from kvtier.hosts import is_loopback

log = logging.getLogger("kvtier.vllm")

PDRole = Literal["off", "prefill", "decode", "both"]
#: ``kv_connector_extra_config`` keys read here (removed before kvtier's own config is loaded).
PD_KEYS = ("pd_role", "pd_lease_s", "pd_host", "pd_port", "pd_sync_load_bytes", "pd_prefillers")
#: Default of ``PDSettings.sync_load_bytes`` (128 MiB).
DEFAULT_SYNC_LOAD_BYTES = 128 << 20
_PARTIAL_DOMAIN = b"kvtier/pd-partial-chunk/v1"


@dataclass(frozen=True)
class PDSettings:
    """PD settings of one engine.

    Attributes:
        role: "prefill" (serves ``do_remote_decode`` requests), "decode" (loads
            ``do_remote_prefill`` requests), "both", or "off" (params ignored).
        lease_s: seconds a prefiller holds a request's blocks and store lease after it
            finished, waiting for the decoder's confirm.
        host: address the prefiller advertises and binds its confirm socket on.
        port: TCP port of the prefiller's confirm socket (required for prefill roles).
        sync_load_bytes: decoder: most bytes of PD loads per engine step done
            synchronously, in the step that schedules the request, when every chunk
            to load is already in memory on this machine (the CPU tier of the shared
            ``kvtier server``). A sync load saves the async hand-off (at least one
            more engine step and a loader thread sharing the engine's core) but
            stalls the step's other running requests for its duration (~25 ms for
            128 MiB at the ~5 GB/s one core copies). Larger loads, and chunks that
            must still travel (another tier, a peer), load asynchronously. 0: always
            asynchronous.
        prefillers: decoder: the prefillers' confirm endpoints (``(host, port)``, host
            lower-cased) whose ``kv_transfer_params`` it acts on; ``None`` (unset): any on a
            loopback address (same machine). Across machines, list them.
    """

    role: PDRole = "off"
    lease_s: float = 30.0
    host: str = "127.0.0.1"
    port: int = 0
    sync_load_bytes: int = DEFAULT_SYNC_LOAD_BYTES
    prefillers: tuple[tuple[str, int], ...] | None = None

    def knows(self, host: str, port: int) -> bool:
        """Whether this decoder acts on params naming the prefiller at ``host:port`` (see
        :attr:`prefillers`; names are compared as given, never resolved)."""
        if self.prefillers is None:
            return is_loopback(host)
        return (host.strip("[]").lower(), port) in self.prefillers

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")

    @classmethod
    def pop_from(cls, extra: dict[str, Any]) -> "PDSettings":
        """Take the ``pd_*`` keys out of ``extra`` (a ``kv_connector_extra_config`` copy).

        Raises:
            ValueError: an unknown role, a non-positive lease, a prefill role without
                ``pd_port``, or a negative ``pd_sync_load_bytes``.
        """
        role = str(extra.pop("pd_role", "off"))
        if role not in ("off", "prefill", "decode", "both"):
            raise ValueError(f"pd_role must be one of off|prefill|decode|both, got {role!r}")
        lease = float(extra.pop("pd_lease_s", 30.0))
        if not lease > 0:
            raise ValueError(f"pd_lease_s must be positive, got {lease}")
        host = str(extra.pop("pd_host", "127.0.0.1"))
        port = int(extra.pop("pd_port", 0))
        if role in ("prefill", "both") and not 0 < port < 65536:
            raise ValueError("pd_role prefill/both needs pd_port (the decoder's confirm socket), 1..65535")
        sync_bytes = int(extra.pop("pd_sync_load_bytes", DEFAULT_SYNC_LOAD_BYTES))
        if sync_bytes < 0:
            raise ValueError(f"pd_sync_load_bytes must be >= 0, got {sync_bytes}")
        raw = extra.pop("pd_prefillers", None)
        prefillers = None if raw is None else tuple(_endpoint(e) for e in _as_list(raw))
        return cls(role, lease, host, port, sync_bytes, prefillers)  # type: ignore[arg-type]


def _as_list(raw: Any) -> list[Any]:
    if isinstance(raw, str):
        return [p for p in raw.split(",") if p.strip()]
    if isinstance(raw, (list, tuple)):
        return list(raw)
    raise ValueError(f"pd_prefillers must be a list of HOST:PORT, got {raw!r}")


def _endpoint(entry: Any) -> tuple[str, int]:
    """``HOST:PORT`` or ``tcp://HOST:PORT`` (``[v6]:PORT``) -> ``(host, port)``.

    Raises:
        ValueError: not that shape.
    """
    text = str(entry).strip()
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"pd_prefillers entry {entry!r}: expected HOST:PORT (the prefiller's pd_host:pd_port)")
    return host.strip("[]").lower(), int(port)


class PDConfirm(msgspec.Struct, frozen=True):
    """Decoder -> prefiller: the decoder is done with ``request_id``'s KV (loaded, failed or aborted)."""

    engine_id: str  # the prefiller's engine id (a confirm for another engine is ignored)
    request_id: str  # the prefiller's request id
    token: str = ""  # the hold's ``kvtier_confirm`` (a confirm without the right one is ignored)


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decoder's KV comes from (parsed from ``kv_transfer_params``)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    prompt_tokens: int
    token: str = ""  # ``kvtier_confirm``: sent back in the confirm

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> "RemotePrefill | None":
        """The remote prefill of ``params``, or None (not a PD decode, or malformed: logged)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return cls(str(params["remote_engine_id"]), str(params["remote_request_id"]),
                       str(params["remote_host"]), int(params["remote_port"]),
                       int(params.get("kvtier_prompt_tokens", 0)), str(params.get("kvtier_confirm", "")))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("kvtier pd: malformed kv_transfer_params %r (%s); the prompt is computed", params, exc)
            return None


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """True for a prefill leg (``do_remote_decode``)."""
    return bool(params and params.get("do_remote_decode"))


def new_confirm_token() -> str:
    """A hold's confirm value: 128 random bits (hex), drawn by the prefiller (:mod:`secrets`)."""
    return secrets.token_hex(16)


def prefill_params(settings: PDSettings, engine_id: str, request_id: str, block_ids: list[int],
                   prompt_tokens: int, confirm_token: str = "") -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefiller returns for the decoder (JSON-serializable);
    ``confirm_token``: the hold's :func:`new_confirm_token`."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": list(block_ids),
        "remote_host": settings.host,
        "remote_port": settings.port,
        "kvtier_prompt_tokens": prompt_tokens,
        "kvtier_confirm": confirm_token,
    }


def partial_key(full_key_of_padded: bytes, num_tokens: int) -> bytes:
    """Key of a prompt's last partial chunk of ``num_tokens`` tokens (32 bytes).

    ``full_key_of_padded`` is the chain key of that chunk padded with token 0 to the
    chunk size (so it covers salt, adapter, images and the whole prefix); the length
    and a domain separate it from any real full chunk.
    """
    return blake3.blake3(_PARTIAL_DOMAIN).update(num_tokens.to_bytes(4, "little")).update(
        full_key_of_padded).digest()


class ConfirmSender:
    """Decoder side: fire-and-forget :class:`PDConfirm` messages over ZMQ PUSH (never blocks).

    An unreachable prefiller loses the confirm; its lease then ends the hold.
    """

    def __init__(self, max_peers: int = 64):
        self._ctx: Any = None
        self._socks: dict[str, Any] = {}
        self._max_peers = max_peers
        self.sent = 0

    def send(self, remote: RemotePrefill) -> None:
        try:
            import zmq

            if self._ctx is None:
                self._ctx = zmq.Context()
            sock = self._socks.get(remote.endpoint)
            if sock is None:
                if len(self._socks) >= self._max_peers:
                    _, old = self._socks.popitem()
                    old.close(linger=0)
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, 10_000)
                sock.connect(remote.endpoint)
                self._socks[remote.endpoint] = sock
            sock.send(msgspec.msgpack.encode(PDConfirm(remote.engine_id, remote.request_id, remote.token)),
                      zmq.NOBLOCK)
            self.sent += 1
        except Exception as exc:  # a lost confirm is covered by the prefiller's lease
            log.warning("kvtier pd: confirm to %s for %s not sent: %s", remote.endpoint, remote.request_id, exc)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=200)
        self._socks = {}
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
