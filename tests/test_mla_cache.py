"""An MLA model's latent through every tier, the handoff, a speculative draft and context
parallelism: cached results equal uncached ones, and the exchange moves latents, never K/V."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.check_model import _write_preset_checkpoint
from kvstrata.cli import main
from kvstrata.decode import greedy_decode
from kvstrata.dist.attention import attention_bytes
from kvstrata.dist.group import Group, SoloGroup
from kvstrata.dist.launch import run_ranks
from kvstrata.engine import Engine, EngineConfig, Finished
from kvstrata.handoff import LoopbackTransport, assemble
from kvstrata.model.compute import ModelCompute, PairCompute
from kvstrata.model.config import PRESETS
from kvstrata.model.loader import load_model
from kvstrata.replay import prefill_uncached
from kvstrata.residency import Tier
from kvstrata.workloads import Request, builtin

CONFIG = EngineConfig(
    page_size=16,
    pool_tokens=320,
    chunk_size=64,
    max_batch_tokens=256,
    l2_tokens=640,
    check_every_step=True,
)


def model_compute(name: str = "tiny-moe") -> ModelCompute:
    _, model = load_model(name, dtype="float32", seed=0)
    return ModelCompute(model, torch.float32)


def max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    assert a is not None and b is not None
    return float((a - b).abs().max())


def run(engine: Engine, requests: list[Request]) -> dict[int, Finished]:
    engine.keep_logits = {r.rid for r in requests}
    engine.keep_handoff = {r.rid for r in requests}
    try:
        return engine.run(requests, check=True)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def mla_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-moe (DeepSeek-V3 structure: low-rank queries, a dense then a MoE layer) saved by
    transformers as a Hugging Face checkpoint."""
    path = tmp_path_factory.mktemp("tiny-moe") / "checkpoint"
    _write_preset_checkpoint(PRESETS["tiny-moe"], path, seed=0)
    return path


def test_the_pools_hold_only_the_latent() -> None:
    compute = model_compute()
    assert [p.name for p in compute.layout.payloads] == ["kv_latent"]
    engine = Engine(compute, CONFIG)
    try:
        assert engine.cache.host_pool is not None
        assert engine.cache.pool.page_bytes == engine.cache.host_pool.page_bytes == 16 * 2 * 80 * 4
    finally:
        engine.close()


@pytest.mark.parametrize("tier", ["l1_l2", "l3"])
def test_logits_with_cache_hits_equal_uncached(tier: str, tmp_path: Path) -> None:
    """fp32 CPU: with L1 and L2 hits (and a disk round trip of the latent pages), last-token
    logits equal a prefill of the same request with an empty cache within 1e-5."""
    compute = model_compute()
    config = CONFIG
    if tier == "l3":
        config = replace(CONFIG, pool_tokens=320, l2_tokens=480, l3_dir=str(tmp_path), l3_gib=0.05)
    requests = builtin(compute.vocab_size, seed=5, n_requests=40)
    engine = Engine(compute, config, model_id="tiny-moe")
    out = run(engine, requests)
    assert engine.hit_tokens[Tier.L1] > 0 and engine.hit_tokens[Tier.L2] > 0
    if tier == "l3":
        assert engine.hit_tokens[Tier.L3] > 0
    cached = [r for r in requests if out[r.rid].cached_len > 0]
    assert len(cached) >= 10
    for r in cached:
        fresh = prefill_uncached(compute, CONFIG, r)
        assert max_diff(fresh.logits, out[r.rid].logits) <= 1e-5, r.rid


@pytest.mark.parametrize(
    ("draft", "payloads"),
    [
        ("tiny-mla-draft", ["kv_latent", "draft_kv_latent"]),
        ("tiny-draft", ["kv_latent", "draft_k", "draft_v"]),  # a Llama draft for an MLA target
    ],
)
def test_a_draft_shares_the_latents_pages(draft: str, payloads: list[str]) -> None:
    _, target = load_model("tiny-mla", dtype="float32", seed=0)
    _, small = load_model(draft, dtype="float32", seed=0)
    compute = PairCompute(target, small, torch.float32)
    assert [p.name for p in compute.layout.payloads] == payloads
    requests = builtin(compute.vocab_size, seed=6, n_requests=30)
    engine = Engine(compute, CONFIG)
    out = run(engine, requests)
    assert engine.hit_tokens[Tier.L2] > 0
    cached = [r for r in requests if out[r.rid].cached_len > 0]
    assert len(cached) >= 5
    for r in cached:
        fresh = prefill_uncached(compute, CONFIG, r)
        assert max_diff(fresh.logits, out[r.rid].logits) <= 1e-5, r.rid
        assert max_diff(fresh.draft_logits, out[r.rid].draft_logits) <= 1e-5, r.rid


