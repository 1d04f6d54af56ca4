"""The disk tier's decisions, made when a spill is submitted: a pure function of the calls.

Every structural choice of the spill pipeline is settled here, on the caller's thread, under
the store's state lock, in the order the calls come (spills, reads, touches), before any thread
touches the disk::

    spill job  ─▶ plan():  for each admitted page, in order
                   on disk already (live)        -> touched, durable at once
                   being written by earlier work -> resolved when that write commits
                   else: GC first if one more slot would pass the high watermark (the least
                         recently used live pages, down to the low watermark: the victims),
                         then a free slot, the newest in LRU order
                 batches: runs of at most ``batch_pages`` written pages (one fdatasync per slab
                 and one index commit each)
    read / touch ─▶ touch(): live pages become the most recently used, in memory

The writer thread only executes plans, in submission order: it deletes a job's victims' index
entries (one commit), writes its pages, syncs, publishes each batch (one commit). So the batch
boundaries, GC's victims and the slot of every page are the same on every run, however fast the
disk drains its queue. A victim's slot may be planned for a new page at once: the writes of that
job and of every later one run after the victims' entries are deleted, which is what keeps a
slot from being rewritten while an index entry names it. Until the deletion commits the victims
are still in the index; ``pending`` lists them so that lookups already miss them.

An access moves a page in the in-memory LRU at once; its ``last_access`` in the index is brought
up to date only when the store closes (``SlotPool.touched``): a lost touch only changes the
order GC takes pages in after a crash, never what a read returns, and keeps accesses from
rewriting the index.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .disk_events import Counters, RateLimitedLog
from .disk_slots import ALLOCATED, LIVE, WRITING, SlotPool
from .host_pool import HostPool


@dataclass(eq=False)
class SpillJob:
    """One spill ticket: its pages, its plan, and where each page ended."""

    ticket: int
    hashes: list[bytes]  # the pages admitted, in spill order
    host_slots: list[int]  # where each is in the host pool
    host_pool: HostPool
    skipped: list[bytes]  # under min_hits
    # The plan: (page hash, host slot, disk slot) to write, in batches; disk slot -1 for a page
    # an earlier write is bringing to disk (it is as durable as that write).
    batches: list[list[tuple[bytes, int, int]]] = field(default_factory=list)
    victims: list[tuple[bytes, int, int]] = field(default_factory=list)  # (hash, slot, last)
    durable: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    pending: int = 0  # planned pages not finished
    rewrites: int = 0  # planned pages an earlier write brings to disk (disk slot -1)
    distinct: bool = False  # no page listed twice (known when every page was allocated)
    released: bool = False


class SpillPlanner:
    """Plans spills and applies touches on one store's slot pool (see the module docstring)."""

    def __init__(
        self,
        pool: SlotPool,
        high_slots: int,
        low_slots: int,
        batch_pages: int,
        counters: Counters,
        warn: RateLimitedLog,
    ) -> None:
        assert 0 < low_slots < high_slots <= pool.num_slots and batch_pages >= 1
        self.pool, self.high_slots, self.low_slots = pool, high_slots, low_slots
        self.batch_pages, self.counters, self.warn = batch_pages, counters, warn
        #: victims whose index entries are not deleted yet: page hash -> its old slot
        self.pending: dict[bytes, int] = {}

    def plan(self, job: SpillJob) -> None:
        """Decide the fate of every page of ``job`` (module docstring); fills its plan, its
        durable pages (those on disk already) and failed ones (no slot even after GC)."""
        present = full = written = 0
        batch: list[tuple[bytes, int, int]] = []
        fates, slots = self.pool.touch_or_alloc(
            job.hashes, self.high_slots, lambda: self._collect(job)
        )
        if fates is None:  # the usual spill: every page allocated (none listed twice)
            job.distinct = True
            rows = list(zip(job.hashes, job.host_slots, slots, strict=True))
            step = self.batch_pages
            job.batches = [rows[i : i + step] for i in range(0, len(rows), step)]
            job.pending = len(rows)
            return
        for h, host_slot, fate, slot in zip(job.hashes, job.host_slots, fates, slots, strict=True):
            if fate == ALLOCATED:
                batch.append((h, host_slot, slot))
                written += 1
                if written % self.batch_pages == 0:
                    job.batches.append(batch)
                    batch = []
            elif fate == LIVE:  # on disk already: counted as an access
                present += 1
                job.durable.append(h)
            elif fate == WRITING:  # in flight: as durable as that write
                present += 1
                job.rewrites += 1
                batch.append((h, host_slot, -1))
            else:
                full += 1
                job.failed.append(h)
        if batch:
            job.batches.append(batch)
        job.pending = sum(len(b) for b in job.batches)
        self.counters.add(pages_present=present, skipped_full=full)
        if full:
            self.warn.warn("full", "no free disk slot even after GC; a spill was skipped")

    def _collect(self, job: SpillJob) -> None:
        """GC before one more page is written: past the high watermark, free the least recently
        used live pages down to the low watermark (they become ``job``'s victims)."""
        pool = self.pool
        used = pool.num_used
        if used + 1 <= self.high_slots:
            return
        victims = pool.remove_coldest(used - self.low_slots)
        self.pending.update((h, slot) for h, slot, _ in victims)
        job.victims += victims
        pool.sort_free()

    def would_collect(self, new_pages: int) -> bool:
        """Whether writing ``new_pages`` more pages may make a plan collect garbage."""
        return self.pool.num_used + new_pages > self.high_slots

    def touch(self, page_hashes: Iterable[bytes]) -> None:
        """Accesses: pages among ``page_hashes`` that are on disk or being written become the
        most recently used."""
        self.pool.touch_many(page_hashes)

    def present(self, page_hash: bytes) -> bool:
        """Whether a page the index holds is still there as far as the plans go (GC may have
        picked it in a plan the writer has not carried out yet)."""
        return page_hash not in self.pending

    def victims_deleted(self, job: SpillJob) -> None:
        """The writer deleted ``job``'s victims' entries: lookups see the index alone again."""
        for h, slot, _ in job.victims:
            if self.pending.get(h) == slot:
                del self.pending[h]

    def victims_kept(self, job: SpillJob) -> set[int]:
        """Deleting ``job``'s victims' entries failed: they are live again where their slots
        are still free; returns the slots planned for new pages meanwhile, which must not be
        written (an entry still names them)."""
        self.victims_deleted(job)
        unsafe: set[int] = set()
        for h, slot, last in job.victims:
            if not self.pool.take_back(h, slot, last) and self.pool.slot_of(h) is None:
                unsafe.add(slot)
        return unsafe

    def touched(self) -> list[tuple[bytes, int, int]]:
        """``(page hash, slot, last_access)`` of live pages whose index entry is older than the
        pool's, and forget them (the caller writes them)."""
        return self.pool.touched()
