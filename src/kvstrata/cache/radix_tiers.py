"""The tree's per-tier state: locks, residency transitions and eviction candidates
(docs/design.md, "Radix tree" and "Tiers and movement").

:class:`TierState` is the half of :class:`~kvstrata.cache.radix.RadixTree` that the tier movers
drive: ``lock`` / ``host_lock`` protect pages in use; ``start_backup`` / ``commit_backup`` /
``abort_backup`` carry a node through a pending host copy under its ticket; ``attach_device`` and
``trim`` move a node between tiers; the per-tier candidate heaps order eviction (planned in
``planner.py``). Every method reads and writes only the tree's replicated state.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, TreeUsageError, UnknownPageError
from ..residency import Residency, Tier
from .eviction import EvictionPolicy, Priority
from .keys import TokenKey
from .node import _EMPTY_PAGES, _EVICTABLE, IntArray, Node

if TYPE_CHECKING:
    from .allocator import PageAllocator


class TierState:
    """Locks, residency transitions and eviction candidates of a :class:`RadixTree`."""

    root: Node
    page_size: int
    cp_size: int
    policy: EvictionPolicy
    num_pages: int
    num_host_pages: int
    num_tokens: int
    num_nodes: int
    heaps: dict[Tier, list[tuple[Priority, Node]]]
    _held: dict[Tier, npt.NDArray[np.bool_]]
    _stamp: dict[Tier, npt.NDArray[np.int64]]
    _order: IntArray
    _allocators: dict[Tier, PageAllocator | None]
    _pending: dict[int, list[Node]]
    _version: int
    hash_collisions: int

    if TYPE_CHECKING:  # the tree's own, used here

        def _split(self, node: Node, at: int) -> Node: ...
        def nodes(self) -> list[Node]: ...
        def key(self, tokens: object) -> TokenKey: ...
        def _descend(self, key: TokenKey, confirmed_len: int = 0) -> tuple[list[Node], int]: ...
        def holds_other_tokens(self, node: Node, key: TokenKey, m: int) -> bool: ...
        def _new_leaf(
            self, parent: Node, key: TokenKey, m: int, pages: IntArray, tier: Tier = Tier.L1
        ) -> Node: ...

    # -- locks -----------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Protect ``node``'s device pages and, since eviction is leaf-up, its ancestors'."""
        self._check_alive(node, "lock")
        if node is not self.root and not node.on_device:
            raise TreeUsageError(
                f"lock of {node!r}, which has no device pages; load it back first (host_lock "
                "protects host pages)"
            )
        node.lock_ref += 1

    def unlock(self, node: Node) -> None:
        if node.lock_ref <= 0:
            raise TreeUsageError(f"unlock of {node!r} which is not locked")
        node.lock_ref -= 1
        if node.lock_ref == 0:
            self._refresh(node)

    def host_lock(self, node: Node) -> None:
        """Protect ``node``'s host pages (and its ancestors') while a copy reads them."""
        self._check_alive(node, "host_lock")
        if node is not self.root and not node.on_host:
            raise TreeUsageError(f"host_lock of {node!r}, which has no host pages")
        node.host_ref += 1

    def host_unlock(self, node: Node) -> None:
        if node.host_ref <= 0:
            raise TreeUsageError(f"host_unlock of {node!r} whose host pages are not locked")
        node.host_ref -= 1
        if node.host_ref == 0:
            self._refresh(node)

    def _check_alive(self, node: Node, what: str) -> None:
        if node.dead:
            raise TreeUsageError(
                f"{what} of {node!r}, which was evicted; match again to get a live node"
            )

    # -- residency transitions (driven by write-through, load-back and the planner) -------------

    def start_backup(self, node: Node, host_pages: IntArray, ticket: int) -> None:
        """Attach reserved host pages to a device-only node: ``DEVICE -> DEVICE_HOST_PENDING``.

        The copy into them is in flight under ``ticket``; the node is invisible as a host copy
        and unevictable until :meth:`commit_backup` or :meth:`abort_backup` of that ticket.
        """
        self._check_alive(node, "start_backup")
        parent = node.parent
        if node.residency is not Residency.DEVICE or parent is None:
            raise TreeUsageError(f"start_backup of {node!r}: only a device-only node backs up")
        if parent is not self.root and not parent.on_host:
            raise TreeUsageError(
                f"start_backup of {node!r}: its parent {parent.id} has no host copy (host "
                "residency is root-connected)"
            )
        if ticket < 1:
            raise TreeUsageError(f"backup tickets are >= 1, got {ticket}")
        host_pages = np.asarray(host_pages, dtype=np.int64)
        if host_pages.shape != (node.span,):
            raise TreeUsageError(
                f"start_backup of {node!r}: {node.span} host pages needed, got {host_pages.shape}"
            )
        lanes_ok = host_pages % self.cp_size == node.pages % self.cp_size
        if not lanes_ok.all():
            raise TreeUsageError(f"start_backup of {node!r}: host pages of the wrong lanes")
        self._check_new_pages(Tier.L2, host_pages)
        self._set_host(node, host_pages.copy(), Residency.DEVICE_HOST_PENDING)
        node.ticket = ticket
        self._pending.setdefault(ticket, []).append(node)

    def pending_tickets(self) -> list[int]:
        """Tickets with nodes still pending, oldest first."""
        return sorted(self._pending)

    def commit_backup(self, ticket: int) -> int:
        """The frontier covers ``ticket``: its nodes' host copies become visible and evictable.
        Returns how many pages were committed."""
        count = 0
        for node in self._pending.pop(ticket, []):
            assert node.residency is Residency.DEVICE_HOST_PENDING and not node.dead, node
            node.residency = Residency.DEVICE_HOST
            node.ticket = 0
            count += node.span
            self._refresh(node)
        return count

    def abort_backup(self, ticket: int) -> list[tuple[int, IntArray]]:
        """Roll back ``ticket``: its nodes drop their host pages (``-> DEVICE``), and so do their
        descendants' pending backups, which cannot stand without them.

        Returns ``(ticket, host_pages)`` per rolled-back node: the caller frees each once that
        ticket's copy has landed (another ticket's copy may still be writing into its pages).
        """
        out: list[tuple[int, IntArray]] = []
        stack = list(self._pending.pop(ticket, []))
        while stack:
            node = stack.pop()
            if node.residency is not Residency.DEVICE_HOST_PENDING:
                continue  # reached twice (an ancestor's descendant walk found it first)
            out.append((node.ticket, self._drop_host(node)))
            for child in node.children.values():
                if child.on_host:
                    stack.append(child)
        for t, group in list(self._pending.items()):  # descendants taken from other tickets
            left = [n for n in group if n.residency is Residency.DEVICE_HOST_PENDING]
            if left:
                self._pending[t] = left
            else:
                del self._pending[t]
        return out

    def attach_device(self, node: Node, device_pages: IntArray) -> None:
        """Load-back: a host-only node gets device pages (``HOST -> DEVICE_HOST``); the caller
        copies the bytes in before any forward reads them."""
        self._check_alive(node, "attach_device")
        parent = node.parent
        if node.residency is not Residency.HOST or parent is None:
            raise TreeUsageError(f"attach_device of {node!r}: only a host-only node loads back")
        if parent is not self.root and not parent.on_device:
            raise TreeUsageError(
                f"attach_device of {node!r}: load its parent {parent.id} first (device residency "
                "is root-connected)"
            )
        device_pages = np.asarray(device_pages, dtype=np.int64)
        if device_pages.shape != (node.span,) or not np.array_equal(
            device_pages % self.cp_size, node.host_pages % self.cp_size
        ):
            raise TreeUsageError(
                f"attach_device of {node!r}: {node.span} device pages of the host pages' lanes "
                f"needed, got {device_pages.tolist()}"
            )
        self._check_new_pages(Tier.L1, device_pages)
        self._set_device(node, device_pages.copy())

    def trim(self, node: Node, tier: Tier, count: int, requeue: bool = True) -> IntArray:
        """Release the last ``count`` pages of ``node`` from ``tier`` and return them.

        ``node`` must be an eviction candidate of ``tier`` (:meth:`is_candidate`). Where the node
        has no other copy, its tail is cut off (all of it: the node goes); where it has one, the
        tail part keeps only that copy (a split first if only part of the node goes). A node
        cut short is queued again unless ``requeue`` is False (the planner queues it itself).
        """
        assert 0 < count <= node.span, (node, count)  # a candidate: the caller checked
        if node.residency is not Residency.DEVICE_HOST:  # the only copy: cut the tail off
            return self._cut_tail(node, tier, count, requeue)
        if count < node.span:
            self._split(node, (node.start // self.page_size + node.span - count) * self.page_size)
        return self._drop_device(node) if tier is Tier.L1 else self._drop_host(node)

    def _cut_tail(self, node: Node, tier: Tier, count: int, requeue: bool = True) -> IntArray:
        """Remove the last ``count`` pages of a leaf that holds them in ``tier`` only."""
        self._version += 1
        pages = node.pages if tier is Tier.L1 else node.host_pages
        freed = pages[node.span - count :].copy()
        self._held[tier][freed] = False
        self._count_pages(tier, -count)
        parent = node.parent
        assert parent is not None and not node.children
        if count == node.span:
            del parent.children[node.first_key]
            node.dead = True
            self.policy.on_remove(node)
            self.num_tokens -= node.valid_len
            self.num_nodes -= 1
            if tier is Tier.L1:
                parent.device_children -= 1
            else:
                parent.host_children -= 1
            self._refresh(parent)
            return freed
        keep = node.span - count  # whole pages kept, so the node now ends on a page boundary
        P = self.page_size
        self.num_tokens -= node.valid_len - keep * P
        self.policy.on_trim(node, count)
        node.tokens = node.tokens[: keep * P].copy()
        node.keys = node.keys[:keep].copy()
        node.num_full = keep
        node.full_key = node.end_key = node.keys.item(-1)
        node.end = node.start + keep * P
        node.span = keep
        if tier is Tier.L1:
            node.pages = node.pages[:keep].copy()
        else:
            node.host_pages = node.host_pages[:keep].copy()
        if requeue:
            self._refresh(node)
        return freed

    def _set_device(self, node: Node, pages: IntArray) -> None:
        assert not node.on_device or node.pages.size == 0, node
        node.pages = pages
        self._held[Tier.L1][pages] = True
        self._count_pages(Tier.L1, pages.size)
        host = node.residency is Residency.HOST
        node.residency = Residency.DEVICE_HOST if host else Residency.DEVICE
        assert node.parent is not None
        node.parent.device_children += 1
        self._refresh(node)

    def _set_host(self, node: Node, pages: IntArray, residency: Residency) -> None:
        node.host_pages = pages
        self._held[Tier.L2][pages] = True
        self._count_pages(Tier.L2, pages.size)
        node.residency = residency
        assert node.parent is not None
        node.parent.host_children += 1

    def _drop_device(self, node: Node) -> IntArray:
        """``DEVICE_HOST -> HOST``: the device copy goes, the committed host copy stays."""
        self._version += 1
        freed = node.pages
        self._held[Tier.L1][freed] = False
        self._count_pages(Tier.L1, -freed.size)
        node.pages = _EMPTY_PAGES
        node.residency = Residency.HOST
        parent = node.parent
        assert parent is not None
        parent.device_children -= 1
        self._refresh(parent)
        self._refresh(node)
        return freed

    def _drop_host(self, node: Node) -> IntArray:
        """``DEVICE_HOST(_PENDING) -> DEVICE``: the host copy goes, the device copy stays."""
        self._version += 1
        freed = node.host_pages
        self._held[Tier.L2][freed] = False
        self._count_pages(Tier.L2, -freed.size)
        node.host_pages = _EMPTY_PAGES
        node.residency = Residency.DEVICE
        node.ticket = 0
        parent = node.parent
        assert parent is not None
        parent.host_children -= 1
        self._refresh(parent)
        self._refresh(node)
        return freed

    def _count_pages(self, tier: Tier, delta: int) -> None:
        if tier is Tier.L1:
            self.num_pages += delta
        else:
            self.num_host_pages += delta

    # -- eviction candidates ---------------------------------------------------------------------

    def is_candidate(self, node: Node, tier: Tier) -> bool:
        """Whether ``tier`` may release pages of ``node`` now: it holds them there, nothing
        protects them, and no child holds pages in that tier (leaf-up)."""
        if node.dead or node.parent is None:
            return False
        r = node.residency  # identity tests: hashing an Enum (a dict or set lookup) is slow here
        if tier is Tier.L1:
            ok = r is Residency.DEVICE or r is Residency.DEVICE_HOST
            return ok and node.lock_ref == 0 and node.device_children == 0
        ok = r is Residency.HOST or r is Residency.DEVICE_HOST
        return ok and node.host_ref == 0 and node.host_children == 0

    def _refresh(self, node: Node) -> None:
        """Queue ``node`` in the heap of every tier it is now a candidate of (entries are lazy:
        the planner skips stale ones)."""
        for tier, heap in self.heaps.items():
            if self.is_candidate(node, tier):
                heapq.heappush(heap, (self.policy.priority(node), node))

    def compact_heaps(self) -> None:
        """Drop stale heap entries once they outnumber the nodes (called by the planner)."""
        for tier, heap in self.heaps.items():
            if len(heap) > 4 * self.num_nodes + 64:
                fresh = [
                    (self.policy.priority(n), n) for n in self.nodes() if self.is_candidate(n, tier)
                ]
                heapq.heapify(fresh)
                self.heaps[tier] = fresh

    def eviction_order(self, tier: Tier = Tier.L1) -> list[Node]:
        """The order in which eviction would release every candidate of ``tier`` whole, without
        changing anything (for tests and reports). Leaf-up: a parent follows its children."""
        order: list[Node] = []
        heap = list(self.heaps[tier])
        heapq.heapify(heap)
        children = {
            n.id: n.device_children if tier is Tier.L1 else n.host_children for n in self.nodes()
        }
        gone: set[int] = set()
        while heap:
            prio, node = heapq.heappop(heap)
            if node.id in gone or not self._virtual_candidate(node, tier, children):
                continue
            current = self.policy.priority(node)
            if current != prio:
                heapq.heappush(heap, (current, node))
                continue
            order.append(node)
            gone.add(node.id)
            parent = node.parent
            assert parent is not None
            if parent is not self.root:
                children[parent.id] -= 1
                if self._virtual_candidate(parent, tier, children):
                    heapq.heappush(heap, (self.policy.priority(parent), parent))
        return order

    def _virtual_candidate(self, node: Node, tier: Tier, children: dict[int, int]) -> bool:
        if node.dead or node.parent is None or node.residency not in _EVICTABLE[tier]:
            return False
        ref = node.lock_ref if tier is Tier.L1 else node.host_ref
        return ref == 0 and children[node.id] == 0

    def _check_new_pages(self, tier: Tier, fresh: IntArray) -> None:
        """Refuse pages that would corrupt the tree: out of range, listed twice, already held,
        or (with an allocator) free."""
        if fresh.size == 0:
            return
        allocator = self._allocators[tier]
        if allocator is not None:
            try:
                free = allocator.is_free(fresh)  # range-checks the ids too
            except UnknownPageError as err:
                raise TreeUsageError(f"{tier.name} {err}") from None
            if free.any():
                bad = int(fresh[np.flatnonzero(free)[0]])
                raise TreeUsageError(f"{tier.name} page {bad} was never allocated (it is free)")
            held = self._held[tier]
        else:
            lo, hi = int(fresh.min()), int(fresh.max())
            if lo < 0:
                raise TreeUsageError(f"{tier.name} page {lo} is negative")
            held = self._held_upto(tier, hi)
        if held[fresh].any():
            bad = int(fresh[np.flatnonzero(held[fresh])[0]])
            raise TreeUsageError(
                f"{tier.name} page {bad} is already held by the tree; pass the pages match_prefix "
                "returned at their positions, and pages freshly allocated elsewhere"
            )
        if fresh.size > 1:
            if self._order.size < fresh.size:
                self._order = np.arange(2 * fresh.size, dtype=np.int64)
            order = self._order[: fresh.size]
            stamp = self._stamp[tier]  # each page writes its index; one listed twice keeps its last
            stamp[fresh] = order
            if not (stamp[fresh] == order).all():
                raise TreeUsageError(
                    f"{tier.name} pages listed twice in one call: {fresh.tolist()}"
                )

    def holds(self, pages: IntArray, tier: Tier = Tier.L1) -> npt.NDArray[np.bool_]:
        """Which of ``pages`` the tree holds in ``tier`` (ids out of range: not held)."""
        held = self._held[tier]
        if pages.size and int(pages.min()) >= 0 and int(pages.max()) < held.size:
            return held[pages]
        out = np.zeros(pages.shape, dtype=np.bool_)
        inside = (pages >= 0) & (pages < held.size)
        out[inside] = held[pages[inside]]
        return out

    def _held_upto(self, tier: Tier, page: int) -> npt.NDArray[np.bool_]:
        """The tier's held-page mask, grown (doubling) to cover page id ``page``."""
        held = self._held[tier]
        if page >= held.size:
            size = max(page + 1, 2 * held.size)
            self._held[tier] = held = np.concatenate([held, np.zeros(size - held.size, np.bool_)])
            self._stamp[tier] = np.zeros(size, dtype=np.int64)
        return held

    def insert_host(
        self, tokens: TokenKey | object, host_pages: IntArray, cached_len: int
    ) -> Node | None:
        """Insert whole pages that only the host holds (a reload from disk): ``host_pages`` for the
        pages after the first ``cached_len`` tokens, which the tree must hold exactly, ending at a
        node with a host copy (host residency is root-connected). Returns the new host-only leaf,
        or None when a child there holds other tokens under the first page's key (a key
        collision): nothing is inserted and the pages stay the caller's (a new leaf would have
        replaced that child, and lost its subtree and pages).
        """
        key = self.key(tokens)
        P, n = self.page_size, len(key)
        host_pages = np.asarray(host_pages, dtype=np.int64)
        if (
            n % P
            or cached_len % P
            or not 0 <= cached_len < n
            or host_pages.shape != ((n - cached_len) // P,)
        ):
            raise ConfigError(
                f"insert_host of {n} tokens after {cached_len} needs whole pages, one host page "
                f"each (page_size {P}); got {host_pages.shape}"
            )
        path, m = self._descend(key)
        parent = path[-1] if path else self.root
        if m * P != cached_len or parent.end != cached_len:
            raise TreeUsageError(
                f"insert_host after {cached_len} tokens: the tree holds {m * P} of them"
                + ("" if parent.end == m * P else f" (its node ends at {parent.end})")
            )
        if parent is not self.root and not parent.on_host:
            raise TreeUsageError(
                f"insert_host under {parent!r}, which has no host copy (host residency is "
                "root-connected)"
            )
        lanes_ok = host_pages % self.cp_size == np.arange(m, n // P) % self.cp_size
        if not lanes_ok.all():
            raise TreeUsageError("insert_host: host pages of the wrong lanes")
        self._check_new_pages(Tier.L2, host_pages)
        if self.holds_other_tokens(parent, key, m):
            self.hash_collisions += 1
            return None
        return self._new_leaf(parent, key, m, host_pages, Tier.L2)
