"""Eviction planning: free exactly what a deficit needs, lane by lane, tail first (design.md,
"Tiers and movement").

A deficit says how many pages each lane (owner rank) of a tier is short. The planner pops the tier's
eviction candidates in policy order from the tree's lazy min-heap (a popped entry is used only if
its priority is still current, else it is queued again with the current one) and trims each victim
from its tail, only as far as the remaining deficit needs::

    victim's pages (positions)   40 41 42 43 44 45 46 47      cp_size 4: lane = position % 4
    lanes                         0  1  2  3  0  1  2  3
    deficit: lane 1 short by 2       ^^^^^^^^^^^^^^^^^^^^      trim 7 pages, 41..47: the second
                                                               lane-1 page from the tail is 41

A trim never leaves a hole: pages are cut from the end, so what stays is still a prefix. A victim
with no page in any short lane is passed over (it stays cached). When a whole victim goes, its
parent may become a candidate and is considered in turn. Only when no candidate left holds a page
of a short lane does the oldest passed-over victim go whole, to expose its parent. Everything here reads replicated inputs
only (logical clock, hit counts, node ids, page positions), so every rank plans the same evictions.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError
from ..residency import Tier

if TYPE_CHECKING:
    from .eviction import Priority
    from .radix import Node, RadixTree

IntArray = npt.NDArray[np.int64]
_EMPTY = np.empty(0, dtype=np.int64)


def as_deficit(deficit: int | IntArray, cp_size: int) -> IntArray:
    """A deficit as pages per lane. An int is a total over all lanes (any lane will do), which
    the planner treats as one lane."""
    if isinstance(deficit, (int, np.integer)) and not isinstance(deficit, bool):
        if deficit < 0:
            raise ConfigError(f"an eviction deficit must be >= 0 pages, got {deficit}")
        return np.array([int(deficit)], dtype=np.int64)
    arr = np.asarray(deficit)
    if arr.shape != (cp_size,) or arr.dtype.kind not in "iu" or (arr.size and arr.min() < 0):
        raise ConfigError(
            f"an eviction deficit is an int or {cp_size} page counts >= 0 (one per lane), "
            f"got {deficit!r}"
        )
    return arr.astype(np.int64)


def trim_count(first: int, span: int, need: list[int]) -> int:
    """How many tail pages of a node at page positions ``[first, first + span)`` to release so
    that every lane ``l`` with ``need[l] > 0`` gets ``need[l]`` pages (or all it has there).

    ``len(need)`` is the number of lanes; the lane of position ``p`` is ``p % len(need)``.
    Returns 0 when the node holds no page of a short lane.
    """
    lanes = len(need)
    end = first + span
    count = 0
    for lane, short in enumerate(need):
        if short <= 0:
            continue
        last = end - 1 - (end - 1 - lane) % lanes  # the lane's last position before `end`
        if last < first:
            continue  # the node holds no page of this lane
        kth = last - (short - 1) * lanes  # the short-th of them, counted from the tail
        if kth < first:  # the lane needs every page it has here: down to its first one
            kth = first + (lane - first) % lanes
        count = max(count, end - kth)
    return count


def lane_counts(first: int, count: int, lanes: int) -> list[int]:
    """Pages per lane among positions ``[first, first + count)``."""
    base, extra = divmod(count, lanes)
    # The first `extra` lanes after `first`'s lane (cyclically) get one more.
    return [base + ((lane - first) % lanes < extra) for lane in range(lanes)]


def evict(tree: RadixTree, tier: Tier, deficit: int | IntArray) -> IntArray:
    """Release pages of ``tier`` until the deficit is met or no candidate can help; return them
    (the caller frees them to the tier's allocator)."""
    need = as_deficit(deficit, tree.cp_size).tolist()
    lanes, P = len(need), tree.page_size
    heap, policy, is_candidate = tree.heaps[tier], tree.policy, tree.is_candidate
    freed: list[IntArray] = []
    passed: list[tuple[Priority, Node]] = []
    while max(need) > 0:
        while heap and max(need) > 0:
            prio, node = heapq.heappop(heap)
            if not is_candidate(node, tier):
                continue  # stale: locked, evicted, or no longer a leaf of this tier
            current = policy.priority(node)
            if current != prio:  # accessed since it was queued: its priority only grew
                heapq.heappush(heap, (current, node))
                continue
            span = node.span
            if lanes == 1:  # one lane (or a plain page count): the tail, as far as needed
                count = min(need[0], span)
                need[0] -= count
            else:
                first = node.start // P
                count = trim_count(first, span, need)
                if count == 0:
                    passed.append((prio, node))
                    continue
                got = lane_counts(first + span - count, count, lanes)
                need = [max(n - g, 0) for n, g in zip(need, got, strict=True)]
            whole = count == span
            freed.append(tree.trim(node, tier, count, requeue=False))
            if not whole and is_candidate(node, tier):
                # It gave every short lane all it had (or enough): nothing more for this plan,
                # but it stays a candidate for the next one.
                passed.append((prio, node))
        if max(need) == 0 or not passed:
            break
        # No candidate left holds a page of a short lane. The oldest passed one goes whole, so
        # that its parent, which may hold such pages, becomes a candidate.
        passed.sort(key=lambda item: item[0])
        prio, node = passed.pop(0)
        if not is_candidate(node, tier):
            continue  # queued twice (lazy heap entries), and already gone
        first, span = node.start // P, node.span
        got = lane_counts(first, span, lanes)
        need = [max(n - g, 0) for n, g in zip(need, got, strict=True)]
        freed.append(tree.trim(node, tier, span, requeue=False))
    for item in passed:
        heapq.heappush(heap, item)
    tree.compact_heaps()
    return np.concatenate(freed) if freed else _EMPTY
