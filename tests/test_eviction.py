"""Tests for kvstrata.cache.eviction: victim order against a brute force, and SLRU segment semantics.

The brute force repeatedly takes, among the current leaves with ``lock_ref == 0``, the node with
the smallest ``policy.priority`` and removes it (virtually); its order must equal both
``tree.eviction_order()`` and the order in which ``evict`` really removes nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.cache.allocator import PageAllocator
from kvstrata.cache.eviction import PROBATION, PROTECTED, LRUPolicy, SLRUPolicy, make_policy
from kvstrata.cache.radix import MatchResult, Node, RadixTree
from kvstrata.config import CacheConfig, PoolConfig
from kvstrata.ownership import page_span
from kvstrata.residency import Tier

CAPACITY = 16  # tree capacity in pages: with protected_fraction 0.25 the SLRU cap is 4 pages
HUGE = 10**9


def make(
    page_size: int, eviction: str, capacity: int = CAPACITY
) -> tuple[RadixTree, PageAllocator]:
    cfg = CacheConfig(page_size=page_size, eviction=eviction, protected_fraction=0.25)
    # The allocator is large enough that building a tree never needs eviction.
    return RadixTree(cfg, capacity), PageAllocator(PoolConfig(512))


def serve(
    tree: RadixTree,
    alloc: PageAllocator,
    tokens: list[int],
    on_match: Callable[[MatchResult], None] | None = None,
) -> MatchResult:
    """Engine loop for one request (match, lock, alloc, insert, free duplicates, unlock);
    ``on_match`` sees the match before the insert changes the tree."""
    key = tree.key(tokens)
    n, P = len(key), tree.page_size
    match = tree.match_prefix(key)
    if on_match is not None:
        on_match(match)
    tree.lock(match.last_node)
    cached = min(match.valid_len, (n - 1) // P * P)
    start = cached // P
    fresh = alloc.alloc(start, page_span(n, P) - start)
    assert fresh is not None
    result = tree.insert(key, np.concatenate([match.device_pages[:start], fresh]), cached)
    alloc.free(result.free_pages)
    tree.unlock(match.last_node)
    return match


def path_of(result: MatchResult) -> list[Node]:
    """The nodes a match walked through, root side first."""
    if result.valid_len == 0:
        return []
    out: list[Node] = []
    node: Node | None = result.last_node
    while node is not None and node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


def brute_force_order(tree: RadixTree) -> list[Node]:
    nodes = tree.nodes()
    children = {n.id: len(n.children) for n in nodes}
    gone: set[int] = set()
    order: list[Node] = []
    while True:
        leaves = [n for n in nodes if n.id not in gone and children[n.id] == 0 and n.lock_ref == 0]
        if not leaves:
            return order
        victim = min(leaves, key=tree.policy.priority)
        order.append(victim)
        gone.add(victim.id)
        assert victim.parent is not None
        if victim.parent is not tree.root:
            children[victim.parent.id] -= 1


def evictable_leaves(tree: RadixTree) -> list[Node]:
    return [n for n in tree.nodes() if not n.children and n.lock_ref == 0]


class SegmentModel:
    """Reference SLRU segments: a node is protected once hit twice; while the protected pages
    exceed the cap, the protected node least recently used (``(last_access, id)``) is demoted.

    Within one match the tree processes the path root-first; nodes further down the path have
    not been handled yet when an earlier node's promotion overflows the cap, so they are not
    candidates until their turn.
    """

    def __init__(self, cap_pages: int) -> None:
        self.cap = cap_pages
        self.seg: dict[int, int] = {}
        self.nodes: dict[int, Node] = {}

    def protected_pages(self) -> int:
        return sum(self.nodes[i].span for i, s in self.seg.items() if s == PROTECTED)

    def sync_structure(self, tree: RadixTree) -> None:
        """Register nodes an insert created (a split's upper half inherits its lower half's
        segment; a new leaf is probationary) and drop evicted ones."""
        alive = {n.id: n for n in tree.nodes()}
        for i in [i for i in self.seg if i not in alive]:
            del self.seg[i]
            del self.nodes[i]
        new = [n for i, n in alive.items() if i not in self.seg]
        for node in new:
            known = [c for c in node.children.values() if c.id in self.seg]
            assert len(known) <= 1
            self.seg[node.id] = self.seg[known[0].id] if known else PROBATION
            self.nodes[node.id] = node

    def on_match(self, path: list[Node]) -> None:
        for k, node in enumerate(path):
            if self.seg[node.id] == PROBATION:
                if node.hit_count < 2:
                    continue
                self.seg[node.id] = PROTECTED
            later = {n.id for n in path[k + 1 :]}
            while self.protected_pages() > self.cap:
                candidates = [
                    self.nodes[i] for i, s in self.seg.items() if s == PROTECTED and i not in later
                ]
                victim = min(candidates, key=lambda n: (n.last_access, n.id))
                self.seg[victim.id] = PROBATION


def check_segments(tree: RadixTree) -> None:
    policy = tree.policy
    nodes = tree.nodes()
    if isinstance(policy, SLRUPolicy):
        protected = [n for n in nodes if n.segment == PROTECTED]
        assert policy.protected_pages == sum(n.span for n in protected)
        assert policy.protected_pages <= policy.cap_pages
        assert all(n.hit_count >= 2 for n in protected)
    else:
        assert all(n.segment == PROBATION for n in nodes)


@st.composite
def token_seq(draw: st.DrawFn, stems: list[list[int]]) -> list[int]:
    stem = draw(st.sampled_from(stems))
    seq = stem[: draw(st.integers(0, len(stem)))] + draw(st.lists(st.integers(0, 2), max_size=4))
    return seq or [0]


def build_random_tree(
    data: st.DataObject, page_size: int, eviction: str, model: SegmentModel | None = None
) -> tuple[RadixTree, PageAllocator, list[Node]]:
    tree, alloc = make(page_size, eviction)
    stems = data.draw(
        st.lists(
            st.lists(st.integers(0, 2), min_size=1, max_size=4 * page_size + 2),
            min_size=1,
            max_size=4,
        ),
        label="stems",
    )
    seqs = token_seq(stems)
    locks: list[Node] = []

    def on_match(match: MatchResult) -> None:
        if model is not None:
            model.sync_structure(tree)  # a match that ends inside a node splits it
            model.on_match(path_of(match))

    for _ in range(data.draw(st.integers(1, 40), label="num_ops")):
        op = data.draw(st.sampled_from(["serve", "serve", "match", "match", "lock", "unlock"]))
        if op == "serve":
            serve(tree, alloc, data.draw(seqs, label="seq"), on_match)
        elif op == "unlock":
            if locks:
                tree.unlock(locks.pop(data.draw(st.integers(0, len(locks) - 1))))
        else:
            match = tree.match_prefix(data.draw(seqs, label="seq"))
            on_match(match)
            if op == "lock":
                tree.lock(match.last_node)
                locks.append(match.last_node)
        if model is not None:
            model.sync_structure(tree)
            assert {n.id: n.segment for n in tree.nodes()} == model.seg
        tree.check()
        check_segments(tree)
    return tree, alloc, locks


def assert_eviction_follows_the_brute_force(
    tree: RadixTree, alloc: PageAllocator, locks: list[Node]
) -> None:
    expected = brute_force_order(tree)
    assert [n.id for n in tree.eviction_order()] == [n.id for n in expected]
    tree.check()  # eviction_order must not disturb the tree
    evicted: list[Node] = []
    while True:
        leaves = evictable_leaves(tree)
        segments_before = {n.id: n.segment for n in leaves}
        # One page at a time: the tail page of the brute force's first victim goes.
        victim = brute_force_order(tree)[0] if leaves else None
        tail = int(victim.pages[-1]) if victim is not None else None
        freed = tree.evict(1)
        if freed.size == 0:
            assert not leaves
            break
        assert victim is not None and freed.tolist() == [tail]
        if segments_before[victim.id] == PROTECTED:
            assert all(s == PROTECTED for s in segments_before.values()), (
                "a protected leaf went before a probationary one"
            )
        if victim.dead:
            evicted.append(victim)
        else:
            assert victim.pages.size and victim.end % tree.page_size == 0
        alloc.free(freed)
        tree.check()
        check_segments(tree)
    assert [n.id for n in evicted] == [n.id for n in expected]
    survivors = {n.id for n in tree.nodes()}
    for node in locks:
        assert not node.dead
        cur: Node | None = node
        while cur is not None and cur is not tree.root:
            assert cur.id in survivors
            cur = cur.parent
    for node in locks:
        tree.unlock(node)
    alloc.free(tree.evict(HUGE))
    assert tree.num_pages == 0 and alloc.num_free == alloc.num_pages
    tree.check()


@given(
    page_size=st.sampled_from([1, 2, 4]),
    eviction=st.sampled_from(["lru", "slru"]),
    data=st.data(),
)
@settings(max_examples=120, deadline=None)
def test_victim_order_equals_the_brute_force(
    page_size: int, eviction: str, data: st.DataObject
) -> None:
    tree, alloc, locks = build_random_tree(data, page_size, eviction)
    assert_eviction_follows_the_brute_force(tree, alloc, locks)


@given(page_size=st.sampled_from([1, 2, 4]), data=st.data())
@settings(max_examples=120, deadline=None)
def test_slru_segments_match_the_reference_model(page_size: int, data: st.DataObject) -> None:
    tree, _ = make(page_size, "slru")
    assert isinstance(tree.policy, SLRUPolicy)
    build_random_tree(data, page_size, "slru", SegmentModel(tree.policy.cap_pages))


# -- hand-built cases ------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_first() -> None:
    tree, alloc = make(2, "lru")
    a, b, c = [1, 1, 1, 1], [2, 2], [3, 3, 3]
    for seq in (a, b, c):
        serve(tree, alloc, seq)
    tree.match_prefix(a)
    order = tree.eviction_order()
    firsts = [int(n.tokens[0]) for n in order]
    assert firsts == [2, 3, 1]
    assert tree.evict(1).tolist() == order[0].pages.tolist()


def test_leaf_up_parent_goes_after_its_children() -> None:
    tree, alloc = make(2, "lru")
    serve(tree, alloc, [1, 1, 2, 2])
    serve(tree, alloc, [1, 1, 3, 3])
    order = tree.eviction_order()
    assert [(n.start, n.end) for n in order] == [(2, 4), (2, 4), (0, 2)]
    assert order[-1] is order[0].parent is order[1].parent


def test_slru_protects_after_two_hits_and_evicts_probation_first() -> None:
    tree, alloc = make(1, "slru")
    serve(tree, alloc, [1, 2])  # A
    serve(tree, alloc, [5])  # B
    a = tree.match_prefix([1, 2]).last_node  # A hit once
    assert a.segment == PROBATION
    a = tree.match_prefix([1, 2]).last_node  # A hit twice
    assert a.segment == PROTECTED
    assert isinstance(tree.policy, SLRUPolicy) and tree.policy.protected_pages == 2
    b = tree.match_prefix([5]).last_node  # B is now more recent than A, but probationary
    assert b.segment == PROBATION and b.last_access > a.last_access
    assert [n.id for n in tree.eviction_order()] == [b.id, a.id]
    assert tree.evict(1).tolist() == b.pages.tolist()
    alloc.free(b.pages)
    assert tree.evict(2).tolist() == a.pages.tolist()
    assert tree.policy.protected_pages == 0


def test_slru_overflow_demotes_the_least_recently_used_protected_node() -> None:
    tree, alloc = make(1, "slru", capacity=12)  # cap = int(0.25 * 12) = 3 pages
    policy = tree.policy
    assert isinstance(policy, SLRUPolicy) and policy.cap_pages == 3
    for seq in ([1, 2], [3], [4]):
        pages = alloc.alloc(0, len(seq))
        assert pages is not None
        tree.insert(seq, pages, 0)
    nodes = {}
    for seq in ([1, 2], [3], [4]):
        tree.match_prefix(seq)
        nodes[seq[0]] = tree.match_prefix(seq).last_node
        check_segments(tree)
    # [1, 2] (2 pages) and [3] filled the cap; protecting [4] demotes [1, 2], the oldest.
    assert nodes[1].segment == PROBATION
    assert nodes[3].segment == PROTECTED and nodes[4].segment == PROTECTED
    assert policy.protected_pages == 2


def test_slru_demotion_after_an_insert_still_picks_the_lru_node() -> None:
    tree, alloc = make(1, "slru", capacity=10)  # cap = int(0.25 * 10) = 2 pages
    serve(tree, alloc, [1, 2])
    tree.match_prefix([1, 2])
    a = tree.match_prefix([1, 2]).last_node
    assert a.segment == PROTECTED
    serve(tree, alloc, [1, 2])  # the engine serves A again: match, insert (bumps A), unlock
    serve(tree, alloc, [5])
    tree.match_prefix([5])
    b = tree.match_prefix([5]).last_node
    assert a.last_access < b.last_access
    assert (a.segment, b.segment) == (PROBATION, PROTECTED)


def test_split_keeps_segment_and_protected_page_count() -> None:
    tree, alloc = make(2, "slru", capacity=40)  # cap 10 pages
    serve(tree, alloc, [1, 1, 2, 2, 3, 3])
    tree.match_prefix([1, 1, 2, 2, 3, 3])
    node = tree.match_prefix([1, 1, 2, 2, 3, 3]).last_node
    assert node.segment == PROTECTED
    hits = node.hit_count
    serve(tree, alloc, [1, 1, 2, 2, 9, 9])  # splits the protected node after its second page
    upper = node.parent
    assert upper is not None and upper is not tree.root
    # The split copies segment and hits; the match that split it then hit only the upper half.
    assert upper.segment == PROTECTED and node.segment == PROTECTED
    assert (upper.hit_count, node.hit_count) == (hits + 1, hits)
    check_segments(tree)
    tree.check()


def test_make_policy() -> None:
    assert isinstance(make_policy(CacheConfig(eviction="lru"), 100), LRUPolicy)
    slru = make_policy(CacheConfig(eviction="slru", protected_fraction=0.3), 100)
    assert isinstance(slru, SLRUPolicy) and slru.cap_pages == 30


# -- the lazy heaps stay bounded and correct -------------------------------------------------------


@pytest.mark.parametrize("eviction", ["lru", "slru"])
def test_stale_heap_entries_are_rebuilt_away(eviction: str) -> None:
    tree, alloc = make(1, eviction)
    for seq in ([1, 2], [1, 3], [4], [5, 6, 7]):
        serve(tree, alloc, seq)
    leaf = tree.match_prefix([5, 6, 7]).last_node
    for _ in range(300):  # every unlock queues the leaf again
        tree.lock(leaf)
        tree.unlock(leaf)
        tree.check()
    expected = brute_force_order(tree)
    victim = expected[0]
    assert tree.evict(victim.span).tolist() == victim.pages.tolist()
    assert len(tree.heaps[Tier.L1]) <= 4 * tree.num_nodes + 64
    tree.check()
    assert [n.id for n in tree.eviction_order()] == [n.id for n in expected[1:]]


def test_slru_lazy_heap_is_compacted_without_changing_segments() -> None:
    tree, alloc = make(1, "slru")  # cap 4 pages
    policy = tree.policy
    assert isinstance(policy, SLRUPolicy)
    model = SegmentModel(policy.cap_pages)
    seqs = [[i] for i in range(6)] + [[9, 9]]
    for seq in seqs:
        pages = alloc.alloc(0, len(seq))
        assert pages is not None
        tree.insert(seq, pages, 0)
    model.sync_structure(tree)
    # Only matches from here on, so every access goes through the policy.
    for step in range(1200):
        seq = seqs[(step * 5 + step // 7) % len(seqs)]
        match = tree.match_prefix(seq)
        model.sync_structure(tree)
        model.on_match(path_of(match))
        assert {n.id: n.segment for n in tree.nodes()} == model.seg
        check_segments(tree)
    assert len(policy._lru) <= 4 * max(64, policy.protected_pages) + 1
    tree.check()
