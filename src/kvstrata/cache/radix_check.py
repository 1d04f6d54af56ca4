"""``RadixTree.check()``: every invariant of the tree, verified from scratch (a debug path).

Walks the tree parents first, recomputing each node's prefix keys from its parent's end key and its
own tokens (no path concatenation), and checks structure, pages per tier, residency, counters,
pending tickets and the per-tier eviction heaps. Raises :class:`TreeInvariantError` naming the node.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..errors import TreeInvariantError
from ..ownership import page_span
from ..residency import Residency, Tier
from .eviction import Priority

if TYPE_CHECKING:
    from .radix import Node, RadixTree


def check_tree(tree: RadixTree) -> None:
    P, cp = tree.page_size, tree.cp_size
    held: dict[Tier, list[np.ndarray]] = {Tier.L1: [], Tier.L2: []}
    num_tokens = 0
    nodes = tree.nodes()
    pending: dict[int, set[int]] = {}
    for n in nodes:
        parent = n.parent

        def fail(what: str, n: Node = n) -> TreeInvariantError:
            return TreeInvariantError(f"node {n.id} [{n.start}, {n.end}): {what}")

        if n.dead:
            raise fail("a dead node is still linked")
        if parent is None or parent.children.get(n.first_key) is not n:
            raise fail("not registered under its parent with its first key")
        if n.start != parent.end or n.start % P:
            raise fail(f"starts at {n.start}, parent ends at {parent.end}")
        if n.end <= n.start or n.tokens.size != n.end - n.start:
            raise fail(f"holds {n.tokens.size} tokens")
        if n.children and n.end % P:
            raise fail("has children but ends inside a page (valid tail)")
        if n.span != page_span(n.end - n.start, P) or n.keys.size != (n.end - n.start) // P:
            raise fail(f"spans {n.span} pages with {n.keys.size} keys")
        if n.num_full != n.keys.size or n.full_key != (n.keys.item(-1) if n.keys.size else -1):
            raise fail("cached full-page count or last full key is stale")
        if n.lock_ref < 0 or n.host_ref < 0:
            raise fail(f"lock_ref {n.lock_ref}, host_ref {n.host_ref}")
        keys, end_key = tree.hasher.continue_keys(parent.end_key, n.start, n.tokens, P)
        if not np.array_equal(keys, n.keys) or end_key != n.end_key:
            raise fail("stored prefix keys disagree with its tokens and its parent's key")
        first = end_key if n.end - n.start < P else int(keys[0])
        if first != n.first_key:
            raise fail("first key disagrees with its tokens")
        _check_residency(tree, n, parent, fail)
        positions = np.arange(n.start // P, n.start // P + n.span)
        for tier, pages in ((Tier.L1, n.pages), (Tier.L2, n.host_pages)):
            if pages.size and np.any(pages % cp != positions % cp):
                raise fail(f"holds a {tier.name} page whose lane is not its position's owner")
            held[tier].append(pages)
        if n.ticket:
            pending.setdefault(n.ticket, set()).add(n.id)
        num_tokens += n.end - n.start
    _check_pages(tree, held)
    if (num_tokens, len(nodes)) != (tree.num_tokens, tree.num_nodes):
        raise TreeInvariantError(
            f"counters {(tree.num_tokens, tree.num_nodes)} != actual {(num_tokens, len(nodes))}"
        )
    listed = {t: {n.id for n in group} for t, group in tree._pending.items()}
    if listed != pending:
        raise TreeInvariantError(f"pending tickets {listed} != nodes marked pending {pending}")
    _check_heaps(tree, nodes)


def _check_residency(
    tree: RadixTree, n: Node, parent: Node, fail: Callable[[str], TreeInvariantError]
) -> None:
    r = n.residency
    if n.pages.size != (n.span if n.on_device else 0):
        raise fail(f"{r.value} with {n.pages.size} device pages")
    if n.host_pages.size != (n.span if n.on_host else 0):
        raise fail(f"{r.value} with {n.host_pages.size} host pages")
    if r not in (Residency.DEVICE, Residency.DEVICE_HOST, Residency.HOST) and (
        r is not Residency.DEVICE_HOST_PENDING
    ):
        raise fail(f"residency {r.value} is not one the tree uses yet")
    if (n.ticket != 0) != (r is Residency.DEVICE_HOST_PENDING):
        raise fail(f"{r.value} with backup ticket {n.ticket}")
    if parent is not tree.root:
        if n.on_device and not parent.on_device:
            raise fail("on the device under a parent that is not (device residency is rooted)")
        if n.on_host and not parent.on_host:
            raise fail("on the host under a parent that is not (host residency is rooted)")
    if n.lock_ref and not n.on_device:
        raise fail("locked without device pages")
    if n.host_ref and not n.on_host:
        raise fail("host-locked without host pages")
    device = sum(c.on_device for c in n.children.values())
    host = sum(c.on_host for c in n.children.values())
    if (device, host) != (n.device_children, n.host_children):
        raise fail(
            f"child counters {(n.device_children, n.host_children)} != actual {(device, host)}"
        )


def _check_pages(tree: RadixTree, held: dict[Tier, list[np.ndarray]]) -> None:
    for tier, arrays in held.items():
        pages = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
        if np.unique(pages).size != pages.size:
            raise TreeInvariantError(f"a {tier.name} page is held by two nodes")
        expected = tree.num_pages if tier is Tier.L1 else tree.num_host_pages
        if pages.size != expected:
            raise TreeInvariantError(f"{tier.name} page counter {expected} != {pages.size} held")
        mask = np.zeros_like(tree._held[tier])
        if pages.size and int(pages.max()) >= mask.size:
            raise TreeInvariantError(f"a {tier.name} page is beyond the held-page mask")
        mask[pages] = True
        if not np.array_equal(mask, tree._held[tier]):
            raise TreeInvariantError(f"the {tier.name} held-page mask disagrees with the nodes")


def _check_heaps(tree: RadixTree, nodes: list[Node]) -> None:
    for tier, heap in tree.heaps.items():
        queued: dict[int, Priority] = {}
        for prio, n in heap:
            if n.id not in queued or prio < queued[n.id]:
                queued[n.id] = prio
        for n in nodes:
            if tree.is_candidate(n, tier):
                q = queued.get(n.id)
                if q is None or q > tree.policy.priority(n):
                    raise TreeInvariantError(
                        f"{tier.name} eviction candidate {n.id} is not queued for eviction"
                    )


def tree_digest(tree: RadixTree) -> str:
    """SHA-256 over the tree's full replicated state (structure, pages, residency, locks,
    clock, stats)."""
    h = hashlib.sha256()
    h.update(
        np.array(
            [tree.clock, tree.num_pages, tree.num_host_pages, tree.num_tokens], dtype=np.int64
        ).tobytes()
    )
    for n in tree.nodes():
        assert n.parent is not None
        h.update(
            np.array(
                [
                    n.id,
                    n.parent.id,
                    n.start,
                    n.end,
                    n.lock_ref,
                    n.host_ref,
                    n.last_access,
                    n.hit_count,
                    n.segment,
                    n.ticket,
                    list(Residency).index(n.residency),
                ],
                dtype=np.int64,
            ).tobytes()
        )
        h.update(n.pages.tobytes())
        h.update(n.host_pages.tobytes())
    return h.hexdigest()
