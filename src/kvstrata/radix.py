"""The page-granular radix prefix tree (DESIGN.md, "Radix tree").

Keys are token ids; lengths are valid lengths. Edges split only at page boundaries, so every inner
node ends on a page boundary and only a leaf may end inside a page (a *valid tail*)::

    root ── [p0 p1 p2] ──┬── [p3 p4]            full pages: matchable
                         └── [p3' p4' t5]       t5: valid tail, 3 of 16 tokens; never matched,
                                                never extended, freed again if inserted twice

A node's children are keyed by the prefix key (``keys.py``) of their first page, so a step down is
one dict lookup, and a whole node matches in O(1) when the request's key at the node's last page
boundary equals the node's. A hit is always confirmed with one ``memcmp`` of the request's tokens
against the tokens the node was built from; should the keys ever collide, the tree falls back to an
exact token walk and counts it.

Each node holds its device pages and a :class:`~kvstrata.residency.Residency`. ``lock_ref`` protects
a node and, because eviction is leaf-up, every ancestor of it. Eviction order comes from a policy
object over the logical clock, hit counts and node ids — replicated inputs only.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .config import CacheConfig
from .errors import ConfigError, TreeInvariantError
from .eviction import PROBATION, EvictionPolicy, Priority, make_policy
from .keys import PrefixHasher, TokenKey
from .ownership import page_span
from .residency import Residency, Tier

IntArray = npt.NDArray[np.int64]
_EMPTY_PAGES: IntArray = np.empty(0, dtype=np.int64)
_EMPTY_KEYS = np.empty(0, dtype=np.uint64)
_EMPTY_TOKENS = np.empty(0, dtype=np.uint32)


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
        "seq",
        "keys",
        "num_full",
        "full_key",
        "pages",
        "residency",
        "lock_ref",
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
        end: int,
        seq: npt.NDArray[np.uint32],
        keys: npt.NDArray[np.uint64],
        pages: IntArray,
        last_access: int,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.first_key = first_key  # key of this node in parent.children
        self.end_key = end_key  # prefix key at self.end
        self.start = start  # valid-token offset of the first token (page aligned)
        self.end = end  # valid-token offset one past the last token
        self.seq = seq  # a uint32 token array whose [0, end) is this node's whole path (shared)
        self.keys = keys  # prefix keys at this node's full-page boundaries
        self.num_full = keys.size  # full pages (a valid tail is not one)
        self.full_key = keys.item(-1) if keys.size else -1  # key at the last full-page boundary
        self.pages = pages  # device logical pages, one per (possibly partial) page
        self.residency = Residency.DEVICE
        self.lock_ref = 0
        self.last_access = last_access
        self.hit_count = 0
        self.segment = PROBATION
        self.dead = False

    @property
    def valid_len(self) -> int:
        return self.end - self.start

    def tokens(self) -> npt.NDArray[np.uint32]:
        """This node's own token ids (a view, no copy)."""
        return self.seq[self.start : self.end]

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, tokens=[{self.start}, {self.end}), pages={self.pages.size}, "
            f"lock_ref={self.lock_ref}, children={len(self.children)})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """What ``match_prefix`` found: a page-aligned valid length and the pages that hold it."""

    valid_len: int
    device_pages: IntArray
    last_node: Node

    def pages(self, tier: Tier) -> IntArray:
        """The matched pages of one tier (only the device tier exists so far)."""
        return self.device_pages if tier is Tier.L1 else _EMPTY_PAGES


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What ``insert`` did.

    prefix_len: valid tokens of the sequence that were already in the tree.
    free_pages: the caller's pages the tree did not keep (duplicates of cached pages, including a
        duplicate valid tail); the caller must free them.
    node: the node now holding the sequence's last token (the root if nothing was kept).
    """

    prefix_len: int
    free_pages: IntArray
    node: Node


