"""Fleet keys and an authorized-members file for tests, demos and benchmarks (:mod:`kvtier.protocol.trust`).

:func:`make_fleet` writes one key per member name under a directory (owner-only key files) and a
``members`` file listing them all; :class:`FleetKeys` then hands out each member's
:class:`~kvtier.protocol.trust.Credentials` or its config settings, and edits the members file
(:meth:`FleetKeys.set_options`, :meth:`FleetKeys.revoke`) the way an operator would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvtier.protocol.trust import Credentials, FleetKey, Members


@dataclass
class FleetKeys:
    """Keys and the members file of a test fleet (see :func:`make_fleet`)."""

    root: Path
    keys: dict[str, FleetKey]
    options: dict[str, str] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)

    @property
    def members_path(self) -> Path:
        return self.root / "members"

    def key_path(self, name: str) -> Path:
        return self.root / f"{name}.key"

    def public(self, name: str) -> str:
        return self.keys[name].public

    def credentials(self, name: str, reload_s: float = 0.0) -> Credentials:
        """``name``'s key and the members file (re-read at every check when ``reload_s`` is 0)."""
        return Credentials(self.keys[name], Members(self.members_path, reload_s=reload_s))

    def config(self, name: str) -> dict[str, Any]:
        """``name``'s settings: ``fleet_key`` and ``fleet_members``."""
        return {"fleet_key": str(self.key_path(name)), "fleet_members": str(self.members_path)}

    def add(self, name: str, options: str = "") -> FleetKey:
        """A new member (its key file written, listed in the members file)."""
        key = FleetKey.generate(name)
        key.save(self.key_path(name))
        self.keys[name] = key
        if options:
            self.options[name] = options
        self.write()
        return key

    def set_options(self, name: str, options: str) -> None:
        """Replace ``name``'s options (``"models=a/* salts=-"``) in the members file."""
        self.options[name] = options
        self.write()

    def revoke(self, name: str) -> None:
        """Remove ``name``'s line from the members file (its key stays on disk)."""
        self.revoked.add(name)
        self.write()

    def write(self) -> None:
        lines = [f"{n} {k.public} {self.options.get(n, '')}".rstrip()
                 for n, k in self.keys.items() if n not in self.revoked]
        tmp = self.members_path.with_name(".members.tmp")
        tmp.write_text("# kvtier test fleet\n" + "\n".join(lines) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.members_path)  # a new inode: a reader sees the whole file or the old one


def make_fleet(root: Path | str, names: Sequence[str], options: dict[str, str] | None = None) -> FleetKeys:
    """Keys for ``names`` under ``root`` (created 0700) and a members file listing them.

    Args:
        options: member name -> its options in the members file (e.g. ``"models=org/*"``).
    """
    root = Path(root)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fleet = FleetKeys(root, {}, dict(options or {}))
    for name in names:
        key = FleetKey.generate(name)
        key.save(fleet.key_path(name))
        fleet.keys[name] = key
    fleet.write()
    return fleet
