"""Verified reads of the disk tier: slab slots into host pool pages, several pages in flight.

Each page is read on one of ``read_threads`` threads, which reads every payload's slot into an
aligned buffer, checks it (``disk_format.check_slot``: magic, format, kind, hash, length, header
and payload CRC), confirms that the index still names that slot, and only then copies the
payload into the page's host slot. Up to ``2 * read_threads`` pages are in flight, so the disk
always has the next reads queued while earlier pages are checked and copied.

A page whose slot fails its check is looked up again first: when its entry is gone or names
another slot, GC dropped it and reused the slot during the read, which is counted as a
``read_race`` without a warning; only a slot the index still vouches for is a verify failure.

Why the index check after the read makes a verified page exact: GC deletes a page's entries
before it frees the slot, and a slot is rewritten only once free; an entry that still names the
slot after the read means nobody rewrote it during the read, except with the same page's bytes
(content addressing), so no torn mix of two pages can pass, CRC collisions included.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Sequence

import lmdb

from .disk_buffers import Staging, host_page_bytes
from .disk_events import Counters, RateLimitedLog
from .disk_format import SlabFile, check_slot
from .disk_index import DiskIndex
from .host_pool import HostPool
from .page_hash import Namespace


class PageReader:
    """Reads one store's pages (``DiskStore.read`` validates the arguments first)."""

    def __init__(
        self,
        namespace: Namespace,
        rank: int,
        slabs: list[SlabFile],
        index: DiskIndex,
        counters: Counters,
        warn: RateLimitedLog,
        drop: Callable[[bytes, int], object],
        touch: Callable[[list[bytes]], None],
        read_threads: int,
        io_timeout_s: float,
    ) -> None:
        self.namespace, self.rank, self._slabs, self._index = namespace, rank, slabs, index
        self.counters, self._warn, self._drop, self._touch = counters, warn, drop, touch
        self.read_threads, self.io_timeout_s = read_threads, io_timeout_s
        self.num_slots = slabs[0].geometry.num_slots
        self.page_bytes = sum(s.geometry.slot_bytes for s in slabs)
        self._payload_len = [s.geometry.payload_len for s in slabs]
        self._read_bufs = self._new_read_buffers()
        self._read_lock = threading.Lock()
        self._io = concurrent.futures.ThreadPoolExecutor(
            read_threads, thread_name_prefix="kvstrata-l3-read"
        )

    def read(
        self, hashes: Sequence[bytes], host_pool: HostPool, host_slots: Sequence[int]
    ) -> list[bool]:
        """``DiskStore.read``: one read at a time; another waits at most ``io_timeout_s``."""
        ok = [False] * len(hashes)
        if not self._read_lock.acquire(timeout=self.io_timeout_s):
            self._warn.warn("read", "a read waited too long for another one; reported as misses")
            self.counters.add(read_errors=len(hashes))
            return ok
        try:
            self._read_locked(hashes, host_pool, host_slots, ok)
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
    ) -> None:
        assert self._index is not None
        ns, num_payloads = self.namespace.digest, len(self._slabs)
        slots: list[int] = []
        try:
            with self._index.read() as txn:
                for h in hashes:
                    entry = self._index.page(txn, ns, self.rank, h, num_payloads)
                    if entry is None:
                        break
                    slots.append(entry.slot)
        except lmdb.Error as err:  # a damaged index: misses, counted, never a crash
            self.counters.add(index_errors=1)
            self._warn.warn("index", f"cannot read the disk index: {err}")
            slots = []
        self.counters.add(read_misses=len(hashes) - len(slots))
        bad = next((i for i, s in enumerate(slots) if not 0 <= s < self.num_slots), None)
        if bad is not None:  # an entry past the slab (another process's, or corrupt): a miss
            past = f"slot {slots[bad]} past the slab's {self.num_slots}"
            self._failed_read(hashes[bad], slots[bad], "verify_failures", past)
            slots = slots[:bad]
        timeout = self.io_timeout_s
        depth = len(self._read_bufs)
        # (page index, its read): after a failure the reads in flight are not the last pages.
        pending: deque[tuple[int, concurrent.futures.Future[tuple[str, str] | None]]] = deque()

        def submit(j: int, buf: Staging) -> None:
            args = (hashes[j], slots[j], buf, host_pool, host_slots[j])
            pending.append((j, self._io.submit(self._load_page, *args)))

        for j in range(min(depth, len(slots))):  # at most `depth` pages in flight
            submit(j, self._read_bufs[j])
        try:
            for i, slot in enumerate(slots):
                try:
                    failed = pending.popleft()[1].result(timeout=timeout)
                except concurrent.futures.TimeoutError:
                    self._read_bufs = self._new_read_buffers()  # the stuck read keeps the old
                    failed = ("read_errors", f"a slot read took over {timeout} s")
                if failed is not None:
                    self._failed_read(hashes[i], slot, *failed)
                    return
                ok[i] = True
                if i + depth < len(slots):  # page i's buffer is free again
                    submit(i + depth, self._read_bufs[i % depth])
        finally:
            for j, future in pending:
                if future.cancel():
                    continue
                try:  # a page read after one that failed still landed whole in its own slot
                    failed = future.result(timeout=timeout)
                except concurrent.futures.TimeoutError:
                    self._read_bufs = self._new_read_buffers()
                    continue
                ok[j] = failed is None
                if failed is not None:
                    self._failed_read(hashes[j], slots[j], *failed)
            pages_read = sum(ok)
            self.counters.add(pages_read=pages_read, bytes_read=pages_read * self.page_bytes)
            self._touch([h for h, good in zip(hashes, ok, strict=False) if good])

    def _new_read_buffers(self) -> list[Staging]:
        # Twice the threads: a thread finds its next page queued while this one is collected.
        depth = 2 * self.read_threads
        return [Staging([s.geometry.slot_bytes for s in self._slabs], 1) for _ in range(depth)]

    def _load_page(
        self, page_hash: bytes, slot: int, buf: Staging, host_pool: HostPool, host_slot: int
    ) -> tuple[str, str] | None:
        """On a read thread: read every payload's slot into ``buf``, verify it, confirm it with
        the index, copy it into the host slot. None when done, else ``(counter, why)``."""
        for k, slab in enumerate(self._slabs):
            view = buf.slot(0, k)
            try:
                got = slab.read_slot(slot, view)
            except OSError as err:
                return "read_errors", f"read error: {err.strerror}"
            if got < len(view):
                return "read_errors", f"short read: {got} of {len(view)} bytes (a truncated slab?)"
            why = check_slot(view, k, page_hash, self._payload_len[k])
            if why is not None:
                # GC may have dropped the page and reused its slot while it was read: that is a
                # race, not corruption, and the index says which (the entry goes before the slot)
                if self._still_names(page_hash, slot) is False:
                    return "read_races", "the page was dropped while it was read"
                return "verify_failures", f"payload {self.namespace.payloads[k].name}: {why}"
        # The bytes are this page's unless GC freed and rewrote the slot meanwhile, which needs
        # the entry gone first: an entry still there after the read vouches for them.
        still = self._still_names(page_hash, slot)
        if still is None:
            return "read_errors", "the disk index cannot be read"
        if not still:
            return "read_races", "the page was dropped while it was read"
        for k, spec in enumerate(self.namespace.payloads):
            buf.scatter(0, k, host_page_bytes(host_pool, spec.name, host_slot))
        return None

    def _still_names(self, page_hash: bytes, slot: int) -> bool | None:
        """Whether the index still names ``slot`` for the page (None: the index cannot be read)."""
        assert self._index is not None
        try:
            with self._index.read() as txn:
                entry = self._index.page(
                    txn, self.namespace.digest, self.rank, page_hash, len(self._slabs)
                )
        except lmdb.Error:
            self.counters.add(index_errors=1)
            return None
        return entry is not None and entry.slot == slot

    def _failed_read(self, page_hash: bytes, slot: int, counter: str, why: str) -> None:
        """Count a page that could not be read; drop it unless GC did (a race, not a fault)."""
        self.counters.add(**{counter: 1})
        if counter == "read_races":
            return
        where = f"page {page_hash.hex()[:16]} slot {slot}"
        self._warn.warn("read", f"{where}: {why}; a miss, the page is dropped")
        self._drop(page_hash, slot)
