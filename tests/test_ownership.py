"""Tests for kvstrata.ownership: the pure functions every rank uses to agree on page owners."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.errors import ConfigError
from kvstrata.ownership import lane, logical_page, owner, owners, page_span, slot

CP_SIZES = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_owner_is_position_mod_cp(cp_size: int) -> None:
    for position in range(3 * cp_size + 5):
        assert owner(position, cp_size) == position % cp_size


def test_owner_matches_the_module_picture() -> None:
    # cp_size = 3: positions p0..p6 are owned by r0 r1 r2 r0 r1 r2 r0.
    assert [owner(p, 3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("start", [0, 1, 5, 17])
@pytest.mark.parametrize("num_pages", [0, 1, 7, 20])
def test_owners_agrees_with_owner(cp_size: int, start: int, num_pages: int) -> None:
    got = owners(start, num_pages, cp_size)
    assert got.dtype == np.int64
    assert got.tolist() == [owner(p, cp_size) for p in range(start, start + num_pages)]


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_lane_slot_logical_page_round_trip(cp_size: int) -> None:
    for page in range(10 * cp_size + 3):
        rank, local_slot = int(lane(page, cp_size)), int(slot(page, cp_size))
        assert 0 <= rank < cp_size
        assert logical_page(rank, local_slot, cp_size) == page
    for rank in range(cp_size):
        local_slots = np.arange(6, dtype=np.int64)
        pages = np.asarray(logical_page(rank, local_slots, cp_size))
        assert np.all(np.asarray(lane(pages, cp_size)) == rank)
        assert np.array_equal(np.asarray(slot(pages, cp_size)), local_slots)


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_each_rank_slots_are_dense(cp_size: int) -> None:
    """Every lane's pages occupy rank-local slots 0, 1, 2, ... with no gap or overlap."""
    pages = np.arange(8 * cp_size, dtype=np.int64)
    for rank in range(cp_size):
        mine = pages[lane(pages, cp_size) == rank]
        assert np.asarray(slot(mine, cp_size)).tolist() == list(range(mine.size))


@given(
    valid_len=st.integers(0, 10_000),
    page_size=st.sampled_from([1, 2, 3, 4, 16, 64]),
)
@settings(max_examples=200, deadline=None)
def test_page_span_is_the_ceiling(valid_len: int, page_size: int) -> None:
    span = page_span(valid_len, page_size)
    assert span * page_size >= valid_len
    assert (span - 1) * page_size < valid_len or span == 0


def test_page_span_examples() -> None:
    assert [page_span(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert page_span(7, 1) == 7


@pytest.mark.parametrize("bad", [0, -1, -8])
def test_bad_cp_size_is_a_config_error(bad: int) -> None:
    with pytest.raises(ConfigError, match="cp_size"):
        owner(0, bad)
    with pytest.raises(ConfigError, match="cp_size"):
        owners(0, 3, bad)


def test_negative_position_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="position"):
        owner(-1, 2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fn", [lane, slot])
def test_lane_and_slot_reject_bad_cp_size(fn: object) -> None:
    assert callable(fn)
    with pytest.raises(ConfigError):
        fn(np.array([5], dtype=np.int64), 0)


def test_owners_rejects_negative_start_like_owner() -> None:
    with pytest.raises(ConfigError):
        owners(-1, 3, 2)
