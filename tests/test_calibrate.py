"""``kvstrata calibrate`` on the CPU engine with the tiny model: the fitted profile predicts a
held-back set of steps (shapes the fit never saw) within 25 %, and the command writes a profile
that ``--cost-profile`` reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.calibrate import Sample, calibrate, design, fit_compute, predict, prefix_lengths
from kvstrata.cli import main
from kvstrata.clock import StepWork
from kvstrata.cost import load_profile
from kvstrata.errors import ConfigError

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


def test_the_design_reaches_the_longest_prefix_asked_for() -> None:
    assert prefix_lengths(2048, 4096) == (512, 2048, 4096)  # the default: m/4, m, 2m
    assert prefix_lengths(2048, 32768) == (512, 2048, 8192, 32768)
    default = design(2048, with_l2=False)
    assert design(2048, with_l2=False, max_prefix=4096) == default  # the default design
    long = design(2048, with_l2=False, max_prefix=32768)
    assert max(max(p.prefixes) for p in long if not p.held_back) == 32768
    assert any(p.held_back and max(p.prefixes) > 4096 for p in long)
    with pytest.raises(ConfigError, match="--max-prefix must lie in"):
        calibrate("tiny", "cpu", max_tokens=1024, max_prefix=1024)
    with pytest.raises(ConfigError, match="exceeds tiny's 131,072 positions"):
        calibrate("tiny", "cpu", max_tokens=1024, max_prefix=131072)


def test_the_fit_separates_pairs_over_a_prefix() -> None:
    """Steps timed by a known cost with pairs over a prefix 3x a fresh request's: the fit finds
    both terms (one pair term, as before the split, cannot fit both kinds)."""
    truth = dict(step=1e-3, request=1e-4, token=1e-5, pair=1e-8, prefix_pair=3e-8, prefix=5e-7)
    samples = []
    for point in design(2048, with_l2=False):
        chunks = list(zip(point.prefixes, point.extend, strict=True))
        pairs = sum(e * (p + e / 2) for p, e in chunks)
        over = sum(e * (p + e / 2) for p, e in chunks if p)
        work = StepWork(sum(point.extend), 0, 0, 0.0, requests=len(chunks),
                        attention_pairs=pairs, prefix_tokens=sum(point.prefixes),
                        prefix_pairs=over)  # fmt: skip
        seconds = (truth["step"] + truth["request"] * len(chunks) + truth["token"] * sum(point.extend)
                   + truth["pair"] * (pairs - over) + truth["prefix_pair"] * over
                   + truth["prefix"] * sum(point.prefixes))  # fmt: skip
        samples.append(Sample(point, work, seconds, 0.0))
    fitted = fit_compute([s.work for s in samples], [s.seconds for s in samples])
    assert fitted == pytest.approx(tuple(truth.values()), rel=1e-6)
