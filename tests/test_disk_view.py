"""``DiskView``: another process's pages, read while that process's store is open and writing."""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from disk_rig import NS, expected_page, hashes, host_pool, open_store, read_page, spill_all

from kvstrata.errors import DiskStoreError
from kvstrata.tiers.disk_index import DiskIndex, decode_key, decode_value
from kvstrata.tiers.disk_view import DiskView


def _writer(root: str, conn: Connection) -> None:
    pool = host_pool()
    with open_store(Path(root)) as store:
        conn.send("open")
        for ticket, n in enumerate(iter(conn.recv, None)):
            spill_all(store, pool, hashes(n), ticket)
            conn.send(n)


@pytest.mark.slow
def test_a_view_reads_what_another_process_writes(tmp_path: Path) -> None:
    pages = hashes(8)
    view = DiskView(NS, 0, tmp_path)
    dst = host_pool()
    assert view.lookup(pages) == 0 and view.read(pages, dst, list(range(8))) == [False] * 8
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_writer, args=(str(tmp_path), child))
    proc.start()
    try:
        assert conn.poll(120) and conn.recv() == "open"
        with pytest.raises(DiskStoreError, match="in use"):  # the writer holds the store
            open_store(tmp_path)
        for n in (3, 8):  # the view sees each commit of the running writer
            conn.send(n)
            assert conn.poll(60) and conn.recv() == n
            assert view.lookup(pages) == n
            ok = view.read(pages, dst, list(range(8)))
            assert ok == [True] * n + [False] * (8 - n)
            for i in range(n):
                assert read_page(dst, i) == expected_page(dst, pages[i])
        conn.send(None)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        view.close()
    with open_store(tmp_path, start="load") as store:  # the view wrote and locked nothing
        assert store.lookup(pages) == 8 and store.check() == []


def test_a_view_finds_a_page_the_writer_moved(tmp_path: Path) -> None:
    """GC takes pages, the writer spills one again into another slot: the view's read of it
    misses once (a race), then the view scans again and reads it (found by review)."""
    pool, dst = host_pool(), host_pool()
    with open_store(tmp_path, pages=10, high_watermark=0.9, low_watermark=0.5) as store:
        a = hashes(4, seed=1)
        spill_all(store, pool, a, 0)  # slots 0..3
        view = DiskView(NS, 0, tmp_path)
        assert view.lookup(a) == 4 and view.read(a, dst, [0, 1, 2, 3]) == [True] * 4
        spill_all(store, pool, hashes(6, seed=2), 1)  # its 6th page makes GC take a
        spill_all(store, pool, a[:1], 2)  # a[0] back, in another slot
        assert store.lookup(a) == 1
        results = [view.read(a[:1], dst, [0]) for _ in range(3)]
        assert results[0] == [False] and results[-1] == [True]
        assert read_page(dst, 0) == expected_page(dst, a[0])
        assert view.lookup(a) == 1
        view.close()


def _commit_forever(path: str, stop: Any) -> None:
    index = DiskIndex(Path(path))
    gen = 0
    while not stop.is_set():
        gen += 1
        index.put_pages(
            b"n" * 32, 0, [(gen.to_bytes(8, "little") * 4, s, gen) for s in range(4000)], 1
        )


def test_a_view_scan_sees_one_snapshot_of_a_busy_writer(tmp_path: Path) -> None:
    """The view's scan is one read transaction the writer knows of (LMDB's lock table): it never
    walks pages the writer reused (lock-free, a slow scan saw 20 commits; found by review)."""
    path = tmp_path / "idx"
    DiskIndex(path).close()
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    proc = ctx.Process(target=_commit_forever, args=(str(path), stop))
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while (
            not (path / "data.mdb").exists()
            or DiskIndex(path, reader=True).env.info()["last_txnid"] < 5
        ):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        reader = DiskIndex(path, reader=True)
        generations: set[int] = set()
        for n, (key, value) in enumerate(reader.items(b"n" * 32)):
            found = decode_value(value)
            assert found is not None and decode_key(key) is not None
            generations.add(found[2])
            if n % 200 == 0:
                time.sleep(0.02)  # a scan of a large index takes this long
        assert len(generations) == 1 and n == 3999
        reader.close()
    finally:
        stop.set()
        proc.join(30)
