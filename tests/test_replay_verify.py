"""``--verify`` judges what it finds: another model's KV served from the disk tier, or pages that
pass every checksum but hold another page's KV, fail the run (exit 1, ``ok: false``); honest runs
pass; the tolerance comes from the dtype unless ``--verify-atol`` gives it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstrata.cli import main
from kvstrata.engine import EngineConfig
from kvstrata.errors import ConfigError
from kvstrata.model.compute import ModelCompute
from kvstrata.model.loader import load_model
from kvstrata.replay import (
    VERIFY_ATOL,
    ReplayConfig,
    ReplaySummary,
    VerifyReport,
    compare_argmax,
    run_replay,
)
from kvstrata.tiers.disk_format import (
    SLOT_HEADER_BYTES,
    SlabFile,
    SlabGeometry,
    SlotHeader,
    crc32c,
    decode_slot_header,
)

#: The issue's repro: small L1 and L2 in front of a disk tier, so a second run hits L3 at once.
TIERS = ["--l1-tokens", "1024", "--l2-tokens", "2048", "--l3-gib", "0.05"]


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    code = main([*args, "--no-progress", "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]), err


def tiny(seed: int) -> ModelCompute:
    _, model = load_model("tiny", device="cpu", dtype="float32", seed=seed)
    return ModelCompute(model, torch.float32)


def disk_config(l3_dir: Path, start: str) -> EngineConfig:
    return EngineConfig(
        pool_tokens=1024, l2_tokens=2048, l3_dir=str(l3_dir), l3_gib=0.05, l3_start=start
    )


def replay_from_disk(l3_dir: Path, writer: ModelCompute, reader: ModelCompute) -> ReplaySummary:
    """``writer`` fills the disk tier; ``reader`` replays the same workload from it with
    ``--verify``. Both under one model name: a checkpoint rewritten in place, as the namespace
    sees it."""
    run_replay(ReplayConfig(engine=disk_config(l3_dir, "clear")), False, compute=writer)
    cfg = ReplayConfig(verify=8, engine=disk_config(l3_dir, "load"))
    summary = run_replay(cfg, False, compute=reader)
    assert summary.tiers is not None and summary.tiers.l3_hit_tokens > 0  # it read the disk
    return summary


def test_another_models_kv_from_disk_fails_verify(tmp_path: Path) -> None:
    summary = replay_from_disk(tmp_path / "l3", writer=tiny(seed=0), reader=tiny(seed=1))
    verify = summary.verify
    assert verify.max_abs_logit_diff is not None and verify.max_abs_logit_diff > 0.1
    assert not verify.ok and verify.atol == VERIFY_ATOL["float32"]
    assert summary.to_json()["verify"]["ok"] is False
    assert verify.describe().startswith("FAIL: max |logit diff|")


def test_the_same_models_kv_from_disk_passes_verify(tmp_path: Path) -> None:
    summary = replay_from_disk(tmp_path / "l3", writer=tiny(seed=0), reader=tiny(seed=0))
    verify = summary.verify
    assert verify.ok and verify.argmax_flips == 0
    assert verify.max_abs_logit_diff is not None and verify.max_abs_logit_diff < 1e-5


def rotate_disk_pages(l3_dir: Path) -> int:
    """Give every written slot the payload of the next written slot of its slab, its header
    keeping its page hash and taking the moved payload's CRC: every checksum holds, as after a
    spill that wrote pages under one another's keys. Returns the slots rewritten."""
    moved = 0
    for path in sorted((l3_dir / "slabs").rglob("*.slab")):
        geom, _ = SlabFile.read_geometry(path)
        assert isinstance(geom, SlabGeometry), geom
        data = bytearray(path.read_bytes())
        view = memoryview(data)
        written = []
        for slot in range(geom.num_slots):
            head = decode_slot_header(view[geom.slot_offset(slot) :])
            if isinstance(head, SlotHeader):
                written.append((slot, head))

        starts = [geom.slot_offset(slot) + SLOT_HEADER_BYTES for slot, _ in written]
        payloads = [bytes(data[start : start + geom.payload_len]) for start in starts]
        for i, (slot, head) in enumerate(written):
            body = payloads[(i + 1) % len(written)]
            offset = geom.slot_offset(slot)
            data[offset + SLOT_HEADER_BYTES : offset + SLOT_HEADER_BYTES + len(body)] = body
            SlotHeader(
                head.payload_kind, head.page_hash, head.payload_len, crc32c(body), head.flags
            ).pack_into(view, offset)
            moved += body != payloads[i]
        del view
        path.write_bytes(data)
    return moved


