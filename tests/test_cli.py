"""The command line as a user meets it: exit codes, messages, the JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstrata.cli", *args], capture_output=True, text=True, timeout=300
    )


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


def write_trace(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}'
GOOD2 = '{"timestamp": 5, "input_length": 700, "hash_ids": [1, 2]}'


def test_malformed_trace_line_stops_with_its_line_number(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [GOOD, "{not json", GOOD2])
    out = run_cli("replay", "--model", "none", "--trace", str(trace), "--no-progress")
    assert out.returncode == 2
    assert ":2:" in out.stderr and "error" in out.stderr


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
