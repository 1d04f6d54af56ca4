"""``kvstrata calibrate`` on the CPU engine with the tiny model: the fitted profile predicts a
held-back set of steps (shapes the fit never saw) within 25 %, and the command writes a profile
that ``--cost-profile`` reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.calibrate import calibrate, design, predict
from kvstrata.cli import main
from kvstrata.cost import load_profile

pytestmark = pytest.mark.slow


def test_the_design_covers_every_term_and_holds_some_back() -> None:
    points = design(1024, with_l2=True)
    kinds = {p.kind for p in points if not p.held_back}
    assert kinds == {"fresh", "prefix", "batch", "backup", "load-back"}
    held = [p for p in points if p.held_back]
    fitted = {(p.kind, p.extend, p.prefix) for p in points if not p.held_back}
    assert held and not fitted & {(p.kind, p.extend, p.prefix) for p in held}


def test_cpu_profile_predicts_held_back_steps_within_25_percent() -> None:
    cal = calibrate("tiny", "cpu", max_tokens=1024, repeats=5)  # the command's default
    held = cal.errors(held_back=True)
    print(cal.table())  # shown with -s: every step measured and predicted
    assert len(held) >= 8
    assert sum(held) / len(held) < 0.25, cal.table()
    p = cal.profile
    assert p.kind == "calibrated" and p.overlap == "serial" and p.token_s > 0
    assert p.provenance.fit_error["held_back_mean"] == pytest.approx(
        sum(held) / len(held), abs=1e-4
    )  # kept to 4 places
    for s in cal.samples:  # the table's predictions are the profile's
        assert predict(p, s.work) > 0


def test_calibrate_command_writes_a_profile_replay_reads(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "p.json"
    code = main(["calibrate", "--max-tokens", "1024", "--repeats", "1", "--l2-tokens", "0",
                 "--out", str(out), "--json"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-back steps" in printed and "predicted ms" in printed
    profile = load_profile(str(out))
    assert json.loads(printed.strip().splitlines()[-1]) == profile.to_json()
    assert profile.provenance.command.startswith("kvstrata calibrate")
    code = main(["replay", "--model", "none", "--trace", "synthetic:0:10", "--cost-profile",
                 str(out), "--no-progress", "--json"])  # fmt: skip
    assert code == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["clock"]["cost"]["name"] == profile.name
