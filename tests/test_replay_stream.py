"""Streamed replay: bounded look-ahead, nothing kept per request, a sample chosen on the fly."""

from __future__ import annotations

import json
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstrata.arrivals import ArrivalSpec
from kvstrata.benchmarks.memory import run_child
from kvstrata.engine import Engine, EngineConfig
from kvstrata.errors import ConfigError
from kvstrata.model.compute import SyntheticCompute
from kvstrata.replay import ReplayConfig, VerifySample, feed, run_replay
from kvstrata.workloads import Request, SkippedLine, Workload, agentic, builtin
from kvstrata.workloads.agentic import AgenticShape


class _Tracked(Request):
    """A request that can be weakly referenced (the slotted base cannot)."""


class LiveCounter:
    """Wraps a request stream; records the most requests alive at once."""

    def __init__(self, requests: Callable[[], Iterator[Request]]) -> None:
        self.requests = requests
        self.alive = 0
        self.most_alive = 0
        self.created = 0

    def _gone(self) -> None:
        self.alive -= 1

    def open(self, skip: Callable[[SkippedLine], None]) -> Iterator[Request]:
        for r in self.requests():
            tracked = _Tracked(r.rid, r.tokens, r.arrival_ms)
            weakref.finalize(tracked, self._gone)
            self.alive += 1
            self.created += 1
            self.most_alive = max(self.most_alive, self.alive)
            yield tracked
            del tracked, r


SMALL_AGENTIC = AgenticShape(sessions=32).scaled(0.01)


@pytest.mark.parametrize(("max_batch", "lookahead", "verify"), [(4, None, 0), (2, 5, 3)])
def test_replay_holds_only_the_lookahead_window(
    monkeypatch: pytest.MonkeyPatch, max_batch: int, lookahead: int | None, verify: int
) -> None:
    counter = LiveCounter(lambda: agentic(0, 300, 512, SMALL_AGENTIC))
    monkeypatch.setattr(feed, "load_workload", lambda *a, **k: Workload("counted", counter.open))
    cfg = ReplayConfig(
        workload="counted",
        model="none",
        kv_width=4,
        vocab_size=512,
        verify=verify,
        lookahead=lookahead,
        arrivals=ArrivalSpec("burst"),  # all at once: the window is what holds them back
        engine=EngineConfig(page_size=8, pool_tokens=4096, max_batch_requests=max_batch),
    )
    summary = run_replay(cfg, progress=False)
    window = lookahead or 2 * max_batch
    assert summary.requests == counter.created == 300
    # The window is used, and nothing else is kept: the verify sample, and the request being made.
    assert window <= counter.most_alive <= window + verify + 1
    assert summary.verify.requests == verify
    if verify:
        assert summary.verify.payload_mismatched_bytes == 0
    assert summary.config["lookahead"] == window


@pytest.mark.parametrize(
    ("config", "lookahead"),
    [
        (EngineConfig(page_size=8, pool_tokens=1024), None),  # the window (128) holds all 48
        (EngineConfig(page_size=8, pool_tokens=640, max_batch_requests=1), 1),  # one at a time
    ],
)
def test_streamed_replay_equals_adding_everything_up_front(
    config: EngineConfig, lookahead: int | None
) -> None:
    engine = Engine(SyntheticCompute(4, 512), config)
    for r in builtin(512):
        engine.add(r)
    cached = 0
    while engine.has_work():
        cached += sum(f.cached_len for f in engine.step())
    cfg = ReplayConfig(
        workload="builtin",
        model="none",
        kv_width=4,
        vocab_size=512,
        lookahead=lookahead,
        engine=config,
    )
    summary = run_replay(cfg, progress=False)
    assert summary.requests == 48 and summary.failed == 0
    assert summary.cached_tokens == cached > 0


def test_lookahead_below_the_batch_is_refused() -> None:
    with pytest.raises(ConfigError, match="--lookahead"):
        ReplayConfig(lookahead=3, engine=EngineConfig(max_batch_requests=4))


