"""The fleet's credentials: each node's key pair and the members a node admits.

Trust model (README, "Running a fleet: the trust model"):

- **Identity is a key, never a claimed name.** Every kvtier node of a fleet (controller, ``kvtier
  server``, embedded connector, router) has its own Curve25519 key pair (:class:`FleetKey`), kept in
  an owner-only file (0600 in a directory only its user can write). The 40-character Z85 public key
  is what other nodes know it by.
- **Membership is a list the operator writes.** An authorized-members file (or a directory of such
  files), one member per line (:func:`parse_members`)::

      # name      public key (Z85, 40 characters)        options (all optional)
      prefill-1   rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7  models=org/* salts=-,tenant-a roles=register,peer

  ``roles`` (default all of :data:`ROLES`): ``register`` (may register with the controller),
  ``peer`` (may pull from and serve to peer servers), ``events`` (may subscribe to KV event
  streams). ``models``: glob patterns (:func:`fnmatch.fnmatchcase`) on ``KeyNamespace.model``
  the member may register and pull (default ``*``). ``salts``: the ``cache_salt`` values whose
  chains it may pull from peers (``-`` is "no salt"; default: any). ``ids``: glob patterns of the
  instance ids it may register (default ``*``). Removing a line revokes the member: the file is
  re-read when it changes (:class:`Members`, at most once per ``reload_s``), and every check
  consults the current table, so established sessions of a revoked key stop being served too.
- **Every connection proves its key.** The controller's agent endpoint and KV event publishers use
  ZeroMQ CURVE (RFC 26/CurveZMQ; libsodium inside libzmq) with a ZAP handler admitting only current
  members with the right role (:class:`CurveGate`, on pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator`);
  the authenticated key arrives with every message as its ``User-Id`` (:func:`sender_key`; the CURVE
  helpers live in :mod:`kvtier.protocol.curve` and are re-exported here). Peer
  transfer links run a mutual handshake over the same keys (:mod:`kvtier.transfer.peer_auth`).

Nothing here opens a connection. Raises :class:`TrustError` for bad or unsafe credentials (a key
file others can read, a members file others can write, a malformed line: the message names the file
and line).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)

#: What a member may do (the ``roles=`` option; default: all).
ROLES = ("register", "peer", "events")
#: Length of a Z85-encoded 32-byte Curve25519 key.
Z85_KEY_CHARS = 40
#: Most members one file or directory may list (a bound on what a typo or a hostile file can cost).
MAX_MEMBERS = 4096
#: Largest authorized-members file read (bytes).
MAX_MEMBERS_FILE_BYTES = 4 << 20
#: Default minimum seconds between two checks of a members file for changes.
DEFAULT_RELOAD_S = 1.0
_NO_SALT = "-"


class TrustError(ValueError):
    """Bad or unsafe credentials: the message names the file (and line) and what to change."""


def _z85() -> Any:
    from zmq.utils import z85

    return z85


def check_public_key(key: str, where: str = "public key") -> str:
    """``key`` if it is a Z85 Curve25519 public key (40 characters that decode to 32 bytes).

    Raises:
        TrustError: naming ``where``.
    """
    if not isinstance(key, str) or len(key) != Z85_KEY_CHARS:
        raise TrustError(f"{where}: a public key is {Z85_KEY_CHARS} Z85 characters, got {str(key)[:48]!r}")
    try:
        raw = _z85().decode(key.encode("ascii"))
    except (ValueError, KeyError, UnicodeEncodeError, IndexError):
        raise TrustError(f"{where}: {key!r} is not Z85") from None
    if len(raw) != 32:
        raise TrustError(f"{where}: {key!r} does not decode to 32 bytes")
    return key


def key_bytes(key: str) -> bytes:
    """The 32 raw bytes of a Z85 key."""
    return bytes(_z85().decode(key.encode("ascii")))


def key_text(raw: bytes) -> str:
    """The Z85 text of 32 raw key bytes."""
    return bytes(_z85().encode(bytes(raw))).decode("ascii")


def check_private_file(path: Path, what: str) -> os.stat_result:
    """Refuse a secret file (``what``) that is not a regular file owned by this user with no group or
    other access, or that lies in a directory other users may write (they could swap it).

    Raises:
        TrustError: naming the path and the fix (``chmod 600``).
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TrustError(f"{what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TrustError(f"{what} {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise TrustError(f"{what} {path} belongs to uid {st.st_uid}, not this user ({os.geteuid()})")
    if st.st_mode & 0o077:
        raise TrustError(f"{what} {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    _check_dir_safe(path.parent, what)
    return st


def _check_dir_safe(directory: Path, what: str) -> None:
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise TrustError(f"{what}: directory {directory}: {exc.strerror}") from None
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & 0o022 and not sticky:
        raise TrustError(f"{what}: directory {directory} is writable by other users: chmod go-w it")
    if st.st_uid not in (os.geteuid(), 0):
        raise TrustError(f"{what}: directory {directory} belongs to uid {st.st_uid}, not this user or root")


@dataclass(frozen=True)
class FleetKey:
    """One node's Curve25519 key pair (Z85 text; the format of ZeroMQ CURVE and pyzmq's certificates).

    Attributes:
        public: the public key, 40 Z85 characters: what members files list.
        secret: the secret key, 40 Z85 characters (never logged; not in ``repr``).
        name: a label written into the key file (informational).
    """

    public: str
    secret: str = field(repr=False)
    name: str = ""

    @classmethod
    def generate(cls, name: str = "") -> "FleetKey":
        """A fresh key pair (libsodium's ``crypto_box_keypair`` through libzmq)."""
        import zmq

        public, secret = zmq.curve_keypair()
        return cls(public.decode("ascii"), secret.decode("ascii"), name)

    @property
    def public_raw(self) -> bytes:
        return key_bytes(self.public)

    @property
    def secret_raw(self) -> bytes:
        return key_bytes(self.secret)

    def save(self, path: Path | str) -> Path:
        """Write the pair to ``path`` (0600; its directory created 0700), in pyzmq's certificate format
        (``zmq.auth.load_certificate`` reads it). Never overwrites.

        Raises:
            TrustError: ``path`` exists or cannot be written.
        """
        path = Path(path).expanduser()
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise TrustError(f"fleet key {path} exists already (remove it first to make a new one)") from None
        except OSError as exc:
            raise TrustError(f"fleet key {path}: {exc.strerror}") from None
        with os.fdopen(fd, "w") as f:
            f.write("#   kvtier fleet key: ZeroMQ CURVE secret certificate. Keep it private (0600).\n"
                    "#   Other nodes list only its public key in their authorized-members files.\n\n"
                    f"metadata\n    name = \"{self.name}\"\ncurve\n"
                    f"    public-key = \"{self.public}\"\n    secret-key = \"{self.secret}\"\n")
        return path

    @classmethod
    def load(cls, path: Path | str) -> "FleetKey":
        """Read a key file written by :meth:`save` (or by pyzmq / czmq with a secret key).

        Raises:
            TrustError: missing, unsafe (see :func:`check_private_file`), or without both keys.
        """
        path = Path(path).expanduser()
        check_private_file(path, "fleet key")
        fields: dict[str, str] = {}
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TrustError(f"fleet key {path}: {exc}") from None
        for line in text.splitlines():
            name, eq, value = line.strip().partition("=")
            if eq:
                fields[name.strip()] = value.strip().strip('"')
        public, secret = fields.get("public-key", ""), fields.get("secret-key", "")
        if not public or not secret:
            raise TrustError(f"fleet key {path} has no public-key and secret-key (make one: kvtier keys new {path})")
        check_public_key(public, f"fleet key {path}")
        check_public_key(secret, f"fleet key {path} (secret)")
        key = cls(public, secret, fields.get("name", ""))
        if _curve_public(secret) != public:
            raise TrustError(f"fleet key {path}: its public key does not belong to its secret key")
        return key

    @classmethod
    def load_or_create(cls, path: Path | str, name: str = "") -> "FleetKey":
        """:meth:`load`, or :meth:`generate` and :meth:`save` when ``path`` does not exist (logged with
        the public key the operator then adds to the members files)."""
        path = Path(path).expanduser()
        if not path.exists():
            key = cls.generate(name)
            try:
                key.save(path)
            except TrustError:
                if path.exists():  # another process of this instance (a TP rank) made it first
                    return cls.load(path)
                raise
            log.warning("kvtier: created fleet key %s; its public key is %s (add it to the fleet's "
                        "authorized-members files)", path, key.public)
            return key
        return cls.load(path)


def _curve_public(secret: str) -> str:
    import zmq

    return zmq.curve_public(secret.encode("ascii")).decode("ascii")


@dataclass(frozen=True)
class Member:
    """One authorized member (a line of a members file; see the module docstring).

    Attributes:
        name: its label (logs, ``/instances``).
        public: its Z85 public key.
        roles: what it may do (subset of :data:`ROLES`).
        models: globs on ``KeyNamespace.model`` it may register and pull.
        salts: ``cache_salt`` values (None: no salt) whose chains it may pull; None: any.
        ids: globs of the instance ids it may register.
    """

    name: str
    public: str
    roles: frozenset[str] = frozenset(ROLES)
    models: tuple[str, ...] = ("*",)
    salts: tuple[str | None, ...] | None = None
    ids: tuple[str, ...] = ("*",)

    def may(self, role: str) -> bool:
        return role in self.roles

    def allows_model(self, model: str) -> bool:
        """True if ``model`` (a ``KeyNamespace.model``) matches one of :attr:`models`."""
        return any(fnmatch.fnmatchcase(model, pat) for pat in self.models)

    def allows_id(self, instance: str) -> bool:
        return any(fnmatch.fnmatchcase(instance, pat) for pat in self.ids)

    def lineages(self, namespace: Any) -> frozenset[bytes] | None:
        """The lineage markers (``KeyNamespace.lineage(salt)``) of the salts this member may pull in
        ``namespace``; None when any salt is allowed."""
        if self.salts is None:
            return None
        return frozenset(namespace.lineage(s) for s in self.salts)

    @property
    def unrestricted(self) -> bool:
        """No model and no salt restriction."""
        return self.models == ("*",) and self.salts is None


def _parse_line(line: str, where: str) -> Member:
    parts = line.split()
    if len(parts) < 2:
        raise TrustError(f"{where}: expected 'NAME PUBLIC_KEY [roles=...] [models=...] [salts=...] [ids=...]'")
    name, public, options = parts[0], parts[1], parts[2:]
    check_public_key(public, where)
    kw: dict[str, Any] = {}
    for opt in options:
        k, eq, v = opt.partition("=")
        values = tuple(x for x in v.split(",") if x)
        if not eq or not values:
            raise TrustError(f"{where}: option {opt!r} must be KEY=VALUE[,VALUE...]")
        if k == "roles":
            bad = [r for r in values if r not in ROLES]
            if bad:
                raise TrustError(f"{where}: unknown role {bad[0]!r}; roles are {', '.join(ROLES)}")
            kw["roles"] = frozenset(values)
        elif k == "models":
            kw["models"] = values
        elif k == "salts":
            kw["salts"] = None if values == ("*",) else tuple(None if s == _NO_SALT else s for s in values)
        elif k == "ids":
            kw["ids"] = values
        else:
            raise TrustError(f"{where}: unknown option {k!r} (roles, models, salts, ids)")
    return Member(name, public, **kw)


def parse_members(text: str, source: str = "members") -> dict[str, Member]:
    """Members by public key from a members file's text (a line starting with ``#`` is a comment).

    Raises:
        TrustError: a malformed line, a key listed twice, more than :data:`MAX_MEMBERS` members.
    """
    out: dict[str, Member] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()  # Z85 uses '#': only whole lines are comments
        if not line or line.startswith("#"):
            continue
        member = _parse_line(line, f"{source}:{n}")
        if member.public in out:
            raise TrustError(f"{source}:{n}: key of {member.name!r} is listed twice")
        out[member.public] = member
        if len(out) > MAX_MEMBERS:
            raise TrustError(f"{source}: more than {MAX_MEMBERS} members")
    return out


class Members:
    """The members a node admits: a members file or a directory of them, re-read when it changes.

    Args:
        path: a file, or a directory whose regular files (names not starting with ``.``) are read
            in name order; None with ``members``: a fixed table (tests, embedding).
        reload_s: least seconds between two checks for a change (a ``stat`` of the file or each
            file of the directory).
        members: the fixed table when ``path`` is None.

    Raises:
        TrustError: the path is unsafe (writable by other users) or its first read fails.
    """

    def __init__(self, path: Path | str | None = None, reload_s: float = DEFAULT_RELOAD_S,
                 members: Iterable[Member] = ()):
        self.path = Path(path).expanduser() if path is not None else None
        self.reload_s = reload_s
        self._lock = threading.Lock()
        self._stamp: tuple[Any, ...] | None = None
        self._checked = 0.0
        self._table: dict[str, Member] = {m.public: m for m in members}
        self.reloads = 0
        self.reload_errors = 0
        if self.path is not None:
            self._table = self._read(self._files())
            self._stamp = self._stamp_of(self._files())
            self._checked = time.monotonic()

    @classmethod
    def of(cls, *members: Member) -> "Members":
        """A fixed table (no file)."""
        return cls(None, members=members)

    def _files(self) -> list[Path]:
        assert self.path is not None
        if self.path.is_dir():
            return sorted(p for p in self.path.iterdir() if p.is_file() and not p.name.startswith("."))
        return [self.path]

    @staticmethod
    def _stamp_of(files: list[Path]) -> tuple[Any, ...]:
        out: list[tuple[Any, ...]] = []
        for p in files:
            try:
                st = os.stat(p)
                out.append((str(p), st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append((str(p), None))
        return tuple(out)

    def _read(self, files: list[Path]) -> dict[str, Member]:
        assert self.path is not None
        if not self.path.exists():
            raise TrustError(f"authorized members {self.path}: no such file or directory")
        table: dict[str, Member] = {}
        for p in files:
            st = os.stat(p)
            if st.st_mode & 0o022:
                raise TrustError(f"authorized members {p} is writable by other users: chmod go-w it")
            if st.st_uid not in (os.geteuid(), 0):
                raise TrustError(f"authorized members {p} belongs to uid {st.st_uid}, not this user or root")
            if st.st_size > MAX_MEMBERS_FILE_BYTES:
                raise TrustError(f"authorized members {p} is larger than {MAX_MEMBERS_FILE_BYTES} bytes")
            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TrustError(f"authorized members {p}: {exc}") from None
            for public, m in parse_members(text, str(p)).items():
                if public in table:
                    raise TrustError(f"authorized members {p}: key of {m.name!r} is listed in another file too")
                table[public] = m
            if len(table) > MAX_MEMBERS:
                raise TrustError(f"authorized members {self.path}: more than {MAX_MEMBERS} members")
        _check_dir_safe(self.path if self.path.is_dir() else self.path.parent, "authorized members")
        return table

    def current(self) -> Mapping[str, Member]:
        """The members now (public key -> member), re-read first if the file changed and ``reload_s``
        passed since the last check. A file that no longer parses keeps the last good table (logged)."""
        if self.path is None:
            return self._table
        now = time.monotonic()
        with self._lock:
            if now - self._checked < self.reload_s:
                return self._table
            self._checked = now
            try:
                files = self._files()
                stamp = self._stamp_of(files)
                if stamp != self._stamp:
                    self._stamp = stamp
                    self._table = self._read(files)
                    self.reloads += 1
                    log.info("kvtier: authorized members %s reloaded (%d members)", self.path, len(self._table))
            except (TrustError, OSError) as exc:
                self.reload_errors += 1
                log.error("kvtier: authorized members %s not reloaded, the last good list stays: %s", self.path, exc)
            return self._table

    def get(self, public: str) -> Member | None:
        """The current member with this Z85 public key, or None."""
        return self.current().get(public)

    def admits(self, public: str, role: str) -> bool:
        """True if ``public`` is a current member with ``role``."""
        m = self.get(public)
        return m is not None and m.may(role)

    def __len__(self) -> int:
        return len(self.current())


@dataclass(frozen=True)
class Credentials:
    """What a node needs to take part in an authenticated fleet: its own key and who it admits."""

    key: FleetKey
    members: Members

    @classmethod
    def from_paths(cls, key_path: Path | str, members_path: Path | str, name: str = "") -> "Credentials":
        """Load (or create) the key at ``key_path`` and the members at ``members_path``.

        Raises:
            TrustError: see :meth:`FleetKey.load` and :class:`Members`.
        """
        return cls(FleetKey.load_or_create(key_path, name), Members(members_path))


def credentials_from_config(config: Any) -> Credentials | None:
    """The node's :class:`Credentials` from a :class:`kvtier.config.KVTierConfig` (``fleet_key`` and
    ``fleet_members``), or None when neither is set.

    Raises:
        TrustError: only one of the two set, or either unusable.
    """
    key_path = getattr(config, "fleet_key", None)
    members_path = getattr(config, "fleet_members", None)
    if key_path is None and members_path is None:
        return None
    if key_path is None or members_path is None:
        raise TrustError("fleet_key and fleet_members go together (this node's key, and who it admits)")
    return Credentials.from_paths(key_path, members_path)


__all__ = [
    "ROLES", "Credentials", "FleetKey", "Member", "Members", "TrustError", "check_private_file", "check_public_key",
    "credentials_from_config", "key_bytes", "key_text", "parse_members",
]
