"""The page-granular radix prefix tree (docs/design.md, "Radix tree").

Keys are token ids; lengths are valid lengths. Edges split only at page boundaries, so every inner
node ends on a page boundary and only a leaf may end inside a page (a *valid tail*)::

    root ── [p0 p1 p2] ──┬── [p3 p4]            full pages: matchable
                         └── [p3' p4' t5]       t5: valid tail, 3 of 16 tokens; never matched,
                                                never extended, freed again if inserted twice

A node's children are keyed by the prefix key (``keys.py``) of their first page, so a step down is
one dict lookup, and a whole node matches in O(1) when the request's key at the node's last page
boundary equals the node's. A hit is always confirmed against the tokens each node stores: its own
tokens only, in its own array, so the tree never keeps a request's array alive. Should keys ever
collide, the tree falls back to an exact token walk and counts it.

Each node holds its pages per tier and one :class:`~kvstrata.residency.Residency`. Residency is
root-connected per tier: a node on the device has its parent on the device, and a node with a host
copy (committed or pending) has its parent's host copy too. So a match is a device part followed by
a host-only part, and eviction from either tier is leaf-up::

    root ── A (device+host) ── B (device+host) ──┬── C (host)        match: A B on device, C on host
                                                 └── D (device+host, pending backup)

``lock_ref`` protects a node's device pages and, leaf-up, its ancestors'; ``host_ref`` does the
same for host pages that a copy is reading; a pending backup (``DEVICE_HOST_PENDING``) keeps its
node out of both tiers' eviction until the commit frontier covers its ticket or it is rolled back.
A split carries the pending state and ticket to both halves, so the marker always covers the whole
pending range.

The tree moves no bytes and frees nothing itself: each operation returns the pages it releases and
the caller returns them to that tier's allocator. Eviction order and trimming are planned in
``planner.py`` over the per-tier candidate heaps kept here; write-through and load-back drive the
residency transitions from their own modules.
"""

from __future__ import annotations

import sys

import numpy as np

from ..config import CacheConfig
from ..errors import ConfigError, TreeUsageError
from ..ownership import page_span
from ..residency import Residency, Tier
from .allocator import PageAllocator
from .eviction import EvictionPolicy, Priority, make_policy
from .keys import PrefixHasher, TokenKey
from .node import (
    _ARRAY_HEADER,
    _EMPTY_KEYS,
    _EMPTY_PAGES,
    _EMPTY_TOKENS,
    _FOREIGN,
    _NO_PAGE,
    InsertResult,
    IntArray,
    MatchResult,
    Node,
    TreeStats,
    _concat,
    _path_to,
)
from .radix_tiers import TierState

__all__ = ["InsertResult", "MatchResult", "Node", "RadixTree", "TreeStats"]


