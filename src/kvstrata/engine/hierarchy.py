"""The cache hierarchy of one rank: the radix tree over L1 (device), L2 (host) and L3 (disk), and
every call that moves pages between them (docs/design.md, "Tiers and movement").

The engine's scheduler talks to this object only: it *claims* a request's cached prefix (match,
lock, allocate the rest, start its load-back), *reserves* backups before a forward, serves as
the forward's per-layer hooks (load-back waits, write-through copies), *inserts* each computed
chunk (and queues its pages' spill), *releases* a finished request, and *settles* the copies the
commit frontier covers. ``check`` verifies conservation across the tiers: every device and host
page is free, cached, or held by exactly one running request, reservation or copy in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from ..cache.allocator import PageAllocator
from ..cache.keys import TokenKey
from ..cache.radix import Node, RadixTree
from ..clock import StepWork
from ..config import CacheConfig, KVLayout, PoolConfig
from ..errors import ConfigError, RequestError
from ..ownership import owners, page_span
from ..residency import Tier
from ..tiers.disk_config import DiskConfig
from ..tiers.disk_store import DiskStore
from ..tiers.host_pool import HostPool
from ..tiers.loadback import LoadBack
from ..tiers.page_hash import Namespace, PrefixHasher
from ..tiers.pool import DevicePool
from ..tiers.remote.behind_disk import RemoteBehindDisk
from ..tiers.remote.config import RemoteConfig
from ..tiers.remote.tier import RemotePages
from ..tiers.spill import DiskTier, PageStore, SpillItem
from ..tiers.tickets import FrontierFn, TicketKind, TicketLedger, local_frontier
from ..tiers.transfer import Completion, Transfer, TransferStats
from ..tiers.writethrough import Reservation, WriteThrough
from .config import GIB, EngineConfig
from .request import Running, insertable_len

if TYPE_CHECKING:
    from ..tiers.remote.store import RemoteStore

__all__ = ["CacheHierarchy", "Claim", "FrontierFn", "Moved", "Settled"]

IntArray = npt.NDArray[np.int64]


class Claim(NamedTuple):
    """What the cache holds of an admitted request, locked for it."""

    node: Node  # locked: the end of the cached prefix the request reads
    pages: IntArray  # one device page per page of the whole sequence
    cached_len: int
    host_len: int  # of cached_len, being loaded back from L2
    disk_len: int = 0  # of host_len, brought from L3 by a reload


class Moved(NamedTuple):
    """Totals so far of what the clock charges a step by."""

    h2d_bytes: int
    d2h_bytes: int
    load_wait_s: float
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0


@dataclass
class _Spill:
    node: Node
    hashes: list[bytes]
    host_pages: IntArray


class CacheHierarchy:
    """L1, L2 and L3 of one rank, their tree, and the copies between them. ``frontier`` turns
    this rank's copy progress into the commit frontier (under CP: the MIN over ranks)."""

    def __init__(
        self,
        config: EngineConfig,
        layout: KVLayout,
        frontier: FrontierFn | None = None,
        cp: int = 1,
        rank: int = 0,
        model_id: str = "model",
    ) -> None:
        self.config, self.layout = config, layout
        self.frontier = frontier or local_frontier
        self.cp, self.rank = cp, rank
        P = config.page_size
        # Sizes are per rank: each rank's pools hold its own lane of a cp-times larger page space.
        self.pool = DevicePool(layout, P, config.pool_pages, config.device)
        self.allocator = PageAllocator(PoolConfig(num_pages=config.pool_pages * cp, cp_size=cp))
        self.host_pool: HostPool | None = None
        self.host_allocator: PageAllocator | None = None
        self.transfer: Transfer | None = None
        host_pages = self._host_pages()
        if host_pages:
            self.host_pool = HostPool(
                layout,
                P,
                host_pages,
                host_layout=config.host_layout,
                max_alloc_bytes=int(config.max_host_alloc_gib * GIB),
            )
            self.host_allocator = PageAllocator(PoolConfig(num_pages=host_pages * cp, cp_size=cp))
            self.transfer = Transfer(self.pool, self.host_pool)
        self.tree = RadixTree(
            CacheConfig(page_size=P, cp_size=cp, eviction=config.eviction),
            capacity_pages=config.pool_pages * cp,
            host_capacity_pages=host_pages * cp,
            allocator=self.allocator,
            host_allocator=self.host_allocator,
        )
        self.ledger = TicketLedger()
        self.backups: WriteThrough | None = None
        self.loads: LoadBack | None = None
        if self.transfer is not None and self.host_allocator is not None:
            self.backups = WriteThrough(
                self.tree,
                self.host_allocator,
                self.transfer,
                self.ledger,
                layout.num_layers,
                config.write_policy,
                config.write_through_hits,
                rank=rank,
            )
            self.loads = LoadBack(
                self.tree, self.transfer, self.ledger, layout.num_layers, self._drain, rank
            )
        self.disk: DiskTier | None = None
        self.namespace: Namespace | None = None
        self._hasher: PrefixHasher | None = None  # the namespace's page hashes, chains reused
        #: The disk store (L3), and the shared store behind it or, without a disk, in its place.
        self.disk_store: DiskStore | None = None
        self.remote: RemoteStore | None = None
        if config.l3_dir is not None or config.remote_url is not None:
            assert self.host_pool is not None and self.host_allocator is not None
            self.namespace = Namespace.for_layout(model_id, layout, P, cp)
            self._hasher = PrefixHasher(self.namespace)
            self.disk = DiskTier(
                self.tree,
                self.host_allocator,
                self.host_pool,
                self._open_l3(self.namespace, rank),
                self.ledger,
                rank,
            )
        #: Test hook: may hold completions back before they count as progress (a slow rank).
        self.report_delay: Callable[[list[Completion]], list[Completion]] | None = None
        self.hit_tokens = {Tier.L1: 0, Tier.L2: 0, Tier.L3: 0}  # tokens served, by tier
        self.peak_pages_used = 0
        self.disk_wait_s = 0.0  # wall seconds settles spent waiting for the disk's last step
        self._hashes: dict[int, list[bytes]] = {}  # rid -> its full pages' content addresses
        self._l3_tokens: dict[int, int] = {}  # rid -> tokens a reload brought it
        self._spill_after: dict[int, list[_Spill]] = {}  # backup ticket -> spills once it commits
        self._reservations: dict[int, Reservation] = {}  # rid -> this step's backup

    def _open_l3(self, namespace: Namespace, rank: int) -> PageStore:
        """The store behind L2: the disk, the shared store, or the disk with the shared store
        behind it (``RemoteBehindDisk``)."""
        config = self.config
        if config.l3_dir is not None:
            self.disk_store = DiskStore(
                namespace,
                rank,
                DiskConfig(
                    root=Path(config.l3_dirs[0]),
                    more_roots=tuple(Path(d) for d in config.l3_dirs[1:]),
                    budget_bytes=int(config.l3_gib * GIB),
                    start=config.l3_start,  # type: ignore[arg-type]
                    min_hits=config.l3_min_hits,
                    io_mode=config.l3_io,  # type: ignore[arg-type]
                    # One spill per step and at most a step's admissions of reloads are in
                    # flight at once (the fixed point waits for them): never refused for queueing.
                    max_tickets=max(64, 2 * config.max_batch_requests + 2),
                ),
            )
        if config.remote_url is None:
            assert self.disk_store is not None
            return self.disk_store
        try:
            self.remote = _open_remote(config, namespace, rank)
        except BaseException:
            if self.disk_store is not None:
                self.disk_store.close()  # its lock and threads
            raise
        if self.disk_store is None:
            return RemotePages(self.remote)
        return RemoteBehindDisk(self.disk_store, RemotePages(self.remote))

    def _host_pages(self) -> int:
        """L2 slots of this rank (0: no L2)."""
        config = self.config
        if not config.has_l2:
            return 0
        if config.l2_tokens:
            return config.l2_tokens // config.page_size
        pages = HostPool.slots_for_bytes(self.layout, config.page_size, int(config.l2_gib * GIB))
        if pages < 1:
            raise ConfigError(
                f"--l2-gib {config.l2_gib} holds no page of "
                f"{self.layout.page_bytes(config.page_size)} bytes"
            )
        return pages

    # -- lookups the scheduler makes -------------------------------------------------------------

    def key(self, tokens: object) -> TokenKey:
        return self.tree.key(tokens)

    def cached_len(self, key: TokenKey) -> int:
        """Tokens of ``key`` the tree holds in any tier (the scheduler's deferral check)."""
        return self.tree.match_length(key)

    def page_hashes(self, rid: int, key: TokenKey) -> list[bytes]:
        """The content addresses of request ``rid``'s full pages (computed once)."""
        hashes = self._hashes.get(rid)
        if hashes is None:
            assert self._hasher is not None
            full = key.num_full_pages * self.config.page_size
            hashes = self._hashes[rid] = self._hasher(key.tokens[:full], key.page_keys)
        return hashes

    # -- claim and release -----------------------------------------------------------------------

    def claim(self, rid: int, key: TokenKey, limit: int, others_hold: bool) -> Claim | None:
        """Lock the cached prefix of ``key`` (at most ``limit`` tokens), allocate device pages for
        its host-only part and the rest of the sequence, and start loading the host part back.
        None when the pages do not fit now; :class:`RequestError` when nothing will ever release
        any (``others_hold``: running requests hold pages that they will release)."""
        P, tree, allocator = self.config.page_size, self.tree, self.allocator
        # Not recorded yet: a request that has to wait would count a hit on every retry.
        hit = tree.match_prefix(key, max_len=limit, record=False)
        host_part = hit.valid_len > hit.device_len
        tree.lock(hit.device_node)
        if host_part:
            tree.host_lock(hit.last_node)
        first = hit.device_len // P
        need = page_span(len(key), P) - first
        new_pages = self._alloc_evicting(first, need)
        if new_pages is None:
            tree.unlock(hit.device_node)
            if host_part:
                tree.host_unlock(hit.last_node)
            if not others_hold and not self.ledger.in_flight(TicketKind.BACKUP):
                raise RequestError(  # nothing will release pages: the refusal should have caught it
                    f"request {rid}: {need} pages do not fit even after eviction "
                    f"({allocator.num_free} free of {allocator.num_pages})"
                )
            return None
        node, cached_len, host_len = hit.device_node, hit.device_len, 0
        if host_part:
            assert self.loads is not None
            loaded = hit.valid_len // P - first
            if self.loads.start(hit, new_pages[:loaded]):
                tree.lock(hit.last_node)
                tree.unlock(hit.device_node)
                node, cached_len, host_len = hit.last_node, hit.valid_len, hit.valid_len - first * P
        tree.record_hit(node)
        if self.backups is not None:
            self.backups.on_hit(node)
        from_disk = min(self._l3_tokens.pop(rid, 0), host_len)
        self.hit_tokens[Tier.L1] += cached_len - host_len
        self.hit_tokens[Tier.L2] += host_len - from_disk
        self.hit_tokens[Tier.L3] += from_disk
        if self.disk is not None:
            self.disk.stats.hit_tokens += from_disk
        self.peak_pages_used = max(self.peak_pages_used, allocator.num_used)
        pages = np.concatenate((hit.device_pages, new_pages))
        return Claim(node, pages, cached_len, host_len, from_disk)

    def _alloc_evicting(self, first: int, count: int) -> IntArray | None:
        """Device pages for sequence pages ``[first, first + count)``, evicting what the short
        lanes need (write-back first backs the victims up; they go once committed)."""
        allocator = self.allocator
        pages = allocator.alloc(first, count)
        if pages is None:
            short = allocator.deficit(owners(first, count, allocator.cp_size))
            if self.backups is not None:
                self.backups.before_evict(int(short.sum()))
            allocator.free(self.tree.evict(short))
            pages = allocator.alloc(first, count)
        return pages

    def release(self, run: Running) -> None:
        """A request is done: free the duplicates it kept (and, after a collision, every page
        past what the tree holds) and unlock what it read."""
        own = run.duplicates
        if run.collided:
            own = [*own, run.pages[page_span(run.inserted_len, self.config.page_size) :]]
        if own:
            self.allocator.free(np.unique(np.concatenate(own)))
        self.tree.unlock(run.node)

    def forget(self, rid: int) -> None:
        """Drop what the cache kept for request ``rid`` (it finished or failed)."""
        self._hashes.pop(rid, None)
        self._l3_tokens.pop(rid, None)

    # -- the forward: backups before it, per-layer hooks during it -------------------------------

    def reserve_backups(self, chosen: Sequence[tuple[Running, int]]) -> None:
        """Reserve host pages for the full pages each chosen chunk completes (write-through)."""
        self._reservations.clear()
        if self.backups is None:
            return
        P = self.config.page_size
        for run, extend in chosen:
            if run.collided:
                continue
            first, last = run.inserted_len // P, page_span(insertable_len(run, extend, P), P)
            if last > first:
                res = self.backups.reserve_chunk(run.node, first, run.pages[first:last])
                if res is not None:
                    self._reservations[run.rid] = res

    @property
    def hooks(self) -> CacheHierarchy | None:
        """What the model calls around each layer (None when nothing is copied)."""
        return self if self.transfer is not None else None

    def before_layer(self, layer: int) -> None:
        if self.loads is not None:
            self.loads.before_layer(layer)

    def after_layer(self, layer: int) -> None:
        if self.backups is not None:
            self.backups.after_layer(layer)

    def end_forward(self) -> None:
        """Every layer's copies are submitted; on CUDA, the step's work is done."""
        if self.backups is not None:
            self.backups.end_forward()
        if self.loads is not None:
            self.loads.end_forward()
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)

    def moved(self) -> Moved:
        """Bytes submitted host -> device and device -> host, the measured load-back wait, and
        the disk's pages read (verified or not) and made durable, in bytes, so far (what the
        clock charges a step by)."""
        if self.transfer is None or self.loads is None:
            return Moved(0, 0, 0.0)
        stats = self.transfer.stats()
        read = written = 0
        if self.disk is not None:
            d, page = self.disk.stats, self.layout.page_bytes(self.config.page_size)
            read, written = (d.reloaded_pages + d.reload_misses) * page, d.spilled_pages * page
        return Moved(
            stats.h2d_submitted_bytes, stats.d2h_submitted_bytes, self.loads.stats.wait_s,
            read, written,
        )  # fmt: skip

    def step_work(self, before: Moved, chunks: Sequence[tuple[int, int]]) -> StepWork:
        """What a step did since ``before`` (:meth:`moved`), computing ``chunks``
        (``(prefix, extend)`` per request), for the clock to charge."""
        after = self.moved()
        return StepWork(
            computed_tokens=sum(e for _, e in chunks),
            h2d_bytes=after.h2d_bytes - before.h2d_bytes,
            d2h_bytes=after.d2h_bytes - before.d2h_bytes,
            load_wait_s=after.load_wait_s - before.load_wait_s,
            requests=len(chunks),
            attention_pairs=sum(e * (p + e / 2) for p, e in chunks),
            prefix_tokens=sum(p for p, _ in chunks),
            prefix_pairs=sum(e * (p + e / 2) for p, e in chunks if p),
            disk_read_bytes=after.disk_read_bytes - before.disk_read_bytes,
            disk_write_bytes=after.disk_write_bytes - before.disk_write_bytes,
        )

    # -- insert ----------------------------------------------------------------------------------

    def insert_chunk(self, run: Running) -> None:
        """Insert what ``run`` has computed in whole pages (all of it once complete), move its
        lock to the node that now ends it, and attach this step's backup (and, with a disk,
        queue the backed-up pages' spill for when the backup commits)."""
        P = self.config.page_size
        upto = insertable_len(run, 0, P)
        if upto <= run.inserted_len or run.collided:
            return
        key = run.key.prefix(upto)
        span = page_span(upto, P)
        # The tree has held the first inserted_len tokens, locked, since this request matched or
        # inserted them: only this chunk's tokens need comparing, below the node that ends them
        # (after a key collision the node may end elsewhere: the walk then starts at the root).
        below = run.node if run.node.end == run.inserted_len else None
        result = self.tree.insert(key, run.pages[:span], run.inserted_len, run.inserted_len, below)
        run.pages[:span] = result.pages  # the tree's own pages where it had them
        if result.free_pages.size:
            still_read = np.isin(result.free_pages, result.pages)
            self.allocator.free(result.free_pages[~still_read])
            if still_read.any():
                run.duplicates.append(result.free_pages[still_read])
        if result.node is not run.node:
            self.tree.lock(result.node)
            self.tree.unlock(run.node)
            run.node = result.node
        res = self._reservations.pop(run.rid, None)
        if res is not None:
            assert self.backups is not None
            if self.backups.attach(res, result.node) and self.disk is not None:
                full = min(res.host_pages.size, upto // P - res.first_page)  # no valid tail
                hashes = self.page_hashes(run.rid, run.key)
                self._spill_after.setdefault(res.ticket, []).append(
                    _Spill(
                        result.node,
                        hashes[res.first_page : res.first_page + full],
                        res.host_pages[:full],
                    )
                )
        if result.node.end < upto:
            # A key collision: the tree holds other tokens under this request's next page key
            # and kept none of its pages from there (they are in duplicates); a later chunk
            # would collide again, so its inserts stop here and release frees the rest.
            run.collided = True
            upto = result.node.end
        run.inserted_len = upto

    # -- copies: progress and the frontier -------------------------------------------------------

    def _drain(self) -> None:
        """Route landed copies to load-back (which stops waiting for them) and to the ledger
        (this rank's progress)."""
        if self.transfer is None:
            return
        if self.disk is not None:
            self.disk.poll()
        landed = self.transfer.poll()
        if self.loads is not None:
            for done in landed:
                self.loads.note_landed(done.ticket, done.ok)
        if self.report_delay is not None:
            landed = self.report_delay(landed)
        for done in landed:
            self.ledger.finish(done.ticket, done.ok, done.error)

    def settle(self, agree: tuple[int, ...] = ()) -> Settled:
        """Apply every ticket the commit frontier covers, in issue order. ``agree`` are this
        rank's numbers for the pending disk lookups; the frontier's collective returns their
        MIN over ranks."""
        if self.transfer is None:
            return Settled((), agree)
        if self.disk is not None:  # the fixed point: the disk's work of the last step is done
            self.disk_wait_s += self.disk.wait_in_flight(self.disk.store.io_timeout_s)
        self._drain()
        progress = replace(self.ledger.progress(), agree=agree)
        frontier = self.frontier(progress)
        reloads: list[int] = []
        spills: list[SpillItem] = []  # every backup this settle commits: one spill, in order
        for ticket, kind, ok in self.ledger.advance(frontier):
            if kind is TicketKind.BACKUP:
                assert self.backups is not None
                self.backups.settle(ticket, ok)
                for s in self._spill_after.pop(ticket, []):
                    if ok:
                        spills.append(
                            SpillItem(s.node, s.hashes, s.host_pages, s.node.hit_count + 1)
                        )
            elif kind is TicketKind.LOAD:
                assert self.loads is not None
                self.loads.settle(ticket, ok)
            elif kind is TicketKind.SPILL:
                assert self.disk is not None
                self.disk.settle_spill(ticket)
            else:
                assert self.disk is not None
                brought = self.disk.settle_reload(ticket, ok)
                if brought is not None:
                    self._l3_tokens[brought[0]] = brought[1]
                reloads.append(ticket)
        if spills:
            assert self.disk is not None
            self.disk.spill(spills)
        agreed = frontier.agree if len(frontier.agree) == len(agree) else agree
        return Settled(tuple(reloads), agreed)

    def transfer_stats(self) -> TransferStats | None:
        return self.transfer.stats() if self.transfer is not None else None

    def synchronize(self, timeout_s: float) -> None:
        """Wait (bounded) for every copy and disk write in flight to land (then :meth:`settle`)."""
        if self.transfer is not None:
            self.transfer.synchronize(timeout_s)
            if self.disk is not None:
                self.disk.store.flush(timeout_s)

    def close(self) -> None:
        """Release what outlives a replay: the disk tier's threads, files and lock."""
        if self.disk is not None:
            self.disk.close()

    # -- invariants ------------------------------------------------------------------------------

    def check(self, running: Sequence[Running]) -> None:
        """Tree, allocator and ledger invariants, and conservation across the tiers: every device
        page free, cached or held by a running request; every host page free, cached, reserved or
        held by a copy in flight; one lock per running request, host locks only by their holders."""
        self.tree.check()
        self.allocator.check()
        self.ledger.check()
        held = sum(int((~self.tree.holds(r.own_pages())).sum()) for r in running)
        if self.allocator.num_used != self.tree.num_pages + held:
            raise AssertionError(
                f"device pages used {self.allocator.num_used} != tree {self.tree.num_pages} + "
                f"running {held}"
            )
        nodes = self.tree.nodes()
        locks = self.tree.root.lock_ref + sum(n.lock_ref for n in nodes)
        if locks != len(running):
            raise AssertionError(f"{locks} node locks held for {len(running)} running requests")
        if self.host_allocator is not None and self.backups is not None:
            self.host_allocator.check()
            extra = self.backups.held_pages + (self.disk.held_pages if self.disk else 0)
            if self.host_allocator.num_used != self.tree.num_host_pages + extra:
                raise AssertionError(
                    f"host pages used {self.host_allocator.num_used} != tree "
                    f"{self.tree.num_host_pages} + reserved/orphaned {extra}"
                )
            host_locks = sum(n.host_ref for n in nodes)
            expected = (
                (self.loads.host_locks if self.loads else 0)
                + len(self._reservations)
                + (self.disk.host_locks if self.disk else 0)
            )
            if host_locks > expected:
                raise AssertionError(f"{host_locks} host locks for {expected} holders")
        if self.host_pool is not None:
            self.host_pool.check()
        if self.disk is not None and isinstance(self.disk.store, RemoteBehindDisk):
            self.disk.store.check()

    def digests(self) -> dict[str, str]:
        """The replicated state every rank must hold alike."""
        return {
            "device allocator": self.allocator.digest(),
            "tree": self.tree.digest(),
            "host allocator": self.host_allocator.digest() if self.host_allocator else "",
        }


def _open_remote(config: EngineConfig, namespace: Namespace, rank: int) -> RemoteStore:
    from ..tiers.remote.store import RemoteStore  # the remote extra (redis-py)

    assert config.remote_url is not None
    remote = RemoteConfig(
        config.remote_url,
        budget_bytes=int(config.remote_gib * GIB),
        timeout_s=config.remote_timeout_ms / 1e3,
        min_hits=config.remote_min_hits,
        threads=config.remote_connections,
        publish_window=config.remote_publish_window,
        password=config.remote_password,
        # As for the disk: one publish per step, and per reload (at most a step's admissions,
        # all finished at the fixed point) a fetch past the disk's pages and a retry of those
        # the disk failed: never refused for queueing.
        max_tickets=max(64, 2 * config.max_batch_requests + 2),
    )
    return RemoteStore(namespace, rank, remote)


class Settled(NamedTuple):
    """What one :meth:`CacheHierarchy.settle` applied that the scheduler needs to know."""

    reloads: tuple[int, ...]  # reload tickets applied, in issue order
    agreed: tuple[int, ...]  # the MIN over ranks of each pending disk lookup's count
