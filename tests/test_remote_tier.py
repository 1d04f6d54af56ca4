"""The shared tier in the engine (``--remote``, in L3's place behind L2): a second instance serves
the first one's prefixes as remote hits with exact bytes and logits, through one Redis server or
a 3-node cluster; a dead store is counted misses, never a hang; configuration errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from redis_rig import RedisServer, free_port

from kvstrata.engine import Engine, EngineConfig, Finished
from kvstrata.errors import ConfigError
from kvstrata.model.compute import ModelCompute, SyntheticCompute, synthetic_payload
from kvstrata.model.loader import load_model
from kvstrata.replay import recompute_uncached
from kvstrata.residency import Tier
from kvstrata.workloads import Request, builtin


def run_all(engine: Engine, requests: list[Request]) -> dict[int, Finished]:
    for r in requests:
        engine.add(r)
    out: dict[int, Finished] = {}
    for _ in range(100_000):
        if not engine.has_work():
            break
        for f in engine.step():
            out[f.rid] = f
        engine.check()
    assert not engine.has_work()
    engine.drain()
    engine.check()
    return out


def config(url: str, **kw: object) -> EngineConfig:
    base = {
        "page_size": 16,
        "pool_tokens": 640,
        "chunk_size": 64,
        "max_batch_tokens": 128,
        "max_batch_requests": 4,
        "l2_tokens": 640,
        "remote_url": url,
        "remote_gib": 0.05,
        "remote_timeout_ms": 300.0,
        **kw,
    }
    return EngineConfig(**base)  # type: ignore[arg-type]


def test_a_second_instance_hits_the_first_ones_prefix(store_url: str) -> None:
    prompt = np.arange(1, 401, dtype=np.uint32)
    first = Engine(SyntheticCompute(8, 1000), config(store_url), model_id="none:8")
    try:
        run_all(first, [Request(0, prompt)])
    finally:
        first.close()
    assert first.cache.remote is not None and first.cache.remote.stats().pages_written == 25
    second = Engine(SyntheticCompute(8, 1000), config(store_url), model_id="none:8")
    second.keep_logits = {1}
    longer = np.concatenate([prompt, [7, 8, 9]]).astype(np.uint32)
    try:
        out = run_all(second, [Request(1, longer)])
    finally:
        second.close()
    assert out[1].cached_len == 400 and second.hit_tokens[Tier.L3] == 400
    assert torch.equal(out[1].payload, synthetic_payload(torch.from_numpy(longer), 8))
    assert second.cache.remote is not None
    stats = second.cache.remote.stats()
    assert stats.hits == 25 and stats.misses == 0 and stats.verify_failures == 0
    # Another model (namespace) on the same store sees nothing.
    other = Engine(SyntheticCompute(8, 1000), config(store_url), model_id="none:9")
    try:
        out = run_all(other, [Request(2, longer)])
    finally:
        other.close()
    assert out[2].cached_len == 0 and other.hit_tokens[Tier.L3] == 0


def test_model_logits_served_from_another_instance_equal_uncached(
    redis_server: RedisServer,
) -> None:
    torch.manual_seed(0)
    _, model = load_model("tiny", device="cpu", dtype="float32", seed=0)
    compute = ModelCompute(model, torch.float32)
    cfg = config(redis_server.url)
    requests = builtin(compute.vocab_size, seed=12, n_requests=30)
    first = Engine(compute, cfg, model_id="tiny")
    try:
        run_all(first, requests)
    finally:
        first.close()
    second = Engine(compute, cfg, model_id="tiny")
    second.keep_logits = {r.rid for r in requests}
    try:
        out = run_all(second, requests)
    finally:
        second.close()
    assert second.hit_tokens[Tier.L3] > 0
    for r in requests[-10:]:
        fresh = recompute_uncached(compute, cfg, r)
        got = out[r.rid].logits
        assert got is not None and float((fresh - got).abs().max()) <= 1e-5, r.rid


def _replay(url: str, *extra: str) -> tuple[int, dict, float]:
    argv = [sys.executable, "-m", "kvstrata", "replay", "--model", "none"]
    argv += ["--trace", "synthetic:0:40", "--l1-tokens", "8192", "--l2-tokens", "8192"]
    argv += ["--remote", url, "--remote-gib", "1", "--remote-timeout-ms", "300", "--json"]
    t0 = time.monotonic()
    out = subprocess.run(
        [*argv, *extra], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1]), time.monotonic() - t0


@pytest.mark.slow
def test_two_processes_share_one_store_with_verified_bytes(redis_server: RedisServer) -> None:
    rc1, first, _ = _replay(redis_server.url, "--verify", "10")
    rc2, second, _ = _replay(
        redis_server.url, "--verify", "10", "--remote-connections", "1",
        "--remote-publish-window", "2",
    )  # fmt: skip
    assert rc1 == rc2 == 0
    assert first["verify"]["ok"] and second["verify"]["ok"]
    assert second["verify"]["payload_mismatched_bytes"] == 0
    r1, r2 = first["tiers"]["remote"], second["tiers"]["remote"]
    assert r1["pages_written"] > 0 and r2["hits"] > r1["hits"]
    assert second["hit_tokens_by_tier"]["l3"] > first["hit_tokens_by_tier"]["l3"]
    assert second["hit_ratio"] > first["hit_ratio"]
    assert second["config"]["remote"] == redis_server.url
    assert (
        first["config"]["remote_connections"] == 3 and second["config"]["remote_connections"] == 1
    )
    assert first["config"]["remote_publish_window"] == 1
    assert second["config"]["remote_publish_window"] == 2


@pytest.mark.slow
def test_a_dead_store_is_counted_misses_never_a_hang(tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    rc, doc, _ = _replay(dead, "--verify", "5")
    assert rc == 0 and doc["verify"]["ok"] and doc["failed"] == 0
    remote = doc["tiers"]["remote"]
    assert remote["breaker_opens"] >= 1 and remote["connection_errors"] >= 1
    assert remote["hits"] == 0 and remote["pages_written"] == 0
    assert doc["hit_tokens_by_tier"]["l3"] == 0


def test_remote_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="L2"):
        EngineConfig(remote_url="redis://h:1", remote_gib=1.0)
    # both at once: the shared store behind the disk (tests/test_remote_behind_disk.py)
    both = EngineConfig(
        l2_tokens=1024, remote_url="redis://h:1", remote_gib=1.0, l3_dir=str(tmp_path), l3_gib=1.0
    )
    assert both.l3_dirs == (str(tmp_path),) and both.remote_url == "redis://h:1"
    with pytest.raises(ConfigError, match="remote-gib"):
        EngineConfig(l2_tokens=1024, remote_url="redis://h:1", remote_gib=0.0)
    with pytest.raises(ConfigError, match="must look like"):
        EngineConfig(l2_tokens=1024, remote_url="h:1", remote_gib=1.0)
    for n in (0, 65):
        with pytest.raises(ConfigError, match="remote-connections"):
            EngineConfig(
                l2_tokens=1024, remote_url="redis://h:1", remote_gib=1.0, remote_connections=n
            )
    for n in (0, 9):
        with pytest.raises(ConfigError, match="remote-publish-window"):
            EngineConfig(
                l2_tokens=1024, remote_url="redis://h:1", remote_gib=1.0, remote_publish_window=n
            )
    with pytest.raises(ConfigError, match="nothing would reach"):
        EngineConfig(
            l2_tokens=1024, remote_url="redis://h:1", remote_gib=1.0, write_policy="write_back"
        )


def test_the_shared_tier_joins_the_metrics(redis_server: RedisServer) -> None:
    from test_metrics import Scraper, value

    from kvstrata.replay import ReplayConfig, run_replay

    scraper = Scraper(at_step=-1)
    cfg = ReplayConfig(
        workload="builtin",
        model="none",
        kv_width=8,
        vocab_size=1000,
        engine=config(redis_server.url),
        metrics_port=0,
    )
    summary = run_replay(cfg, progress=False, observers=[scraper])
    end = scraper.end
    assert value(end, "kvstrata_pages_total", tier="remote", lane="0") > 0
    assert value(end, "kvstrata_remote_total", event="spilled_pages") > 0
    hits = value(end, "kvstrata_remote_store_total", counter="hits")
    assert hits == summary.tiers.remote["hits"] > 0
    assert value(end, "kvstrata_hit_tokens_total", tier="l3") == value(
        end, "kvstrata_remote_total", event="hit_tokens"
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_cp2_instances_share_one_store_with_digests_checked(redis_server: RedisServer) -> None:
    """Two instances of two CP ranks each: each rank publishes and fetches only its own pages,
    the ranks agree on what to read through the frontier (digests compared every step), and the
    second instance's remote hits carry the right bytes."""
    extra = ["--cp", "2", "--check-digests", "--verify", "5", "--trace", "synthetic:0:30"]
    rc1, first, _ = _replay(redis_server.url, *extra)
    rc2, second, _ = _replay(redis_server.url, *extra)
    assert rc1 == rc2 == 0 and first["failed"] == second["failed"] == 0
    assert second["verify"]["ok"] and second["verify"]["payload_mismatched_bytes"] == 0
    assert second["hit_tokens_by_tier"]["l3"] > first["hit_tokens_by_tier"]["l3"]
    assert second["tiers"]["remote"]["hits"] > 0


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_a_store_that_dies_or_stops_mid_replay_changes_no_byte(
    redis_server: RedisServer, fault: str
) -> None:
    """The store is killed (then restarted empty) or paused past the timeout between two halves
    of a replay: every request still finishes with the bytes it would have uncached, the faults
    are counted, and the breaker keeps the paused store from costing a timeout per request."""
    requests = builtin(1000, seed=13, n_requests=60)
    engine = Engine(SyntheticCompute(8, 1000), config(redis_server.url), model_id="none:8")
    engine.keep_logits = {r.rid for r in requests}
    try:
        out = run_all(engine, requests[:30])
        t0 = time.monotonic()
        if fault == "kill":
            redis_server.kill()
            out |= run_all(engine, requests[30:45])
            redis_server.start()
            time.sleep(0.6)  # past the breaker's interval: the next call probes and succeeds
            out |= run_all(engine, requests[45:])
        else:
            with redis_server.paused():
                out |= run_all(engine, requests[30:])
        elapsed = time.monotonic() - t0
    finally:
        redis_server.resume()
        engine.close()
    for r in requests:
        expected = synthetic_payload(torch.from_numpy(r.tokens.astype(np.int64)), 8)
        assert out[r.rid].error is None and torch.equal(out[r.rid].payload, expected), r.rid
    assert engine.cache.remote is not None
    stats = engine.cache.remote.stats()
    assert stats.breaker_opens >= 1 and stats.verify_failures == 0
    if fault == "pause":
        assert stats.timeouts >= 1
        # one timeout per breaker interval (5 s), not one per request or per page
        assert elapsed < 10 * 0.3 + 15, elapsed
    else:
        assert stats.connection_errors >= 1


def _mismatched_remote(group: object) -> None:
    from kvstrata.replay import ReplayConfig, _agree_on_config

    engine = config(
        "redis://:Ur1-s3cr3t@h:1",
        remote_gib=1.0 + group.rank,  # type: ignore[attr-defined]
        remote_password="Zx9-s3cr3t",
    )
    _agree_on_config(group, ReplayConfig(model="none", engine=engine))  # type: ignore[arg-type]


@pytest.mark.multiproc
def test_a_configuration_mismatch_never_prints_the_password() -> None:
    from kvstrata.dist.launch import run_ranks
    from kvstrata.errors import CollectiveError

    with pytest.raises(CollectiveError, match="remote_gib") as err:
        run_ranks(2, _mismatched_remote, (), timeout_s=120)
    assert "Zx9-s3cr3t" not in str(err.value) and "Ur1-s3cr3t" not in str(err.value)
    assert "Ur1-s3cr3t" not in repr(config("redis://:Ur1-s3cr3t@h:1", remote_password="Zx9"))
