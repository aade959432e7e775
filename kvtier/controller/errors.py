"""Errors of fleet operations raised synchronously, before anything is sent to an instance."""

from __future__ import annotations


class BadRequest(ValueError):
    """Invalid operation input (HTTP 400); ``field`` names the offending field."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class UnknownInstance(LookupError):
    """An instance id that is not registered (HTTP 404)."""

    def __init__(self, instance: str):
        super().__init__(f"unknown instance {instance!r} (not registered or expired)")
        self.instance = instance
