"""The engine on top of the cache: cached answers equal uncached ones, failures stay isolated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import OrderBlindHasher, run_all

from kvstrata.engine import Engine, EngineConfig, Finished
from kvstrata.errors import ConfigError
from kvstrata.model.compute import ModelCompute, SyntheticCompute, synthetic_payload
from kvstrata.model.loader import load_model
from kvstrata.replay import ReplayConfig, recompute_uncached, run_replay
from kvstrata.workloads import Request, builtin


@pytest.fixture(scope="module")
def tiny() -> ModelCompute:
    torch.manual_seed(0)
    _, model = load_model("tiny", device="cpu", dtype="float32", seed=0)
    return ModelCompute(model, torch.float32)


def test_cached_logits_equal_uncached_for_every_request(tiny: ModelCompute) -> None:
    """200 requests with heavy sharing through a pool that forces eviction: every request's
    last-token logits equal a no-cache recompute within 1e-5 and the argmax is identical."""
    requests = builtin(tiny.vocab_size, seed=3, n_requests=200)
    config = EngineConfig(
        page_size=16, pool_tokens=1024, chunk_size=96, max_batch_tokens=512, check_every_step=True
    )
    engine = Engine(tiny, config)
    engine.keep_logits = {r.rid for r in requests}
    finished = run_all(engine, requests)

    assert len(finished) == 200 and all(f.error is None for f in finished.values())
    assert sum(f.cached_len for f in finished.values()) > 0.3 * sum(r.tokens.size for r in requests)
    assert engine.cache.tree.num_pages <= config.pool_pages
    evicted_some = engine.cache.allocator.num_pages < sum(-(-r.tokens.size // 16) for r in requests)
    assert evicted_some
    for r in requests:
        cached = finished[r.rid].logits
        assert cached is not None
        fresh = recompute_uncached(tiny, config, r)
        assert torch.allclose(cached, fresh, atol=1e-5, rtol=0), (
            r.rid,
            (cached - fresh).abs().max(),
        )
        assert int(cached.argmax()) == int(fresh.argmax())


def test_chunking_and_page_size_do_not_change_logits(tiny: ModelCompute) -> None:
    request = builtin(tiny.vocab_size, n_requests=8)[-1]
    ref = recompute_uncached(tiny, EngineConfig(page_size=16, chunk_size=4096), request)
    for page_size, chunk in [(1, 7), (4, 33), (64, 50)]:
        got = recompute_uncached(tiny, EngineConfig(page_size=page_size, chunk_size=chunk), request)
        assert torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_repeated_identical_prompt_hits_and_does_not_grow_pool(tiny: ModelCompute) -> None:
    tokens = np.arange(1, 41, dtype=np.uint32)  # 40 tokens: 2 full pages + a valid tail
    engine = Engine(tiny, EngineConfig(page_size=16, pool_tokens=256))
    first = run_all(engine, [Request(0, tokens)])[0]
    assert first.cached_len == 0
    used = engine.cache.allocator.num_used
    for i in range(1, 6):
        again = run_all(engine, [Request(i, tokens)])[i]
        assert again.cached_len == 32  # whole pages only; the tail page is recomputed
        assert engine.cache.allocator.num_used == used
    engine.check()


def test_full_page_multiple_hit_recomputes_last_page(tiny: ModelCompute) -> None:
    tokens = np.arange(5, 5 + 48, dtype=np.uint32)  # exactly 3 pages
    engine = Engine(tiny, EngineConfig(page_size=16, pool_tokens=256))
    engine.keep_logits = {0, 1}
    a = run_all(engine, [Request(0, tokens)])[0]
    b = run_all(engine, [Request(1, tokens)])[1]
    assert b.cached_len == 32 and b.computed_len == 16
    assert a.logits is not None and b.logits is not None
    assert torch.allclose(a.logits, b.logits, atol=1e-5, rtol=0)
    engine.check()


@pytest.mark.parametrize("l2_tokens", [0, 256])
def test_a_page_key_collision_mid_prefill_stops_that_request_s_inserts(
    tiny: ModelCompute, l2_tokens: int
) -> None:
    """B shares A's first two pages, then a page with A's tokens in another order (an equal key
    under an order-blind hasher) and more: B's chunk that reaches the collision is kept out of
    the tree, its later chunks are not inserted, its pages are freed at the end, and every
    request's logits equal a no-cache recompute. (A chunk after the collision once raised:
    the engine took what it computed for what the tree held.)"""
    a = np.arange(1, 25, dtype=np.uint32)
    b = np.concatenate([a[:8], a[8:12][::-1], np.arange(100, 120, dtype=np.uint32)])
    config = EngineConfig(
        page_size=4, pool_tokens=256, chunk_size=8, l2_tokens=l2_tokens, check_every_step=True
    )
    engine = Engine(tiny, config)
    engine.cache.tree.hasher = OrderBlindHasher()
    engine.keep_logits = {0, 1, 2}
    requests = [Request(0, a), Request(1, b), Request(2, b.copy())]
    out: dict[int, Finished] = {}
    for r in requests:  # one after the other: B meets A's pages, C meets both
        out |= run_all(engine, [r], check=True)
    assert engine.cache.tree.hash_collisions >= 1
    assert [out[i].cached_len for i in range(3)] == [0, 8, 8]
    assert engine.cache.allocator.num_used == engine.cache.tree.num_pages  # nothing leaked
    for r in requests:
        got = out[r.rid].logits
        fresh = recompute_uncached(tiny, config, r)
        assert got is not None and torch.allclose(got, fresh, atol=1e-5, rtol=0), r.rid


def test_request_that_cannot_fit_fails_alone(tiny: ModelCompute) -> None:
    ok1 = Request(0, np.arange(10, 60, dtype=np.uint32))
    huge = Request(1, np.arange(0, 300, dtype=np.uint32) % 500)
    ok2 = Request(2, np.arange(20, 90, dtype=np.uint32))
    engine = Engine(tiny, EngineConfig(page_size=16, pool_tokens=128))
    out = run_all(engine, [ok1, huge, ok2])
    assert out[1].error is not None and "pool" in out[1].error
    assert out[0].error is None and out[2].error is None
    engine.check()


def test_out_of_vocab_and_too_long_requests_fail_alone(tiny: ModelCompute) -> None:
    bad_vocab = Request(0, np.array([1, 2, tiny.vocab_size], dtype=np.uint32))
    good = Request(1, np.arange(1, 20, dtype=np.uint32))
    out = run_all(Engine(tiny, EngineConfig(pool_tokens=256)), [bad_vocab, good])
    assert out[0].error is not None and "vocabulary" in out[0].error
    assert out[1].error is None


def test_waiting_for_pages_does_not_fail(tiny: ModelCompute) -> None:
    """Two requests that each fit alone but not together: the second waits, then runs."""
    a = Request(0, np.arange(1, 100, dtype=np.uint32))
    b = Request(1, np.arange(200, 300, dtype=np.uint32))
    engine = Engine(tiny, EngineConfig(page_size=16, pool_tokens=112, chunk_size=32))
    out = run_all(engine, [a, b])
    assert out[0].error is None and out[1].error is None
    engine.check()


def test_model_none_hit_ratio_equals_model_mode(tiny: ModelCompute) -> None:
    requests = builtin(tiny.vocab_size, seed=1, n_requests=60)
    config = EngineConfig(page_size=16, pool_tokens=1024, chunk_size=64, max_batch_tokens=256)
    model_run = run_all(Engine(tiny, config), requests)
    none_run = run_all(Engine(SyntheticCompute(32, tiny.vocab_size), config), requests)
    for r in requests:
        assert model_run[r.rid].cached_len == none_run[r.rid].cached_len


def test_synthetic_payload_served_from_cache_is_exact() -> None:
    cfg = ReplayConfig(
        workload="builtin",
        model="none",
        vocab_size=512,
        kv_width=16,
        verify=48,
        engine=EngineConfig(page_size=8, pool_tokens=1024),
    )
    summary = run_replay(cfg, progress=False)
    assert summary.hit_ratio > 0.3
    assert summary.verify.requests == 48
    assert summary.verify.payload_mismatched_bytes == 0


def test_replay_verify_reports_agreement() -> None:
    summary = run_replay(
        ReplayConfig(verify=5, engine=EngineConfig(pool_tokens=2048)), progress=False
    )
    assert summary.verify.requests == 5
    assert (
        summary.verify.max_abs_logit_diff is not None and summary.verify.max_abs_logit_diff < 1e-4
    )
    assert summary.verify.argmax_agree == 1.0
    data = summary.to_json()
    assert data["hit_tokens_by_tier"]["l1"] == data["cached_tokens"] > 0
    assert set(data["ttft_ms"]) == {"mean", "p50", "p90", "p99"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 0},
        {"pool_tokens": 0},
        {"chunk_size": 0},
        {"max_batch_tokens": -1},
        {"eviction": "fifo"},
        {"page_size": 64, "pool_tokens": 32},
    ],
)
def test_bad_engine_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_all_token_logits_on_request(tiny: ModelCompute) -> None:
    """All-token logits of the computed part equal the one-shot forward's, across chunks and a hit."""
    base = np.arange(3, 3 + 70, dtype=np.uint32)
    longer = np.concatenate([base, np.arange(100, 131, dtype=np.uint32)])
    engine = Engine(tiny, EngineConfig(page_size=16, pool_tokens=512, chunk_size=24))
    engine.keep_all_logits = {0, 1}
    engine.keep_logits = {1}
    out = run_all(engine, [Request(0, base)])
    out |= run_all(engine, [Request(1, longer)])
    first, second = out[0], out[1]
    assert first.all_logits is not None and first.all_logits.shape == (70, tiny.vocab_size)
    assert second.cached_len == 64 and second.all_logits is not None
    assert second.all_logits.shape == (longer.size - 64, tiny.vocab_size)
    assert second.logits is not None and torch.equal(second.logits, second.all_logits[-1])

    solo = Engine(tiny, EngineConfig(page_size=16, pool_tokens=512, chunk_size=4096))
    solo.keep_all_logits = {9}
    ref = run_all(solo, [Request(9, longer)])[9].all_logits
    assert ref is not None
    assert torch.allclose(second.all_logits, ref[64:], atol=1e-5, rtol=0)
    assert torch.allclose(first.all_logits, ref[:70], atol=1e-5, rtol=0)


