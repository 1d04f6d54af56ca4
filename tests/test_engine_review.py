"""Regression tests from an adversarial review of the engine, replay and CLI.

Each test pins one concrete bug the review found; all are fixed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import run_all

from kvstrata.cli import main
from kvstrata.engine import Engine, EngineConfig
from kvstrata.model.compute import ModelCompute, SyntheticCompute
from kvstrata.model.loader import load_model
from kvstrata.replay import ReplayConfig, run_replay
from kvstrata.workloads import Request


def synthetic_engine(**kwargs: Any) -> Engine:
    return Engine(SyntheticCompute(4, 512), EngineConfig(check_every_step=True, **kwargs))


# -- engine ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("page_size", "num_tokens"), [(16, 64), (1, 1), (1, 5)])
def test_repeat_of_a_pool_sized_prompt_is_served(page_size: int, num_tokens: int) -> None:
    """A prompt that fits the pool alone must be served again after it was cached."""
    engine = synthetic_engine(page_size=page_size, pool_tokens=num_tokens)
    tokens = np.arange(1, num_tokens + 1, dtype=np.uint32)
    out = run_all(engine, [Request(0, tokens), Request(1, tokens.copy())])
    assert out[0].error is None and out[1].error is None
    assert out[1].cached_len == (num_tokens - 1) // page_size * page_size
    engine.check()


def test_retries_of_a_waiting_request_are_not_hits() -> None:
    engine = synthetic_engine(page_size=4, pool_tokens=32, chunk_size=1, eviction="slru")
    prefix = np.arange(1, 9, dtype=np.uint32)  # 2 pages
    run_all(engine, [Request(0, prefix)])
    big = Request(1, np.arange(100, 124, dtype=np.uint32))  # 6 pages, runs 24 steps
    waiter = Request(2, np.concatenate([prefix, np.arange(200, 212, dtype=np.uint32)]))
    out = run_all(engine, [big, waiter])
    assert out[2].cached_len == 8
    # Chunks are inserted as they finish, so the prefix may span several nodes.
    shared = [n for n in engine.cache.tree.nodes() if n.end <= 8 and n.tokens[0] == n.start + 1]
    assert sum(n.end - n.start for n in shared) == 8
    assert all(n.hit_count == 1 for n in shared)  # one request reused it, once


def test_no_deferral_when_the_shared_page_is_recomputed_anyway() -> None:
    engine = synthetic_engine(page_size=16, pool_tokens=256, chunk_size=16)
    long = np.arange(1, 65, dtype=np.uint32)  # 4 pages: 4 steps at chunk 16
    engine.add(Request(0, long))
    engine.add(Request(1, long[:16].copy()))  # one page: its last token is in page 0
    first = {f.rid: f for f in engine.step()}
    assert engine.deferred == 0
    assert 1 in first and first[1].computed_len == 16


# -- replay ------------------------------------------------------------------------------------


def test_model_none_hits_equal_model_mode_on_the_same_trace(tmp_path: Path) -> None:
    # Hash ids 8 and 21 start with the same token modulo 512, not modulo 128,256.
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 4, "hash_ids": [8]}\n'
        '{"timestamp": 1, "input_length": 4, "hash_ids": [21]}\n'
    )
    engine = EngineConfig(page_size=1, pool_tokens=64)
    model = run_replay(ReplayConfig(workload=str(trace), model="tiny", engine=engine), False)
    vocab = model.config["vocab_size"]
    none = run_replay(
        ReplayConfig(workload=str(trace), model="none", vocab_size=vocab, engine=engine), False
    )
    assert none.cached_tokens == model.cached_tokens == 1
    assert none.config["vocab_size"] == 512


def test_json_config_records_every_setting_that_changes_the_result() -> None:
    tiny = run_replay(
        ReplayConfig(model="none", limit=4, engine=EngineConfig(max_batch_requests=3)), False
    )
    config = tiny.to_json()["config"]
    assert {"max_batch_requests", "seed", "limit"} <= set(config)


def test_model_and_none_mode_agree_with_model_vocab() -> None:
    """Guard for the fix above: with the same vocabulary, both modes hit identically (page 1)."""
    _, model = load_model("tiny", device="cpu", dtype="float32", seed=0)
    compute = ModelCompute(model, torch.float32)
    cfg = ReplayConfig(limit=12, engine=EngineConfig(page_size=1, pool_tokens=2048))
    with_model = run_replay(cfg, False, compute=compute)
    without = run_replay(cfg, False, compute=SyntheticCompute(8, compute.vocab_size))
    assert with_model.cached_tokens == without.cached_tokens > 0


# -- CLI ---------------------------------------------------------------------------------------


def _one_error_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"kvstrata {args[0]}: error: ")


@pytest.mark.parametrize(
    "bad",
    [["--device", "nonsense"], ["--seed", "-1"], ["--l1-tokens", str(10**14)]],
    ids=["device", "seed", "l1-tokens"],
)
def test_replay_bad_input_exits_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    _one_error_line(["replay", "--model", "none", "--limit", "2", "--no-progress", *bad], capsys)


def test_replay_model_none_refuses_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    _one_error_line(
        ["replay", "--model", "none", "--limit", "2", "--no-progress", "--dtype", "foo"], capsys
    )


def test_check_model_page_size_0_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    _one_error_line(["check-model", "tiny", "--page-size", "0"], capsys)
