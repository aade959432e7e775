"""Eviction policies: which resident chunk a tier gives up first.

A policy only orders keys; the tier decides whether a candidate may go (chunks
with readers/writers or leases are skipped). Tiers call the policy under their
own lock, so policies are not thread-safe by themselves.

Chain order: keys are prefix-chained, so a chunk whose parent is gone can never
be hit again. The storage manager therefore touches the chunks of a prompt from
the last to the first (see ``StorageManager``): under recency-based policies a
chain's tail is always older than its head and is evicted first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, Iterator


class EvictionPolicy(ABC):
    """Orders resident keys for eviction."""

    name: str = ""

    @abstractmethod
    def insert(self, key: bytes) -> None:
        """A new key became resident."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """A resident key was hit (looked up for a load, or read)."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """A key left the tier (evicted or deleted). Unknown keys are ignored."""

    @abstractmethod
    def candidates(self) -> Iterator[bytes]:
        """Resident keys, best victim first. The tier may skip some (pinned).

        The caller must stop iterating before it mutates the policy.
        """

    def __len__(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name.

    Raises:
        ValueError: unknown policy name (the message lists the known ones).
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
