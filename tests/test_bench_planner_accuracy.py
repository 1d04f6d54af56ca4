"""``kvstrata bench planner-accuracy`` on the CPU with the tiny model: a trace window replayed
with the model (the CPU clock) and predicted by ``--model none`` with the shipped CPU profile,
same sizes and arrivals; every figure measured, predicted and its error, in the table and the
JSON line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import trace_line, write_trace

from kvstrata.benchmarks import planneraccuracy
from kvstrata.benchmarks.planner_steps import profile_seconds
from kvstrata.cost import load_profile
from kvstrata.errors import ConfigError
from kvstrata.replay.steps import read_steps

pytestmark = pytest.mark.slow


def test_window_parse_and_write(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [trace_line(600, [i], 100 * i) for i in range(5)])
    window = planneraccuracy.Window.parse("1:3")
    path, left_out = window.write(trace, tmp_path)
    lines = path.read_text().splitlines()
    assert left_out == 0 and [json.loads(line)["hash_ids"] for line in lines] == [[1], [2], [3]]
    # Lines longer than the model takes are left out of both replays, and counted.
    long = write_trace(tmp_path / "l.jsonl", [trace_line(600 if i != 2 else 2000, [i], 100 * i)
                                              for i in range(5)])  # fmt: skip
    path, left_out = window.write(long, tmp_path, max_input=1024)
    assert left_out == 1
    assert [json.loads(line)["hash_ids"] for line in path.read_text().splitlines()] == [[1], [3]]
    with pytest.raises(ConfigError, match="runs past its end"):
        planneraccuracy.Window.parse("3:5").write(trace, tmp_path)
    with pytest.raises(ConfigError, match="START:COUNT"):
        planneraccuracy.Window.parse("3")


def test_cpu_measured_against_predicted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Conversations: each turn re-sends the last one's blocks plus one, 300 ms apart.
    lines = [trace_line(512 * (t + 1) - 100, list(range(10 * c, 10 * c + t + 1)), 300 * (4 * t + c))
             for t in range(3) for c in range(4)]  # fmt: skip
    trace = write_trace(tmp_path / "t.jsonl", lines)
    code = planneraccuracy.main(
        [
            "--trace",
            str(trace),
            "--device",
            "cpu",
            "--windows",
            "0:12",
            "--time-scales",
            "1",
            "0.25",
            "--l1-tokens",
            "16384",
            "--l2-tokens",
            "32768",
        ]  # fmt: skip
    )
    assert code == 0
    out = capsys.readouterr().out
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["bench"] == "planner-accuracy" and len(doc["results"]) == 2
    for result in doc["results"]:
        assert result["profile"] == "cpu-2core-tiny-fp32" and result["measured_clock"] == "cpu"
        rows = {r["figure"]: r for r in result["rows"]}
        assert set(rows) == {label for label, _, _ in planneraccuracy.FIGURES}
        assert rows["TTFT mean ms"]["measured"] > 0 and rows["TTFT mean ms"]["predicted"] > 0
        assert abs(rows["hit ratio"]["error"]) < 0.05  # the cache decides alike on both clocks
    assert "TTFT p90 ms" in out and "window 0:12, time scale 0.25" in out


def test_steps_out_logs_both_replays_step_by_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [trace_line(512 * (t + 1) - 100, list(range(10 * c, 10 * c + t + 1)), 50 * (4 * t + c))
             for t in range(3) for c in range(4)]  # fmt: skip
    trace = write_trace(tmp_path / "t.jsonl", lines)
    out = tmp_path / "steps"
    argv = ["--trace", str(trace), "--device", "cpu", "--windows", "0:12", "--time-scales", "1",
            "--l1-tokens", "16384", "--l2-tokens", "32768", "--chunk-size", "256",
            "--max-batch-tokens", "1024", "--steps-out", str(out)]  # fmt: skip
    assert planneraccuracy.main(argv) == 0
    text = capsys.readouterr().out
    assert "warm-up:" in text and "start-up before the loop s" in text and "busy (in steps)" in text
    doc = json.loads(text.strip().splitlines()[-1])
    steps = doc["results"][0]["steps"]
    profile = load_profile("cpu-2core-tiny-fp32")
    for name in ("measured", "predicted"):
        path = Path(steps["files"][name])
        assert path.parent == out and path.name == f"window-0-12-scale-1-{name}.jsonl"
        records = read_steps(path)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(records) == steps[name]["steps"] > 0
        for row, record in zip(rows, records, strict=True):
            # Every record carries the profile's prediction for its own composition.
            assert row["profile_s"] == pytest.approx(profile_seconds(profile, record))
        assert steps[name]["busy_s"] == pytest.approx(sum(r.seconds for r in records), abs=1e-5)
    measured, predicted = steps["measured"], steps["predicted"]
    # Both replays computed the same tokens; the sim run's steps last what the profile says.
    assert sum(r.tokens for r in read_steps(Path(steps["files"]["measured"]))) == sum(
        r.tokens for r in read_steps(Path(steps["files"]["predicted"]))
    )
    assert predicted["busy_s"] == pytest.approx(predicted["profile_busy_s"], rel=1e-6)
    assert measured["busy_s"] > 0 and measured["first_step_s"] < 1.0
    assert predicted["startup_s"] == 0.0 and predicted["other_s"] == pytest.approx(0, abs=1e-9)
    # A second run into the same directory refuses before it runs, and leaves the logs alone.
    before = Path(steps["files"]["measured"]).read_text()
    with pytest.raises(ConfigError, match="already holds"):
        planneraccuracy.main(argv)
    assert Path(steps["files"]["measured"]).read_text() == before
