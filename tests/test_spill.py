"""DiskTier on its own: committed host pages spill under their content addresses, a miss reloads
the leading verified pages as a host-only node, a page that fails verification ends the run, and
requests missing the same pages find the reload in flight."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tier_rig import LAYOUT, cached_sequence, hierarchy, host_bytes, same, settle_copies

from kvstrata.engine import CacheHierarchy, EngineConfig
from kvstrata.residency import Residency, Tier
from kvstrata.tiers.disk_format import SLOT_HEADER_BYTES
from kvstrata.tiers.spill import SpillItem
from kvstrata.tiers.tickets import TicketKind

TOKENS = np.arange(1, 33, dtype=np.uint32)  # eight full pages


def _disk(tmp: Path, start: str = "clear") -> CacheHierarchy:
    return hierarchy(
        pool_tokens=64, l2_tokens=64, l3_dir=str(tmp / "l3"), l3_gib=0.01, l3_start=start
    )


def _until_settled(h: CacheHierarchy, kind: TicketKind) -> list[tuple[int, bool]]:
    """Poll the disk tier until a ticket of ``kind`` is covered (bounded)."""
    assert h.disk is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        h.disk.poll()
        got = [(t, ok) for t, k, ok in settle_copies(h) if k is kind]
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"no {kind} ticket landed in 30 s")


def _spilled(h: CacheHierarchy) -> tuple[object, object, list]:  # type: ignore[type-arg]
    """Eight pages backed up to L2 and spilled: the key, the node and its host bytes."""
    assert h.disk is not None and h.backups is not None
    key, node, _ = cached_sequence(h, TOKENS, seed=5)
    h.backups.back_up_now([node])
    for ticket, _, ok in settle_copies(h):
        h.backups.settle(ticket, ok)
    want = host_bytes(h, node.host_pages)
    hashes = h.page_hashes(0, key)
    h.disk.spill([SpillItem(node, hashes, node.host_pages, hits=1)])
    assert node.host_ref == 1  # locked until the store has gathered the pages
    for ticket, _ in _until_settled(h, TicketKind.SPILL):
        h.disk.settle_spill(ticket)
    assert node.host_ref == 0
    assert h.disk.store.flush(30)
    h.disk.poll()
    assert h.disk.stats.spills == 1 and h.disk.stats.spilled_pages == 8
    assert h.disk.store.lookup(hashes) == 8
    return key, node, want


def _drop_from_memory(h: CacheHierarchy) -> None:
    h.allocator.free(h.tree.evict(16, Tier.L1))
    assert h.host_allocator is not None
    h.host_allocator.free(h.tree.evict(16, Tier.L2))
    assert h.tree.num_nodes == 0


def test_spill_then_reload_brings_back_the_same_bytes_as_a_host_only_node(tmp_path: Path) -> None:
    h = _disk(tmp_path)
    try:
        key, _, want = _spilled(h)
        _drop_from_memory(h)
        assert h.disk is not None
        ticket = h.disk.try_reload(key, h.page_hashes(0, key), 0, 28, h.tree.root, rid=7)
        assert ticket is not None and h.disk.pending_reload(h.tree.root, h.page_hashes(0, key)[0])
        assert h.disk.held_pages == 7  # the pages before the last token's page
        for t, ok in _until_settled(h, TicketKind.RELOAD):
            assert h.disk.settle_reload(t, ok) == (7, 28)
        hit = h.tree.match_prefix(key, record=False)
        assert (hit.device_len, hit.valid_len) == (0, 28)
        assert all(n.residency is Residency.HOST for n in hit.host_nodes)
        assert same(host_bytes(h, hit.host_pages), [w[:7] for w in want])
        assert h.disk.stats.reloads == 1 and h.disk.stats.reloaded_pages == 7
        assert h.disk.held_pages == 0 and h.disk.host_locks == 0
        h.check([])
    finally:
        h.close()


def test_a_page_that_fails_verification_ends_the_reloaded_run(tmp_path: Path) -> None:
    h = _disk(tmp_path)
    try:
        key, _, want = _spilled(h)
        _drop_from_memory(h)
        assert h.disk is not None
        store, hashes = h.disk.store, h.page_hashes(0, key)
        slot = store.pool.slot_of(hashes[3])
        assert slot is not None
        slab = store._slabs[0]
        with open(slab.path, "r+b") as f:  # one payload bit of page 3's first payload
            f.seek(slab.geometry.slot_offset(slot) + SLOT_HEADER_BYTES + 5)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0x10]))
        ticket = h.disk.try_reload(key, hashes, 0, 28, h.tree.root, rid=1)
        assert ticket is not None
        for t, ok in _until_settled(h, TicketKind.RELOAD):
            assert h.disk.settle_reload(t, ok) == (1, 12)  # pages 0..2 verified, then a miss
        assert h.disk.stats.reload_misses == 4
        hit = h.tree.match_prefix(key, record=False)
        assert hit.valid_len == 12
        assert same(host_bytes(h, hit.host_pages), [w[:3] for w in want])
        h.check([])
    finally:
        h.close()


def test_under_cp_a_rank_counts_only_the_pages_it_owns(tmp_path: Path) -> None:
    """local_count stops at this rank's first owned page the disk lacks (the ranks then take
    the MIN): with nothing spilled, rank 1 of 2 can serve up to its first page, position 1."""
    cfg = {"l3_dir": str(tmp_path / "l3"), "l3_gib": 0.01}
    h = CacheHierarchy(
        EngineConfig(page_size=4, pool_tokens=64, l2_tokens=64, **cfg), LAYOUT, cp=2, rank=1
    )
    try:
        assert h.disk is not None
        key = h.tree.key(TOKENS)
        assert h.disk.local_count(h.page_hashes(0, key), 0, 7) == 1
        assert h.disk.local_count(h.page_hashes(0, key), 2, 7) == 1  # position 3 is rank 1's
    finally:
        h.close()
