"""Controller-directed P2P: a lower tier that asks the fleet controller which peer holds a prefix.

With static ``peers`` every instance lists every other and each local miss asks all of them.
:class:`DirectedPeerTier` (setting ``peer_discovery``: the controller's HTTP URL) instead
asks the controller once per lookup (``POST /locate``, :mod:`kvtier.controller.ops_locate`):
the controller's index knows which live instance's CPU/disk tiers hold the leading keys and
the peer URL each registered (``Register.peer_url``). The tier then

1. picks the instance with the longest run (never this instance: excluded by ``instance_id``
   when set, else by this process's host and pid, and never a URL of its own ``peer_listen``);
   the controller lists authenticated members only, with their public key, and the peer tier
   then requires the server at that URL to prove exactly that key (:mod:`kvtier.transfer.peer_auth`);
2. answers the run the controller's index gives for that peer, if the pooled connection to it
   (:class:`~kvtier.transfer.peer_open.UrlPeerTier`, dialled and authenticated on first use) is
   open: no request to the peer on the lookup path, only a check that it has not closed the link,
   and remembers which peer holds each key (bounded). The index lags the peer by at most one
   change report, and the peer may evict before the engine loads anyway (nothing is leased on a
   peer), so a chunk the peer no longer holds is a miss of the pull, which the connector treats
   as a failed load (recomputed, never stored over). Asking the peer on every lookup cost a
   second round trip (p50 0.7 ms, p99 3.7 ms in the fleet soak) for a freshness the load cannot keep;
3. serves ``get_many_into`` from the remembered peer (keys it never saw: located first), so the
   storage manager promotes the chunks into its CPU tier as from any lower tier.

The pool holds at most ``max_peers`` peer tiers keyed by URL (least recently used closed first);
an entry unused for ``idle_s`` seconds, or whose URL the controller's last answer no longer
lists (the instance expired or restarted elsewhere), is closed. Every failure (controller
down or slow, a refused token, a peer gone, a timeout, a malformed answer) is a miss, never an
exception: a controller call is bounded by ``timeout_s`` (connect, each read, and the reply body's
deadline; :mod:`~kvtier.transfer.keepalive_http`, a kept-alive connection on the lookup path), a failed
controller is not asked again for ``retry_s`` seconds; each peer call is bounded and backed off
by its :class:`~kvtier.transfer.peer_tier.PeerTier`. The tier is read-only (``writable`` False).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import http.client

import msgspec

from kvtier.protocol.decoding import decode

from kvtier.protocol.fleet import MAX_LOCATE_KEYS, LocateReply, PeerLocation
from kvtier.serde.base import Buffer
from kvtier.tiers.base import TierCounters, check_key
from kvtier.transfer.keepalive_http import KeepAliveClient
from kvtier.transfer.peer_open import UrlPeerTier
from kvtier.transfer.peer_tier import PeerTier, ReadOnlyTier

log = logging.getLogger("kvtier.transfer.peer")

#: Keys whose peer the tier remembers between ``contains_many`` and ``get_many_into`` (LRU).
MAX_ROUTES = 1 << 16


class DirectedPeerTier(ReadOnlyTier):
    """A read-only lower tier that pulls a local miss from the peer the controller names (module doc).

    Args:
        controller_url: the controller's HTTP API, ``http://HOST:PORT`` (or https).
        namespace: this manager's 32-byte namespace digest (``KeyNamespace.digest()``).
        instance_id: this instance's id at the controller (excluded from answers); None: this
            process (host name and pid) is excluded instead.
        token: bearer token for the controller (``controller_token``); None: none.
        timeout_s: bound of each controller request phase and of each peer call, seconds.
        retry_s: after the controller failed, lookups are misses without asking it for this long.
        own_urls: this instance's own peer URLs (``peer_listen``): never pulled from.
        max_peers: most peer connections kept open.
        idle_s: a peer connection unused this long is closed, seconds.
        open_peer: makes the tier for a peer URL and the key it must prove (default:
            ``UrlPeerTier(url, timeout_s, retry_s, credentials, expect=key)``).
        credentials: this instance's fleet key and members (TCP/NIXL peers need them).

    Raises:
        ValueError: a controller URL that is not http(s)://..., a digest that is not 32 bytes, or bad bounds.
    """

    name = "peer"
    kind = "peer"

    def __init__(self, controller_url: str, namespace: bytes, instance_id: str | None = None,
                 token: str | None = None, timeout_s: float = 1.0, retry_s: float = 5.0,
                 own_urls: Sequence[str] = (), max_peers: int = 4, idle_s: float = 60.0,
                 open_peer: Callable[[str, str], PeerTier] | None = None, credentials: Any = None):
        if not controller_url.startswith(("http://", "https://")):
            raise ValueError(f"peer_discovery {controller_url!r} must be the controller's http(s)://HOST:PORT")
        if len(namespace) != 32:
            raise ValueError("namespace must be a 32-byte digest")
        if max_peers < 1 or not timeout_s > 0 or not retry_s > 0 or not idle_s > 0:
            raise ValueError("max_peers must be >= 1 and timeout_s, retry_s, idle_s > 0")
        self.controller_url = controller_url.rstrip("/")
        self.namespace = bytes(namespace)
        self.instance_id = instance_id
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.own_urls = frozenset(own_urls)
        self.max_peers = max_peers
        self.idle_s = idle_s
        self._open_peer = open_peer or (lambda url, key: UrlPeerTier(
            url, timeout_s=timeout_s, retry_s=retry_s, credentials=credentials, expect=key or None))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = KeepAliveClient(self.controller_url, headers=headers, timeout_s=timeout_s)
        self._exclude: dict[str, Any] = (
            {"exclude_instance": instance_id} if instance_id
            else {"exclude_host": socket.gethostname(), "exclude_pid": os.getpid()})
        self._reply = msgspec.json.Decoder(LocateReply)
        self._lock = threading.Lock()
        self._pool: OrderedDict[str, tuple[PeerTier, float]] = OrderedDict()  # url -> (tier, last use)
        self._routes: OrderedDict[bytes, str] = OrderedDict()  # key -> url of the peer that holds it
        self._keys: dict[str, str] = {}  # url -> the public key the controller says its member holds
        self._down_until = 0.0
        self._closed = False
        self.counters = TierCounters()
        self.locates = 0
        self.locate_failures = 0

    @property
    def location(self) -> str:
        return f"controller:{self.controller_url}"

    # -- the controller ---------------------------------------------------------------------------
    def _locate(self, keys: list[bytes]) -> list[PeerLocation] | None:
        """Peers of the namespace, longest run of ``keys`` first (self excluded); None if the controller failed."""
        if self._closed or time.monotonic() < self._down_until:
            self.counters.add(skipped_calls=1)
            return None
        body = {"keys": [k.hex() for k in keys[:MAX_LOCATE_KEYS]], "namespace": self.namespace.hex(), **self._exclude}
        self.locates += 1
        try:
            status, content = self._http.post("/locate", msgspec.json.encode(body))
            if status != 200:
                raise ValueError(f"HTTP {status}: {content[:200].decode('utf-8', 'replace')}")
            reply = decode(self._reply, content)
        except (OSError, http.client.HTTPException, ValueError, msgspec.DecodeError, RuntimeError) as exc:
            self.locate_failures += 1
            self.counters.add(errors=1)
            self._down_until = time.monotonic() + self.retry_s
            log.info("kvtier directed peer tier: controller %s failed (%s); misses for %.1f s",
                     self.controller_url, exc, self.retry_s)
            return None
        rows = [r for r in reply.instances if r.peer_url not in self.own_urls]
        self._keys.update({r.peer_url: r.key for r in reply.instances})
        self._sync_pool({r.peer_url for r in reply.instances})
        return rows

    # -- the peer pool ------------------------------------------------------------------------------
    def _sync_pool(self, listed: set[str]) -> None:
        """Close peers the controller no longer lists and peers idle past ``idle_s``."""
        now = time.monotonic()
        with self._lock:
            gone = [u for u, (t, used) in self._pool.items() if u not in listed or now - used > self.idle_s
                    or getattr(t, "expect", None) != (self._keys.get(u) or None)]  # another member at that URL now
            tiers = [self._pool.pop(u)[0] for u in gone]
            for u in [u for u in self._keys if u not in listed]:
                del self._keys[u]
            unlisted = {u for u in gone if u not in listed}
            if unlisted:  # its chunks are no longer there to pull: forget them (not dialled again)
                for k in [k for k, u in self._routes.items() if u in unlisted]:
                    del self._routes[k]
        for t in tiers:
            t.close()

    def _peer(self, url: str) -> PeerTier | None:
        """The pooled tier for ``url`` (opened on demand; the least recently used closed beyond ``max_peers``)."""
        evicted: list[PeerTier] = []
        with self._lock:
            if self._closed:
                return None
            entry = self._pool.pop(url, None)
            if entry is None:
                try:
                    entry = (self._open_peer(url, self._keys.get(url, "")), 0.0)
                except (ValueError, TypeError) as exc:  # a URL the controller should not have accepted
                    log.warning("kvtier directed peer tier: cannot open peer %r: %s", url, exc)
                    return None
            self._pool[url] = (entry[0], time.monotonic())
            while len(self._pool) > self.max_peers:
                evicted.append(self._pool.popitem(last=False)[1][0])
        for t in evicted:
            t.close()
        return entry[0]

    @property
    def pool_urls(self) -> list[str]:
        """URLs of the open peer tiers, least recently used first."""
        with self._lock:
            return list(self._pool)

    def _remember(self, keys: Sequence[bytes], found: Sequence[bool], url: str) -> None:
        with self._lock:
            for k, f in zip(keys, found):
                if f:
                    self._routes[k] = url
                    self._routes.move_to_end(k)
            while len(self._routes) > MAX_ROUTES:
                self._routes.popitem(last=False)

    # -- LowerTier ----------------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        keys = [bytes(k) for k in keys]
        for k in keys:
            check_key(k)
        self.counters.add(contains_keys=len(keys))
        if not keys or any(len(k) != 32 for k in keys):
            return [False] * len(keys)
        try:
            found = self._contains(keys)
        except Exception:  # a bug here must stay a miss, never reach the engine
            log.exception("kvtier directed peer tier: lookup failed")
            found = [False] * len(keys)
        self.counters.add(contains_hits=sum(found))
        return found

    def _contains(self, keys: list[bytes]) -> list[bool]:
        rows = self._locate(keys)
        if not rows or rows[0].chunks <= 0:
            return [False] * len(keys)
        url = rows[0].peer_url
        peer = self._peer(url)
        if peer is None or not peer.ready():  # a peer that closed its link or is backed off: a miss
            return [False] * len(keys)
        n = min(rows[0].chunks, len(keys))  # the index's run (module doc, step 2)
        self._remember(keys[:n], [True] * n, url)
        return [True] * n + [False] * (len(keys) - n)

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        keys = [bytes(k) for k, _ in items]
        for k in keys:
            check_key(k)
        self.counters.add(gets=len(keys))
        try:
            got = self._get(keys, items)
        except Exception:
            log.exception("kvtier directed peer tier: pull failed")
            got = [False] * len(keys)
        hits = sum(got)
        self.counters.add(get_hits=hits, get_misses=len(keys) - hits)
        return got

    def _get(self, keys: list[bytes], items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        with self._lock:
            routes = [self._routes.get(k) for k in keys]
        unknown = [i for i, u in enumerate(routes) if u is None]
        if unknown and all(len(keys[i]) == 32 for i in unknown):
            rows = self._locate([keys[i] for i in unknown])
            if rows and rows[0].chunks > 0:
                for i in unknown:
                    routes[i] = rows[0].peer_url
        out = [False] * len(keys)
        for url in dict.fromkeys(u for u in routes if u is not None):
            idx = [i for i, u in enumerate(routes) if u == url]
            peer = self._peer(url)
            if peer is None:
                continue
            res = peer.get_many_into([items[i] for i in idx])
            for i, ok in zip(idx, res):
                out[i] = bool(ok)
            if not all(res):  # the peer lost them (or failed): ask the controller again next time
                with self._lock:
                    for i, ok in zip(idx, res):
                        if not ok:
                            self._routes.pop(keys[i], None)
        return out

    def close(self) -> None:
        """Close every pooled peer and the HTTP client (idempotent); later calls are misses."""
        with self._lock:
            self._closed = True
            tiers = [t for t, _ in self._pool.values()]
            self._pool.clear()
            self._routes.clear()
        for t in tiers:
            t.close()
        self._http.close()

    def stats(self) -> dict[str, Any]:
        return {**self.counters.snapshot(), "location": self.location, "peers": self.pool_urls,
                "locates": self.locates, "locate_failures": self.locate_failures}


def open_directed_peer_tier(config: Any, namespace: bytes) -> DirectedPeerTier:
    """The controller-directed peer tier of ``config`` (``peer_discovery``, ``instance_id``,
    ``controller_token``, ``peer_timeout_s``, ``peer_retry_s``, ``peer_listen``). Contacts nothing here.

    Raises:
        ValueError: see :class:`DirectedPeerTier`.
    """
    from kvtier.transfer.peer_open import peer_credentials

    own = (config.peer_listen,) if getattr(config, "peer_listen", None) else ()
    return DirectedPeerTier(config.peer_discovery, namespace, instance_id=config.instance_id,
                            token=config.controller_token, timeout_s=config.peer_timeout_s,
                            retry_s=config.peer_retry_s, own_urls=own, credentials=peer_credentials(config))
