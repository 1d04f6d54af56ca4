"""Requests parked behind a disk reload, and the ranks' agreement on what to read
(docs/design.md, "Tiers and movement": reload).

When the tree misses pages the disk holds, the request leaves the queue until they are read and
inserted host-only; then it comes back and loads them back like any host hit. Other requests
pass it meanwhile. Requests that miss the same pages (same parent, same first page) while that
read is in flight wait for it instead of reading again.

Under CP each rank knows only its own pages, so a lookup first waits one step: every rank counts
the leading pages it can serve and the next commit frontier's collective takes the MIN
(``Progress.agree``); only then is the reload started, alike on every rank.

Parked requests come back in ticket order (the reload issued first, first), and behind one
reload in the order they waited, so the request whose read it was is admitted first and its
tokens count as L3 hits.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from ..cache.node import Node
from .hierarchy import CacheHierarchy, Settled
from .request import Waiting, reusable_len


class Park(Enum):
    """What :meth:`DiskWaits.park` did with a request."""

    PARKED = "parked"  # behind a reload (or a lookup the ranks agree on next step)
    COMPUTE = "compute"  # nothing to read: it computes
    LATER = "later"  # this step's reloads are all started: it tries again next step


class _Lookup(NamedTuple):
    waiting: Waiting
    first: int  # the first sequence page the tree missed when it looked
    found: int  # pages from there this rank's disk can serve (before the ranks' MIN)
    parent: Node  # where the tree's match ended
    first_hash: bytes  # the content address of page ``first``
    followers: list[Waiting]  # requests that missed the same pages since: they share the read


class DiskWaits:
    """Requests waiting for the disk, keyed by the reload they wait for."""

    def __init__(self, cache: CacheHierarchy, reloads_per_step: int) -> None:
        assert cache.disk is not None
        self.cache = cache
        self.disk = cache.disk
        #: New reloads (and CP lookups) one step may start: the per-step budget that keeps the
        #: disk's queue bounded by replicated inputs instead of refusals.
        self.reloads_per_step = reloads_per_step
        self._started = 0  # this step's
        # reload ticket -> the requests waiting for it: the one that asked, then any that missed
        # the same pages meanwhile (they share the read instead of reading again)
        self._parked: dict[int, list[Waiting]] = {}
        self._lookups: list[_Lookup] = []  # under CP: waiting for the ranks' MIN
        self._tried: set[int] = set()  # request ids that looked once (they compute if it failed)

    def __bool__(self) -> bool:
        return bool(self._parked or self._lookups)

    @property
    def looking(self) -> int:
        """Requests waiting for the ranks to agree on a disk lookup (followers included): each
        takes the admission slot it would use."""
        return sum(1 + len(lk.followers) for lk in self._lookups)

    def park(self, waiting: Waiting) -> Park:
        """Park ``waiting`` behind a reload of the pages the tree misses that the disk holds
        (or, under CP, behind the lookup the next frontier agrees on)."""
        parked = self._park(waiting)
        if parked is Park.LATER:
            self._tried.discard(waiting.request.rid)
        return parked

    def _park(self, waiting: Waiting) -> Park:
        request, key = waiting.request, waiting.key
        if request.rid in self._tried:
            return Park.COMPUTE
        self._tried.add(request.rid)
        cache, P = self.cache, self.cache.config.page_size
        limit = reusable_len(len(key), P)
        hit = cache.tree.match_prefix(key, max_len=limit, record=False)
        if hit.valid_len >= limit:
            return Park.COMPUTE
        hashes = cache.page_hashes(request.rid, key)
        first, last, parent = hit.valid_len // P, limit // P, hit.last_node
        if last <= first or cache.tree.holds_other_tokens(parent, key, first):
            return Park.COMPUTE  # (a key collision: a reload could not be inserted; decided alike)
        # The same pages already on their way (same parent, same first page): wait for that read.
        # A follower may look again once that read lands: it may need pages past the first's.
        ticket = self.disk.pending_reload(parent, hashes[first])
        if ticket is not None:
            self._parked[ticket].append(waiting)
            self._tried.discard(request.rid)
            return Park.PARKED
        if cache.cp > 1:  # each rank knows its own pages: the next frontier agrees on the count
            for lk in self._lookups:
                if lk.parent is parent and lk.first_hash == hashes[first]:
                    lk.followers.append(waiting)
                    self._tried.discard(request.rid)
                    return Park.PARKED
            if parent is not cache.tree.root and not parent.on_host:
                return Park.COMPUTE  # nothing a reload could attach to: decided alike, no lookup
            if self._started >= self.reloads_per_step:
                return Park.LATER
            self._started += 1
            found = self.disk.local_count(hashes, first, last)
            self._lookups.append(_Lookup(waiting, first, found, parent, hashes[first], []))
            return Park.PARKED
        if self._started >= self.reloads_per_step:
            return Park.LATER
        ticket = self.disk.try_reload(key, hashes, hit.valid_len, limit, parent, request.rid)
        if ticket is None:
            return Park.COMPUTE
        self._started += 1
        self._parked[ticket] = [waiting]
        return Park.PARKED

    def take_lookups(self) -> tuple[int, ...]:
        """This rank's counts for the lookups waiting for agreement (what the frontier MINs);
        :meth:`settle` must follow with the frontier's answer."""
        return tuple(lk.found for lk in self._lookups)

    def settle(self, settled: Settled) -> list[Waiting]:
        """Requests whose wait ended, in the order they come back: those behind the reloads the
        frontier applied (ticket order), then lookups with nothing to read. Agreed lookups start
        their reloads."""
        self._started = 0
        back: list[Waiting] = []
        for ticket in settled.reloads:
            back += self._parked.pop(ticket)
        lookups, self._lookups = self._lookups, []
        for lk, count in zip(lookups, settled.agreed, strict=True):
            if not self._reload_agreed(lk, count):
                back += [lk.waiting, *lk.followers]
        return back

    def _reload_agreed(self, lookup: _Lookup, count: int) -> bool:
        """Start the reload every rank agreed on (``count`` pages from ``lookup.first``, the MIN
        over ranks); False when there is nothing left to read (the request computes)."""
        cache, P = self.cache, self.cache.config.page_size
        request, key = lookup.waiting.request, lookup.waiting.key
        limit = reusable_len(len(key), P)
        hit = cache.tree.match_prefix(key, max_len=limit, record=False)  # it may have grown
        now = hit.valid_len // P
        if now < lookup.first or hit.valid_len >= limit:  # shrank: pages no rank looked up
            return False
        count = lookup.first + count - now
        if count <= 0:
            return False
        ticket = self.disk.try_reload(
            key, cache.page_hashes(request.rid, key), hit.valid_len, limit, hit.last_node,
            request.rid, count,
        )  # fmt: skip
        if ticket is None:
            return False
        self._parked[ticket] = [lookup.waiting, *lookup.followers]
        return True

    def give_up_lookups(self) -> list[Waiting]:
        """Lookups still waiting for agreement, given up (their requests wait again and will
        compute): settling then starts no new reload."""
        back = [w for lk in self._lookups for w in (lk.waiting, *lk.followers)]
        self._lookups = []
        return back

    def forget(self, rid: int) -> None:
        self._tried.discard(rid)

    def held_back(self) -> list[int]:
        """Ids of every request waiting for the disk (each must appear once)."""
        looking = [w for lk in self._lookups for w in (lk.waiting, *lk.followers)]
        parked = [w for ws in self._parked.values() for w in ws]
        return [w.request.rid for w in looking + parked]
