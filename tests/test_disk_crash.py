"""Crash safety of the disk tier: a process spilling (and reading, and collecting garbage) in a loop
is SIGKILLed at random points, over and over; every restart with ``load`` must find a consistent
store. No verified read may return wrong bytes, no slot may be handed out twice, and
``kvstrata disk check`` must be clean (and stay clean after ``--fix``).

Children come from a multiprocessing fork server that imported torch once, so each of the 24
restarts costs milliseconds instead of a fresh interpreter's seconds.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from disk_rig import expected_page, host_pool, open_store, read_page, write_page

from kvstrata.cli import main

KILLS = 24
STORE = {"pages": 40, "high_watermark": 0.9, "low_watermark": 0.6, "staging_bytes": 8 * 12288}


def _child(root: str, seed: int, conn: Connection) -> None:
    """Spill batches of random pages forever (the store GCs all the time: 40 slots), read some
    back, and report progress; the parent kills this process at a random moment."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    pool, dst = host_pool(slots=16), host_pool(slots=16)
    store = open_store(Path(root), start="load", **STORE)
    conn.send(("ready", store.stats().load_pages))
    durable: list[bytes] = []
    for ticket in range(10**9):
        pages = [rng.randbytes(32) for _ in range(rng.randint(1, 8))]
        for slot, h in enumerate(pages):
            write_page(pool, slot, h)
        assert store.spill(ticket, [(h, slot, 1) for slot, h in enumerate(pages)], pool)
        while True:  # the host slots are reused next round: wait for the release
            got = store.poll()
            durable += [h for d in got.spilled for h in d.durable]
            if got.spilled:
                break
            time.sleep(0.001)
        sample = rng.sample(durable, min(4, len(durable)))
        for i, ok in enumerate(store.read(sample, dst, list(range(len(sample))))):
            if ok and read_page(dst, i) != expected_page(dst, sample[i]):
                conn.send(("wrong bytes", sample[i].hex()))
        conn.send(("spilled", ticket))


@pytest.mark.slow
def test_sigkill_at_random_points_leaves_a_consistent_store(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "kvstrata.tiers.disk_store", "disk_rig"])
    rng = random.Random(0)
    verified = survived = 0
    for kill in range(KILLS):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(str(tmp_path), kill, child), daemon=True)
        proc.start()
        assert parent.poll(60), "the child did not start"
        what, loaded = parent.recv()
        assert what == "ready"
        survived += loaded > 0
        for _ in range(rng.randint(1, 6)):  # let it spill a few rounds, then kill mid-flight
            assert parent.poll(30), "the child stopped making progress"
            msg = parent.recv()
            assert msg[0] == "spilled", msg
        time.sleep(rng.uniform(0, 0.01))
        proc.kill()  # SIGKILL
        proc.join(10)
        assert proc.exitcode == -9
        while parent.poll(0):  # what it sent before dying
            msg = parent.recv()
            assert msg[0] == "spilled", msg
        parent.close()
        with open_store(tmp_path, start="load", **STORE) as store:  # the restart
            assert store.check() == []
            live = store.pool.live()
            dst = host_pool(slots=len(live) + 1)
            ok = store.read([h for h, _, _ in live], dst, list(range(len(live))))
            assert all(ok)  # the index names only pages written and synced in full
            for i, (h, _, _) in enumerate(live):
                assert read_page(dst, i) == expected_page(dst, h)
            verified += len(live)
    assert verified > KILLS and survived >= KILLS - 2  # pages did survive the kills
    assert main(["disk", "check", str(tmp_path)]) == 0
    assert main(["disk", "check", str(tmp_path), "--fix"]) == 0
    assert main(["disk", "check", str(tmp_path)]) == 0
