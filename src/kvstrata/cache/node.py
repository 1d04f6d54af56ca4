"""The radix tree's nodes and the named results of its operations (docs/design.md, "Radix tree").

A :class:`Node` is one edge of the tree: tokens ``[start, end)`` of a path, its pages per tier and
one :class:`~kvstrata.residency.Residency`. :class:`MatchResult` and :class:`InsertResult` are what
``match_prefix`` and ``insert`` return; :class:`TreeStats` what ``stats`` does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..residency import Residency, Tier
from .eviction import PROBATION

IntArray = npt.NDArray[np.int64]
_EMPTY_PAGES: IntArray = np.empty(0, dtype=np.int64)
_EMPTY_KEYS = np.empty(0, dtype=np.uint64)
_EMPTY_TOKENS = np.empty(0, dtype=np.uint32)

# Tuples, not sets: containment tests identity first, while Enum hashing is slow on hot paths.
_ON_DEVICE = (Residency.DEVICE, Residency.DEVICE_HOST, Residency.DEVICE_HOST_PENDING)
_ON_HOST = (Residency.DEVICE_HOST, Residency.HOST, Residency.DEVICE_HOST_PENDING)
#: Residencies a tier may evict from (a pending backup is never evicted from either tier).
_EVICTABLE = {
    Tier.L1: (Residency.DEVICE, Residency.DEVICE_HOST),
    Tier.L2: (Residency.DEVICE_HOST, Residency.HOST),
}
_NO_PAGE = -1  # a position the tree covers without a device page (host-only)
_FOREIGN = -2  # a position the tree covers with other tokens under an equal key (a collision)


class Node:
    """One edge of the tree: tokens ``[start, end)`` of a path, and the pages that hold them."""

    __slots__ = (
        "id",
        "parent",
        "children",
        "first_key",
        "end_key",
        "start",
        "end",
        "span",
        "tokens",
        "keys",
        "num_full",
        "full_key",
        "pages",
        "host_pages",
        "residency",
        "ticket",
        "lock_ref",
        "host_ref",
        "device_children",
        "host_children",
        "last_access",
        "hit_count",
        "segment",
        "dead",
    )

    def __init__(
        self,
        node_id: int,
        parent: Node | None,
        first_key: int,
        end_key: int,
        start: int,
        tokens: npt.NDArray[np.uint32],
        keys: npt.NDArray[np.uint64],
        span: int,
        pages: IntArray,
        last_access: int,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.first_key = first_key  # key of this node in parent.children
        self.end_key = end_key  # prefix key at self.end
        self.start = start  # valid-token offset of the first token (page aligned)
        self.end = start + tokens.size  # valid-token offset one past the last token
        self.span = span  # pages covering [start, end), a valid tail included
        self.tokens = tokens  # this node's own token ids (its own array)
        self.keys = keys  # prefix keys at this node's full-page boundaries
        self.num_full = keys.size  # full pages (a valid tail is not one)
        self.full_key = keys.item(-1) if keys.size else -1  # key at the last full-page boundary
        self.pages = pages  # device logical pages (one per page of the span) or none
        self.host_pages = _EMPTY_PAGES  # host logical pages, once a backup is attached
        self.residency = Residency.DEVICE
        self.ticket = 0  # the backup ticket while DEVICE_HOST_PENDING
        self.lock_ref = 0
        self.host_ref = 0
        self.device_children = 0  # children with a device copy
        self.host_children = 0  # children with a host copy (committed or pending)
        self.last_access = last_access
        self.hit_count = 0
        self.segment = PROBATION
        self.dead = False

    @property
    def valid_len(self) -> int:
        return self.end - self.start

    @property
    def on_device(self) -> bool:
        return self.residency in _ON_DEVICE

    @property
    def on_host(self) -> bool:
        """Whether host pages are attached (committed, or pending while a backup is in flight)."""
        return self.residency in _ON_HOST

    def tier_pages(self, tier: Tier) -> IntArray:
        return self.pages if tier is Tier.L1 else self.host_pages

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, tokens=[{self.start}, {self.end}), {self.residency.value}, "
            f"lock_ref={self.lock_ref}, host_ref={self.host_ref}, children={len(self.children)})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """What ``match_prefix`` found: a page-aligned prefix, its device part and its host-only part.

    ``[0, device_len)`` is on the device in ``device_pages``; ``[device_len, valid_len)`` is only
    on the host, in ``host_pages`` of ``host_nodes`` (root side first), and needs a load-back
    before a forward reads it. ``device_node`` ends at ``device_len`` (the root when nothing is on
    the device) and is what a request locks; ``last_node`` ends at ``valid_len``.
    """

    valid_len: int
    device_len: int
    device_pages: IntArray
    host_pages: IntArray
    device_node: Node
    last_node: Node
    host_nodes: tuple[Node, ...] = ()

    def pages(self, tier: Tier) -> IntArray:
        """The matched pages of one tier (the disk tier is not built yet)."""
        if tier is Tier.L1:
            return self.device_pages
        return self.host_pages if tier is Tier.L2 else _EMPTY_PAGES


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What ``insert`` did.

    prefix_len: valid tokens of the sequence that were already in the tree.
    free_pages: the caller's pages the tree did not keep (duplicates of cached pages, including a
        duplicate valid tail); the caller must free them, except those still in ``pages`` (after
        a key collision: positions where the tree holds other tokens under an equal key, which
        the caller keeps reading until it is done).
    node: the node now holding the sequence's last token (the root if nothing was kept); after a
        key collision, the node ending where the tree stops holding the sequence's tokens
        (``node.end`` short of the sequence).
    pages: the device pages that hold the sequence from now on: the tree's where it had its own
        page for a position, the caller's elsewhere (a caller still computing reads these).
    """

    prefix_len: int
    free_pages: IntArray
    node: Node
    pages: IntArray


@dataclass(frozen=True, slots=True)
class TreeStats:
    """Size of the tree's bookkeeping against what it caches."""

    nodes: int
    tokens: int
    device_pages: int
    host_pages: int
    bytes: int  # node objects, their dicts and arrays (token ids, keys, pages)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else 0.0


_ARRAY_HEADER = sys.getsizeof(np.empty(0, dtype=np.int64))


def _concat(arrays: list[IntArray]) -> IntArray:
    if not arrays:
        return _EMPTY_PAGES
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _path_to(node: Node) -> list[Node]:
    """``node`` and its ancestors below the root, root side first."""
    path: list[Node] = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]
