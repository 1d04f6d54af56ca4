"""The L2 host tier in the engine: write-through, frontier visibility, load-back, demotion, host
eviction, write policies, and faults (failed copies) — with ``Engine.check()`` after every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import run_all

from kvstrata.engine import Engine, EngineConfig
from kvstrata.errors import ConfigError
from kvstrata.model.compute import ModelCompute, SyntheticCompute, synthetic_payload
from kvstrata.model.loader import load_model
from kvstrata.replay import recompute_uncached
from kvstrata.residency import Residency, Tier
from kvstrata.tiers.tickets import Progress
from kvstrata.workloads import Request, builtin, synthetic


def synthetic_engine(**kw: object) -> Engine:
    cfg = {"page_size": 4, "pool_tokens": 64, "chunk_size": 64, "l2_tokens": 1024, **kw}
    return Engine(SyntheticCompute(8, 1000), EngineConfig(**cfg))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny() -> ModelCompute:
    torch.manual_seed(0)
    _, model = load_model("tiny", device="cpu", dtype="float32", seed=0)
    return ModelCompute(model, torch.float32)


def test_host_hits_serve_exact_payload_bytes() -> None:
    """A tiny L1 demotes nearly everything; later turns load their prefix back from L2, and every
    request's cached payload equals a from-scratch computation byte for byte."""
    requests = synthetic(
        seed=1,
        n_requests=120,
        vocab_size=1000,
        system_prompt_len=40,
        turn_min=5,
        turn_max=30,
        max_turns=6,
        concurrent_sessions=4,
    )
    engine = synthetic_engine(pool_tokens=200, chunk_size=32, max_batch_tokens=64)
    engine.keep_logits = {r.rid for r in requests}
    out = run_all(engine, requests, check=True)
    assert all(f.error is None for f in out.values())
    assert engine.hit_tokens[Tier.L2] > 0 and engine.hit_tokens[Tier.L1] > 0
    assert sum(f.host_len for f in out.values()) == engine.hit_tokens[Tier.L2]
    for r in requests:
        f = out[r.rid]
        expected = synthetic_payload(torch.from_numpy(r.tokens.astype(np.int64)), 8)
        assert f.payload is not None and torch.equal(f.payload, expected), r.rid
    stats = engine.cache.transfer_stats()
    assert stats is not None and stats.h2d_pages > 0 and stats.d2h_pages > 0
    assert engine.cache.backups is not None and engine.cache.backups.stats.done > 0


def test_model_logits_with_l2_hits_equal_uncached(tiny: ModelCompute) -> None:
    """fp32 CPU: a tiny L1 forces demotion and load-back on most hits; logits equal a no-cache
    recompute within 1e-5."""
    requests = builtin(tiny.vocab_size, seed=5, n_requests=60)
    config = EngineConfig(
        page_size=16,
        pool_tokens=640,
        chunk_size=64,
        max_batch_tokens=256,
        l2_tokens=8192,
        check_every_step=True,
    )
    engine = Engine(tiny, config)
    engine.keep_logits = {r.rid for r in requests}
    out = run_all(engine, requests, check=True)
    assert engine.hit_tokens[Tier.L2] > engine.hit_tokens[Tier.L1] / 4
    loaded = [r for r in requests if out[r.rid].host_len > 0]
    assert len(loaded) >= 10
    for r in loaded:
        fresh = recompute_uncached(tiny, config, r)
        got = out[r.rid].logits
        assert got is not None
        assert float((fresh - got).abs().max()) <= 1e-5, r.rid


def test_pending_backups_are_invisible_until_the_frontier_covers_them() -> None:
    """With a frontier that holds everything back, nothing is ever served from L2 and no host
    page becomes visible; releasing the frontier commits every backup."""
    held_back = Progress(0)
    engine = Engine(
        SyntheticCompute(8, 1000),
        EngineConfig(page_size=4, pool_tokens=256, chunk_size=64, l2_tokens=1024),
        frontier=lambda progress: held_back,
    )
    first = Request(0, np.arange(1, 41, dtype=np.uint32))
    run_all(engine, [first], check=True)
    assert all(n.residency is Residency.DEVICE_HOST_PENDING for n in engine.cache.tree.nodes()), (
        "backups must stay pending until the frontier covers them"
    )
    # More work, and a repeat of the first request: pending nodes are never evicted or demoted,
    # and no match ever reports a host copy.
    others = [Request(i, np.arange(100 * i, 100 * i + 12, dtype=np.uint32)) for i in range(1, 4)]
    run_all(engine, [*others, Request(9, first.tokens.copy())], check=True)
    hit = engine.cache.tree.match_prefix(first.tokens, record=False)
    assert hit.host_pages.size == 0 and hit.valid_len == 40
    assert engine.hit_tokens[Tier.L2] == 0
    assert engine.cache.tree.num_host_pages > 0 and all(
        n.residency is Residency.DEVICE_HOST_PENDING for n in engine.cache.tree.nodes()
    )
    engine.cache.frontier = lambda progress: progress
    engine.drain()
    engine.check()
    assert all(n.residency is Residency.DEVICE_HOST for n in engine.cache.tree.nodes())


