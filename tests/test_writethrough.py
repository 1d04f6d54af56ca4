"""WriteThrough on its own: reserve host pages, copy each layer, attach, commit or roll back;
orphans of an insert that kept other pages; skips when L2 cannot take a backup."""

from __future__ import annotations

import numpy as np
from tier_rig import (
    LAYOUT,
    cached_sequence,
    device_bytes,
    fill,
    hierarchy,
    host_bytes,
    same,
    settle_copies,
)

from kvstrata.residency import Residency
from kvstrata.tiers.tickets import TicketKind

TOKENS = np.arange(1, 17, dtype=np.uint32)  # four full pages


def _backup_during_forward(h, anchor, first_page, pages):  # type: ignore[no-untyped-def]
    wt = h.backups
    res = wt.reserve_chunk(anchor, first_page, pages)
    for layer in range(LAYOUT.num_layers):
        wt.after_layer(layer)
    wt.end_forward()
    return res


def test_a_chunk_backup_commits_the_device_bytes_to_the_host() -> None:
    h = hierarchy()
    key = h.tree.key(TOKENS)
    pages = h.allocator.alloc(0, 4)
    assert pages is not None
    fill(h.pool, pages, seed=1)
    res = _backup_during_forward(h, h.tree.root, 0, pages)
    assert res is not None and h.backups.held_pages == 4
    node = h.tree.insert(key, pages, 0).node
    assert h.backups.attach(res, node)
    assert node.residency is Residency.DEVICE_HOST_PENDING
    assert h.tree.match_prefix(key, record=False).host_pages.size == 0  # pending: invisible
    covered = settle_copies(h)
    assert [kind for _, kind, _ in covered] == [TicketKind.BACKUP]
    for ticket, _, ok in covered:
        h.backups.settle(ticket, ok)
    assert node.residency is Residency.DEVICE_HOST
    assert same(host_bytes(h, node.host_pages), device_bytes(h.pool, pages))
    stats = h.backups.stats
    assert (stats.done, stats.done_pages, stats.skipped, stats.failed) == (1, 4, 0, 0)
    assert h.backups.held_pages == 0
    h.check([])


def test_a_failed_backup_rolls_back_and_frees_its_host_pages() -> None:
    h = hierarchy()
    key, node, pages = cached_sequence(h, TOKENS)
    h.tree.lock(node)  # as a running request would hold it
    res = _backup_during_forward(h, h.tree.root, 0, pages)
    assert h.backups.attach(res, node)
    covered = settle_copies(h)
    for ticket, _, _ in covered:
        h.backups.settle(ticket, ok=False)  # the frontier says some rank failed it
    h.tree.unlock(node)
    assert node.residency is Residency.DEVICE
    assert h.host_allocator.num_used == 0
    assert (h.backups.stats.failed, h.backups.stats.failed_pages) == (1, 4)
    h.check([])


def test_an_insert_that_kept_other_pages_orphans_the_backup() -> None:
    """Another request inserted the same pages first: the reserved host pages are copied but
    never become visible, and are freed when the ticket settles."""
    h = hierarchy()
    key, node, _ = cached_sequence(h, TOKENS, seed=2)
    mine = h.allocator.alloc(0, 4)
    assert mine is not None
    res = _backup_during_forward(h, h.tree.root, 0, mine)
    result = h.tree.insert(key, mine, 0)
    assert result.node is node and np.array_equal(np.sort(result.free_pages), np.sort(mine))
    h.allocator.free(result.free_pages)
    assert not h.backups.attach(res, result.node)
    assert node.residency is Residency.DEVICE and h.backups.stats.orphaned_pages == 4
    assert h.host_allocator.num_used == 4  # still copying into them
    for ticket, _, ok in settle_copies(h):
        h.backups.settle(ticket, ok)
    assert h.host_allocator.num_used == 0 and h.backups.held_pages == 0
    h.check([])


def test_a_backup_l2_cannot_take_is_skipped_not_waited_for() -> None:
    h = hierarchy(l2_tokens=8)  # two host pages for a four-page chunk
    pages = h.allocator.alloc(0, 4)
    assert pages is not None
    assert _backup_during_forward(h, h.tree.root, 0, pages) is None
    assert (h.backups.stats.skipped, h.backups.stats.skipped_pages) == (1, 4)
    assert h.host_allocator.num_used == 0
    # The step's ticket was closed with nothing to copy: it settles at once.
    assert [ok for _, _, ok in settle_copies(h)] == [True]


def test_a_chunk_under_a_parent_without_a_host_copy_is_skipped() -> None:
    """Host residency is root-connected: a child's backup needs its parent on the host."""
    h = hierarchy()
    _, parent, _ = cached_sequence(h, TOKENS)  # device only
    more = h.allocator.alloc(4, 2)
    assert more is not None
    assert _backup_during_forward(h, parent, 4, more) is None
    assert h.backups.stats.skipped == 1 and parent.host_ref == 0


def test_write_back_backs_up_the_l1_victims_next_in_line() -> None:
    h = hierarchy(write_policy="write_back")
    _, node, pages = cached_sequence(h, TOKENS, seed=3)
    assert h.backups.before_evict(4) == 1
    assert node.residency is Residency.DEVICE_HOST_PENDING
    for ticket, _, ok in settle_copies(h):
        h.backups.settle(ticket, ok)
    assert node.residency is Residency.DEVICE_HOST
    assert same(host_bytes(h, node.host_pages), device_bytes(h.pool, pages))
