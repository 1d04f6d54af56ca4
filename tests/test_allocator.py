"""Tests for kvstrata.cache.allocator: lanes, all-or-nothing allocation, typed misuse errors, digests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.cache.allocator import PageAllocator
from kvstrata.config import PoolConfig
from kvstrata.errors import (
    AllocatorError,
    DoubleFreeError,
    ForeignPageError,
    UnknownPageError,
)

IntArray = np.ndarray


def pages(*ids: int) -> IntArray:
    return np.array(ids, dtype=np.int64)


def used_pages(alloc: PageAllocator) -> set[int]:
    return set(np.flatnonzero(~alloc.is_free(np.arange(alloc.num_pages))).tolist())


@pytest.mark.parametrize(("num_pages", "cp_size"), [(1, 1), (10, 1), (10, 3), (8, 4), (9, 8)])
def test_fresh_allocator(num_pages: int, cp_size: int) -> None:
    alloc = PageAllocator(PoolConfig(num_pages, cp_size))
    alloc.check()
    assert alloc.num_free == num_pages and alloc.num_used == 0
    expected = [len(range(lane, num_pages, cp_size)) for lane in range(cp_size)]
    assert alloc.free_per_lane().tolist() == expected
    assert alloc.alloc_pages_with_owners(np.empty(0, dtype=np.int64)).size == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_alloc_by_position_uses_the_owning_lane(cp_size: int) -> None:
    alloc = PageAllocator(PoolConfig(40, cp_size))
    got = alloc.alloc(start_position=5, num_pages=7)
    assert got is not None and got.dtype == np.int64
    assert (got % cp_size).tolist() == [p % cp_size for p in range(5, 12)]
    assert np.unique(got).size == got.size
    alloc.check()


def test_all_or_nothing_when_one_lane_is_short() -> None:
    alloc = PageAllocator(PoolConfig(num_pages=6, cp_size=2))  # lanes: {0, 2, 4}, {1, 3, 5}
    assert alloc.alloc_pages_with_owners(pages(0, 0)) is not None
    before = alloc.digest()
    assert alloc.deficit(pages(0, 0, 1)).tolist() == [1, 0]
    assert alloc.alloc_pages_with_owners(pages(1, 0, 0, 1)) is None
    assert alloc.digest() == before
    assert alloc.free_per_lane().tolist() == [1, 3]
    got = alloc.alloc_pages_with_owners(pages(1, 0, 1, 1))
    assert got is not None and (got % 2).tolist() == [1, 0, 1, 1]
    assert alloc.num_free == 0
    assert alloc.alloc_pages_with_owners(pages(0)) is None
    alloc.check()


@given(
    cp_size=st.integers(1, 8),
    extra=st.integers(0, 20),
    data=st.data(),
)
@settings(max_examples=80, deadline=None)
def test_lanes_never_hand_out_a_page_of_the_wrong_owner(
    cp_size: int, extra: int, data: st.DataObject
) -> None:
    num_pages = cp_size + extra
    alloc = PageAllocator(PoolConfig(num_pages, cp_size))
    held: list[int] = []
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        do_free: bool = data.draw(st.booleans(), label="free?")
        if held and do_free:
            chosen: list[int] = data.draw(
                st.lists(st.sampled_from(held), unique=True, min_size=1), label="pages to free"
            )
            arr = np.array(chosen, dtype=np.int64)
            with_owners = data.draw(st.booleans(), label="with owners")
            alloc.free(arr, arr % cp_size if with_owners else None)
            held = [p for p in held if p not in chosen]
        else:
            owner_vec = np.array(
                data.draw(st.lists(st.integers(0, cp_size - 1), max_size=12), label="owners"),
                dtype=np.int64,
            )
            free_before = alloc.free_per_lane()
            need = np.bincount(owner_vec, minlength=cp_size)
            expected_deficit = np.maximum(need - free_before, 0)
            assert alloc.deficit(owner_vec).tolist() == expected_deficit.tolist()
            digest_before = alloc.digest()
            got = alloc.alloc_pages_with_owners(owner_vec)
            if expected_deficit.any():
                assert got is None
                assert alloc.digest() == digest_before
            else:
                assert got is not None and got.shape == owner_vec.shape
                assert np.array_equal(got % cp_size, owner_vec)
                assert np.all((got >= 0) & (got < num_pages))
                assert np.unique(got).size == got.size
                assert not set(got.tolist()) & set(held)
                held.extend(got.tolist())
                assert np.array_equal(alloc.free_per_lane(), free_before - need)
        alloc.check()
        assert used_pages(alloc) == set(held)
        assert alloc.num_used == len(held)


# -- misuse ----------------------------------------------------------------------------------------


def test_double_free_is_typed_and_leaves_state_unchanged() -> None:
    alloc = PageAllocator(PoolConfig(8, 2))
    got = alloc.alloc(0, 4)
    assert got is not None
    alloc.free(got[:1])
    snapshot = alloc.digest()
    with pytest.raises(DoubleFreeError):
        alloc.free(got[:2])  # got[0] is already free
    with pytest.raises(DoubleFreeError):
        alloc.free(pages(int(got[1]), int(got[2]), int(got[1])))  # listed twice in one call
    with pytest.raises(DoubleFreeError):
        alloc.free(pages(7))  # never allocated
    assert alloc.digest() == snapshot
    alloc.check()
    alloc.free(got[1:])
    assert alloc.num_free == 8
    alloc.check()


def test_free_of_another_lanes_page_is_foreign() -> None:
    alloc = PageAllocator(PoolConfig(8, 4))
    got = alloc.alloc(0, 4)
    assert got is not None
    snapshot = alloc.digest()
    wrong_owners = (got + 1) % 4
    with pytest.raises(ForeignPageError):
        alloc.free(got, wrong_owners)
    assert alloc.digest() == snapshot
    alloc.free(got, got % 4)
    alloc.check()


@pytest.mark.parametrize("bad", [-1, 8, 1000])
def test_unknown_page(bad: int) -> None:
    alloc = PageAllocator(PoolConfig(8, 2))
    with pytest.raises(UnknownPageError):
        alloc.free(pages(bad))
    with pytest.raises(UnknownPageError):
        alloc.is_free(pages(bad))
    alloc.check()


def test_free_nothing_is_a_no_op() -> None:
    alloc = PageAllocator(PoolConfig(4, 2))
    before = alloc.digest()
    alloc.free(np.empty(0, dtype=np.int64))
    assert alloc.digest() == before


def test_out_of_range_owner_is_rejected_for_cp_size_1() -> None:
    alloc = PageAllocator(PoolConfig(4, 1))
    with pytest.raises(AllocatorError):
        alloc.alloc_pages_with_owners(pages(1))


def test_out_of_range_owner_is_rejected_for_cp_size_2() -> None:
    alloc = PageAllocator(PoolConfig(4, 2))
    with pytest.raises(AllocatorError):
        alloc.alloc_pages_with_owners(pages(0, 2))


def test_negative_or_large_owner_gets_a_typed_error() -> None:
    alloc = PageAllocator(PoolConfig(4, 2))
    with pytest.raises(AllocatorError):
        alloc.alloc_pages_with_owners(pages(-1))
    with pytest.raises(AllocatorError):
        alloc.deficit(pages(3))


# -- replication -----------------------------------------------------------------------------------

_OP = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 50), st.integers(0, 9)),
    st.tuples(st.just("owners"), st.lists(st.integers(0, 7), max_size=10)),
    st.tuples(st.just("free"), st.lists(st.integers(0, 1000), max_size=6)),
)


@given(cp_size=st.integers(1, 4), extra=st.integers(0, 24), ops=st.lists(_OP, max_size=40))
@settings(max_examples=80, deadline=None)
def test_two_ranks_fed_the_same_operations_have_equal_digests(
    cp_size: int, extra: int, ops: list[tuple[object, ...]]
) -> None:
    num_pages = cp_size + extra
    ranks = [PageAllocator(PoolConfig(num_pages, cp_size)) for _ in range(2)]
    held: list[int] = []  # the same on both ranks: decisions read only replicated state
    for op in ops:
        results = []
        for alloc in ranks:
            if op[0] == "alloc":
                _, start, count = op
                assert isinstance(start, int) and isinstance(count, int)
                results.append(alloc.alloc(start, count))
            elif op[0] == "owners":
                vec = np.array(op[1], dtype=np.int64) % cp_size
                results.append(alloc.alloc_pages_with_owners(vec))
            else:
                picks = op[1]
                assert isinstance(picks, list)
                chosen = list(dict.fromkeys(held[i % len(held)] for i in picks)) if held else []
                alloc.free(np.array(chosen, dtype=np.int64))
                results.append(np.array(chosen, dtype=np.int64))
        a, b = results
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert np.array_equal(a, b)
            if op[0] == "free":
                held = [p for p in held if p not in set(a.tolist())]
            else:
                held.extend(a.tolist())
        for alloc in ranks:
            alloc.check()
        assert ranks[0].digest() == ranks[1].digest()


def test_digest_sees_free_order_and_geometry() -> None:
    a, b = (PageAllocator(PoolConfig(8, 2)) for _ in range(2))
    assert a.digest() == b.digest()
    got_a, got_b = a.alloc(0, 4), b.alloc(0, 4)
    assert got_a is not None and got_b is not None
    a.free(got_a)
    b.free(got_b[::-1].copy())  # same set of free pages, different stack order
    assert a.num_free == b.num_free
    assert a.digest() != b.digest()
    assert PageAllocator(PoolConfig(8, 1)).digest() != PageAllocator(PoolConfig(8, 2)).digest()
    assert PageAllocator(PoolConfig(8, 2)).digest() != PageAllocator(PoolConfig(9, 2)).digest()


@given(
    start=st.one_of(st.integers(-5, -1), st.floats(allow_nan=True), st.text(max_size=2), st.none()),
    count=st.one_of(
        st.integers(-(10**9), -1), st.floats(allow_nan=True), st.text(max_size=2), st.just(True)
    ),
    which=st.sampled_from(["start", "count"]),
    cp_size=st.sampled_from([1, 2, 4]),
)
@settings(max_examples=100, deadline=None)
def test_bad_alloc_arguments_are_typed_errors(
    start: object, count: object, which: str, cp_size: int
) -> None:
    """A negative or non-integer count or position raises AllocatorError at the call (old main
    sliced with it and handed out garbage or raised a numpy error), and nothing is taken."""
    alloc = PageAllocator(PoolConfig(16, cp_size))
    before = alloc.digest()
    args = (start, 2) if which == "start" else (0, count)
    with pytest.raises(AllocatorError):
        alloc.alloc(*args)  # type: ignore[arg-type]
    assert alloc.digest() == before
    alloc.check()


def test_bad_owner_and_free_arrays_are_typed_errors() -> None:
    alloc = PageAllocator(PoolConfig(8, 2))
    with pytest.raises(AllocatorError):
        alloc.alloc_pages_with_owners(np.array([0.5, 1.0]))
    with pytest.raises(AllocatorError):
        alloc.alloc_pages_with_owners(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(AllocatorError):
        alloc.free(np.array([1.0]))
    alloc.check()
