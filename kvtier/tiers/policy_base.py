"""The eviction policy interface and the chain rule every kvtier policy keeps.

See :mod:`kvtier.tiers.policies` for the rule, its cost and the callers' duties;
the concrete orders (LRU, LFU, FIFO, S3-FIFO, a2q) subclass :class:`ChainAwarePolicy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Iterator

from kvtier.index.chains import closes_cycle, first_cycle


class EvictionPolicy(ABC):
    """Orders resident keys for eviction."""

    name: str = ""

    @abstractmethod
    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        """A new key became resident.

        Args:
            key: the chunk key (32 bytes).
            parent: the key of the previous chunk of the same prompt (whether or
                not it is resident in this tier), or None for a prompt's first
                chunk or when unknown. Inserting a resident key again counts as
                a use of it.

        Raises:
            ValueError: a chain-aware policy's new key whose ``parent`` is the key itself or
                one of its resident descendants (:meth:`closes_cycle`); nothing is recorded.
        """

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """A resident key was hit (looked up for a load, or read). Unknown keys are ignored."""

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

    def __contains__(self, key: object) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def num_children(self, key: bytes) -> int:
        """Resident keys whose recorded parent is ``key`` (0 for a policy without chains)."""
        return 0

    def parent_of(self, key: bytes) -> bytes | None:
        """The parent recorded when ``key`` was inserted (None: a head, or unknown)."""
        return None

    def closes_cycle(self, key: bytes, parent: bytes | None) -> bool:
        """True if inserting ``key`` (not resident) with ``parent`` would close a parent cycle:
        ``parent`` is ``key`` or a resident descendant of it (:mod:`kvtier.index.chains`).
        O(1) unless resident keys already name ``key`` as parent; then O(ancestors of ``parent``)."""
        if parent is None or (parent != key and not self.num_children(key)):
            return False
        return closes_cycle(key, parent, self.parent_of, len(self))

    def check_invariants(self) -> None:
        """Assert the policy's bookkeeping is consistent (tests; O(keys))."""


class ChainAwarePolicy(EvictionPolicy):
    """Base of every policy here: applies the chain rule of the module doc.

    Subclasses keep an *order* over the non-deferred resident keys and implement
    the ``_add``/``_use``/``_use_deferred``/``_detach``/``_readd``/``_forget``/
    ``_order`` hooks.

    Invariants (kept by this class):
    - ``_parent`` holds exactly the resident keys (value: parent given at insert).
    - ``_children[p]`` is the number of resident keys whose parent is ``p``
      (``p`` resident or not); zero counts are not stored.
    - Each resident key is either in the subclass order or in ``_deferred``.
    - ``candidates`` yields only keys absent from ``_children`` (leaves).
    - Acyclic: the recorded parents form a forest. ``insert`` refuses a parent that would
      close a cycle (:meth:`closes_cycle`; the tiers drop such a link first), since the keys
      on a cycle would never become leaves: never evicted, and pinning their slots for good.
    """

    def __init__(self) -> None:
        self._parent: dict[bytes, bytes | None] = {}
        self._children: dict[bytes, int] = {}
        self._deferred: set[bytes] = set()
        # Interior keys met by the last ``candidates`` pass; they are deferred at
        # the next call, because the order must not change while a caller iterates.
        self._passed: list[bytes] = []
        #: Monotonic count of interior keys passed over by ``candidates`` (a cost metric).
        self.passed_over = 0

    # -- public interface ------------------------------------------------------
    # The three operations below are every tier's hot path (issue 28: <= 2 us each at 1M
    # keys, ``kvtier bench policies``): each inlines ``_settle``'s emptiness check, and
    # ``insert`` the O(1) part of :meth:`closes_cycle` (a key no resident key names as parent
    # closes no cycle unless it is its own parent), which it calls only past that.
    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        if self._passed:
            self._settle()
        if key in self._parent:
            self._use_resident(key)
            return
        if parent is not None:
            children = self._children
            if (parent == key or key in children) and self.closes_cycle(key, parent):
                raise ValueError("a chunk cannot be its own parent nor the child of its descendant (a parent cycle)")
            self._parent[key] = parent
            children[parent] = children.get(parent, 0) + 1
        else:
            self._parent[key] = None
        self._add(key)

    def touch(self, key: bytes) -> None:
        if self._passed:
            self._settle()
        if key in self._parent:
            if key in self._deferred:
                self._use_resident(key)
            else:
                self._use(key)

    def remove(self, key: bytes) -> None:
        if self._passed:
            self._settle()
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        if key in self._deferred:
            self._deferred.discard(key)
            self._forget(key, False)
        else:
            self._forget(key, True)
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
                if parent in self._deferred:  # its last child is gone: next victim
                    self._deferred.discard(parent)
                    self._readd(parent, True)

    def candidates(self) -> Iterator[bytes]:
        if self._passed:
            self._settle()
        return self._leaves()

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def num_children(self, key: bytes) -> int:
        """Resident keys whose parent is ``key``."""
        return self._children.get(key, 0)

    def parent_of(self, key: bytes) -> bytes | None:
        return self._parent.get(key)

    def check_invariants(self) -> None:
        counts: dict[bytes, int] = {}
        for parent in self._parent.values():
            if parent is not None:
                counts[parent] = counts.get(parent, 0) + 1
        assert counts == self._children, "child counts disagree with the recorded parents"
        assert self._deferred <= self._parent.keys(), "a deferred key is not resident"
        order = self._members()
        assert not (order & self._deferred), "a key is both deferred and in the order"
        assert order | self._deferred == self._parent.keys(), "a resident key is in neither the order nor deferred"
        assert first_cycle(self._parent) is None, "the recorded parents form a cycle"

    # -- chain rule ------------------------------------------------------------
    def _use_resident(self, key: bytes) -> None:
        if key in self._deferred:
            if self._use_deferred(key):
                self._deferred.discard(key)
                self._readd(key, False)
        else:
            self._use(key)

    def _leaves(self) -> Iterator[bytes]:
        children = self._children
        for key in self._order():
            if key in children:
                self._passed.append(key)
                self.passed_over += 1
            else:
                yield key

    def _settle(self) -> None:
        if not self._passed:
            return
        passed, self._passed = self._passed, []
        for key in passed:
            if key in self._children and key in self._parent and key not in self._deferred:
                self._detach(key)
                self._deferred.add(key)

    # -- subclass hooks --------------------------------------------------------
    @abstractmethod
    def _add(self, key: bytes) -> None:
        """Put a new key into the order."""

    @abstractmethod
    def _use(self, key: bytes) -> None:
        """A key in the order was used."""

    @abstractmethod
    def _use_deferred(self, key: bytes) -> bool:
        """A deferred key was used; return True to put it back into the order as used."""

    @abstractmethod
    def _detach(self, key: bytes) -> None:
        """Take a key out of the order, keeping its metadata (it is being deferred)."""

    @abstractmethod
    def _readd(self, key: bytes, as_victim: bool) -> None:
        """Put a detached key back: as the next victim of its class, or as just used."""

    @abstractmethod
    def _forget(self, key: bytes, in_order: bool) -> None:
        """A key left the tier; drop it from the order (if ``in_order``) and its metadata."""

    @abstractmethod
    def _order(self) -> Iterator[bytes]:
        """Keys in the order, best victim first."""

    def _members(self) -> set[bytes]:
        """Keys in the order, as a set, without changing it (for ``check_invariants``)."""
        return set(self._order())
