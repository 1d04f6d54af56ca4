"""``kvstrata bench radix`` against its peer, SGLang's Rust token tree (``peers/sglang-tree``).

The peer tests need the built binary and skip, naming the build command, where it is absent; the
rest (finding the peer, a failing peer, running without one) need no binary.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvstrata.benchmarks import radix, radix_peer
from kvstrata.errors import ConfigError, PeerError
from kvstrata.workloads import shared_synthetic as synthetic

needs_peer = pytest.mark.skipif(
    not os.access(radix_peer.DEFAULT_PEER, os.X_OK),
    reason=f"peer not built ({'cargo absent' if shutil.which('cargo') is None else 'no binary'}):"
    f" {radix_peer.BUILD_COMMAND}",
)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@needs_peer
def test_peer_matches_the_reference_at_page_1(tmp_path: Path) -> None:
    """With no eviction the peer's matched lengths are the workload's tree-free reference."""
    requests = [np.array(r, dtype=np.uint32) for r in synthetic.generate(0, 2000)]
    dump = tmp_path / "w.bin"
    radix_peer.write_dump(requests, dump)
    stats = radix_peer.run_peer(radix_peer.DEFAULT_PEER, dump, 1, 262_144)
    assert stats.noevict_matched_checksum == radix.KNOWN_REFERENCES[(0, 2000)][1]
    assert stats.requests == 2000 and stats.evictions > 0  # the budgeted replay did evict


def test_dump_reads_back_as_the_workload_writes_it(tmp_path: Path) -> None:
    raw = synthetic.generate(3, 5)
    radix_peer.write_dump([np.array(r, dtype=np.uint32) for r in raw], tmp_path / "a.bin")
    synthetic.dump(raw, str(tmp_path / "b.bin"))
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


@needs_peer
def test_bench_json_has_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    code = radix.main(["--requests", "60", "--page-sizes", "1", "16", "--rounds", "2"])
    out = capsys.readouterr().out
    summary = last_json(out)
    assert code == 0
    assert summary["peer"]["binary"] == str(radix_peer.DEFAULT_PEER)
    assert summary["peer_reason"] is None
    for row in summary["results"]:
        assert row["peer_reference_ok"] and row["reference_ok"]
        assert len(row["peer_rounds_requests_per_s"]) == 2
        kv = np.median(row["rounds_requests_per_s"])
        assert row["ratio"] == pytest.approx(
            kv / np.median(row["peer_rounds_requests_per_s"]), rel=1e-2, abs=1e-4
        )
    assert " ratio " in out


def test_without_a_peer_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert radix.main(["--requests", "10", "--page-sizes", "16", "--rounds", "1", "--no-peer"]) == 0
    out = capsys.readouterr().out
    summary = last_json(out)
    assert out.startswith("peer: none (--no-peer)")
    assert summary["peer"] is None and summary["peer_reason"] == "--no-peer"
    assert "ratio" not in summary["results"][0]


def test_an_unbuilt_default_peer_names_the_build_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(radix_peer, "DEFAULT_PEER", tmp_path / "sglang-tree-bench")
    binary, reason = radix_peer.find_peer(None)
    assert binary is None and reason is not None and radix_peer.BUILD_COMMAND in reason


def test_an_explicit_peer_that_is_not_a_program_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("not a program")
    for path in (str(tmp_path / "x"), str(tmp_path / "missing")):
        with pytest.raises(ConfigError, match="--peer"):
            radix_peer.find_peer(path)


@pytest.mark.parametrize(
    ("script", "match"),
    [("echo broken >&2; exit 3", "status 3: broken"), ("echo hello", "no result line")],
)
def test_a_failing_peer_is_a_peer_error(tmp_path: Path, script: str, match: str) -> None:
    fake = tmp_path / "peer"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    with pytest.raises(PeerError, match=match):
        radix_peer.run_peer(fake, tmp_path / "w.bin", 16, 1024)
