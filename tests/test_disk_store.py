"""Tests for kvstrata.tiers.disk_store: round trips, admission, order, GC, cold starts, threads."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from disk_rig import (
    LAYOUT,
    NS,
    PAGE,
    budget_for,
    expected_page,
    hashes,
    host_pool,
    open_store,
    read_page,
    spill_all,
    wait_until,
    write_page,
)

from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.errors import ConfigError, DiskFormatError, DiskStoreError
from kvstrata.tiers import disk_open
from kvstrata.tiers.disk_format import probe_direct_io
from kvstrata.tiers.disk_store import DiskConfig, DiskStore
from kvstrata.tiers.host_pool import HOST_LAYOUTS, HostLayout
from kvstrata.tiers.page_hash import Namespace

IO_MODES = ["direct", "buffered", "packed"]


@pytest.fixture(params=IO_MODES)
def io_mode(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "direct" and probe_direct_io(tmp_path) is not None:
        pytest.skip("no O_DIRECT on the test filesystem")
    return str(request.param)


@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
def test_round_trip_every_payload_byte(
    tmp_path: Path, io_mode: str, host_layout: HostLayout
) -> None:
    src, dst = host_pool(host_layout=host_layout), host_pool(host_layout="page_first")
    pages = hashes(20)
    with open_store(tmp_path, io_mode=io_mode) as store:
        assert store.stats().io_mode == io_mode
        done = spill_all(store, src, pages, ticket=7)
        assert done.released == (7,) and len(done.spilled) == 1
        assert done.spilled[0].durable == tuple(pages) and not done.spilled[0].failed
        assert store.lookup(pages) == 20
        slots = list(range(30, 50))
        assert store.read(pages, dst, slots) == [True] * 20
        for h, slot in zip(pages, slots, strict=True):
            assert read_page(dst, slot) == expected_page(dst, h)
        stats = store.stats()
        assert stats.pages_written == stats.pages_read == 20 and stats.used_slots == 20
        assert stats.bytes_written == 20 * stats.page_bytes
        assert store.check() == []


@pytest.mark.parametrize(
    "payloads",
    [
        (PayloadSpec("kv_latent", (576,), "bfloat16"),),  # MLA: one payload, pages of odd size
        (
            PayloadSpec("k", (1, 3), "float16"),
            PayloadSpec("v", (1, 3), "float16"),
            PayloadSpec("scale", (7,), "uint8"),
            PayloadSpec("q", (2,), "int8"),
        ),
    ],
)
def test_round_trip_other_geometries(tmp_path: Path, payloads: tuple[PayloadSpec, ...]) -> None:
    layout = KVLayout(2, payloads)
    ns = Namespace.for_layout("geo", layout, PAGE)
    src, dst = host_pool(layout=layout), host_pool(layout=layout)
    pages = hashes(8, ns=ns)
    with open_store(tmp_path, ns=ns) as store:
        spill_all(store, src, pages, ticket=1)
        assert store.read(pages, dst, list(range(8))) == [True] * 8
        assert all(read_page(dst, s) == expected_page(dst, h) for s, h in enumerate(pages))


def test_tickets_complete_in_order_and_release_first(tmp_path: Path) -> None:
    pool = host_pool()
    with open_store(tmp_path, max_tickets=16) as store:
        released, spilled = [], []
        for t in range(10):
            pages = hashes(3, seed=t)
            for i, h in enumerate(pages):
                write_page(pool, 3 * t + i, h)
            assert store.spill(t, [(h, 3 * t + i, 1) for i, h in enumerate(pages)], pool)
            got = store.poll()
            released += got.released
            spilled += [d.ticket for d in got.spilled]
            assert set(spilled) <= set(released)
        assert store.flush(30)
        got = store.poll()
        released += got.released
        spilled += [d.ticket for d in got.spilled]
        assert released == spilled == list(range(10))


def test_admission_skips_pages_under_min_hits(tmp_path: Path) -> None:
    pool = host_pool()
    pages = hashes(4)
    for slot, h in enumerate(pages):
        write_page(pool, slot, h)
    with open_store(tmp_path, min_hits=2) as store:
        assert store.spill(
            1, [(pages[0], 0, 2), (pages[1], 1, 1), (pages[2], 2, 5), (pages[3], 3, 0)], pool
        )
        assert store.flush(30)
        (done,) = store.poll().spilled
        assert done.durable == (pages[0], pages[2]) and done.skipped == (pages[1], pages[3])
        assert store.lookup(pages) == 1 and store.lookup(pages[2:]) == 1
        assert store.stats().skipped_admission == 2


def test_spilling_a_page_twice_writes_it_once(tmp_path: Path) -> None:
    pool = host_pool()
    pages = hashes(5)
    with open_store(tmp_path) as store:
        spill_all(store, pool, pages, ticket=1)
        got = spill_all(
            store, pool, [*pages[2:], *hashes(2, seed=9), hashes(2, seed=9)[0]], ticket=2
        )
        assert len(got.spilled[0].durable) == 6
        stats = store.stats()
        assert stats.pages_written == 7 and stats.used_slots == 7 and stats.pages_present == 4
        assert store.check() == []


def test_lookup_and_read_stop_at_the_first_absent_page(tmp_path: Path) -> None:
    pool, dst = host_pool(), host_pool()
    pages = hashes(6)
    with open_store(tmp_path) as store:
        spill_all(store, pool, pages[:2] + pages[3:], ticket=1)  # page 2 never spilled
        assert store.lookup(pages) == 2 and store.lookup(pages[3:]) == 3 and store.lookup([]) == 0
        assert store.read(pages, dst, list(range(6))) == [True, True, False, False, False, False]
        assert store.stats().read_misses == 4


def test_a_page_needs_every_payload(tmp_path: Path) -> None:
    pool, dst = host_pool(), host_pool()
    pages = hashes(3)
    with open_store(tmp_path) as store:
        spill_all(store, pool, pages, ticket=1)
        index = store._index
        assert index is not None
        from kvstrata.tiers.disk_index import encode_key

        slot = store.pool.slot_of(pages[1])
        assert slot is not None
        index.delete_keys([encode_key(NS.digest, slot, 2)])  # page 1 loses its draft payload
        assert {p.kind for p in store.check()} == {"page-incomplete", "live-not-indexed"}
        # The running store reads from the pages it wrote (its slot pool), and page 1's bytes
        # still check out: all three are served, exact.
        assert store.read(pages, dst, [0, 1, 2]) == [True, True, True]
        for slot, h in enumerate(pages):
            assert read_page(dst, slot) == expected_page(dst, h)
        assert store.stats().verify_failures == 0
    # After a restart the index is the truth: page 1 is not a page any more.
    with open_store(tmp_path, start="load") as store:
        assert store.lookup(pages) == 1 and store.read(pages[:1], dst, [3]) == [True]
        assert store.check() == [] and store.stats().used_slots == 2


def test_gc_stays_between_watermarks_under_twice_the_budget(tmp_path: Path) -> None:
    pool = host_pool(slots=40)
    total = 0
    with open_store(tmp_path, pages=100, high_watermark=0.9, low_watermark=0.7) as store:
        high, low = store.high_slots, store.low_slots
        assert (high, low) == (90, 70)
        dropped: list[bytes] = []
        for t in range(20):  # 20 x 10 = 200 distinct pages, twice the budget
            pages = hashes(10, seed=100 + t)
            got = spill_all(store, pool, pages, ticket=t)
            assert got.spilled[0].durable == tuple(pages)
            dropped += got.dropped
            total += 10
            used = store.stats().used_slots
            assert used <= high
            if total > high:
                assert used >= low
            assert store.check(payload=False) == []
        stats = store.stats()
        assert stats.gc_reclaimed == 200 - stats.used_slots == len(dropped)
        assert store.lookup(dropped[:1]) == 0
        last = hashes(10, seed=119)
        assert store.lookup(last) == 10  # the newest pages survive
        store.pool.check()


def test_gc_evicts_the_least_recently_used_first(tmp_path: Path) -> None:
    pool, dst = host_pool(), host_pool()
    old, hot = hashes(10, seed=1), hashes(5, seed=2)
    with open_store(tmp_path, pages=20, high_watermark=0.9, low_watermark=0.5) as store:
        spill_all(store, pool, hot, ticket=1)
        spill_all(store, pool, old, ticket=2)
        # Reading makes hot the newest: the touches reach the writer before the next spill.
        assert store.read(hot, dst, list(range(5))) == [True] * 5
        spill_all(store, pool, hashes(5, seed=3), ticket=3)  # 20 > 18: GC down to 10 first
        assert store.lookup(hot) == 5 and store.lookup(old) == 0


def test_reload_runs_on_the_reader_thread(tmp_path: Path) -> None:
    pool, dst = host_pool(), host_pool()
    pages = hashes(4)
    with open_store(tmp_path) as store:
        spill_all(store, pool, pages[:3], ticket=1)
        assert store.reload(2, pages, dst, [10, 11, 12, 13])
        assert store.flush(30)
        (done,) = store.poll().reloaded
        assert done.ticket == 2 and done.ok == (True, True, True, False)
        assert read_page(dst, 12) == expected_page(dst, pages[2])


def test_reload_after_a_lookup_reads_from_its_slots_and_misses_a_page_moved_since(
    tmp_path: Path,
) -> None:
    """A reload of the pages a lookup just found starts from that lookup's slots (no second
    look at the pool); a page that lost its slot in between (a drop) reads as a miss, and a
    page now in another page's slot is never served as the page asked for."""
    pool, dst = host_pool(), host_pool()
    pages = hashes(6)
    with open_store(tmp_path) as store:
        spill_all(store, pool, pages, ticket=1)
        assert store.lookup(pages) == 6
        assert store._looked is not None and store._looked[1] == store.pool.held_slots(pages)
        assert store.reload(2, pages[:4], dst, [10, 11, 12, 13])  # a prefix of the lookup's
        assert store._looked is None  # used once
        assert store.flush(30)
        assert store.poll().reloaded[0].ok == (True,) * 4
        assert all(read_page(dst, 10 + i) == expected_page(dst, h) for i, h in enumerate(pages[:4]))
        # A page dropped between the lookup and the reload: the lookup's slots are not used (a
        # page moved), the reload stops at the page the pool no longer holds, as without a
        # lookup before it, and the pool's invariants hold (no free slot touched).
        assert store.lookup(pages) == 6
        with store._state_lock:
            store.pool.remove(pages[1])
        before = [read_page(dst, s) for s in (21, 22)]
        misses = store.stats().counters["read_misses"]
        assert store.reload(3, pages[:3], dst, [20, 21, 22])
        assert store.flush(30)
        assert store.poll().reloaded[0].ok == (True, False, False)
        assert [read_page(dst, s) for s in (21, 22)] == before  # never written
        assert store.stats().counters["read_misses"] == misses + 2
        store.pool.check()
        # Hashes of another type than bytes are refused however a lookup went before.
        assert store.lookup(pages[2:4]) == 2
        with pytest.raises(ConfigError, match="page hashes are"):
            store.reload(5, [bytearray(h) for h in pages[2:4]], dst, [40, 41])  # type: ignore[misc]
        # The lookup's pages given in another order: looked up again, read right.
        assert store.lookup(pages[2:4]) == 2
        assert store.reload(4, [pages[3], pages[2]], dst, [30, 31])
        assert store.flush(30)
        assert store.poll().reloaded[0].ok == (True, True)
        assert read_page(dst, 30) == expected_page(dst, pages[3])
        assert read_page(dst, 31) == expected_page(dst, pages[2])


