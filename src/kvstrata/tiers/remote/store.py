"""The shared tier of one rank: host pages published to a Redis store that several prefill
instances share, looked up and fetched back verified (docs/design.md, "Shared tier").

::

    store = RemoteStore(namespace, rank, RemoteConfig("redis://10.0.0.5:6379/0", 64 << 30))
    store.publish(ticket, [(page_hash, host_slot, hits), ...], host_pool)   # async, FIFO
    store.lookup(hashes)            # leading pages whose every payload is in the store
    store.fetch(ticket, hashes, host_pool, host_slots)     # async: ok per page
    store.poll()                    # RemotePoll: released, published, fetched
    store.flush(timeout_s); store.stats(); store.check(); store.close()

Every round trip runs on the store's threads, never on the caller's. A publish first asks which
of its pages the store lacks (one EXISTS pipeline for up to :data:`LOOKUP_PAGES` pages), takes the
budget for those in page order, and queues them in batches of ``batch_pages`` pages, each one SET
NX pipeline sent from the host pool's own bytes; it reports the ticket ``released`` once every
batch was sent, so the caller keeps the host slots pinned until then. A fetch is cut into batches
of ``batch_pages`` pages, each one GET pipeline of every payload, each page checked and copied as
soon as its values arrived. A lookup waits for its answer at most twice the socket timeout. A
value is written whole by one SET (atomic in Redis), so a reader sees a page's payload entirely
or not at all; every value read is checked (``values.PageCodec.check``) before one byte of it
reaches the host pool, and a bad one is a counted miss whose keys are deleted.

Faults never raise: a timeout or connection error opens the breaker (``client.Breaker``), and for
its interval every call answers at once (lookups 0, fetches all misses, publishes skipped), all
counted. The budget (``RemoteConfig.budget_bytes / cp_size`` per rank) counts this rank's keys by
a SCAN at the first publish and whenever a write would pass it (at most every
:data:`RECOUNT_S`), plus what it wrote since; writes past it are skipped and counted. The SCAN
runs on a thread of its own, never in a fetch's way: the first one is waited for at most twice
the timeout (publishes are skipped until it is in), later ones not at all (the last count
stands meanwhile).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ...errors import ConfigError, PoolInvariantError
from ..disk_events import Counters, RateLimitedLog
from ..disk_format import SLOT_HEADER_BYTES
from ..host_pool import HostPool
from ..page_hash import HASH_BYTES, Namespace
from .client import Breaker, CommandError, RedisClient, StoreUnavailable, log, tune_malloc
from .config import RemoteConfig
from .results import COUNTERS, Events, FetchDone, PublishDone, RemotePoll, RemoteStats
from .values import PageCodec, PageValue, key_kind, rank_pattern

#: A GET's reply as the fetch sees it: read in place (the views it was given), in a buffer of
#: its own (another length), absent, or refused.
_Value = list[memoryview] | memoryview | CommandError | None

__all__ = ["RemoteConfig", "RemotePoll", "RemoteStats", "RemoteStore"]

#: The soonest a budget that looks full is counted again by a SCAN (the store's own eviction
#: frees keys the store does not tell anyone about).
RECOUNT_S = 10.0
#: Pages one lookup round trip asks about (EXISTS replies are a few bytes each).
LOOKUP_PAGES = 256
T = TypeVar("T")


@dataclass(eq=False)
class _Job:
    ticket: int
    host_pool: HostPool
    order: list[bytes]  # the pages, in the caller's order
    pending: int  # batches not finished
    gathering: int = 0  # publish: batches that have not sent their pages yet
    skipped: list[bytes] = field(default_factory=list)
    written: set[bytes] = field(default_factory=set)
    present: set[bytes] = field(default_factory=set)
    ok: list[bool] = field(default_factory=list)  # fetch


class RemoteStore:
    """One rank's connection to the shared store, its threads, breaker, budget and counters."""

    def __init__(self, namespace: Namespace, rank: int, config: RemoteConfig) -> None:
        if not 0 <= rank < namespace.cp_size:
            raise ConfigError(f"rank {rank} is outside [0, {namespace.cp_size}) (the cp_size)")
        self.namespace, self.rank, self.config = namespace, rank, config
        self.address = config.address
        self._kinds = range(len(namespace.payloads))
        self._codec = PageCodec(namespace, rank)
        self._value_len = self._codec.value_len
        self.page_bytes = sum(self._value_len)
        self.budget_bytes = config.budget_bytes // namespace.cp_size
        if self.budget_bytes < self.page_bytes:
            raise ConfigError(
                f"a remote budget of {config.budget_bytes:,} bytes over {namespace.cp_size} "
                f"rank(s) holds no page of {self.page_bytes:,} bytes; raise --remote-gib"
            )
        self.counters = Counters(COUNTERS)
        self.breaker = Breaker(config.breaker_s)
        self.malloc_tuned = tune_malloc() if config.tune_malloc else False
        self._warn = RateLimitedLog(logger=log, tier="shared tier")
        self._client: RedisClient | None = None
        self._client_lock = threading.Lock()
        self._events = Events()
        self._crash: BaseException | None = None
        self._open_tickets = 0  # accepted and not yet returned by poll()
        self._closed = False
        self._used = 0  # value bytes of this rank's keys, as counted plus written since
        self._reserved = 0  # bytes of writes in flight
        self._counted_at: float | None = None
        self._budget_lock = threading.Lock()
        self._io = concurrent.futures.ThreadPoolExecutor(config.threads, "kvstrata-remote")
        self._lookup_io = concurrent.futures.ThreadPoolExecutor(1, "kvstrata-remote-lookup")
        self._count_io = concurrent.futures.ThreadPoolExecutor(1, "kvstrata-remote-count")
        self._counting: concurrent.futures.Future[None] | None = None
        self._local = threading.local()  # each store thread's header buffers (_headers)

    # -- round trips -----------------------------------------------------------------------------

    def _connect(self) -> RedisClient:
        with self._client_lock:
            if self._client is None:  # a cluster client asks a seed node for the slots here
                self._client = RedisClient(
                    self.address, self.config.timeout_s, self.config.threads + 1
                )
            return self._client

    def _call(self, fn: Callable[[RedisClient], T], round_trips: int = 1) -> T:
        """``round_trips`` round trips through the breaker; raises :class:`StoreUnavailable`
        (counted; a refusal by the open breaker counts each round trip skipped)."""
        if not self.breaker.allow():
            self.counters.add(breaker_skips=round_trips)
            raise StoreUnavailable("the breaker is open", timeout=False)
        try:
            out = fn(self._connect())
        except StoreUnavailable as err:
            self._failed(err)
            raise
        except BaseException:  # a bug of ours, not the store's: it neither opens nor closes
            self.breaker.abandon()
            raise
        self.breaker.success()
        return out

    def _failed(self, err: StoreUnavailable) -> None:
        self.counters.add(timeouts=int(err.timeout), connection_errors=int(not err.timeout))
        if self.breaker.failure():
            self.counters.add(breaker_opens=1)
            self._warn.warn(
                "down",
                f"{self.address.shown}: {err}; answering misses for {self.config.breaker_s} s",
            )

    def _exists(self, keys: list[bytes]) -> list[bool | CommandError]:
        return self._call(lambda c: c.exists(keys))

    def _keys(self, page_hash: bytes) -> list[bytes]:
        return self._codec.keys(page_hash)

    # -- tickets ---------------------------------------------------------------------------------

    def _check_args(
        self,
        hashes: Sequence[bytes],
        host_pool: HostPool | None,
        host_slots: Sequence[int],
        distinct: bool = False,
    ) -> None:
        bad = [h for h in hashes if not isinstance(h, bytes) or len(h) != HASH_BYTES]
        if bad:
            raise ConfigError(f"page hashes are {HASH_BYTES} bytes (page_hashes), got {bad[0]!r}")
        if host_pool is None:
            return
        ns = self.namespace
        if host_pool.layout != ns.layout or host_pool.page_size != ns.page_size:
            raise ConfigError(
                "the host pool's layout or page size differs from the remote namespace's: "
                f"{host_pool.layout} / {host_pool.page_size} vs {ns.layout} / {ns.page_size}"
            )
        # distinct for a fetch: each value lands in its slot before it is checked
        host_pool.check_slots(host_slots, distinct)

    def _take_ticket(self) -> bool:
        with self._events.cond:
            if self._closed or self._open_tickets >= self.config.max_tickets:
                return False
            self._open_tickets += 1
            self._events.running += 1
            return True

    def _batches(self, n: int) -> list[range]:
        step = self.config.batch_pages
        return [range(i, min(i + step, n)) for i in range(0, n, step)]

    def _guard(self, fn: Callable[..., None], *args: object) -> None:
        """Run a batch on a store thread; a bug in it is kept for ``poll()`` to raise."""
        try:
            fn(*args)
        except BaseException as err:
            self._crash = err
            log.exception("shared tier: a store thread failed")
            with self._events.cond:
                self._events.cond.notify_all()

    def _raise_crash(self) -> None:
        if self._crash is not None:
            raise self._crash

    # -- publish ---------------------------------------------------------------------------------

    def publish(
        self, ticket: int, pages: Sequence[tuple[bytes, int, int]], host_pool: HostPool
    ) -> bool:
        """Publish ``(page hash, host slot, hits)`` pages in this order, asynchronously.

        Returns False when refused (``max_tickets`` in flight, or closed): nothing was queued and
        the host slots are the caller's again. Otherwise ``poll()`` reports the ticket in
        ``released`` once its host slots were sent (keep them pinned until then), and in
        ``published`` when every page is in the store, failed, or skipped by admission."""
        self._raise_crash()
        self._check_args([h for h, _, _ in pages], host_pool, [s for _, s, _ in pages])
        if not self._take_ticket():
            self.counters.add(publishes_refused=1)
            return False
        admit = [(h, slot) for h, slot, hits in pages if hits >= self.config.min_hits]
        skipped = [h for h, _, hits in pages if hits < self.config.min_hits]
        self.counters.add(publishes=1, skipped_admission=len(skipped))
        job = _Job(ticket, host_pool, [h for h, _ in admit], 1, 1, skipped)
        self._io.submit(self._guard, self._publish_job, job, admit)
        return True

    def _publish_job(self, job: _Job, pages: list[tuple[bytes, int]]) -> None:
        """A publish's first step: which pages the store lacks (one EXISTS pipeline per
        :data:`LOOKUP_PAGES` pages), the budget for them in page order, then their SET batches
        queued behind it. The job counts this step as one batch until it ends."""
        n = len(self._kinds)
        present: list[bytes] = []
        todo: list[tuple[bytes, int]] = []
        batches: list[list[tuple[bytes, int]]] = []
        try:
            for b in range(0, len(pages), LOOKUP_PAGES):
                chunk = pages[b : b + LOOKUP_PAGES]
                there = self._exists([k for h, _ in chunk for k in self._keys(h)])
                for i, page in enumerate(chunk):
                    if all(x is True for x in there[i * n : (i + 1) * n]):
                        present.append(page[0])
                    else:
                        todo.append(page)
            fits = self._reserve(len(todo)) if todo else 0  # raises before it reserves
            if fits < len(todo):
                self.counters.add(skipped_budget=len(todo) - fits)
                self._warn.warn("budget", "the namespace's share of the store is used up")
            step = self.config.batch_pages
            batches = [todo[i : min(i + step, fits)] for i in range(0, fits, step)]
        except StoreUnavailable:
            self.counters.add(skipped_unavailable=len(pages) - len(present))
        self.counters.add(pages_present=len(present))
        with self._events.cond:
            job.pending += len(batches)
            job.gathering += len(batches)
        streams = min(self.config.threads, len(batches))
        for s in range(streams):  # batch i on stream i % streams: each stream in page order
            try:
                self._io.submit(self._guard, self._publish_stream, job, batches[s::streams])
            except RuntimeError:  # the store is closing: its threads take no more work
                for r in range(s, streams):
                    for batch in batches[r::streams]:
                        self._settle_batch(job, batch, None)
                break
        self._gathered(job)
        self._batch_done(job, [], present)

    def _publish_stream(self, job: _Job, batches: list[list[tuple[bytes, int]]]) -> None:
        """SET NX of each batch's values (their budget reserved by :meth:`_publish_job`) on one
        connection, ``config.publish_window`` batches in flight: the next batch's values (their
        CRC-32C) are made while the server stores the ones before. Every batch is settled once,
        sent or not; a stream stops sending once another stream opened the breaker (the batches
        left count as skipped by it). A batch the server stored but whose replies were lost
        with the connection is not in ``used_bytes`` until the next recount."""
        settled = [False] * len(batches)

        def stream() -> Iterator[list[tuple[bytes, PageValue]]]:
            for b, batch in enumerate(batches):
                if b and self.breaker.is_open:  # another round trip found the store down
                    self.counters.add(breaker_skips=len(batches) - b)
                    return
                yield [
                    (key, self._codec.encode(k, h, job.host_pool, slot))
                    for h, slot in batch
                    for k, key in zip(self._kinds, self._keys(h), strict=True)
                ]

        def done(b: int, stored: list[bool | CommandError]) -> None:
            settled[b] = True
            self._settle_batch(job, batches[b], stored)

        window = self.config.publish_window
        try:
            self._call(
                lambda c: c.set_new_stream(stream(), self.config.ttl_s, done, window),
                round_trips=len(batches),
            )
        except StoreUnavailable:
            pass
        finally:
            for b, batch in enumerate(batches):
                if not settled[b]:
                    self._settle_batch(job, batch, None)

    def _settle_batch(
        self, job: _Job, pages: list[tuple[bytes, int]], stored: list[bool | CommandError] | None
    ) -> None:
        """Count a batch's SET NX replies (None: not stored, the store unavailable), give back
        its budget reservation and finish it in its job."""
        n = len(self._kinds)
        written: list[bytes] = []
        present: list[bytes] = []
        new_bytes = 0
        self._gathered(job)  # sent or failed: the host pool's bytes are not read again
        if stored is None:
            self.counters.add(skipped_unavailable=len(pages))
        else:
            for i, (h, _) in enumerate(pages):
                res = stored[i * n : (i + 1) * n]
                errors = [r for r in res if isinstance(r, CommandError)]
                if errors:
                    self.counters.add(write_errors=1)
                    self._warn.warn("write", f"{self.address.shown} refused a write: {errors[0]}")
                    continue
                new_bytes += sum(self._value_len[k] for k, r in enumerate(res) if r is True)
                (written if any(r is True for r in res) else present).append(h)
        with self._budget_lock:
            self._reserved -= len(pages) * self.page_bytes
            self._used += new_bytes
        self.counters.add(
            pages_written=len(written), bytes_written=new_bytes, pages_present=len(present)
        )
        self._batch_done(job, written, present)

    def _batch_done(self, job: _Job, written: list[bytes], present: list[bytes]) -> None:
        with self._events.cond:
            job.written.update(written)
            job.present.update(present)
            job.pending -= 1
            if job.pending == 0:
                self._finish_publish(job)

    def _gathered(self, job: _Job) -> None:
        with self._events.cond:
            job.gathering -= 1
            if job.gathering == 0:
                self._events.released.append(job.ticket)

    def _finish_publish(self, job: _Job) -> None:
        """Post a finished publish (under the events' lock)."""
        failed = tuple(h for h in job.order if h not in job.written and h not in job.present)
        written = tuple(h for h in job.order if h in job.written)
        present = tuple(h for h in job.order if h in job.present and h not in job.written)
        done = PublishDone(job.ticket, written, present, failed, tuple(job.skipped))
        self._events.published.append(done)
        self._events.running -= 1
        self._events.cond.notify_all()

    # -- the budget ------------------------------------------------------------------------------

    def _reserve(self, pages: int) -> int:
        """How many of ``pages`` new pages fit in the budget (reserved for the caller)."""
        with self._budget_lock:
            over = self._used + self._reserved + pages * self.page_bytes > self.budget_bytes
            counted = self._counted_at
            first = counted is None
            due = counted is None or (over and time.monotonic() - counted >= RECOUNT_S)
        if due:
            counting = self._start_recount()
            if first:  # nothing counted yet: wait for it, no longer than one round trip may take
                try:
                    counting.result(timeout=2 * self.config.timeout_s)
                except concurrent.futures.TimeoutError:
                    self.counters.add(recount_waits_cut=1)
                    return 0  # skipped (counted by the caller) until the first count is in
        with self._budget_lock:
            room = (self.budget_bytes - self._used - self._reserved) // self.page_bytes
            fits = max(0, min(pages, room))
            self._reserved += fits * self.page_bytes
            return fits

    def _start_recount(self) -> concurrent.futures.Future[None]:
        """The recount under way, or a new one on the counting thread. A SCAN walks every key
        of the store, every tenant's, so it never runs on the threads that fetch: a fetch
        would wait behind it for as long as the keyspace takes to walk (2.6 s at 3 M keys)."""
        with self._budget_lock:
            if self._counting is None or self._counting.done():
                self._counting = self._count_io.submit(self._recount)
            return self._counting

    def _recount(self) -> None:
        """Count this rank's keys in the store (SCAN; on the counting thread only, one at a
        time: :meth:`_start_recount` submits none while one runs)."""
        pattern = rank_pattern(self.namespace, self.rank)

        def count(client: RedisClient) -> int:
            kinds = (key_kind(key) for key in client.scan(pattern))
            return sum(self._value_len[k] for k in kinds if k is not None and k in self._kinds)

        total = self._call(count)
        with self._budget_lock:
            self._used, self._counted_at = total, time.monotonic()
        self.counters.add(recounts=1)

    def clear(self) -> int:
        """Delete every key of this rank's namespace from the store (every instance's: they
        share it) after the writes in flight, and count the budget from zero; the keys deleted.
        A flush of the cache as an operator asks for it (SGLang's clear of its storage backend),
        on the caller's thread; an unavailable store raises :class:`StoreUnavailable`."""
        self.flush(self.config.timeout_s * 4)
        pattern = rank_pattern(self.namespace, self.rank)

        def wipe(client: RedisClient) -> int:
            keys = list(client.scan(pattern))
            for i in range(0, len(keys), LOOKUP_PAGES):
                client.delete(keys[i : i + LOOKUP_PAGES])
            return len(keys)

        deleted = self._call(wipe)
        with self._budget_lock:
            self._used, self._counted_at = 0, time.monotonic()
        return deleted

    # -- lookup and fetch ------------------------------------------------------------------------

    def lookup(self, page_hashes: Sequence[bytes]) -> int:
        """How many of ``page_hashes``, from the first, have every payload in the store (0 when
        the store is closed, unavailable or slower than twice its timeout)."""
        self._check_args(page_hashes, None, ())
        if self._closed or not page_hashes:
            return 0
        self.counters.add(lookups=1, lookup_pages=len(page_hashes))
        if self.breaker.blocked():
            self.counters.add(breaker_skips=1)
            return 0
        future = self._lookup_io.submit(self._lookup_leading, list(page_hashes))
        try:
            found = future.result(timeout=2 * self.config.timeout_s + 0.05)
        except concurrent.futures.TimeoutError:
            self._failed(StoreUnavailable("a lookup outlasted twice the timeout", timeout=True))
            return 0
        self.counters.add(lookup_found=found)
        return found

    def _lookup_leading(self, hashes: list[bytes]) -> int:
        n, found = len(self._kinds), 0
        for b in range(0, len(hashes), LOOKUP_PAGES):
            batch = hashes[b : b + LOOKUP_PAGES]
            try:
                there = self._exists([k for h in batch for k in self._keys(h)])
            except StoreUnavailable:
                return found
            for i in range(len(batch)):
                if not all(x is True for x in there[i * n : (i + 1) * n]):
                    return found
                found += 1
        return found

    def fetch(
        self,
        ticket: int,
        page_hashes: Sequence[bytes],
        host_pool: HostPool,
        host_slots: Sequence[int],
    ) -> bool:
        """Read pages into ``host_slots`` of ``host_pool``, verified, asynchronously; ``poll()``
        reports ``FetchDone(ticket, ok)``. Returns False when refused (``max_tickets`` in
        flight, or closed)."""
        self._raise_crash()
        if len(page_hashes) != len(host_slots):
            raise ConfigError(f"{len(page_hashes)} page hashes for {len(host_slots)} host slots")
        self._check_args(page_hashes, host_pool, host_slots, distinct=True)
        if not self._take_ticket():
            self.counters.add(fetches_refused=1)
            return False
        self.counters.add(fetches=1)
        batches = self._batches(len(page_hashes))
        job = _Job(
            ticket, host_pool, list(page_hashes), len(batches), ok=[False] * len(page_hashes)
        )
        if not batches:
            with self._events.cond:
                self._finish_fetch(job)
        for b in batches:
            self._io.submit(self._guard, self._fetch_batch, job, b, [host_slots[i] for i in b])
        return True

    def _fetch_batch(self, job: _Job, pages: range, host_slots: list[int]) -> None:
        """One GET pipeline of every payload of ``pages``. Each value is read straight into its
        host slot (its header into this thread's header buffer, the payload scattered over the
        slot's views by the kernel); a page is checked as soon as its values arrived, while the
        server still sends the next ones. The slot was reserved for this fetch: a page that
        fails its check is a miss and its slot's bytes are never used."""
        n, hashes = len(self._kinds), [job.order[i] for i in pages]
        keys = [self._keys(h) for h in hashes]
        ok = [False] * len(hashes)
        bad: list[bytes] = []
        arrived = 0  # pages whose every reply came
        heads = self._headers()
        got: list[_Value] = [None] * n

        def into(j: int) -> list[memoryview]:
            i, k = divmod(j, n)
            return [heads[k], *self._codec.payload_views(k, job.host_pool, host_slots[i])]

        def each(j: int, value: _Value) -> None:
            nonlocal arrived
            i, k = divmod(j, n)
            got[k] = value
            if k == n - 1:
                arrived = i + 1
                if self._take_page(hashes[i], got):
                    ok[i] = True
                elif all(isinstance(v, list | memoryview) for v in got):
                    bad.extend(keys[i])  # read but not intact: deleted below

        try:
            flat = [k for ks in keys for k in ks]
            self._call(lambda c: c.get(flat, into, each))
            if bad:
                self._call(lambda c: c.delete(bad))
        except StoreUnavailable:
            self.counters.add(read_unavailable=len(hashes) - arrived)
        finally:
            hits = sum(ok)
            self.counters.add(
                hits=hits, misses=len(hashes) - hits, bytes_read=hits * self.page_bytes
            )
            with self._events.cond:
                for i, good in zip(pages, ok, strict=True):
                    job.ok[i] = good
                job.pending -= 1
                if job.pending == 0:
                    self._finish_fetch(job)

    def _take_page(self, page_hash: bytes, values: list[_Value]) -> bool:
        """Whether every payload's value of a page arrived intact in its host slot. A missing
        or refused value is a miss; a bad one (another length is read into a buffer of its
        own) is counted and logged."""
        if not all(isinstance(v, list | memoryview) for v in values):
            return False  # absent (never written, evicted, expired), refused or no value: a miss
        why = next(
            (
                f"payload {self.namespace.payloads[k].name}: {w}"
                for k, v in enumerate(values)
                if (w := self._codec.check(k, page_hash, v)) is not None  # type: ignore[arg-type]
            ),
            None,
        )
        if why is not None:
            self.counters.add(verify_failures=1)
            self._warn.warn("verify", f"page {page_hash.hex()[:16]}: {why}; a miss, deleted")
            return False
        return True

    def _headers(self) -> list[memoryview]:
        """This thread's slot-header buffers, one per payload kind: a value's header lands
        there (its payload in the host slot) and is checked before the next page's."""
        buf: bytearray | None = getattr(self._local, "heads", None)
        if buf is None:
            buf = self._local.heads = bytearray(SLOT_HEADER_BYTES * len(self._kinds))
        view = memoryview(buf)
        return [view[k * SLOT_HEADER_BYTES : (k + 1) * SLOT_HEADER_BYTES] for k in self._kinds]

    def _finish_fetch(self, job: _Job) -> None:
        self._events.fetched.append(FetchDone(job.ticket, tuple(job.ok)))
        self._events.running -= 1
        self._events.cond.notify_all()

    # -- progress and state ----------------------------------------------------------------------

    def poll(self) -> RemotePoll:
        """Completions since the last call (non-blocking). Raises only if a store thread hit a
        bug; store faults are counted and reported in the results."""
        self._raise_crash()
        out = self._events.take()
        with self._events.cond:
            self._open_tickets -= len(out.published) + len(out.fetched)
        return out

    def flush(self, timeout_s: float) -> bool:
        """Wait until every accepted publish and fetch finished; False if ``timeout_s`` ran out."""
        ev = self._events
        with ev.cond:
            ev.cond.wait_for(lambda: ev.running == 0 or self._crash is not None, timeout_s)
            return ev.running == 0

    def stats(self) -> RemoteStats:
        with self._budget_lock:
            used = self._used
        return RemoteStats(
            url=self.address.shown,
            kind=self.address.kind,
            budget_bytes=self.budget_bytes,
            used_bytes=used,
            page_bytes=self.page_bytes,
            breaker_open=self.breaker.is_open,
            malloc_tuned=self.malloc_tuned,
            counters=self.counters.snapshot(),
        )

    def check(self) -> None:
        """The ticket and budget accounting's invariants; raises ``PoolInvariantError``."""
        with self._events.cond:
            running, open_tickets = self._events.running, self._open_tickets
        if not 0 <= running <= open_tickets <= self.config.max_tickets:
            raise PoolInvariantError(
                f"shared tier: {running} jobs running, {open_tickets} tickets open "
                f"(at most {self.config.max_tickets})"
            )
        with self._budget_lock:
            if self._used < 0 or self._reserved < 0:
                raise PoolInvariantError(
                    f"shared tier budget: {self._used} bytes used, {self._reserved} reserved"
                )
        c = self.counters.snapshot()
        if c["hits"] + c["misses"] > 0 and c["fetches"] == 0:
            raise PoolInvariantError("shared tier: pages fetched without a fetch ticket")

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish accepted work (up to ``timeout_s``; the breaker bounds each round trip), stop
        the threads, close the connections. Idempotent."""
        if self._closed:
            return
        if not self.flush(timeout_s):
            log.warning("shared tier: closing with work still running after %s s", timeout_s)
        with self._events.cond:
            self._closed = True
        self._io.shutdown(wait=True, cancel_futures=True)
        self._lookup_io.shutdown(wait=True, cancel_futures=True)
        self._count_io.shutdown(wait=True, cancel_futures=True)
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