# -- the verify sample ---------------------------------------------------------------------------


def offer_all(size: int, seed: int, n: int) -> tuple[VerifySample, set[int]]:
    keep: set[int] = set()
    sample = VerifySample(size, seed, keep)
    token = np.ones(1, dtype=np.uint32)
    for rid in range(n):
        sample.offer(Request(rid, token))
    return sample, keep


def test_verify_sample_is_a_seeded_reservoir() -> None:
    sample, keep = offer_all(5, seed=1, n=100)
    assert keep == set(sample.requests) and len(keep) == 5
    assert offer_all(5, seed=1, n=100)[1] == keep  # the same on every run
    assert offer_all(5, seed=2, n=100)[1] != keep
    assert offer_all(5, seed=1, n=3)[1] == {0, 1, 2}  # fewer requests than asked: all of them
    assert offer_all(0, seed=1, n=10)[1] == set()


def test_verify_sample_is_uniform() -> None:
    n, size, runs = 20, 4, 4000
    counts: Counter[int] = Counter()
    for seed in range(runs):
        counts.update(offer_all(size, seed, n)[1])
    expected = runs * size / n  # 800 per request
    assert all(abs(counts[rid] - expected) < 0.15 * expected for rid in range(n))


# -- a long trace streams ------------------------------------------------------------------------

BLOCK = 512
SHARED_BLOCKS = 190  # every request: 190 shared blocks, then 6 of its own (100,352 tokens)


def write_long_trace(path: Path, n_requests: int) -> Path:
    with path.open("w") as f:
        for i in range(n_requests):
            own = list(range(1_000 + 6 * i, 1_000 + 6 * i + 6))
            record = {
                "timestamp": i,
                "input_length": 100_000,
                "hash_ids": [*range(SHARED_BLOCKS), *own],
            }
            f.write(json.dumps(record) + "\n")
    return path


_READ = (
    "import sys\n"
    "from kvstrata.workloads import load_workload\n"
    "print(sum(r.tokens.size for r in load_workload(sys.argv[1])))\n"
)


def test_a_trace_of_100k_token_requests_streams(tmp_path: Path) -> None:
    """800 requests of 100,000 tokens are 320 MB of token ids loaded whole (about 360 MB more
    at the issue's 4.5 bytes per token); read as a stream the peak RSS barely moves."""
    rss = {}
    for n in (100, 900):
        trace = write_long_trace(tmp_path / f"long{n}.jsonl", n)
        peak, _, out = run_child([sys.executable, "-c", _READ, str(trace)])
        assert int(out.split()[-1]) == n * 100_000
        rss[n] = peak
    print(f"peak RSS MiB by requests read: {rss}")
    assert rss[900] - rss[100] < 20, rss  # the block cache holds at most 8 MiB


@pytest.mark.slow
def test_replaying_a_trace_of_100k_token_requests_streams(tmp_path: Path) -> None:
    """The whole replay too, with a pool that holds two requests: the cache is bounded and so
    is everything else. Both sizes fill the look-ahead window (16 requests of 400 KB here; the
    default of 128 would hold 58 MB)."""
    rss = {}
    for n in (50, 300):
        trace = write_long_trace(tmp_path / f"long{n}.jsonl", n)
        argv = [sys.executable, "-m", "kvstrata.cli", "replay", "--model", "none", "--trace"]
        peak, _, out = run_child(
            [
                *argv,
                str(trace),
                "--l1-tokens",
                "204800",
                "--kv-width",
                "4",
                "--max-batch-requests",
                "8",
            ]
            + ["--json"]
        )
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["requests"] == n and summary["hit_ratio"] > 0.9
        rss[n] = peak
    print(f"peak RSS MiB by requests replayed: {rss}")
    assert rss[300] - rss[50] < 40, rss