def test_clear_starts_empty_and_load_keeps_pages_and_lru(tmp_path: Path) -> None:
    pool, dst = host_pool(), host_pool()
    cold, warm = hashes(6, seed=1), hashes(6, seed=2)
    with open_store(tmp_path, pages=20) as store:
        spill_all(store, pool, cold + warm, ticket=1)
        assert store.read(cold[:2], dst, [0, 1]) == [True, True]  # cold[:2] become the newest
    order = [h for h, _ in store.pool.coldest(12)]  # after close: every touch applied
    assert order == cold[2:] + warm + cold[:2]
    with open_store(tmp_path, pages=20, start="load") as store:
        stats = store.stats()
        assert stats.load_pages == 12 and stats.load_dropped == 0 and stats.used_slots == 12
        assert [h for h, _ in store.pool.coldest(12)] == order
        new = hashes(4, seed=3)
        spill_all(store, pool, new, ticket=2)  # new pages take free slots, not live ones
        assert store.check() == []
        assert store.read(cold + warm + new, dst, list(range(16))) == [True] * 16
        assert all(
            read_page(dst, i) == expected_page(dst, h) for i, h in enumerate(cold + warm + new)
        )
    with open_store(tmp_path, pages=20, start="clear") as store:
        assert store.lookup(cold) == 0 and store.stats().used_slots == 0
    with open_store(tmp_path, pages=20, start="load") as store:
        assert store.lookup(cold) == 0


