"""``KvstrataStorage``: kvstrata's disk tier as an SGLang HiCache L3 storage backend.

SGLang builds it through its dynamic loader as ``KvstrataStorage(storage_config, kwargs)`` and
hands it the host pool with ``register_mem_pool_host(pool)``; the store opens then, because the
page geometry comes from the pool. One :class:`~kvstrata.tiers.disk_store.DiskStore` per rank
(its namespace names model, TP/PP/CP/DP rank and geometry: ``pages.namespace_for``)::

    backup    batch_set_v1(keys, host_indices)  spill the pages from SGLang's host memory,
              wait until they are durable (written, fdatasync-ed, indexed): True per page
    prefetch  batch_exists(keys)                leading pages in the index
              batch_get_v1(keys, host_indices)  read, verify (CRC-32C, hash, index), copy into
              the host pages: True per page; a page that fails is False (SGLang recomputes it),
              counted, and dropped from the index before this returns, so the next
              batch_exists stops there

MLA pools hold the same latent on every TP rank and SGLang lets only one of them write; the
others serve reads from that rank's store through a read-only view (``disk_view.DiskView``).
The older ``get``/``set``/``batch_get``/``batch_set``/``exists`` (SGLang without
``interface_v1``) move flat data pages through the same store in a namespace of their own.

With ``"remote": "redis://..."`` the shared Redis tier sits behind the disk (``shared.py``), in
the disk store's namespace: every page a backup made durable is then also published (staged by
a bounded copy, sent on the store's threads); ``batch_exists`` counts a leading run of pages that
are on disk or in Redis, and ``batch_get_v1`` reads the disk's pages from the disk and the rest
from Redis, verified. A page read from Redis is not written to the local disk (that write would
sit on the prefetch path); a bad value, a timeout or a dead Redis is a False, counted.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from ...errors import ConfigError
from ...tiers.disk_config import DiskStats
from ...tiers.disk_store import DiskStore
from ...tiers.disk_view import DiskView
from ...tiers.host_pool import HostPool
from ...tiers.remote.client import StoreUnavailable
from .metrics import BackendCounters, storage_metrics
from .pages import SGLangPages, key_hash, namespace_for
from .settings import BackendSettings
from .shared import SharedPages

log = logging.getLogger("kvstrata.sglang")
#: SGLang's STORAGE_BATCH_SIZE: the most pages one call carries.
MAX_BATCH_PAGES = 128
#: The longest a failed read waits for its page to leave the index.
DROP_WAIT_S = 2.0
#: Keys whose backup offers are counted for ``min_hits`` (oldest forgotten first).
OFFER_CAP = 1 << 20


class KvstrataStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over kvstrata's verified, crash-safe disk tier."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config, os.environ)
        if storage_config.should_split_heads:
            raise ConfigError(
                "the kvstrata storage backend does not split heads across heterogeneous TP "
                "(tp_lcm_size); drop tp_lcm_size from the extra config"
            )
        self.storage_config = storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.counters = BackendCounters()
        self.pages: SGLangPages | None = None
        self.store: DiskStore | DiskView | None = None
        self.shared: SharedPages | None = None
        self._tickets = itertools.count()
        self._set_lock = threading.Lock()  # one backup in flight: poll() results are its own
        self._offers: OrderedDict[bytes, int] = OrderedDict()

    # -- set-up ----------------------------------------------------------------------------------

    def shard(self) -> dict[str, int]:
        """The SGLang ranks whose pages this store holds (MLA pages are the same on every TP
        rank, so an MLA store has no TP rank: the writer's pages serve all of them)."""
        c = self.storage_config
        shard = {"pp_rank": c.pp_rank, "pp_size": c.pp_size, "dp_rank": c.dp_rank}
        shard |= {"cp_rank": c.attn_cp_rank, "cp_size": c.attn_cp_size}
        if not self.is_mla:
            shard |= {"tp_rank": c.tp_rank, "tp_size": c.tp_size}
        return shard

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for ``mem_pool_host``'s page geometry (SGLang calls this once, right
        after construction)."""
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            raise ConfigError("the kvstrata storage backend already has a host pool")
        self.pages = SGLangPages(mem_pool_host, is_mla=self.is_mla)
        interface = "v1" if self.settings.interface_v1 else "flat"
        ns = namespace_for(self.storage_config.model_name, self.pages, self.shard(), interface)
        disk = self.settings.disk
        if self.is_writer:
            self.store = DiskStore(ns, 0, disk)
        else:
            self.store = DiskView(ns, 0, disk.root, disk.read_threads, disk.io_timeout_s)
        remote = self.settings.remote
        if remote is not None:
            # A reader never publishes; its staging stays untouched (never resident).
            staging = self.settings.remote_staging_bytes
            self.shared = SharedPages(ns, remote, self.pages.layout, self.pages.page_size, staging)
        log.info(
            "kvstrata storage: %s %s, namespace %s, %d-byte pages, %s%s",
            "writer" if self.is_writer else "reader",
            interface,
            ns.short,
            self.pages.page_bytes,
            disk.root,
            f", shared tier {self.shared.where}" if self.shared is not None else "",
        )

    def _ready(self) -> tuple[SGLangPages, DiskStore | DiskView]:
        if self.pages is None or self.store is None:
            raise ConfigError("register_mem_pool_host(pool) must come before any storage call")
        return self.pages, self.store

    @staticmethod
    def _check_batch(keys: list[str]) -> list[bytes]:
        if len(keys) > MAX_BATCH_PAGES:
            raise ConfigError(f"{len(keys)} pages in one call; SGLang sends at most 128")
        return [key_hash(k) for k in keys]

    # -- interface_v1 ----------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are on disk (the index; no slab I/O) or, with
        the shared tier, in Redis (every payload's key there; values are checked on read)."""
        _, store = self._ready()
        hashes = [key_hash(k) for k in keys]
        found = remote = 0
        for s in range(0, len(hashes), MAX_BATCH_PAGES):
            chunk = hashes[s : s + MAX_BATCH_PAGES]
            n, r = self._leading(store, chunk)
            found, remote = found + n, remote + r
            if n < len(chunk):
                break
        self.counters.add(
            exists_calls=1, exists_pages=len(keys), exists_hits=found, exists_remote=remote
        )
        return found

    def _leading(self, store: DiskStore | DiskView, hashes: list[bytes]) -> tuple[int, int]:
        """The leading run of ``hashes`` on disk or in Redis, and how much of it Redis found:
        the disk's run, then Redis's run from where it stopped, then the disk's again, ..."""
        at = remote = 0
        while at < len(hashes):
            at += store.lookup(hashes[at:])
            if at == len(hashes) or self.shared is None:
                break
            n = self.shared.lookup(hashes[at:])
            if n == 0:
                break
            at, remote = at + n, remote + n
        return at, remote

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read ``keys`` into the host pages at ``host_indices``; True per page verified."""
        pages, _ = self._ready()
        hashes = self._check_batch(keys)
        return self._read(hashes, pages.host_pool, pages.slots(host_indices, len(keys)))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Write the host pages at ``host_indices`` as ``keys``; True per page durable."""
        pages, _ = self._ready()
        hashes = self._check_batch(keys)
        return self._write(hashes, pages.host_pool, pages.slots(host_indices, len(keys)))

    # -- the older interface: flat data pages ----------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location])
        return got[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        pages, _ = self._ready()
        hashes = self._check_batch(keys)
        targets = list(target_locations or [None] * len(keys))
        targets = [t if t is not None else pages.pool.get_dummy_flat_data_page() for t in targets]
        ok = self._read(hashes, pages.flat_pool(targets), list(range(len(keys))))
        return [t if good else None for t, good in zip(targets, ok, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        pages, _ = self._ready()
        hashes = self._check_batch(keys)
        flat = [torch.as_tensor(v).contiguous() for v in values or []]
        if len(flat) != len(keys):
            raise ConfigError(f"{len(keys)} keys for {len(flat)} values")
        return all(self._write(hashes, pages.flat_pool(flat), list(range(len(keys)))))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- reads and writes ------------------------------------------------------------------------

    def _read(self, hashes: list[bytes], host_pool: HostPool, slots: list[int]) -> list[bool]:
        """Read pages, verified: from disk, and where the disk's run stops, from Redis (the
        page there and the later ones the disk lacks), then from disk again, ... SGLang uses
        the leading run of True, so each round starts at the first page still False and a round
        that adds nothing there ends it."""
        _, store = self._ready()
        t0 = time.perf_counter()
        n = len(hashes)
        ok = [False] * n
        disk_miss: bytes | None = None  # the disk's first False page (maybe being dropped)
        remote_hits = at = 0
        while at < n:
            _take(ok, range(at, n), store.read, hashes, host_pool, slots)
            at = _first_false(ok, at)
            if at < n and disk_miss is None:
                disk_miss = hashes[at]
            if at == n or self.shared is None:
                break
            todo = [at] + [
                i for i in range(at + 1, n) if not ok[i] and not store.lookup(hashes[i : i + 1])
            ]
            remote_hits += _take(ok, todo, self.shared.fetch, hashes, host_pool, slots)
            after = _first_false(ok, at)
            if after == at:
                break
            at = after
        hits = sum(ok)
        self.counters.add(get_calls=1, get_pages=n, get_hits=hits, get_remote_hits=remote_hits)
        if hits:
            self.counters.prefetched(hits, hits * host_pool.page_bytes, time.perf_counter() - t0)
        if disk_miss is not None and isinstance(store, DiskStore):
            # A page that failed verification is being dropped by the writer thread; wait for
            # it (bounded), so that the next batch_exists already stops there.
            self._await_gone(store, disk_miss)
        return ok

    def _await_gone(self, store: DiskStore, page_hash: bytes) -> None:
        # The writer thread applies drops within one of its polls (50 ms); a page that was not
        # dropped (a read that timed out waiting for another) leaves after DROP_WAIT_S.
        deadline = time.monotonic() + DROP_WAIT_S
        while store.lookup([page_hash]) and time.monotonic() < deadline:
            time.sleep(0.001)

    def _hits(self, hashes: list[bytes]) -> list[int]:
        """Backup offers of each page so far, this one included (``min_hits`` admission)."""
        out = []
        for h in hashes:
            n = self._offers.pop(h, 0) + 1
            self._offers[h] = n
            out.append(n)
        while len(self._offers) > OFFER_CAP:
            self._offers.popitem(last=False)
        return out

    def _write(self, hashes: list[bytes], host_pool: HostPool, slots: list[int]) -> list[bool]:
        _, store = self._ready()
        if not isinstance(store, DiskStore):
            self.counters.add(set_calls=1, set_pages=len(hashes), set_not_writer=len(hashes))
            return [False] * len(hashes)
        t0 = time.perf_counter()
        with self._set_lock:
            ticket = next(self._tickets)
            pages = list(zip(hashes, slots, self._hits(hashes), strict=True))
            if not store.spill(ticket, pages, host_pool):
                self.counters.add(set_calls=1, set_pages=len(hashes), set_refused=len(hashes))
                return [False] * len(hashes)
            durable: set[bytes] = set()
            done = released = False
            if store.flush(store.config.io_timeout_s):  # every page durable, failed or skipped
                got = store.poll()
                released = ticket in got.released
                for d in got.spilled:
                    if d.ticket == ticket:
                        durable.update(d.durable)
                        done = True
            if not done and not released:
                self._await_release(store, ticket)
        ok = [h in durable for h in hashes]
        if self.shared is not None and any(ok):  # durable: now the other hosts may have them
            mine = [
                (h, slot, hits) for (h, slot, hits), good in zip(pages, ok, strict=True) if good
            ]
            self.shared.publish(
                [(h, hits) for h, _, hits in mine], host_pool, [s for _, s, _ in mine]
            )
        self.counters.add(
            set_calls=1,
            set_pages=len(hashes),
            set_durable=sum(ok),
            set_timeouts=0 if done else len(hashes),
        )
        if any(ok):
            nbytes = sum(ok) * host_pool.page_bytes
            self.counters.backed_up(sum(ok), nbytes, time.perf_counter() - t0)
        return ok

    def _await_release(self, store: DiskStore, ticket: int) -> None:
        """A backup that timed out returns only once the store no longer reads its host pages:
        SGLang reuses them as soon as the call returns, and a page gathered after that would be
        another page's bytes under this key. The store's own I/O timeouts bound this wait."""
        log.warning("kvstrata storage: a backup ran past io_timeout_s; waiting for its copies")
        while True:
            got = store.poll()
            if ticket in got.released or any(d.ticket == ticket for d in got.spilled):
                return
            time.sleep(0.001)

    # -- state -----------------------------------------------------------------------------------

    def disk_stats(self) -> DiskStats:
        """The disk tier's state and counters (``kvstrata disk check`` reads the same files)."""
        _, store = self._ready()
        return store.stats()

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (per-call page counts and GB/s since the last call), with
        kvstrata's counters as ``.kvstrata`` (the backend's and the disk tier's, cumulative)."""
        counters = self.counters.snapshot()
        if self.store is not None:
            counters |= {f"disk_{k}": v for k, v in self.store.stats().counters.items()}
        if self.shared is not None:
            counters |= {f"remote_{k}": v for k, v in self.shared.stats().counters.items()}
            counters |= {f"remote_{k}": v for k, v in self.shared.counters.snapshot().items()}
        return storage_metrics(self.counters.drain(), counters)

    def clear(self) -> bool:
        """Drop every page this rank's store holds (its slabs stay, empty) and, with the shared
        tier, this rank's pages in Redis: every host's, since they share them (a flush after a
        weight update must not leave the old KV for anyone). False when Redis could not be
        reached (the disk is cleared all the same)."""
        pages, store = self._ready()
        if not isinstance(store, DiskStore):
            return False
        store.close()
        cfg = store.config
        fresh = dataclasses.replace(cfg, start="clear")
        self.store = DiskStore(store.namespace, store.rank, fresh)
        if self.shared is not None:
            try:
                deleted = self.shared.clear()
            except StoreUnavailable as err:
                log.warning("clear: the shared tier is unreachable, its pages stay: %s", err)
                return False
            log.info("clear: %d keys of this rank deleted from the shared tier", deleted)
        return True

    def close(self) -> None:
        """Finish the writes in flight (the publishes' too) and close the stores (idempotent)."""
        if self.shared is not None:
            self.shared.close()
        if self.store is not None:
            self.store.close()


def _first_false(ok: list[bool], start: int) -> int:
    """The first index from ``start`` whose page is not read (``len(ok)`` when none)."""
    return next((i for i in range(start, len(ok)) if not ok[i]), len(ok))


def _take(
    ok: list[bool],
    todo: Sequence[int],
    read: Callable[[list[bytes], HostPool, list[int]], list[bool]],
    hashes: list[bytes],
    host_pool: HostPool,
    slots: list[int],
) -> int:
    """``read`` the pages of ``todo`` not read yet into their slots; marks ``ok``, returns how
    many it read."""
    todo = [i for i in todo if not ok[i]]
    if not todo:
        return 0
    got = read([hashes[i] for i in todo], host_pool, [slots[i] for i in todo])
    for i, good in zip(todo, got, strict=True):
        ok[i] = good
    return sum(got)
