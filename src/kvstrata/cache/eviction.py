"""Eviction order as a policy object over replicated inputs only (DESIGN.md, "Radix tree").

A policy maps a node to a priority tuple ``(segment, last_access, node_id)``; the tree evicts the
evictable leaf with the smallest priority first. ``last_access`` is the tree's logical clock, never
wall-clock time, and the node id breaks every tie, so all ranks evict in the same order.

* :class:`LRUPolicy` — least recently used on the logical clock.
* :class:`SLRUPolicy` — segmented LRU: a node hit at least twice joins the *protected* segment,
  which is capped at ``protected_fraction`` of the tier's pages; overflow demotes the protected
  nodes least recently used back to *probationary*. Every probationary leaf goes before any
  protected one.

Priorities may only grow while a node sits in the tree's heap (the clock only moves forward); a
policy that lowers one (a demotion) returns that node from :meth:`on_access` so the tree re-queues it.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Protocol

from ..config import CacheConfig

if TYPE_CHECKING:
    from .node import Node

Priority = tuple[int, int, int]

PROBATION = 0
PROTECTED = 1


class EvictionPolicy(Protocol):
    name: str
    tracks_access: bool  # whether on_access must be called (LRU needs no per-access bookkeeping)

    def priority(self, node: Node) -> Priority: ...

    def on_access(self, node: Node, hit: bool) -> list[Node]:
        """Called after ``node.last_access`` moved (and, when ``hit``, ``node.hit_count`` grew);
        returns the nodes whose priority dropped."""
        ...

    def on_split(self, upper: Node, lower: Node) -> None: ...

    def on_trim(self, node: Node, num_pages: int) -> None:
        """``node`` lost its last ``num_pages`` pages (it stays in the tree)."""
        ...

    def on_remove(self, node: Node) -> None: ...


class LRUPolicy:
    """Least recently used on the logical clock; node id breaks ties."""

    name = "lru"
    tracks_access = False

    def priority(self, node: Node) -> Priority:
        return (PROBATION, node.last_access, node.id)

    def on_access(self, node: Node, hit: bool) -> list[Node]:
        return []

    def on_split(self, upper: Node, lower: Node) -> None:
        return None

    def on_trim(self, node: Node, num_pages: int) -> None:
        return None

    def on_remove(self, node: Node) -> None:
        return None


class SLRUPolicy:
    """Segmented LRU with a protected segment capped at ``cap_pages`` pages."""

    name = "slru"
    tracks_access = True

    def __init__(self, cap_pages: int) -> None:
        self.cap_pages = cap_pages
        self.protected_pages = 0
        # Lazy min-heap of (last_access, id, node) over protected nodes; an entry is current only
        # while the node is alive, protected and its last_access still equals the entry's.
        self._lru: list[tuple[int, int, Node]] = []

    def priority(self, node: Node) -> Priority:
        return (node.segment, node.last_access, node.id)

    def on_access(self, node: Node, hit: bool) -> list[Node]:
        if node.segment == PROBATION:
            if not hit or node.hit_count < 2:
                return []
            node.segment = PROTECTED
            self.protected_pages += node.span
        heapq.heappush(self._lru, (node.last_access, node.id, node))
        demoted: list[Node] = []
        while self.protected_pages > self.cap_pages:
            la, _, victim = heapq.heappop(self._lru)
            if victim.dead or victim.segment != PROTECTED or victim.last_access != la:
                continue
            victim.segment = PROBATION
            self.protected_pages -= victim.span
            demoted.append(victim)
        if len(self._lru) > 4 * max(64, self.protected_pages):
            self._compact()
        return demoted

    def on_split(self, upper: Node, lower: Node) -> None:
        upper.segment = lower.segment
        if upper.segment == PROTECTED:
            heapq.heappush(self._lru, (upper.last_access, upper.id, upper))

    def on_trim(self, node: Node, num_pages: int) -> None:
        if node.segment == PROTECTED:
            self.protected_pages -= num_pages

    def on_remove(self, node: Node) -> None:
        if node.segment == PROTECTED:
            self.protected_pages -= node.span
            node.segment = PROBATION

    def _compact(self) -> None:
        live = {
            n.id: (la, i, n)
            for la, i, n in self._lru
            if not n.dead and n.segment == PROTECTED and n.last_access == la
        }
        self._lru = list(live.values())
        heapq.heapify(self._lru)


def make_policy(config: CacheConfig, capacity_pages: int) -> EvictionPolicy:
    """The policy ``config.eviction`` names, sized for a tier of ``capacity_pages`` pages."""
    if config.eviction == "slru":
        return SLRUPolicy(int(config.protected_fraction * capacity_pages))
    return LRUPolicy()
