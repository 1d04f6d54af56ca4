"""``kvstrata bench workload`` and ``kvstrata bench memory``: the statistics are the cache's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from lru_sim import LRUSim, engine_hits, random_workload

from kvstrata.benchmarks import memory
from kvstrata.benchmarks.workload import describe
from kvstrata.cli import main
from kvstrata.workloads import Request, agentic, builtin
from kvstrata.workloads.agentic import AgenticShape

P = 4


def workloads() -> dict[str, list[Request]]:
    return {
        "builtin": builtin(512),
        "agentic": list(agentic(0, 300, 512, AgenticShape(sessions=16).scaled(0.01))),
        "random": [Request(i, t) for i, t in enumerate(random_workload(3, 300, P))],
    }


@pytest.mark.parametrize("name", ["builtin", "agentic", "random"])
def test_ideal_hits_and_unique_tokens_are_an_unbounded_cache(name: str) -> None:
    requests = workloads()[name]
    stats = describe(requests, page_size=P)
    unbounded = sum(-(-r.tokens.size // P) for r in requests)
    hits = engine_hits(requests, P, unbounded, vocab=512)
    assert stats.ideal_hit_tokens == sum(h for h in hits if h is not None) > 0
    sim = LRUSim(P, unbounded)
    for r in requests:
        sim.run(r.tokens)
    assert stats.unique_tokens == sum(len(page.key) // 4 for page in sim.index.values())
    lengths = np.array([r.tokens.size for r in requests])
    assert stats.requests == len(requests) and stats.prompt_tokens == lengths.sum()
    assert stats.p99_tokens == np.percentile(lengths, 99) and stats.max_tokens == lengths.max()


def test_bench_workload_prints_a_table_then_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "workload", "--trace", "builtin", "--trace", "agentic:0:20"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    data = json.loads(lines[-1])
    assert data["bench"] == "workload" and [r["requests"] for r in data["results"]] == [48, 20]
    assert lines[0].startswith("workload")


@pytest.mark.slow
def test_bench_memory_reports_both_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert memory.main(["--sizes", "10", "30", "--l1-tokens", "400000"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["bench"] == "memory"
    runs = data["runs"]
    assert [(r["mode"], r["requests"]) for r in runs] == [
        ("stream", 10),
        ("replay", 10),
        ("stream", 30),
        ("replay", 30),
    ]
    assert all(r["peak_rss_mib"] > 10 for r in runs)
    assert all(0 < r["hit_ratio"] < 1 for r in runs if r["mode"] == "replay")
