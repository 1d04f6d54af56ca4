"""Tests for kvstrata.tiers.page_hash: namespaces and prefix-chained page hashes."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import OrderBlindHasher
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.cache.keys import PrefixHasher as KeyHasher
from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.errors import ConfigError, InvalidTokensError
from kvstrata.tiers.page_hash import ROOT_HASH, Namespace, PrefixHasher, page_hashes

LAYOUT = KVLayout(2, (PayloadSpec("k", (2, 4), "bfloat16"), PayloadSpec("v", (2, 4), "bfloat16")))
NS = Namespace.for_layout("llama", LAYOUT, page_size=4, cp_size=2)
SRC = Path(__file__).resolve().parents[1] / "src"


def _reference(ns: Namespace, tokens: list[int]) -> list[bytes]:
    """The chain written out: h_i = SHA-256(h_{i-1} || ns || page i as little-endian uint32)."""
    out, h = [], ROOT_HASH
    for i in range(len(tokens) // ns.page_size):
        page = tokens[i * ns.page_size : (i + 1) * ns.page_size]
        h = hashlib.sha256(h + ns.digest + b"".join(t.to_bytes(4, "little") for t in page)).digest()
        out.append(h)
    return out


def test_hashes_follow_the_documented_chain_and_skip_the_partial_page() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # 2 full pages and a partial one
    hashes = page_hashes(NS, tokens)
    assert hashes == _reference(NS, tokens) and len(hashes) == 2
    assert all(len(h) == 32 for h in hashes)
    assert page_hashes(NS, []) == [] and page_hashes(NS, tokens[:3]) == []
    assert page_hashes(NS, np.array(tokens, dtype=np.int64)) == hashes


def test_a_changed_token_changes_its_page_and_every_later_one_only() -> None:
    tokens = list(range(20))
    base = page_hashes(NS, tokens)
    tokens[9] += 1  # page 2
    changed = page_hashes(NS, tokens)
    assert changed[:2] == base[:2]
    assert all(a != b for a, b in zip(changed[2:], base[2:], strict=True))


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    page_size=st.integers(1, 7),
    cut=st.integers(0, 10),
)
def test_prefix_closed_and_continuable(tokens: list[int], page_size: int, cut: int) -> None:
    ns = dataclasses.replace(NS, page_size=page_size)
    hashes = page_hashes(ns, tokens)
    assert hashes == _reference(ns, tokens)
    k = min(cut, len(hashes))
    # A prefix's hashes are the prefix of the hashes; a suffix continues from its parent.
    assert page_hashes(ns, tokens[: k * page_size]) == hashes[:k]
    parent = hashes[k - 1] if k else ROOT_HASH
    assert page_hashes(ns, tokens[k * page_size :], parent=parent) == hashes[k:]


@settings(max_examples=40, deadline=None)
@given(
    cuts=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)), min_size=1, max_size=12),
    kept=st.integers(1, 4),
    prints=st.sampled_from(["blake2b", "prefix keys", "colliding keys"]),
)
def test_the_prefix_hasher_gives_the_chain_whatever_it_kept(
    cuts: list[tuple[int, int]], kept: int, prints: str
) -> None:
    """Sequences that share prefixes of any length with the earlier ones (a conversation's
    turns, an agent's steps, other sessions between them): the hashes are the chain's, exactly,
    however few sequences the hasher keeps, and whatever the fingerprints (its own BLAKE2b, the
    radix tree's prefix keys, or keys that collide for any equal token multiset); the shared
    pages are reused, not hashed again."""
    hasher = PrefixHasher(NS, sequences=kept)
    keyer = {"prefix keys": KeyHasher(), "colliding keys": OrderBlindHasher()}.get(prints)

    def fp(tokens: np.ndarray) -> np.ndarray | None:
        return keyer.key(tokens, NS.page_size).page_keys if keyer and tokens.size else None

    base = np.random.default_rng(0).integers(0, 2**32, 400, dtype=np.uint64).astype(np.uint32)
    for share, tail in cuts:
        tokens = np.concatenate([base[:share], np.arange(tail, dtype=np.uint32) + 7 * share])
        if tail % 2:  # another order: the same colliding keys as a kept sequence, other hashes
            tokens[share:] = tokens[share:][::-1].copy()
        assert hasher(tokens, fp(tokens)) == _reference(NS, tokens.tolist()), (share, tail)
    # The same long sequence twice: the second time every page comes from the first's chain.
    hashed = hasher.pages_hashed
    assert hasher(base, fp(base)) == hasher(base, fp(base)) == page_hashes(NS, base)
    assert hasher.pages_hashed - hashed <= len(base) // NS.page_size
    swapped = base.copy()  # page 3's tokens in another order: colliding keys from page 3 on
    swapped[12:16] = swapped[12:16][::-1].copy()
    assert hasher(swapped, fp(swapped)) == page_hashes(NS, swapped)
    assert hasher(base, fp(base)) == page_hashes(NS, base)
    got = hasher(base)
    got[0] = b"x" * 32  # the caller's list is its own: the kept chain is untouched
    assert hasher(base) == page_hashes(NS, base)
    with pytest.raises(InvalidTokensError):
        hasher([-1])  # refused as page_hashes refuses it, even shorter than a page
    small = PrefixHasher(NS, max_tokens=100)  # keeps about 100 tokens' worth of sequences
    for share in (40, 80, 120, 40):
        assert small(base[:share]) == page_hashes(NS, base[:share])
    assert small._kept_tokens <= 120 and len(small._kept) == 1
    with pytest.raises(ConfigError, match="keeps >= 1"):
        PrefixHasher(NS, sequences=0)
    with pytest.raises(ConfigError, match="a key per full page"):
        PrefixHasher(NS)(base[:8], np.zeros(1, dtype=np.uint64))


def test_a_session_keeps_one_sequence_and_hashes_only_its_new_pages() -> None:
    """Turns of interleaved sessions, each the last turn plus new tokens: a turn replaces the
    kept turn it extends (whose every fingerprint it has), so the hasher keeps one sequence a
    session, and however many sessions run, each turn hashes only its new pages; a turn that
    branches off an earlier one keeps both."""
    rng = np.random.default_rng(1)
    sessions = 6
    hasher = PrefixHasher(NS, sequences=sessions)  # room for one sequence a session, no more
    turns = [rng.integers(0, 2**32, 8, dtype=np.uint64).astype(np.uint32) for _ in range(sessions)]
    for step in range(5):
        for s in range(sessions):
            new = rng.integers(0, 2**32, 4 * (s + 1), dtype=np.uint64).astype(np.uint32)
            longer = np.concatenate([turns[s], new])
            hashed = hasher.pages_hashed
            assert hasher(longer) == _reference(NS, longer.tolist()), (step, s)
            if step:  # the earlier turn's pages all came from its chain
                assert hasher.pages_hashed - hashed == len(longer) // 4 - len(turns[s]) // 4
            turns[s] = longer
        assert len(hasher._kept) == sessions
    branch = np.concatenate([turns[0][:12], np.arange(8, dtype=np.uint32)])
    assert hasher(branch) == _reference(NS, branch.tolist())
    assert hasher(turns[0]) == _reference(NS, turns[0].tolist())
    assert len(hasher._kept) == sessions  # the branch did not replace the turn it left


def test_every_namespace_field_changes_the_digest() -> None:
    variants = [
        dataclasses.replace(NS, model_id="qwen"),
        dataclasses.replace(NS, num_layers=3),
        dataclasses.replace(NS, page_size=8),
        dataclasses.replace(NS, cp_size=1),
        dataclasses.replace(NS, format_version=2),
        dataclasses.replace(NS, payloads=(PayloadSpec("k", (2, 4), "float16"), LAYOUT.payloads[1])),
        dataclasses.replace(
            NS, payloads=(PayloadSpec("k", (4, 2), "bfloat16"), LAYOUT.payloads[1])
        ),
        dataclasses.replace(NS, payloads=LAYOUT.payloads[::-1]),
        dataclasses.replace(NS, payloads=(*LAYOUT.payloads, PayloadSpec("draft_k", (1, 4)))),
    ]
    digests = {NS.digest, *(v.digest for v in variants)}
    assert len(digests) == len(variants) + 1
    tokens = list(range(8))
    assert page_hashes(variants[0], tokens) != page_hashes(NS, tokens)
    assert dataclasses.replace(NS).digest == NS.digest  # equal fields, equal digest


def test_digest_is_the_same_in_another_process() -> None:
    code = (
        "from kvstrata.config import KVLayout, PayloadSpec\n"
        "from kvstrata.tiers.page_hash import Namespace, page_hashes\n"
        "ns = Namespace.for_layout('llama', KVLayout(2, (PayloadSpec('k', (2, 4), 'bfloat16'), "
        "PayloadSpec('v', (2, 4), 'bfloat16'))), page_size=4, cp_size=2)\n"
        "print(ns.digest.hex(), page_hashes(ns, list(range(9)))[-1].hex())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [NS.digest.hex(), page_hashes(NS, list(range(9)))[-1].hex()]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="model id"):
        Namespace.for_layout("", LAYOUT, 4)
    with pytest.raises(ConfigError, match="page_size"):
        Namespace.for_layout("m", LAYOUT, 0)
    with pytest.raises(ConfigError, match="unique"):
        Namespace("m", 2, (LAYOUT.payloads[0], LAYOUT.payloads[0]), 4)
    with pytest.raises(ConfigError, match="parent"):
        page_hashes(NS, [1, 2, 3, 4], parent=b"short")
    with pytest.raises(InvalidTokensError):
        page_hashes(NS, [1, -2, 3, 4])
