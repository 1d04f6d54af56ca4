"""Tests for kvstrata.cache.keys: token validation and prefix-closed, process-independent page keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.cache.keys import PrefixHasher, TokenKey, as_token_array
from kvstrata.errors import ConfigError, InvalidTokensError

PAGE_SIZES = [1, 2, 3, 4, 16]

# Longer than one weight chunk (2**16 positions), so a second PCG64 stream is exercised.
_LONG_LEN = 70_001


def _long_tokens() -> np.ndarray:
    return (np.arange(_LONG_LEN, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)


def _key_fingerprint(key: TokenKey) -> dict[str, object]:
    return {
        "page_keys": [int(x) for x in key.page_keys[:8]] + [int(x) for x in key.page_keys[-8:]],
        "sum": int(key.page_keys.sum(dtype=np.uint64)),
        "end_key": int(key.end_key),
    }


# -- validation ----------------------------------------------------------------------------------


def test_uint32_array_passes_through_without_copy() -> None:
    arr = np.array([1, 2, 3], dtype=np.uint32)
    assert as_token_array(arr) is arr


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint64])
def test_integer_dtypes_convert_to_uint32(dtype: type) -> None:
    out = as_token_array(np.array([0, 5, 100], dtype=dtype))
    assert out.dtype == np.uint32
    assert out.tolist() == [0, 5, 100]


def test_extreme_valid_token_ids() -> None:
    assert as_token_array([0, 2**32 - 1]).tolist() == [0, 2**32 - 1]


@pytest.mark.parametrize(
    "bad",
    [
        [],
        np.empty(0, dtype=np.uint32),
        [-1],
        [3, -5, 2],
        [2**32],
        [2**63],
        [2**64],
        [-1, 2**63],
        [1.0, 2.0],
        np.array([1.5]),
        [True, False],
        ["a", "b"],
        "hello",
        5,
        [[1, 2], [3, 4]],
        np.zeros((2, 3), dtype=np.uint32),
    ],
)
def test_bad_tokens_raise_invalid_tokens_error(bad: object) -> None:
    with pytest.raises(InvalidTokensError):
        as_token_array(bad)
    with pytest.raises(ConfigError):  # InvalidTokensError is a ConfigError
        PrefixHasher().key(bad, 4)


# -- prefix-closed keys ----------------------------------------------------------------------------


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80),
    page_size=st.sampled_from(PAGE_SIZES),
)
@settings(max_examples=150, deadline=None)
def test_keys_are_prefix_closed(tokens: list[int], page_size: int) -> None:
    hasher = PrefixHasher()
    full = hasher.key(tokens, page_size)
    assert full.num_full_pages == len(tokens) // page_size
    assert full.page_keys.size == full.num_full_pages
    assert full.key_at(len(tokens)) == full.end_key
    for pages in range(1, full.num_full_pages + 1):
        t = pages * page_size
        prefix = hasher.key(tokens[:t], page_size)
        assert np.array_equal(prefix.page_keys, full.page_keys[:pages])
        # The end key of a page-aligned prefix is the longer sequence's key at that boundary.
        assert prefix.end_key == int(full.page_keys[pages - 1]) == full.key_at(t)
    # A fresh hasher (fresh weight table and length-term cache) gives the same keys.
    again = PrefixHasher().key(tokens, page_size)
    assert np.array_equal(again.page_keys, full.page_keys)
    assert again.end_key == full.end_key


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    page_size=st.sampled_from(PAGE_SIZES),
)
@settings(max_examples=100, deadline=None)
def test_earlier_key_is_not_clobbered_by_scratch_reuse(tokens: list[int], page_size: int) -> None:
    """prefix_sums reuses a scratch buffer; a TokenKey must not alias it."""
    hasher = PrefixHasher()
    first = hasher.key(tokens, page_size)
    saved_pages, saved_end = first.page_keys.copy(), first.end_key
    hasher.key([7] * (len(tokens) + 50), page_size)
    assert np.array_equal(first.page_keys, saved_pages)
    assert first.end_key == saved_end


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_length_term_separates_trailing_zeros(page_size: int) -> None:
    hasher = PrefixHasher()
    for base in ([5, 9], [0], [0, 0, 0], [1] * page_size):
        a = hasher.key(base, page_size).end_key
        b = hasher.key([*base, 0], page_size).end_key
        assert a != b, base


def test_all_zero_pages_of_different_lengths_differ() -> None:
    """Without the length term every all-zero prefix would hash to 0."""
    key = PrefixHasher().key([0] * 64, 1)
    assert np.unique(key.page_keys).size == 64


def test_different_tokens_in_one_page_give_different_keys() -> None:
    hasher = PrefixHasher()
    keys = {hasher.key([a, b, c, d], 4).end_key for a in range(4) for b in range(4)
            for c in range(4) for d in range(4)}  # fmt: skip
    assert len(keys) == 4**4


def test_weight_table_is_independent_of_growth_order() -> None:
    grown_at_once = PrefixHasher().weights(_LONG_LEN).copy()
    stepwise = PrefixHasher()
    for n in (1, 17, 65_536, 65_537, _LONG_LEN):
        stepwise.weights(n)
    assert np.array_equal(stepwise.weights(_LONG_LEN), grown_at_once)
    assert np.all(grown_at_once % 2 == 1)
    assert np.unique(grown_at_once).size == grown_at_once.size
    other_seed = PrefixHasher(seed=1).weights(64)
    assert not np.array_equal(other_seed, grown_at_once[:64])


def test_same_prefix() -> None:
    key = PrefixHasher().key([1, 2, 3, 4], 2)
    other = np.array([1, 2, 9, 4], dtype=np.uint32)
    assert key.same_prefix(other, 0, 2)
    assert not key.same_prefix(other, 0, 3)
    assert key.same_prefix(other, 3, 4)


_CHILD = """
import json, sys
import numpy as np
from kvstrata.cache.keys import PrefixHasher
tokens = (np.arange({n}, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
hasher = PrefixHasher()
# Warm the length-term cache and scratch with another page size first: keys must not depend on it.
hasher.key(tokens[:100], 3)
key = hasher.key(tokens, 16)
out = {{
    "page_keys": [int(x) for x in key.page_keys[:8]] + [int(x) for x in key.page_keys[-8:]],
    "sum": int(key.page_keys.sum(dtype=np.uint64)),
    "end_key": int(key.end_key),
}}
sys.stdout.write(json.dumps(out))
"""


def test_keys_are_identical_across_processes_and_hash_seeds() -> None:
    expected = _key_fingerprint(PrefixHasher().key(_long_tokens(), 16))
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD.format(n=_LONG_LEN)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        assert json.loads(proc.stdout) == expected, seed
