"""HTTP client of the controller API (what ``kvtier ctl`` uses)."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import httpx

from kvtier.controller.server import DEFAULT_HTTP_PORT, TOKEN_ENV
from kvtier.urls import mask_url

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_HTTP_PORT}"


class ControllerClientError(RuntimeError):
    """The controller refused a request or could not be reached.

    Attributes:
        status: HTTP status (0: not reached).
    """

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


class ControllerClient:
    """Synchronous client.

    Args:
        url: controller base URL (default ``http://127.0.0.1:7601``).
        token: bearer token (None: ``$KVTIER_CONTROLLER_TOKEN``; "": none).
        timeout_s: per-request timeout (seconds).
    """

    def __init__(self, url: str = DEFAULT_URL, token: Optional[str] = None, timeout_s: float = 30.0):
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
        except httpx.InvalidURL as exc:  # not an httpx.HTTPError
            raise ControllerClientError(f"controller URL {mask_url(url)!r} is not a URL: {exc}") from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ControllerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _req(self, method: str, path: str, body: Optional[dict[str, Any]] = None,
             params: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        try:
            r = self._http.request(method, path, json=body, params=params)
        except httpx.InvalidURL as exc:  # e.g. an argument that makes the URL too long
            raise ControllerClientError(f"cannot ask the controller {method} {path[:80]}: {exc}") from None
        except httpx.HTTPError as exc:
            raise ControllerClientError(f"controller at {mask_url(str(self._http.base_url))} not reachable: {exc}") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            if r.status_code == 401:  # say how a token is given, not only that it is wrong
                detail = f"{detail} (pass --token or set KVTIER_CONTROLLER_TOKEN)"
            raise ControllerClientError(f"HTTP {r.status_code}: {detail}", r.status_code)
        if path == "/metrics":
            return {"text": r.text}
        return r.json()

    def lookup(self, tokens: Optional[Sequence[int]] = None, keys: Optional[Sequence[str]] = None,
               cache_salt: Optional[str] = None, instance: Optional[str] = None) -> dict[str, Any]:
        return self._req("POST", "/lookup", _drop_none({"tokens": None if tokens is None else list(tokens),
                                                        "keys": None if keys is None else list(keys),
                                                        "cache_salt": cache_salt, "instance": instance}))

    def clear(self, instance: Optional[str] = None, tier: Optional[str] = None, cache_salt: Optional[str] = None,
              wait: bool = False) -> dict[str, Any]:
        return self._req("POST", "/clear", _drop_none({"instance": instance, "tier": tier, "cache_salt": cache_salt,
                                                       "wait": wait}))

    def pin(self, tokens: Sequence[int], instance: Optional[str] = None, ttl_s: Optional[float] = None,
            cache_salt: Optional[str] = None, wait: bool = False) -> dict[str, Any]:
        return self._req("POST", "/pin", _drop_none({"tokens": list(tokens), "instance": instance, "ttl_s": ttl_s,
                                                     "cache_salt": cache_salt, "wait": wait}))

    def unpin(self, tokens: Optional[Sequence[int]] = None, instance: Optional[str] = None,
              pin_id: Optional[str] = None, cache_salt: Optional[str] = None, wait: bool = False) -> dict[str, Any]:
        return self._req("POST", "/unpin", _drop_none({"tokens": None if tokens is None else list(tokens),
                                                       "instance": instance, "pin_id": pin_id,
                                                       "cache_salt": cache_salt, "wait": wait}))

    def move(self, tokens: Sequence[int], from_instance: str, to_tier: str, to_instance: Optional[str] = None,
             from_tier: Optional[str] = None, copy: bool = False, cache_salt: Optional[str] = None,
             wait: bool = False) -> dict[str, Any]:
        return self._req("POST", "/move", _drop_none({
            "tokens": list(tokens), "from_instance": from_instance, "from_tier": from_tier,
            "to_instance": to_instance, "to_tier": to_tier, "copy": copy, "cache_salt": cache_salt, "wait": wait}))

    def compress(self, tokens: Sequence[int], codec: str, instance: Optional[str] = None, tier: Optional[str] = None,
                 cache_salt: Optional[str] = None, wait: bool = False) -> dict[str, Any]:
        return self._req("POST", "/compress", _drop_none({"tokens": list(tokens), "codec": codec, "instance": instance,
                                                          "tier": tier, "cache_salt": cache_salt, "wait": wait}))

    def decompress(self, tokens: Sequence[int], instance: Optional[str] = None, tier: Optional[str] = None,
                   cache_salt: Optional[str] = None, wait: bool = False) -> dict[str, Any]:
        return self._req("POST", "/decompress", _drop_none({"tokens": list(tokens), "instance": instance, "tier": tier,
                                                            "cache_salt": cache_salt, "wait": wait}))

    def health(self, instance: Optional[str] = None, live: bool = False) -> dict[str, Any]:
        return self._req("GET", "/health", params=_drop_none({"instance": instance, "live": str(live).lower()}))

    def instances(self) -> dict[str, Any]:
        return self._req("GET", "/instances")

    def locate(self, keys: Sequence[str], namespace: str, exclude_instance: Optional[str] = None) -> dict[str, Any]:
        """``POST /locate``: hex chunk keys and hex namespace digest -> live peer-serving instances, longest run first."""
        return self._req("POST", "/locate", _drop_none({"keys": list(keys), "namespace": namespace,
                                                        "exclude_instance": exclude_instance}))

    def check_finish(self, event_id: str) -> dict[str, Any]:
        return self._req("GET", f"/check_finish/{event_id}")

    def metrics(self) -> str:
        return self._req("GET", "/metrics")["text"]
