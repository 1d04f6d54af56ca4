"""Verified reads of the disk tier: slab slots into host pool pages, several pages in flight.

A read splits its pages into *runs*: pages in consecutive slots of one file, up to
:data:`RUN_BYTES` of one payload's slab (pages spilled together get consecutive slots, so a
prefix is a few runs; with slots striped over several drives, a few runs per drive, interleaved:
``disk_layout.stripe_runs``). Each run is read on one of ``read_threads`` threads, with one
vectored O_DIRECT read per payload slab into aligned buffers; every slot is then checked (``disk_format.check_slot``: magic, format,
kind, hash, length, header and payload CRC), the index is asked once, in one transaction,
whether it still names each slot, and only then is each page's payload copied into its host
slot. Up to ``2 * read_threads`` runs are in flight, so the disk always has the next reads
queued while earlier runs are checked and copied, all off the caller's thread. An I/O error in a
run reads its slots one at a time, so that only the pages that fail are lost.

Where each page is comes from the store's slot pool (the slots the store found when the reload
was asked for, or ``locate``: no index read; a read-only
:class:`~kvstrata.tiers.disk_view.DiskView` asks the index instead). A page that no longer holds
its slot after the read was dropped by GC meanwhile, which is counted as a ``read_race`` without
a warning. A slot that still belongs to its page but fails its check is a verify failure, dropped.

Why the check after the read makes a verified page exact: GC takes a page out of the slot pool,
then deletes its entries, and only then is its slot rewritten; a page that still holds the slot
after the read (in the pool for the store's own reader, in the index for a read-only view) means
nobody rewrote it during the read, except with the same page's bytes (content addressing), so no
torn mix of two pages can pass, CRC collisions included.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import lmdb

from .disk_batch import check_slots, to_host
from .disk_buffers import HostPages, Staging, host_pages
from .disk_events import Counters, RateLimitedLog
from .disk_format import MAX_RUN_SLOTS
from .disk_layout import Slab, stripe_runs
from .host_pool import HostPool
from .page_hash import Namespace

#: Bytes of one payload's consecutive slots read in one call and checked together (a run).
RUN_BYTES = 4 << 20
#: What became of one page of a run: None when it is in its host slot, else (counter, why).
_Result = tuple[str, str] | None
_T = TypeVar("_T")


def _take(items: Sequence[_T], run: Sequence[int]) -> list[_T]:
    """``items`` at the positions ``run`` (a slice when the run is a range)."""
    if isinstance(run, range) and run.step == 1:
        return list(items[run.start : run.stop])
    return [items[i] for i in run]


class _Gate:
    """One read call's say over its host slots: a run copies into them only while the call
    still waits for it. ``close`` (the call gives up or returns) waits for the copies under way
    and turns every later one away, so a run that outlives its timeout never writes into host
    slots the call reported False, which the caller may already reuse. Runs copy at once, each
    into its own host slots (one lock around every copy held the reads to about 1.5 GB/s)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._copying = 0

    def enter(self) -> bool:
        """Whether a run may copy now (then :meth:`leave` when done); False once closed."""
        with self._cond:
            if self._closed:
                return False
            self._copying += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._copying -= 1
            if self._copying == 0:
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._copying:
                self._cond.wait()


