"""``kvstrata replay`` as a contract: verification that cannot say OK wrongly, exit codes, partial
results on Ctrl-C, and checks that run before anything large is built."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import trace_line, write_trace
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvstrata import replay as replay_module
from kvstrata.cli import main
from kvstrata.engine import Engine, EngineConfig
from kvstrata.errors import CapacityError, WorkloadError
from kvstrata.model.compute import ModelCompute
from kvstrata.model.loader import load_model
from kvstrata.replay import ReplayConfig, compare_logits, run_replay
from kvstrata.workloads import load_mooncake

BASE = ["replay", "--model", "none", "--no-progress"]


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


# -- verification never says OK wrongly ----------------------------------------------------------


finite_or_not = st.floats(allow_nan=True, allow_infinity=True, width=32)


@given(
    pair=st.integers(1, 40).flatmap(
        lambda n: st.tuples(
            hnp.arrays(np.float32, n, elements=finite_or_not),
            hnp.arrays(np.float32, n, elements=finite_or_not),
        )
    )
)
@settings(max_examples=200, deadline=None)
@example(pair=(np.array([3e38], np.float32), np.array([-3e38], np.float32)))
def test_compare_logits_counts_every_nonfinite_value(pair: tuple[np.ndarray, np.ndarray]) -> None:
    a, b = pair
    diff, nonfinite = compare_logits(torch.from_numpy(a), torch.from_numpy(b))
    assert nonfinite == int((~np.isfinite(a)).sum() + (~np.isfinite(b)).sum())
    both = np.isfinite(a) & np.isfinite(b)
    expected = float(np.abs(a[both].astype(np.float64) - b[both]).max()) if both.any() else 0.0
    assert diff == expected
    assert np.isfinite(diff)


def test_verify_fails_on_nan_logits() -> None:
    """A model whose weights hold a NaN gives NaN logits with and without the cache; the
    difference is NaN, which max() used to drop, so verify said 0 and agreement 1."""
    _, model = load_model("tiny", device="cpu", dtype="float32", seed=0)
    with torch.no_grad():
        model.state_dict()["layers.0.mlp.down_proj.weight"][0, 0] = torch.nan
    cfg = ReplayConfig(limit=6, verify=3, engine=EngineConfig(pool_tokens=4096))
    summary = run_replay(cfg, False, compute=ModelCompute(model, torch.float32))
    assert summary.verify.nonfinite_logits and summary.verify.nonfinite_logits > 0
    assert not summary.verify.ok
    assert summary.verify.argmax_agree == 0.0
    assert "FAIL" in summary.table()
    assert summary.to_json()["verify"]["ok"] is False


def test_verify_ok_on_a_sound_model() -> None:
    summary = run_replay(
        ReplayConfig(limit=6, verify=3, engine=EngineConfig(pool_tokens=4096)), False
    )
    assert summary.verify.ok and summary.verify.nonfinite_logits == 0
    assert summary.to_json()["verify"]["ok"] is True


def test_replay_verify_of_a_nan_checkpoint_exits_1(
    nan_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(
        ["replay", "--model", str(nan_checkpoint), "--limit", "4", "--verify", "2", "--json"],
        capsys,
    )
    assert code == 1
    assert "non-finite" in out and "--verify failed" in err
    assert json.loads(out.strip().splitlines()[-1])["verify"]["ok"] is False


# -- exit codes and partial results --------------------------------------------------------------


def test_every_request_failing_exits_1_and_lists_the_rest_as_a_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A 4-page pool: every built-in request (80 to 600 tokens) needs more.
    code, out, err = cli([*BASE, "--l1-tokens", "64"], capsys)
    assert code == 1 and "every request failed (48)" in err
    failed = [line for line in out.splitlines() if line.startswith("failed: ")]
    assert len(failed) == replay_module.LISTED_ERRORS + 1
    assert failed[-1] == f"failed: ... and {48 - replay_module.LISTED_ERRORS} more"


def test_some_requests_failing_exits_0_unless_fail_on_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = cli([*BASE, "--l1-tokens", "256"], capsys)
    assert code == 0 and "failed)" in out
    code, _, err = cli([*BASE, "--l1-tokens", "256", "--fail-on-error"], capsys)
    assert code == 1 and "--fail-on-error" in err


def test_skipped_trace_lines_show_in_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl", [trace_line(600, [1, 2]), "[[[", trace_line(700, [1, 2])]
    )
    code, out, _ = cli([*BASE, "--trace", str(trace), "--on-error", "skip"], capsys)
    assert code == 0
    assert any(
        line.startswith("skipped trace lines") and line.endswith(" 1") for line in out.splitlines()
    )
    assert "skipped: line 2: invalid JSON" in out


def test_ctrl_c_prints_the_summary_so_far_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_step = Engine.step
    calls = []

    def step(self: Engine) -> list:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    code, out, err = cli([*BASE, "--max-batch-requests", "4", "--json"], capsys)
    assert code == 130
    assert "interrupted" in err
    data = json.loads(out.strip().splitlines()[-1])
    assert data["interrupted"] is True and 0 < data["requests"] < 48
    assert any(line.startswith("interrupted") for line in out.splitlines())


@pytest.mark.slow
def test_sigint_to_a_running_replay(tmp_path: Path) -> None:
    """A real SIGINT: the process prints the summary so far and exits 130, no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstrata", "replay", "--trace", "synthetic:0:2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
        # a suite started in the background (``pytest &``) hands its children SIGINT ignored, and
        # Python then keeps it ignored: give the child the default disposition a terminal has
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # stderr is a pipe, so progress comes as lines; the first says started
        if line.startswith("replay: started"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert "interrupted" in out and "hit ratio" in out


# -- checks before anything large is built -------------------------------------------------------


def test_bad_trace_fails_before_the_model_is_built(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before the trace was checked")

    monkeypatch.setattr("kvstrata.replay.build.load_model", no_model)
    code, _, err = cli(
        ["replay", "--model", "small", "--trace", "/no/such/trace.jsonl", "--no-progress"], capsys
    )
    assert code == 2 and "cannot open trace" in err


def test_pool_larger_than_memory_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_pool(*args: object, **kwargs: object) -> None:
        raise AssertionError("the pool was allocated")

    monkeypatch.setattr("kvstrata.limits.available_bytes", lambda device: 2**30)
    monkeypatch.setattr("kvstrata.engine.hierarchy.DevicePool", no_pool)
    # 32 M tokens of 64 bytes: 2 GiB of pool (+ allocator) against 1 GiB available.
    code, _, err = cli([*BASE, "--l1-tokens", str(2**25)], capsys)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "the L1 pool (2,097,152 pages)" in line and "only 1.00 GiB is available" in line


def test_model_weights_count_against_memory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("kvstrata.limits.available_bytes", lambda device: 2**30)
    code, _, err = cli(["replay", "--model", "llama-3.2-1b", "--no-progress"], capsys)
    assert code == 2 and "the model weights 4.60 GiB" in err


def test_huge_trace_line_is_refused_before_its_tokens_exist(tmp_path: Path) -> None:
    """A 200 M-token line used to expand into 800 MB of tokens before the engine refused it."""
    n = 200_000_000
    trace = write_trace(tmp_path / "big.jsonl", [trace_line(n, list(range(-(-n // 512))))])
    tracemalloc.start()
    try:
        with pytest.raises(WorkloadError, match=r"big.jsonl:1: input_length 200,000,000 exceeds"):
            list(load_mooncake(trace, max_tokens=262_144))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20  # the line's JSON, not its tokens


def test_replay_refuses_a_line_longer_than_the_engine_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [trace_line(600, [1, 2]), trace_line(5000, [3] * 10)])
    code, _, err = cli([*BASE, "--trace", str(trace), "--l1-tokens", "4096"], capsys)
    assert code == 2 and "t.jsonl:2: input_length 5,000 exceeds the 4,096 tokens" in err
    code, out, _ = cli(
        [*BASE, "--trace", str(trace), "--l1-tokens", "4096", "--on-error", "skip"], capsys
    )
    assert code == 0 and "skipped: line 2" in out


def test_threads_flag_sets_and_restores_torch_threads(capsys: pytest.CaptureFixture[str]) -> None:
    before = torch.get_num_threads()
    code, out, _ = cli([*BASE, "--limit", "2", "--threads", "1", "--json"], capsys)
    assert code == 0
    assert json.loads(out.strip().splitlines()[-1])["config"]["threads"] == 1
    assert torch.get_num_threads() == before


def test_l2_host_pool_counts_against_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvstrata.limits.available_bytes", lambda device: 2**30)
    cfg = ReplayConfig(
        model="none", engine=EngineConfig(pool_tokens=4096, l2_tokens=2**25)
    )  # 32 M tokens of 64 bytes: 2 GiB of host pool against 1 GiB available
    with pytest.raises(CapacityError, match=r"the L2 host pool \(2,097,152 pages\)"):
        run_replay(cfg, False)
