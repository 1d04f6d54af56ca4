"""Page-key collisions end to end: with an order-blind hasher (``helpers.OrderBlindHasher``) any
two prefixes of equal length and equal token multiset share a key, so collisions that real
64-bit keys make once in 2**64 happen every few requests. Whatever the tree does with them,
every request's KV must be its own tokens' and no page may leak or be lost.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import OrderBlindHasher, run_all, small_disk_config

from kvstrata.cache.allocator import PageAllocator
from kvstrata.cache.radix import RadixTree
from kvstrata.config import CacheConfig, PoolConfig
from kvstrata.dist.group import Group
from kvstrata.dist.launch import run_ranks
from kvstrata.engine import Engine, EngineConfig, Finished
from kvstrata.model.compute import SyntheticCompute, synthetic_payload
from kvstrata.workloads import Request

KV_WIDTH, VOCAB = 8, 16
CP_SEEDS = [52, 58]


def _workload(seed: int, l3_dir: Path) -> tuple[EngineConfig, list[np.ndarray], list[list[int]]]:
    """Requests over a 2-4 token alphabet that copy earlier ones up to a cut, shuffle a window
    of them (equal page keys, other tokens) and add a few tokens; small pools, chunks and
    batches, an L2 and a small disk tier; the requests arrive in waves."""
    rng = random.Random(seed)
    P = rng.choice([1, 2, 4])
    alpha = rng.choice([2, 3, 4])
    n = rng.randint(8, 20)
    base = [rng.randint(1, alpha) for _ in range(rng.randint(1, 6 * P))]
    reqs: list[np.ndarray] = []
    for _ in range(n):
        if reqs and rng.random() < 0.6:
            toks = rng.choice(reqs).tolist()
            toks = toks[: rng.randint(0, len(toks))]
            if rng.random() < 0.7 and len(toks) >= 2:
                a = rng.randint(0, len(toks) - 1)
                b = min(len(toks), a + rng.randint(2, 2 * P + 1))
                window = toks[a:b]
                rng.shuffle(window)
                toks[a:b] = window
            toks += [rng.randint(1, alpha) for _ in range(rng.randint(0, 4 * P))]
            toks = toks or [1]
        else:
            toks = base[: rng.randint(1, len(base))]
            toks += [rng.randint(1, alpha) for _ in range(rng.randint(0, 4 * P))]
        reqs.append(np.array(toks, dtype=np.uint32))
    longest = -(-max(t.size for t in reqs) // P)
    pool = rng.randint(longest + 1, 3 * longest + 4)
    chunk = rng.randint(1, 3 * P + 2)
    config = EngineConfig(
        page_size=P,
        pool_tokens=pool * P,
        chunk_size=chunk,
        max_batch_tokens=max(rng.randint(1, 4 * P + 4) + P, chunk),
        max_batch_requests=rng.randint(1, 4),
        check_every_step=True,
        l2_tokens=rng.randint(1, pool) * P,
        l3_dir=str(l3_dir),
        l3_gib=0.01,
    )
    waves = rng.randint(2, 6)
    return config, reqs, [list(range(n))[w::waves] for w in range(waves)]


@pytest.mark.parametrize("seed", [52, 58, 73, *range(6)])
def test_colliding_requests_keep_their_own_kv_through_every_tier(seed: int, tmp_path: Path) -> None:
    """Seeds 52, 58 and 73 reload pages from disk whose first page's key a node with other
    tokens already had (a reload once replaced that node, losing its subtree and pages)."""
    config, reqs, waves = _workload(seed, tmp_path)
    engine = Engine(SyntheticCompute(KV_WIDTH, VOCAB), config)
    engine.cache.tree.hasher = OrderBlindHasher()
    engine.keep_logits = set(range(len(reqs)))  # and, with no model, each one's payload
    done: dict[int, Finished] = {}
    try:
        for wave in waves:
            for i in wave:
                engine.add(Request(i, reqs[i]))
            for _ in range(5_000):
                if not engine.has_work():
                    break
                done |= {f.rid: f for f in engine.step()}
            assert not engine.has_work(), "the engine stopped making progress"
            engine.drain()
            engine.check()
        for i, tokens in enumerate(reqs):
            assert done[i].error is None, done[i].error
            want = synthetic_payload(torch.from_numpy(tokens.astype(np.int64)), KV_WIDTH)
            got = done[i].payload
            assert got is not None and torch.equal(got, want), f"request {i}: another prefix's KV"
        assert engine.cache.allocator.num_used == engine.cache.tree.num_pages  # nothing leaked
    finally:
        engine.close()


def _tree(P: int) -> tuple[RadixTree, PageAllocator, PageAllocator]:
    dev, host = PageAllocator(PoolConfig(16, 1)), PageAllocator(PoolConfig(16, 1))
    tree = RadixTree(
        CacheConfig(page_size=P),
        16,
        OrderBlindHasher(),
        host_capacity_pages=16,
        allocator=dev,
        host_allocator=host,
    )
    return tree, dev, host


def test_a_reload_under_a_colliding_key_inserts_nothing() -> None:
    """``insert_host`` where a child already holds other tokens under the first page's key:
    None, the child and its pages untouched; under a free key it inserts as before."""
    tree, dev, host = _tree(2)
    pages = dev.alloc(0, 2)
    assert pages is not None
    tree.insert([1, 2, 3, 4], pages, 0)
    assert tree.match_length([2, 1, 5, 5]) == 0  # other tokens, equal page keys
    reloaded = host.alloc(0, 2)
    assert reloaded is not None
    assert tree.insert_host(np.array([2, 1, 5, 5], dtype=np.uint32), reloaded, 0) is None
    assert tree.match_length([1, 2, 3, 4]) == 4 and tree.num_pages == 2 and tree.num_host_pages == 0
    assert tree.hash_collisions >= 1
    tree.check()
    leaf = tree.insert_host(np.array([7, 7, 5, 5], dtype=np.uint32), reloaded, 0)
    assert leaf is not None and tree.match_length([7, 7, 5, 5]) == 4
    tree.check()


def test_an_insert_colliding_inside_a_node_keeps_the_caller_s_pages_there() -> None:
    """Inserting ``[1, 2, 4, 3, 9, 9]`` (no match asked first) where a node holds ``[1, 2, 3,
    4]``: page 1's keys are equal and its tokens are not, so the tree keeps page 0's position
    only; the sequence's pages from page 1 on are the caller's own, never the node's page for
    other tokens (which would hand the caller another prefix's KV)."""
    tree, dev, _ = _tree(2)
    pages = dev.alloc(0, 2)
    fresh = dev.alloc(0, 3)
    assert pages is not None and fresh is not None
    tree.insert([1, 2, 3, 4], pages, 0)
    result = tree.insert([1, 2, 4, 3, 9, 9], fresh, 0)
    assert result.node.end == 2
    assert result.pages.tolist() == [int(pages[0]), int(fresh[1]), int(fresh[2])]
    assert result.free_pages.tolist() == fresh.tolist()  # page 0 a duplicate, the rest not kept
    dev.free(result.free_pages)
    tree.check()
    assert dev.num_used == tree.num_pages == 2


def _exact(f: Finished, tokens: np.ndarray) -> bool:
    want = synthetic_payload(torch.from_numpy(tokens.astype(np.int64)), KV_WIDTH)
    return f.error is None and f.payload is not None and torch.equal(f.payload, want)


def _cp_rank(group: Group, seed: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    config, reqs, waves = _workload(seed, Path(root))
    config = dataclasses.replace(config, check_digests=True)
    engine = Engine(SyntheticCompute(KV_WIDTH, VOCAB), config, group=group)
    engine.cache.tree.hasher = OrderBlindHasher()
    engine.keep_logits = set(range(len(reqs)))
    done: dict[int, Finished] = {}
    try:
        for wave in waves:
            done |= run_all(engine, [Request(i, reqs[i]) for i in wave], check=True)
    finally:
        engine.close()
    bad = [i for i, tokens in enumerate(reqs) if not _exact(done[i], tokens)]
    return {
        "bad": bad,
        "leaked": engine.cache.allocator.num_used - engine.cache.tree.num_pages,
        "collisions": engine.cache.tree.hash_collisions,
        "digest": engine.cache.tree.digest(),
    }


@pytest.mark.multiproc
@pytest.mark.slow
def test_colliding_requests_under_cp2_stay_exact_and_replicated(tmp_path: Path) -> None:
    """The same fuzz over two ranks (gloo), digests compared every step: collisions are decided
    alike on every rank, every request's KV is its own, nothing leaks. (Before a collision
    stopped a request's inserts, a chunk after one raised on both ranks.)"""
    seen = 0
    for seed in CP_SEEDS:
        ranks = run_ranks(2, _cp_rank, (seed, str(tmp_path / str(seed))), timeout_s=120)
        assert [r["bad"] for r in ranks] == [[], []], seed
        assert [r["leaked"] for r in ranks] == [0, 0], seed
        assert ranks[0]["digest"] == ranks[1]["digest"], seed
        seen += ranks[0]["collisions"] > 0
    assert seen  # the seeds do collide


def test_a_prefix_the_tree_holds_other_tokens_for_is_not_reloaded_again_and_again(
    tmp_path: Path,
) -> None:
    """X on disk; the tree holds Y, X with page 0's tokens reversed (equal keys): requests for
    X can never insert X's pages there, so they compute at once instead of each reading X's
    pages from disk and throwing them away (one wasted read a request before)."""
    X = np.arange(1, 65, dtype=np.uint32)
    Y = X.copy()
    Y[:16] = Y[:16][::-1].copy()

    first = Engine(
        SyntheticCompute(KV_WIDTH, 1000), small_disk_config(tmp_path, "clear"), model_id="none"
    )
    try:
        first.run([Request(0, X)], check=True)
    finally:
        first.close()
    engine = Engine(
        SyntheticCompute(KV_WIDTH, 1000), small_disk_config(tmp_path, "load"), model_id="none"
    )
    engine.cache.tree.hasher = OrderBlindHasher()
    engine.keep_logits = {10, 11, 12}
    try:
        engine.run([Request(1, np.concatenate([Y, [7, 7, 7]]).astype(np.uint32))], check=True)
        assert engine.cache.disk is not None
        reloads = engine.cache.disk.stats.reloads
        asks = [
            Request(10 + i, np.concatenate([X, [900 + i, 5, 6]]).astype(np.uint32))
            for i in range(3)
        ]
        done = engine.run(asks, check=True)
        assert engine.cache.disk.stats.reloads == reloads
        assert all(_exact(done[r.rid], r.tokens) for r in asks)
    finally:
        engine.close()