def test_ranks_and_namespaces_share_a_directory(tmp_path: Path) -> None:
    ns2 = Namespace.for_layout("test-model", LAYOUT, PAGE, cp_size=2)
    pool, dst = host_pool(), host_pool()
    p0, p1 = hashes(3, seed=1, ns=ns2), hashes(3, seed=2, ns=ns2)
    with open_store(tmp_path, ns=ns2, rank=0) as r0, open_store(tmp_path, ns=ns2, rank=1) as r1:
        spill_all(r0, pool, p0, ticket=1)
        spill_all(r1, pool, p1, ticket=1)
        assert r0.lookup(p0) == 3 and r0.lookup(p1) == 0 and r1.lookup(p1) == 3
        with pytest.raises(DiskStoreError, match="in use by another process"):
            open_store(tmp_path, ns=ns2, rank=0)
        with open_store(tmp_path) as other:  # another namespace (cp_size 1)
            assert other.lookup(p0) == 0
        assert r1.read(p1, dst, [0, 1, 2]) == [True] * 3
    with open_store(tmp_path, ns=ns2, rank=1, start="clear") as r1:
        assert r1.lookup(p1) == 0
    with open_store(tmp_path, ns=ns2, rank=0, start="load") as r0:
        assert r0.lookup(p0) == 3


