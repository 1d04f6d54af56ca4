"""The shared tier behind the disk: one rank's :class:`~kvstrata.tiers.disk_store.DiskStore`
with the shared store (:class:`~kvstrata.tiers.remote.tier.RemotePages`) behind it, seen through
the store interface the disk tier's driver (:class:`~kvstrata.tiers.spill.DiskTier`) calls, so
that spill, reload, the ranks' agreement on a lookup and the frontier work for the pair unchanged
(docs/design.md, "Shared tier": L1 -> L2 -> L3 disk -> shared store).

::

    lookup  the disk's leading pages, then the shared store's from the first page the disk
            lacks: the longest prefix the two hold, in order. One count, as for the disk alone
            (under CP the ranks MIN it through the step's frontier all-reduce).
    reload  the pages up to the disk's hit from the disk, the rest from the shared store, each
            verified by its store; a disk page that fails (and those after it, which the disk
            does not read) is asked of the shared store, as are all of them when the disk
            refuses the read. One ReloadDone per ticket, once every part ended.
    spill   the same committed pages to both, in commit order: the disk admits those with
            --l3-min-hits uses, the shared store those with --remote-min-hits. The ticket is
            released once neither store reads its host slots any more; its ``spilled`` is the
            disk's (the shared store counts its own). A page the disk's GC drops stays there.
    wait    the disk's fixed point, then every publish and fetch of the shared store (what
            ``RemotePages.wait`` does): every reload issued before a settle has ended by it,
            retries included, so the step it lands at never depends on either store's speed.

The shared store's fetches run under tickets of their own (negative, apart from the engine's),
so that a reload may have two of them (its tail past the disk, and a retry of the disk's
failures).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import PoolInvariantError
from ..disk_config import DiskPoll, DiskStats
from ..disk_events import Counters, ReloadDone, SpillDone
from ..host_pool import HostPool
from .tier import RemotePages

if TYPE_CHECKING:
    from ..disk_store import DiskStore

COUNTERS = (
    "reloads_split",  # reloads that read from both stores
    "disk_pages",  # pages reloads asked of the disk
    "remote_pages",  # pages reloads asked of the shared store (past the disk's, or retried)
    "disk_refused",  # reloads the disk refused: every page asked of the shared store instead
    "disk_retried",  # pages the disk did not read back verified, asked of the shared store
    "reloaded_from_disk",  # pages of reloads' leading verified runs the disk served
    "reloaded_from_remote",  # ... the shared store served
    "spills_remote_only",  # spills the disk refused that the shared store still took
)


@dataclass(eq=False)
class _Reload:
    hashes: list[bytes]
    host_pool: HostPool
    host_slots: list[int]
    ok: list[bool]
    remote: list[bool]  # page i was asked of the shared store (last)
    parts: int = 0  # store jobs not ended
    disk_pages: int = 0  # pages asked of the disk (the leading ones)


class RemoteBehindDisk:
    """A disk store with the shared store behind it (module docstring), with the disk store's
    method names (what ``DiskTier`` calls)."""

    def __init__(self, disk: DiskStore, remote: RemotePages) -> None:
        self.disk, self.remote = disk, remote
        self.counters = Counters(COUNTERS)
        self._spills: dict[int, int] = {}  # spill ticket -> stores still reading its host slots
        self._reloads: dict[int, _Reload] = {}
        self._fetches: dict[int, tuple[int, int]] = {}  # fetch ticket -> (reload, first page)
        self._next_fetch = -1
        self._error: Exception | None = None  # a shared store's call that raised: poll raises it
        self._late: str | None = None  # the store the last wait gave up on
        # news taken from the stores (by poll, or by wait's pump) not yet handed out
        self._released: list[int] = []
        self._spilled: list[SpillDone] = []
        self._reloaded: list[ReloadDone] = []
        self._dropped: list[bytes] = []

    @property
    def where(self) -> str:
        """The stores, for messages: the one the last wait gave up on, else both."""
        return self._late or f"{self.disk.where}, with the shared store {self.remote.where}"

    @property
    def num_slots(self) -> int:
        """The pages the pair holds (every page the disk spills is published as well)."""
        return max(self.disk.num_slots, self.remote.num_slots)

    @property
    def io_timeout_s(self) -> float:
        """The disk's bound for its part of a step's wait, then the shared store's for its own."""
        return self.disk.io_timeout_s + self.remote.io_timeout_s

    # -- spill -----------------------------------------------------------------------------------

    def spill(
        self, ticket: int, pages: Sequence[tuple[bytes, int, int]], host_pool: HostPool
    ) -> bool:
        """Both stores take the pages (each admits by its own min_hits); False only when both
        refused (then neither reads the host slots)."""
        on_disk = self.disk.spill(ticket, pages, host_pool)  # raises before it accepts anything
        published = self._remote_call(lambda: self.remote.spill(ticket, pages, host_pool))
        if on_disk + published == 0:
            return False
        if not on_disk:
            self.counters.add(spills_remote_only=1)
        self._spills[ticket] = on_disk + published
        return True

    def _remote_call(self, call: Callable[[], bool]) -> bool:
        """A call into the shared store once the disk may hold the host slots: a raise (a store
        thread's bug: its poll raises it again) is kept for :meth:`poll`, never lost, and counts
        as refused here, so the slots stay pinned for the disk's part."""
        try:
            return call()
        except Exception as err:
            self._error = self._error or err
            return False

    # -- lookup and reload -----------------------------------------------------------------------

    def lookup(self, page_hashes: Sequence[bytes]) -> int:
        """The leading pages the disk holds, then those the shared store holds after them."""
        found = self.disk.lookup(page_hashes)
        if found < len(page_hashes):
            found += self.remote.lookup(page_hashes[found:])
        return found

    def reload(
        self,
        ticket: int,
        page_hashes: Sequence[bytes],
        host_pool: HostPool,
        host_slots: Sequence[int],
    ) -> bool:
        """Read the pages the disk holds from it and the rest from the shared store; False only
        when neither store took any (then neither writes the host slots)."""
        n = len(page_hashes)
        rec = _Reload(list(page_hashes), host_pool, list(host_slots), [False] * n, [False] * n)
        if n == 0:  # under CP this rank may own none of the pages: the disk answers, as alone
            if not self.disk.reload(ticket, [], host_pool, []):
                return False
            rec.parts = 1
            self._reloads[ticket] = rec
            return True
        first = self.disk.lookup(page_hashes)  # what it holds now (a spill's GC may have run)
        if first and self.disk.reload(ticket, page_hashes[:first], host_pool, host_slots[:first]):
            rec.parts, rec.disk_pages = 1, first
            self.counters.add(disk_pages=first)
        elif first:
            self.counters.add(disk_refused=1)
            first = 0
        if first < n and self._fetch(ticket, rec, first, n) and rec.disk_pages:
            self.counters.add(reloads_split=1)
        if rec.parts == 0:
            return False
        self._reloads[ticket] = rec
        return True

    def _fetch(self, ticket: int, rec: _Reload, first: int, last: int) -> bool:
        """Ask the shared store for pages ``[first, last)`` of reload ``ticket``."""
        fetch = self._next_fetch
        ok = self._remote_call(
            lambda: self.remote.reload(
                fetch, rec.hashes[first:last], rec.host_pool, rec.host_slots[first:last]
            )
        )
        if not ok:
            return False
        self._next_fetch -= 1
        self._fetches[fetch] = (ticket, first)
        rec.parts += 1
        rec.remote[first:last] = [True] * (last - first)
        self.counters.add(remote_pages=last - first)
        return True

    def _part_done(self, ticket: int, first: int, ok: tuple[bool, ...], disk: bool) -> None:
        rec = self._reloads[ticket]
        rec.ok[first : first + len(ok)] = ok
        rec.parts -= 1
        if disk and not all(ok):  # the disk stopped at its first failure: the rest from remote
            bad = ok.index(False)
            if self._fetch(ticket, rec, bad, rec.disk_pages):
                self.counters.add(disk_retried=rec.disk_pages - bad)
        if rec.parts:
            return
        del self._reloads[ticket]
        lead = next((i for i, good in enumerate(rec.ok) if not good), len(rec.ok))
        remote = sum(rec.remote[:lead])
        self.counters.add(reloaded_from_disk=lead - remote, reloaded_from_remote=remote)
        self._reloaded.append(ReloadDone(ticket, tuple(rec.ok)))

    # -- progress --------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Take both stores' news: releases once neither store reads a spill's host slots,
        the disk's spill results, reloads once every part ended (retries started here)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        disk = self.disk.poll()  # a raise here took nothing
        try:
            remote = self.remote.poll()
        finally:  # the disk's news are taken: kept even when the shared store's poll raises
            self._unpin(disk.released)
            self._spilled += disk.spilled
            self._dropped += disk.dropped
            for done in disk.reloaded:
                self._part_done(done.ticket, 0, done.ok, disk=True)
        self._unpin(remote.released)
        for done in remote.reloaded:
            ticket, first = self._fetches.pop(done.ticket)
            self._part_done(ticket, first, done.ok, disk=False)

    def _unpin(self, released: tuple[int, ...]) -> None:
        """One store no longer reads these spills' host slots: released once neither does."""
        for ticket in released:
            self._spills[ticket] -= 1
            if self._spills[ticket] == 0:
                del self._spills[ticket]
                self._released.append(ticket)

    def poll(self) -> DiskPoll:
        """Completions since the last call, as the disk store reports them."""
        self._pump()
        out = DiskPoll(
            tuple(self._released), tuple(self._spilled), tuple(self._reloaded),
            tuple(self._dropped),
        )  # fmt: skip
        self._released, self._spilled, self._reloaded, self._dropped = [], [], [], []
        return out

    def wait(self, timeout_s: float, spills_writing: int) -> bool:
        """The engine's fixed point (module docstring); False when a store did not get there
        within ``timeout_s`` (:attr:`where` names it)."""
        deadline = time.monotonic() + timeout_s
        self._late = None
        if not self.disk.wait(timeout_s, spills_writing):
            self._late = self.disk.where
            return False
        self._pump()  # the disk's failed pages: their fetches start before the store's flush
        if not self.remote.wait(max(0.0, deadline - time.monotonic()), spills_writing):
            self._late = f"with the shared store {self.remote.where}"
            return False
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every accepted spill and reload of both stores finished."""
        return self.wait(timeout_s, spills_writing=0)

    def stats(self) -> DiskStats:
        """The disk's (the shared store's are ``remote.stats()``, the pair's :attr:`counters`)."""
        return self.disk.stats()

    def check(self) -> None:
        """The ticket tables' invariants and the shared store's; raises ``PoolInvariantError``."""
        bad = [t for t, n in self._spills.items() if not 1 <= n <= 2]
        bad += [t for t, rec in self._reloads.items() if rec.parts < 1]
        bad += [t for t, _ in self._fetches.values() if t not in self._reloads]
        if bad:
            raise PoolInvariantError(
                f"disk + shared tier: tickets {sorted(set(bad))[:5]} have no store job left, "
                "or a fetch outlived its reload"
            )
        self.remote.remote.check()

    def close(self) -> None:
        """Close the disk (it finishes its work), then the shared store. Idempotent."""
        try:
            self.disk.close()
        finally:
            self.remote.close()
