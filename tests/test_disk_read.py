"""Verified reads of the disk tier with more pages than reads in flight: when one page fails,
the reads already in flight still land, each reported against its own page. A read is made of
runs of consecutive slots; with one page a run, six runs are in flight at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from disk_rig import (
    expected_page,
    hashes,
    host_pool,
    open_store,
    patch_slot_io,
    read_page,
    spill_all,
    write_page,
)

from kvstrata.tiers import disk_read
from kvstrata.tiers.disk_format import ALIGN, SLOT_HEADER_BYTES, SlabFile


@pytest.mark.parametrize("run_pages", [1, 12])
def test_a_failed_page_in_a_long_read_reports_every_other_page_as_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_pages: int
) -> None:
    monkeypatch.setattr(disk_read, "RUN_BYTES", run_pages * ALIGN)  # this layout's slots: 4 KiB
    pool, dst = host_pool(), host_pool()
    pages = hashes(12)
    with open_store(tmp_path / "l3", read_threads=3) as store:  # 6 reads in flight
        spill_all(store, pool, pages, ticket=1)
        slot = store.pool.slot_of(pages[5])
        assert slot is not None
        path = store._slabs[0].path
        at = store._slabs[0].geometry.slot_offset(slot) + SLOT_HEADER_BYTES + 3
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x04]))
        for t in dst.tensors():
            t.view(torch.uint8).fill_(0xAB)
        sentinel = read_page(dst, 20)
        targets = list(range(20, 32))
        ok = store.read(pages, dst, targets)
        assert ok[:6] == [True] * 5 + [False]
        for i, good in enumerate(ok):  # True means: that host slot holds that page
            want = expected_page(dst, pages[i]) if good else None
            assert not good or read_page(dst, targets[i]) == want, f"page {i}"
        if run_pages == 1:  # the pages after the last one in flight were never read
            assert not ok[11] and read_page(dst, 31) == sentinel
        else:  # one run: every other page was read alongside the bad one, and is its own
            assert ok == [True] * 5 + [False] + [True] * 6


def test_a_timed_out_read_never_writes_into_its_host_slots_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stuck past io_timeout_s and then landing must not copy into host slots read()
    reported False: the caller reuses them (found by review: the late copy wrote another
    page's bytes into a slot the caller had filled)."""
    pool = host_pool()
    hs = hashes(4)
    with open_store(tmp_path, io_timeout_s=0.3) as store:
        spill_all(store, pool, hs, ticket=1)  # slots 0..3

        def before(slab: SlabFile, slot: int) -> None:
            if slot == 0:
                raise OSError(5, "EIO")  # run 0 fails at once
            if slot == 2 and slab.geometry.payload_kind == 0:
                time.sleep(1.0)  # run 1 is stuck past io_timeout_s, then completes

        patch_slot_io(monkeypatch, "read", before)
        # The failed pages' drops queue behind the writer, which a stalling disk holds up too:
        # held back here until the stuck run has landed (its index check still finds them).
        held: list[tuple[bytes, int]] = []
        real_drop = store._reader._drop
        monkeypatch.setattr(store._reader, "_drop", lambda h, slot: held.append((h, slot)))
        assert store.read([hs[0], hs[2]], pool, [10, 11]) == [False, False]
        other = hashes(1, seed=99)[0]
        write_page(pool, 11, other)  # the caller reuses host slot 11: read() said False
        time.sleep(2.5)  # the stuck run lands
        monkeypatch.undo()
        for h, slot in held:
            real_drop(h, slot)
        assert read_page(pool, 11) == expected_page(pool, other)


def test_the_gate_lets_runs_copy_at_once_and_close_waits_for_them() -> None:
    """Two runs copy at the same time; ``close`` returns only once both left, and no run enters
    after it."""
    from kvstrata.tiers.disk_read import _Gate

    gate = _Gate()
    assert gate.enter() and gate.enter()  # both copying at once
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (gate.close(), closed.set()), daemon=True)
    closer.start()
    assert not closed.wait(0.2), "close returned while two runs were copying"
    gate.leave()
    assert not closed.wait(0.2), "close returned while a run was copying"
    gate.leave()
    assert closed.wait(10)
    closer.join(10)
    assert not gate.enter()
