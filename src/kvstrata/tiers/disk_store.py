"""The disk tier (L3) of one rank: the store the engine spills host pages to and reloads from.

::

    store = DiskStore(namespace, rank, DiskConfig(root, budget_bytes, start="load"))
    store.spill(ticket, [(page_hash, host_slot, hits), ...], host_pool)   # async, FIFO
    store.poll()          # DiskPoll: tickets whose host slots are free again, pages now durable
                          # (or failed, or skipped by admission), reloads done, pages dropped
    store.lookup(hashes)  # leading pages present (index only, no slab I/O)
    store.read(hashes, host_pool, host_slots)     # synchronous: per page ok
    store.reload(ticket, hashes, host_pool, host_slots)   # the same on the reader thread
    store.check(fix=False); store.stats(); store.close()

Layout under ``root`` (``disk_dir.py``): a marker, ``index/`` (one LMDB environment per namespace
and rank, ``disk_index.py``), ``slabs/`` (one slab file per namespace, rank and payload,
``disk_format.py``, a lock file and a layout record per namespace and rank). Given several
directories (``DiskConfig.more_roots``), a rank takes one or stripes its slots over several
(``disk_layout.py``; its index in the first). The budget is split into equal slot counts per
payload: a page takes slot ``s`` of every payload's slab. Cold start ``clear`` starts
this rank's index afresh (whatever state it was in; slabs of the right geometry are kept, others
recreated); ``load`` keeps it, cross-checks each entry against its slot headers and frees what
does not check out (``disk_audit.audit_group``), and refuses a damaged index, or directories that
differ from those it was written to (``disk_manifest.py``), with the way out.

Every read is verified (header magic, format, kind, hash, length, header and payload CRC-32C) and
then confirmed against the index; a page that fails is a counted miss and is dropped from the
index, so the host pool never receives bytes that are not the page's own.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb

from ..errors import CapacityError, ConfigError, DiskStoreError
from .disk_audit import GroupAudit, Problem, audit_group
from .disk_buffers import Staging
from .disk_config import DiskConfig, DiskPoll, DiskStats
from .disk_events import (
    POLL_S,
    Counters,
    Events,
    RateLimitedLog,
    ReloadDone,
    SpillDone,
    log,
)
from .disk_format import CRC32C_HARDWARE
from .disk_index import WAY_OUT
from .disk_layout import rank_roots
from .disk_open import OpenGroup, size_group
from .disk_plan import SpillJob, SpillPlanner
from .disk_read import PageReader
from .disk_slots import SlotPool
from .disk_spill import SpillPipeline
from .host_pool import HostPool, mem_available_bytes
from .page_hash import HASH_BYTES, Namespace

# The store's configuration and results, importable from here as well.
__all__ = ["DiskConfig", "DiskPoll", "DiskStats", "DiskStore", "ReloadDone", "SpillDone"]


@dataclass(eq=False)
class _ReloadJob:
    ticket: int
    hashes: list[bytes]
    host_pool: HostPool
    host_slots: list[int]
    where: list[int | None]  # each page's slot when the reload was asked for (None: absent)


#: The most pages the staging holds (its byte budget bounds it first for pages over 4 KiB).
MAX_STAGING_PAGES = 1 << 16


class DiskStore:
    """One rank's disk tier: preallocated slabs, the index, the spill and reload threads."""

    def __init__(self, namespace: Namespace, rank: int, config: DiskConfig) -> None:
        if not 0 <= rank < namespace.cp_size:
            raise ConfigError(f"rank {rank} is outside [0, {namespace.cp_size}) (the cp_size)")
        self.namespace, self.rank, self.config = namespace, rank, config
        self._closed = True
        self._warn = RateLimitedLog()
        self.counters = Counters()
        #: This rank's directories, its home (the index's) first (``disk_layout.rank_roots``).
        self.dirs = tuple(
            config.roots[i] for i in rank_roots(len(config.roots), rank, namespace.cp_size)
        )
        size = size_group(namespace, rank, config, len(self.dirs))
        self.num_slots, self.page_bytes = size.num_slots, size.page_bytes
        self.high_slots, self.low_slots = size.high_slots, size.low_slots
        self._geoms = size.geoms[0]
        self._group = OpenGroup(namespace, rank, config, self.dirs, size)
        try:
            self._group.open()
            self.io_mode = self._group.io_mode
            self._slabs, self._index = self._group.slabs, self._group.index
            self.pool = SlotPool(self.num_slots)
            if config.start == "load":
                self._start_load()
            self._start_threads()
        except BaseException:
            self._group.close()
            raise
        self._closed = False

    # -- start -----------------------------------------------------------------------------------

    def _start_load(self) -> None:
        self.counters.add(load_truncated=self._group.truncated)
        assert self._index is not None
        try:
            audit = audit_group(
                self._index, self.namespace.digest, self.rank, self._slabs, payload=False, fix=True
            )
        except lmdb.Error as err:
            raise DiskStoreError(
                f"the disk index {self._index.path} is damaged: {str(err).strip()[:200]}; {WAY_OUT}"
            ) from None
        for problem in audit.problems[:20]:
            log.warning("disk tier load: dropped %s", problem)
        self.pool.rebuild(audit.pages)
        self.counters.add(load_pages=len(audit.pages), load_dropped=len(audit.problems))

    def _start_threads(self) -> None:
        cfg = self.config
        # At most MAX_STAGING_PAGES, however small the pages (packed slots: 2 M of 128 bytes in
        # the default 256 MiB would cost seconds of start-up in per-block bookkeeping).
        num_blocks = max(2, min(MAX_STAGING_PAGES, cfg.staging_bytes // self.page_bytes))
        largest = max(g.slot_bytes for g in self._geoms)
        need = num_blocks * self.page_bytes + PageReader.buffer_bytes(
            self.page_bytes, largest, cfg.read_threads * len(self.dirs)
        )
        available = mem_available_bytes()
        if available is not None and need > available:
            raise CapacityError(
                f"the disk tier's staging and read buffers take {need / 2**30:.2f} GiB, more "
                f"than the {available / 2**30:.2f} GiB available; lower staging_bytes or "
                "read_threads"
            )
        self._events = Events()
        self._state_lock = threading.Lock()
        staging = Staging([g.slot_bytes for g in self._geoms], num_blocks)
        # Half the staging per batch: the gather thread fills the next while one is written.
        self._planner = SpillPlanner(
            self.pool,
            self.high_slots,
            self.low_slots,
            max(1, num_blocks // 2),
            self.counters,
            self._warn,
        )
        assert self._index is not None
        self._spill = SpillPipeline(
            self.namespace,
            self.rank,
            self._slabs,
            self._index,
            self.pool,
            self._planner,
            self._state_lock,
            self.counters,
            self._events,
            staging,
            self._warn,
            write_threads=cfg.write_threads * len(self.dirs),  # per drive
            io_timeout_s=cfg.io_timeout_s,
        )
        self._reader = PageReader(
            self.namespace,
            self.rank,
            self._slabs,
            self._locate,
            self._holds,
            self.counters,
            self._warn,
            drop=self._spill.drop,
            wait_written=lambda hashes: self._wait_written(hashes, cfg.io_timeout_s),
            read_threads=cfg.read_threads * len(self.dirs),  # per drive
            io_timeout_s=cfg.io_timeout_s,
        )
        self._reloads: queue.Queue[_ReloadJob] = queue.Queue()  # bounded: max_tickets
        self._reload_thread = threading.Thread(
            target=self._spill._guard,
            args=(self._reload_loop,),
            name="kvstrata-l3-reload",
            daemon=True,
        )
        self._reload_thread.start()
        self._open_tickets = 0  # submitted and not yet returned by poll()
        #: The last lookup's leading pages, their slots and the pool's ``moves`` then, until
        #: the next call
        self._looked: tuple[list[bytes], list[int], int] | None = None

    # -- spill -----------------------------------------------------------------------------------

    def _check_host_pool(
        self, host_pool: HostPool, host_slots: Sequence[int], distinct: bool = False
    ) -> list[int]:
        """The slots as ints (``HostPool.check_slots``), the pool's geometry checked first."""
        if (
            host_pool.layout != self.namespace.layout
            or host_pool.page_size != self.namespace.page_size
        ):
            raise ConfigError(
                "the host pool's layout or page size differs from the disk namespace's: "
                f"{host_pool.layout} / {host_pool.page_size} vs {self.namespace.layout} / "
                f"{self.namespace.page_size}"
            )
        return host_pool.check_slots(host_slots, distinct)

    @staticmethod
    def _check_hashes(page_hashes: Sequence[bytes]) -> None:
        if set(map(type, page_hashes)) <= {bytes} and set(map(len, page_hashes)) <= {HASH_BYTES}:
            return  # the common case, at C speed
        bad = [h for h in page_hashes if not isinstance(h, bytes) or len(h) != HASH_BYTES]
        if bad:
            raise ConfigError(
                f"page hashes are {HASH_BYTES} bytes (page_hash.page_hashes), got {bad[0]!r}"
            )

    def _take_ticket(self, reload: bool) -> bool:
        """Admit one more job. With ``max_tickets`` jobs running, wait for one to finish
        (back-pressure: the caller waits for a disk that falls behind, so what runs never
        depends on how fast it drains); refuse only when closed, after a thread crashed, or
        when none finished within ``io_timeout_s`` (a disk that stopped answering: a fault)."""
        ev = self._events
        with ev.cond:
            ev.cond.wait_for(
                lambda: (
                    self._closed
                    or self._spill.crash is not None
                    or ev.running < self.config.max_tickets
                ),
                self.config.io_timeout_s,
            )
            if (
                self._closed
                or self._spill.crash is not None
                or ev.running >= self.config.max_tickets
            ):
                return False
            self._open_tickets += 1
            ev.start(reload)
            return True

    def spill(
        self, ticket: int, pages: Sequence[tuple[bytes, int, int]], host_pool: HostPool
    ) -> bool:
        """Spill ``(page hash, host slot, hits)`` pages in this order, asynchronously.

        Waits while ``max_tickets`` jobs are running; returns False when refused (closed, or
        no job finished within ``io_timeout_s``): nothing was queued and the host slots are the
        caller's again. Otherwise ``poll()`` reports the ticket twice:
        in ``released`` once the host slots are copied (keep them pinned until then), and in
        ``spilled`` when every page is durable, failed, or skipped (hits < ``min_hits``).
        """
        self._raise_crash()
        self._looked = None  # a plan may move pages: no reload starts from an older lookup
        # Columns (a comprehension each: zip(*pages) over 100,000 pages takes twice as long)
        hashes = [h for h, _, _ in pages]
        slots = [s for _, s, _ in pages]
        hits = [n for _, _, n in pages]
        self._check_hashes(hashes)
        self._check_host_pool(host_pool, slots)
        if not self._take_ticket(reload=False):
            self.counters.add(spills_refused=1)
            return False
        need = self.config.min_hits
        skipped: list[bytes] = []
        if hits and min(hits) < need:  # columns, one C pass each, where every page is admitted
            skipped = [h for h, n in zip(hashes, hits, strict=True) if n < need]
            admit = [(h, s) for h, s, n in zip(hashes, slots, hits, strict=True) if n >= need]
            hashes, slots = [h for h, _ in admit], [s for _, s in admit]
        self.counters.add(spills=1, skipped_admission=len(skipped))
        job = SpillJob(ticket, hashes, slots, host_pool, skipped)
        with self._state_lock:
            collects = self._planner.would_collect(len(hashes)) and self.pool.num_writing > 0
        if collects:  # GC picks among pages on disk: let those in flight land first
            self._wait_written(None, self.config.io_timeout_s)
        with self._state_lock:  # the plan, in call order: what GC takes, which slot each gets
            self._planner.plan(job)
            self._spill.submit(job)
        return True

    def poll(self) -> DiskPoll:
        """Completions since the last call (non-blocking). Raises only if a store thread hit a
        bug; I/O failures are counted and reported in the result."""
        self._raise_crash()
        ev = self._events
        with ev.cond:
            out = DiskPoll(
                tuple(ev.released), tuple(ev.spilled), tuple(ev.reloaded), tuple(ev.dropped)
            )
            ev.released.clear()
            ev.spilled.clear()
            ev.reloaded.clear()
            ev.dropped.clear()
            self._open_tickets -= len(out.spilled) + len(out.reloaded)
        return out

    @property
    def where(self) -> str:
        """The store, for messages."""
        return "under " + " and ".join(str(d) for d in self.dirs)

    @property
    def io_timeout_s(self) -> float:
        return self.config.io_timeout_s

    def flush(self, timeout_s: float) -> bool:
        """Wait until every accepted spill and reload finished; False if ``timeout_s`` ran out."""
        return self.wait(timeout_s, spills_writing=0)

    def wait(self, timeout_s: float, spills_writing: int) -> bool:
        """Wait until every accepted reload finished, every accepted spill released its host
        slots, and at most ``spills_writing`` spills are still being written (``flush``: 0);
        False if ``timeout_s`` ran out. A spill's pages count as on disk for lookups and reads
        from the moment it is accepted (a read of a page still being written waits for it), so
        a caller that waits here sees the same store however fast the disk is."""
        ev = self._events

        def quiet() -> bool:
            writing = ev.running - ev.reloading - ev.unreleased
            return ev.reloading == 0 and ev.unreleased == 0 and writing <= spills_writing

        with ev.cond:  # a crashed thread finishes nothing more: no use waiting for it
            ev.cond.wait_for(lambda: quiet() or self._spill.crash is not None, timeout_s)
            return quiet()

    def _wait_written(self, page_hashes: Sequence[bytes] | None, timeout_s: float) -> bool:
        """Wait until none of ``page_hashes`` (None: no page at all) is being written; False
        if ``timeout_s`` ran out."""
        ev = self._events

        def written() -> bool:
            with self._state_lock:
                if page_hashes is None:
                    return self.pool.num_writing == 0
                return not self.pool.any_writing(page_hashes)

        with ev.cond:
            return (
                bool(
                    ev.cond.wait_for(lambda: written() or self._spill.crash is not None, timeout_s)
                )
                and written()
            )

    def _raise_crash(self) -> None:
        if not self._closed and self._spill.crash is not None:
            raise self._spill.crash

    # -- lookup and read -------------------------------------------------------------------------

    def lookup(self, page_hashes: Sequence[bytes]) -> int:
        """How many of ``page_hashes``, from the first, have every payload on disk as far as the
        plans go (0 once closed): live pages and those being written count, GC's victims do
        not, whether or not the writer got there yet. The slot pool answers: it holds exactly
        the index's pages (rebuilt from it at start, changed only after the index commits) plus
        the plans, so no slab or index I/O. A read still confirms each page with the index."""
        self._looked = None
        self._check_hashes(page_hashes)
        if self._closed or self._index is None:
            return 0
        with self._state_lock:
            slots = self.pool.leading(page_hashes)
            moves = self.pool.moves
        # A reload of these pages that follows (DiskTier.try_reload) starts from these slots
        # instead of looking every page up again, unless a page left its slot meanwhile.
        self._looked = (list(page_hashes[: len(slots)]), slots, moves)
        return len(slots)

    def _locate(self, page_hashes: Sequence[bytes]) -> list[int | None]:
        """The reader's look at the slot pool: each live page's slot (None where absent or
        still being written)."""
        with self._state_lock:
            return self.pool.slots_of(page_hashes)

    def _holds(self, page_hashes: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """The reader's check after a read: each page still holds its slot in the pool."""
        with self._state_lock:
            return self.pool.holds(page_hashes, slots)

    def touch(self, page_hashes: Sequence[bytes]) -> None:
        """Mark pages recently used (GC takes the least recently used first), at once: the
        next spill's plan sees it. The index learns it at close."""
        with self._state_lock:
            self._planner.touch(page_hashes)

    def read(
        self, page_hashes: Sequence[bytes], host_pool: HostPool, host_slots: Sequence[int]
    ) -> list[bool]:
        """Read pages into ``host_slots`` of ``host_pool``, verified; ``ok[i]`` per page.

        ``ok[i]`` is True exactly when host slot ``i`` now holds page ``i``, verified. Reading
        stops at the first page that is absent or fails verification (the prefix past it is
        unusable), so later pages are False unless they were read alongside it; a failed page is
        counted and dropped from the index. A page is copied to its host slot only after it
        verified, so a False page leaves its slot as it was. The pages count as accessed when
        the call is made (:meth:`touch`).
        """
        if len(page_hashes) != len(host_slots):
            raise ConfigError(f"{len(page_hashes)} page hashes for {len(host_slots)} host slots")
        self._check_hashes(page_hashes)
        self._check_host_pool(host_pool, host_slots, distinct=True)
        self._looked = None
        if self._closed:
            return [False] * len(page_hashes)
        self.touch(page_hashes)
        return self._reader.read(page_hashes, host_pool, host_slots)

    def reload(
        self,
        ticket: int,
        page_hashes: Sequence[bytes],
        host_pool: HostPool,
        host_slots: Sequence[int],
    ) -> bool:
        """:meth:`read` on the reader thread; ``poll()`` reports ``ReloadDone(ticket, ok)``.
        Waits and refuses as :meth:`spill` does."""
        self._raise_crash()
        if len(page_hashes) != len(host_slots):
            raise ConfigError(f"{len(page_hashes)} page hashes for {len(host_slots)} host slots")
        hashes, looked, self._looked = list(page_hashes), self._looked, None
        self._check_hashes(hashes)
        slots = self._check_host_pool(host_pool, host_slots, distinct=True)
        if not self._take_ticket(reload=True):
            return False
        self.counters.add(reloads=1)
        # Where each page is, and accessed now, in call order, not when the read gets to it:
        # one look at the pool for both (a page being written is read once it is written). The
        # pages the last lookup found, or the first of them, with no page moved since: the
        # slots it found.
        with self._state_lock:
            where: list[int | None]
            if (
                looked is not None
                and looked[2] == self.pool.moves
                and (looked[0][: len(hashes)] == hashes)
            ):
                where = [*looked[1][: len(hashes)]]
            else:
                where = self.pool.held_slots(hashes)
            self.pool.touch_slots([s for s in where if s is not None])
        self._reloads.put_nowait(_ReloadJob(ticket, hashes, host_pool, slots, where))
        return True

    def _reload_loop(self) -> None:
        while True:
            try:
                job = self._reloads.get(timeout=POLL_S)
            except queue.Empty:
                if self._spill.stop.is_set():
                    return
                continue
            ok = (
                self._reader.read(job.hashes, job.host_pool, job.host_slots, job.where)
                if not self._spill.stop.is_set()
                else [False] * len(job.hashes)
            )
            self._events.reload_done(ReloadDone(job.ticket, tuple(ok)))

    # -- state -----------------------------------------------------------------------------------

    def stats(self) -> DiskStats:
        return DiskStats(
            io_mode=self.io_mode,
            crc32c_hardware=CRC32C_HARDWARE,
            num_slots=self.num_slots,
            used_slots=self.pool.num_used,
            high_slots=self.high_slots,
            low_slots=self.low_slots,
            page_bytes=self.page_bytes,
            counters=self.counters.snapshot(),
        )

    def check(self, fix: bool = False, payload: bool = True) -> list[Problem]:
        """Audit this rank's slabs and index entries against each other and against the slot
        pool (the spill threads wait meanwhile); with ``fix``, drop what does not check out.
        Returns the problems found (empty when clean). Raises ``PoolInvariantError`` when the
        slot pool's own invariants are broken (a bug)."""
        assert self._index is not None
        # Between two of the writer's steps (it waits meanwhile): every slot an entry names holds
        # what it held when the entry was committed.
        with self._spill.io_lock, self._state_lock:
            self.pool.check()
            audit: GroupAudit = audit_group(
                self._index, self.namespace.digest, self.rank, self._slabs, payload=payload, fix=fix
            )
            problems = list(audit.problems)
            on_disk = {h: slot for h, slot, _ in audit.pages}
            live = {h: slot for h, slot, _ in self.pool.live()}
            where = f"ns {self.namespace.short} rank {self.rank}"
            for h, slot in live.items():
                if on_disk.get(h) != slot:
                    problems.append(
                        Problem(
                            "live-not-indexed",
                            f"{where} page {h.hex()[:16]}",
                            f"slot {slot} is live but its page does not check out",
                        )
                    )
                    if fix:
                        self._index.delete_pages(
                            self.namespace.digest, [(h, slot)], len(self._slabs), rank=self.rank
                        )
                        self.pool.remove(h)
            for h, slot in on_disk.items():
                if h not in live and self._planner.present(h):  # not a victim being deleted
                    problems.append(
                        Problem(
                            "indexed-not-live",
                            f"{where} page {h.hex()[:16]}",
                            f"the index names slot {slot}, which the store does not hold live",
                        )
                    )
                    if fix:
                        self._index.delete_pages(
                            self.namespace.digest, [(h, slot)], len(self._slabs), rank=self.rank
                        )
            self.pool.check()
        return problems

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish accepted spills and reloads (up to ``timeout_s``), stop the threads, close
        the files. Idempotent."""
        if self._closed:
            return
        if not self.flush(timeout_s):
            log.warning(
                "disk tier: closing with spills or reloads still running after %s s", timeout_s
            )
        with self._events.cond:
            self._closed = True
            self._events.cond.notify_all()  # a spill or reload waiting for a ticket is refused now
        self._spill.stop.set()
        for t in [*self._spill.threads, self._reload_thread]:
            t.join(timeout=timeout_s)
            if t.is_alive():
                log.warning("disk tier: thread %s did not stop within %s s", t.name, timeout_s)
        self._reader.close()
        self._spill.shutdown()
        self._save_touches()
        self._release_files()

    def _save_touches(self) -> None:
        """Bring the index's last_access up to the accesses made since (one commit), so that
        a ``load`` start keeps the LRU order."""
        if self._index is None or self._spill.crash is not None:
            return
        with self._state_lock:
            pages = self._planner.touched()
        if not pages:
            return
        try:
            self._index.touch_pages(self.namespace.digest, self.rank, pages, len(self._slabs))
        except lmdb.Error as err:
            self.counters.add(index_errors=1)
            self._warn.warn("index", f"cannot record page accesses in the index: {err}")

    def _release_files(self) -> None:
        self._group.close()
        self._slabs = []

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
