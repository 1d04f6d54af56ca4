"""``kvstrata bench tiers`` on the CPU (tiny model): every tier's TTFT and dd's read in one run,
the restarted engine's hit served from disk; the contract is a table, then one JSON line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.benchmarks import tiers


def test_bench_tiers_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--device", "cpu", "--prefix", "256", "--suffix", "32", "--repeats", "1"]
    assert tiers.main([*argv, "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert any(line.startswith("L3 (disk, after restart)") for line in out)
    assert set(result["ttft_ms"]) == {"l1", "l2", "l3", "recompute"}
    assert result["read_bytes"] > 0 and result["dd_read_ms"] > 0
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
