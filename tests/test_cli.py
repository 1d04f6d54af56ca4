"""The command line as a user meets it: exit codes, messages, the JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_trace

from kvstrata import __version__
from kvstrata.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstrata.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_replay_defaults_print_table_and_json_last_line() -> None:
    out = run_cli("replay", "--json", "--no-progress")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    data = json.loads(lines[-1])
    for field in (
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "hit_ratio",
        "hit_tokens_by_tier",
        "computed_tokens",
        "prefill_tokens_per_s",
        "ttft_ms",
        "verify",
        "config",
        "versions",
    ):
        assert field in data
    assert data["requests"] == 48 and data["failed"] == 0
    assert data["hit_ratio"] > 0.5
    assert data["cached_tokens"] + data["computed_tokens"] == data["prompt_tokens"]
    assert any(line.startswith("hit ratio") for line in lines)


GOOD = '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}'
GOOD2 = '{"timestamp": 5, "input_length": 700, "hash_ids": [1, 2]}'


@pytest.mark.slow
def test_malformed_trace_line_stops_with_its_line_number(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [GOOD, "{not json", GOOD2])
    out = run_cli("replay", "--model", "none", "--trace", str(trace), "--no-progress")
    assert out.returncode == 2
    assert ":2:" in out.stderr and "error" in out.stderr


@pytest.mark.slow
def test_malformed_trace_line_can_be_skipped(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [GOOD, '{"timestamp": 1}', GOOD2])
    out = run_cli(
        "replay",
        "--model",
        "none",
        "--trace",
        str(trace),
        "--on-error",
        "skip",
        "--json",
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["requests"] == 2 and data["config"]["skipped_lines"] == 1
    assert data["cached_tokens"] == 600 // 16 * 16  # request 2 re-sends request 1: whole pages hit


@pytest.mark.parametrize(
    "args",
    [
        ["replay", "--page-size", "0"],
        ["replay", "--l1-tokens", "8", "--page-size", "16"],
        ["replay", "--model", "no-such-preset"],
        ["replay", "--trace", "missing.jsonl"],
        ["replay", "--trace", "nonsense"],
        ["replay", "--verify", "-1"],
        ["check-model", "/no/such/checkpoint"],
    ],
)
def test_bad_input_exits_2_with_one_message(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*args, "--no-progress"] if args[0] == "replay" else args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvstrata {args[0]}: error: ") and len(err.strip().splitlines()) == 1


def test_check_model_preset_agrees_with_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-model", "tiny-qwen3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] and report["max_abs_logit_diff"] < 1e-3 and report["argmax_agree"] == 1.0


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"kvstrata {__version__}\n"


@pytest.mark.parametrize(
    ("args", "prog"),
    [
        (["replay", "--page-size", "abc"], "kvstrata replay"),
        (["replay", "--eviction", "fifo"], "kvstrata replay"),
        (["check-model"], "kvstrata check-model"),
        (["no-such-command"], "kvstrata"),
        (["bench"], "kvstrata bench"),
        (["bench", "radix", "--requests", "x"], "kvstrata bench radix"),
        (["bench", "radix", "--requests", "0"], "kvstrata bench radix"),
        (["bench", "prefill", "--device", "nonsense"], "kvstrata bench prefill"),
    ],
)
def test_usage_errors_are_one_line_too(
    args: list[str], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's own errors used to print a usage block first; now every error is one line."""
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"{prog}: error: ")


def test_check_model_validates_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-model", "tiny", "--device", "nonsense"]) == 2
    assert "device 'nonsense' is not a torch device" in capsys.readouterr().err


def test_check_model_fails_a_checkpoint_with_nan_weights(
    nan_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conftest import POISONED_WEIGHT

    assert main(["check-model", str(nan_checkpoint), "--json"]) == 1
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"] is False
    assert report["nonfinite_ours"] > 0 and report["nonfinite_theirs"] > 0
    assert report["nonfinite_weight_names"] == [POISONED_WEIGHT]
    assert "verdict            FAIL" in out and "non-finite weights 1:" in out


def test_check_model_passes_the_same_checkpoint_without_nan(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-model", str(tiny_checkpoint)]) == 0
    assert "non-finite logits  0 kvstrata, 0 transformers" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["radix", "--requests", "20", "--page-sizes", "16"],
        ["prefill", "--device", "cpu", "--preset", "tiny", "--lengths", "8", "--repeats", "1"],
        pytest.param(
            ["replay", "--trace", "builtin", "--repeats", "1", "--scrape-interval", "0.01"],
            marks=pytest.mark.slow,  # two spawned processes
        ),
    ],
)
def test_bench_json_names_the_benchmark(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *args]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench"] == args[0]
