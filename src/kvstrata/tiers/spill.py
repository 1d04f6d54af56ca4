"""Spill to and reload from the disk tier (L3), driving the tree (docs/design.md, "Tiers and
movement": spill, reload).

* **Spill.** When a backup commits, its host pages are handed to the
  :class:`~kvstrata.tiers.disk_store.DiskStore` under their content addresses (prefix-chained page
  hashes), in commit order. The node that holds them is host-locked until the store has gathered
  them into its staging memory, so L2 eviction cannot reuse a page the store is still reading.
* **Reload.** A request whose prefix the tree misses looks the missing pages up in the disk index;
  the leading pages found get host pages, are read and verified on the store's reader thread, and
  become a host-only node; the request waits meanwhile (others pass it), then loads them back to
  the device as any host hit.

Both are tickets of the engine's ledger: a spill takes effect (its host lock is released) and a
reload is inserted only when the commit frontier covers it, so every rank changes its tree at the
same step. A page that fails verification is a miss: the reload keeps the leading run of verified
pages and frees the rest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from ..cache.allocator import PageAllocator
from ..cache.keys import TokenKey
from ..cache.radix import Node, RadixTree
from ..errors import DiskStoreError
from ..ownership import owners
from ..residency import Tier
from .disk_config import DiskPoll, DiskStats
from .host_pool import HostPool
from .tickets import TicketKind, TicketLedger

if TYPE_CHECKING:
    from .remote.results import RemoteStats

IntArray = npt.NDArray[np.int64]
#: Spills the engine lets the store still be writing when a step settles: their fdatasync and
#: index commit overlap the next steps' compute instead of stalling each step.
SPILLS_WRITING = 4


class PageStore(Protocol):
    """What :class:`DiskTier` drives: a :class:`~kvstrata.tiers.disk_store.DiskStore`, the
    shared store in its place (``remote.tier.RemotePages``), or the shared store behind it
    (``remote.behind_disk.RemoteBehindDisk``)."""

    @property
    def where(self) -> str: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def io_timeout_s(self) -> float: ...
    def spill(
        self, ticket: int, pages: Sequence[tuple[bytes, int, int]], host_pool: HostPool
    ) -> bool: ...
    def reload(
        self,
        ticket: int,
        page_hashes: Sequence[bytes],
        host_pool: HostPool,
        host_slots: Sequence[int],
    ) -> bool: ...
    def lookup(self, page_hashes: Sequence[bytes]) -> int: ...
    def poll(self) -> DiskPoll: ...
    def flush(self, timeout_s: float) -> bool: ...
    def wait(self, timeout_s: float, spills_writing: int) -> bool: ...
    def stats(self) -> DiskStats | RemoteStats: ...
    def close(self) -> None: ...


@dataclass
class DiskStatsView:
    """What the engine did with the disk tier (the store keeps its own I/O counters)."""

    spills: int = 0
    spilled_pages: int = 0
    spills_refused: int = 0
    reloads: int = 0
    reloaded_pages: int = 0
    reload_misses: int = 0  # pages the index had but that did not read back verified
    reloads_refused: int = 0  # reloads the store refused (closed, or its disk stopped answering)
    reload_refused_pages: int = 0  # their pages (not misses: they were never read)
    hit_tokens: int = 0  # tokens requests got from disk (then loaded back like host hits)


class SpillItem(NamedTuple):
    """Committed host pages to spill: ``hashes[i]`` is the address of ``host_pages[i]``."""

    node: Node  # the lowest node holding them
    hashes: list[bytes]
    host_pages: IntArray
    hits: int


@dataclass
class _Reload:
    key: TokenKey  # the prefix: cached part plus the pages asked for
    cached_len: int
    host_pages: IntArray
    parent: Node  # host-locked until the reload is inserted
    rid: int
    first_hash: bytes  # the content address of its first page
    ok: tuple[bool, ...] = ()
    refused: bool = False  # the store refused it: nothing was read


@dataclass
class DiskTier:
    """Spills committed host pages and reloads missed ones for one rank."""

    tree: RadixTree
    host_allocator: PageAllocator
    host_pool: HostPool
    store: PageStore  # the disk, the shared store in its place, or both
    ledger: TicketLedger
    rank: int = 0
    stats: DiskStatsView = field(default_factory=DiskStatsView)
    _spills: dict[int, list[Node]] = field(default_factory=dict)  # ticket -> host-locked nodes
    _reloads: dict[int, _Reload] = field(default_factory=dict)
    _written_since: bool = False  # a spill was handed to the store since the last wait

    # -- spill -----------------------------------------------------------------------------------

    def spill(self, batch: list[SpillItem]) -> None:
        """Hand committed host pages to the store as one job under one ticket (every backup a
        settle committed, in commit order). Each item's node (the lowest node holding its pages)
        stays host-locked until the store has gathered them."""
        batch = [item for item in batch if not item.node.dead and item.node.on_host]
        if not batch:
            return
        ticket = self.ledger.issue(TicketKind.SPILL)
        cp = self.tree.cp_size
        pages: list[tuple[bytes, int, int]] = []
        for item in batch:
            own = item.host_pages % cp == self.rank
            if own.size != len(item.hashes):
                raise ValueError(f"{len(item.hashes)} page hashes for {own.size} host pages")
            slots = (item.host_pages[own] // cp).tolist()  # Python ints, one pass
            mine = compress(item.hashes, own.tolist())
            pages += zip(mine, slots, repeat(item.hits, len(slots)), strict=True)
            # Locked on every rank alike, whatever this rank's store does: the lock is replicated
            # state, released when the frontier covers the ticket.
            self.tree.host_lock(item.node)
        self._spills[ticket] = [item.node for item in batch]
        try:
            accepted = self.store.spill(ticket, pages, self.host_pool)
        except Exception:  # any store fault is a skipped spill (counted), never a lost lock
            accepted = False
        if not accepted:
            self.stats.spills_refused += 1
            self.ledger.finish(ticket, ok=False, error="the disk store refused the spill")
            return
        self.stats.spills += 1
        self._written_since = True

    def wait_in_flight(self, timeout_s: float) -> float:
        """Block until every reload handed to the store has finished and every spill has
        released its host pages, with at most :data:`SPILLS_WRITING` spills still being written
        (the engine's fixed point: what the disk does between two steps is then the same on
        every run, however fast it is; pages being written already count as on disk, and a read
        of one waits for it); the seconds waited. A disk that does not get there within
        ``timeout_s`` stops the run: its reader may still write into host pages, which must not
        be reused."""
        if not self._spills and not self._reloads and not self._written_since:
            return 0.0
        t0 = time.perf_counter()
        self._written_since = False
        if not self.store.wait(timeout_s, spills_writing=SPILLS_WRITING):
            raise DiskStoreError(
                f"rank {self.rank}: the disk tier's I/O did not finish within {timeout_s:g} s "
                f"({len(self._spills)} spills, {len(self._reloads)} reloads in flight); the disk "
                f"{self.store.where} stopped answering"
            )
        return time.perf_counter() - t0

    # -- reload ----------------------------------------------------------------------------------

    def local_count(self, hashes: list[bytes], first: int, last: int) -> int:
        """Under CP: how many pages from ``first`` (before ``last``) could be reloaded as far as
        this rank knows: up to its first owned page the disk lacks. The ranks take the MIN
        through the frontier collective before anything is reserved."""
        cp = self.tree.cp_size
        mine = np.arange(first, last, dtype=np.int64)
        mine = mine[mine % cp == self.rank]
        found = self.store.lookup([hashes[int(i)] for i in mine])
        return last - first if found == mine.size else int(mine[found]) - first

    def try_reload(
        self,
        key: TokenKey,
        hashes: list[bytes],
        cached_len: int,
        limit: int,
        parent: Node,
        rid: int,
        count: int | None = None,
    ) -> int | None:
        """Start reloading the pages after ``cached_len`` tokens that the disk holds (at most up
        to ``limit`` tokens; ``count`` pages when the ranks already agreed on it). Returns the
        reload's ticket, or None when there is nothing to read or no host room (then the request
        simply computes)."""
        P = self.tree.page_size
        first, last = cached_len // P, limit // P
        if last <= first or (parent is not self.tree.root and not parent.on_host):
            return None
        if count is None:
            count = self.store.lookup(hashes[first:last])
        count = min(count, last - first)
        if count <= 0:
            return None
        wanted = hashes[first : first + count]
        if len(wanted) != count:
            raise ValueError(f"{len(hashes)} page hashes for pages {first}..{first + count}")
        alloc, tree = self.host_allocator, self.tree
        locked = parent is not tree.root  # its host copy must outlive the reload
        if locked:
            tree.host_lock(parent)
        want = owners(first, count, alloc.cp_size)
        host_pages = alloc.alloc_pages_with_owners(want)
        if host_pages is None:
            alloc.free(tree.evict(alloc.deficit(want), Tier.L2))
            host_pages = alloc.alloc_pages_with_owners(want)
        if host_pages is None:
            if locked:
                tree.host_unlock(parent)
            return None
        ticket = self.ledger.issue(TicketKind.RELOAD)
        cp = self.tree.cp_size
        own = host_pages % cp == self.rank
        mine = list(compress(wanted, own.tolist()))
        self._reloads[ticket] = _Reload(
            key.prefix((first + count) * P), cached_len, host_pages, parent, rid, hashes[first]
        )
        if not self.store.reload(ticket, mine, self.host_pool, host_pages[own] // cp):
            self._reloads[ticket].refused = True
            self.ledger.finish(ticket, ok=False, error="the disk store refused the reload")
        return ticket

    def pending_reload(self, parent: Node, first_hash: bytes) -> int | None:
        """The ticket of a reload in flight that reads the page ``first_hash`` under ``parent``
        (another request missed the same pages first), or None."""
        for ticket, rec in self._reloads.items():
            if rec.parent is parent and rec.first_hash == first_hash:
                return ticket
        return None

    # -- progress and the frontier ---------------------------------------------------------------

    def poll(self) -> None:
        """Route the store's news to the ledger: gathered spills, finished reloads."""
        news = self.store.poll()
        for ticket in news.released:
            if ticket in self._spills:
                self.ledger.finish(ticket, ok=True)
        for spilled in news.spilled:
            self.stats.spilled_pages += len(spilled.durable)
        for reloaded in news.reloaded:
            rec = self._reloads.get(reloaded.ticket)
            if rec is not None:
                rec.ok = reloaded.ok
                # Under CP a page that failed here fails the whole reload on every rank (the
                # frontier unions failures): ranks cannot each keep a different run.
                whole = self.tree.cp_size == 1 or all(reloaded.ok)
                error = None if whole else "a reloaded page failed verification"
                self.ledger.finish(reloaded.ticket, ok=whole, error=error)

    def settle_spill(self, ticket: int) -> None:
        for node in self._spills.pop(ticket, []):
            self.tree.host_unlock(node)

    def settle_reload(self, ticket: int, ok: bool) -> tuple[int, int] | None:
        """Insert what a reload verified as a host-only node; returns ``(rid, tokens)`` it
        brought, or None when nothing came back."""
        rec = self._reloads.pop(ticket)
        tree, P = self.tree, self.tree.page_size
        if rec.parent is not tree.root:
            tree.host_unlock(rec.parent)
        verified = 0
        if ok:
            for (
                good
            ) in rec.ok:  # this rank's pages, in order; under CP ranks agree via the frontier
                if not good:
                    break
                verified += 1
        cp = tree.cp_size
        own = np.flatnonzero(rec.host_pages % cp == self.rank)
        if cp > 1:  # all or nothing, alike on every rank (see poll)
            keep = rec.host_pages.size if ok else 0
        else:
            keep = rec.host_pages.size if verified >= own.size else int(own[verified])
        if rec.refused:
            self.stats.reloads_refused += 1
            self.stats.reload_refused_pages += rec.host_pages.size - keep
        else:
            self.stats.reloads += 1
            self.stats.reload_misses += rec.host_pages.size - keep
        # The tree must still hold exactly the cached part (nothing lost, nothing added since).
        if keep == 0 or tree.match_length(rec.key) != rec.cached_len:
            self.host_allocator.free(rec.host_pages)
            return None
        self.host_allocator.free(rec.host_pages[keep:])
        leaf = tree.insert_host(rec.key.prefix(rec.cached_len + keep * P), rec.host_pages[:keep],
                                rec.cached_len)  # fmt: skip
        if leaf is None:  # a key collision with the tree's pages: the request computes these
            self.host_allocator.free(rec.host_pages[:keep])
            return None
        self.stats.reloaded_pages += keep
        return rec.rid, keep * P

    @property
    def held_pages(self) -> int:
        """Host pages reserved for reloads in flight."""
        return sum(r.host_pages.size for r in self._reloads.values())

    @property
    def host_locks(self) -> int:
        return sum(len(nodes) for nodes in self._spills.values()) + sum(
            1 for r in self._reloads.values() if r.parent is not self.tree.root
        )

    def close(self) -> None:
        self.store.close()
