"""``kvstrata bench disk``: a small run verifies every byte and ends in its JSON line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli import main


def test_a_small_run_round_trips_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "disk", "--dir", str(tmp_path), "--gib", "0.004", "--layers", "2"]
    argv += ["--kv-heads", "2", "--head-dim", "16", "--page-size", "16", "--repeat", "2"]
    argv += ["--io-mode", "buffered", "--ticket-pages", "5", "--read-pages", "7"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["bench"] == "disk" and doc["verified"] and doc["io_mode"] == "buffered"
    page_bytes = 16 * 2 * 2 * (2 * 16 * 2)  # tokens x layers x (K, V) x (heads x dim x bf16)
    assert doc["page_bytes"] == page_bytes and doc["pages"] == int(0.004 * 2**30) // page_bytes
    assert len(doc["rounds_gbps"]["spill"]) == 2 and doc["spill_gbps"] > 0
    assert doc["write_errors"] == doc["verify_failures"] == 0
    # Bytes sent to storage while spilling: every slot at least once (None without /proc/self/io).
    assert doc["written_per_slot_byte"] is None or doc["written_per_slot_byte"] >= 0.99
    assert any(line.startswith("reload") for line in lines)
    assert list(tmp_path.iterdir()) == []  # the scratch directory is gone


def test_packed_slots_report_their_own_size_and_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --io-mode packed the slots are 64-byte multiples: the JSON's slot and disk bytes
    (the GB/s figures' bytes) are those slots', not 4 KiB ones."""
    argv = ["bench", "disk", "--dir", str(tmp_path), "--gib", "0.001", "--layers", "1"]
    argv += ["--kv-heads", "1", "--head-dim", "1", "--dtype", "float32", "--page-size", "16"]
    argv += ["--repeat", "1", "--io-mode", "packed"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["verified"] and doc["io_mode"] == "packed"
    assert doc["slot_bytes"] == 128  # a 64-byte payload (16 tokens x 4 bytes) and its header
    assert doc["disk_bytes"] == -(-doc["pages"] * 2 * 128 // 4096) * 4096


def test_bad_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "disk", "--dir", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["bench", "disk", "--dir", str(tmp_path), "--gib", "0"]) == 2


def test_two_directories_add_rows_for_a_store_striped_over_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    argv = ["bench", "disk", "--dir", str(a), "--dir", str(b), "--gib", "0.004", "--layers", "2"]
    argv += ["--kv-heads", "2", "--head-dim", "16", "--page-size", "16", "--repeat", "2"]
    argv += ["--io-mode", "buffered", "--ticket-pages", "5", "--read-pages", "7"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["verified"] and doc["dirs"] == [str(a), str(b)] and doc["devices"] == 1
    striped = doc["striped"]
    assert striped["reload_gbps"] > 0 and striped["spill_gbps"] > 0
    assert len(doc["rounds_gbps"]["reload_all"]) == 2
    assert any(line.startswith("reload x2") for line in lines)
    assert any("on one device" in line for line in lines)  # the note says why it cannot double
    assert list(a.iterdir()) == list(b.iterdir()) == []
    assert main(["bench", "disk", "--dir", str(a), "--dir", str(a)]) == 2
