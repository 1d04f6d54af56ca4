"""Tests for kvstrata.cache.radix against a dict-of-pages reference model.

The reference model keeps, for every cached whole-page prefix (a tuple of token ids), the logical
page that holds its last page, and for every cached sequence that ends in a valid tail, the page of
that tail. A match is the longest run of whole-page prefixes present; an insert stores each page the
model has not seen and frees every duplicate. After every operation the model must equal what the
tree holds, and tree pages + allocator free pages must partition the page space.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence

import numpy as np
import pytest
from helpers import OrderBlindHasher
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.cache.allocator import PageAllocator
from kvstrata.cache.keys import PrefixHasher
from kvstrata.cache.radix import InsertResult, MatchResult, Node, RadixTree
from kvstrata.config import CacheConfig, PoolConfig
from kvstrata.errors import ConfigError, InvalidTokensError, TreeUsageError
from kvstrata.ownership import owners, page_span
from kvstrata.residency import Tier
from kvstrata.workloads import shared_synthetic as synthetic

HUGE = 10**9
Prefix = tuple[int, ...]


# -- helpers ---------------------------------------------------------------------------------------


def make(
    page_size: int,
    num_pages: int = 64,
    cp_size: int = 1,
    hasher: PrefixHasher | None = None,
    eviction: str = "lru",
    allocator: bool = False,
) -> tuple[RadixTree, PageAllocator]:
    """A tree and its allocator; with ``allocator`` the tree also checks pages against it."""
    cfg = CacheConfig(page_size=page_size, cp_size=cp_size, eviction=eviction)
    alloc = PageAllocator(PoolConfig(num_pages, cp_size))
    tree = RadixTree(cfg, num_pages, hasher=hasher, allocator=alloc if allocator else None)
    return tree, alloc


def alloc_evicting(
    tree: RadixTree, alloc: PageAllocator, start: int, count: int, on_evict: object = None
) -> np.ndarray | None:
    """Pages for positions [start, start + count), evicting for the lanes that are short."""
    while (fresh := alloc.alloc(start, count)) is None:
        freed = tree.evict(alloc.deficit(owners(start, count, tree.cp_size)))
        if freed.size == 0:
            return None
        if callable(on_evict):
            on_evict(freed)
        alloc.free(freed)
    return fresh


def serve(tree: RadixTree, alloc: PageAllocator, tokens: object) -> MatchResult | None:
    """The engine loop for one request: match, lock, allocate the uncached suffix (always
    recomputing the last token), insert, free the duplicates, unlock."""
    key = tree.key(tokens)
    n, P = len(key), tree.page_size
    match = tree.match_prefix(key)
    tree.lock(match.last_node)
    try:
        cached = min(match.valid_len, (n - 1) // P * P)
        start = cached // P
        fresh = alloc_evicting(tree, alloc, start, page_span(n, P) - start)
        if fresh is None:
            return None
        result = tree.insert(key, np.concatenate([match.device_pages[:start], fresh]), cached)
        alloc.free(result.free_pages)
    finally:
        tree.unlock(match.last_node)
    return match


def path_tokens(node: Node) -> list[int]:
    """The tokens of the whole path from the root to the end of ``node``."""
    parts: list[list[int]] = []
    cur: Node | None = node
    while cur is not None and cur.parent is not None:
        parts.append(cur.tokens.tolist())
        cur = cur.parent
    return [t for part in reversed(parts) for t in part]


def tree_contents(tree: RadixTree) -> tuple[dict[Prefix, int], dict[Prefix, int]]:
    """What the tree holds, as (whole-page prefix -> page, tail-ended sequence -> tail page)."""
    P = tree.page_size
    full: dict[Prefix, int] = {}
    tails: dict[Prefix, int] = {}
    for node in tree.nodes():
        path = path_tokens(node)
        for i, page in enumerate(node.pages.tolist()):
            hi = node.start + (i + 1) * P
            if hi <= node.end:
                assert tuple(path[:hi]) not in full, "a whole page is cached twice"
                full[tuple(path[:hi])] = page
            else:
                assert tuple(path) not in tails, "a valid tail is cached twice"
                tails[tuple(path)] = page
    return full, tails


class Model:
    """The dict-of-pages reference prefix cache."""

    def __init__(self, page_size: int) -> None:
        self.P = page_size
        self.full: dict[Prefix, int] = {}
        self.tails: dict[Prefix, int] = {}

    def match(self, seq: Sequence[int]) -> list[int]:
        out: list[int] = []
        for i in range(1, len(seq) // self.P + 1):
            page = self.full.get(tuple(seq[: i * self.P]))
            if page is None:
                break
            out.append(page)
        return out

    def prefix_len(self, seq: Sequence[int]) -> int:
        n, matched = len(seq), len(self.match(seq)) * self.P
        if matched == n // self.P * self.P and (n % self.P == 0 or tuple(seq) in self.tails):
            return n
        return matched

    def insert(self, seq: Sequence[int], pages: np.ndarray, cached_len: int) -> list[int]:
        """Record the insert; return the pages the tree must hand back, in page order."""
        P, n = self.P, len(seq)
        dupes: list[int] = []
        for i in range(n // P):
            prefix, page = tuple(seq[: (i + 1) * P]), int(pages[i])
            if prefix in self.full:
                if i < cached_len // P:
                    assert page == self.full[prefix], "cached page is not the tree's page"
                else:
                    dupes.append(page)
            else:
                assert i >= cached_len // P
                self.full[prefix] = page
        if n % P:
            if tuple(seq) in self.tails:
                dupes.append(int(pages[-1]))
            else:
                self.tails[tuple(seq)] = int(pages[-1])
        return dupes

    def evict(self, freed: np.ndarray) -> None:
        gone = freed.tolist()
        assert len(set(gone)) == len(gone), "a page was evicted twice"
        held = set(self.full.values()) | set(self.tails.values())
        assert set(gone) <= held, "evict returned a page the tree did not hold"
        drop = set(gone)
        self.full = {k: v for k, v in self.full.items() if v not in drop}
        self.tails = {k: v for k, v in self.tails.items() if v not in drop}

    def pages(self) -> set[int]:
        return set(self.full.values()) | set(self.tails.values())


def assert_consistent(tree: RadixTree, alloc: PageAllocator, model: Model) -> None:
    tree.check()
    alloc.check()
    full, tails = tree_contents(tree)
    assert full == model.full
    assert tails == model.tails
    in_tree = model.pages()
    assert len(in_tree) == tree.num_pages == len(full) + len(tails)
    free = set(np.flatnonzero(alloc.is_free(np.arange(alloc.num_pages))).tolist())
    assert not in_tree & free, "a page is both cached and free"
    assert in_tree | free == set(range(alloc.num_pages)), "a page leaked"


def ancestors(node: Node) -> list[Node]:
    out: list[Node] = []
    cur: Node | None = node
    while cur is not None and cur.parent is not None:
        out.append(cur)
        cur = cur.parent
    return out


def checked_match(tree: RadixTree, model: Model, seq: list[int]) -> MatchResult:
    expected = model.match(seq)
    before = tree.digest()
    assert tree.match_length(seq) == len(expected) * tree.page_size
    assert tree.digest() == before, "match_length must not record an access"
    result = tree.match_prefix(seq)
    assert result.valid_len == len(expected) * tree.page_size
    assert result.device_pages.tolist() == expected
    assert result.pages(Tier.L1) is result.device_pages
    assert result.pages(Tier.L2).size == 0
    return result


# -- randomized operations against the reference model --------------------------------------------


@st.composite
def token_seq(draw: st.DrawFn, stems: list[list[int]], page_size: int, alphabet: int) -> list[int]:
    stem = draw(st.sampled_from(stems))
    cut = draw(st.integers(0, len(stem)))
    suffix = draw(st.lists(st.integers(0, alphabet - 1), max_size=page_size + 2))
    seq = stem[:cut] + suffix
    return seq or [0]


def run_random_ops(
    data: st.DataObject,
    page_size: int,
    cp_size: int,
    hasher: PrefixHasher | None = None,
    alphabet: int = 3,
) -> RadixTree:
    P = page_size
    num_pages = 24
    tree, alloc = make(P, num_pages, cp_size, hasher)
    model = Model(P)
    stem_st = st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=3 * P + 3)
    stems = data.draw(st.lists(stem_st, min_size=1, max_size=3), label="stems")
    seqs = token_seq(stems, P, alphabet)
    locks: list[tuple[Node, list[int], int]] = []

    def on_evict(freed: np.ndarray) -> None:
        model.evict(freed)
        for node, seq, locked_len in locks:
            assert not node.dead, "a locked node was evicted"
            assert len(model.match(seq)) * P >= locked_len, "a locked prefix lost pages"

    for _ in range(data.draw(st.integers(1, 30), label="num_ops")):
        op = data.draw(
            st.sampled_from(["insert", "insert", "insert", "match", "lock", "unlock", "evict"]),
            label="op",
        )
        if op == "insert":
            seq = data.draw(seqs, label="seq")
            n = len(seq)
            key = tree.key(np.array(seq, dtype=np.int64))
            match: MatchResult | None = None
            cached = 0
            if data.draw(st.booleans(), label="use match"):
                match = checked_match(tree, model, seq)
                tree.lock(match.last_node)
                cap = data.draw(st.integers(0, n // P), label="cached pages cap")
                cached = min(match.valid_len, cap * P)
            start = cached // P
            fresh = alloc_evicting(tree, alloc, start, page_span(n, P) - start, on_evict)
            if fresh is not None:
                assert (fresh % cp_size).tolist() == owners(start, fresh.size, cp_size).tolist()
                head = match.device_pages[:start] if match is not None else fresh[:0]
                pages = np.concatenate([head, fresh])
                expected_prefix = model.prefix_len(seq)
                result: InsertResult = tree.insert(key, pages, cached)
                dupes = model.insert(seq, pages, cached)
                assert result.free_pages.tolist() == dupes
                assert result.prefix_len == expected_prefix
                node = result.node
                assert node.start < n <= node.end
                assert path_tokens(node)[:n] == seq
                alloc.free(result.free_pages)
            if match is not None:
                tree.unlock(match.last_node)
        elif op == "match":
            checked_match(tree, model, data.draw(seqs, label="seq"))
        elif op == "lock":
            seq = data.draw(seqs, label="seq")
            match = checked_match(tree, model, seq)
            tree.lock(match.last_node)
            locks.append((match.last_node, seq, match.valid_len))
        elif op == "unlock" and locks:
            i = data.draw(st.integers(0, len(locks) - 1), label="which lock")
            tree.unlock(locks.pop(i)[0])
        elif op == "evict":
            want = data.draw(st.sampled_from([1, 2, 5, HUGE]), label="evict pages")
            planned = tree.eviction_order()
            # Eviction releases the planned victims' pages in order, the last one only from its
            # tail as far as needed, and stops the moment it has enough.
            expected, remaining = [], want
            for victim in planned:
                take = min(remaining, victim.pages.size)
                expected += victim.pages[victim.pages.size - take :].tolist()
                remaining -= take
                if remaining == 0:
                    break
            before = tree.num_pages
            freed = tree.evict(want)
            on_evict(freed)
            alloc.free(freed)
            assert freed.size == before - tree.num_pages
            assert freed.tolist() == expected
            if freed.size < want:
                assert tree.eviction_order() == []
            if want == HUGE:
                expected_alive = {id(a) for node, _, _ in locks for a in ancestors(node)}
                assert {id(n) for n in tree.nodes()} == expected_alive
                # A lock pins exactly the pages its match returned, not a node's unmatched rest.
                pinned = {
                    page
                    for _, seq, locked_len in locks
                    for page in model.match(seq)[: locked_len // P]
                }
                assert model.pages() == pinned
        assert_consistent(tree, alloc, model)

    for node, _, _ in locks:
        tree.unlock(node)
    on_evict_all = tree.evict(HUGE)
    model.evict(on_evict_all)
    alloc.free(on_evict_all)
    assert_consistent(tree, alloc, model)
    assert (tree.num_pages, tree.num_nodes, tree.num_tokens) == (0, 0, 0)
    assert alloc.num_free == num_pages
    if hasher is None:  # the real 64-bit keys never collide on these inputs
        assert tree.hash_collisions == 0
    return tree


@given(
    page_size=st.sampled_from([1, 2, 3, 4, 16]),
    cp_size=st.sampled_from([1, 2, 3]),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_random_operations_match_the_reference_model(
    page_size: int, cp_size: int, data: st.DataObject
) -> None:
    run_random_ops(data, page_size, cp_size)


# -- matching and the valid-tail rule --------------------------------------------------------------


def test_empty_tree_matches_nothing() -> None:
    tree, _ = make(4)
    result = tree.match_prefix([1, 2, 3, 4, 5])
    assert result.valid_len == 0 and result.device_pages.size == 0
    assert result.last_node is tree.root


def test_match_inside_a_partial_page_is_floored() -> None:
    tree, alloc = make(4)
    seq = list(range(10, 17))  # 7 tokens: one whole page and a 3-token valid tail
    pages = alloc.alloc(0, 2)
    assert pages is not None
    tree.insert(seq, pages, 0)
    tree.check()
    for query, expected in [(seq, 4), (seq[:6], 4), (seq[:5], 4), (seq[:4], 4), (seq[:3], 0)]:
        result = tree.match_prefix(query)
        assert result.valid_len == expected, query
        assert result.device_pages.tolist() == pages[: expected // 4].tolist()
    # Extending the sequence past the tail still matches only the whole page.
    assert tree.match_prefix([*seq, 99]).valid_len == 4


@pytest.mark.parametrize("page_size", [2, 4])
def test_a_valid_tail_is_never_extended(page_size: int) -> None:
    P = page_size
    tree, alloc = make(P)
    short = list(range(1, P + 2))  # one whole page + a 1-token tail
    short_pages = alloc.alloc(0, 2)
    assert short_pages is not None
    tree.insert(short, short_pages, 0)
    longer = [*short, *range(50, 50 + 2 * P)]  # shares the tail's tokens, then continues
    match = tree.match_prefix(longer)
    assert match.valid_len == P
    fresh = alloc.alloc(1, page_span(len(longer), P) - 1)
    assert fresh is not None
    result = tree.insert(longer, np.concatenate([match.device_pages, fresh]), P)
    assert result.free_pages.size == 0
    tree.check()
    # The short sequence's tail page is untouched and now sits beside the longer sequence.
    full, tails = tree_contents(tree)
    assert tails[tuple(short)] == int(short_pages[1])
    tail_holder = next(n for n in tree.nodes() if int(short_pages[1]) in n.pages.tolist())
    assert tail_holder.end == len(short) and not tail_holder.children
    assert tail_holder.parent is result.node.parent
    assert tail_holder.parent is not None and tail_holder.parent.end == P
    # The longer sequence's second page is its own page, never the tail page.
    again = tree.match_prefix(longer)
    assert again.valid_len == len(longer) // P * P
    assert int(short_pages[1]) not in again.device_pages.tolist()
    assert again.device_pages[1] == fresh[0]


@pytest.mark.parametrize("page_size", [2, 4])
def test_sequence_ending_inside_a_cached_page_is_a_sibling(page_size: int) -> None:
    """Inserting a shorter sequence whose tail lies inside a cached whole page splits at the
    page boundary and adds the tail as its own leaf; the whole page stays matchable."""
    P = page_size
    tree, alloc = make(P)
    long_seq = list(range(3 * P))
    pages = alloc.alloc(0, 3)
    assert pages is not None
    tree.insert(long_seq, pages, 0)
    short = long_seq[: P + 1]
    match = tree.match_prefix(short)
    assert match.valid_len == P
    tail = alloc.alloc(1, 1)
    assert tail is not None
    result = tree.insert(short, np.concatenate([match.device_pages, tail]), P)
    assert result.free_pages.size == 0 and result.prefix_len == P
    tree.check()
    assert tree.num_pages == 4
    assert tree.match_prefix(long_seq).device_pages.tolist() == pages.tolist()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("cp_size", [1, 3])
@pytest.mark.parametrize("length_in_pages", [0.25, 1, 1.5, 3, 3.75])
def test_repeated_identical_prompts_do_not_grow_the_pool(
    page_size: int, cp_size: int, length_in_pages: float
) -> None:
    n = max(1, int(length_in_pages * page_size))
    tree, alloc = make(page_size, num_pages=32, cp_size=cp_size)
    prompt = [(7 * i + 3) % 11 for i in range(n)]
    used: list[tuple[int, int]] = []
    for _ in range(50):
        match = serve(tree, alloc, prompt)
        assert match is not None
        tree.check()
        alloc.check()
        used.append((alloc.num_used, tree.num_pages))
    assert used[0] == (page_span(n, page_size), page_span(n, page_size))
    assert set(used) == {used[0]}
    assert tree.match_prefix(prompt).valid_len == n // page_size * page_size


def test_duplicate_tail_is_freed_whether_inside_a_node_or_a_lone_leaf() -> None:
    P = 4
    tree, alloc = make(P)
    seq = [1, 2, 3, 4, 5, 6]  # page + 2-token tail: tail lives inside the same node
    first = alloc.alloc(0, 2)
    assert first is not None
    tree.insert(seq, first, 0)
    lone = [9, 9]  # a sequence shorter than a page: a lone valid-tail leaf under the root
    lone_page = alloc.alloc(0, 1)
    assert lone_page is not None
    tree.insert(lone, lone_page, 0)
    for query, expected_pages in [(seq, 2), (lone, 1)]:
        match = tree.match_prefix(query)
        start = match.valid_len // P
        fresh = alloc.alloc(start, expected_pages - start)
        assert fresh is not None
        result = tree.insert(query, np.concatenate([match.device_pages, fresh]), match.valid_len)
        assert result.prefix_len == len(query)
        assert result.free_pages.tolist() == fresh.tolist()
        alloc.free(result.free_pages)
        tree.check()
    assert tree.num_pages == 3 and alloc.num_used == 3


# -- locks and eviction ----------------------------------------------------------------------------


def test_locked_node_and_its_ancestors_survive_evict() -> None:
    P = 2
    tree, alloc = make(P)
    base = [1, 1, 2, 2]
    for tail in ([3, 3], [4, 4, 4, 4], [5]):
        assert serve(tree, alloc, base + tail) is not None
    assert serve(tree, alloc, [8, 8, 8]) is not None
    tree.check()
    match = tree.match_prefix([*base, 4, 4, 4, 4])
    assert match.valid_len == 8
    tree.lock(match.last_node)
    freed = tree.evict(HUGE)
    alloc.free(freed)
    tree.check()
    alive = tree.nodes()
    assert {id(n) for n in alive} == {id(n) for n in ancestors(match.last_node)}
    assert tree.match_prefix([*base, 4, 4, 4, 4]).device_pages.tolist() == (
        match.device_pages.tolist()
    )
    alive_pages = {p for n in alive for p in n.pages.tolist()}
    assert len(set(freed.tolist())) == freed.size
    assert not alive_pages & set(freed.tolist())
    tree.unlock(match.last_node)
    rest = tree.evict(HUGE)
    alloc.free(rest)
    assert tree.num_pages == 0 and alloc.num_free == alloc.num_pages
    assert not set(rest.tolist()) & set(freed.tolist())


def test_a_lock_pins_only_the_matched_pages() -> None:
    P = 2
    tree, alloc = make(P)
    seq = [1, 1, 2, 2, 3, 3, 4]  # three whole pages and a valid tail, inserted as one node
    pages = alloc.alloc(0, 4)
    assert pages is not None
    tree.insert(seq, pages, 0)
    assert tree.num_nodes == 1
    match = tree.match_prefix([1, 1, 2, 2, 9, 9])  # ends inside the node, after two pages
    assert match.valid_len == 4
    assert match.last_node.end == 4  # the node was split where the match ended
    tree.check()
    tree.lock(match.last_node)
    freed = tree.evict(HUGE)
    assert sorted(freed.tolist()) == sorted(pages[2:].tolist())
    assert tree.num_pages == 2
    assert tree.match_prefix(seq).device_pages.tolist() == pages[:2].tolist()
    tree.unlock(match.last_node)
    tree.check()


def test_evict_stops_once_enough_pages_are_freed() -> None:
    tree, alloc = make(1)
    for seq in ([1, 2, 3], [4, 5], [6], [7, 8, 9, 10]):
        assert serve(tree, alloc, seq) is not None
    oldest = tree.eviction_order()[0]
    assert oldest.tokens.tolist() == [1, 2, 3]  # the least recently used leaf
    pages = oldest.pages.tolist()
    freed = tree.evict(2)  # two pages of its tail are enough; nothing more goes
    assert freed.tolist() == pages[1:]
    assert tree.num_pages == 8
    assert oldest.tokens.tolist() == [1] and not oldest.dead
    assert tree.match_prefix([1, 2, 3]).valid_len == 1  # what stays is still a prefix
    assert tree.evict(0).size == 0
    tree.check()


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens", [[], [-1], [2**32], [1.5, 2.5], [[1, 2], [3, 4]], np.zeros((2, 2), np.int64)]
)
def test_bad_tokens_are_typed_errors(tokens: object) -> None:
    tree, _ = make(4)
    with pytest.raises(InvalidTokensError):
        tree.match_prefix(tokens)
    with pytest.raises(InvalidTokensError):
        tree.insert(tokens, np.zeros(1, dtype=np.int64), 0)


def test_bad_tree_arguments() -> None:
    with pytest.raises(ConfigError, match="capacity_pages"):
        RadixTree(CacheConfig(page_size=4), 0)
    tree, _ = make(4)
    with pytest.raises(ConfigError, match="page_size"):
        tree.match_prefix(PrefixHasher().key([1, 2, 3], 2))


def test_bad_insert_arguments_leave_the_tree_unchanged() -> None:
    tree, alloc = make(4)
    seq = list(range(10))  # 3 pages in its padded span
    pages = alloc.alloc(0, 3)
    assert pages is not None
    snapshot = tree.digest()
    for bad_pages in (pages[:2], np.concatenate([pages, pages[:1]]), pages.reshape(1, 3)):
        with pytest.raises(ConfigError, match="needs 3 integer pages"):
            tree.insert(seq, bad_pages, 0)
    assert tree.digest() == snapshot
    tree.check()


def test_cached_len_is_validated() -> None:
    tree, alloc = make(4)
    seq = list(range(10))  # 3 pages in its padded span
    pages = alloc.alloc(0, 3)
    assert pages is not None
    snapshot = tree.digest()
    for bad in (2, 12, -4, 1.5, True):
        with pytest.raises(ConfigError, match="page-aligned"):
            tree.insert(seq, pages, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="exceeds"):
        tree.insert(seq, pages, 4)  # nothing is cached yet
    assert tree.digest() == snapshot
    tree.check()


def test_insert_never_hands_back_the_trees_own_pages() -> None:
    """Old main returned the matched pages as free_pages when the caller left cached_len at its
    default 0; freeing them handed cached pages out again. cached_len is now required, and the
    tree's own pages passed as fresh ones are refused."""
    tree, alloc = make(4, num_pages=16, allocator=True)
    first = alloc.alloc(0, 2)
    assert first is not None
    tree.insert(list(range(8)), first, 0)
    match = tree.match_prefix(list(range(12)))
    assert match.valid_len == 8
    fresh = alloc.alloc(2, 1)
    assert fresh is not None
    pages = np.concatenate([match.device_pages, fresh])
    snapshot = tree.digest()
    with pytest.raises(TreeUsageError, match="already held"):
        tree.insert(list(range(12)), pages, 0)
    assert tree.digest() == snapshot
    result = tree.insert(list(range(12)), pages, 8)
    assert result.free_pages.size == 0 and tree.num_pages == 3
    tree.check()


