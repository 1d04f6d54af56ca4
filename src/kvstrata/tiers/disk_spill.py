"""The spill pipeline of the disk tier: host pages -> staging -> slab slots -> index.

Two threads, in commit order (FIFO), everything bounded::

    spill(ticket, pages) ─▶ jobs (≤ max_tickets) ─▶ GATHER thread
        copy each page's payloads from the host pool into an aligned staging block, CRC them,
        write the slot headers; post RELEASED(ticket) once the last page is copied, so the
        caller unpins its host slots before any disk I/O
    ─▶ staged (one entry per staging block) ─▶ WRITER thread, a batch at a time:
        apply touches and drops; GC: if the batch would lift the slabs past the high watermark,
        delete the coldest pages' index entries (one durable commit) and free their slots down to
        the low watermark; allocate slots; pwrite every payload's slot; fdatasync every slab;
        commit the batch's index entries (one durable commit); post SPILLED(ticket) when all
        its pages are durable or failed

The writer thread is the only one that changes the slot pool or the index while the store runs.
A failed write, sync or commit is counted and reported, and its slots go back to the free list;
nothing here raises to the caller. A bug in a thread is kept and raised by ``DiskStore.poll()``.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import lmdb

from .disk_buffers import Staging, host_page_bytes
from .disk_events import POLL_S, Counters, Events, RateLimitedLog, SpillJob, log
from .disk_format import SLOT_HEADER_BYTES, SlabFile, SlotHeader, crc32c
from .disk_index import DiskIndex
from .disk_slots import SlotPool
from .page_hash import Namespace

#: How long the writer waits for another page before it syncs the pages written so far: one
#: fdatasync per slab and one index commit serve the whole batch.
LINGER_S = 0.005
#: Control messages (touches, drops) waiting for the writer; more touches are dropped and counted.
CONTROL_CAP = 4096


@dataclass(eq=False)
class _Staged:
    job: SpillJob
    page_hash: bytes
    block: int


@dataclass(eq=False)
class _Batch:
    """Pages written since the last sync: durable together at the next commit."""

    # (page, slot, its write in flight)
    written: list[tuple[_Staged, int, concurrent.futures.Future[None]]] = field(
        default_factory=list
    )
    dupes: list[_Staged] = field(default_factory=list)
    hashes: set[bytes] = field(default_factory=set)


class SpillPipeline:
    """The gather and writer threads of one store (module docstring)."""

    def __init__(
        self,
        namespace: Namespace,
        rank: int,
        slabs: list[SlabFile],
        index: DiskIndex,
        pool: SlotPool,
        state_lock: threading.Lock,
        counters: Counters,
        events: Events,
        staging: Staging,
        high_slots: int,
        low_slots: int,
        max_tickets: int,
        warn: RateLimitedLog,
        write_threads: int = 1,
        io_timeout_s: float = 30.0,
    ) -> None:
        self.ns, self.rank, self.slabs, self.index, self.pool = namespace, rank, slabs, index, pool
        self.state_lock, self.counters, self.events, self.staging = (
            state_lock,
            counters,
            events,
            staging,
        )
        self.high_slots, self.low_slots, self.warn = high_slots, low_slots, warn
        self.num_payloads = len(slabs)
        self.payload_len = [namespace.payload_bytes(k) for k in range(self.num_payloads)]
        # A batch never spans more than the watermark gap, so GC keeps usage inside it.
        self.batch_pages = max(1, min(staging.num_blocks // 2, high_slots - low_slots))
        self.jobs: queue.Queue[SpillJob] = queue.Queue(maxsize=max_tickets)
        self.staged: queue.Queue[_Staged] = queue.Queue(maxsize=staging.num_blocks)
        self.control: queue.Queue[tuple[str, bytes, int]] = queue.Queue(maxsize=CONTROL_CAP)
        self.stop = threading.Event()
        # Slot writes of a batch run on these threads (the disk sees that queue depth); the
        # writer thread keeps the slot pool, GC, the syncs and the index to itself.
        self.io_timeout_s = io_timeout_s
        self._writers = concurrent.futures.ThreadPoolExecutor(
            write_threads, thread_name_prefix="kvstrata-l3-pwrite"
        )
        self.crash: BaseException | None = None
        self._dirty: dict[bytes, tuple[int, int]] = {}  # touched pages: hash -> (slot, last)
        self.threads = [
            threading.Thread(
                target=self._guard,
                args=(self._gather_loop,),
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

    def submit(self, job: SpillJob) -> bool:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    def send(self, what: str, page_hash: bytes, slot: int = -1) -> bool:
        """Queue a control message for the writer (``touch`` or ``drop``); False when full."""
        try:
            self.control.put_nowait((what, page_hash, slot))
        except queue.Full:
            return False
        return True

    # -- gather thread ---------------------------------------------------------------------------

    def _gather_loop(self) -> None:
        while not self.stop.is_set():
            try:
                job = self.jobs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            self._gather(job)
        self._fail_queued()

    def _fail_queued(self) -> None:
        """After stop: jobs never gathered end as failed (their host slots released)."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.failed.extend(h for h, _ in job.pages)
            self.events.release(job)

    def _gather(self, job: SpillJob) -> None:
        try:
            with self.index.read() as txn:
                present = [
                    self.index.page(txn, self.ns.digest, self.rank, h, self.num_payloads)
                    is not None
                    for h, _ in job.pages
                ]
        except lmdb.Error as err:  # write them all; the commit will say whether the index works
            self.counters.add(index_errors=1)
            self.warn.warn("index", f"cannot read the disk index: {err}")
            present = [False] * len(job.pages)
        todo = [page for page, found in zip(job.pages, present, strict=True) if not found]
        for (h, _), found in zip(job.pages, present, strict=True):
            if found:
                job.durable.append(h)
                self.send("touch", h)
        self.counters.add(pages_present=len(job.pages) - len(todo))
        with self.events.cond:
            job.pending = len(todo)
        for i, (h, host_slot) in enumerate(todo):
            block = self.staging.acquire(self.stop)
            if block is None:  # closing: the pages not copied yet are not spilled
                for rest_hash, _ in todo[i:]:
                    self.events.page_done(job, rest_hash, ok=False)
                break
            for kind, spec in enumerate(self.ns.payloads):
                self.staging.gather(
                    block, kind, host_page_bytes(job.host_pool, spec.name, host_slot)
                )
                slot = self.staging.slot(block, kind)
                body = slot[SLOT_HEADER_BYTES : SLOT_HEADER_BYTES + self.payload_len[kind]]
                SlotHeader(kind, h, self.payload_len[kind], crc32c(body)).pack_into(slot)
            if i == len(todo) - 1:
                self.events.release(job)  # before the last page reaches the writer
            self.staged.put_nowait(_Staged(job, h, block))
        if not job.released:
            self.events.release(job)

    # -- writer thread ---------------------------------------------------------------------------

    def _write_loop(self) -> None:
        batch = _Batch()
        while True:
            try:  # with a batch open, wait only briefly for more before syncing it
                item: _Staged | None = self.staged.get(
                    timeout=LINGER_S if batch.written else POLL_S
                )
            except queue.Empty:
                item = None
            with self.state_lock:
                self._apply_control()
                if item is not None:
                    self._write_one(item, batch)
                if batch.written and (item is None or len(batch.written) >= self.batch_pages):
                    self._commit(batch)
                    batch = _Batch()
                if item is None:
                    self._flush_touches()
                    if self.stop.is_set() and not self.threads[0].is_alive():
                        return

    def _apply_control(self) -> None:
        while True:
            try:
                what, h, slot = self.control.get_nowait()
            except queue.Empty:
                return
            if what == "touch":
                found = self.pool.touch(h)
                if found is not None:
                    self._dirty[h] = found
            elif what == "drop" and self.pool.slot_of(h) in (slot, None):
                # A live page goes with its slot; an entry the pool never held (written by
                # another process, or corrupt) goes alone. A page re-spilled meanwhile to
                # another slot stays.
                try:
                    self.index.delete_pages(
                        self.ns.digest, [h], self.num_payloads, rank=self.rank, slot=slot
                    )
                except lmdb.Error as err:
                    self.counters.add(index_errors=1)
                    self.warn.warn("index", f"cannot drop a failed page from the index: {err}")
                    continue
                if self.pool.slot_of(h) is not None:
                    self.pool.remove(h)
                    self._dirty.pop(h, None)
                self.events.drop([h], self.counters)

    def _flush_touches(self) -> None:
        if not self._dirty:
            return
        pages = [(h, slot, last) for h, (slot, last) in self._dirty.items()]
        self._dirty.clear()
        try:
            self.index.touch_pages(self.ns.digest, self.rank, pages, self.num_payloads)
        except lmdb.Error as err:
            self.counters.add(index_errors=1)
            self.warn.warn("index", f"cannot record page accesses in the index: {err}")

    def _gc(self, incoming: int) -> None:
        """Before a write of ``incoming`` pages: from the high watermark down to the low one."""
        used = self.pool.num_used
        if used + incoming <= self.high_slots:
            return
        target = max(0, min(self.low_slots, self.high_slots - incoming))
        victims = [h for h, _ in self.pool.coldest(used - target)]
        if not victims:
            return
        try:  # the entries go first: a slot is reused only once no entry names it
            self.index.delete_pages(self.ns.digest, victims, self.num_payloads, rank=self.rank)
        except lmdb.Error as err:
            self.counters.add(index_errors=1)
            self.warn.warn("index", f"GC cannot delete index entries: {err}")
            return
        for h in victims:
            self.pool.remove(h)
            self._dirty.pop(h, None)
        self.counters.add(gc_reclaimed=len(victims))
        self.events.drop(victims, self.counters)

    def _finish(self, item: _Staged, ok: bool) -> None:
        self.staging.release(item.block)
        self.events.page_done(item.job, item.page_hash, ok)

    def _write_one(self, item: _Staged, batch: _Batch) -> None:
        """Write one staged page into a free slot (GC first if that would pass the high
        watermark); it becomes durable when its batch commits."""
        h = item.page_hash
        if h in batch.hashes:  # the same page twice in one batch: as durable as the first
            batch.dupes.append(item)
            self.counters.add(pages_present=1)
            return
        if (found := self.pool.touch(h)) is not None:  # on disk already: counts as an access
            self._dirty[h] = found
            self.counters.add(pages_present=1)
            self._finish(item, True)
            return
        self._gc(1)
        slot = self.pool.alloc()
        if slot is None:
            self.counters.add(skipped_full=1)
            self.warn.warn("full", "no free disk slot even after GC; a spill was skipped")
            self._finish(item, False)
            return
        batch.written.append(
            (item, slot, self._writers.submit(self._write_slots, slot, item.block))
        )
        batch.hashes.add(h)

    def _write_slots(self, slot: int, block: int) -> None:
        for kind, slab in enumerate(self.slabs):
            slab.write_slot(slot, self.staging.slot(block, kind))

    def _commit(self, batch: _Batch) -> None:
        """Wait for the batch's writes, fdatasync every slab, then publish the pages written in
        one index commit."""
        written: list[tuple[_Staged, int]] = []
        for item, slot, future in batch.written:
            try:
                future.result(timeout=self.io_timeout_s)
            except (OSError, concurrent.futures.TimeoutError) as err:
                # A write that is stuck may still land later: whatever it leaves in the slot has
                # this page's header, which no index entry will name, so it reads as a miss.
                self.pool.release(slot)
                self.counters.add(write_errors=1)
                self.warn.warn("write", f"write to slot {slot} failed: {err!r}")
                self._finish(item, False)
            else:
                written.append((item, slot))
        ok = False
        try:
            for slab in self.slabs:
                slab.sync()
        except OSError as err:
            for _, slot in written:
                self.pool.release(slot)
            self.counters.add(write_errors=len(written))
            self.warn.warn("write", f"fdatasync failed: {err}")
        else:
            pages = [
                (item.page_hash, slot, self.pool.publish(item.page_hash, slot))
                for item, slot in written
            ]
            try:
                self.index.put_pages(self.ns.digest, self.rank, pages, self.num_payloads)
            except lmdb.Error as err:
                for item, _ in written:
                    self.pool.remove(item.page_hash)
                self.counters.add(write_errors=len(written))
                self.warn.warn("write", f"index commit failed: {err}")
            else:
                ok = True
                nbytes = sum(s.geometry.slot_bytes for s in self.slabs) * len(written)
                self.counters.add(pages_written=len(written), bytes_written=nbytes)
        for item, _ in written:
            self._finish(item, ok)
        durable = {item.page_hash for item, _ in written} if ok else set()
        for item in batch.dupes:  # as durable as the copy that was written
            self._finish(item, item.page_hash in durable)
        self._flush_touches()
