"""Replay on the trace's clock: arrivals, queue wait, the simulated clock, and ``--arrivals burst``
reproducing the replay that queued every request at time zero."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from helpers import trace_line, write_trace

from kvstrata.arrivals import ArrivalSpec
from kvstrata.clock import CostModel
from kvstrata.engine import Engine, EngineConfig, Finished
from kvstrata.model.compute import SyntheticCompute
from kvstrata.replay import ReplayConfig, ReplayRun, run_replay
from kvstrata.workloads import DEFAULT_VOCAB_SIZE, load_workload

COST = CostModel(tokens_per_s=100_000.0, h2d_gbps=1.0, d2h_gbps=1.0)


@dataclass
class PerRequest:
    """Observer: every served request's TTFT parts, in finish order."""

    ttft: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)

    def on_start(self, run: ReplayRun) -> None:
        pass

    def on_step(self, run: ReplayRun) -> None:
        pass

    def on_end(self, run: ReplayRun) -> None:
        self.ttft = list(run.tally.ttft_s)
        self.queue = list(run.tally.queue_s)
        self.load = list(run.tally.load_wait_s)


def replay(workload: str, observers: list[PerRequest] | None = None, **kwargs: object) -> dict:
    engine = kwargs.pop("engine", EngineConfig(page_size=16, pool_tokens=1 << 16))
    cfg = ReplayConfig(workload=workload, model="none", kv_width=4, engine=engine, **kwargs)  # type: ignore[arg-type]
    return run_replay(cfg, progress=False, observers=observers or []).to_json()


def test_a_burst_of_identical_arrivals_queues_longer_and_longer(tmp_path: Path) -> None:
    """Eight identical 4,000-token requests at the same timestamp, one running at a time: each
    waits for all before it, so the queue wait grows by about one request's compute each."""
    trace = str(write_trace(tmp_path / "t.jsonl", [trace_line(4000, list(range(8)), 5000)] * 8))
    seen = PerRequest()
    data = replay(
        trace,
        [seen],
        cost=COST,
        engine=EngineConfig(page_size=16, pool_tokens=1 << 16, max_batch_requests=1),
    )
    assert data["arrivals"] == "trace" and data["clock"]["kind"] == "sim"
    queue = np.array(seen.queue)
    assert queue[0] == 0.0
    assert (np.diff(queue) > 0).all()  # every request waits longer than the one before
    # The first computes 4,000 tokens (40 ms at 100,000 tokens/s); the others hit all but the
    # last page and wait for everything before them.
    assert seen.ttft[0] == pytest.approx(4000 / 100_000)
    assert queue[1] == pytest.approx(seen.ttft[0])
    assert data["ttft_parts_ms"]["queue"]["mean"] == pytest.approx(queue.mean() * 1e3, abs=1e-3)
    ttft = np.array(seen.ttft)
    parts = data["ttft_parts_ms"]
    assert data["ttft_ms"]["mean"] == pytest.approx(
        parts["queue"]["mean"] + parts["load_back"]["mean"] + parts["compute"]["mean"], abs=3e-3
    )
    assert (ttft >= queue).all()
    assert data["ttft_by_hit_ms"]["cached"]["requests"] == 7
    assert data["ttft_by_hit_ms"]["recomputed"]["requests"] == 1


def test_trace_arrivals_leave_idle_time_out_of_ttft(tmp_path: Path) -> None:
    """Requests 10 s apart on a fast engine: each finds it idle, waits in no queue, and the clock
    ends at the last arrival plus its compute."""
    rows = [
        trace_line(1600, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], i * 10_000) for i in range(3)
    ]
    trace = str(write_trace(tmp_path / "t.jsonl", rows))
    seen = PerRequest()
    data = replay(trace, [seen], cost=COST)
    assert seen.queue == [0.0, 0.0, 0.0]
    assert seen.ttft == pytest.approx([1600 / 100_000] * 3)
    assert data["clock"]["seconds"] == pytest.approx(20 + 1600 / 100_000)
    squeezed = replay(trace, cost=COST, arrivals=ArrivalSpec("trace", time_scale=0.1))
    assert squeezed["clock"]["seconds"] == pytest.approx(2 + 1600 / 100_000)