class PageReader:
    """Reads one store's pages (``DiskStore.read`` validates the arguments first)."""

    def __init__(
        self,
        namespace: Namespace,
        rank: int,
        slabs: Sequence[Slab],
        locate: Callable[[Sequence[bytes]], list[int | None]],
        confirm: Callable[[Sequence[bytes], Sequence[int]], list[bool]],
        counters: Counters,
        warn: RateLimitedLog,
        drop: Callable[[bytes, int], object],
        read_threads: int,
        io_timeout_s: float,
        wait_written: Callable[[Sequence[bytes]], bool] | None = None,
    ) -> None:
        self.namespace, self.rank, self._slabs = namespace, rank, slabs
        self.counters, self._warn, self._drop = counters, warn, drop
        self._wait_written = wait_written
        #: Where each page is (the store's slot pool, or a view's scan of the index), and
        #: whether each page still holds its slot after the read (module docstring); either
        #: may raise ``lmdb.Error`` (a damaged index: misses).
        self._locate, self._confirm = locate, confirm
        self.read_threads, self.io_timeout_s = read_threads, io_timeout_s
        self.num_slots = slabs[0].geometry.num_slots
        self.page_bytes = sum(s.geometry.slot_bytes for s in slabs)
        self._payload_len = [s.geometry.payload_len for s in slabs]
        largest = max(s.geometry.slot_bytes for s in slabs)
        self.run_pages = max(1, min(MAX_RUN_SLOTS, RUN_BYTES // largest))
        self._read_bufs = self._new_read_buffers()
        self._read_lock = threading.Lock()
        self._io = concurrent.futures.ThreadPoolExecutor(
            read_threads, thread_name_prefix="kvstrata-l3-read"
        )

    @staticmethod
    def buffer_bytes(page_bytes: int, largest_slot: int, read_threads: int) -> int:
        """Memory the read buffers of a store take."""
        run_pages = max(1, min(MAX_RUN_SLOTS, RUN_BYTES // largest_slot))
        return 2 * read_threads * run_pages * page_bytes

    def read(
        self,
        hashes: Sequence[bytes],
        host_pool: HostPool,
        host_slots: Sequence[int],
        where: Sequence[int | None] | None = None,
    ) -> list[bool]:
        """``DiskStore.read``: one read at a time; another waits at most ``io_timeout_s``.
        ``where``: each page's slot as the caller found it (None where absent), instead of
        asking ``locate``; a page that lost that slot since fails the check after the read."""
        ok = [False] * len(hashes)
        if not self._read_lock.acquire(timeout=self.io_timeout_s):
            self._warn.warn("read", "a read waited too long for another one; reported as misses")
            self.counters.add(read_errors=len(hashes))
            return ok
        try:
            self._read_locked(hashes, host_pool, host_slots, ok, where)
        finally:
            self._read_lock.release()
        return ok

    def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)

    def _read_locked(
        self,
        hashes: Sequence[bytes],
        host_pool: HostPool,
        host_slots: Sequence[int],
        ok: list[bool],
        where: Sequence[int | None] | None,
    ) -> None:
        # A page the writer has not published yet is read once it has (or failed: a miss).
        if self._wait_written is not None and not self._wait_written(hashes):
            self._warn.warn("read", "a read waited too long for pages being written")
        found: Sequence[int | None] = []
        try:
            found = self._locate(hashes) if where is None else where
        except lmdb.Error as err:  # a damaged index: misses, counted, never a crash
            self.counters.add(index_errors=1)
            self._warn.warn("index", f"cannot read the disk index: {err}")
        # The pages up to the first absent one (no Python step a page: a reload has thousands).
        try:
            lead = found.index(None)
        except ValueError:
            lead = len(found)
        slots = cast("list[int]", list(found[:lead]))
        self.counters.add(read_misses=len(hashes) - len(slots))
        bad = None
        if slots and (min(slots) < 0 or max(slots) >= self.num_slots):
            bad = next(i for i, s in enumerate(slots) if not 0 <= s < self.num_slots)
        if bad is not None:  # an entry past the slab (another process's, or corrupt): a miss
            past = f"slot {slots[bad]} past the slab's {self.num_slots}"
            self._failed_read(hashes[bad], slots[bad], "verify_failures", past)
            slots = slots[:bad]
        if not slots:
            return
        timeout = self.io_timeout_s
        runs = stripe_runs(slots, self._slabs[0].stripes, self.run_pages)
        pages = host_pages(host_pool)
        # (the run's pages, its buffer, its read): after a failure the runs in flight are not
        # the last pages read.
        pending: deque[tuple[Sequence[int], Staging, concurrent.futures.Future[list[_Result]]]] = (
            deque()
        )

        gate = _Gate()

        def submit(r: int, buf: Staging) -> None:
            run = runs[r]
            args = (_take(hashes, run), _take(slots, run), buf, pages, _take(host_slots, run), gate)
            pending.append((run, buf, self._io.submit(self._load_run, *args)))

        for r, buf in enumerate(self._read_bufs[: len(runs)]):  # `depth` runs in flight
            submit(r, buf)
        next_run = len(pending)

        def collect(run: Sequence[int], results: list[_Result]) -> bool:
            """Mark a run's pages; False when one failed."""
            if isinstance(run, range) and not any(results):  # the usual case: all read
                ok[run.start : run.stop] = [True] * len(run)
                return True
            whole = True
            for i, failed in zip(run, results, strict=True):
                ok[i] = failed is None
                if failed is not None:
                    whole = False
                    self._failed_read(hashes[i], slots[i], *failed)
            return whole

        try:
            while pending:
                run, buf, future = pending.popleft()
                try:
                    results = future.result(timeout=timeout)
                except concurrent.futures.TimeoutError:
                    self._read_bufs = self._new_read_buffers()  # the stuck read keeps the old
                    results = [("read_errors", f"a slot read took over {timeout} s")] * len(run)
                if not collect(run, results):
                    return
                if next_run < len(runs):  # the run's buffer is free again
                    submit(next_run, buf)
                    next_run += 1
        finally:
            for run, _, future in pending:
                if future.cancel():
                    continue
                try:  # a page read after one that failed still landed whole in its own slot
                    collect(run, future.result(timeout=timeout))
                except concurrent.futures.TimeoutError:
                    self._read_bufs = self._new_read_buffers()
            gate.close()  # a run still going copies nothing from here on
            pages_read = sum(ok)
            self.counters.add(pages_read=pages_read, bytes_read=pages_read * self.page_bytes)

    def _new_read_buffers(self) -> list[Staging]:
        # Twice the threads: a thread finds its next run queued while this one is collected.
        depth = 2 * self.read_threads
        slot_bytes = [s.geometry.slot_bytes for s in self._slabs]
        return [Staging(slot_bytes, self.run_pages) for _ in range(depth)]

    def _load_run(
        self,
        hashes: Sequence[bytes],
        slots: Sequence[int],
        buf: Staging,
        pages: HostPages,
        host_slots: Sequence[int],
        gate: _Gate,
    ) -> list[_Result]:
        """On a read thread: read a run's slots of every payload into ``buf``, verify each,
        confirm them with the index, copy the good ones into their host slots (unless the call
        gave up on the run meanwhile: ``gate``)."""
        n = len(hashes)
        results: list[_Result] = [None] * n
        checks: list[str | None] = [None] * n  # why a slot that was read does not check out
        blocks = range(n)
        for k, slab in enumerate(self._slabs):
            self._read_views(slab, slots, buf.slot_views(k)[:n], results)
            verdicts = check_slots(buf, k, blocks, hashes, self._payload_len[k])
            if not any(verdicts):
                continue
            for b, why in enumerate(verdicts):
                if why is not None and results[b] is None and checks[b] is None:
                    checks[b] = f"payload {self.namespace.payloads[k].name}: {why}"
        # The bytes are a page's own unless GC freed and rewrote its slot meanwhile, which needs
        # the entry gone first: an entry still there after the read vouches for them. GC may
        # also have reused the slot of a page that does not check out: that is a race, not
        # corruption, and the index says which (the entry goes before the slot).
        still = self._still_name(hashes, slots)
        if still is not None and all(still) and not any(checks) and not any(results):
            good: Sequence[int] = range(n)  # the usual case: every slot read, checked, held
        else:
            self._judge(results, checks, still)
            good = [b for b in range(n) if results[b] is None]
        if not gate.enter():
            gave_up = ("read_errors", "the read gave up on it before it landed")
            return [r if r is not None else gave_up for r in results]
        try:
            targets = _take(host_slots, good)
            for k in range(len(self._slabs)):
                to_host(buf, k, good, pages, targets)
        finally:
            gate.leave()
        return results

    @staticmethod
    def _judge(results: list[_Result], checks: list[str | None], still: list[bool] | None) -> None:
        """Each slot that was read: why it is not its page's (``results``), if it is not."""
        for b in range(len(results)):
            if results[b] is not None:
                continue
            if still is None:
                results[b] = ("read_errors", "the disk index cannot be read")
            elif not still[b]:
                results[b] = ("read_races", "the page was dropped while it was read")
            elif (why := checks[b]) is not None:
                results[b] = ("verify_failures", why)

    @staticmethod
    def _read_views(
        slab: Slab, slots: Sequence[int], views: list[memoryview], results: list[_Result]
    ) -> None:
        """Read a run's slots into ``views`` (one vectored read; slot by slot after an error,
        so that only the slots that fail are lost); failures go to ``results``."""
        size = slab.geometry.slot_bytes
        try:
            got = [slab.read_run(slots[0], views)]
        except OSError:
            got = []
            for b, view in enumerate(views):
                try:
                    got.append(slab.read_slot(slots[b], view))
                except OSError as err:
                    got.append(-1)
                    if results[b] is None:
                        results[b] = ("read_errors", f"read error: {err.strerror}")
        if len(got) == 1 and got[0] == len(views) * size:
            return  # the whole run (the usual case): nothing to look at page by page
        for b in range(len(views)):
            have = got[b] if len(got) > 1 else min(size, max(0, got[0] - b * size))
            if 0 <= have < size and results[b] is None:
                results[b] = (
                    "read_errors",
                    f"short read: {have} of {size} bytes (a truncated slab?)",
                )

    def _still_name(self, hashes: Sequence[bytes], slots: Sequence[int]) -> list[bool] | None:
        """Whether each page still holds its slot (None: the index cannot be read). The store's
        own reader asks its slot pool, which lets a slot go before GC deletes its entries and
        reuses it (the same order, earlier, and no index read per page); a read-only view asks
        the index, by slot."""
        try:
            return self._confirm(hashes, slots)
        except lmdb.Error:
            self.counters.add(index_errors=1)
            return None

    def _failed_read(self, page_hash: bytes, slot: int, counter: str, why: str) -> None:
        """Count a page that could not be read; drop it unless GC did (a race, not a fault)."""
        self.counters.add(**{counter: 1})
        if counter == "read_races":
            return
        where = f"page {page_hash.hex()[:16]} slot {slot}"
        self._warn.warn("read", f"{where}: {why}; a miss, the page is dropped")
        self._drop(page_hash, slot)
