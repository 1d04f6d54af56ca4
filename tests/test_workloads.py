"""Tests for kvstrata.workloads: trace expansion, validation, and the generated workloads."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import trace_line, write_trace

from kvstrata.errors import ConfigError, InvalidTokensError, WorkloadError
from kvstrata.workloads import (
    BUILTIN_REQUESTS,
    Request,
    Workload,
    builtin,
    load_mooncake,
    load_workload,
    shared_synthetic,
    synthetic,
)

TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake"
CONVERSATION = TRACE_DIR / "conversation_trace.jsonl"
BLOCK = 512


def line(input_length: int, hash_ids: list[int], timestamp: int = 0) -> str:
    return trace_line(input_length, hash_ids, timestamp, output_length=1)


def digest(workload: Workload) -> str:
    h = hashlib.sha256()
    for r in workload:
        h.update(np.int64(r.tokens.size).tobytes())
        h.update(r.tokens.astype("<u4").tobytes())
    return h.hexdigest()


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_trace(
        tmp_path / "trace.jsonl",
        [
            line(3 * BLOCK, [0, 1, 2], timestamp=0),
            line(2 * BLOCK + 100, [0, 1, 3], timestamp=5),
            line(BLOCK + 7, [4, 1], timestamp=9),
            line(700, [0, 1], timestamp=12),
        ],
    )


# --- expansion --------------------------------------------------------------------------------


def test_load_is_deterministic(trace: Path) -> None:
    assert digest(load_mooncake(trace)) == digest(load_mooncake(trace))


def test_fresh_process_gives_same_tokens(trace: Path) -> None:
    script = (
        "import sys; sys.path.insert(0, sys.argv[2]); from test_workloads import digest; "
        "from kvstrata.workloads import load_mooncake; print(digest(load_mooncake(sys.argv[1])))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", script, str(trace), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert out.stdout.strip() == digest(load_mooncake(trace))


def test_block_tokens_are_pinned(tmp_path: Path) -> None:
    # Changing how ids expand would silently change every recorded trace result.
    path = write_trace(tmp_path / "trace.jsonl", [line(4, [0]), line(4, [182789])])
    full = list(load_mooncake(path, vocab_size=2**32))
    assert full[0].tokens.tolist() == [2735729615, 1158725112, 175979945, 70985654]
    assert full[1].tokens.tolist() == [1825360380, 3495885725, 2668427709, 1637137620]
    llama = list(load_mooncake(path))
    assert llama[0].tokens.tolist() == [29135, 60408, 12713, 60086]


def test_shared_ids_share_tokens_and_different_ids_differ(trace: Path) -> None:
    r = list(load_mooncake(trace))
    assert shared_prefix(r[0].tokens, r[1].tokens) == 2 * BLOCK
    assert shared_prefix(r[0].tokens, r[2].tokens) == 0
    # id 1 expands to the same tokens in request 2 (cut to 7) as in request 0.
    assert np.array_equal(r[2].tokens[BLOCK:], r[0].tokens[BLOCK : BLOCK + 7])
    assert [req.arrival_ms for req in r] == [0, 5, 9, 12]
    assert [req.rid for req in r] == [0, 1, 2, 3]


def test_truncation_to_input_length(trace: Path) -> None:
    r = list(load_mooncake(trace))
    assert [req.tokens.size for req in r] == [3 * BLOCK, 2 * BLOCK + 100, BLOCK + 7, 700]
    assert np.array_equal(r[3].tokens, r[0].tokens[:700])
    assert all(req.tokens.dtype == np.uint32 for req in r)


def test_vocab_mapping_in_range_and_consistent(trace: Path) -> None:
    full = list(load_mooncake(trace, vocab_size=2**32))
    small = list(load_mooncake(trace, vocab_size=7))
    for f, s in zip(full, small, strict=True):
        assert int(s.tokens.max()) < 7
        assert np.array_equal(s.tokens, f.tokens % 7)


def test_block_tokens_parameter(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "trace.jsonl", [line(20, [0, 1]), line(16, [0, 2])])
    r = list(load_mooncake(path, block_tokens=10))
    assert shared_prefix(r[0].tokens, r[1].tokens) == 10
    with pytest.raises(WorkloadError, match="exceeds"):
        list(load_mooncake(path, block_tokens=8))


def test_limit(trace: Path) -> None:
    w = list(load_mooncake(trace, limit=2))
    assert len(w) == 2
    assert np.array_equal(w[1].tokens, list(load_mooncake(trace))[1].tokens)


# --- validation -------------------------------------------------------------------------------

GOOD = line(BLOCK, [0])

MALFORMED = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"timestamp": 0, "input_length": 5}), "missing field hash_ids"),
    (json.dumps({"hash_ids": [1]}), "missing field timestamp, input_length"),
    (line(0, [1]), "input_length must be an integer >= 1, got 0"),
    (line(-3, [1]), "input_length must be an integer >= 1, got -3"),
    (line(1, [1]).replace('"input_length": 1', '"input_length": "1"'), "input_length must be"),
    (line(1, [1], timestamp=-1), "timestamp must be"),
    (line(BLOCK + 1, [1]), "input_length 513 exceeds the 512 tokens"),
    (line(1, []), "hash_ids must be a non-empty list"),
    (line(1, [1]).replace("[1]", "7"), "hash_ids must be a non-empty list"),
    (line(1, [1]).replace("[1]", "[1, 2.5]"), r"hash_ids\[1\] must be an integer >= 0, got 2.5"),
    (line(1, [1]).replace("[1]", '["a"]'), r"hash_ids\[0\] must be an integer"),
    (line(1, [1]).replace("[1]", "[null]"), r"hash_ids\[0\] must be an integer"),
    (line(1, [1]).replace("[1]", "[true]"), r"hash_ids\[0\] must be an integer"),
    (line(1, [-4]), r"hash_ids\[0\] must be an integer >= 0, got -4"),
    ("[" * 100_000 + "]" * 100_000, "invalid JSON: nested too deeply"),
    ('{"a":' * 100_000 + "1" + "}" * 100_000, "invalid JSON: nested too deeply"),
]


@pytest.mark.parametrize(("bad", "what"), MALFORMED)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad: str, what: str) -> None:
    # Line 2 is blank: blank lines are ignored but still count in the line numbers.
    path = write_trace(tmp_path / "trace.jsonl", [GOOD, "", bad, GOOD])
    with pytest.raises(WorkloadError, match=what) as info:
        list(load_mooncake(path))
    assert f"{path}:3: " in str(info.value)


def test_non_utf8_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(GOOD.encode() + b"\n\xff\xfe{\n")
    with pytest.raises(WorkloadError, match=r":2: invalid JSON"):
        list(load_mooncake(path))


def test_skip_mode_counts_lines(tmp_path: Path) -> None:
    bad = [text for text, _ in MALFORMED]
    path = write_trace(tmp_path / "trace.jsonl", [GOOD, "", *bad, "   ", GOOD])
    w = load_mooncake(path, on_error="skip")
    assert [r.rid for r in w] == [0, 1]
    assert w.num_skipped == len(bad)
    assert [s.line_no for s in w.skipped] == list(range(3, 3 + len(bad)))
    assert all(s.reason for s in w.skipped)


def test_limit_stops_before_later_bad_lines(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "trace.jsonl", [GOOD, "{not json"])
    assert len(list(load_mooncake(path, limit=1))) == 1


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(WorkloadError, match=str(path)):
        load_mooncake(path)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"vocab_size": 0},
        {"vocab_size": 2**32 + 1},
        {"limit": 0},
        {"on_error": "ignore"},
        {"block_tokens": 0},
    ],
)
def test_bad_arguments(trace: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        load_mooncake(trace, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tokens",
    [np.array([], dtype=np.uint32), np.array([1, 2], dtype=np.int64), np.zeros((2, 2), np.uint32)],
)
def test_request_rejects_bad_tokens(tokens: np.ndarray) -> None:
    with pytest.raises(InvalidTokensError):
        Request(0, tokens)


@pytest.mark.skipif(
    not CONVERSATION.exists(), reason="Mooncake traces not checked out beside the repo"
)
def test_real_conversation_trace_head() -> None:
    w = load_mooncake(CONVERSATION, limit=200)
    requests = list(w)
    assert len(requests) == 200 and not w.skipped
    with CONVERSATION.open() as f:
        records = [json.loads(next(f)) for _ in range(200)]
    assert [r.tokens.size for r in requests] == [rec["input_length"] for rec in records]
    assert [r.arrival_ms for r in requests] == [rec["timestamp"] for rec in records]
    # The first requests all open with hash id 0 (a shared system prompt).
    assert records[0]["hash_ids"][0] == records[1]["hash_ids"][0] == 0
    assert shared_prefix(requests[0].tokens, requests[1].tokens) >= BLOCK


# --- generated workloads ----------------------------------------------------------------------


def test_builtin_is_small_deterministic_and_shares_prefixes() -> None:
    requests = builtin(1000)
    assert len(requests) == BUILTIN_REQUESTS
    assert all(64 <= r.tokens.size <= 600 for r in requests)
    assert all(int(r.tokens.max()) < 1000 for r in requests)
    again = builtin(1000)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(requests, again, strict=True))
    reused = sum(
        max((shared_prefix(r.tokens, e.tokens) for e in requests[: r.rid]), default=0)
        for r in requests
    )
    assert reused > 0.6 * sum(r.tokens.size for r in requests)
    # The structure does not depend on the vocabulary.
    assert [r.tokens.size for r in builtin(50_000)] == [r.tokens.size for r in requests]
    assert not np.array_equal(builtin(1000, seed=1)[0].tokens, requests[0].tokens)


def test_synthetic_matches_shared_generator() -> None:
    params = {"n_system_prompts": 3, "system_prompt_len": 64, "turn_min": 8, "turn_max": 16}
    requests = synthetic(3, 20, vocab_size=100, **params)
    reference = shared_synthetic.generate(3, 20, **params)
    for r, ref in zip(requests, reference, strict=True):
        assert np.array_equal(r.tokens, np.array(ref) % 100)
    assert synthetic(3, 5, **params)[4].tokens.tolist() == reference[4]
    with pytest.raises(ConfigError, match="unknown synthetic workload parameters"):
        synthetic(0, 5, turns=3)


def test_load_workload_specs(trace: Path) -> None:
    assert len(list(load_workload("builtin", vocab_size=500))) == BUILTIN_REQUESTS
    assert len(list(load_workload("builtin", limit=5, vocab_size=500))) == 5
    w = list(load_workload("synthetic:7:4", vocab_size=500))
    assert len(w) == 4 and all(int(r.tokens.max()) < 500 for r in w)
    assert len(list(load_workload("synthetic:7:4", limit=2))) == 2
    assert len(list(load_workload(str(trace), limit=3))) == 3
    agentic = load_workload("agentic:3:7", vocab_size=500)
    assert agentic.num_requests == 7 and len(list(agentic)) == 7
    assert load_workload("agentic", limit=2).num_requests == 2
    for spec in ("nope", "synthetic:x", "synthetic:1:2:3", "trace.json", "agentic:1:0", "agentic:"):
        with pytest.raises(WorkloadError, match="builtin|synthetic|agentic"):
            load_workload(spec)


def test_max_tokens_refuses_longer_lines_before_expanding(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "trace.jsonl", [GOOD, line(3 * BLOCK, [0, 1, 2]), GOOD])
    with pytest.raises(WorkloadError, match=r":2: input_length 1,536 exceeds the 1,024 tokens"):
        list(load_mooncake(path, max_tokens=2 * BLOCK))
    w = load_workload(str(path), on_error="skip", max_tokens=2 * BLOCK)
    assert len(list(w)) == 2 and [s.line_no for s in w.skipped] == [2]
    assert len(list(load_mooncake(path, max_tokens=3 * BLOCK))) == 3


def test_block_seeding_is_numpys_own_bit_for_bit() -> None:
    """blocks.py seeds PCG64 itself (SeedSequence's hashing vectorised, PCG64's two seeding
    steps in Python's integers): for ids across the 32-bit range its state and outputs are
    numpy's, and ids past 32 bits (numpy's own seeding) expand the same as well."""
    from kvstrata.workloads.blocks import BlockExpander, pcg64_state, seed_words

    rng = np.random.default_rng(3)
    ids = np.concatenate([np.arange(40), rng.integers(0, 2**32, 300), [2**31, 2**32 - 1]])
    words = seed_words(ids.astype(np.uint32))
    gen = np.random.PCG64(0)
    for row, h in zip(words, ids.tolist(), strict=True):
        assert row.tolist() == np.random.SeedSequence(h).generate_state(4, np.uint64).tolist()
        gen.state = pcg64_state(row)
        assert gen.state == np.random.PCG64(h).state
    # A request's blocks, new ones and cached ones, past 32 bits or not, a cache smaller than
    # one call's blocks: every token is the high 32 bits of PCG64(h)'s outputs, mod the vocab.
    requests = [[7, 2**40, 7, 3], [3, 9, 2**33 + 1], [11, 12, 13, 14, 15], [7, 12]]
    lengths = [4 * 16 - 5, 3 * 16, 5 * 16, 17]
    for max_blocks in (2, 4096):
        expander = BlockExpander(1000, 16, max_blocks)
        got = expander.expand_many(list(zip(requests, lengths, strict=True)))
        got += [expander.expand(ids, n) for ids, n in zip(requests, lengths, strict=True)]
        for tokens, ids_, n in zip(got, requests * 2, lengths * 2, strict=True):
            want = np.concatenate(
                [(np.random.PCG64(h).random_raw(16) >> np.uint64(32)) % 1000 for h in ids_]
            )[:n]
            assert tokens.tolist() == want.tolist()
        assert len(expander._blocks) <= max_blocks


def test_a_bad_line_stops_where_it_stands_despite_the_lookahead(tmp_path: Path) -> None:
    """Lines are parsed LOOKAHEAD_LINES at a time, but a bad line still raises only once the
    requests before it were handed out (and with skip, the rest still come)."""
    from kvstrata.workloads import LOOKAHEAD_LINES

    lines = [line(4, [i]) for i in range(LOOKAHEAD_LINES + 5)]
    lines[3] = '{"timestamp": 1, "input_length": 4}'
    path = write_trace(tmp_path / "bad.jsonl", lines)
    got = []
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:4: missing field hash_ids"):
        for request in load_mooncake(path):
            got.append(request.rid)
    assert got == [0, 1, 2]
    skipped = load_mooncake(path, on_error="skip")
    assert len(list(skipped)) == LOOKAHEAD_LINES + 4 and skipped.num_skipped == 1
