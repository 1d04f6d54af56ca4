"""The disk tier decides from the calls made, never from how fast the disk is (issue 20, items 2
and 4): the same spills, reads and touches against a slow disk and a fast one give the same
plans (slots, batches, GC's victims), the same store and, through the engine, the same counts;
a writer that falls behind makes callers wait instead of refusing their work; and the bytes a
spill-heavy run writes stay close to the slot bytes it spills (one index commit per batch, and
accesses kept in memory until close instead of one commit per touch)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from disk_rig import (
    engine_counts,
    expected_page,
    hashes,
    host_pool,
    open_store,
    patch_slot_io,
    read_page,
    wait_until,
    write_page,
)
from test_disk_tier import config

from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.engine import Engine
from kvstrata.model.compute import SyntheticCompute
from kvstrata.residency import Tier
from kvstrata.tiers.disk_format import ALIGN, SlabFile, round_up
from kvstrata.tiers.disk_plan import SpillJob, SpillPlanner
from kvstrata.tiers.disk_store import DiskConfig, DiskStore
from kvstrata.tiers.host_pool import HostPool
from kvstrata.tiers.page_hash import Namespace, page_hashes
from kvstrata.workloads import builtin


def _slow_disk(
    monkeypatch: pytest.MonkeyPatch, write_s: float, sync_s: float, read_s: float
) -> None:
    """Every slot write and read, and every fdatasync of a slab, takes that much longer."""
    patch_slot_io(monkeypatch, "write", lambda slab, slot: time.sleep(write_s))
    patch_slot_io(monkeypatch, "read", lambda slab, slot: time.sleep(read_s))
    real_sync = SlabFile.sync

    def slow_sync(self: SlabFile) -> None:
        time.sleep(sync_s)
        real_sync(self)

    monkeypatch.setattr(SlabFile, "sync", slow_sync)


def _record_plans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    """Every plan the store makes: ``(ticket, batches, victims)``, in the order made."""
    plans: list[tuple[object, ...]] = []
    real_plan = SpillPlanner.plan

    def plan(self: SpillPlanner, job: SpillJob) -> None:
        real_plan(self, job)
        batches = tuple(tuple(b) for b in job.batches)
        plans.append((job.ticket, batches, tuple((h, s) for h, s, _ in job.victims)))

    monkeypatch.setattr(SpillPlanner, "plan", plan)
    return plans


def _spill_without_waiting(store: DiskStore) -> tuple[object, ...]:
    """Twelve spills of six new pages each, never waiting for one to finish, with touches of
    earlier pages, lookups and reads in between, into a store that collects garbage often.
    Returns what the store answered and decided: lookups, reads, the live pages in LRU order
    with their slots, GC's count, pages written."""
    pool, dst = host_pool(slots=72), host_pool()
    order: list[bytes] = []
    answers: list[object] = []
    for t in range(12):
        pages = hashes(6, seed=500 + t)
        for i, h in enumerate(pages):
            write_page(pool, 6 * t + i, h)
        assert store.spill(t, [(h, 6 * t + i, 1) for i, h in enumerate(pages)], pool)
        order += pages
        answers.append(store.lookup(order[-12:]))  # being written counts as there
        if t >= 3:
            store.touch(order[6 * (t - 3) : 6 * (t - 3) + 2])  # a few older pages stay warm
        if t % 4 == 3:
            ok = store.read(order[-3:], dst, [0, 1, 2])  # waits for pages still being written
            answers.append(tuple(ok))
            assert all(read_page(dst, i) == expected_page(dst, h) for i, h in enumerate(order[-3:]))
    assert store.flush(30)
    stats = store.stats()
    return tuple(answers), tuple(store.pool.live()), stats.gc_reclaimed, stats.pages_written


def test_plans_and_the_store_do_not_depend_on_the_disks_speed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches, slots, GC's victims and the LRU order are decided when a spill is submitted, in
    call order: a disk whose writes, syncs and reads are slow gives the same plans and the same
    store (the old writer batched what arrived within LINGER_S of its last write, and applied
    touches whenever it got to them)."""
    cfg: dict[str, Any] = {"pages": 40, "high_watermark": 0.9, "low_watermark": 0.6}
    plans = _record_plans(monkeypatch)
    with open_store(tmp_path / "fast", **cfg) as store:
        fast = _spill_without_waiting(store)
    fast_plans = list(plans)
    plans.clear()
    _slow_disk(monkeypatch, write_s=0.002, sync_s=0.02, read_s=0.001)
    with open_store(tmp_path / "slow", **cfg) as store:
        slow = _spill_without_waiting(store)
    assert fast[2] > 0 and any(victims for *_, victims in fast_plans)  # GC ran, in the plans
    assert slow == fast
    assert plans == fast_plans


def test_more_jobs_than_max_tickets_wait_instead_of_being_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``max_tickets`` jobs running, one more waits for one to finish: a slow disk slows
    the caller down and loses nothing (the old store refused every spill past 64 open
    tickets, and which ones it refused depended on how fast the disk drained)."""
    _slow_disk(monkeypatch, write_s=0.005, sync_s=0.01, read_s=0.0)
    pool, dst = host_pool(slots=64), host_pool(slots=64)
    pages = hashes(40, seed=9)
    for slot, h in enumerate(pages):
        write_page(pool, slot, h)
    with open_store(tmp_path, pages=100, max_tickets=2) as store:
        for t, h in enumerate(pages):  # never polled meanwhile
            assert store.spill(t, [(h, t, 1)], pool)
        assert store.reload(100, pages[:4], dst, [0, 1, 2, 3])
        assert store.flush(30)
        done = store.poll()
        assert store.stats().spills_refused == 0
        assert sorted(d.ticket for d in done.spilled) == list(range(40))
        assert all(len(d.durable) == 1 for d in done.spilled)
        assert [r.ok for r in done.reloaded] == [(True,) * 4]
        assert store.lookup(pages) == 40


