"""Backing device pages up to the host tier (docs/design.md, "Tiers and movement": write-through).

Three policies decide *when* a node's device pages are copied to host pages:

* ``write_through`` (default): every chunk a forward computes. Host pages are reserved before the
  forward, each layer's copies go out as soon as the layer has written its KV (``after_layer``),
  and the backup attaches to the node the chunk's insert creates.
* ``write_through_selective``: a node once it has been hit ``hits`` times (at admission).
* ``write_back``: a device-only node when L1 eviction would drop it (it is demoted once its backup
  commits; the request that needed the room waits a step).

A backup is *reserved* (host pages allocated, the parent's host copy host-locked so L2 eviction
cannot take it meanwhile), *submitted* under a ticket, *attached* to its node
(``DEVICE -> DEVICE_HOST_PENDING``), and *committed* or *rolled back* when the commit frontier
covers its ticket. Host pages whose node never materialised (the insert found the pages already
cached) are *orphans*: freed once their ticket's copies have landed, never visible.

Admission is gated by the hard deficit only: a backup that cannot get host pages even after L2
eviction is skipped and counted, never waited for. Host residency is root-connected, so a node
whose parent has no host copy is skipped too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..cache.allocator import PageAllocator
from ..cache.radix import Node, RadixTree
from ..config import WRITE_POLICIES
from ..errors import ConfigError
from ..ownership import owners
from ..residency import Residency, Tier
from .tickets import TicketKind, TicketLedger
from .transfer import Transfer

IntArray = npt.NDArray[np.int64]


@dataclass
class BackupStats:
    """Backups by outcome, in nodes and pages (a skipped backup never got host pages)."""

    done: int = 0
    done_pages: int = 0
    skipped: int = 0
    skipped_pages: int = 0
    failed: int = 0
    failed_pages: int = 0
    orphaned_pages: int = 0  # reserved and copied, but the pages were already cached


@dataclass(slots=True)
class Reservation:
    """Host pages reserved for device pages ``[first_page, first_page + n)`` of a sequence."""

    ticket: int
    first_page: int
    device_pages: IntArray
    host_pages: IntArray
    anchor: Node  # host-locked until attach (the parent the new node will hang under)


@dataclass
class WriteThrough:
    """Reserves, submits, attaches and settles backups for one rank."""

    tree: RadixTree
    host_allocator: PageAllocator
    transfer: Transfer
    ledger: TicketLedger
    num_layers: int
    policy: str = "write_through"
    hits: int = 2  # write_through_selective: back a node up once it has this many hits
    rank: int = 0  # under CP this rank copies only the pages of its own lane
    stats: BackupStats = field(default_factory=BackupStats)
    _step: list[Reservation] = field(default_factory=list)
    _step_ticket: int = 0
    _orphans: dict[int, list[IntArray]] = field(default_factory=dict)
    _reserved_pages: int = 0

    def __post_init__(self) -> None:
        if self.policy not in WRITE_POLICIES:
            raise ConfigError(
                f"write policy must be one of {', '.join(WRITE_POLICIES)}, got {self.policy!r}"
            )
        if self.hits < 1:
            raise ConfigError(f"write_through_selective needs hits >= 1, got {self.hits}")

    # -- reserve before the forward --------------------------------------------------------------

    def reserve_chunk(
        self, anchor: Node, first_page: int, device_pages: IntArray
    ) -> Reservation | None:
        """Reserve host pages for a chunk's new pages (``write_through`` only), to be copied
        layer by layer during this step's forward."""
        if self.policy != "write_through":
            return None
        if not self._step_ticket:
            self._step_ticket = self.ledger.issue(TicketKind.BACKUP)
        res = self._reserve(anchor, first_page, device_pages, self._step_ticket)
        if res is not None:
            self._step.append(res)
        return res

    def _reserve(
        self, anchor: Node, first_page: int, device_pages: IntArray, ticket: int
    ) -> Reservation | None:
        tree, alloc = self.tree, self.host_allocator
        if anchor is not tree.root and not anchor.on_host:
            self._skip(device_pages.size)  # host residency is root-connected
            return None
        if anchor is not tree.root:
            tree.host_lock(anchor)
        want = owners(first_page, device_pages.size, alloc.cp_size)
        host_pages = alloc.alloc_pages_with_owners(want)
        if host_pages is None:
            alloc.free(tree.evict(alloc.deficit(want), Tier.L2))
            host_pages = alloc.alloc_pages_with_owners(want)
        if host_pages is None:
            if anchor is not tree.root:
                tree.host_unlock(anchor)
            self._skip(device_pages.size)
            return None
        self._reserved_pages += host_pages.size
        return Reservation(ticket, first_page, device_pages.copy(), host_pages, anchor)

    def _skip(self, num_pages: int) -> None:
        self.stats.skipped += 1
        self.stats.skipped_pages += num_pages

    # -- copy during the forward -----------------------------------------------------------------

    def after_layer(self, layer: int) -> None:
        """Submit this step's copies of ``layer`` (the layer has just written its KV)."""
        if not self._step:
            return
        device, host = self._own_slots(self._step)
        self.transfer.d2h(self._step_ticket, layer, device, host)

    def _own_slots(self, reservations: list[Reservation]) -> tuple[IntArray, IntArray]:
        """This rank's device and host slots of the reserved pages (its lane only)."""
        cp = self.tree.cp_size
        device = np.concatenate([r.device_pages for r in reservations])
        host = np.concatenate([r.host_pages for r in reservations])
        own = device % cp == self.rank
        return device[own] // cp, host[own] // cp

    def end_forward(self) -> None:
        """Close this step's ticket: every layer has been submitted."""
        if self._step_ticket:
            if self._step:
                self.transfer.close(self._step_ticket, self.num_layers)
            else:  # every reservation was skipped: nothing to copy, nothing to wait for
                self.ledger.finish(self._step_ticket, ok=True)
        self._step, self._step_ticket = [], 0

    # -- attach after the insert -----------------------------------------------------------------

    def attach(self, res: Reservation, node: Node) -> bool:
        """The chunk's insert put its pages into ``node``: start the node's pending backup, or
        orphan the host pages when the insert kept other pages there. True if it backs up."""
        tree = self.tree
        if res.anchor is not tree.root:
            tree.host_unlock(res.anchor)
        self._reserved_pages -= res.host_pages.size
        parent = node.parent
        fits = (
            node.residency is Residency.DEVICE
            and node.start // tree.page_size == res.first_page
            and node.span == res.host_pages.size
            and np.array_equal(node.pages, res.device_pages)
            and parent is not None
            and (parent is tree.root or parent.on_host)
        )
        if fits:
            tree.start_backup(node, res.host_pages, res.ticket)
        else:
            self._orphan(res.ticket, res.host_pages)
        return fits

    def _orphan(self, ticket: int, host_pages: IntArray) -> None:
        self.stats.orphaned_pages += host_pages.size
        self._orphans.setdefault(ticket, []).append(host_pages)

    # -- backups outside the forward (selective, write-back) -------------------------------------

    def back_up_now(self, nodes: list[Node]) -> int:
        """Back up device-only ``nodes`` (root side first) with all layers at once, under one
        ticket. Returns how many started."""
        started: list[Reservation] = []
        ticket = 0
        for node in nodes:
            if node.residency is not Residency.DEVICE or node.dead:
                continue
            parent = node.parent
            assert parent is not None
            if not ticket:
                ticket = self.ledger.issue(TicketKind.BACKUP)
            res = self._reserve(parent, node.start // self.tree.page_size, node.pages, ticket)
            if res is None:
                continue
            self.attach(res, node)
            started.append(res)
        if not ticket:
            return 0
        if started:
            device, host = self._own_slots(started)
            for layer in range(self.num_layers):
                self.transfer.d2h(ticket, layer, device, host)
            self.transfer.close(ticket, self.num_layers)
        else:
            self.ledger.finish(ticket, ok=True)
        return len(started)

    def on_hit(self, node: Node) -> None:
        """``write_through_selective``: back up the path's device-only nodes hit often enough."""
        if self.policy != "write_through_selective":
            return
        path: list[Node] = []
        cur: Node | None = node
        while cur is not None and cur.parent is not None:
            path.append(cur)
            cur = cur.parent
        due = [
            n
            for n in reversed(path)
            if n.residency is Residency.DEVICE and n.hit_count >= self.hits
        ]
        if due:
            self.back_up_now(due)

    def before_evict(self, num_pages: int) -> int:
        """``write_back``: back up the device-only L1 victims next in line instead of dropping
        them (they are demoted once committed). Returns how many backups started."""
        if self.policy != "write_back":
            return 0
        victims: list[Node] = []
        covered = 0
        for node in self.tree.eviction_order(Tier.L1):
            if covered >= num_pages:
                break
            if node.residency is Residency.DEVICE:
                victims.append(node)
            covered += node.span
        victims.sort(key=lambda n: n.start)  # parents before children
        return self.back_up_now(victims)

    # -- settle at the frontier ------------------------------------------------------------------

    def settle(self, ticket: int, ok: bool) -> None:
        """The frontier covers ``ticket``: commit its backups, or roll them back (and those of
        descendants that cannot stand without them); free its orphans."""
        tree = self.tree
        if ok:
            pages = tree.commit_backup(ticket)
            if pages:
                self.stats.done += 1
                self.stats.done_pages += pages
        else:
            for owner, host_pages in tree.abort_backup(ticket):
                self.stats.failed += 1
                self.stats.failed_pages += host_pages.size
                if owner <= ticket:
                    self.host_allocator.free(host_pages)
                else:  # its own copy may still be writing into these pages
                    self._orphans.setdefault(owner, []).append(host_pages)
        for host_pages in self._orphans.pop(ticket, []):
            self.host_allocator.free(host_pages)

    @property
    def held_pages(self) -> int:
        """Host pages allocated but not held by the tree: reserved or orphaned."""
        return self._reserved_pages + sum(p.size for ps in self._orphans.values() for p in ps)
