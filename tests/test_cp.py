"""Context parallelism over real processes (gloo on CPU): results equal one rank's, replicated
state agrees on every rank after every step, and a dead rank is named instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstrata.dist.group import Group, SoloGroup
from kvstrata.dist.launch import run_ranks
from kvstrata.engine import Engine, EngineConfig, Finished
from kvstrata.errors import CollectiveError
from kvstrata.model.compute import ModelCompute, SyntheticCompute
from kvstrata.model.loader import load_model
from kvstrata.residency import Tier
from kvstrata.workloads import Request, builtin

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 120


def _compute(kind: str) -> ModelCompute | SyntheticCompute:
    if kind == "none":
        return SyntheticCompute(8, 1000)
    torch.manual_seed(0)
    _, model = load_model("tiny", device="cpu", dtype="float32", seed=0)
    return ModelCompute(model, torch.float32)


def _requests(kind: str, n: int) -> list[Request]:
    vocab = 1000 if kind == "none" else _compute(kind).vocab_size
    return builtin(vocab, seed=7, n_requests=n)


def replay(group: Group, kind: str, n: int, config: dict[str, Any]) -> dict[str, Any]:
    """Run ``n`` built-in requests on this rank; what every rank must agree on, plus outputs."""
    torch.set_num_threads(1)
    engine = Engine(_compute(kind), EngineConfig(**config), group=group)
    requests = _requests(kind, n)
    engine.keep_logits = {r.rid for r in requests}
    for r in requests:
        engine.add(r)
    out: dict[int, Finished] = {}
    while engine.has_work():
        for f in engine.step():
            out[f.rid] = f
        engine.check()
    engine.drain()
    engine.check()
    return {
        "logits": {rid: f.logits for rid, f in out.items()},
        "payload": {rid: f.payload for rid, f in out.items()},
        "cached": {rid: f.cached_len for rid, f in out.items()},
        "errors": [f.error for f in out.values() if f.error],
        "digest": (engine.cache.allocator.digest(), engine.cache.tree.digest()),
        "l2_hits": engine.hit_tokens[Tier.L2],
        "pages_used": engine.cache.allocator.num_used,
        "strategies": engine.strategy_steps,
        "traffic": dict(engine.group.traffic.bytes),
    }


BASE = {
    "page_size": 16,
    "pool_tokens": 1024,
    "chunk_size": 64,
    "max_batch_tokens": 256,
    "l2_tokens": 8192,
    "check_digests": True,
}


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("strategy", ["move_kv", "move_queries"])
def test_cp_model_logits_equal_one_rank(cp: int, strategy: str) -> None:
    """Tiny pools (per rank: the single rank's divided by cp) so that L1 and L2 both serve hits;
    fp32 logits within 1e-5 (move KV) / 1e-4 (move queries), argmax identical."""
    config = {**BASE, "cp_attention": strategy}
    solo = replay(SoloGroup(), "tiny", 60, {**config, "check_digests": False})
    per_rank = {**config, "pool_tokens": 1024 // cp, "l2_tokens": 8192 // cp}
    t0 = time.monotonic()
    ranks = run_ranks(cp, replay, ("tiny", 60, per_rank), timeout_s=TIMEOUT_S)
    assert time.monotonic() - t0 < TIMEOUT_S
    tol = 1e-5 if strategy == "move_kv" else 1e-4
    for res in ranks:
        assert res["errors"] == [] and res["digest"] == ranks[0]["digest"]
        assert res["cached"] == solo["cached"]
        for rid, want in solo["logits"].items():
            got = torch.from_numpy(res["logits"][rid])
            assert float((got - want).abs().max()) <= tol, rid
            assert int(got.argmax()) == int(want.argmax())
    assert ranks[0]["l2_hits"] > 0
    assert ranks[0]["strategies"] == {strategy: ranks[0]["strategies"][strategy]}


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_synthetic_payload_bytes_equal_one_rank(cp: int) -> None:
    config = {**BASE, "cp_attention": "auto"}
    solo = replay(SoloGroup(), "none", 80, {**config, "check_digests": False})
    per_rank = {**config, "pool_tokens": 1024 // cp, "l2_tokens": 8192 // cp}
    ranks = run_ranks(cp, replay, ("none", 80, per_rank), timeout_s=TIMEOUT_S)
    for res in ranks:
        assert res["digest"] == ranks[0]["digest"] and res["errors"] == []
        assert res["cached"] == solo["cached"]
        for rid, want in solo["payload"].items():
            assert torch.equal(torch.from_numpy(res["payload"][rid]), want), rid
    # Every page is stored once: a rank holds 1/cp of the single rank's pages (one per lane).
    assert abs(ranks[0]["pages_used"] - solo["pages_used"]) <= cp


def _die(group: Group, rank: int) -> None:
    if group.rank == rank:
        raise SystemExit(9)
    t = torch.zeros(1)
    group.all_reduce(t, "sum", "test")  # the dead rank never joins


def test_a_dead_rank_is_named_not_waited_for() -> None:
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="rank 1"):
        run_ranks(2, _die, (1,), timeout_s=20)
    assert time.monotonic() - t0 < 60


def test_frontier_takes_the_min_over_ranks() -> None:
    ranks = run_ranks(3, _frontier_probe, (), timeout_s=TIMEOUT_S)
    assert all(r == (4, [3]) for r in ranks)


def _frontier_probe(group: Group) -> tuple[int, list[int]]:
    from kvstrata.dist.frontier import group_frontier
    from kvstrata.tiers.tickets import Progress

    done = [4, 6, 5][group.rank]
    failed = frozenset({3} if group.rank == 1 else set())
    out = group_frontier(group)(Progress(done, failed, 0, 6))
    return out.done_upto, sorted(out.failed)


def delayed_replay(group: Group, seed: int) -> dict[str, Any]:
    """A replay whose copy completions reach the ledger late, by a random per-rank number of
    steps: the frontier (MIN over ranks) must keep every decision identical."""
    torch.set_num_threads(1)
    config = {**BASE, "pool_tokens": 512, "l2_tokens": 4096, "cp_attention": "auto"}
    engine = Engine(_compute("none"), EngineConfig(**config), group=group)
    rng = np.random.default_rng(seed * 100 + group.rank)
    held: list[tuple[int, Any]] = []  # (drains to wait, completion)

    def late(landed: list[Any]) -> list[Any]:
        held.extend((int(rng.integers(0, 4)), c) for c in landed)
        ready = [c for wait, c in held if wait == 0]
        held[:] = [(wait - 1, c) for wait, c in held if wait > 0]
        return ready

    engine.cache.report_delay = late
    requests = _requests("none", 60)
    for r in requests:
        engine.add(r)
    digests = []
    while engine.has_work():
        engine.step()
        digests.append((engine.cache.allocator.digest(), engine.cache.tree.digest()))
    for _ in range(10):  # the held completions come in over a few more settles
        engine.drain()
    return {"digests": digests, "l2": engine.hit_tokens[Tier.L2], "left": len(held)}


@pytest.mark.parametrize("seed", [1, 2])
def test_random_per_rank_copy_delays_change_nothing(seed: int) -> None:
    ranks = run_ranks(2, delayed_replay, (seed,), timeout_s=TIMEOUT_S)
    assert ranks[0]["digests"] == ranks[1]["digests"]
    assert ranks[0]["l2"] == ranks[1]["l2"] > 0
    assert ranks[0]["left"] == ranks[1]["left"] == 0


def _mismatched(group: Group) -> None:
    from kvstrata.replay import ReplayConfig, _agree_on_config

    _agree_on_config(group, ReplayConfig(model="none", seed=group.rank))


def test_mismatched_configurations_are_refused_naming_the_field() -> None:
    with pytest.raises(CollectiveError, match="seed"):
        run_ranks(2, _mismatched, (), timeout_s=TIMEOUT_S)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    ranks = []
    for child in sorted(out):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                ranks.append(child)
    return ranks


@pytest.mark.slow
def test_killing_one_rank_mid_replay_names_it() -> None:
    cmd = [sys.executable, "-m", "kvstrata", "replay", "--cp", "2", "--model", "none",
           "--trace", "synthetic:0:3000", "--l1-tokens", "65536", "--no-progress",
           "--cp-timeout", "20"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    ranks: list[int] = []
    while len(ranks) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        ranks = _children(proc.pid)
    assert len(ranks) == 2, "the two rank processes did not start"
    time.sleep(4)  # well into the replay
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode not in (0, None)
    assert "rank 1" in err and "died" in err, err


@pytest.mark.slow
def test_replay_with_cp2_and_the_disk_tier_runs_to_the_end(tmp_path: Path) -> None:
    """The whole replay path at cp 2 (no decode, no report): digests checked every step, the
    disk tier on every rank, payload bytes verified, and `disk check` clean afterwards."""
    from kvstrata.replay import ReplayConfig, run_replay
    from kvstrata.tiers.disk_audit import audit_directory

    engine = EngineConfig(
        page_size=16,
        pool_tokens=4096,
        l2_tokens=8192,
        l3_dir=str(tmp_path / "l3"),
        l3_gib=0.05,
        check_digests=True,
    )
    cfg = ReplayConfig(model="none", workload="synthetic:0:120", engine=engine, verify=10, cp=2)
    summary = run_replay(cfg, progress=False)
    assert summary.requests == 120 and summary.failed == 0
    assert summary.verify.ok and summary.verify.payload_mismatched_bytes == 0
    assert summary.to_json()["hit_tokens_by_tier"]["l3"] > 0
    assert audit_directory(tmp_path / "l3").clean


def _failing_loads(group: Group) -> None:
    """Rank 1's host -> device copies fail: it stops, naming itself, instead of rolling the
    load-back back on its own (which would fork the replicated tree)."""
    torch.set_num_threads(1)
    config = EngineConfig(**{**BASE, "pool_tokens": 320, "check_digests": True})
    engine = Engine(_compute("none"), config, group=group)
    transfer = engine.cache.transfer
    assert transfer is not None
    real_copy = transfer.copier.copy

    def copy(direction: str, *args: Any) -> None:
        if group.rank == 1 and direction == "h2d":
            raise RuntimeError("injected h2d failure")
        real_copy(direction, *args)  # type: ignore[arg-type]

    transfer.copier.copy = copy  # type: ignore[method-assign]
    engine.run(_requests("none", 80))


@pytest.mark.slow
def test_a_load_back_failure_on_one_rank_stops_the_run_naming_it() -> None:
    with pytest.raises(CollectiveError, match=r"rank 1.*load-back ticket \d+ failed"):
        run_ranks(2, _failing_loads, (), timeout_s=60)
