"""Mutual authentication of a peer transfer link with the fleet keys (:mod:`kvtier.protocol.trust`).

Both ends hold a static Curve25519 key pair (their :class:`~kvtier.protocol.trust.FleetKey`, the
same keys ZeroMQ CURVE uses) and admit only current members of their authorized-members list with
the ``peer`` role. The handshake is three frames on the channel's own socket, before any request::

    client -> server   Hello(kind, version, key=C, eph=Ce)
    server -> client   Hello(kind, version, key=S, eph=Se, mac=HMAC(k, "server" || T))   or Refused(reason)
    client -> server   Proof(mac=HMAC(k, "client" || T))                              (server: Refused on failure)

with ``T`` = ``"kvtier-peer-auth/v1" || kind || C || Ce || S || Se`` and ``k`` = HKDF-SHA256 of
``X25519(Ce, Se) || X25519(Ce, S) || X25519(C, Se)`` (info ``T``). Only the holder of ``S``'s
secret can compute the second term, only the holder of ``C``'s secret the third; fresh ephemeral
keys on both sides make every transcript new, so a recorded handshake cannot be replayed. The mix
of DH terms is the ``ee, es, se`` of the Noise Protocol Framework's KK/XX patterns (Perrin, "The
Noise Protocol Framework", rev. 34, 2018); the MACs take the place of Noise's encrypted payloads
because the link itself is not encrypted: authentication proves *who* is at the other end at
connect time; payloads then travel in clear with their xxh3 checksums, like every kvtier channel
(run the fleet on a private network or under WireGuard/IPsec if an on-path attacker is in scope).

Primitives from ``cryptography`` (X25519, HKDF, HMAC-SHA256: OpenSSL's audited implementations)
rather than own code. A server refuses a client before doing any DH if its static key is not a
current member with the ``peer`` role, so strangers cost one dictionary lookup.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.protocol.trust import Credentials, Member, key_text
from kvtier.transfer.errors import PeerRefused

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

_LABEL = b"kvtier-peer-auth/v1"
KEY_BYTES = 32
MAC_BYTES = 32


def _x25519() -> tuple[type[X25519PrivateKey], type[X25519PublicKey]]:
    # imported on first use: only authenticated links need cryptography
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    return X25519PrivateKey, X25519PublicKey


def _dh(secret: bytes, public: bytes) -> bytes:
    priv_cls, pub_cls = _x25519()
    try:
        return priv_cls.from_private_bytes(secret).exchange(pub_cls.from_public_bytes(public))
    except ValueError as exc:  # a low-order point: an all-zero shared secret
        raise PeerRefused(f"peer authentication failed: bad public key ({exc})") from None


def _ephemeral() -> tuple[bytes, bytes]:
    """A fresh X25519 pair (secret, public), raw bytes."""
    priv_cls, _ = _x25519()
    secret = os.urandom(KEY_BYTES)
    return secret, priv_cls.from_private_bytes(secret).public_key().public_bytes_raw()


def transcript(kind: str, c: bytes, ce: bytes, s: bytes, se: bytes) -> bytes:
    """The bytes both MACs cover (see the module docstring)."""
    return _LABEL + len(kind).to_bytes(1, "big") + kind.encode() + c + ce + s + se


def _session_key(ikm: bytes, t: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=t).derive(ikm)


def _mac(k: bytes, who: bytes, t: bytes) -> bytes:
    return hmac.new(k, who + t, hashlib.sha256).digest()


def _check_len(value: bytes, what: str) -> None:
    if len(value) != KEY_BYTES:
        raise PeerRefused(f"peer authentication failed: {what} is {len(value)} bytes, not {KEY_BYTES}")


@dataclass
class ClientAuth:
    """The dialling side's part of the handshake.

    Args:
        creds: this node's key and the members it admits.
        expect: the Z85 public key the server must hold (controller-directed P2P knows it from the
            controller); None: any current member with the ``peer`` role.
    """

    creds: Credentials
    expect: str | None = None

    def __post_init__(self) -> None:
        self._eph_secret, self.eph = _ephemeral()
        self.server: Member | None = None

    @property
    def key(self) -> bytes:
        return self.creds.key.public_raw

    def answer(self, kind: str, server_key: bytes, server_eph: bytes, server_mac: bytes) -> bytes:
        """Check the server's Hello; the client's proof MAC to send.

        Raises:
            PeerRefused: the server is not the expected key or not a current member with ``peer``,
                or its MAC is wrong (it does not hold that key).
        """
        if not server_key:
            raise PeerRefused("the peer server is not authenticated (it has no fleet key); refusing it")
        _check_len(server_key, "the server's key")
        _check_len(server_eph, "the server's ephemeral key")
        public = key_text(server_key)
        if self.expect is not None and public != self.expect:
            raise PeerRefused(f"the peer server holds key {public}, not the expected {self.expect}")
        member = self.creds.members.get(public)
        if member is None or not member.may("peer"):
            raise PeerRefused(f"the peer server's key {public} is not a fleet member with the peer role")
        t = transcript(kind, self.key, self.eph, server_key, server_eph)
        ikm = (_dh(self._eph_secret, server_eph) + _dh(self._eph_secret, server_key)
               + _dh(self.creds.key.secret_raw, server_eph))
        k = _session_key(ikm, t)
        if not hmac.compare_digest(_mac(k, b"server", t), server_mac):
            raise PeerRefused(f"the peer server did not prove it holds key {public}")
        self.server = member
        return _mac(k, b"client", t)


class ServerAuth:
    """The accepting side's part of one handshake.

    Args:
        creds: this node's key and the members it admits.
    """

    def __init__(self, creds: Credentials):
        self.creds = creds
        self.member: Member | None = None
        self._expect_mac = b""

    def hello(self, kind: str, client_key: bytes, client_eph: bytes) -> tuple[bytes, bytes, bytes]:
        """Check the client's Hello; ``(key, eph, mac)`` of the server's Hello.

        Raises:
            PeerRefused: the client is not a current member with the ``peer`` role (checked before any
                DH), or sent malformed keys.
        """
        if not client_key:
            raise PeerRefused("this peer server admits fleet members only: set fleet_key and fleet_members")
        _check_len(client_key, "the client's key")
        _check_len(client_eph, "the client's ephemeral key")
        public = key_text(client_key)
        member = self.creds.members.get(public)
        if member is None or not member.may("peer"):
            raise PeerRefused(f"key {public} is not a fleet member with the peer role here")
        eph_secret, eph = _ephemeral()
        me = self.creds.key
        t = transcript(kind, client_key, client_eph, me.public_raw, eph)
        ikm = _dh(eph_secret, client_eph) + _dh(me.secret_raw, client_eph) + _dh(eph_secret, client_key)
        k = _session_key(ikm, t)
        self._expect_mac = _mac(k, b"client", t)
        self._pending = member
        return me.public_raw, eph, _mac(k, b"server", t)

    def proof(self, mac: bytes) -> Member:
        """Check the client's proof; the authenticated member.

        Raises:
            PeerRefused: a wrong MAC (the client does not hold the key it named).
        """
        if not self._expect_mac or not hmac.compare_digest(self._expect_mac, mac):
            raise PeerRefused("the peer did not prove it holds the key it named")
        self.member = self._pending
        return self.member
