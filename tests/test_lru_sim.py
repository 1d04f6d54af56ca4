"""The engine against the page-level LRU reference in ``lru_sim.py``, one request at a time.

With ``max_batch_requests=1`` and chunks as long as the longest request, the engine's cached
tokens per request must equal the tail-first reference's exactly: eviction frees only the deficit,
trimming the least recently used leaf from its tail (issue 14, parts 3 and 5).

The whole-leaf reference models the tree before tail-trim eviction; it matched that engine
exactly on the same workloads and capacities (branch ``agentic``, commit b395dc9), which proved
the reference and the harness. It stays for the hit-ratio comparison ``lru_sim.py`` prints.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lru_sim import (
    CAPACITY_FRACTIONS,
    CASES,
    Case,
    LRUSim,
    engine_hits,
    random_workload,
    simulate,
    unique_tokens,
)

from kvstrata.workloads import Request


def tokens(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.uint32)


# -- the reference itself, by hand -------------------------------------------------------------


@pytest.mark.parametrize(("eviction", "hit_after"), [("tail_first", 4), ("whole_leaf", 0)])
def test_tail_first_frees_only_the_deficit(eviction: str, hit_after: int) -> None:
    sim = LRUSim(page_size=4, capacity_pages=4, eviction=eviction)
    a = np.arange(1, 9, dtype=np.uint32)  # 2 pages
    b = np.arange(101, 113, dtype=np.uint32)  # 3 pages: 1 short
    assert sim.run(a) == 0 and sim.used == 2
    assert sim.run(b) == 0
    # tail_first evicted a's last page only; whole_leaf evicted all of a.
    assert sim.used == (4 if eviction == "tail_first" else 3)
    assert sim.run(a) == hit_after


def test_oldest_leaf_goes_first_and_its_valid_tail_before_its_pages() -> None:
    sim = LRUSim(page_size=4, capacity_pages=6, eviction="tail_first")
    old = np.arange(1, 7, dtype=np.uint32)  # 1 page + a 2-token valid tail
    new = np.arange(50, 58, dtype=np.uint32)  # 2 pages
    sim.run(old)
    sim.run(new)
    assert sim.used == 4
    sim.run(np.arange(200, 212, dtype=np.uint32))  # 3 pages, 2 free: evict 1 = old's tail
    assert sim.run(old) == 4  # its full page survived
    assert sim.run(new) == 4  # untouched (capped at (8 - 1) // 4 pages)


def test_exact_repeats_do_not_grow_the_cache() -> None:
    for n in (8, 10):  # page-aligned (the recomputed last page is a duplicate) and a valid tail
        sim = LRUSim(page_size=4, capacity_pages=8, eviction="tail_first")
        t = np.arange(1, n + 1, dtype=np.uint32)
        assert sim.run(t) == 0
        used = sim.used
        assert sim.run(t) == (n - 1) // 4 * 4
        assert sim.used == used


def test_a_request_larger_than_the_cache_is_refused_and_changes_nothing() -> None:
    sim = LRUSim(page_size=4, capacity_pages=2, eviction="tail_first")
    sim.run(tokens(1, 2, 3, 4))
    assert sim.run(np.arange(20, dtype=np.uint32)) is None
    assert sim.used == 1 and sim.run(tokens(1, 2, 3, 4, 5)) == 4


# -- the engine against the reference ----------------------------------------------------------


@functools.cache
def loaded(case: Case) -> tuple[list[Request], int]:
    requests = case.load()
    return requests, unique_tokens([r.tokens for r in requests], case.page_size)


def compare(case: Case, eviction: str) -> None:
    requests, unique = loaded(case)
    arrays = [r.tokens for r in requests]
    for fraction in CAPACITY_FRACTIONS:
        pages = int(fraction * unique) // case.page_size
        want = simulate(arrays, case.page_size, pages, eviction)
        got = engine_hits(requests, case.page_size, pages, case.vocab)
        served = sum(h is not None for h in want)
        assert served > len(requests) // 4, "a capacity that refuses most requests tests little"
        first = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w), None)
        assert first is None, (
            f"{case.name} at {fraction:.1%} of {unique} unique tokens ({pages} pages): request "
            f"{first} cached {got[first]} tokens, the {eviction} reference {want[first]}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_engine_equals_tail_first_reference(case: Case) -> None:
    compare(case, "tail_first")


def test_an_insert_refreshes_only_the_pages_of_its_request() -> None:
    """An insert records its access on the request's own pages only: a node that runs past the
    request's last page keeps its older pages older (the tree once refreshed the whole node)."""
    z = np.arange(301, 305, dtype=np.uint32)  # 1 page, the oldest
    a = np.arange(1, 13, dtype=np.uint32)  # 3 pages
    c = np.arange(101, 109, dtype=np.uint32)  # 2 pages
    y = np.arange(401, 405, dtype=np.uint32)  # 1 page: the 7-page cache is full
    b = a[:8].copy()  # a0 a1: matches a0 (capped), a1 is a duplicate; z is evicted for it
    d = np.arange(201, 209, dtype=np.uint32)  # 2 fresh pages, 1 short: a2 (A's) is the oldest
    c2 = np.concatenate([c, tokens(7)])  # may hit c0 c1
    arrays = [z, a, c, y, b, d, c2]
    want = simulate(arrays, 4, 7, "tail_first")
    assert want == [0, 0, 0, 0, 4, 0, 8]
    assert engine_hits([Request(i, t) for i, t in enumerate(arrays)], 4, 7, vocab=500) == want


def test_an_exact_page_aligned_repeat_is_no_hash_collision() -> None:
    """The insert after a capped match walks the tree again (the tree once reused the capped
    walk and took the cached last page for a hash collision)."""
    from kvstrata.engine import Engine, EngineConfig
    from kvstrata.model.compute import SyntheticCompute

    engine = Engine(SyntheticCompute(4, 500), EngineConfig(page_size=4, pool_tokens=64))
    a = np.arange(1, 13, dtype=np.uint32)
    for i, t in enumerate([a, a[:8].copy()]):
        engine.add(Request(i, t))
        while engine.has_work():
            engine.step()
    assert engine.cache.tree.hash_collisions == 0


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    page_size=st.sampled_from([1, 2, 4]),
    capacity_pages=st.integers(12, 60),
)
def test_engine_equals_tail_first_reference_on_random_workloads(
    seed: int, page_size: int, capacity_pages: int
) -> None:
    arrays = list(random_workload(seed, 120, page_size, max_pages=12))
    requests = [Request(i, t) for i, t in enumerate(arrays)]
    want = simulate(arrays, page_size, capacity_pages, "tail_first")
    assert engine_hits(requests, page_size, capacity_pages, vocab=8, check=True) == want
