"""Trace-driven eviction simulator: synthetic prompt traces replayed, keys only,
through the real chunk hashing and eviction policies (``kvtier simulate``)."""
