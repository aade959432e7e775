"""The page's static files (``kvtier/dashboard/static``), read once and served from memory.

Only files present in the package at start are served (a fixed name -> bytes map: no path
from a request ever reaches the filesystem).
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
#: URL prefix of the assets.
STATIC_URL = "/dashboard/static/"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8",
          ".LICENSE": "text/plain; charset=utf-8"}


class Assets:
    """``{relative name: (content type, bytes)}`` of the static folder."""

    def __init__(self, root: Path = STATIC_DIR):
        self.files: dict[str, tuple[str, bytes]] = {}
        for p in sorted(root.rglob("*")):
            if p.is_file():
                self.files[p.relative_to(root).as_posix()] = (_TYPES.get(p.suffix, "application/octet-stream"),
                                                              p.read_bytes())

    def index(self) -> tuple[str, bytes]:
        return self.files["index.html"]

    def get(self, url_path: str) -> tuple[str, bytes] | None:
        """The asset at ``/dashboard/static/<name>``, or None."""
        if not url_path.startswith(STATIC_URL):
            return None
        return self.files.get(url_path[len(STATIC_URL):])
