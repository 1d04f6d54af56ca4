"""``DiskView``: another process's pages, read while that process's store is open and writing."""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from disk_rig import NS, expected_page, hashes, host_pool, open_store, read_page, spill_all

from kvstrata.errors import DiskStoreError
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
