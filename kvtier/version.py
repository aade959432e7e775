"""kvtier's version (the one in pyproject.toml), importable from every layer."""

__version__ = "0.1.0"
