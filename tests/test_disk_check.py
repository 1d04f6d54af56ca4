"""Tests for ``kvstrata disk check`` (kvstrata.tiers.disk_audit): every inconsistency is named,
--fix repairs it, the exit status says whether the directory is clean."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from disk_rig import NS, hashes, host_pool, open_store, spill_all

from kvstrata.cli import main
from kvstrata.tiers import disk_format
from kvstrata.tiers.disk_audit import audit_directory
from kvstrata.tiers.disk_dir import index_dir
from kvstrata.tiers.disk_format import SLOT_HEADER_BYTES, SlabGeometry
from kvstrata.tiers.disk_index import DiskIndex, encode_key, encode_value

PAGES = hashes(6)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """A clean directory: six pages of NS, rank 0, in a 20-page store."""
    with open_store(tmp_path, pages=20) as store:
        spill_all(store, host_pool(), PAGES, ticket=1)
    return tmp_path


def _slab(root: Path, kind: int) -> tuple[Path, SlabGeometry]:
    (path,) = (root / "slabs").glob(f"*-r0-{kind}-*.slab")
    geom, _ = disk_format.SlabFile.read_geometry(path)
    assert isinstance(geom, SlabGeometry)
    return path, geom


def _slot_of(root: Path, page: bytes) -> int:
    index = DiskIndex(index_dir(root, NS.digest, 0))
    entry = index.scan(NS.digest, 0, 3).get(page)
    index.close()
    assert entry is not None
    return entry.slot


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 1]))


def _payload_bit(root: Path) -> None:
    path, geom = _slab(root, 1)
    _flip(path, geom.slot_offset(_slot_of(root, PAGES[2])) + SLOT_HEADER_BYTES + 5)


def _header_bit(root: Path) -> None:
    path, geom = _slab(root, 0)
    _flip(path, geom.slot_offset(_slot_of(root, PAGES[2])) + 20)


def _put(root: Path, entries: list[tuple[bytes, int, int]], rank: int = 0) -> None:
    """Raw entries ``(page, kind, slot)``."""
    index = DiskIndex(index_dir(root, NS.digest, 0))
    with index.env.begin(write=True, db=index._pages) as txn:
        for page, kind, slot in entries:
            txn.put(encode_key(NS.digest, slot, kind), encode_value(page, rank, 1))
    index.close()


def _past_slab(root: Path) -> None:
    _put(root, [(PAGES[0], k, 500) for k in range(3)])


def _incomplete(root: Path) -> None:
    slot = _slot_of(root, PAGES[1])
    index = DiskIndex(index_dir(root, NS.digest, 0))
    index.delete_keys([encode_key(NS.digest, slot, 2)])
    index.close()


def _slot_mismatch(root: Path) -> None:
    _put(root, [(PAGES[1], k, 15) for k in range(3)])  # whole at a second slot


def _slot_shared(root: Path) -> None:
    slot = _slot_of(root, PAGES[3])
    _put(root, [(hashes(1, seed=5)[0], 0, slot)])  # another page's payload 0 entry


def _truncated(root: Path) -> None:
    path, geom = _slab(root, 2)
    os.truncate(path, geom.slot_offset(_slot_of(root, PAGES[5])) + 10)


def _foreign_version(root: Path) -> None:
    path, _ = _slab(root, 1)
    raw = bytearray(path.read_bytes()[:4096])
    struct.pack_into("<H", raw, 8, 7)
    head = disk_format._SUPER_HEAD.size
    struct.pack_into("<I", raw, head, disk_format.crc32c(bytes(raw[:head])))
    with open(path, "r+b") as f:
        f.write(raw)


def _missing_slab(root: Path) -> None:
    _slab(root, 2)[0].unlink()


def _orphan_rank(root: Path) -> None:
    _put(root, [(hashes(1, seed=8)[0], k, 19) for k in range(3)], rank=3)


def _malformed(root: Path) -> None:
    index = DiskIndex(index_dir(root, NS.digest, 0))
    with index.env.begin(write=True, db=index._pages) as txn:
        txn.put(b"short key", b"value")
    index.close()


CASES: dict[str, tuple[Callable[[Path], None], set[str], int]] = {
    # name: (corruption, problem kinds reported, pages that check out after --fix)
    "payload-bit": (_payload_bit, {"bad-slot"}, 5),
    "header-bit": (_header_bit, {"bad-slot"}, 5),
    "past-slab": (_past_slab, {"past-slab"}, 6),  # a second, bad claim: the page stays
    "incomplete": (_incomplete, {"page-incomplete"}, 5),
    "slot-mismatch": (_slot_mismatch, {"slot-mismatch"}, 5),
    "slot-shared": (_slot_shared, {"slot-shared"}, 5),
    "truncated": (_truncated, {"slab-truncated", "bad-slot"}, 5),
    "foreign-version": (
        _foreign_version,
        {"slab-superblock", "group-incomplete", "entry-orphan"},
        0,
    ),
    "missing-slab": (_missing_slab, {"group-incomplete", "entry-orphan"}, 0),
    "orphan-rank": (_orphan_rank, {"entry-orphan"}, 6),
    "malformed": (_malformed, {"entry-malformed"}, 6),
}


def test_a_clean_directory(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["disk", "check", str(store_dir), "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].endswith("CLEAN")
    doc = json.loads(out[-1])
    assert doc["clean"] and doc["problems"] == [] and doc["groups"][0]["pages"] == 6


@pytest.mark.parametrize("case", list(CASES))
def test_each_inconsistency_is_reported_and_fixed(
    store_dir: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt, kinds, left = CASES[case]
    corrupt(store_dir)
    assert main(["disk", "check", str(store_dir), "--json"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "DIRTY" in out[-2]
    assert {p["kind"] for p in json.loads(out[-1])["problems"]} == kinds
    assert main(["disk", "check", str(store_dir), "--fix"]) == 0
    assert "FIXED" in capsys.readouterr().out
    assert main(["disk", "check", str(store_dir)]) == 0
    report = audit_directory(store_dir)
    assert report.clean and sum(len(g.pages) for g in report.groups) == left
    with open_store(store_dir, pages=20, start="load") as store:  # and a store can use it
        assert store.stats().load_dropped == 0 and store.stats().used_slots == left
        spill_all(store, host_pool(), PAGES, ticket=2)
        assert store.check() == []


def test_quick_checks_headers_only(store_dir: Path) -> None:
    _payload_bit(store_dir)
    assert main(["disk", "check", str(store_dir), "--quick"]) == 0
    assert main(["disk", "check", str(store_dir)]) == 1
    _header_bit(store_dir)
    assert main(["disk", "check", str(store_dir), "--quick"]) == 1


def test_bad_input_exits_2_and_a_running_store_is_reported_in_use(
    tmp_path: Path, store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["disk", "check", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvstrata disk: error:")
    assert "not a kvstrata disk directory" in err[0]
    with open_store(store_dir, pages=20, start="load"):
        assert main(["disk", "check", str(store_dir), "--json"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert "in use, not checked" in out[-2]
        assert json.loads(out[-1])["in_use"] == [f"{NS.short}-r0"]
    with pytest.raises(SystemExit) as exit_info:
        main(["disk", "check"])
    assert exit_info.value.code == 2


def test_fix_beside_a_starting_store_touches_nothing_of_its_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A store that is starting holds its group's lock while its slab is still being made (no
    superblock yet) and its index has entries its slabs do not back yet. --fix must neither
    unlink that slab nor delete those entries: the group is in use, reported, not judged."""
    from kvstrata.tiers.disk_format import RankLock, lock_path

    root = tmp_path / "l3"
    with open_store(root, pages=20) as store:
        spill_all(store, host_pool(), PAGES, ticket=1)
    slab, _ = _slab(root, 2)
    slab.write_bytes(bytes(8192))  # being created, in place, as kvstrata before 0.1 did
    (other, _) = _slab(root, 1)
    other.unlink()  # ... and this one not yet
    lock = RankLock(lock_path(root / "slabs", NS.digest, 0))  # the starting store
    try:
        assert main(["disk", "check", str(root), "--fix", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert doc["in_use"] == [f"{NS.short}-r0"] and doc["problems"] == []
        assert slab.read_bytes() == bytes(8192)
    finally:
        lock.release()
    index = DiskIndex(index_dir(root, NS.digest, 0))
    assert sum(1 for _ in index.items()) == len(PAGES) * 3  # every entry still there
    index.close()


def test_index_deletes_only_the_entries_that_still_name_the_page(tmp_path: Path) -> None:
    """``DiskIndex.delete_pages`` (GC's and a drop's deletes) removes a slot's entries only where
    they name that page (and rank, when given): another page's entries at the slot, another
    rank's, and a value of a foreign length stay, byte for byte."""
    index = DiskIndex(tmp_path / "index")
    a, b, c = hashes(3, seed=7)
    index.put_pages(NS.digest, 0, [(a, 1, 5), (b, 2, 6)], 2)
    index.put_pages(NS.digest, 1, [(c, 3, 7)], 2)
    odd = encode_key(NS.digest, 4, 0)
    with index.env.begin(write=True, db=index._pages) as txn:
        txn.put(odd, a + b"\0")  # not a value of this format
    before = dict(index.items(NS.digest))
    index.delete_pages(NS.digest, [(b, 1), (a, 3), (a, 4), (c, 3)], 2, rank=0)
    assert dict(index.items(NS.digest)) == before  # nothing named those pages at those slots
    index.delete_pages(NS.digest, [(a, 1), (c, 3)], 2, rank=0)  # c is rank 1's
    after = dict(index.items(NS.digest))
    assert set(before) - set(after) == {encode_key(NS.digest, 1, k) for k in range(2)}
    assert all(after[k] == v for k, v in before.items() if k in after)
    index.delete_pages(NS.digest, [(c, 3), (b, 2)], 2)  # any rank
    assert set(index.items(NS.digest)) == {(odd, a + b"\0")}
    index.close()
