"""Tests for kvstrata.workloads.agentic: the shape of the generated sessions, determinism and laziness."""

from __future__ import annotations

import hashlib
import inspect
import itertools
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from kvstrata.benchmarks.workload import describe
from kvstrata.errors import ConfigError, WorkloadError
from kvstrata.workloads import Request, agentic
from kvstrata.workloads.agentic import (
    DEFAULT_REQUESTS,
    AgenticRequest,
    AgenticShape,
    generate,
    parse_spec,
)

SHAPE = AgenticShape()


def digest(requests: list[AgenticRequest]) -> str:
    h = hashlib.sha256()
    for r in requests:
        h.update(np.array([r.tokens.size, r.arrival_ms, r.session, r.parent], np.int64).tobytes())
        h.update(r.tokens.astype("<u4").tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def head() -> list[AgenticRequest]:
    """The first 3,000 requests of seed 0 with the default shape (about 140 M tokens)."""
    return list(generate(0, 3000, 128_256))


def test_deterministic_across_processes() -> None:
    first = digest(list(generate(5, 300, 1000)))
    assert digest(list(generate(5, 300, 1000))) == first
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from test_agentic import digest; "
        "from kvstrata.workloads.agentic import generate; print(digest(list(generate(5, 300, 1000))))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "999"}
    out = subprocess.run(
        [sys.executable, "-c", script, os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert out.stdout.strip() == first
    assert digest(list(generate(6, 300, 1000))) != first


def test_structure_does_not_depend_on_the_vocabulary() -> None:
    small = list(generate(1, 400, 97))
    large = list(generate(1, 400, 2**32))
    assert [(r.tokens.size, r.arrival_ms, r.session) for r in small] == [
        (r.tokens.size, r.arrival_ms, r.session) for r in large
    ]
    for s, big in zip(small, large, strict=True):
        assert int(s.tokens.max()) < 97
        assert np.array_equal(s.tokens, big.tokens % 97)


def test_lazy_and_read_only() -> None:
    stream = generate(0, 10**12, 1000)
    assert inspect.isgenerator(stream)
    first = list(itertools.islice(stream, 50))  # a materialising generator would never return
    assert len(first) == 50
    with pytest.raises(ValueError, match="read-only"):
        first[0].tokens[0] = 1
    requests = list(itertools.islice(agentic(0, 10**12, 1000), 3))
    assert all(isinstance(r, Request) for r in requests) and [r.rid for r in requests] == [0, 1, 2]


def test_sessions_grow_by_turns_and_share_the_system_prompt(head: list[AgenticRequest]) -> None:
    first: dict[int, int] = {}
    for r in head:
        first.setdefault(r.session, r.tokens.size)
    # Sessions under way when the trace begins are well past a fresh session's 8,300-19,000.
    assert np.median([first[s] for s in range(SHAPE.sessions)]) > 25_000
    system = head[0].tokens[: SHAPE.system_tokens]
    last: dict[int, np.ndarray] = {}
    increments = []
    for r in head:
        assert np.array_equal(r.tokens[: SHAPE.system_tokens], system)
        assert r.tokens.size <= SHAPE.target_tokens[1] + SHAPE.delegation_tokens[1]
        prev = last.get(r.session)
        if prev is not None:  # every request re-sends its session so far
            assert r.tokens.size > prev.size and np.array_equal(r.tokens[: prev.size], prev)
            increments.append(r.tokens.size - prev.size)
        last[r.session] = r.tokens
    inc = np.array(increments)
    assert np.median(inc) < 1_000  # many small tool outputs ...
    assert 0.01 < np.mean(inc > 5_000) < 0.1  # ... and some large ones
    assert inc.max() <= 20_000 + SHAPE.reply_tokens[1] + SHAPE.delegation_tokens[1]
    arrivals = [r.arrival_ms for r in head]
    assert arrivals == sorted(arrivals)


def test_subagents_fork_from_their_parents_context(head: list[AgenticRequest]) -> None:
    by_session: dict[int, list[AgenticRequest]] = defaultdict(list)
    for r in head:
        by_session[r.session].append(r)
    children = [reqs for reqs in by_session.values() if reqs[0].parent >= 0]
    assert len(children) >= 10
    for reqs in children:
        first = reqs[0]
        parent_before = [p for p in by_session[first.parent] if p.arrival_ms <= first.arrival_ms]
        context = parent_before[-1].tokens
        assert first.tokens.size > context.size  # the delegation message follows
        assert np.array_equal(first.tokens[: context.size], context)
        assert len(reqs) <= SHAPE.subagent_turns[1]
        # The parent waits: no parent request between the child's first and last.
        assert not any(
            first.arrival_ms < p.arrival_ms < reqs[-1].arrival_ms for p in by_session[first.parent]
        )


def test_hundreds_of_sessions_overlap_and_most_tokens_repeat(head: list[AgenticRequest]) -> None:
    span: dict[int, list[int]] = {}
    for r in head:
        span.setdefault(r.session, [r.arrival_ms, r.arrival_ms])[1] = r.arrival_ms
    t = head[len(head) // 2].arrival_ms
    open_at_t = sum(lo <= t <= hi for lo, hi in span.values())
    assert 150 <= open_at_t <= 2 * SHAPE.sessions
    # The head holds the first request of every session under way when the trace begins, most
    # of it never sent before: over 20,000 requests the ideal hit ratio is 0.97 (README).
    stats = describe(Request(i, r.tokens) for i, r in enumerate(head))
    assert stats.ideal_hit_ratio > 0.9
    last: dict[int, int] = {}
    resent = []
    for r in head:
        if r.session in last:
            resent.append(last[r.session] / r.tokens.size)
        last[r.session] = r.tokens.size
    assert np.median(resent) > 0.95


def test_scaled_shape() -> None:
    small = AgenticShape().scaled(0.01)
    assert small.system_tokens == 60 and small.target_tokens == (200, 1500)
    assert small.tool_tokens[0] == (1, 10) and small.sessions == SHAPE.sessions
    requests = list(generate(0, 500, 100, small))
    assert max(r.tokens.size for r in requests) <= 1500 + 8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sessions": 0},
        {"task_tokens": (10, 5)},
        {"task_tokens": (0, 5)},
        {"toolset_weights": (0.5, 0.5, 0.5, 0.5)},
        {"tool_weights": (0.5, 0.5)},
        {"subagent_probability": 1.5},
        {"system_tokens": -1},
    ],
)
def test_bad_shape(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        AgenticShape(**kwargs)  # type: ignore[arg-type]


def test_parse_spec() -> None:
    assert parse_spec("agentic") == (0, DEFAULT_REQUESTS)
    assert parse_spec("agentic:7") == (7, DEFAULT_REQUESTS)
    assert parse_spec("agentic:7:123") == (7, 123)
    for bad in ("agentic:", "agentic:x", "agentic:1:0", "agentic:1:2:3", "agentics:1"):
        with pytest.raises(WorkloadError, match="agentic"):
            parse_spec(bad)
