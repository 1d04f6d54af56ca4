"""The shared Redis tier behind the SGLang backend's disk: one rank's
:class:`~kvstrata.tiers.remote.store.RemoteStore` under the disk store's own namespace (model,
rank and page geometry folded in), so two ranks or two models never see each other's pages in
Redis either.

::

    publish  batch_set_v1 made pages durable on disk -> copy those with remote_min_hits
             backups (the others are counted as skipped by admission) into this rank's staging
             pool (on the caller's thread: a bounded memcpy, never a round trip) and publish
             from there on the store's threads; a staging slot is free again once the store
             reports its ticket released. Pages that find no free staging slot, or a ticket
             the store refuses, are not published (counted as ``publish_dropped``).
    lookup   the leading pages whose every payload is in Redis (at most twice the timeout)
    fetch    pages read from Redis into SGLang's host pages, each value checked exactly as the
             engine's shared tier checks it (``values.PageCodec.check``: slot header, page hash,
             length, CRC-32C) before a byte of it is copied; a bad value is a miss whose keys
             the store deletes. The call returns once the store reports the ticket done, so no
             copy lands in a host page after SGLang got it back; every round trip is bounded by
             the socket timeout, and after a timeout or a connection error the breaker answers
             misses at once.

SGLang's backup and prefetch threads call in concurrently; the store's ``poll()`` results are
shared, so :meth:`SharedPages._pump` is the one place that takes them, under a lock, and hands
each ticket its own (staging slots back to the free list, fetch results to their waiter).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...config import KVLayout
from ...errors import ConfigError, PoolInvariantError
from ...tiers.disk_events import Counters
from ...tiers.host_pool import HostPool
from ...tiers.page_hash import Namespace
from ...tiers.remote.config import RemoteConfig
from ...tiers.remote.results import RemoteStats
from ...tiers.remote.tier import RemotePages

if TYPE_CHECKING:
    from ...tiers.remote.store import RemoteStore

log = logging.getLogger("kvstrata.sglang")
COUNTERS = (
    "publish_staged",  # durable pages copied into staging and handed to the store
    "publish_dropped",  # durable pages not published: no free staging slot, or ticket refused
    "fetch_slow",  # fetches that outlasted the store's bound (4 timeouts + 1 s; logged)
)
#: The longest one wait for a fetch's completion sleeps before it polls again.
POLL_S = 0.001


class SharedPages:
    """One rank's shared tier behind its disk store (module docstring)."""

    def __init__(
        self,
        namespace: Namespace,
        config: RemoteConfig,
        layout: KVLayout,
        page_size: int,
        staging_bytes: int,
    ) -> None:
        from ...tiers.remote.store import RemoteStore  # the remote extra (redis-py)

        slots = HostPool.slots_for_bytes(layout, page_size, staging_bytes)
        if slots < 1:
            raise ConfigError(
                f'kvstrata storage backend: "remote_staging_mib" ({staging_bytes / 2**20:g} MiB) '
                f"holds no page of {layout.page_bytes(page_size):,} bytes; raise it"
            )
        self.remote: RemoteStore = RemoteStore(namespace, 0, config)
        # Never pinned (only memcpy and sockets read it); torch.empty leaves it untouched until
        # used, and the free list is a stack, so a rank's resident staging is what it reuses.
        self.staging = HostPool(layout, page_size, slots, host_layout="page_first", pin=False)
        self.counters = Counters(COUNTERS)
        self._bound_s = RemotePages(self.remote).io_timeout_s
        self._lock = threading.Lock()  # the free list and the ticket tables
        self._poll_lock = threading.Lock()  # one taker of the store's poll() at a time
        self._free = list(range(slots - 1, -1, -1))
        self._held: dict[int, list[int]] = {}  # publish ticket -> its staging slots
        self._fetched: dict[int, tuple[bool, ...]] = {}
        self._tickets = itertools.count()
        self._closed = False

    @property
    def where(self) -> str:
        return self.remote.address.shown

    def _pump(self) -> None:
        """Take what the store finished and hand each ticket its own."""
        with self._poll_lock:
            news = self.remote.poll()
            with self._lock:
                for ticket in news.released:
                    self._free.extend(self._held.pop(ticket))
                for done in news.fetched:
                    self._fetched[done.ticket] = done.ok

    def publish(
        self, pages: Sequence[tuple[bytes, int]], host_pool: HostPool, host_slots: Sequence[int]
    ) -> int:
        """Publish ``(page hash, hits)`` pages, durable on disk, from ``host_slots`` of
        ``host_pool``: copied into staging now, sent later. Returns how many were staged."""
        if self._closed or not pages:
            return 0
        # Pages the store's admission skips are never copied: that memcpy would sit on SGLang's
        # backup thread and hold staging slots that admissible pages then miss.
        least = self.remote.config.min_hits
        below = sum(hits < least for _, hits in pages)
        if below:
            self.remote.counters.add(skipped_admission=below)
            admit = [i for i, (_, hits) in enumerate(pages) if hits >= least]
            pages = [pages[i] for i in admit]
            host_slots = [host_slots[i] for i in admit]
            if not pages:
                return 0
        self._pump()
        with self._lock:
            take = min(len(pages), len(self._free))
            slots = [self._free.pop() for _ in range(take)]
        if take < len(pages):
            self.counters.add(publish_dropped=len(pages) - take)
        if not take:
            return 0
        for src, dst in zip(host_slots[:take], slots, strict=True):
            for spec in host_pool.layout.payloads:
                for layer in range(host_pool.layout.layers(spec)):
                    self.staging.page(spec.name, layer, dst).copy_(
                        host_pool.page(spec.name, layer, src)
                    )
        ticket = next(self._tickets)
        with self._lock:
            self._held[ticket] = slots
        staged = [(h, slot, hits) for (h, hits), slot in zip(pages[:take], slots, strict=True)]
        if not self.remote.publish(ticket, staged, self.staging):
            with self._lock:
                self._free.extend(self._held.pop(ticket))
            self.counters.add(publish_dropped=take)
            return 0
        self.counters.add(publish_staged=take)
        return take

    def lookup(self, page_hashes: Sequence[bytes]) -> int:
        """How many of ``page_hashes``, from the first, Redis holds whole (0 when unavailable)."""
        self._pump()
        return self.remote.lookup(page_hashes)

    def fetch(
        self, page_hashes: Sequence[bytes], host_pool: HostPool, host_slots: Sequence[int]
    ) -> list[bool]:
        """Read pages from Redis into ``host_slots``, verified: True per page; returns only
        once the store no longer writes into those slots (module docstring)."""
        if self._closed or not page_hashes:
            return [False] * len(page_hashes)
        ticket = next(self._tickets)
        if not self.remote.fetch(ticket, page_hashes, host_pool, host_slots):
            return [False] * len(page_hashes)  # refused: counted by the store
        slow_at = time.monotonic() + self._bound_s
        warned = False
        while True:
            self._pump()
            with self._lock:
                ok = self._fetched.pop(ticket, None)
            if ok is not None:
                return list(ok)
            if not warned and time.monotonic() > slow_at:
                warned = True
                self.counters.add(fetch_slow=1)
                log.warning(
                    "kvstrata storage: a fetch from %s outlasted %.1f s; waiting for its copies",
                    self.where,
                    self._bound_s,
                )
            self.remote.flush(POLL_S)  # wakes as soon as the store has nothing running

    def flush(self, timeout_s: float) -> bool:
        """Wait until every publish was sent or skipped; False if ``timeout_s`` ran out."""
        done = self.remote.flush(timeout_s)
        self._pump()
        return done

    def stats(self) -> RemoteStats:
        return self.remote.stats()

    def clear(self) -> int:
        """Delete this rank's pages from the shared store (every host's copy of them: the keys
        are shared); the keys deleted."""
        return self.remote.clear()

    def check(self) -> None:
        """Staging slots are free or held by exactly one ticket; the store's own invariants."""
        with self._lock:
            held = [s for slots in self._held.values() for s in slots]
            every = sorted(self._free + held)
        if every != list(range(self.staging.num_slots)):
            raise PoolInvariantError(
                f"shared tier staging: {len(self._free)} free and {len(held)} held slots "
                f"do not partition its {self.staging.num_slots}"
            )
        self.remote.check()

    def close(self) -> None:
        """Send what was staged (the store's close waits, bounded), then stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.remote.close()
        self._pump()
        self.staging.close()