class RadixTree(TierState):
    """Page-granular radix tree over token ids with per-tier residency and leaf-up eviction.

    ``capacity_pages`` sizes the eviction policy (the SLRU protected cap). With an ``allocator``
    (and ``host_allocator``), pages handed to the tree are checked to lie in its page space and
    to be allocated; without one, only against the tree's own pages.
    """

    def __init__(
        self,
        config: CacheConfig,
        capacity_pages: int,
        hasher: PrefixHasher | None = None,
        *,
        host_capacity_pages: int = 0,
        allocator: PageAllocator | None = None,
        host_allocator: PageAllocator | None = None,
    ) -> None:
        for name, value, low in (
            ("capacity_pages", capacity_pages, 1),
            ("host_capacity_pages", host_capacity_pages, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        self.config = config
        self.page_size = config.page_size
        self.cp_size = config.cp_size
        self.capacity_pages = capacity_pages
        self.hasher = hasher or PrefixHasher()
        self.policy: EvictionPolicy = make_policy(config, capacity_pages)
        self.clock = 0
        self._next_id = 1
        self.root = Node(0, None, 0, 0, 0, _EMPTY_TOKENS, _EMPTY_KEYS, 0, _EMPTY_PAGES, 0)
        self.num_pages = 0  # device pages held
        self.num_host_pages = 0  # host pages held (committed or pending)
        self.num_tokens = 0
        self.num_nodes = 0
        self.hash_collisions = 0
        self.heaps: dict[Tier, list[tuple[Priority, Node]]] = {Tier.L1: [], Tier.L2: []}
        # Which page ids the tree holds, per tier (grown on demand; bounded by an allocator).
        self._held = {
            Tier.L1: np.zeros(allocator.num_pages if allocator else capacity_pages, np.bool_),
            Tier.L2: np.zeros(
                host_allocator.num_pages if host_allocator else host_capacity_pages, np.bool_
            ),
        }
        self._stamp = {t: np.zeros(m.size, dtype=np.int64) for t, m in self._held.items()}
        self._allocators = {Tier.L1: allocator, Tier.L2: host_allocator}
        self._order = np.arange(1024, dtype=np.int64)  # scratch for the listed-twice check
        self._pending: dict[int, list[Node]] = {}  # backup ticket -> nodes it covers
        self._version = 0  # bumped by every structural change (new leaf, split, trim, removal)
        self._memo: tuple[TokenKey, int, list[Node], int] | None = None

    # -- keys ------------------------------------------------------------------------------------

    def key(self, tokens: object) -> TokenKey:
        """Validate ``tokens`` and compute its prefix keys; reuse the result for match and insert."""
        if isinstance(tokens, TokenKey):
            if tokens.page_size != self.page_size:
                raise ConfigError(
                    f"token key built for page_size {tokens.page_size}, tree uses {self.page_size}"
                )
            return tokens
        return self.hasher.key(tokens, self.page_size)

    # -- match -----------------------------------------------------------------------------------

    def match_prefix(
        self, tokens: TokenKey | object, max_len: int | None = None, record: bool = True
    ) -> MatchResult:
        """The longest cached prefix of ``tokens`` in whole pages, in every tier.

        ``max_len`` caps the match (an engine that recomputes a request's last token passes the
        page boundary before it). A match that ends inside a node splits it there, so the nodes
        of the result end exactly where the matched parts do and locks pin only matched pages.
        With ``record`` (the default) the match bumps the logical clock and records an access and
        a hit on every node of its path; a caller that may still back out passes
        ``record=False`` and calls :meth:`record_hit` once it uses the match.
        """
        key = self.key(tokens)
        path, m = self._descend(key)
        P = self.page_size
        capped = max_len is not None and m * P > max_len
        if capped:
            m = max(max_len or 0, 0) // P
            path = [n for n in path if n.start < m * P]
        if path and path[-1].end > m * P:
            path = [*path[:-1], self._split(path[-1], m * P)]
            if not capped:  # a capped walk is not the one an insert of this key would do
                self._memo = (key, self._version, path, m)
        if record:
            self._record(path)
        if not path:
            return MatchResult(0, 0, _EMPTY_PAGES, _EMPTY_PAGES, self.root, self.root)
        on_device = [n for n in path if n.pages.size]  # a leading run: device residency is rooted
        host_only = tuple(path[len(on_device) :])
        device_node = on_device[-1] if on_device else self.root
        return MatchResult(
            valid_len=m * P,
            device_len=device_node.end,
            device_pages=_concat([n.pages for n in on_device]),
            host_pages=_concat([n.host_pages for n in host_only]),
            device_node=device_node,
            last_node=path[-1],
            host_nodes=host_only,
        )

    def record_hit(self, node: Node) -> None:
        """Record an access and a hit on ``node`` and its ancestors (a match used late)."""
        self._record(_path_to(node))

    def _record(self, path: list[Node]) -> None:
        self.clock += 1
        clock = self.clock
        for node in path:
            node.last_access = clock
            node.hit_count += 1
        self._notify_access(path, hit=True)

    def match_length(self, tokens: TokenKey | object) -> int:
        """The valid length ``match_prefix`` would return, without recording an access."""
        return self._descend(self.key(tokens))[1] * self.page_size

    def holds_other_tokens(self, node: Node, key: TokenKey, m: int) -> bool:
        """Whether ``node``, which ends where ``key``'s match stopped (page ``m``), has a child
        under ``key``'s page-``m`` key: that child holds other tokens (a key collision), so
        nothing of ``key`` from page ``m`` on can be inserted under ``node``."""
        return node.end == m * self.page_size and self._child_key(key, m) in node.children

    def _descend(
        self, key: TokenKey, confirmed_len: int = 0, below: Node | None = None
    ) -> tuple[list[Node], int]:
        """Nodes whose pages the full-page prefix of ``key`` matches, and how many pages match.

        Remembers its last answer: an ``insert`` right after the ``match_prefix`` of the same key,
        with no structural change in between, does not walk again. The tokens of the first
        ``confirmed_len`` are known to match (see :meth:`insert`) and are not compared again;
        ``below``, the node that ends there, is where the walk by keys starts.
        """
        memo = self._memo
        if memo is not None and memo[0] is key and memo[1] == self._version:
            return memo[2], memo[3]
        path, m = self._descend_by_keys(key, below)
        if m and not self._confirm(key, path, m * self.page_size, confirmed_len):
            self.hash_collisions += 1
            path, m = self._descend_exact(key)
        self._memo = (key, self._version, path, m)
        return path, m

    @staticmethod
    def _confirm(key: TokenKey, path: list[Node], length: int, skip: int = 0) -> bool:
        """Whether the tokens of ``path`` equal ``key``'s tokens ``[skip, length)`` (the first
        ``skip`` are known to; the path starts at token 0)."""
        if skip >= length:
            return True
        rest = [n for n in path if n.end > skip]
        tokens = rest[0].tokens if len(rest) == 1 else np.concatenate([n.tokens for n in rest])
        lo = skip - rest[0].start
        return bool(np.array_equal(key.tokens[skip:length], tokens[lo : lo + length - skip]))

    def _descend_by_keys(self, key: TokenKey, below: Node | None = None) -> tuple[list[Node], int]:
        keys, nf, P = key.page_keys, key.num_full_pages, self.page_size
        if below is None or below is self.root:
            node, path, m = self.root, [], 0
        else:  # the walk from the root would pass through it: start there
            node, path, m = below, _path_to(below), below.end // P
        while m < nf:
            child = node.children.get(keys.item(m))
            if child is None:
                break
            nk = child.num_full
            if nk == 0:  # a lone valid-tail page: never matched
                break
            if nf - m >= nk and keys.item(m + nk - 1) == child.full_key:
                path.append(child)
                m += nk
                if child.end % P:  # it ends in a valid tail, which is never matched
                    break
                node = child
                continue
            lim = min(nk, nf - m)
            eq = keys[m : m + lim] == child.keys[:lim]
            j = lim if bool(eq.all()) else int(np.argmin(eq))
            if j:
                path.append(child)
                m += j
            break
        return path, m

    def _descend_exact(self, key: TokenKey) -> tuple[list[Node], int]:
        """The same walk as ``_descend_by_keys`` by token comparison alone (after a collision)."""
        P, nf = self.page_size, key.num_full_pages
        node, path, m = self.root, [], 0
        while m < nf:
            lo = m * P
            nxt = next(
                (
                    c
                    for c in node.children.values()
                    if c.keys.size and key.same_tokens(lo, c.tokens[:P])
                ),
                None,
            )
            if nxt is None:
                break
            lim, j = min(nxt.keys.size, nf - m), 1
            while j < lim and key.same_tokens(lo + j * P, nxt.tokens[j * P : (j + 1) * P]):
                j += 1
            path.append(nxt)
            m += j
            if j < nxt.keys.size or nxt.end > nxt.start + j * P:
                break
            node = nxt
        return path, m

    # -- insert ----------------------------------------------------------------------------------

    def insert(
        self,
        tokens: TokenKey | object,
        pages: IntArray,
        cached_len: int,
        confirmed_len: int = 0,
        below: Node | None = None,
    ) -> InsertResult:
        """Insert a whole sequence whose KV sits in the device ``pages`` (one per page of its
        padded span).

        ``pages[:cached_len // page_size]`` are the tree's own pages, which the caller got from
        ``match_prefix`` and kept locked (``cached_len`` is page aligned); the rest are the
        caller's own fresh pages. Where the tree already covers a fresh page's position (another
        request inserted it meanwhile, or a duplicate valid tail), the fresh page is a duplicate,
        returned in ``free_pages``; where the tree holds the position only on the host, the
        fresh page becomes its device copy; the rest form a new leaf. Cached pages the tree does
        not hold, fresh pages it does hold, pages listed twice, ids out of range and (with an
        allocator) pages that were never allocated raise :class:`~kvstrata.errors.TreeUsageError`
        before anything changes.

        ``confirmed_len`` (at most ``cached_len``) skips comparing tokens the caller knows the tree
        holds: it matched or inserted them with these same tokens and has kept the node that ends
        there locked since. A chunked prefill passes what it inserted so far, so each chunk's
        insert compares its own tokens, not the whole context again, and, as ``below``, the node
        that ends there (its previous chunk's), so that the walk starts there, not at the root.
        """
        key = self.key(tokens)
        P, n = self.page_size, len(key)
        num_pages = page_span(n, P)
        pages = np.asarray(pages)
        if pages.shape != (num_pages,) or (pages.size and pages.dtype.kind not in "iu"):
            raise ConfigError(
                f"insert of {n} tokens needs {num_pages} integer pages (page_size {P}), got "
                f"{pages.dtype} of shape {pages.shape}"
            )
        if (
            isinstance(cached_len, bool)
            or not isinstance(cached_len, (int, np.integer))
            or not 0 <= cached_len <= n
            or cached_len % P
        ):
            raise ConfigError(
                f"cached_len must be a page-aligned length <= {n}, got {cached_len!r} "
                f"(page_size {P})"
            )
        if not 0 <= confirmed_len <= cached_len:
            raise ConfigError(
                f"confirmed_len must lie in [0, cached_len {cached_len}], got {confirmed_len!r}"
            )
        if below is not None and (below.dead or below.end != confirmed_len or confirmed_len % P):
            raise TreeUsageError(
                f"below must be a live node that ends at confirmed_len {confirmed_len} (page "
                f"aligned); it spans [{below.start}, {below.end})"
            )
        pages = pages.astype(np.int64, copy=False)
        path, m = self._descend(key, confirmed_len, below)
        if cached_len > m * P:
            raise ConfigError(
                f"cached_len {cached_len} exceeds the {m * P} tokens the tree holds for this key; "
                "keep the matched node locked between match_prefix and insert"
            )
        c = cached_len // P
        # The tree neither stores nor frees the cached pages, so a wrong one cannot corrupt it;
        # checking the last catches a cached_len that does not fit the pages, in O(1).
        if c and self._page_at(path, c - 1) != int(pages[c - 1]):
            raise TreeUsageError(
                f"pages[:{c}] (cached_len {cached_len}) must be the tree's own pages, as "
                f"match_prefix returned them; page {c - 1} is {int(pages[c - 1])}, the tree's "
                f"is {self._page_at(path, c - 1)}"
            )
        node = path[-1] if path else self.root
        kept, prefix_len = m, m * P  # pages [0, kept) are covered by the tree
        held = None  # after a collision: the tree holds this key's tokens on pages [0, held) only
        tail_owner: Node | None = None  # the node holding an identical valid tail
        split_leaf = new_leaf = False
        if m * P < n:
            rest_is_tail = n - m * P < P
            if node.end > m * P:  # the match ends inside `node`
                if rest_is_tail and node.end == n and self._same_tail(node, key, m * P):
                    tail_owner, kept, prefix_len = node, num_pages, n
                elif self._lower_first_key(node, m * P) == self._child_key(key, m):
                    self.hash_collisions += 1  # the new page's key equals the split-off part's
                    kept, held = num_pages, m
                else:
                    split_leaf = True
            else:
                twin = node.children.get(self._child_key(key, m))
                if twin is None:
                    new_leaf = True
                elif rest_is_tail and twin.end == n and self._same_tail(twin, key, m * P):
                    tail_owner, kept, prefix_len = twin, num_pages, n
                else:
                    self.hash_collisions += 1  # a different page under an equal key: keep none
                    kept, held = num_pages, m
        # What the tree holds where fresh pages land inside the covered part [c, kept): usually
        # nothing (c == kept), else another request's pages (duplicates) or host-only positions.
        tree_pages = self._covered_pages(path, tail_owner, c, kept if held is None else held)
        if held is not None and kept > held:  # other tokens there: never the tree's pages
            tree_pages = np.concatenate([tree_pages, np.full(kept - held, _FOREIGN)])  # c <= held
        attaching = bool(tree_pages.size) and bool((tree_pages == _NO_PAGE).any())
        self._check_new_pages(Tier.L1, pages[c:])

        last_partial = bool(path) and path[-1].end > m * P and tail_owner is not path[-1]
        if last_partial:
            # Split where the sequence ends inside a node, so the access below refreshes only
            # its own pages (and a host-only node gets device pages only where the caller has).
            path = [*path[:-1], self._split(path[-1], m * P)]
        self.clock += 1
        for p in path:
            p.last_access = self.clock
        self._notify_access(path, hit=False)
        if tail_owner is not None and tail_owner is not node:
            tail_owner.last_access = self.clock
            self._notify_access([tail_owner], hit=False)
        if attaching:
            self._attach_along(path, tail_owner, pages)
        if split_leaf:
            node = self._new_leaf(path[-1], key, m, pages)
        elif last_partial and not new_leaf and tail_owner is None:
            node = path[-1]
        elif new_leaf:
            node = self._new_leaf(node, key, m, pages)
        elif tail_owner is not None:
            node = tail_owner
        if not tree_pages.size:  # the usual insert: nothing fresh landed on covered positions
            return InsertResult(prefix_len, _EMPTY_PAGES, node, pages)
        dup = tree_pages != _NO_PAGE
        free_pages = pages[c:kept][dup].copy()
        seq_pages = pages.copy()
        replaced = dup & (tree_pages >= 0)  # not where a collision put other tokens
        seq_pages[c:kept][replaced] = tree_pages[replaced]
        return InsertResult(prefix_len, free_pages, node, seq_pages)

    def _page_at(self, path: list[Node], position: int) -> int:
        """The device page ``path`` holds at page ``position`` (_NO_PAGE if host-only)."""
        P = self.page_size
        for node in reversed(path):
            start = node.start // P
            if start <= position:
                return int(node.pages[position - start]) if node.pages.size else _NO_PAGE
        return _NO_PAGE

    def _covered_pages(
        self, path: list[Node], tail_owner: Node | None, first: int, kept: int
    ) -> IntArray:
        """The tree's device page at each position of ``[first, kept)``: a page id, _NO_PAGE
        where only the host holds it, _FOREIGN where other tokens sit under an equal key."""
        if first >= kept:
            return _EMPTY_PAGES
        P = self.page_size
        parts: list[IntArray] = []
        for node in reversed(path):  # only the last nodes reach past `first`
            start = node.start // P
            if start + node.span <= first:
                break
            lo = max(first - start, 0)
            parts.append(node.pages[lo:] if node.pages.size else np.full(node.span - lo, _NO_PAGE))
        parts.reverse()
        if tail_owner is not None and (not path or tail_owner is not path[-1]):
            parts.append(tail_owner.pages if tail_owner.pages.size else np.array([_NO_PAGE]))
        covered = _concat(parts)[: kept - first]
        if covered.size < kept - first:  # a collision: the tree holds other tokens there
            covered = np.concatenate([covered, np.full(kept - first - covered.size, _FOREIGN)])
        return covered

    def _attach_along(self, path: list[Node], tail_owner: Node | None, pages: IntArray) -> None:
        """Give host-only nodes on the inserted path the caller's device pages."""
        nodes = path if tail_owner is None or tail_owner in path else [*path, tail_owner]
        P = self.page_size
        for n in nodes:
            if not n.on_device:
                lo = n.start // P
                self._set_device(n, pages[lo : lo + n.span].copy())

    def _notify_access(self, nodes: list[Node], hit: bool) -> None:
        if self.policy.tracks_access:
            for node in nodes:
                for demoted in self.policy.on_access(node, hit):
                    self._refresh(demoted)

    def _child_key(self, key: TokenKey, m: int) -> int:
        """The key a child holding ``key``'s tokens from page ``m`` on is registered under."""
        return (
            key.end_key if len(key) - m * self.page_size < self.page_size else key.page_keys.item(m)
        )

    def _lower_first_key(self, node: Node, at: int) -> int:
        """The key the part of ``node`` from token ``at`` on would be registered under."""
        k = (at - node.start) // self.page_size
        return int(node.keys[k]) if node.keys.size > k else node.end_key

    @staticmethod
    def _same_tail(node: Node, key: TokenKey, lo: int) -> bool:
        """Whether ``node``'s tokens from ``lo`` to its end equal ``key``'s."""
        return key.same_tokens(lo, node.tokens[lo - node.start :])

    def _new_leaf(
        self, parent: Node, key: TokenKey, m: int, pages: IntArray, tier: Tier = Tier.L1
    ) -> Node:
        self._version += 1
        P, n = self.page_size, len(key)
        start = m * P
        leaf = Node(
            self._next_id,
            parent,
            self._child_key(key, m),
            key.end_key,
            start,
            key.tokens[start:].copy(),
            key.page_keys[m:].copy(),
            page_span(n - start, P),
            _EMPTY_PAGES,
            self.clock,
        )
        self._next_id += 1
        parent.children[leaf.first_key] = leaf
        self.num_tokens += n - start
        self.num_nodes += 1
        if tier is Tier.L1:
            self._set_device(leaf, pages[m:].copy())
        else:  # a reload from disk: only the host holds it
            leaf.pages = _EMPTY_PAGES
            self._set_host(leaf, pages.copy(), Residency.HOST)
            leaf.last_access = self.clock
            self._refresh(leaf)
        return leaf

    def _split(self, node: Node, at: int) -> Node:
        """Split ``node`` at token ``at`` (a page boundary inside it); return the new upper part.

        The existing object keeps the lower part, so its locks, children, heap entries and
        pending ticket stay valid; the new node takes ``[node.start, at)``, the node's place under
        its parent, its residency and (if pending) its ticket.
        """
        self._version += 1
        P = self.page_size
        assert node.start < at < node.end and at % P == 0, (node, at)
        k = (at - node.start) // P
        parent = node.parent
        assert parent is not None
        # Both halves are views of the node's own arrays (never a request's): no copy, and no
        # more memory than the node held. Node arrays are never written in place.
        upper = Node(
            self._next_id,
            parent,
            node.first_key,
            int(node.keys[k - 1]),
            node.start,
            node.tokens[: k * P],
            node.keys[:k],
            k,
            node.pages[:k] if node.on_device else _EMPTY_PAGES,
            node.last_access,
        )
        self._next_id += 1
        upper.host_pages = node.host_pages[:k] if node.on_host else _EMPTY_PAGES
        upper.residency = node.residency
        upper.ticket = node.ticket
        upper.hit_count = node.hit_count
        upper.device_children = int(node.on_device)
        upper.host_children = int(node.on_host)
        if node.ticket:
            self._pending[node.ticket].append(upper)
        parent.children[node.first_key] = upper
        node.first_key = self._lower_first_key(node, at)
        node.keys = node.keys[k:]
        node.tokens = node.tokens[k * P :]
        node.num_full = node.keys.size
        node.full_key = node.keys.item(-1) if node.keys.size else -1
        node.span -= k
        if node.on_device:
            node.pages = node.pages[k:]
        if node.on_host:
            node.host_pages = node.host_pages[k:]
        node.start = at
        node.parent = upper
        upper.children[node.first_key] = node
        self.num_nodes += 1
        self.policy.on_split(upper, node)
        return upper

    def evict(self, deficit: int | IntArray, tier: Tier = Tier.L1) -> IntArray:
        """Free pages of ``tier`` for a deficit; see :func:`kvstrata.cache.planner.evict`."""
        from .planner import evict

        return evict(self, tier, deficit)

    # -- inspection ------------------------------------------------------------------------------

    def nodes(self) -> list[Node]:
        """Every non-root node, parents before children, in a deterministic order."""
        out: list[Node] = []
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children.values()))
        return out

    def stats(self) -> TreeStats:
        """What the tree's own bookkeeping costs, against the tokens it caches."""
        size = 0
        for n in self.nodes():
            size += sys.getsizeof(n) + sys.getsizeof(n.children)
            size += n.tokens.nbytes + n.keys.nbytes + n.pages.nbytes + n.host_pages.nbytes
            size += 4 * _ARRAY_HEADER
        return TreeStats(self.num_nodes, self.num_tokens, self.num_pages, self.num_host_pages, size)

    def digest(self) -> str:
        """SHA-256 over the tree's full replicated state (structure, pages, residency, locks,
        clock, stats)."""
        from .radix_check import tree_digest

        return tree_digest(self)

    def check(self) -> None:
        """Verify every invariant; raise :class:`TreeInvariantError` naming the node otherwise."""
        from .radix_check import check_tree

        check_tree(self)