def test_bad_configuration_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least"):
        DiskStore(NS, 0, DiskConfig(tmp_path, budget_for(5)))
    with pytest.raises(ConfigError, match="watermarks"):
        DiskConfig(tmp_path, 1 << 20, high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(ConfigError, match="start"):
        DiskConfig(tmp_path, 1 << 20, start="warm")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rank"):
        DiskStore(NS, 1, DiskConfig(tmp_path, 1 << 20))
    with open_store(tmp_path) as store:
        with pytest.raises(ConfigError, match="layout"):
            store.spill(1, [], host_pool(layout=KVLayout(1, LAYOUT.payloads)))
        with pytest.raises(ConfigError, match="outside"):
            store.read(hashes(1), host_pool(), [64])
        for slots in ([-0.5], np.array([1.5]), [float("nan")], [2**64]):
            with pytest.raises(ConfigError, match="host slots"):
                store.read(hashes(1), host_pool(), slots)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="distinct"):  # a later page would land over it
            store.read(hashes(2), host_pool(), [3, 3])
        with pytest.raises(ConfigError, match="distinct"):
            store.reload(7, hashes(2), host_pool(), np.array([3, 3]))
        assert store.stats().reloads == 0, "refused before any ticket was taken"
        with pytest.raises(ConfigError, match="32 bytes"):
            store.lookup([b"short"])
        with pytest.raises(ConfigError, match="32 bytes"):
            store.spill(1, [(b"x" * 31, 0, 1)], host_pool())


def test_load_refuses_a_slab_of_another_geometry(tmp_path: Path) -> None:
    with open_store(tmp_path, pages=20):
        pass
    with pytest.raises(DiskFormatError, match="in num_slots 20 vs 30 "):  # the field named
        open_store(tmp_path, pages=30, start="load")
    with open_store(tmp_path, pages=30, start="clear") as store:  # clear recreates it
        assert store.num_slots == 30
    with open_store(tmp_path, pages=30, start="load") as store:
        assert store.num_slots == 30


def test_direct_io_mode_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(disk_open, "probe_direct_io", lambda d: "O_DIRECT open failed: EINVAL")
    with pytest.raises(DiskStoreError, match="O_DIRECT is unavailable"):
        open_store(tmp_path, io_mode="direct")
    with (
        caplog.at_level(logging.WARNING, logger="kvstrata.disk"),
        open_store(tmp_path, io_mode="auto") as store,
    ):
        assert store.stats().io_mode == "buffered"
    assert "O_DIRECT unavailable" in caplog.text


def test_a_bug_in_a_thread_is_raised_by_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstrata.tiers import disk_gather

    def broken(*args: object) -> object:
        raise ValueError("gather bug")

    monkeypatch.setattr(disk_gather, "host_pages", broken)
    store = open_store(tmp_path)
    pool = host_pool()
    assert store.spill(1, [(hashes(1)[0], 0, 1)], pool)
    wait_until(lambda: store._spill.crash is not None)
    with pytest.raises(ValueError, match="gather bug"):
        store.poll()
    store.close(timeout_s=5)


def test_close_is_idempotent_and_refuses_later_work(tmp_path: Path) -> None:
    pool = host_pool()
    store = open_store(tmp_path)
    pages = hashes(3)
    for slot, h in enumerate(pages):
        write_page(pool, slot, h)
    assert store.spill(1, [(h, slot, 1) for slot, h in enumerate(pages)], pool)
    store.close()  # finishes the spill first
    store.close()
    assert not store.spill(2, [(pages[0], 0, 1)], pool)
    assert store.read(pages, pool, [0, 1, 2]) == [False] * 3
    with open_store(tmp_path, start="load") as again:
        assert again.lookup(pages) == 3
