"""Moved: the control plane lives in :mod:`kvtier.protocol` (this name stays importable)."""

from kvtier.protocol import *  # noqa: F401,F403
from kvtier.protocol import __all__  # noqa: F401