@given(data=st.data())
@settings(max_examples=80, deadline=None)
def test_insert_refuses_pages_that_would_corrupt_the_tree(data: st.DataObject) -> None:
    """Pages the tree holds passed as fresh, fresh pages passed as cached, pages listed twice,
    pages never allocated and page ids out of range raise TreeUsageError at the call, and the
    tree is unchanged."""
    P = 2
    tree, alloc = make(P, num_pages=32, allocator=True)
    for seq in ([1, 1, 2, 2, 3], [1, 1, 4, 4], [7, 7, 7]):
        assert serve(tree, alloc, seq) is not None
    seq = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=8), label="seq")
    n_pages = page_span(len(seq), P)
    match = tree.match_prefix(seq)
    cached = min(match.valid_len, (len(seq) - 1) // P * P)
    c = cached // P
    held = sorted({p for n in tree.nodes() for p in n.pages.tolist()})
    free = np.flatnonzero(alloc.is_free(np.arange(32))).tolist()
    fresh = alloc.alloc(c, n_pages - c)
    assert fresh is not None
    pages = np.concatenate([match.device_pages[:c], fresh])
    kinds = ["held", "twice", "free", "range"] + (["cached"] if c else [])
    kind = data.draw(st.sampled_from(kinds), label="kind")
    i = data.draw(st.integers(c, n_pages - 1), label="fresh position")
    if kind == "held":
        pages[i] = data.draw(st.sampled_from(held))
    elif kind == "twice":
        if n_pages - c < 2:
            return
        j = data.draw(st.integers(c, n_pages - 1).filter(lambda j: j != i), label="other")
        pages[j] = pages[i]
    elif kind == "free":
        still_free = [p for p in free if alloc.is_free(np.array([p]))[0]]
        pages[i] = data.draw(st.sampled_from(still_free))
    elif kind == "range":
        pages[i] = data.draw(st.sampled_from([-1, 32, 10**6]))
    else:  # a fresh page where the caller claims the tree's own
        pages[data.draw(st.integers(0, c - 1), label="cached position")] = fresh[-1]
    snapshot = tree.digest()
    with pytest.raises(TreeUsageError):
        tree.insert(seq, pages, cached)
    assert tree.digest() == snapshot
    tree.check()


def test_lock_of_an_evicted_node_raises() -> None:
    tree, alloc = make(2)
    assert serve(tree, alloc, [1, 2, 3, 4]) is not None
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    alloc.free(tree.evict(HUGE))
    assert node.dead
    with pytest.raises(TreeUsageError, match="evicted"):
        tree.lock(node)
    tree.check()


def test_unlock_of_an_unlocked_node() -> None:
    tree, alloc = make(2)
    assert serve(tree, alloc, [1, 2, 3, 4]) is not None
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    with pytest.raises(TreeUsageError):
        tree.unlock(node)
    tree.lock(node)
    tree.unlock(node)
    with pytest.raises(TreeUsageError):
        tree.unlock(node)
    tree.check()


def test_unlock_of_the_root_without_a_lock() -> None:
    tree, _ = make(2)
    with pytest.raises(TreeUsageError):
        tree.unlock(tree.root)
    assert tree.evict(1).size == 0


# -- hash collisions -------------------------------------------------------------------------------


def test_order_blind_hasher_really_collides() -> None:
    hasher = OrderBlindHasher()
    assert hasher.key([1, 2, 3, 4], 2).end_key == hasher.key([2, 1, 4, 3], 2).end_key


def test_collision_inside_a_node_falls_back_to_exact_tokens() -> None:
    tree, alloc = make(1, hasher=OrderBlindHasher())
    model = Model(1)
    stored = [1, 2, 3, 4]
    pages = alloc.alloc(0, 4)
    assert pages is not None
    model.insert(stored, pages, 0)
    tree.insert(stored, pages, 0)
    # Keys say the whole node matches (equal sums at length 4); the tokens agree only on 2.
    query = [1, 2, 4, 3]
    assert tree.hash_collisions == 0
    assert checked_match(tree, model, query).valid_len == 2
    assert tree.hash_collisions >= 1  # match_length and match_prefix each detect it
    match = tree.match_prefix(query)
    fresh = alloc.alloc(2, 2)
    assert fresh is not None
    full = np.concatenate([match.device_pages, fresh])
    result = tree.insert(query, full, 2)
    assert result.free_pages.tolist() == model.insert(query, full, 2) == []
    assert_consistent(tree, alloc, model)
    checked_match(tree, model, stored)
    checked_match(tree, model, query)


def test_colliding_sibling_pages_are_dropped_not_confused() -> None:
    P = 2
    tree, alloc = make(P, hasher=OrderBlindHasher())
    first = [1, 2, 5, 5]
    pages = alloc.alloc(0, 2)
    assert pages is not None
    tree.insert(first, pages, 0)
    other = [2, 1, 5, 5]  # every page key equals `first`'s
    match = tree.match_prefix(other)
    assert match.valid_len == 0 and match.device_pages.size == 0
    assert tree.hash_collisions >= 1
    fresh = alloc.alloc(0, 2)
    assert fresh is not None
    result = tree.insert(other, fresh, 0)
    # The tree cannot hold both under one key: it keeps the first and hands the new pages back.
    assert result.free_pages.tolist() == fresh.tolist()
    alloc.free(result.free_pages)
    tree.check()
    assert tree.match_prefix(other).valid_len == 0
    assert tree.match_prefix(first).device_pages.tolist() == pages.tolist()
    assert alloc.num_used == tree.num_pages == 2


def test_collision_at_a_split_keeps_both_halves() -> None:
    P = 2
    tree, alloc = make(P, hasher=OrderBlindHasher())
    model = Model(P)
    stored = [1, 2, 3, 4]
    pages = alloc.alloc(0, 2)
    assert pages is not None
    model.insert(stored, pages, 0)
    tree.insert(stored, pages, 0)
    query = [1, 2, 4, 3]  # its second page key equals `stored`'s second page key
    # No match first (a caller that recomputes everything, cached_len 0): insert itself splits.
    fresh = alloc.alloc(0, 2)
    assert fresh is not None
    result = tree.insert(query, fresh, 0)
    dupes = model.insert(query, fresh, 0)
    assert result.free_pages.tolist()[:1] == dupes[:1] == [int(fresh[0])]
    alloc.free(result.free_pages)
    # Either outcome is acceptable for the second page (keep it as a sibling, or hand it back),
    # but nothing may leak and the tree must stay consistent and evictable.
    if result.free_pages.size == 2:
        model.evict(fresh[1:])
    assert_consistent(tree, alloc, model)
    alloc.free(tree.evict(HUGE))
    assert alloc.num_free == alloc.num_pages


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_random_operations_stay_exact_under_an_order_blind_hash(data: st.DataObject) -> None:
    """With page_size 1 an order-blind hash collides whenever a walk checks a whole node by its
    last key; every match must still equal the reference model's."""
    run_random_ops(data, page_size=1, cp_size=1, hasher=OrderBlindHasher(), alphabet=4)


# -- replication -----------------------------------------------------------------------------------


@given(
    page_size=st.sampled_from([1, 2, 4]),
    cp_size=st.sampled_from([1, 2, 3, 4]),
    eviction=st.sampled_from(["lru", "slru"]),
    requests=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), max_size=30),
)
@settings(max_examples=60, deadline=None)
def test_two_ranks_fed_the_same_requests_have_equal_digests(
    page_size: int, cp_size: int, eviction: str, requests: list[list[int]]
) -> None:
    num_pages = max(cp_size, 14)
    ranks = [make(page_size, num_pages, cp_size, eviction=eviction) for _ in range(2)]
    for tokens in requests:
        outcomes = [serve(tree, alloc, tokens) for tree, alloc in ranks]
        assert [m is None for m in outcomes] == [outcomes[0] is None] * 2
        for tree, alloc in ranks:
            tree.check()
            alloc.check()
        (t0, a0), (t1, a1) = ranks
        assert t0.digest() == t1.digest()
        assert a0.digest() == a1.digest()
    (t0, _), (t1, _) = ranks
    assert [n.id for n in t0.eviction_order()] == [n.id for n in t1.eviction_order()]