@pytest.mark.slow
def test_checksummed_pages_of_the_wrong_kv_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the CLI: a disk tier whose pages all pass their checksums but hold other pages'
    KV makes ``--verify`` fail with exit 1; the same run on the intact directory passes."""
    runs = {}
    for name, tamper in (("intact", False), ("rotated", True)):
        l3_dir = tmp_path / name
        code, _, _ = cli(["replay", *TIERS, "--l3-dir", str(l3_dir)], capsys)
        assert code == 0
        if tamper:
            assert rotate_disk_pages(l3_dir) > 0
        runs[name] = cli(
            ["replay", *TIERS, "--l3-dir", str(l3_dir), "--l3-start", "load", "--verify", "8"],
            capsys,
        )
    for _, doc, _ in runs.values():
        assert doc["hit_tokens_by_tier"]["l3"] > 0 and doc["tiers"]["l3"]["verify_failures"] == 0
    code, doc, err = runs["intact"]
    assert code == 0 and doc["verify"]["ok"] is True
    code, doc, err = runs["rotated"]
    assert code == 1 and doc["verify"]["ok"] is False
    assert "kvstrata replay: --verify failed: max |logit diff|" in err


def test_verify_atol_overrides_the_dtypes_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    """An honest float32 run differs by about 1e-7: it passes the default and fails at 0."""
    base = ["replay", "--limit", "6", "--verify", "3"]
    code, doc, _ = cli(base, capsys)
    assert code == 0 and doc["verify"]["ok"] is True
    assert doc["verify"]["atol"] == VERIFY_ATOL["float32"] and doc["config"]["verify_atol"] is None
    assert 0 < doc["verify"]["max_abs_logit_diff"] < VERIFY_ATOL["float32"]
    code, doc, err = cli([*base, "--verify-atol", "0"], capsys)
    assert code == 1 and doc["verify"]["ok"] is False
    assert doc["verify"]["atol"] == 0 and doc["config"]["verify_atol"] == 0
    assert "> tolerance 0" in err


def test_an_argmax_flip_fails_only_beyond_the_tolerance() -> None:
    fresh = torch.tensor([1.0, 3.0, 2.995, -1.0])
    near_tie = torch.tensor([1.0, 2.999, 3.0, -1.0])  # top token 2, 0.005 below token 1 in fresh
    assert compare_argmax(fresh, fresh.clone(), 1e-3) == (True, False)
    assert compare_argmax(fresh, near_tie, 1e-2) == (False, False)
    assert compare_argmax(fresh, near_tie, 1e-3) == (False, True)


@pytest.mark.parametrize(
    ("report", "ok"),
    [
        (VerifyReport(3, 1e-4, 1.0, None, 0, atol=1e-3, argmax_flips=0), True),
        (VerifyReport(3, 2e-3, 1.0, None, 0, atol=1e-3, argmax_flips=0), False),
        (VerifyReport(3, 1e-4, 2 / 3, None, 0, atol=1e-3, argmax_flips=1), False),
        (VerifyReport(3, 1e-4, 2 / 3, None, 0, atol=1e-3, argmax_flips=0), True),  # a near-tie
        (VerifyReport(3, 1e-4, 1.0, None, 0, 0.3, 1.0, atol=0.25, argmax_flips=0), False),  # draft
        (VerifyReport(3, None, None, 0), True),  # payload bytes, all equal
        (VerifyReport(3, None, None, 5), False),
        (VerifyReport(0), True),  # nothing sampled
    ],
)
def test_verify_report_ok(report: VerifyReport, ok: bool) -> None:
    assert report.ok is ok
    if report.max_abs_logit_diff is not None:
        assert report.describe().startswith("FAIL") is not ok


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"verify": 2, "verify_atol": -1.0}, "must be >= 0"),
        ({"verify": 2, "verify_atol": float("nan")}, "finite number"),
        ({"verify_atol": 0.1}, "give --verify N too"),
        ({"model": "none", "verify": 2, "verify_atol": 0.1}, "compares payload bytes exactly"),
    ],
)
def test_verify_atol_misuse_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReplayConfig(**fields)  # type: ignore[arg-type]