@pytest.mark.parametrize("seed", range(12))
def test_random_copy_failures_roll_back_and_leak_nothing(seed: int) -> None:
    """Copies fail at random (device -> host and host -> device); after every step the engine's
    invariants hold, failed backups are counted and never visible, and nothing leaks."""
    rng = np.random.default_rng(seed)
    requests = synthetic(
        seed=seed,
        n_requests=80,
        vocab_size=500,
        system_prompt_len=24,
        turn_min=3,
        turn_max=20,
        max_turns=5,
        concurrent_sessions=5,
    )
    engine = synthetic_engine(
        pool_tokens=160,
        chunk_size=int(rng.choice([8, 16, 64])),
        max_batch_tokens=48,
        l2_tokens=int(rng.choice([64, 200, 1000])),
    )
    transfer = engine.cache.transfer
    assert transfer is not None
    real_copy = transfer.copier.copy

    def flaky(*args: object, **kw: object) -> None:
        if rng.random() < 0.15:
            raise RuntimeError("injected copy failure")
        real_copy(*args, **kw)  # type: ignore[arg-type]

    transfer.copier.copy = flaky  # type: ignore[method-assign]
    engine.keep_logits = {r.rid for r in requests}
    out = run_all(engine, requests, check=True)
    assert [f.error for f in out.values() if f.error] == []
    for r in requests:  # a failed copy never serves a wrong byte
        expected = synthetic_payload(torch.from_numpy(r.tokens.astype(np.int64)), 8)
        assert torch.equal(out[r.rid].payload, expected), r.rid
    assert engine.cache.backups is not None
    stats = transfer.stats()
    assert stats.failed_tickets > 0
    assert engine.cache.backups.stats.failed + engine.cache.loads.stats.failed > 0  # type: ignore[union-attr]
    # Nothing leaks: every device page is free or cached, every host page free or cached.
    assert engine.cache.allocator.num_used == engine.cache.tree.num_pages
    assert engine.cache.host_allocator is not None
    assert engine.cache.host_allocator.num_used == engine.cache.tree.num_host_pages


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_write_policies_fill_l2_when_they_should(policy: str) -> None:
    requests = synthetic(
        seed=2,
        n_requests=100,
        vocab_size=1000,
        system_prompt_len=40,
        turn_min=5,
        turn_max=30,
        max_turns=6,
        concurrent_sessions=4,
    )
    engine = synthetic_engine(
        pool_tokens=200,
        chunk_size=32,
        max_batch_tokens=64,
        write_policy=policy,
        write_through_hits=2,
    )
    engine.keep_logits = {r.rid for r in requests}
    out = run_all(engine, requests, check=True)
    assert all(f.error is None for f in out.values())
    backups = engine.cache.backups
    assert backups is not None and backups.stats.done > 0
    assert engine.hit_tokens[Tier.L2] > 0
    for r in requests:
        expected = synthetic_payload(torch.from_numpy(r.tokens.astype(np.int64)), 8)
        assert torch.equal(out[r.rid].payload, expected), r.rid


def test_a_full_l2_skips_backups_and_never_waits() -> None:
    engine = synthetic_engine(pool_tokens=64, l2_tokens=8)  # two host pages
    requests = [Request(i, np.arange(40 * i, 40 * i + 30, dtype=np.uint32)) for i in range(6)]
    out = run_all(engine, requests, check=True)
    assert all(f.error is None for f in out.values())
    assert engine.cache.backups is not None and engine.cache.backups.stats.skipped > 0


def test_l2_configuration_errors() -> None:
    for kw in (
        {"l2_tokens": -1},
        {"l2_tokens": 64, "l2_gib": 1.0},
        {"l2_gib": float("nan")},
        {"host_layout": "diagonal"},
        {"write_policy": "sometimes"},
        {"write_through_hits": 0},
        {"l2_tokens": 2},
    ):
        with pytest.raises(ConfigError):
            EngineConfig(page_size=4, **kw)  # type: ignore[arg-type]


def test_a_deferred_request_waits_for_the_chunk_it_needs_not_the_whole_prefill() -> None:
    """Chunks are inserted as they finish: a request sharing only the first chunk of a long
    running prefill starts as soon as that chunk is in the tree, and finishes first."""
    engine = Engine(
        SyntheticCompute(8, 1000),
        EngineConfig(page_size=4, pool_tokens=256, chunk_size=8, max_batch_tokens=64),
    )
    long = Request(0, np.arange(1, 65, dtype=np.uint32))  # 64 tokens: 8 steps of 8
    short = Request(1, np.concatenate([long.tokens[:8], np.arange(500, 504, dtype=np.uint32)]))
    engine.add(long)
    engine.add(short)
    order: list[int] = []
    steps = {}
    while engine.has_work():
        for f in engine.step():
            order.append(f.rid)
            steps[f.rid] = engine.steps
            if f.rid == 1:
                assert f.cached_len == 8  # it reused the long request's first chunk
        engine.check()
    assert order == [1, 0]
    assert engine.deferred >= 1 and steps[1] <= 3
