"""Inputs that used to end in a traceback (or a 31-year sleep) end in one stderr line and exit 2
(issue 19, item 10, and the LOW items about `compare`'s output)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstrata.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
FAST = ["--model", "none", "--no-progress", "--l1-tokens", "4096"]


def _one_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"kvstrata {command}: error: "), err[0]
    return err[0]


# -- replay --report -------------------------------------------------------------------------------


def test_a_report_name_taken_by_a_directory_fails_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out" / "hit_ratio.png").mkdir(parents=True)
    assert main(["replay", *FAST, "--report", str(tmp_path / "out")]) == 2
    assert "hit_ratio.png exists and is not a regular file" in _one_line(capsys, "replay")
    assert "hit ratio" not in capsys.readouterr().out  # refused before it ran


def test_a_full_disk_while_writing_the_report_is_one_line_and_leaves_no_half_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    def full(self: Figure, *args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    out = tmp_path / "out"
    assert main(["replay", *FAST, "--report", str(out)]) == 2
    assert "No space left on device" in _one_line(capsys, "replay")
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]  # whole, nothing partial
    json.loads((out / "summary.json").read_text())


# -- compare ---------------------------------------------------------------------------------------


def _summary(tmp_path: Path, name: str, **fields: Any) -> Path:
    doc = {"schema": 2, "hit_ratio": 0.5, "requests": 10, "config": {"model": "none"}} | fields
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x89PNG\r\n\x1a\n\xff\xfe\x00binary", "not a text file"),
        (b"[" * 200_000 + b"]" * 200_000, "holds no replay summary"),
        (b'{"schema": 2, "hit_ratio": 0.5, "config": [1, 2]}', "'config' is a list"),
        (b'{"schema": 2, "hit_ratio": 0.5, "config": "x"}', "'config' is a str"),
    ],
)
def test_compare_refuses_what_is_not_a_summary_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    good = _summary(tmp_path, "good.json")
    assert main(["compare", str(good), str(bad)]) == 2
    assert message in _one_line(capsys, "compare")


def test_compare_escapes_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _summary(tmp_path, "a.json")
    b = _summary(tmp_path, "b.json", config={"model": "\x1b]0;pwned\x07\x1b[2J"})
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in out


# -- trace timestamps ------------------------------------------------------------------------------


def _trace(tmp_path: Path, gap_ms: int) -> Path:
    path = tmp_path / f"gap{gap_ms}.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]},
        {"timestamp": gap_ms, "input_length": 600, "hash_ids": [1, 3]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("gap_ms", [10**15, 10**12])
def test_an_arrival_gap_beyond_a_day_is_refused_unless_scaled(tmp_path: Path, gap_ms: int) -> None:
    """10^15 ms overflowed time.sleep (a traceback); 10^12 ms slept 31 years. In a child process
    with a timeout of its own, so the second cannot stall the suite."""
    trace = str(_trace(tmp_path, gap_ms))
    cmd = [sys.executable, "-m", "kvstrata", "replay", "--model", "tiny", "--trace", trace,
           "--no-progress", "--clock", "wall"]  # fmt: skip
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "more than a day" in lines[0] and "--time-scale" in lines[0]
    scaled = subprocess.run(
        [*cmd, "--time-scale", str(1000.0 / gap_ms)], capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip
    assert scaled.returncode == 0, scaled.stderr[-2000:]
