"""The spill pipeline of the disk tier: host pages -> staging -> slab slots -> index.

A job arrives already planned (``disk_plan.py``: which pages to write, into which slots, in
which batches, and GC's victims). Two threads carry plans out, in submission order (FIFO): the
gather thread (``disk_gather.py``) and the writer thread (here)::

    jobs and drops (FIFO) ─▶ GATHER thread
        per job: announce it, then copy each page to write from the host pool into an aligned
        staging block, CRC it, write its slot headers; hand them on in chunks; mark each
        batch's end; post RELEASED(ticket) once the last page is copied, so the caller unpins
        its host slots before any disk I/O
    ─▶ staged (FIFO) ─▶ WRITER thread
        a job's start: delete its victims' index entries (one durable commit)
        a chunk: one vectored pwrite per payload slab for each run of consecutive slots of
            one file (``write_threads`` runs in flight; plans hand out slots in ascending runs,
            which striped over several drives are a run per drive: ``disk_layout.py``)
        a batch's end: fdatasync every slab file (the drives' at once), then publish its pages
            (one durable commit); while more staged work is queued, up to GROUP_COMMIT_BATCHES
            ended batches share that sync and commit (a GC delete or a drop commits first)
        a drop (a page a read found bad): delete its entries (one commit)
        post SPILLED(ticket) when every page of a job is durable or failed

Publish after durable: a page's index entries are committed only after its slots are synced,
and a slot is rewritten only after the entries of the page it held are deleted. The writer is
the only thread that commits to the index while the store runs, and it holds the state lock
only to update the slot pool, never across I/O. A failed write, sync or commit is counted and
reported, and its slots go back to the free list; nothing here raises to the caller. A bug in a
thread is kept and raised by ``DiskStore.poll()``.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import lmdb
import numpy as np

from .disk_buffers import Staging
from .disk_events import POLL_S, Counters, Events, RateLimitedLog, log
from .disk_format import MAX_RUN_SLOTS
from .disk_gather import Begin, Chunk, Commit, Drop, Gatherer, Staged
from .disk_index import DiskIndex
from .disk_layout import Slab
from .disk_plan import SpillJob, SpillPlanner
from .disk_slots import SlotPool
from .page_hash import Namespace

#: A ``Staged`` page's fields, read without a Python step a page.
_hash, _slot, _block = itemgetter(1), itemgetter(2), itemgetter(3)

#: Batches whose end has come are synced and published together while more staged work waits
#: (group commit: one fdatasync per slab and one index commit for all of them), up to this many.
#: Which pages a spill writes and where is planned before; only when they become durable moves.
GROUP_COMMIT_BATCHES = 16


@dataclass(eq=False)
class _Batch:
    """Pages written since the last sync: durable together at the next commit."""

    # (a run of pages in consecutive slots, its write in flight: the run's failed positions)
    written: list[tuple[list[Staged], concurrent.futures.Future[list[int]]]] = field(
        default_factory=list
    )
    dupes: list[Staged] = field(default_factory=list)


class SpillPipeline:
    """The gather and writer threads of one store (module docstring)."""

    def __init__(
        self,
        namespace: Namespace,
        rank: int,
        slabs: Sequence[Slab],
        index: DiskIndex,
        pool: SlotPool,
        planner: SpillPlanner,
        state_lock: threading.Lock,
        counters: Counters,
        events: Events,
        staging: Staging,
        warn: RateLimitedLog,
        write_threads: int = 1,
        io_timeout_s: float = 30.0,
    ) -> None:
        self.ns, self.rank, self.slabs, self.index, self.pool = namespace, rank, slabs, index, pool
        self.planner, self.state_lock, self.counters = planner, state_lock, counters
        self.events, self.staging, self.warn = events, staging, warn
        self.num_payloads = len(slabs)
        self.stripes = slabs[0].stripes  # directories the slots are striped over
        self.payload_len = [namespace.payload_bytes(k) for k in range(self.num_payloads)]
        self.stop = threading.Event()
        self.gather = Gatherer(namespace, staging, pool, planner, state_lock, events, self.stop)
        self.jobs, self.staged = self.gather.jobs, self.gather.staged
        #: Held by the writer for each step it takes; ``DiskStore.check`` takes it to audit
        #: the slabs between two steps.
        self.io_lock = threading.Lock()
        # Slot writes of a batch run on these threads (the disk sees that queue depth); the
        # writer thread keeps the syncs and the index to itself.
        self.io_timeout_s = io_timeout_s
        self._writers = concurrent.futures.ThreadPoolExecutor(
            write_threads, thread_name_prefix="kvstrata-l3-pwrite"
        )
        self.crash: BaseException | None = None
        # Slots whose old page's entries could not be deleted: slot -> (that page, last_access)
        self._unsafe: dict[int, tuple[bytes, int]] = {}
        self.threads = [
            threading.Thread(
                target=self._guard,
                args=(self.gather.loop,),
                name="kvstrata-l3-gather",
                daemon=True,
            ),
            threading.Thread(
                target=self._guard, args=(self._write_loop,), name="kvstrata-l3-write", daemon=True
            ),
        ]
        for t in self.threads:
            t.start()

    def _guard(self, loop: Callable[[], None]) -> None:
        """Run a store thread's loop; a bug in it is kept for ``poll()`` to raise."""
        try:
            loop()
        except BaseException as err:  # a bug: keep it for poll() to raise, stop the pipeline
            self.crash = err
            self.stop.set()
            log.exception("disk tier: %s failed", threading.current_thread().name)
            with self.events.cond:  # wake a flush() waiting for work this thread will not do
                self.events.cond.notify_all()

    def shutdown(self) -> None:
        """After the threads stopped: let the write pool's threads go."""
        self._writers.shutdown(wait=False, cancel_futures=True)

    # -- caller side -----------------------------------------------------------------------------

    def submit(self, job: SpillJob) -> None:
        """Queue a planned job (``SpillPlanner.plan`` ran under the state lock)."""
        self.jobs.put_nowait(job)

    def drop(self, page_hash: bytes, slot: int) -> None:
        """Delete a page that a read found bad at ``slot`` (in order with the jobs)."""
        self.jobs.put_nowait(Drop(page_hash, slot))

    # -- writer thread ---------------------------------------------------------------------------

    def _write_loop(self) -> None:
        batch = _Batch()  # the batch being written
        ended = _Batch()  # batches whose end came, not committed yet: synced and published together
        num_ended = 0
        while True:
            if num_ended and (self.staged.empty() or num_ended >= GROUP_COMMIT_BATCHES):
                with self.io_lock:
                    self._commit(ended)
                ended, num_ended = _Batch(), 0
            try:
                item = self.staged.get(timeout=POLL_S)
            except queue.Empty:
                if self.stop.is_set() and not self.threads[0].is_alive():
                    return
                continue
            with self.io_lock:
                if isinstance(item, Chunk):
                    self._write_chunk(item.pages, batch)
                    continue
                if isinstance(item, Commit):
                    ended.written += batch.written
                    ended.dupes += batch.dupes
                    batch, num_ended = _Batch(), num_ended + 1
                    continue
                if isinstance(item, Begin) and not item.job.victims:
                    continue
                if num_ended:  # GC's deletes and drops stay in order with the publishes before
                    self._commit(ended)
                    ended, num_ended = _Batch(), 0
                if isinstance(item, Begin):
                    self._delete_victims(item.job)
                else:
                    self._drop(item)

    def _delete_victims(self, job: SpillJob) -> None:
        """GC as planned: the victims' entries go (one commit) before any slot is rewritten."""
        if not job.victims:
            return
        hashes = [h for h, _, _ in job.victims]
        pages = [(h, slot) for h, slot, _ in job.victims]
        try:
            self.index.delete_pages(self.ns.digest, pages, self.num_payloads, rank=self.rank)
        except lmdb.Error as err:
            self.counters.add(index_errors=1)
            self.warn.warn("index", f"GC cannot delete index entries: {err}")
            with self.state_lock:
                kept = self.planner.victims_kept(job)
                self._unsafe |= {slot: (h, last) for h, slot, last in job.victims if slot in kept}
            return
        with self.state_lock:
            self.planner.victims_deleted(job)
        self.counters.add(gc_reclaimed=len(hashes))
        self.events.drop(hashes, self.counters)

    def _drop(self, item: Drop) -> None:
        """A page a read found bad: its entries naming that slot go; then the slot is free."""
        h, slot = item
        try:
            self.index.delete_pages(self.ns.digest, [(h, slot)], self.num_payloads, rank=self.rank)
        except lmdb.Error as err:
            self.counters.add(index_errors=1)
            self.warn.warn("index", f"cannot drop a failed page from the index: {err}")
            return
        with self.state_lock:
            where = self.pool.slot_of(h)
            if where == slot:
                self.pool.remove(h)
        # A page re-spilled meanwhile to another slot stays (and is not reported).
        if where in (slot, None):
            self.events.drop([h], self.counters)

    def _fail(self, item: Staged) -> None:
        """A page not written: its slot is free again (or its old page's again, see unsafe).
        When the old page lives elsewhere now (spilled again), the entries still naming the
        slot are deleted first; until that succeeds the slot is withheld, never handed out."""
        stale: tuple[bytes, int] | None = None
        with self.state_lock:
            self.pool.release(item.page_hash)
            old = self._unsafe.pop(item.slot, None)
            if old is not None and not self.pool.take_back(old[0], item.slot, old[1]):
                self.pool.withhold(item.slot)
                stale = (old[0], item.slot)
        if stale is not None:
            self._delete_withheld(stale)
        self._finish([item], False)

    def _delete_withheld(self, stale: tuple[bytes, int]) -> None:
        try:
            self.index.delete_pages(self.ns.digest, [stale], self.num_payloads, rank=self.rank)
        except lmdb.Error as err:
            self.counters.add(index_errors=1)
            self.warn.warn("index", f"slot {stale[1]} is withheld: {err}")
            return
        with self.state_lock:
            self.pool.release_withheld(stale[1])

    def _finish(self, items: list[Staged], ok: bool) -> None:
        blocks = list(map(_block, items))
        self.staging.release_many(
            [b for b in blocks if b is not None] if None in blocks else blocks
        )
        self.events.pages_done(items, ok)

    def _write_chunk(self, pages: list[Staged], batch: _Batch) -> None:
        """Start writing staged pages into their planned slots, a run of consecutive slots of
        one file at a time (one run per drive at once where slots are striped); they become
        durable when their batch commits."""
        if self.stripes == 1 and not self._unsafe and pages:  # the usual chunk: runs at once
            slots = list(map(_slot, pages))
            if min(slots) >= 0 and None not in map(_block, pages):
                cuts = (np.flatnonzero(np.diff(slots) != 1) + 1).tolist()
                for start, end in zip([0, *cuts], [*cuts, len(pages)], strict=True):
                    for at in range(start, end, MAX_RUN_SLOTS):
                        run = pages[at : min(at + MAX_RUN_SLOTS, end)]
                        batch.written.append((run, self._writers.submit(self._write_run, run)))
                return
        runs: dict[int, list[Staged]] = {}  # stripe -> the run being gathered there
        for item in pages:
            if item.slot < 0:
                batch.dupes.append(item)
                continue
            if item.block is None or item.slot in self._unsafe:
                if item.block is not None:  # an entry still names the slot: it cannot be written
                    self.counters.add(write_errors=1)
                self._fail(item)
                continue
            run = runs.setdefault(item.slot % self.stripes, [])
            if run and (item.slot != run[-1].slot + self.stripes or len(run) >= MAX_RUN_SLOTS):
                batch.written.append((run, self._writers.submit(self._write_run, run)))
                run = runs[item.slot % self.stripes] = []
            run.append(item)
        for run in runs.values():
            if run:
                batch.written.append((run, self._writers.submit(self._write_run, run)))

    def _write_run(self, run: list[Staged]) -> list[int]:
        """Write a run of pages in consecutive slots of one file: one vectored write per payload
        slab. On an error each slot is written alone, so that only the pages that fail are
        lost; returns their positions in the run."""
        first, failed = run[0].slot, set()
        blocks = list(map(_block, run))  # every page of a run was copied
        for kind, slab in enumerate(self.slabs):
            bufs = list(map(self.staging.slot_views(kind).__getitem__, blocks))
            try:
                slab.write_run(first, bufs)
            except OSError:
                for i, (item, buf) in enumerate(zip(run, bufs, strict=True)):
                    try:
                        slab.write_slot(item.slot, buf)
                    except OSError as err:
                        failed.add(i)
                        self.warn.warn("write", f"write to slot {item.slot} failed: {err!r}")
        return sorted(failed)

    def _sync(self) -> None:
        """fdatasync every slab file, the files of different drives at once; raises OSError."""
        files = [f for slab in self.slabs for f in slab.files]
        if self.stripes == 1:
            for f in files:
                f.sync()
            return
        for future in [self._writers.submit(f.sync) for f in files]:
            future.result(timeout=self.io_timeout_s)

    def _commit(self, batch: _Batch) -> None:
        """Wait for the batch's writes, fdatasync every slab, then publish the pages written in
        one index commit."""
        written: list[Staged] = []
        for run, future in batch.written:
            try:
                failed = set(future.result(timeout=self.io_timeout_s))
            except concurrent.futures.TimeoutError:
                # A write that is stuck may still land later: whatever it leaves in the slots
                # has these pages' headers, which no index entry will name: they read as misses.
                self.warn.warn("write", f"writes to slots {run[0].slot}.. took over the timeout")
                failed = set(range(len(run)))
            self.counters.add(write_errors=len(failed))
            if not failed:
                written += run
                continue
            for i, item in enumerate(run):
                if i in failed:
                    self._fail(item)
                else:
                    written.append(item)
        ok = False
        if written:
            try:
                self._sync()
            except (OSError, concurrent.futures.TimeoutError) as err:
                self.counters.add(write_errors=len(written))
                self.warn.warn("write", f"fdatasync failed: {err}")
            else:
                ok = self._publish(written)
        if ok:
            self._finish(written, True)
        else:
            for item in written:
                self._fail(item)
        with self.state_lock:
            durable = [self.pool.slot_of(item.page_hash) is not None for item in batch.dupes]
        for item, found in zip(batch.dupes, durable, strict=True):  # as durable as the copy
            self._finish([item], found)

    def _publish(self, written: list[Staged]) -> bool:
        """Commit the index entries of synced pages (one durable commit), then make them live."""
        hashes = list(map(_hash, written))
        with self.state_lock:
            lasts = self.pool.last_accesses(hashes)
        pages = list(zip(hashes, map(_slot, written), lasts, strict=True))
        try:
            self.index.put_pages(self.ns.digest, self.rank, pages, self.num_payloads)
        except lmdb.Error as err:
            self.counters.add(write_errors=len(written))
            self.warn.warn("write", f"index commit failed: {err}")
            return False
        with self.state_lock:
            self.pool.publish_many(hashes)
        nbytes = sum(s.geometry.slot_bytes for s in self.slabs) * len(written)
        self.counters.add(pages_written=len(written), bytes_written=nbytes)
        return True