def test_synthetic_payload_depends_on_the_whole_prefix() -> None:
    a = torch.tensor([5, 6, 7, 8], dtype=torch.int64)
    b = torch.tensor([9, 6, 7, 8], dtype=torch.int64)  # same tokens at positions 1-3
    pa, pb = synthetic_payload(a, 8), synthetic_payload(b, 8)
    assert torch.equal(synthetic_payload(a[:3], 8), pa[:3])  # a prefix's bytes do not change
    assert all(not torch.equal(pa[i], pb[i]) for i in range(4))
    shifted = synthetic_payload(torch.tensor([1, 5, 6, 7, 8]), 8)[1:]
    assert all(not torch.equal(pa[i], shifted[i]) for i in range(4))  # position matters too


@pytest.mark.parametrize(("page_size", "chunk"), [(1, 3), (4, 7), (16, 5)])
def test_synthetic_chunks_and_hits_reproduce_one_shot_bytes(page_size: int, chunk: int) -> None:
    """Chunked, batched and cache-hit writes leave every request's bytes equal to a one-shot
    computation over its whole sequence."""
    requests = builtin(512, seed=2, n_requests=40)
    engine = Engine(
        SyntheticCompute(12, 512),
        EngineConfig(page_size=page_size, pool_tokens=2048, chunk_size=chunk, max_batch_tokens=64),
    )
    engine.keep_logits = {r.rid for r in requests}
    out = run_all(engine, requests)
    assert sum(f.cached_len for f in out.values()) > 0
    for r in requests:
        payload = out[r.rid].payload
        assert payload is not None
        assert torch.equal(
            payload, synthetic_payload(torch.from_numpy(r.tokens.astype(np.int64)), 12)
        )


def test_synthetic_kv_width_needs_room_for_the_state() -> None:
    with pytest.raises(ConfigError, match="kv_width"):
        SyntheticCompute(3, 512)
