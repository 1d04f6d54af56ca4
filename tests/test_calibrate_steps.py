"""``kvstrata calibrate --from-steps``: the compute terms fitted to a replay's step log recover
the costs that produced it, a compile stall is left out and counted, and bad input is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstrata.calibrate_steps import fit_steps
from kvstrata.cli import main
from kvstrata.cost import load_profile
from kvstrata.errors import ConfigError
from kvstrata.replay.steps import StepRecord, write_steps

#: The costs the synthetic log is made of; the pair term of requests without a prefix is the base
#: profile's (the fit holds it there: a replay's log hardly determines it).
BASE = load_profile("h200-llama-3.2-1b-bf16")
TRUTH = dict(step_s=0.012, request_s=0.0004, token_s=3.9e-6, pair_s=BASE.pair_s,
             prefix_pair_s=2.5e-10, prefix_s=3e-7)  # fmt: skip


def _log(path: Path, stall_at: int | None = None, n: int = 120) -> Path:
    rng = np.random.default_rng(0)
    records = []
    for i in range(n):
        reqs = int(rng.integers(1, 6))
        extend = [int(rng.integers(16, 2049)) for _ in range(reqs)]
        prefix = [int(rng.integers(0, 60000)) * (j > 0 or i % 3 > 0) for j in range(reqs)]
        pairs = sum(e * (p + e / 2) for p, e in zip(prefix, extend, strict=True))
        over = sum(e * (p + e / 2) for p, e in zip(prefix, extend, strict=True) if p)
        t = (TRUTH["step_s"] + TRUTH["request_s"] * reqs + TRUTH["token_s"] * sum(extend)
             + TRUTH["pair_s"] * (pairs - over) + TRUTH["prefix_pair_s"] * over
             + TRUTH["prefix_s"] * sum(prefix))  # fmt: skip
        if i == stall_at:
            t += 1.9  # a kernel compiled mid-replay
        records.append(StepRecord(
            step=i, start_s=float(i), seconds=t, idle_before_s=0.0, add_before_s=0.0,
            kind="batch", requests=reqs, tokens=sum(extend), prefix_tokens=sum(prefix),
            pairs=pairs, prefix_pairs=over, h2d_bytes=0.0, d2h_bytes=0.0, disk_read_bytes=0.0,
            disk_write_bytes=0.0, load_wait_s=0.0, waiting=0, running=reqs, finished=i,
        ))  # fmt: skip
    return write_steps(records, path)


def test_fit_recovers_the_terms_and_leaves_a_stall_out(tmp_path: Path) -> None:
    base = load_profile("h200-llama-3.2-1b-bf16")
    log = _log(tmp_path / "a-measured.jsonl", stall_at=6)
    profile, stats = fit_steps([log], base, "fitted")
    for name, value in TRUTH.items():
        assert getattr(profile, name) == pytest.approx(value, rel=1e-3), name
    assert stats["outliers"] == 1 and stats["fitted"] + stats["held_back"] + 1 == 120
    assert stats["held_back_mean"] < 1e-3
    assert (profile.h2d_gbps, profile.d2h_gbps) == (base.h2d_gbps, base.d2h_gbps)
    assert profile.name == "fitted" and "1 outliers" in profile.provenance.note


def test_cli_writes_a_profile_replay_reads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = _log(tmp_path / "a-measured.jsonl")
    out = tmp_path / "p.json"
    argv = ["calibrate", "--device", "cuda", "--model", "llama-3.2-1b", "--from-steps",
            str(log), "--out", str(out), "--json"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "held back mean" in text and "links from h200-llama-3.2-1b-bf16" in text
    profile = load_profile(str(out))
    assert profile.token_s == pytest.approx(TRUTH["token_s"], rel=1e-3)
    assert json.loads(text.strip().splitlines()[-1])["name"] == "h200-llama-3.2-1b-bf16-steps"


def test_bad_input_is_refused(tmp_path: Path) -> None:
    base = load_profile("h200-llama-3.2-1b-bf16")
    with pytest.raises(ConfigError, match="no such file"):
        fit_steps([tmp_path / "none.jsonl"], base, "x")
    short = _log(tmp_path / "short.jsonl", n=10)
    with pytest.raises(ConfigError, match="at least 20"):
        fit_steps([short], base, "x")
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="not a step log"):
        fit_steps([junk], base, "x")


def test_base_profile_without_steps_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["calibrate", "--base-profile", "x", "--out", str(tmp_path / "p.json")]) != 0
    assert "--base-profile goes with --from-steps" in capsys.readouterr().err
