"""LoadBack on its own: a host-only prefix gets device pages of the same owners, every layer is
copied back, the forward waits for its own layer, and the host lock holds until the frontier."""

from __future__ import annotations

import numpy as np
import pytest
from tier_rig import LAYOUT, cached_sequence, device_bytes, hierarchy, same, settle_copies

from kvstrata.engine import CacheHierarchy
from kvstrata.errors import TransferError
from kvstrata.residency import Residency, Tier

TOKENS = np.arange(1, 17, dtype=np.uint32)


def _host_only(h: CacheHierarchy) -> tuple[object, list]:  # type: ignore[type-arg]
    """A four-page sequence backed up to L2, then evicted from L1: its bytes, and its key."""
    key, node, pages = cached_sequence(h, TOKENS, seed=4)
    want = device_bytes(h.pool, pages)
    assert h.backups is not None and h.backups.before_evict(0) == 0  # write_through: no-op
    h.backups.back_up_now([node])
    for ticket, _, ok in settle_copies(h):
        h.backups.settle(ticket, ok)
    h.allocator.free(h.tree.evict(4, Tier.L1))
    assert node.residency is Residency.HOST
    for spec in LAYOUT.payloads:  # the freed device rows no longer hold the KV
        for layer in range(LAYOUT.num_layers):
            h.pool.buffer(spec.name, layer).zero_()
    return key, want


def test_a_host_hit_loads_every_layer_back_and_unlocks_at_the_frontier() -> None:
    h = hierarchy()
    key, want = _host_only(h)
    hit = h.tree.match_prefix(key, record=False)
    assert (hit.device_len, hit.valid_len) == (0, 16)
    h.tree.host_lock(hit.last_node)
    pages = h.allocator.alloc(0, 4)
    assert pages is not None and h.loads is not None
    assert h.loads.start(hit, pages)
    for layer in range(LAYOUT.num_layers):
        h.loads.before_layer(layer)  # returns once that layer's copy landed
    h.loads.end_forward()
    assert same(device_bytes(h.pool, pages), want)
    assert hit.last_node.residency is Residency.DEVICE_HOST
    assert hit.last_node.host_ref == 1 and h.loads.host_locks == 1
    for ticket, _, ok in settle_copies(h):
        h.loads.settle(ticket, ok)
    assert hit.last_node.host_ref == 0 and h.loads.host_locks == 0
    assert (h.loads.stats.loads, h.loads.stats.pages, h.loads.stats.failed) == (1, 4, 0)


def test_a_copy_that_fails_at_submission_leaves_the_nodes_host_only() -> None:
    h = hierarchy()
    key, _ = _host_only(h)
    assert h.transfer is not None and h.loads is not None

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("injected copy failure")

    h.transfer.copier.copy = broken  # type: ignore[method-assign]
    hit = h.tree.match_prefix(key, record=False)
    h.tree.host_lock(hit.last_node)
    pages = h.allocator.alloc(0, 4)
    assert pages is not None
    assert not h.loads.start(hit, pages)
    assert all(n.residency is Residency.HOST for n in hit.host_nodes)
    assert h.loads.stats.failed == 1
    assert h.allocator.num_used == 4  # the device pages are still the caller's, to free
    h.allocator.free(pages)
    for ticket, _, ok in settle_copies(h):
        assert not ok
        h.loads.settle(ticket, ok)
    assert hit.last_node.host_ref == 0
    h.check([])


def test_before_layer_raises_when_a_load_failed_after_submission() -> None:
    h = hierarchy()
    key, _ = _host_only(h)
    assert h.loads is not None
    hit = h.tree.match_prefix(key, record=False)
    h.tree.host_lock(hit.last_node)
    pages = h.allocator.alloc(0, 4)
    assert pages is not None and h.loads.start(hit, pages)
    ticket = h.loads._step_tickets[0]
    h.loads.note_landed(ticket, ok=False)  # as a device copy that failed would be polled
    with pytest.raises(TransferError, match="failed before the forward read"):
        h.loads.before_layer(0)