def test_simulated_replays_are_identical_run_to_run() -> None:
    """Everything but the wall-clock fields repeats exactly (poisson arrivals, an L2 tier)."""
    engine = EngineConfig(page_size=16, pool_tokens=1 << 15, l2_tokens=1 << 17)
    runs = [
        replay("synthetic:3:150", engine=engine, arrivals=ArrivalSpec("poisson", rate=40.0))
        for _ in range(2)
    ]
    for run in runs:
        for wall in ("seconds", "cpu_seconds", "prefill_tokens_per_s"):
            run.pop(wall)
        run["tiers"].pop("load_back_wait_ms")  # measured on the host
        run["tree"].pop("bytes")  # object sizes of the interpreter
    assert runs[0] == runs[1]
    assert runs[0]["ttft_ms"]["p99"] > 0
    assert runs[0]["hit_tokens_by_tier"]["l2"] > 0


def old_replay(workload: str, engine_cfg: EngineConfig, lookahead: int) -> tuple[list[int], int]:
    """The replay before arrivals, written out: fill the look-ahead window, step, repeat.
    Returns each request's cached tokens (by request id) and the engine steps."""
    engine = Engine(SyntheticCompute(4, DEFAULT_VOCAB_SIZE), engine_cfg)
    requests = iter(load_workload(workload))
    cached: dict[int, int] = {}
    read, finished = 0, 0
    exhausted = False
    while True:
        while not exhausted and read - finished < lookahead:
            request = next(requests, None)
            if request is None:
                exhausted = True
                break
            engine.add(request)
            read += 1
        if not engine.has_work():
            break
        done: list[Finished] = engine.step()
        finished += len(done)
        cached.update((f.rid, f.cached_len) for f in done)
    return [cached[rid] for rid in sorted(cached)], engine.steps


@pytest.mark.parametrize("workload", ["builtin", "agentic:1:150"])
def test_burst_arrivals_reproduce_the_replay_without_arrivals(workload: str) -> None:
    engine = EngineConfig(page_size=16, pool_tokens=8192, max_batch_requests=4)
    cached, steps = old_replay(workload, engine, lookahead=8)
    data = replay(workload, engine=engine, arrivals=ArrivalSpec("burst"), lookahead=8)
    assert data["arrivals"] == "burst"
    assert data["steps"] == steps
    assert data["cached_tokens"] == sum(cached)
    assert data["requests"] == len(cached)


def test_builtin_default_numbers_are_unchanged() -> None:
    """``kvstrata replay --model none`` on the built-in workload, as main printed it before
    arrivals (commit 28b60c7): the default there is burst, and the cache does the same work."""
    data = replay("builtin", engine=EngineConfig())
    assert (data["arrivals"], data["steps"]) == ("burst", 7)
    assert (data["prompt_tokens"], data["cached_tokens"], data["computed_tokens"]) == (
        12_515,
        9_104,
        3_411,
    )


@pytest.mark.slow
def test_bench_replay_measures_the_scrapes_cpu_directly(capsys: pytest.CaptureFixture[str]) -> None:
    """The metrics cost comes from the scraping threads' own CPU time (collector, exposition and
    HTTP client), not only from the difference of two noisy process totals."""
    from kvstrata.benchmarks.replay import run_main

    args = ["--trace", "synthetic:0:2000", "--repeats", "1", "--scrape-interval", "0.02"]
    assert run_main(args) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["best_on"]["scrapes"] > 0 and doc["best_on"]["scrape_cpu_s"] > 0
    assert 0 < doc["metrics_scrape_cpu_share"] < 0.5