def test_decoding_from_a_latent_handoff_equals_decoding_uncached() -> None:
    """The handoff carries the latent pages; a decoder that rebuilds its pool from them decodes
    the same greedy tokens as one fed by a prefill without the cache."""
    compute = model_compute("tiny-mla")
    requests = builtin(compute.vocab_size, seed=9, n_requests=20)
    engine = Engine(compute, CONFIG)
    out = run(engine, requests)
    transport = LoopbackTransport()
    checked = 0
    for r in requests:
        f = out[r.rid]
        if not f.cached_len:
            continue
        assert f.handoff is not None and f.logits is not None
        assert set(f.handoff.payloads) == {"kv_latent"}
        transport.send(f.handoff)
        kv = assemble(transport.receive(r.rid), engine.fingerprint)
        cached = greedy_decode(kv, compute.model, f.logits, 5)
        fresh = prefill_uncached(compute, CONFIG, r, handoff=True)
        assert fresh.handoff is not None and fresh.logits is not None
        uncached = greedy_decode(
            assemble([fresh.handoff], engine.fingerprint), compute.model, fresh.logits, 5
        )
        assert cached.tokens == uncached.tokens, r.rid
        checked += 1
    assert checked >= 5


def test_cp_cost_model_knows_the_latent_sizes() -> None:
    """tiny-mla's exchange per token and layer: a latent (80 fp32) for move_kv; absorbed queries
    (4 heads x 80) and fp32 latent-space partials (4 x (64 + 2)) for move_queries."""
    exchange = model_compute("tiny-mla").exchange
    assert exchange == (80 * 4, 4 * 80 * 4, 4 * 66 * 4)
    cost = attention_bytes([4096], [64], exchange)
    assert cost == {"move_kv": 4160 * 320, "move_queries": 64 * (1280 + 1056)}
    assert min(cost, key=lambda s: cost[s]) == "move_queries"  # long prefix, short extend
    short = attention_bytes([0], [64], exchange)
    assert min(short, key=lambda s: short[s]) == "move_kv"  # nothing cached yet


# -- context parallelism -------------------------------------------------------------------------


STRATEGIES = ("move_kv", "move_queries")


