"""Loading host-only pages back to the device (docs/design.md, "Tiers and movement": load-back).

A hit whose tail lives only on the host gets device pages of the same owners (the engine
allocates them, evicting from L1 if needed, and counts evictable pages as free). :meth:`start`
attaches them to the host-only nodes (``HOST -> DEVICE_HOST``) and submits every layer's host ->
device copy at once on the load stream; the forward then waits, layer by layer, only for the layer
it is about to read (:meth:`before_layer`), so the copy of layer ``i + 1`` overlaps the compute of
layer ``i``. The host pages stay host-locked until the commit frontier covers the load's ticket.

A load that fails while it is submitted (the CPU path copies synchronously) is undone at once:
the nodes go back to host-only and the request computes that part instead. A load that fails
later, on the device, raises at ``before_layer`` so no forward reads pages that never arrived.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..cache.radix import MatchResult, Node, RadixTree
from ..errors import TransferError
from ..residency import Tier
from .tickets import TicketKind, TicketLedger
from .transfer import Transfer

IntArray = npt.NDArray[np.int64]


@dataclass
class LoadStats:
    loads: int = 0
    pages: int = 0
    failed: int = 0
    wait_s: float = 0.0  # time the forward spent waiting for load-back copies (host clock)


@dataclass
class LoadBack:
    """Submits load-backs and makes each forward layer wait for its own copy."""

    tree: RadixTree
    transfer: Transfer
    ledger: TicketLedger
    num_layers: int
    drain: Callable[[], None]  # routes finished copies to the ledger (the engine's poll)
    rank: int = 0  # under CP this rank loads only the pages of its own lane
    stats: LoadStats = field(default_factory=LoadStats)
    _step_tickets: list[int] = field(default_factory=list)
    _host_locked: dict[int, Node] = field(default_factory=dict)
    _landed: dict[int, bool] = field(default_factory=dict)  # ticket -> ok, once polled

    def start(self, hit: MatchResult, device_pages: IntArray) -> bool:
        """Load ``hit``'s host-only part into ``device_pages`` (one per page, owners matching).

        The caller host-locked ``hit.last_node`` and keeps ``hit.device_node`` locked. Returns
        False when the copy failed at submission; the nodes are then host-only again, the device
        pages are the caller's to free, and the host lock is released at the frontier.
        """
        tree, cp = self.tree, self.tree.cp_size
        offset = 0
        for node in hit.host_nodes:
            tree.attach_device(node, device_pages[offset : offset + node.span])
            offset += node.span
        assert offset == device_pages.size, (offset, device_pages.size)
        ticket = self.ledger.issue(TicketKind.LOAD)
        self._host_locked[ticket] = hit.last_node
        own = device_pages % cp == self.rank
        host_slots = hit.host_pages[own] // cp
        device_slots = device_pages[own] // cp
        for layer in range(self.num_layers):
            self.transfer.h2d(ticket, layer, host_slots, device_slots)
        self.transfer.close(ticket, self.num_layers)
        self.drain()
        if self._landed.get(ticket) is False:  # the CPU path copies at once: it failed
            self.stats.failed += 1
            if cp > 1:  # only this rank knows: rolling back here alone would fork the tree
                raise TransferError(
                    f"rank {self.rank}: load-back ticket {ticket} failed "
                    f"({self.ledger.error(ticket) or 'copy error'}); under context "
                    "parallelism a copy failure on one rank stops the run instead of letting the "
                    "ranks' trees diverge"
                )
            for node in reversed(hit.host_nodes):  # leaf side first: device residency is rooted
                tree.trim(node, Tier.L1, node.span)
            return False
        self._step_tickets.append(ticket)
        self.stats.loads += 1
        self.stats.pages += device_pages.size
        return True

    def before_layer(self, layer: int) -> None:
        """Make the forward wait for this step's loads of ``layer`` (no host sync on CUDA)."""
        if not self._step_tickets:
            return
        t0 = time.perf_counter()
        for ticket in self._step_tickets:
            landed = self._landed.get(ticket)
            if landed is None:
                self.transfer.wait_layer(ticket, layer)
            elif not landed:
                raise TransferError(
                    f"load-back ticket {ticket} failed before the forward read its pages"
                )
        self.stats.wait_s += time.perf_counter() - t0

    def end_forward(self) -> None:
        self._step_tickets = []

    def note_landed(self, ticket: int, ok: bool) -> None:
        """The transfer finished ``ticket`` on this rank (a load's copies need no more waiting)."""
        if ticket in self._host_locked:
            self._landed[ticket] = ok

    def settle(self, ticket: int, ok: bool) -> None:
        """The frontier covers the load ``ticket``: release its host pages."""
        self._landed.pop(ticket, None)
        self.tree.host_unlock(self._host_locked.pop(ticket))

    @property
    def host_locks(self) -> int:
        return len(self._host_locked)
