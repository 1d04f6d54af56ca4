"""The disk tier under faults: corrupt bytes, truncated or foreign slabs, bad index entries, I/O
errors, read-only and full filesystems. Each must end as a counted miss or a refusal to start
with a clear message: never wrong bytes, never a crash, never a hang."""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch
from disk_rig import (
    NS,
    expected_page,
    hashes,
    host_pool,
    open_store,
    patch_slot_io,
    read_page,
    spill_all,
    wait_until,
    write_page,
)

from kvstrata.errors import DiskFormatError, DiskStoreError
from kvstrata.tiers.disk_audit import audit_directory
from kvstrata.tiers.disk_dir import index_dir
from kvstrata.tiers.disk_format import SLOT_HEADER_BYTES, SlabFile, aligned_buffer, crc32c
from kvstrata.tiers.disk_index import DiskIndex
from kvstrata.tiers.disk_store import DiskConfig, DiskStore


def _slab(store: DiskStore, kind: int) -> Path:
    return store._slabs[kind].path


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x04]))


@pytest.mark.parametrize(
    ("kind", "where"),
    [
        (0, 17),
        (1, 40),
        (2, 60),
        (0, SLOT_HEADER_BYTES + 3),
        (1, SLOT_HEADER_BYTES + 200),
        (2, SLOT_HEADER_BYTES + 10),
    ],
    ids=[
        "k-header-kind",
        "v-header-hash",
        "draft-header-crc",
        "k-payload",
        "v-payload",
        "draft-payload",
    ],
)
def test_a_flipped_bit_is_a_counted_miss(tmp_path: Path, kind: int, where: int) -> None:
    pool, dst = host_pool(), host_pool()
    pages = hashes(3)
    with open_store(tmp_path / "l3") as store:
        spill_all(store, pool, pages, ticket=1)
        slot = store.pool.slot_of(pages[1])
        assert slot is not None
        _flip(_slab(store, kind), store._slabs[kind].geometry.slot_offset(slot) + where)
        dst.tensors()[0].view(torch.uint8).fill_(0xAB)  # a sentinel the failed page must keep
        before = read_page(dst, 11)
        ok = store.read(pages, dst, [10, 11, 12])
        assert ok[:2] == [True, False]  # page 2 may have been read alongside page 1
        assert read_page(dst, 10) == expected_page(dst, pages[0])
        assert not ok[2] or read_page(dst, 12) == expected_page(dst, pages[2])
        assert read_page(dst, 11) == before  # nothing of the bad page reached the host pool
        assert store.stats().verify_failures == 1
        wait_until(lambda: store.lookup(pages) == 1)  # dropped from the index
        assert store.read(pages[2:], dst, [12]) == [True]
        assert read_page(dst, 12) == expected_page(dst, pages[2])
        assert store.check() == []
        assert pages[1] in store.poll().dropped


def test_a_truncated_slab_is_a_miss_then_repaired_on_load(tmp_path: Path) -> None:
    pool, dst = host_pool(), host_pool()
    pages = hashes(10)
    with open_store(tmp_path, pages=20) as store:
        spill_all(store, pool, pages, ticket=1)
        geom = store._slabs[0].geometry
        os.truncate(_slab(store, 0), geom.slot_offset(8) + 100)
        assert store.read(pages, dst, list(range(10))) == [True] * 8 + [False] * 2
        dropped = store.stats().read_errors  # 2 when page 9 was read alongside page 8
        assert dropped in (1, 2)
    with open_store(tmp_path, pages=20, start="load") as store:
        stats = store.stats()
        assert stats.load_truncated == 1 and stats.load_pages == 8
        assert stats.load_dropped == 2 - dropped  # what the reads did not drop, load did
        assert _slab(store, 0).stat().st_size == geom.file_bytes
        assert store.lookup(pages) == 8 and store.check() == []
        spill_all(store, pool, pages, ticket=2)
        assert store.read(pages, dst, list(range(10))) == [True] * 10


