"""Tests for kvstrata.cache.planner: the lazy-heap planner picks exactly what a naive greedy planner
picks, trims are minimal and tail-first, and eviction frees no more than the deficit needs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.cache.allocator import PageAllocator
from kvstrata.cache.planner import as_deficit, lane_counts, trim_count
from kvstrata.cache.radix import Node, RadixTree
from kvstrata.config import CacheConfig, PoolConfig
from kvstrata.errors import ConfigError
from kvstrata.ownership import owners, page_span
from kvstrata.residency import Tier


def build(seed: int, cp_size: int, page_size: int) -> tuple[RadixTree, PageAllocator, list[Node]]:
    """A random tree: sessions that share prefixes, some locked matches."""
    rng = np.random.default_rng(seed)
    tree = RadixTree(CacheConfig(page_size=page_size, cp_size=cp_size), 4096)
    alloc = PageAllocator(PoolConfig(4096, cp_size))
    stems = [rng.integers(0, 4, rng.integers(1, 6 * page_size)) for _ in range(3)]
    locks: list[Node] = []
    for _ in range(int(rng.integers(5, 40))):
        stem = stems[int(rng.integers(0, len(stems)))]
        tokens = np.concatenate(
            [stem[: rng.integers(0, stem.size + 1)], rng.integers(0, 4, rng.integers(1, 30))]
        )
        key = tree.key(tokens)
        hit = tree.match_prefix(key)
        start = hit.valid_len // page_size
        fresh = alloc.alloc(start, page_span(tokens.size, page_size) - start)
        assert fresh is not None
        alloc.free(
            tree.insert(key, np.concatenate([hit.device_pages, fresh]), hit.valid_len).free_pages
        )
        if rng.random() < 0.15:
            node = tree.match_prefix(tokens[: rng.integers(1, tokens.size + 1)]).last_node
            tree.lock(node)
            locks.append(node)
    return tree, alloc, locks


def naive_evict(tree: RadixTree, deficit: np.ndarray | int) -> list[int]:
    """The greedy planner written plainly: scan every node for the best candidate, try trim
    counts one by one, skip candidates without a page in a short lane."""
    P = tree.page_size
    need = [int(deficit)] if isinstance(deficit, int) else [int(d) for d in deficit]
    lanes = len(need)
    passed: set[int] = set()
    freed: list[int] = []
    while max(need) > 0:
        candidates = [
            n for n in tree.nodes() if tree.is_candidate(n, Tier.L1) and n.id not in passed
        ]
        if not candidates:
            # Nothing left holds a short lane's page: the oldest passed-over one goes whole.
            stuck = [n for n in tree.nodes() if tree.is_candidate(n, Tier.L1) and n.id in passed]
            if not stuck:
                break
            victim = min(stuck, key=tree.policy.priority)
            passed.discard(victim.id)
            first = victim.start // P
            positions = list(range(first, first + victim.span))
            freed += tree.trim(victim, Tier.L1, victim.span).tolist()
            for p in positions:
                need[p % lanes] = max(need[p % lanes] - 1, 0)
            continue
        victim = min(candidates, key=tree.policy.priority)
        first = victim.start // P
        positions = list(range(first, first + victim.span))
        have = [sum(1 for p in positions if p % lanes == lane) for lane in range(lanes)]
        count = 0
        for t in range(1, victim.span + 1):
            got = [0] * lanes
            for p in positions[victim.span - t :]:
                got[p % lanes] += 1
            count = t
            if all(g >= min(n, h) for g, n, h in zip(got, need, have, strict=True)):
                break
        useful = any(need[p % lanes] > 0 for p in positions)
        if not useful:
            passed.add(victim.id)
            continue
        tail = positions[victim.span - count :]
        freed += tree.trim(victim, Tier.L1, count).tolist()
        for p in tail:
            need[p % lanes] = max(need[p % lanes] - 1, 0)
    return freed


@pytest.mark.parametrize("seed", range(300))
def test_planner_picks_what_the_naive_greedy_planner_picks(seed: int) -> None:
    rng = np.random.default_rng(10_000 + seed)
    cp_size = int(rng.integers(1, 5))
    page_size = int(rng.choice([1, 2, 4]))
    fast, fast_alloc, _ = build(seed, cp_size, page_size)
    slow, _, _ = build(seed, cp_size, page_size)
    assert fast.digest() == slow.digest()
    for _ in range(3):
        if rng.random() < 0.3:
            deficit: np.ndarray | int = int(rng.integers(0, 20))
        else:
            deficit = rng.integers(0, 12, cp_size)
        got = fast.evict(deficit)
        want = naive_evict(slow, deficit)
        assert got.tolist() == want
        assert fast.digest() == slow.digest()
        fast_alloc.free(got)
        fast.check()


@given(
    first=st.integers(0, 50),
    span=st.integers(1, 40),
    need=st.lists(st.integers(0, 12), min_size=1, max_size=5),
)
def test_trim_count_is_the_smallest_tail_that_covers_the_need(
    first: int, span: int, need: list[int]
) -> None:
    lanes = len(need)
    count = trim_count(first, span, need)
    have = lane_counts(first, span, lanes)
    if not any(n > 0 and h > 0 for n, h in zip(need, have, strict=True)):
        assert count == 0
        return
    got = lane_counts(first + span - count, count, lanes)
    covered = all(g >= min(n, h) for g, n, h in zip(got, need, have, strict=True))
    assert covered
    if count > 1:  # one page fewer would leave a short lane uncovered
        less = lane_counts(first + span - count + 1, count - 1, lanes)
        assert not all(g >= min(n, h) for g, n, h in zip(less, need, have, strict=True))


@given(first=st.integers(0, 100), count=st.integers(0, 60), lanes=st.integers(1, 6))
def test_lane_counts_counts_positions(first: int, count: int, lanes: int) -> None:
    expected = np.bincount(np.arange(first, first + count) % lanes, minlength=lanes)
    assert lane_counts(first, count, lanes) == expected.tolist()


@given(seed=st.integers(0, 10_000), k=st.integers(1, 60))
@settings(max_examples=150, deadline=None)
def test_at_cp_1_eviction_frees_exactly_the_deficit(seed: int, k: int) -> None:
    tree, alloc, locks = build(seed, 1, 2)
    for node in locks:
        tree.unlock(node)
    available = tree.num_pages
    freed = tree.evict(np.array([k]))
    assert freed.size == min(k, available)
    alloc.free(freed)
    tree.check()


@given(
    cp_size=st.integers(2, 4),
    leaf_pages=st.integers(1, 80),
    start=st.integers(0, 7),
    k=st.integers(1, 80),
)
@settings(max_examples=200, deadline=None)
def test_a_trim_frees_at_most_the_deficit_plus_one_page_per_lane(
    cp_size: int, leaf_pages: int, start: int, k: int
) -> None:
    """For the deficit of a contiguous allocation (what the engine asks for), trimming a victim
    frees per lane at most what that lane is short plus one page. (Across several victims a
    lane can get more: pages leave a prefix only from its tail, never from the middle.)"""
    tree = RadixTree(CacheConfig(page_size=1, cp_size=cp_size), 256)
    alloc = PageAllocator(PoolConfig(256, cp_size))
    fresh = alloc.alloc(0, leaf_pages)
    assert fresh is not None
    tree.insert(np.arange(leaf_pages), fresh, 0)
    need = np.bincount(owners(start, k, cp_size), minlength=cp_size)
    freed = tree.evict(need)
    per_lane = np.bincount(freed % cp_size, minlength=cp_size)
    assert np.all(per_lane <= need + 1), (per_lane, need)
    have = np.bincount(np.arange(leaf_pages) % cp_size, minlength=cp_size)
    assert np.all(per_lane >= np.minimum(need, have))  # every short lane got what it could
    alloc.free(freed)
    tree.check()


def test_bad_deficits_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        as_deficit(-1, 2)
    with pytest.raises(ConfigError):
        as_deficit(np.array([1, 2, 3]), 2)
    with pytest.raises(ConfigError):
        as_deficit(np.array([1.5, 2.0]), 2)
    with pytest.raises(ConfigError):
        as_deficit(np.array([-1, 2]), 2)


def test_a_victim_without_short_lane_pages_goes_only_when_nothing_else_helps() -> None:
    P, cp = 1, 2
    tree = RadixTree(CacheConfig(page_size=P, cp_size=cp), 64)
    alloc = PageAllocator(PoolConfig(64, cp))
    fresh = alloc.alloc(0, 3)
    assert fresh is not None
    tree.insert([1, 2, 3], fresh, 0)  # lanes 0 1 0
    more = alloc.alloc(3, 1)
    assert more is not None
    tree.insert([1, 2, 3, 4], np.concatenate([fresh, more]), 3)  # a leaf [4] in lane 1
    tree.match_prefix([1, 2, 3, 5])  # touch [1 2 3], not the leaf: it is the oldest candidate
    freed = tree.evict(np.array([1, 0]))  # lane 0 short: the leaf holds none
    # The leaf (lane 1) had to go to expose its parent, whose tail page (lane 0) then went.
    assert sorted(int(p) % cp for p in freed) == [0, 1]
    assert tree.match_prefix([1, 2, 3]).valid_len == 2
    tree.check()


def test_a_victim_without_short_lane_pages_is_passed_over() -> None:
    P, cp = 1, 4
    tree = RadixTree(CacheConfig(page_size=P, cp_size=cp), 64)
    alloc = PageAllocator(PoolConfig(64, cp))
    for tokens in ([1, 2], [5, 6, 7, 8]):  # [1, 2] holds lanes 0-1 only; it is the LRU leaf
        fresh = alloc.alloc(0, len(tokens))
        assert fresh is not None
        tree.insert(tokens, fresh, 0)
    old = tree.match_prefix([1, 2]).last_node
    freed = tree.evict(np.array([0, 0, 0, 1]))  # only lane 3 is short
    assert freed.size == 1 and int(freed[0]) % cp == 3
    assert not old.dead and old.span == 2  # passed over, still cached
    assert tree.match_prefix([5, 6, 7, 8]).valid_len == 3  # the other leaf lost its tail page
    tree.check()
