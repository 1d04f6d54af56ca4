"""The disk tier (L3) in the engine: committed host pages spill, misses reload, verified bytes
only, and a second process started with ``load`` hits from disk on its first request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from disk_rig import engine_counts
from helpers import run_all

from kvstrata.engine import Engine, EngineConfig
from kvstrata.errors import ConfigError
from kvstrata.model.compute import ModelCompute, SyntheticCompute, synthetic_payload
from kvstrata.model.loader import load_model
from kvstrata.replay import recompute_uncached
from kvstrata.residency import Tier
from kvstrata.workloads import Request, builtin


def config(tmp: Path, start: str = "clear", **kw: object) -> EngineConfig:
    base = {
        "page_size": 16,
        "pool_tokens": 640,
        "chunk_size": 64,
        "max_batch_tokens": 128,
        "max_batch_requests": 4,
        "l2_tokens": 640,
        "l3_dir": str(tmp / "l3"),
        "l3_gib": 0.05,
        "l3_start": start,
        **kw,
    }
    return EngineConfig(**base)  # type: ignore[arg-type]


def test_small_l1_and_l2_hit_from_disk_with_exact_bytes(tmp_path: Path) -> None:
    requests = builtin(1000, seed=11, n_requests=80)
    engine = Engine(SyntheticCompute(8, 1000), config(tmp_path), model_id="none:8")
    engine.keep_logits = {r.rid for r in requests}
    try:
        out = run_all(engine, requests, check=True)
    finally:
        engine.close()
    assert engine.hit_tokens[Tier.L3] > 0
    assert engine.cache.disk is not None and engine.cache.disk.stats.spilled_pages > 0
    for r in requests:
        f = out[r.rid]
        assert f.error is None
        expected = synthetic_payload(torch.from_numpy(r.tokens.astype(np.int64)), 8)
        assert f.payload is not None and torch.equal(f.payload, expected), r.rid


def test_a_second_process_with_load_hits_from_disk_at_once(tmp_path: Path) -> None:
    prompt = np.arange(1, 401, dtype=np.uint32)
    first = Engine(SyntheticCompute(8, 1000), config(tmp_path), model_id="none:8")
    try:
        run_all(first, [Request(0, prompt)], check=True)
    finally:
        first.close()
    second = Engine(SyntheticCompute(8, 1000), config(tmp_path, "load"), model_id="none:8")
    second.keep_logits = {1}
    try:
        out = run_all(
            second, [Request(1, np.concatenate([prompt, [7, 8, 9]]).astype(np.uint32))], check=True
        )
    finally:
        second.close()
    assert out[1].cached_len == 400 and second.hit_tokens[Tier.L3] == 400
    expected = synthetic_payload(torch.from_numpy(np.concatenate([prompt, [7, 8, 9]])), 8)
    assert torch.equal(out[1].payload, expected)


def test_model_logits_after_a_disk_round_trip_equal_uncached(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _, model = load_model("tiny", device="cpu", dtype="float32", seed=0)
    compute = ModelCompute(model, torch.float32)
    cfg = config(tmp_path, pool_tokens=640, l2_tokens=640)
    engine = Engine(compute, cfg, model_id="tiny")
    requests = builtin(compute.vocab_size, seed=12, n_requests=50)
    engine.keep_logits = {r.rid for r in requests}
    try:
        out = run_all(engine, requests, check=True)
    finally:
        engine.close()
    assert engine.hit_tokens[Tier.L3] > 0
    for r in requests[-15:]:
        fresh = recompute_uncached(compute, cfg, r)
        got = out[r.rid].logits
        assert got is not None and float((fresh - got).abs().max()) <= 1e-5, r.rid


def test_disk_tier_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="L2"):
        EngineConfig(l3_dir=str(tmp_path), l3_gib=1.0)
    for policy in ("write_back", "write_through_selective"):
        with pytest.raises(ConfigError, match=f"--write-policy {policy} nothing would reach"):
            EngineConfig(l2_tokens=1024, l3_dir=str(tmp_path), l3_gib=1.0, write_policy=policy)
    with pytest.raises(ConfigError, match="l3-gib"):
        EngineConfig(l2_tokens=1024, l3_dir=str(tmp_path), l3_gib=0.0)
    with pytest.raises(ConfigError, match="l3-start"):
        EngineConfig(l2_tokens=1024, l3_dir=str(tmp_path), l3_gib=1.0, l3_start="warm")


def test_requests_missing_the_same_pages_share_one_reload(tmp_path: Path) -> None:
    """Four requests arrive together after a restart, all missing the same 400-token prefix: the
    disk is read once (the others wait for that read), and the tokens it brought count as L3 hits
    once; the other three hit what the first loaded back."""
    prompt = np.arange(1, 401, dtype=np.uint32)
    first = Engine(SyntheticCompute(8, 1000), config(tmp_path), model_id="none:8")
    try:
        run_all(first, [Request(0, prompt)], check=True)
    finally:
        first.close()
    second = Engine(SyntheticCompute(8, 1000), config(tmp_path, "load"), model_id="none:8")
    requests = [
        Request(i, np.concatenate([prompt, [7 + i, 8, 9]]).astype(np.uint32)) for i in range(1, 5)
    ]
    second.keep_logits = {r.rid for r in requests}
    try:
        out = run_all(second, requests, check=True)
    finally:
        second.close()
    assert second.cache.disk is not None
    assert second.cache.disk.stats.reloads == 1 and second.cache.disk.stats.reloaded_pages == 25
    assert second.hit_tokens[Tier.L3] == 400
    assert all(out[r.rid].cached_len == 400 for r in requests)
    for r in requests:
        expected = synthetic_payload(torch.from_numpy(r.tokens.astype(np.int64)), 8)
        assert torch.equal(out[r.rid].payload, expected), r.rid


def _l3_counts(tmp: Path, requests: list[Request]) -> dict[str, object]:
    """One cache-only run with a small L1/L2 and a disk tier small enough to collect garbage."""
    cfg = config(tmp, pool_tokens=320, l2_tokens=320, l3_gib=0.0005)
    engine = Engine(SyntheticCompute(8, 1000), cfg, model_id="none:8")
    try:
        engine.run(requests)
    finally:
        engine.close()
    return engine_counts(engine)


def test_the_same_l3_replay_twice_gives_identical_counts(tmp_path: Path) -> None:
    """What spills and what reloads is decided from replicated inputs, and the engine waits for
    the disk at a fixed point instead of refusing work: hit tokens per tier, pages spilled and
    reloaded, GC and the tree come out the same on every run."""
    requests = builtin(1000, seed=3, n_requests=120)
    first = _l3_counts(tmp_path / "a", requests)
    second = _l3_counts(tmp_path / "b", requests)
    assert first == second
    assert first["hit_tokens"][Tier.L3] > 0  # type: ignore[index]
    assert first["store"][2] > 0 and first["store"][3] == 0  # type: ignore[index]  # GC ran; no refusal