def _cp_replay(group: Group, per_rank: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The built-in workload through an engine per strategy (one process start for both)."""
    torch.set_num_threads(1)
    results = {}
    for strategy in STRATEGIES:
        config = EngineConfig(**per_rank, cp_attention=strategy)
        engine = Engine(model_compute(), config, group=group)
        requests = builtin(512, seed=7, n_requests=40)
        engine.keep_logits = {r.rid for r in requests}
        digests = []
        for r in requests:
            engine.add(r)
        out: dict[int, Finished] = {}
        while engine.has_work():
            for f in engine.step():
                out[f.rid] = f
            engine.check()
            digests.append((engine.cache.allocator.digest(), engine.cache.tree.digest()))
        engine.drain()
        engine.close()
        results[strategy] = {
            "logits": {rid: f.logits for rid, f in out.items()},
            "cached": {rid: f.cached_len for rid, f in out.items()},
            "digests": digests,
            "l2_hits": engine.hit_tokens[Tier.L2],
            "strategies": engine.strategy_steps,
        }
    return results


BASE = {
    "page_size": 16,
    "pool_tokens": 640,
    "chunk_size": 64,
    "max_batch_tokens": 256,
    "l2_tokens": 2048,
}


@pytest.mark.multiproc
def test_cp2_logits_and_digests_equal_one_rank() -> None:
    """Two ranks (each half the pools), both strategies, every step: digests equal; fp32 logits
    within 1e-5 of one rank's, with L1 and L2 hits."""
    solo = _cp_replay(SoloGroup(), BASE)
    per_rank = {**BASE, "pool_tokens": 320, "l2_tokens": 1024, "check_digests": True}
    ranks = run_ranks(2, _cp_replay, (per_rank,), timeout_s=180)
    for strategy in STRATEGIES:
        one, two = (r[strategy] for r in ranks)
        assert one["digests"] == two["digests"] and len(one["digests"]) > 5
        assert one["l2_hits"] > 0 and set(one["strategies"]) == {strategy}
        for res in (one, two):
            assert res["cached"] == solo[strategy]["cached"]
            for rid, want in solo[strategy]["logits"].items():
                got = torch.from_numpy(res["logits"][rid])
                assert float((got - want).abs().max()) <= 1e-5, (strategy, rid)


def _measured_bytes(group: Group) -> dict[str, tuple[int, int]]:
    """Per strategy: one 1025-token request cached, then a 64-token extension of its 1024
    cached tokens; the attention bytes this rank put into the exchange per layer in that step,
    and the cost model's figure."""
    torch.set_num_threads(1)
    compute = model_compute("tiny-mla")
    tokens = torch.randint(0, 512, (1088,), generator=torch.Generator().manual_seed(0)).numpy()
    out = {}
    for strategy in STRATEGIES:
        config = EngineConfig(
            page_size=16,
            pool_tokens=2048,
            chunk_size=2048,
            max_batch_tokens=2048,
            cp_attention=strategy,
        )
        engine = Engine(compute, config, group=group)
        engine.run([Request(0, tokens[:1025].astype("uint32"))])
        before = group.traffic.bytes.get("attention", 0)
        engine.run([Request(1, tokens.astype("uint32"))])
        moved = group.traffic.bytes.get("attention", 0) - before
        engine.close()
        predicted = attention_bytes([1024], [64], compute.exchange)[strategy]
        out[strategy] = (moved // compute.layout.num_layers, predicted)
    return out


@pytest.mark.multiproc
def test_cp_moves_exactly_the_bytes_the_cost_model_predicts() -> None:
    for res in run_ranks(2, _measured_bytes, (), timeout_s=120):
        for strategy, (moved, predicted) in res.items():
            assert moved == predicted, (strategy, moved, predicted)


# -- the replay command --------------------------------------------------------------------------


def _replay(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["replay", *args, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_replay_verify_with_l1_l2_and_l3_hits(
    mla_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvstrata replay --model <MLA checkpoint>` with small L1/L2 and a disk tier: hits from
    every tier, and --verify 10 finds the logits within 1e-4 of an uncached prefill."""
    summary = _replay(
        [
            "--model", str(mla_checkpoint), "--l1-tokens", "640", "--l2-tokens", "1280",
            "--l3-dir", str(tmp_path / "l3"), "--l3-gib", "0.05", "--verify", "10",
        ],
        capsys,
    )  # fmt: skip
    hits = summary["hit_tokens_by_tier"]
    assert hits["l1"] > 0 and hits["l2"] > 0 and hits["l3"] > 0, hits
    verify = summary["verify"]
    assert verify["ok"] and verify["requests"] == 10 and verify["max_abs_logit_diff"] <= 1e-4


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["move_kv", "move_queries"])
def test_replay_at_cp2_verifies_with_digests_checked_every_step(
    mla_checkpoint: Path, strategy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = _replay(
        [
            "--model", str(mla_checkpoint), "--l1-tokens", "640", "--l2-tokens", "1280",
            "--verify", "10", "--cp", "2", "--cp-attention", strategy, "--check-digests",
        ],
        capsys,
    )  # fmt: skip
    assert summary["hit_tokens_by_tier"]["l2"] > 0
    assert set(summary["config"]["cp_attention_steps"]) == {strategy}
    verify = summary["verify"]
    assert verify["ok"] and verify["max_abs_logit_diff"] <= 1e-4


def test_bench_gpu_ttft_reads_the_prefix_back_from_each_tier(tmp_path: Path) -> None:
    """`kvstrata bench gpu --model deepseek-v2-lite --l3-dir DIR` on the GPU; here its TTFT
    section on the CPU with tiny-mla: the prefix served from L1, L2 and the disk alone (the
    section asserts where each hit came from)."""
    import argparse

    import numpy as np

    from kvstrata.benchmarks.gpu import ttft

    args = argparse.Namespace(prefix=128, suffix=16, device="cpu", repeats=1, l3_dir=tmp_path)
    result = ttft(model_compute("tiny-mla"), args, np.random.default_rng(0))
    assert result.l3_ms is not None and result.l3_ms > 0
    assert result.copy_bytes == 128 // 16 * 16 * 2 * 80 * 4