def test_slabs_and_indexes_of_another_format_version_are_refused(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        path = _slab(store, 1)
    raw = bytearray(path.read_bytes()[:4096])
    struct.pack_into("<H", raw, 8, 2)  # format version 2, with a valid CRC
    from kvstrata.tiers import disk_format

    head = disk_format._SUPER_HEAD.size
    struct.pack_into("<I", raw, head, crc32c(bytes(raw[:head])))
    with open(path, "r+b") as f:
        f.write(raw)
    with pytest.raises(DiskFormatError, match="format version 2"):
        open_store(tmp_path, start="load")
    with open_store(tmp_path, start="clear"):  # clear recreates the slab
        pass
    env = lmdb.open(str(index_dir(tmp_path, NS.digest, 0)), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"format", struct.pack("<I", 99))
    env.close()
    with pytest.raises(DiskFormatError, match="another format"):
        open_store(tmp_path, start="load")


def test_an_index_entry_past_the_slab_is_a_miss(tmp_path: Path) -> None:
    pool, dst = host_pool(), host_pool()
    pages = hashes(3)
    with open_store(tmp_path, pages=20) as store:
        spill_all(store, pool, pages[:1], ticket=1)
        assert store._index is not None
        store._index.put_pages(NS.digest, 0, [(pages[1], 25, 1)], 3)  # slot 25 of 20
        # The running store answers from the pages it wrote (its slot pool), so an entry
        # written behind its back is a miss; its check finds it, and fix drops it.
        assert store.lookup(pages) == 1
        assert store.read(pages[:2], dst, [0, 1]) == [True, False]
        assert "past-slab" in {p.kind for p in store.check()}
        store.check(fix=True)
        assert store.check() == [] and store.lookup(pages) == 1
    index = DiskIndex(index_dir(tmp_path, NS.digest, 0))
    index.put_pages(NS.digest, 0, [(pages[2], 1000, 1)], 3)
    index.close()
    assert "past-slab" in {p.kind for p in audit_directory(tmp_path).all_problems}
    with open_store(tmp_path, pages=20, start="load") as store:
        assert store.stats().load_dropped == 1 and store.lookup(pages) == 1


def test_io_errors_are_counted_and_leak_no_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, dst = host_pool(), host_pool()
    pages = hashes(6)

    def write_fails_on_slot_1(slab: SlabFile, slot: int) -> None:
        if slot == 1:
            raise OSError(errno.EIO, "injected")

    with open_store(tmp_path, pages=20) as store:
        with monkeypatch.context() as patch:  # during the first spill, slot 1 cannot be written
            patch_slot_io(patch, "write", write_fails_on_slot_1)
            (done,) = spill_all(store, pool, pages[:3], ticket=1).spilled
        assert done.failed == (pages[1],) and set(done.durable) == {pages[0], pages[2]}
        assert store.stats().write_errors == 1 and store.stats().used_slots == 2
        monkeypatch.setattr(
            SlabFile, "sync", lambda self: (_ for _ in ()).throw(OSError(errno.EIO, "sync"))
        )
        (done,) = spill_all(store, pool, pages[3:], ticket=2).spilled
        assert done.failed == tuple(pages[3:]) and store.stats().used_slots == 2
        monkeypatch.undo()
        monkeypatch.setattr(
            DiskIndex, "put_pages", lambda *a: (_ for _ in ()).throw(lmdb.MapFullError("full"))
        )
        (done,) = spill_all(store, pool, pages[3:], ticket=3).spilled
        assert done.failed == tuple(pages[3:]) and store.stats().write_errors == 1 + 3 + 3
        monkeypatch.undo()
        (done,) = spill_all(store, pool, pages, ticket=4).spilled
        assert done.durable == tuple(pages) and store.stats().used_slots == 6
        assert store.check() == []

        def read_fails(slab: SlabFile, slot: int) -> None:
            if slot == store.pool.slot_of(pages[4]):
                raise OSError(errno.EIO, "injected")

        patch_slot_io(monkeypatch, "read", read_fails)
        assert store.read(pages, dst, list(range(6)))[:5] == [True] * 4 + [False]
        assert store.stats().read_errors == 1
        wait_until(lambda: store.lookup(pages) == 4)
        monkeypatch.undo()
        assert store.check() == [] and store.stats().used_slots == 5


def test_a_read_waits_a_bounded_time(tmp_path: Path) -> None:
    pool = host_pool()
    pages = hashes(2)
    with open_store(tmp_path, io_timeout_s=0.2) as store:
        spill_all(store, pool, pages, ticket=1)
        with store._reader._read_lock:  # another read that never ends
            assert store.read(pages, pool, [5, 6]) == [False, False]
        assert store.stats().read_errors == 2
        # The stuck read gone, reads work again (with room for a loaded machine's slow reads:
        # 0.2 s is for the wait above, not for reading two pages).
        store._reader.io_timeout_s = 30.0
        assert store.read(pages, pool, [5, 6]) == [True, True]


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, *options: str) -> Iterator[Path]:
    """A fresh tmpfs at ``path`` (root only); skips the test where mounting is not allowed."""
    path.mkdir()
    opts = ",".join([f"size={size}", *options])
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True
        ).returncode
    ):
        pytest.skip("needs root and mount to make a small or read-only filesystem")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:  # permissions stop everyone but root
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(DiskStoreError, match="writable directory"):
            open_store(ro)
        return
    with (
        _tmpfs(tmp_path / "ro", "4m", "ro") as ro,
        pytest.raises(DiskStoreError, match="writable directory"),
    ):
        open_store(ro / "l3")
    with _tmpfs(tmp_path / "rw", "16m") as rw:
        pages = hashes(2)
        with open_store(rw) as store:
            spill_all(store, host_pool(), pages, ticket=1)
        subprocess.run(["mount", "-o", "remount,ro", str(rw)], check=True)
        with pytest.raises(
            DiskStoreError, match="Read-only file system; give the disk tier a writable"
        ):
            open_store(rw, start="load")