class RadixTree:
    """Page-granular radix tree over token ids with leaf-up, policy-ordered eviction."""

    def __init__(
        self,
        config: CacheConfig,
        capacity_pages: int,
        hasher: PrefixHasher | None = None,
    ) -> None:
        if capacity_pages < 1:
            raise ConfigError(f"capacity_pages must be >= 1, got {capacity_pages}")
        self.config = config
        self.page_size = config.page_size
        self.cp_size = config.cp_size
        self.capacity_pages = capacity_pages
        self.hasher = hasher or PrefixHasher()
        self.policy: EvictionPolicy = make_policy(config, capacity_pages)
        self.clock = 0
        self._next_id = 1
        self.root = Node(0, None, 0, 0, 0, 0, _EMPTY_TOKENS, _EMPTY_KEYS, _EMPTY_PAGES, 0)
        self.num_pages = 0
        self.num_tokens = 0
        self.num_nodes = 0
        self.hash_collisions = 0
        self._heap: list[tuple[Priority, Node]] = []
        self._version = 0  # bumped by every structural change (new leaf, split, removal)
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
        """The longest cached prefix of ``tokens`` in whole pages, and its device pages.

        ``max_len`` caps the match (an engine that recomputes a request's last token passes the
        page boundary before it). A match that ends inside a node splits it there, so
        ``last_node`` ends exactly at ``valid_len`` and locking it pins only the matched pages.
        With ``record`` (the default) the match bumps the logical clock and records an access and
        a hit on every node of its path; a caller that may still back out passes
        ``record=False`` and calls :meth:`record_hit` once it uses the match.
        """
        key = self.key(tokens)
        path, m = self._descend(key)
        P = self.page_size
        capped = False
        if max_len is not None and m * P > max_len:
            capped, m = True, max(max_len, 0) // P
            path = [n for n in path if n.start < m * P]
        if path and path[-1].end > m * P:
            path = [*path[:-1], self._split(path[-1], m * P)]
            if not capped:
                self._memo = (key, self._version, path, m)  # still the walk an insert would do
        if record:
            self._record(path)
        if not path:
            return MatchResult(0, _EMPTY_PAGES, self.root)
        last = path[-1]
        pages = last.pages[:m] if len(path) == 1 else np.concatenate([n.pages for n in path])[:m]
        return MatchResult(m * P, pages, last)

    def record_hit(self, node: Node) -> None:
        """Record an access and a hit on ``node`` and its ancestors (a match used late)."""
        path: list[Node] = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        self._record(path[::-1])

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

    def _descend(self, key: TokenKey) -> tuple[list[Node], int]:
        """Nodes whose pages the full-page prefix of ``key`` matches, and how many pages match.

        Remembers its last answer: an ``insert`` right after the ``match_prefix`` of the same key,
        with no structural change in between, does not walk again.
        """
        memo = self._memo
        if memo is not None and memo[0] is key and memo[1] == self._version:
            return memo[2], memo[3]
        path, m = self._descend_by_keys(key)
        if m and not key.same_prefix(path[-1].seq, 0, m * self.page_size):
            self.hash_collisions += 1
            path, m = self._descend_exact(key)
        self._memo = (key, self._version, path, m)
        return path, m

    def _descend_by_keys(self, key: TokenKey) -> tuple[list[Node], int]:
        keys, nf, P = key.page_keys, key.num_full_pages, self.page_size
        node, path, m = self.root, [], 0
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
                    if c.keys.size and key.same_prefix(c.seq, lo, lo + P)
                ),
                None,
            )
            if nxt is None:
                break
            lim, j = min(nxt.keys.size, nf - m), 1
            while j < lim and key.same_prefix(nxt.seq, lo + j * P, lo + (j + 1) * P):
                j += 1
            path.append(nxt)
            m += j
            if j < nxt.keys.size or nxt.end > nxt.start + j * self.page_size:
                break
            node = nxt
        return path, m

    # -- insert ----------------------------------------------------------------------------------

    def insert(
        self, tokens: TokenKey | object, pages: IntArray, cached_len: int = 0
    ) -> InsertResult:
        """Insert a whole sequence whose KV sits in ``pages`` (one per page of its padded span).

        ``pages[:cached_len // page_size]`` must be the tree's own pages that the caller got from
        ``match_prefix`` and kept locked; the rest are the caller's freshly computed pages. Pages
        covering tokens the tree already holds (a concurrent insert of the same prefix, or a
        duplicate valid tail) are returned in ``free_pages`` for the caller to free.
        """
        key = self.key(tokens)
        P, n = self.page_size, len(key)
        num_pages = page_span(n, P)
        if pages.shape != (num_pages,):
            raise ConfigError(
                f"insert of {n} tokens needs {num_pages} pages (page_size {P}), got shape {pages.shape}"
            )
        if cached_len < 0 or cached_len % P or cached_len > n:
            raise ConfigError(
                f"cached_len must be a page-aligned length <= {n}, got {cached_len} (page_size {P})"
            )
        path, m = self._descend(key)
        if cached_len > m * P:
            raise ConfigError(
                f"cached_len {cached_len} exceeds the {m * P} tokens the tree holds for this key; "
                "keep the matched node locked between match_prefix and insert"
            )
        self.clock += 1
        for node in path:
            node.last_access = self.clock
        self._notify_access(path, hit=False)
        node = path[-1] if path else self.root
        kept = m  # caller pages up to here are covered by the tree's own pages
        prefix_len = m * P
        if m * P < n:
            rest_is_tail = n - m * P < P
            if node.end > m * P:  # the match ends inside `node`
                if rest_is_tail and node.end == n and self._same_tokens(node, key, m * P, n):
                    kept, prefix_len = num_pages, n  # duplicate valid tail
                else:
                    upper = self._split(node, m * P)
                    if self._child_key(key, m) in upper.children:
                        self.hash_collisions += 1  # the new page's key equals the split-off part's
                        node, kept = upper, num_pages
                    else:
                        node = self._new_leaf(upper, key, m, pages)
            else:
                twin = node.children.get(self._child_key(key, m))
                if twin is None:
                    node = self._new_leaf(node, key, m, pages)
                elif rest_is_tail and twin.end == n and self._same_tokens(twin, key, m * P, n):
                    twin.last_access = self.clock
                    self._notify_access([twin], hit=False)
                    node, kept, prefix_len = twin, num_pages, n  # duplicate valid tail
                else:
                    self.hash_collisions += 1  # a different page under an equal key: keep none
                    kept = num_pages
        free_pages = pages[cached_len // P : kept].copy()
        return InsertResult(prefix_len, free_pages, node)

    def _notify_access(self, nodes: list[Node], hit: bool) -> None:
        if self.policy.tracks_access:
            for node in nodes:
                for demoted in self.policy.on_access(node, hit):
                    self._push_if_evictable(demoted)

    def _child_key(self, key: TokenKey, m: int) -> int:
        """The key a child holding ``key``'s tokens from page ``m`` on is registered under."""
        return (
            key.end_key if len(key) - m * self.page_size < self.page_size else key.page_keys.item(m)
        )

    @staticmethod
    def _same_tokens(node: Node, key: TokenKey, lo: int, hi: int) -> bool:
        return key.same_prefix(node.seq, lo, hi)

    def _new_leaf(self, parent: Node, key: TokenKey, m: int, pages: IntArray) -> Node:
        self._version += 1
        P, n = self.page_size, len(key)
        start = m * P
        first_key = self._child_key(key, m)
        leaf = Node(
            self._next_id,
            parent,
            first_key,
            key.end_key,
            start,
            n,
            key.tokens,
            key.page_keys[m:],
            pages[m:].copy(),
            self.clock,
        )
        self._next_id += 1
        parent.children[first_key] = leaf
        self.num_pages += leaf.pages.size
        self.num_tokens += n - start
        self.num_nodes += 1
        self._push_if_evictable(leaf)
        return leaf

    def _split(self, node: Node, at: int) -> Node:
        """Split ``node`` at token ``at`` (a page boundary inside it); return the new upper part.

        The existing object keeps the lower part, so its locks, children and heap entries stay
        valid; the new node takes ``[node.start, at)`` and the node's place under its parent.
        """
        self._version += 1
        P = self.page_size
        assert node.start < at < node.end and at % P == 0, (node, at)
        k = (at - node.start) // P
        parent = node.parent
        assert parent is not None
        upper = Node(
            self._next_id,
            parent,
            node.first_key,
            int(node.keys[k - 1]),
            node.start,
            at,
            node.seq,
            node.keys[:k],
            node.pages[:k],
            node.last_access,
        )
        self._next_id += 1
        upper.hit_count = node.hit_count
        upper.residency = node.residency
        parent.children[node.first_key] = upper
        node.first_key = int(node.keys[k]) if node.keys.size > k else node.end_key
        node.keys = node.keys[k:]
        node.num_full = node.keys.size
        node.full_key = node.keys.item(-1) if node.keys.size else -1
        node.pages = node.pages[k:]
        node.start = at
        node.parent = upper
        upper.children[node.first_key] = node
        self.num_nodes += 1
        self.policy.on_split(upper, node)
        return upper

    # -- locks -----------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Protect ``node`` and, since eviction is leaf-up, all of its ancestors."""
        node.lock_ref += 1

    def unlock(self, node: Node) -> None:
        if node.lock_ref <= 0:
            raise TreeInvariantError(f"unlock of {node!r} which is not locked")
        node.lock_ref -= 1
        if node.lock_ref == 0:
            self._push_if_evictable(node)

    # -- eviction --------------------------------------------------------------------------------

    def _push_if_evictable(self, node: Node) -> None:
        if not node.children and node.lock_ref == 0 and not node.dead and node is not self.root:
            heapq.heappush(self._heap, (self.policy.priority(node), node))

    def evict(self, num_pages: int) -> IntArray:
        """Evict leaves in policy order until at least ``num_pages`` device pages are freed (or
        nothing evictable is left). Returns the freed pages; the caller returns them to the
        allocator."""
        freed: list[IntArray] = []
        count = 0
        heap, policy = self._heap, self.policy
        while count < num_pages and heap:
            prio, node = heapq.heappop(heap)
            if node.dead or node.children or node.lock_ref:
                continue
            current = policy.priority(node)
            if current != prio:  # accessed since it was queued: its priority only grew
                heapq.heappush(heap, (current, node))
                continue
            freed.append(self._remove_leaf(node))
            count += freed[-1].size
        if len(heap) > 4 * self.num_nodes + 64:
            self._rebuild_heap()
        return np.concatenate(freed) if freed else _EMPTY_PAGES

    def eviction_order(self) -> list[Node]:
        """The order ``evict`` would remove every evictable node, without removing any (for tests
        and reports). Leaf-up: a parent appears once all its children have."""
        saved = list(self._heap)
        order: list[Node] = []
        gone: set[int] = set()
        heap = list(self._heap)
        heapq.heapify(heap)
        remaining = {n.id: len(n.children) for n in self.nodes()}
        while heap:
            prio, node = heapq.heappop(heap)
            if node.dead or node.id in gone or remaining[node.id] or node.lock_ref:
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
                remaining[parent.id] -= 1
                if remaining[parent.id] == 0 and parent.lock_ref == 0:
                    heapq.heappush(heap, (self.policy.priority(parent), parent))
        self._heap = saved
        return order

    def _remove_leaf(self, node: Node) -> IntArray:
        self._version += 1
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.first_key]
        node.dead = True
        self.policy.on_remove(node)
        self.num_pages -= node.pages.size
        self.num_tokens -= node.end - node.start
        self.num_nodes -= 1
        if parent is not self.root:
            self._push_if_evictable(parent)
        return node.pages

    def _rebuild_heap(self) -> None:
        self._heap = [
            (self.policy.priority(n), n) for n in self.nodes() if not n.children and n.lock_ref == 0
        ]
        heapq.heapify(self._heap)

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

    def digest(self) -> str:
        """SHA-256 over the tree's full replicated state (structure, pages, locks, clock, stats)."""
        h = hashlib.sha256()
        h.update(np.array([self.clock, self.num_pages, self.num_tokens], dtype=np.int64).tobytes())
        for n in self.nodes():
            assert n.parent is not None
            h.update(
                np.array(
                    [
                        n.id,
                        n.parent.id,
                        n.start,
                        n.end,
                        n.lock_ref,
                        n.last_access,
                        n.hit_count,
                        n.segment,
                    ],
                    dtype=np.int64,
                ).tobytes()
            )
            h.update(n.pages.tobytes())
        return h.hexdigest()

    def check(self) -> None:
        """Verify every invariant; raise :class:`TreeInvariantError` naming the node otherwise."""
        P = self.page_size
        seen_pages: list[IntArray] = []
        num_pages = num_tokens = 0
        nodes = self.nodes()
        for n in nodes:
            parent = n.parent

            def fail(what: str, n: Node = n) -> TreeInvariantError:
                return TreeInvariantError(f"node {n.id} [{n.start}, {n.end}): {what}")

            if n.dead:
                raise fail("a dead node is still linked")
            if parent is None or parent.children.get(n.first_key) is not n:
                raise fail("not registered under its parent with its first key")
            if n.start != parent.end or n.start % P:
                raise fail(f"starts at {n.start}, parent ends at {parent.end}")
            if n.end <= n.start:
                raise fail("is empty")
            if n.children and n.end % P:
                raise fail("has children but ends inside a page (valid tail)")
            if (
                n.pages.size != page_span(n.end - n.start, P)
                or n.keys.size != (n.end - n.start) // P
            ):
                raise fail(f"holds {n.pages.size} pages and {n.keys.size} keys")
            if n.num_full != n.keys.size or n.full_key != (n.keys.item(-1) if n.keys.size else -1):
                raise fail("cached full-page count or last full key is stale")
            if n.lock_ref < 0:
                raise fail(f"lock_ref {n.lock_ref} < 0")
            toks = n.seq[: n.end]
            if parent is not self.root and not np.array_equal(
                toks[: n.start], parent.seq[: n.start]
            ):
                raise fail("its tokens do not continue its parent's path")
            ref = self.hasher.key(toks, P)
            if (
                not np.array_equal(ref.page_keys[n.start // P :], n.keys)
                or ref.end_key != n.end_key
            ):
                raise fail("stored prefix keys disagree with its tokens")
            first = ref.end_key if n.end - n.start < P else int(ref.page_keys[n.start // P])
            if first != n.first_key:
                raise fail("first key disagrees with its tokens")
            positions = np.arange(n.start // P, n.start // P + n.pages.size)
            if np.any(n.pages % self.cp_size != positions % self.cp_size):
                raise fail("holds a page whose lane is not the owner of its position")
            seen_pages.append(n.pages)
            num_pages += n.pages.size
            num_tokens += n.end - n.start
        allp = np.concatenate(seen_pages) if seen_pages else _EMPTY_PAGES
        if np.unique(allp).size != allp.size:
            raise TreeInvariantError("a page is held by two nodes")
        if (num_pages, num_tokens, len(nodes)) != (self.num_pages, self.num_tokens, self.num_nodes):
            raise TreeInvariantError(
                f"counters {(self.num_pages, self.num_tokens, self.num_nodes)} != "
                f"actual {(num_pages, num_tokens, len(nodes))}"
            )
        queued: dict[int, Priority] = {}
        for prio, n in self._heap:
            if n.id not in queued or prio < queued[n.id]:
                queued[n.id] = prio
        for n in nodes:
            if not n.children and n.lock_ref == 0:
                q = queued.get(n.id)
                if q is None or q > self.policy.priority(n):
                    raise TreeInvariantError(f"evictable leaf {n.id} is not queued for eviction")
