"""Helpers for the disk-tier fault tests: a failing FileOps, a crash-test writer, payloads."""