def test_a_full_disk_is_refused_at_start_and_met_by_preallocation(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "small", "3m") as small:
        with pytest.raises(DiskStoreError, match="needs .* GiB .* free"):
            open_store(small, pages=400)  # 4.7 MiB of slabs (12 KiB pages)
        pool, dst = host_pool(), host_pool()
        first, later = hashes(5, seed=1), hashes(20, seed=2)
        with open_store(small, pages=40) as store:
            spill_all(store, pool, first, ticket=1)
            filler = small / "filler"
            with open(filler, "wb", buffering=0) as f:
                for chunk in (65536, 4096, 1):  # fill the filesystem to the last byte
                    with contextlib.suppress(OSError):
                        while True:
                            f.write(b"\0" * chunk)
            for t, page in enumerate(later):  # slabs and index are preallocated: no failure
                (done,) = spill_all(store, pool, [page], ticket=2 + t).spilled
                assert done.durable == (page,)
            assert store.read(first + later, dst, list(range(25))) == [True] * 25
            assert all(
                read_page(dst, i) == expected_page(dst, h) for i, h in enumerate(first + later)
            )
            assert store.stats().write_errors == 0 and store.check() == []
            filler.unlink()


def test_budget_larger_than_the_disk_is_refused(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(DiskStoreError, match="lower the disk budget"):
        DiskStore(NS, 0, DiskConfig(tmp_path, free * 2))
    assert not any((tmp_path / "slabs").glob("*.slab"))


def test_a_read_racing_gcs_reuse_of_its_slot_is_a_race_not_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """GC deletes a page's entries, then reuses its slot for another page; a read that looked
    the page up before and reads the slot after sees the other page's header. That is a
    read_race (silent), not a verify failure with a corruption warning."""
    pool, dst = host_pool(), host_pool()
    pages = hashes(2)
    with open_store(tmp_path, pages=20) as store:
        spill_all(store, pool, pages, ticket=1)
        victim, other = (store.pool.slot_of(h) for h in pages)
        assert victim is not None and other is not None
        real_read = SlabFile.read_slot
        raced = []

        def gc_meanwhile(slab: SlabFile, slot: int) -> None:
            if slot == victim and not raced:  # what GC does between lookup and read
                raced.append(slot)
                assert store._index is not None
                with store._state_lock:  # the plan takes it from the pool first
                    store.pool.remove(pages[0])
                store._index.delete_pages(NS.digest, [(pages[0], victim)], 3, rank=0)
                for each in store._slabs:
                    scratch = memoryview(aligned_buffer(each.geometry.slot_bytes))  # O_DIRECT
                    real_read(each, other, scratch)
                    os.pwrite(each._fd, scratch, each.geometry.slot_offset(victim))

        patch_slot_io(monkeypatch, "read", gc_meanwhile)
        caplog.set_level("WARNING")
        assert store.read(pages[:1], dst, [0]) == [False]
        stats = store.stats()
        assert raced and stats.read_races == 1 and stats.verify_failures == 0
        assert not [r for r in caplog.records if "a miss, the page is dropped" in r.getMessage()]


def test_a_failed_gc_delete_with_its_victim_spilled_again_leaves_a_clean_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC's delete fails while the same job spills one of its victims again: the victim's old
    slot, whose entries still name it, is withheld until they are deleted, never handed out
    (it went back to the free list, and the page was named at two slots; found by review)."""
    pool = host_pool()
    with open_store(tmp_path, pages=10, high_watermark=0.9, low_watermark=0.5) as store:
        old = hashes(9, seed=1)
        spill_all(store, pool, old, 0)  # slots 0..8
        real = DiskIndex.delete_pages
        calls: list[int] = []

        def fail_once(self: DiskIndex, *a: object, **k: object) -> None:
            if not calls:
                calls.append(1)
                raise lmdb.Error("injected")
            real(self, *a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(DiskIndex, "delete_pages", fail_once)
        job = [*hashes(5, seed=2), old[0]]  # GC takes old[0..3]; old[0] is spilled again
        for slot, h in enumerate(job):
            write_page(pool, slot, h)
        assert store.spill(1, [(h, s, 1) for s, h in enumerate(job)], pool)
        assert store.flush(30)
        store.poll()
        assert calls and store.check() == []
        assert store.stats().index_errors == 1
