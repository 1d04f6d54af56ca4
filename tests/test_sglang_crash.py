"""Crash safety of the SGLang backend: a process backing pages up through ``batch_set_v1`` is
SIGKILLed in the middle of a call, over and over; every restart with ``start: load`` must serve
every page a call had reported durable, byte for byte, and never a wrong byte of any other.

SGLang's imports take seconds, so the writers are forked from one *zygote* process that imported
torch and sglang once and never opens a store (so it forks with no threads and no LMDB
environment). The zygote runs each round: fork a writer, let it finish a few calls, kill it
inside the next one, and report what it said.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from sglang_rig import PAGE, attach, expected, fill, mha_pool, page_bytes, storage_config

from kvstrata.cli import main

KILLS = 24
PAGES = 48  # host pool pages; a call backs up 1..16 of them


def _child(root: str, seed: int, conn: Connection) -> None:
    """Back up batches of new pages forever; say which keys a call is about to write, then which
    it reported durable. The parent kills this process at a random moment."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    pool = mha_pool(pages=PAGES)
    backend = attach(storage_config(Path(root), start="load", budget_bytes=256 << 20), pool)
    conn.send(("ready", backend.disk_stats().load_pages))
    for call in range(10**9):
        keys = [f"s{seed}-c{call}-p{i}" for i in range(rng.randint(1, 16))]
        host = pool.alloc(len(keys) * PAGE)
        fill(pool, host, keys, "crash")
        conn.send(("offer", keys))
        ok = backend.batch_set_v1(keys, host)
        pool.free(host)
        conn.send(("durable", [k for k, good in zip(keys, ok, strict=True) if good]))


def _restart_and_verify(root: Path, offered: list[str], durable: set[str]) -> int:
    """Open the store as a restarted server would; check every page it serves. Returns how many
    pages it served."""
    pool = mha_pool(pages=PAGES)
    backend = attach(storage_config(root, start="load", budget_bytes=256 << 20), pool)
    try:
        assert backend.store is not None and backend.store.check() == []  # type: ignore[union-attr]
        present = [k for k in offered if backend.batch_exists([k]) == 1]
        assert durable <= set(present), sorted(durable - set(present))[:5]
        for s in range(0, len(present), PAGES):
            keys = present[s : s + PAGES]
            host = pool.alloc(len(keys) * PAGE)
            ok = backend.batch_get_v1(keys, host)
            assert all(ok), (keys, ok)
            got = [page_bytes(pool, int(host[i * PAGE])) for i in range(len(keys))]
            for key, page, want in zip(keys, got, expected(pool, keys, "crash"), strict=True):
                assert torch.equal(page, want), f"wrong bytes for {key}"
            pool.free(host)
        return len(present)
    finally:
        backend.close()


def _round(root: str, seed: int, offers: int, sleep_s: float) -> tuple[list, set, int, bool]:
    """In the zygote: one writer, killed during its ``offers``-th call after ``sleep_s``.
    Returns (keys offered, keys reported durable, exit code, killed inside a call)."""
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(root, seed, child))
    proc.start()
    assert parent.poll(60), "the writer did not start"
    assert parent.recv()[0] == "ready"
    offered: list[str] = []
    durable: set[str] = set()
    what = ""
    while offers:  # let it finish a few calls, then kill it inside the next one
        assert parent.poll(30), "the writer stopped making progress"
        what, keys = parent.recv()
        if what == "offer":
            offered += keys
            offers -= 1
        else:
            durable.update(keys)
    time.sleep(sleep_s)
    proc.kill()  # SIGKILL
    proc.join(10)
    while parent.poll(0):  # what it said before dying
        what, keys = parent.recv()
        if what == "offer":
            offered += keys
        else:
            durable.update(keys)
    return offered, durable, proc.exitcode or 0, what == "offer"


def _zygote(conn: Connection) -> None:
    torch.set_num_threads(1)
    mha_pool(pages=2)  # SGLang's host pool modules, imported once
    while (job := conn.recv()) is not None:
        conn.send(_round(*job))


@pytest.mark.slow
def test_sigkill_during_batch_set_v1_loses_nothing_durable(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")  # a clean interpreter, with this sys.path
    conn, zygote_conn = ctx.Pipe()
    zygote = ctx.Process(target=_zygote, args=(zygote_conn,))
    zygote.start()
    rng = random.Random(0)
    offered: list[str] = []
    durable: set[str] = set()
    mid_call = 0
    try:
        for kill in range(KILLS):
            conn.send((str(tmp_path), kill, rng.randint(1, 4), rng.uniform(0, 0.004)))
            assert conn.poll(180), "the zygote did not finish a round"
            got_offered, got_durable, exitcode, inside = conn.recv()
            assert exitcode == -9
            offered += got_offered
            durable |= got_durable
            mid_call += inside  # killed inside batch_set_v1, not between calls
            served = _restart_and_verify(tmp_path, offered, durable)
            assert served >= len(durable)
    finally:
        if zygote.is_alive():
            conn.send(None)
        zygote.join(30)
        if zygote.is_alive():
            zygote.kill()
    assert mid_call >= KILLS // 2, f"only {mid_call} kills landed inside a call"
    assert len(durable) > KILLS
    assert main(["disk", "check", str(tmp_path)]) == 0