_DIGEST_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from kvstrata.workloads import shared_synthetic as synthetic
    from kvstrata.cache.allocator import PageAllocator
    from kvstrata.config import CacheConfig, PoolConfig
    from kvstrata.ownership import owners
    from kvstrata.cache.radix import RadixTree

    P, CP, N = 4, 3, 240
    reqs = synthetic.generate(seed=3, n_requests=60, n_system_prompts=3, system_prompt_len=40,
                              turn_min=3, turn_max=30, max_turns=6, concurrent_sessions=4,
                              vocab=20)
    tree = RadixTree(CacheConfig(page_size=P, cp_size=CP, eviction="slru"), N)
    alloc = PageAllocator(PoolConfig(N, CP))
    lens = []
    for r in reqs:
        key = tree.key(r)
        n = len(key)
        m = tree.match_prefix(key)
        lens.append(m.valid_len)
        tree.lock(m.last_node)
        cached = min(m.valid_len, (n - 1) // P * P)
        s = cached // P
        k = -(-n // P) - s
        while (fresh := alloc.alloc(s, k)) is None:
            freed = tree.evict(int(alloc.deficit(owners(s, k, CP)).sum()))
            assert freed.size
            alloc.free(freed)
        res = tree.insert(key, np.concatenate([m.device_pages[:s], fresh]), cached)
        alloc.free(res.free_pages)
        tree.unlock(m.last_node)
    tree.check()
    sys.stdout.write(json.dumps([tree.digest(), alloc.digest(), lens]))
    """
)


def test_tree_digest_is_independent_of_the_python_hash_seed() -> None:
    outputs = []
    for seed in ("0", "1", "987654"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        outputs.append(json.loads(proc.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    assert sum(outputs[0][2]) > 0  # the workload does hit the cache


# -- the shared workload checksum ------------------------------------------------------------------


@pytest.fixture(scope="module")
def workload() -> list[list[int]]:
    return synthetic.generate(seed=0, n_requests=300)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_matched_lengths_equal_the_shared_reference(
    workload: list[list[int]], page_size: int
) -> None:
    reference = synthetic.reference_matched_lengths(workload, page_size)
    bound = sum(
        page_span(len(r), page_size) - m // page_size
        for r, m in zip(workload, reference, strict=True)
    )
    tree, alloc = make(page_size, num_pages=bound + 1)
    got: list[int] = []
    for tokens in workload:
        match = serve(tree, alloc, tokens)
        assert match is not None, "no eviction is allowed in this test"
        got.append(match.valid_len)
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a == b, f"request {i}: matched {a}, reference {b}"
    assert synthetic.matched_checksum(got) == synthetic.matched_checksum(reference)
    assert tree.num_pages == alloc.num_used
    assert tree.hash_collisions == 0
    tree.check()
    alloc.check()


@pytest.mark.parametrize("confirmed", [0, 2])
def test_confirmed_prefix_still_catches_a_collision_after_it(confirmed: int) -> None:
    """A chunked insert that skips comparing the tokens it confirmed before still compares the
    rest: a collision past ``confirmed_len`` is found exactly as without it."""
    P = 2
    tree, alloc = make(P, hasher=OrderBlindHasher())
    stored = [1, 2, 3, 4, 5, 6]
    pages = alloc.alloc(0, 3)
    assert pages is not None
    tree.insert(stored, pages, 0)
    query = [1, 2, 4, 3, 5, 6]  # every page key equals stored's; the tokens differ in page 1
    match = tree.match_prefix(query)
    assert match.valid_len == 2
    tree.lock(match.last_node)
    fresh = alloc.alloc(1, 2)
    assert fresh is not None
    full = np.concatenate([match.device_pages, fresh])
    before = tree.hash_collisions
    result = tree.insert(query, full, 2, confirmed_len=confirmed)
    assert tree.hash_collisions > before
    # As with no confirmed prefix: the tree keeps the first under the colliding key and hands
    # the new pages back.
    assert result.free_pages.tolist() == fresh.tolist()
    alloc.free(result.free_pages)
    tree.unlock(match.last_node)
    tree.check()
    assert tree.match_prefix(stored).device_pages.tolist() == pages.tolist()
    assert tree.match_prefix(query).valid_len == 2


def test_confirmed_len_cannot_exceed_cached_len() -> None:
    tree, alloc = make(2)
    pages = alloc.alloc(0, 2)
    assert pages is not None
    with pytest.raises(ConfigError, match="confirmed_len"):
        tree.insert([1, 2, 3, 4], pages, 0, confirmed_len=2)


def _chunked_prefill(
    tree: RadixTree, alloc: PageAllocator, tokens: list[int], chunk: int, use_below: bool
) -> list[tuple[int, list[int], int]]:
    """Match, then insert ``tokens`` chunk by chunk as the engine does (the node that ends the
    inserted part locked between chunks), passing that node as ``below`` or not; each insert's
    (prefix_len, free pages, node end)."""
    P = tree.page_size
    key = tree.key(tokens)
    hit = tree.match_prefix(key)
    node, inserted = hit.last_node, hit.valid_len
    tree.lock(node)
    pages = np.concatenate(
        [hit.device_pages, alloc.alloc(0, page_span(len(tokens), P) - hit.valid_len // P)]
    )
    out = []
    while inserted < len(tokens):
        upto = min(len(tokens), inserted + chunk)
        if upto < len(tokens):
            upto -= upto % P
        if upto <= inserted:
            upto = len(tokens)
        sub = key.prefix(upto) if upto < len(tokens) else key
        below = node if use_below and node.end == inserted else None
        span = page_span(upto, P)
        result = tree.insert(sub, pages[:span], inserted, inserted, below)
        pages[:span] = result.pages
        alloc.free(result.free_pages)
        out.append((result.prefix_len, result.free_pages.tolist(), result.node.end))
        if result.node is not node:
            tree.lock(result.node)
            tree.unlock(node)
            node = result.node
        inserted = upto
    tree.unlock(node)
    return out


@given(
    requests=st.lists(
        st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=12
    ),
    page_size=st.sampled_from([1, 2, 4]),
    chunk=st.integers(1, 12),
)
@settings(max_examples=150, deadline=None)
def test_a_chunk_inserted_below_its_previous_chunk_equals_a_walk_from_the_root(
    requests: list[list[int]], page_size: int, chunk: int
) -> None:
    """Starting the insert's walk at the node that ends the chunk before (what the engine does)
    gives the same results, pages and tree, digest for digest, as walking from the root; shared
    prefixes, splits, duplicates and valid tails included (requests share a small alphabet)."""
    trees = [make(page_size, num_pages=2048) for _ in range(2)]
    for tokens in requests:
        got = [
            _chunked_prefill(t, a, tokens, chunk, use)
            for (t, a), use in zip(trees, (False, True), strict=True)
        ]
        assert got[0] == got[1]
        assert trees[0][0].digest() == trees[1][0].digest()
    for tree, alloc in trees:
        tree.check()
        assert tree.num_pages == alloc.num_used


def test_below_must_end_where_the_confirmed_part_does() -> None:
    tree, alloc = make(2)
    pages = alloc.alloc(0, 3)
    assert pages is not None
    tree.insert([1, 2, 3, 4, 5, 6], pages, 0)
    hit = tree.match_prefix([1, 2, 3, 4, 7, 8])
    assert hit.valid_len == 4 and hit.last_node.end == 4
    fresh = alloc.alloc(2, 1)
    assert fresh is not None
    full = np.concatenate([hit.device_pages, fresh])
    with pytest.raises(TreeUsageError, match="below"):
        tree.insert([1, 2, 3, 4, 7, 8], full, 4, 2, below=hit.last_node)  # ends at 4, not 2
