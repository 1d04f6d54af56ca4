"""The gather thread of the disk tier's spill pipeline: host pool pages into aligned staging.

Per planned job (``disk_plan.py``), in submission order: announce it to the writer (``Begin``:
it deletes the job's victims first), then copy each page to write from the host pool into a
staging block, CRC it and write its slot headers, hand them on in chunks of about
:data:`CHUNK_BYTES` (``Chunk``) and mark each batch's end (``Commit``); post RELEASED(ticket)
once the job's last page is copied, so the caller unpins its host slots before any disk I/O. A
page an earlier write brings to disk is handed on uncopied (slot -1). Drops (pages a read found
bad) pass through in order with the jobs. After stop, the jobs never announced end as failed
(their slots free and their victims live again: nothing was written or deleted for them).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from functools import partial
from itertools import repeat
from typing import NamedTuple, cast

from .disk_batch import from_host, write_headers
from .disk_buffers import HostPages, Staging, host_pages
from .disk_events import POLL_S, Events
from .disk_plan import SpillJob, SpillPlanner
from .disk_slots import SlotPool
from .page_hash import Namespace


class Begin(NamedTuple):
    job: SpillJob


class Staged(NamedTuple):
    job: SpillJob
    page_hash: bytes
    slot: int  # -1: a page an earlier write brings to disk
    block: int | None  # its staging block; None: not copied (the store is closing)


class Chunk(NamedTuple):
    """Staged pages of one batch, handed to the writer together."""

    pages: list[Staged]


#: ``Staged`` from a ``(job, page hash, slot, block)`` tuple, the loop in C (a namedtuple's own
#: constructor is a Python call a page: a quarter of the gather thread's time on small pages).
_staged = cast(
    "Callable[[tuple[SpillJob, bytes, int, int | None]], Staged]", partial(tuple.__new__, Staged)
)

#: Bytes of staged pages the gather thread hands on at a time (fewer, larger writer steps).
CHUNK_BYTES = 8 << 20


class Commit(NamedTuple):
    job: SpillJob


class Drop(NamedTuple):
    page_hash: bytes
    slot: int


class Gatherer:
    """The gather thread's work (module docstring); ``loop`` runs on that thread."""

    def __init__(
        self,
        namespace: Namespace,
        staging: Staging,
        pool: SlotPool,
        planner: SpillPlanner,
        state_lock: threading.Lock,
        events: Events,
        stop: threading.Event,
    ) -> None:
        self.staging, self.pool, self.planner = staging, pool, planner
        self.state_lock, self.events, self.stop = state_lock, events, stop
        self.num_payloads = len(namespace.payloads)
        self.payload_len = [namespace.payload_bytes(k) for k in range(self.num_payloads)]
        self.jobs: queue.Queue[SpillJob | Drop] = queue.Queue()  # bounded by the tickets
        # bounded by the staging blocks (a batch holds at most half of them)
        self.staged: queue.Queue[Begin | Chunk | Commit | Drop] = queue.Queue()
        self.chunk_pages = max(1, CHUNK_BYTES // staging.block_bytes)

    def loop(self) -> None:
        while not self.stop.is_set():
            try:
                job = self.jobs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(job, Drop):
                self.staged.put_nowait(job)
            else:
                self._gather(job)
        self._fail_queued()

    def _fail_queued(self) -> None:
        """After stop: jobs never announced end as failed, their slots free again and their
        victims live again (nothing was written or deleted for them); drops still go ahead."""
        left: list[SpillJob] = []
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Drop):  # still carried out: the writer outlives this thread
                self.staged.put_nowait(job)
            else:
                left.append(job)
        with self.state_lock:
            for job in left:
                for batch in job.batches:
                    for h, _, slot in batch:
                        if slot >= 0:
                            self.pool.release(h)
            for job in reversed(left):
                self.planner.victims_kept(job)
        for job in left:
            with self.events.cond:
                job.pending = 0
                job.failed.extend(h for batch in job.batches for h, _, _ in batch)
            self.events.release(job)

    def _gather(self, job: SpillJob) -> None:
        self.staged.put_nowait(Begin(job))
        writes = sum(map(len, job.batches)) - job.rewrites
        pages = host_pages(job.host_pool) if writes else None
        copied = 0
        spare: list[int] = []  # blocks taken for the chunk's next pages, last one first
        for batch in job.batches:
            if not job.rewrites:  # every page of the batch to write: a chunk at a time
                copied = self._gather_batch(job, batch, pages, copied, writes)
                continue
            chunk: list[Staged] = []
            # the pages of ``chunk`` copied to staging together: (block, host slot, hash)
            blocks: list[int] = []
            host_slots: list[int] = []
            hashes: list[bytes] = []
            for h, host_slot, slot in batch:
                if slot < 0:
                    chunk.append(Staged(job, h, -1, None))
                    continue
                if not spare and not self.stop.is_set():  # for the rest of the chunk at once
                    want = min(self.chunk_pages - len(chunk), writes - copied)
                    spare = self.staging.acquire_many(max(1, want), self.stop)[::-1]
                block = spare.pop() if spare else None
                if block is not None:
                    blocks.append(block)
                    host_slots.append(host_slot)
                    hashes.append(h)
                chunk.append(Staged(job, h, slot, block))
                copied += 1
                if len(chunk) >= self.chunk_pages or copied == writes:
                    self.staging.release_many(spare)  # never held past a chunk: the bound
                    spare = []
                    self._copy(pages, blocks, host_slots, hashes)
                    blocks, host_slots, hashes = [], [], []
                    if copied == writes:
                        self.events.release(job)  # before the last page reaches the writer
                    if len(chunk) >= self.chunk_pages:
                        self.staged.put_nowait(Chunk(chunk))
                        chunk = []
            self.staging.release_many(spare)
            spare = []
            self._copy(pages, blocks, host_slots, hashes)
            if chunk:
                self.staged.put_nowait(Chunk(chunk))
            self.staged.put_nowait(Commit(job))
        if not job.released:
            self.events.release(job)

    def _gather_batch(
        self,
        job: SpillJob,
        batch: list[tuple[bytes, int, int]],
        pages: HostPages | None,
        copied: int,
        writes: int,
    ) -> int:
        """:meth:`_gather`'s loop for a batch of pages that are all to be written, a chunk at a
        time without a Python step a page: the same chunks, copies and events, in the same
        order. Returns the pages handled so far."""
        step = self.chunk_pages
        for start in range(0, len(batch), step):
            part = batch[start : start + step]
            # columns, a comprehension each (zip(*part) takes 2.5x as long over 10,000s of pages)
            hashes = [h for h, _, _ in part]
            host_slots = [host for _, host, _ in part]
            slots = [slot for _, _, slot in part]
            n = len(hashes)
            blocks: list[int] = []
            while len(blocks) < n and not self.stop.is_set():
                got = self.staging.acquire_many(n - len(blocks), self.stop)
                if not got:
                    break
                blocks += got
            k = len(blocks)  # fewer only once the store is closing: the rest are not copied
            self._copy(pages, blocks, host_slots[:k], hashes[:k])
            copied += n
            if copied == writes:
                self.events.release(job)  # before the last page reaches the writer
            held: list[int | None] = [*blocks, *([None] * (n - k))]
            self.staged.put_nowait(Chunk(list(map(_staged, zip(repeat(job), hashes, slots, held)))))
        self.staged.put_nowait(Commit(job))
        return copied

    def _copy(
        self,
        pages: HostPages | None,
        blocks: list[int],
        host_slots: list[int],
        hashes: list[bytes],
    ) -> None:
        """Copy host pages into staging blocks and write their slot headers (``disk_batch``)."""
        if not blocks:
            return
        assert pages is not None
        for kind in range(self.num_payloads):
            from_host(self.staging, kind, blocks, pages, host_slots)
            write_headers(self.staging, kind, blocks, hashes, self.payload_len[kind])
