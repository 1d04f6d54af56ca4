"""Each engine step of a replay on its clock (``replay/steps.py``), the clock started when the
replay's loop begins (building the engine is start-up, not queueing), and the warm-up a measured
replay runs before it (``replay/warmup.py``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import trace_line, write_trace

from kvstrata.benchmarks.planner_steps import profile_seconds, summarize_steps
from kvstrata.clock import CpuClock, WallClock
from kvstrata.cost import load_profile
from kvstrata.engine import Engine, EngineConfig
from kvstrata.errors import ConfigError
from kvstrata.replay import ReplayConfig, run_replay
from kvstrata.replay import loop as replay_loop
from kvstrata.replay.build import build_compute
from kvstrata.replay.steps import STEP_KINDS, StepLog, read_steps, write_steps
from kvstrata.replay.warmup import warm_up

PROFILE = "cpu-2core-tiny-fp32"


def _trace(tmp_path: Path) -> str:
    # Two conversations of three turns 5 ms apart (each re-sends the last turn's blocks plus one), then a
    # lone request 30 s later: the engine idles between.
    lines = [trace_line(512 * (t + 1) - 100, list(range(10 * c, 10 * c + t + 1)), 5 * (2 * t + c))
             for t in range(3) for c in range(2)]  # fmt: skip
    lines.append(trace_line(700, [99, 98], 30_000))
    return str(write_trace(tmp_path / "t.jsonl", lines))


def _sim(trace: str, log: StepLog, **kwargs: object) -> dict:
    cfg = ReplayConfig(
        workload=trace,
        model="none",
        model_shape="tiny",
        dtype="float32",
        cost_profile=PROFILE,
        kv_width=4,
        vocab_size=512,
        clock="sim",
        engine=EngineConfig(
            page_size=16,
            pool_tokens=1 << 14,
            l2_tokens=1 << 15,
            chunk_size=512,
            max_batch_tokens=1024,
        ),  # fmt: skip
        **kwargs,  # type: ignore[arg-type]
    )
    return run_replay(cfg, progress=False, observers=[log]).to_json()


def test_the_sim_run_logs_every_step_at_its_charged_cost(tmp_path: Path) -> None:
    log = StepLog()
    doc = _sim(_trace(tmp_path), log)
    records = log.records
    assert len(records) == doc["steps"] and records
    assert sum(r.tokens for r in records) == doc["computed_tokens"]
    assert {r.kind for r in records} <= set(STEP_KINDS) and {"fresh", "batch"} <= {
        r.kind for r in records
    }
    profile = load_profile(PROFILE)
    end = 0.0
    for r in records:
        assert r.step == records.index(r) and r.start_s >= end - 1e-12  # in order, no overlap
        # The simulated clock charged each step what the profile says of its composition,
        # its backups counted in the modeled model's bytes (1,024 per token, not the 4 stored).
        assert r.seconds == pytest.approx(profile_seconds(profile, r), rel=1e-9)
        assert r.d2h_bytes in (0.0, r.tokens * 1024.0) or r.d2h_bytes % 1024 == 0
        # The pairs of requests over a prefix (charged at prefix_pair_s) are part of its pairs:
        # none for a fresh request's step, all of them for one request over a prefix.
        assert 0 <= r.prefix_pairs <= r.pairs
        assert r.prefix_pairs == {"fresh": 0.0, "prefix": r.pairs}.get(r.kind, r.prefix_pairs)
        end = r.end_s
    assert any(r.d2h_bytes for r in records)
    assert any(0 < r.prefix_pairs < r.pairs for r in records)  # a batch of both kinds
    # The lone request came 30 s after the rest: the clock idled to it, and the step log says so.
    lone = next(r for r in records if r.start_s >= 29.0)  # its first chunk (of 512 + 188)
    assert lone.idle_before_s == pytest.approx(30.0 - records[lone.step - 1].end_s, rel=1e-6)
    assert lone.start_s == pytest.approx(30.0) and lone.idle_before_s > 29.0
    assert sum(r.idle_before_s > 0 for r in records) == 1
    summary = summarize_steps(log, profile)
    assert summary["busy_s"] == pytest.approx(doc["clock"]["busy_s"], rel=1e-6)
    assert summary["idle_s"] == pytest.approx(doc["clock"]["seconds"] - doc["clock"]["busy_s"],
                                              rel=1e-6)  # fmt: skip
    assert summary["other_s"] == pytest.approx(0.0, abs=1e-9)  # the sim pays no loop time
    assert summary["startup_s"] == 0.0 and summary["first_step_s"] == 0.0
    kinds = summary["kinds"]
    assert sum(k["steps"] for k in kinds.values()) == len(records)
    assert all(k["ratio_of_sums"] == pytest.approx(1.0) for k in kinds.values())


def test_step_log_round_trips_and_never_overwrites(tmp_path: Path) -> None:
    log = StepLog()
    _sim(_trace(tmp_path), log)
    path = write_steps(log.records, tmp_path / "s.jsonl", lambda r: {"extra": r.step})
    assert read_steps(path) == log.records
    assert '"extra": 0' in path.read_text().splitlines()[0]
    with pytest.raises(ConfigError, match="exists already"):
        write_steps(log.records, path)
    assert read_steps(path) == log.records  # left as it was


def test_clocks_start_again_at_zero() -> None:
    wall = WallClock()
    time.sleep(0.05)
    assert wall.start() >= 0.05 and wall.now() < 0.05
    cpu = CpuClock()
    sum(i * i for i in range(200_000))  # some CPU time on this thread
    cpu.wait_until(10.0)
    assert cpu.start() >= 10.0 and cpu.now() < 1.0


def test_building_the_engine_is_not_queue_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the wall clock, a replay whose engine takes 0.6 s to build (a pinned L2 of tens of GiB
    takes seconds on CUDA) serves its first request as soon as the loop runs: its TTFT holds
    none of the build, which the summary reports as start-up. Before the clock started at the
    loop, every request arriving during the build queued behind it."""

    class SlowEngine(Engine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            time.sleep(0.6)

    monkeypatch.setattr(replay_loop, "Engine", SlowEngine)
    trace = str(write_trace(tmp_path / "t.jsonl", [trace_line(100, [1], 0)]))
    cfg = ReplayConfig(workload=trace, model="none", kv_width=4, clock="wall",
                       engine=EngineConfig(page_size=16, pool_tokens=1 << 12))  # fmt: skip
    log = StepLog()
    doc = run_replay(cfg, progress=False, observers=[log]).to_json()
    assert doc["clock"]["kind"] == "wall"
    assert doc["clock"]["startup_s"] >= 0.6
    assert log.startup_s == pytest.approx(doc["clock"]["startup_s"], abs=1e-6)
    assert doc["ttft_ms"]["mean"] < 300.0  # a 100-token request: milliseconds, not 600
    assert log.records[0].start_s < 0.3


def test_warm_up_runs_every_step_kind_on_an_engine_of_its_own(tmp_path: Path) -> None:
    cfg = ReplayConfig(model="tiny", engine=EngineConfig(chunk_size=256, max_batch_tokens=512,
                                                         l2_tokens=1 << 14))  # fmt: skip
    compute = build_compute(cfg)
    warm = warm_up(compute, cfg.engine)
    assert {"fresh", "prefix", "batch", "prefix+load"} <= warm.kinds and warm.seconds > 0
    # Without an L2 there is nothing to load back.
    assert not any(
        k.endswith("+load") for k in warm_up(compute, EngineConfig(chunk_size=256)).kinds
    )
