"""``kvstrata bench remote``: a small run verifies every byte and ends in its JSON line."""

from __future__ import annotations

import json
import shutil

import pytest

from kvstrata.cli import main

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None,
    reason="redis-server / redis-benchmark are not installed (scripts/setup.sh installs them)",
)


def test_a_small_run_round_trips_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "remote", "--gib", "0.002", "--layers", "2", "--kv-heads", "2"]
    argv += ["--head-dim", "16", "--page-size", "16", "--repeat", "2", "--ticket-pages", "5"]
    argv += ["--batch-pages", "3", "--threads", "2"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["bench"] == "remote" and doc["verified"]
    page_bytes = 16 * 2 * 2 * (2 * 16 * 2)  # tokens x layers x (K, V) x (heads x dim x bf16)
    assert doc["page_bytes"] == page_bytes and doc["pages"] == int(0.002 * 2**30) // page_bytes
    assert doc["value_bytes"] == 64 + page_bytes // 2 and doc["keys"] == 2 * doc["pages"]
    for op in ("publish", "set", "fetch", "get"):
        assert len(doc["rounds_gbps"][op]) == 2 and doc[f"{op}_gbps"] > 0
    assert doc["verify_failures"] == doc["writes_skipped"] == 0
    assert any(line.startswith("fetch") for line in lines)


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "remote", "--gib", "0"]) == 2
    assert "--gib must lie in" in capsys.readouterr().err
    assert main(["bench", "remote", "--batch-pages", "0"]) == 2
