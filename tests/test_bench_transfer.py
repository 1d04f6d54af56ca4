"""Smoke test of ``kvstrata bench transfer`` on the CPU path: a table, then one JSON line."""

from __future__ import annotations

import json

import pytest

from kvstrata.cli import main


def test_bench_transfer_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "transfer", "--device", "cpu", "--pages", "16", "--page-size", "4"]
    assert main([*argv, "--layers", "2", "--repeats", "2", "--warmup", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["bench"] == "transfer" and summary["device"] == "cpu"
    rows = summary["results"]
    assert {(r["geometry"], r["layout"], r["direction"]) for r in rows} == {
        (g, layout, d)
        for g in ("gqa", "mla")
        for layout in ("layer_first", "page_first")
        for d in ("d2h", "h2d")
    }
    assert all(r["verified"] and r["gbps"] > 0 and r["kernel"] == "torch" for r in rows)
    assert (
        rows[0]["bytes"] == 16 * 4 * 2 * 8 * 128 * 2
    )  # pages x tokens x (K, V) x heads x dim x bf16
    assert lines[0].startswith("geometry")