def test_a_spill_is_refused_only_when_the_disk_stops_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal is a fault: no job finished within ``io_timeout_s``. It is counted (and so is
    the write that was stuck), and once the disk answers again spills are taken again."""
    stuck = threading.Event()
    patch_slot_io(monkeypatch, "write", lambda slab, slot: stuck.wait(20))
    pool = host_pool()
    pages = hashes(3, seed=4)
    for slot, h in enumerate(pages):
        write_page(pool, slot, h)
    with open_store(tmp_path, max_tickets=1, io_timeout_s=0.3) as store:
        assert store.spill(1, [(pages[0], 0, 1)], pool)
        t0 = time.monotonic()
        assert not store.spill(2, [(pages[1], 1, 1)], pool)
        assert time.monotonic() - t0 >= 0.25  # it waited for room first
        assert store.stats().spills_refused == 1
        # The stuck write of the first page passes io_timeout_s too: a counted write error.
        wait_until(lambda: store.stats().write_errors == 1)
        stuck.set()
        assert store.spill(3, [(pages[2], 2, 1)], pool)
        assert store.flush(30)
        assert store.stats().write_errors == 1 and store.lookup(pages) == 0
        assert store.lookup([pages[2]]) == 1


def _written_bytes() -> int:
    """Bytes this process caused to be sent to storage (/proc/self/io write_bytes: O_DIRECT
    slot writes and LMDB's pages alike)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise AssertionError("no write_bytes in /proc/self/io")


def test_a_spill_heavy_run_writes_little_more_than_its_slots(tmp_path: Path) -> None:
    """100 spills of 16 pages of 40 KiB (1,600 pages into a disk of 400: GC collects 1,240),
    each followed by reads and lookups of recent pages: the bytes written to the slabs and the
    index stay within 1.3x of the slot bytes spilled (1.26x measured; the old store, which
    committed every touch to the index, wrote 1.44x)."""
    if _written_bytes() == 0 and not Path("/proc/self/io").exists():
        pytest.skip("no /proc/self/io")
    layout = KVLayout(
        2, (PayloadSpec("k", (1024,), "bfloat16"), PayloadSpec("v", (1024,), "bfloat16"))
    )
    ns = Namespace.for_layout("amplification", layout, 4)
    page = sum(round_up(64 + ns.payload_bytes(k)) for k in range(2))
    pool = HostPool(layout, 4, 64, pin=False, check_memory=False)
    dst = HostPool(layout, 4, 64, pin=False, check_memory=False)
    store = DiskStore(ns, 0, DiskConfig(tmp_path, 400 * page + 2 * ALIGN))
    before = _written_bytes()
    seqs: list[list[bytes]] = []
    try:
        for t in range(100):
            seq = page_hashes(ns, [(t * 7 + i) % 50_000 for i in range(4 * 16)])
            seqs.append(seq)
            assert store.spill(t, [(h, i, 1) for i, h in enumerate(seq)], pool)
            assert store.flush(30)
            for old in seqs[-3:]:
                store.read(old[:8], dst, list(range(8)))
                store.lookup(old)
            store.poll()
    finally:
        store.close()
    written = _written_bytes() - before
    stats = store.stats()
    assert stats.pages_written == 1600 and stats.gc_reclaimed > 1000
    assert stats.bytes_written == 1600 * page
    assert written <= 1.3 * stats.bytes_written, written / stats.bytes_written


def _engine_counts(tmp: Path) -> dict[str, object]:
    """A small cache-only run with a small L1/L2 and a disk tier that collects garbage."""
    requests = builtin(1000, seed=3, n_requests=120)
    engine = Engine(
        SyntheticCompute(8, 1000),
        config(tmp, pool_tokens=320, l2_tokens=320, l3_gib=0.0005),
        model_id="none:8",
    )
    try:
        engine.run(requests)
    finally:
        engine.close()
    return engine_counts(engine)


def test_the_engine_gives_the_same_counts_on_a_slow_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the engine: hit tokens per tier, pages spilled and reloaded, GC and the tree are
    the same when every write, sync and read of the disk is slow."""
    fast = _engine_counts(tmp_path / "fast")
    _slow_disk(monkeypatch, write_s=0.001, sync_s=0.005, read_s=0.001)
    slow = _engine_counts(tmp_path / "slow")
    assert slow == fast
    assert fast["hit_tokens"][Tier.L3] > 0  # type: ignore[index]
    assert fast["store"][2] > 0 and fast["store"][3] == 0  # type: ignore[index]


def test_a_refused_reload_is_counted_apart_from_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload the store refuses (a disk that stopped answering) was never read: it counts as
    refused, with its pages, not as reload misses (which are pages that did not read back
    verified); the request computes instead."""
    requests = builtin(1000, seed=3, n_requests=60)
    monkeypatch.setattr(DiskStore, "reload", lambda self, *args: False)
    engine = Engine(
        SyntheticCompute(8, 1000),
        config(tmp_path, pool_tokens=320, l2_tokens=320, l3_gib=0.0005),
        model_id="none:8",
    )
    try:
        engine.run(requests)
    finally:
        engine.close()
    assert engine.cache.disk is not None
    stats = engine.cache.disk.stats
    assert stats.reloads_refused > 0 and stats.reload_refused_pages >= stats.reloads_refused
    assert stats.reloads == 0 and stats.reload_misses == 0
    assert engine.hit_tokens[Tier.L3] == 0
