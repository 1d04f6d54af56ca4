"""Progress reporting: a bar on a terminal, a line every few seconds anywhere else."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.progress import Progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_prints_a_line_every_interval() -> None:
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress("replay", 100, stream=stream, interval_s=5.0, clock=clock)
    assert stream.getvalue() == "replay: started, 100 requests\n"
    for _ in range(10):  # 10 requests per second for 10 s
        clock.now += 1.0
        progress.update(10, tokens=1000)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[1:] == [
        "replay: 50/100 requests, 1,000 tokens/s, ETA 0:05, elapsed 0:05",
        "replay: 100/100 requests, 1,000 tokens/s, ETA 0:00, elapsed 0:10",
        "replay: 100/100 requests, 1,000 tokens/s, elapsed 0:10 (done)",
    ]


def test_nothing_between_intervals_and_no_eta_without_a_total() -> None:
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress("replay", None, stream=stream, interval_s=5.0, clock=clock)
    clock.now += 4.9
    progress.update(3, tokens=49)
    assert stream.getvalue().splitlines() == ["replay: started"]
    clock.now += 0.1
    progress.update(1, tokens=1)
    assert stream.getvalue().splitlines()[-1] == "replay: 4 requests, 10 tokens/s, elapsed 0:05"


def test_disabled_prints_nothing() -> None:
    stream = io.StringIO()
    with Progress("replay", 10, enabled=False, stream=stream) as progress:
        progress.update(10, tokens=5)
    assert stream.getvalue() == ""


def test_a_terminal_gets_a_bar_not_lines() -> None:
    stream = Terminal()
    with Progress("replay", 10, stream=stream) as progress:
        progress.update(10)
    assert "replay: started" not in stream.getvalue()
    assert "0/10 [" in stream.getvalue()  # tqdm's bar


@pytest.mark.slow
def test_replay_without_a_terminal_logs_progress_lines() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstrata", "replay", "--model", "none", "--limit", "5"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == "replay: started, 5 requests"
    assert lines[-1].startswith("replay: 5/5 requests, ") and lines[-1].endswith("(done)")
    assert "\r" not in out.stderr
