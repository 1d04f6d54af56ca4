"""What the disk tier reports: counters, per-ticket results, and the events ``poll()`` hands out.

Every store thread bumps :class:`Counters` and posts to one :class:`Events`; ``DiskStore.poll()``
drains it. Results wait for ``poll()`` (one small record a ticket; at most ``max_tickets`` jobs
run at once), and dropped pages beyond :data:`DROPPED_CAP` are only counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .disk_gather import Staged
    from .disk_plan import SpillJob

log = logging.getLogger("kvstrata.disk")
#: How long a store thread waits on an empty queue before it looks at the stop flag again.
POLL_S = 0.05
#: Pages no longer on disk kept for ``poll()``; older ones are counted as unreported.
DROPPED_CAP = 65536


class RateLimitedLog:
    """At most one warning per kind every ``every_s`` seconds (wall clock only paces logging)."""

    def __init__(
        self, every_s: float = 10.0, logger: logging.Logger | None = None, tier: str = "disk tier"
    ) -> None:
        self.every_s = every_s
        self._log, self._tier = logger or log, tier
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self.every_s) < self.every_s:
                return
            self._last[kind] = now
        self._log.warning("%s: %s", self._tier, message)


COUNTERS = (
    "spills",  # spill tickets accepted
    "spills_refused",  # spill tickets refused (closed, or the disk stopped answering)
    "pages_written",  # pages made durable by a write
    "bytes_written",
    "pages_present",  # pages a spill found already on disk
    "skipped_admission",  # pages under min_hits
    "skipped_full",  # pages with no free slot even after GC
    "write_errors",  # pages lost to a failed write, fdatasync or index commit
    "index_errors",  # failed index commits of GC, touches or drops
    "reloads",  # reload tickets (async reads) accepted
    "pages_read",  # pages read, verified and copied to the host pool
    "bytes_read",
    "read_misses",  # pages asked for that the index does not hold
    "verify_failures",  # pages whose slot failed verification (now dropped)
    "read_errors",  # pages lost to an I/O error or timeout while reading (now dropped)
    "read_races",  # pages dropped by GC while they were read (a miss, not an error)
    "gc_reclaimed",  # pages GC removed
    "load_pages",  # pages a load cold start found valid
    "load_dropped",  # index entries a load cold start dropped
    "load_truncated",  # slabs a load cold start found truncated (and extended)
    "dropped_unreported",  # dropped pages poll() no longer lists (it was not called for long)
)


class Counters:
    """Cumulative counts, bumped from any thread (the disk tier's :data:`COUNTERS`, or the
    names another tier counts)."""

    def __init__(self, names: tuple[str, ...] = COUNTERS) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(names, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._n[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)


@dataclass(frozen=True, slots=True)
class SpillDone:
    """Where every page of spill ``ticket`` ended: on disk (written now or found there), not on
    disk (no room, I/O error, store closing), or skipped by admission (fewer hits than min_hits)."""

    ticket: int
    durable: tuple[bytes, ...]
    failed: tuple[bytes, ...]
    skipped: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class ReloadDone:
    """Reload ``ticket``: ``ok[i]`` when page ``i`` was read, verified and copied to its host
    slot (``DiskStore.read``: reading stops at the first page that fails)."""

    ticket: int
    ok: tuple[bool, ...]


class Events:
    """Completions waiting for ``poll()``, and counts of the jobs still running (what
    ``DiskStore.wait`` waits for). ``cond`` is also notified whenever pages finish writing.
    Lock order: ``cond`` before the store's state lock, never the other way round."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.released: list[int] = []
        self.spilled: list[SpillDone] = []
        self.reloaded: list[ReloadDone] = []
        self.dropped: deque[bytes] = deque()
        self.running = 0  # spill and reload jobs submitted and not finished
        self.reloading = 0  # of them, reloads
        self.unreleased = 0  # of them, spills whose host slots are still read

    def start(self, reload: bool) -> None:
        """A job was accepted (call with ``cond`` held)."""
        self.running += 1
        if reload:
            self.reloading += 1
        else:
            self.unreleased += 1

    def release(self, job: SpillJob) -> None:
        with self.cond:
            assert not job.released
            job.released = True
            self.unreleased -= 1
            self.released.append(job.ticket)
            self._maybe_done(job)
            self.cond.notify_all()

    def pages_done(self, pages: Sequence[Staged], ok: bool) -> None:
        """Staged pages are durable (``ok``) or failed; a job's pages that come together are
        recorded together."""
        with self.cond:
            for job, group in groupby(pages, key=itemgetter(0)):
                done = list(map(itemgetter(1), group))
                (job.durable if ok else job.failed).extend(done)
                job.pending -= len(done)
                self._maybe_done(job)
            self.cond.notify_all()

    def _maybe_done(self, job: SpillJob) -> None:
        if job.released and job.pending == 0:
            durable: tuple[bytes, ...]
            failed: tuple[bytes, ...]
            if job.distinct and not job.failed and job.durable == job.hashes:  # landed in order
                durable, failed = tuple(job.durable), ()
            else:  # report in spill order
                order = {h: i for i, h in enumerate(job.hashes)}
                durable, failed = (
                    tuple(sorted(x, key=order.__getitem__)) for x in (job.durable, job.failed)
                )
            done = SpillDone(job.ticket, durable, failed, tuple(job.skipped))
            self.spilled.append(done)
            self.running -= 1
            self.cond.notify_all()

    def reload_done(self, done: ReloadDone) -> None:
        with self.cond:
            self.reloaded.append(done)
            self.running -= 1
            self.reloading -= 1
            self.cond.notify_all()

    def drop(self, hashes: list[bytes], counters: Counters) -> None:
        with self.cond:
            self.dropped.extend(hashes)
            over = len(self.dropped) - DROPPED_CAP
            for _ in range(max(over, 0)):
                self.dropped.popleft()
        if over > 0:
            counters.add(dropped_unreported=over)
