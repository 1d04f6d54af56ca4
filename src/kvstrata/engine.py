"""The step-based prefill engine: the cache's reason to exist.

Per request::

    match_prefix (device part + host part) ──▶ lock ──▶ alloc device pages for the host part and
    the uncached suffix (evict if short) ──▶ load the host part back, layer by layer
        ──▶ compute the suffix in chunks over several steps; after each chunk insert its full
            pages (write-through copies them to the host as each layer finishes)
        ──▶ free duplicates ──▶ unlock

Each :meth:`Engine.step` first settles finished copies at the commit frontier, admits waiting
requests in arrival order, then packs one chunk of every running request into a single forward
without padding. A request always recomputes at least its last token (a prefill needs its
logits), so a full hit is trimmed to the page boundary before it. A request that cannot fit even
in an empty pool fails alone with a :class:`RequestError`; one that only has to wait for running
requests (or pending backups) to release pages stays queued.

Admission defers a request whose first uncached page is being computed right now by a running
request (same prefix key): it would compute the same KV twice. Chunks are inserted as they finish,
so it waits for the chunk it needs, not the whole prefill. This reads only replicated inputs
(arrival order, prefix keys), so every rank defers identically.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from .cache.allocator import PageAllocator
from .cache.keys import TokenKey
from .cache.radix import Node, RadixTree
from .clock import Clock, StepWork, WallClock
from .config import (
    DEFAULT_HOST_LAYOUT,
    HOST_LAYOUTS,
    WRITE_POLICIES,
    CacheConfig,
    HostLayout,
    PoolConfig,
)
from .dist.attention import attention_bytes, check_strategy
from .dist.cp_batch import build_cp_batch
from .dist.frontier import group_frontier
from .dist.group import Group, SoloGroup
from .errors import ConfigError, DivergenceError, RequestError
from .handoff import Handoff, export_handoff, layout_fingerprint
from .model.batch import ForwardBatch
from .model.compute import Compute, PairCompute
from .ownership import owners, page_span
from .residency import Tier
from .tiers.disk_config import DiskConfig
from .tiers.disk_store import DiskStore
from .tiers.host_pool import HostPool
from .tiers.loadback import LoadBack
from .tiers.page_hash import Namespace, page_hashes
from .tiers.pool import DevicePool
from .tiers.spill import DiskTier
from .tiers.tickets import FrontierFn, TicketKind, TicketLedger, local_frontier
from .tiers.transfer import Completion, Transfer, TransferStats
from .tiers.writethrough import Reservation, WriteThrough
from .workloads import Request

IntArray = npt.NDArray[np.int64]
GIB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes. ``pool_tokens`` is the L1 device pool, in tokens (whole pages); the L2 host
    pool is ``l2_tokens`` tokens or ``l2_gib`` GiB (at most one of them; neither: no L2)."""

    page_size: int = 16
    pool_tokens: int = 262_144
    chunk_size: int = 2_048
    max_batch_tokens: int = 8_192
    max_batch_requests: int = 64
    eviction: str = "lru"
    device: str = "cpu"
    check_every_step: bool = False
    l2_tokens: int = 0
    l2_gib: float = 0.0
    host_layout: HostLayout = DEFAULT_HOST_LAYOUT
    write_policy: str = "write_through"
    write_through_hits: int = 2
    max_host_alloc_gib: float = 480.0
    l3_dir: str | None = None  # the disk tier's directory (needs an L2: it spills host pages)
    l3_gib: float = 0.0  # disk bytes this rank's slabs take
    l3_start: str = "clear"  # "clear" (start empty) or "load" (keep what the directory holds)
    l3_min_hits: int = 1  # spill only pages used at least this often
    cp_attention: str = "auto"  # under CP: move_kv, move_queries, or auto (cheaper per step)
    check_digests: bool = False  # under CP: compare replicated digests across ranks every step

    def __post_init__(self) -> None:
        CacheConfig(page_size=self.page_size, eviction=self.eviction)  # validates both
        for name in ("pool_tokens", "chunk_size", "max_batch_tokens", "max_batch_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ConfigError(
                f"device {self.device!r} is not a torch device; use cpu or cuda"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device {self.device!r} asked for, but this machine has no CUDA device"
            )
        if self.pool_tokens < self.page_size:
            raise ConfigError(
                f"pool_tokens ({self.pool_tokens}) must hold at least one page of {self.page_size} tokens"
            )
        if not isinstance(self.l2_tokens, int) or self.l2_tokens < 0:
            raise ConfigError(f"--l2-tokens must be an integer >= 0, got {self.l2_tokens!r}")
        if not 0 <= self.l2_gib <= 2**20:
            raise ConfigError(
                f"--l2-gib must be a number in [0, 1048576] (1 PiB), got {self.l2_gib!r}"
            )
        if self.l2_tokens and self.l2_gib:
            raise ConfigError("give the L2 size once: --l2-tokens or --l2-gib, not both")
        if 0 < self.l2_tokens < self.page_size:
            raise ConfigError(
                f"--l2-tokens ({self.l2_tokens}) must hold at least one page of {self.page_size}"
            )
        if self.host_layout not in HOST_LAYOUTS:
            raise ConfigError(
                f"--host-layout must be one of {', '.join(HOST_LAYOUTS)}, got {self.host_layout!r}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"--write-policy must be one of {', '.join(WRITE_POLICIES)}, "
                f"got {self.write_policy!r}"
            )
        if not isinstance(self.write_through_hits, int) or self.write_through_hits < 1:
            raise ConfigError(
                f"--write-through-hits must be an integer >= 1, got {self.write_through_hits!r}"
            )
        check_strategy(self.cp_attention)
        if self.l3_dir is not None:
            if not self.has_l2:
                raise ConfigError(
                    "the disk tier (--l3-dir) spills host pages: give an L2 too (--l2-tokens)"
                )
            if not 0 < self.l3_gib <= 2**20:
                raise ConfigError(f"--l3-gib must lie in (0, 1048576], got {self.l3_gib!r}")
            if self.l3_start not in ("clear", "load"):
                raise ConfigError(f"--l3-start must be clear or load, got {self.l3_start!r}")
            if not isinstance(self.l3_min_hits, int) or self.l3_min_hits < 0:
                raise ConfigError(f"--l3-min-hits must be >= 0, got {self.l3_min_hits!r}")
            if self.write_policy != "write_through":
                raise ConfigError(
                    f"the disk tier spills the pages each write-through backup commits; with "
                    f"--write-policy {self.write_policy} nothing would reach the disk: use "
                    "--write-policy write_through with --l3-dir"
                )
        if not 0 < self.max_host_alloc_gib <= 2**20:
            raise ConfigError(
                f"the per-allocation cap must be > 0 GiB, got {self.max_host_alloc_gib!r}"
            )

    @property
    def pool_pages(self) -> int:
        return self.pool_tokens // self.page_size

    @property
    def has_l2(self) -> bool:
        return bool(self.l2_tokens or self.l2_gib)


@dataclass
class Finished:
    """The outcome of one request."""

    rid: int
    prompt_len: int
    cached_len: int  # tokens served from the cache (both tiers)
    logits: torch.Tensor | None  # last-token logits on the CPU (None without a model or on error)
    ttft_s: float  # clock time from its arrival to its last-token logits
    error: str | None = None
    payload: torch.Tensor | None = None  # the sequence's cached payload rows, when kept (no model)
    all_logits: torch.Tensor | None = None  # logits of every computed token, when asked for
    host_len: int = 0  # of cached_len, tokens loaded back from the host tier (L2)
    queue_s: float = 0.0  # of ttft_s, from its arrival to the step it entered
    load_wait_s: float = 0.0  # of ttft_s, steps it ran in spent waiting for load-back copies
    draft_logits: torch.Tensor | None = None  # the speculative draft's last-token logits, if any
    handoff: Handoff | None = None  # this rank's part of its KV, when asked for (keep_handoff)

    @property
    def computed_len(self) -> int:
        return 0 if self.error else self.prompt_len - self.cached_len


class _Lookup(NamedTuple):
    waiting: _Waiting
    first: int  # the first sequence page the tree missed when it looked
    found: int  # pages from there this rank's disk can serve (before the ranks' MIN)
    parent: Node  # where the tree's match ended
    first_hash: bytes  # the content address of page ``first``
    followers: list[_Waiting]  # requests that missed the same pages since: they share the read


class _Waiting(NamedTuple):
    request: Request
    key: TokenKey  # hashed once, when the request is added
    arrived_at: float


@dataclass
class _Running:
    request: Request
    key: TokenKey
    node: Node  # locked while the request runs: the end of what the tree holds of it
    pages: IntArray  # one logical page per page of the whole sequence
    cached_len: int
    host_len: int  # of cached_len, loaded back from L2
    done_len: int
    inserted_len: int  # tokens of it the tree holds (matched or inserted chunk by chunk)
    arrived_at: float
    entered_at: float
    load_wait_at_entry: float  # the engine's load-back wait total when it entered
    keep_logits: bool
    keep_all_logits: bool
    # Pages the tree did not keep that it still reads (only after a key collision): freed at
    # the end. Ordinary duplicates are swapped for the tree's pages and freed at once.
    duplicates: list[IntArray] = field(default_factory=list)
    logits: torch.Tensor | None = field(default=None)
    logit_chunks: list[torch.Tensor] = field(default_factory=list)

    def own_pages(self) -> IntArray:
        """Every device page it references (its page table and the duplicates it keeps)."""
        return np.unique(np.concatenate([self.pages, *self.duplicates]))


class Engine:
    """Prefill engine over one device pool (and an optional host pool), one radix tree and one
    page allocator per tier (one rank). ``frontier`` turns this rank's copy progress into the
    commit frontier; context parallelism plugs its MIN all-reduce in there. ``clock`` stamps
    arrivals, admissions and first tokens (the wall clock unless a simulated one is given); it
    never takes part in a decision."""

    def __init__(
        self,
        compute: Compute,
        config: EngineConfig,
        frontier: FrontierFn | None = None,
        group: Group | None = None,
        clock: Clock | None = None,
        model_id: str = "model",
    ) -> None:
        self.compute = compute
        self.config = config
        self.group: Group = group or SoloGroup()
        self.cp = cp = self.group.size
        self.rank = self.group.rank
        self.frontier = frontier or (group_frontier(self.group) if cp > 1 else local_frontier)
        self.clock: Clock = clock if clock is not None else WallClock()
        P = config.page_size
        layout = compute.layout
        # Sizes are per rank: each rank's pools hold its own lane of a cp-times larger page space.
        self.pool = DevicePool(layout, P, config.pool_pages, config.device)
        self.allocator = PageAllocator(PoolConfig(num_pages=config.pool_pages * cp, cp_size=cp))
        self.host_pool: HostPool | None = None
        self.host_allocator: PageAllocator | None = None
        self.transfer: Transfer | None = None
        host_pages = 0
        if config.has_l2:
            host_pages = (
                config.l2_tokens // P
                if config.l2_tokens
                else HostPool.slots_for_bytes(layout, P, int(config.l2_gib * GIB))
            )
            if host_pages < 1:
                raise ConfigError(
                    f"--l2-gib {config.l2_gib} holds no page of {layout.page_bytes(P)} bytes"
                )
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
                rank=self.rank,
            )
            self.loads = LoadBack(
                self.tree, self.transfer, self.ledger, layout.num_layers, self._drain, self.rank
            )
        self.disk: DiskTier | None = None
        self.namespace: Namespace | None = None
        if config.l3_dir is not None:
            assert self.host_pool is not None and self.host_allocator is not None
            self.namespace = Namespace.for_layout(model_id, layout, P, cp)
            store = DiskStore(
                self.namespace,
                self.rank,
                DiskConfig(
                    root=Path(config.l3_dir),
                    budget_bytes=int(config.l3_gib * GIB),
                    start=config.l3_start,  # type: ignore[arg-type]
                    min_hits=config.l3_min_hits,
                ),
            )
            self.disk = DiskTier(
                self.tree, self.host_allocator, self.host_pool, store, self.ledger, self.rank
            )
        self._hashes: dict[int, list[bytes]] = {}  # rid -> its full pages' content addresses
        # reload ticket -> the requests waiting for it: the one that asked, then any that missed
        # the same pages meanwhile (they share the read instead of reading again)
        self._parked: dict[int, list[_Waiting]] = {}
        # Under CP: requests whose disk lookup waits for the ranks' MIN (the next frontier).
        self._lookups: list[_Lookup] = []
        self._reload_tried: set[int] = set()
        self._l3_tokens: dict[int, int] = {}  # rid -> tokens a reload brought it
        self._spill_after: dict[int, list[tuple[Node, list[bytes], IntArray]]] = {}
        self.waiting: deque[_Waiting] = deque()
        self._refused: list[Finished] = []
        self.running: list[_Running] = []
        self.keep_logits: set[int] = set()  # request ids whose last-token logits are returned
        self.keep_all_logits: set[int] = set()  # ... whose logits for every computed token are
        self.keep_handoff: set[int] = set()  # ... whose KV this rank exports when they finish
        self.fingerprint = layout_fingerprint(model_id, layout, P)  # what a decoder must match
        self.has_draft = isinstance(compute, PairCompute)  # logits come as [..., 2, vocab]
        self._reservations: dict[int, Reservation] = {}  # id(run) -> this step's backup
        self.deferred = 0
        self.steps = 0
        self.peak_pages_used = 0
        self.hit_tokens = {Tier.L1: 0, Tier.L2: 0, Tier.L3: 0}
        self.load_wait_s = 0.0  # clock time steps spent waiting for load-back, in total
        self.strategy_steps: dict[str, int] = {}  # CP attention strategy -> steps that used it
        self.report_delay: Callable[[list[Completion]], list[Completion]] | None = None

    # -- public ----------------------------------------------------------------------------------

    def add(self, request: Request, arrived_at: float | None = None) -> None:
        """Queue a request that arrived at clock time ``arrived_at`` (default: now). One that can
        never run here is refused at once: the next :meth:`step` returns it with its error."""
        arrived = self.clock.now() if arrived_at is None else arrived_at
        error = self._refusal(request)
        if error is not None:
            self._refused.append(
                Finished(request.rid, request.tokens.size, 0, None, 0.0, str(error))
            )
            return
        self.waiting.append(_Waiting(request, self.tree.key(request.tokens), arrived))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._refused or self._parked or self._lookups)

    def close(self) -> None:
        """Release what outlives a replay: the disk tier's threads, files and lock."""
        if self.disk is not None:
            self.disk.close()

    def step(self) -> list[Finished]:
        """Settle finished copies, admit what fits, run one packed forward, insert what it
        computed, finish the requests it completed."""
        started = self.clock.now()
        before = self._moved()
        self._settle()
        finished = self._admit(started)
        if not self.running:
            return finished
        chosen: list[tuple[_Running, int]] = []
        budget = self.config.max_batch_tokens
        for run in self.running:
            if budget == 0:
                break
            extend = min(self.config.chunk_size, len(run.key) - run.done_len, budget)
            chosen.append((run, extend))
            budget -= extend
        self._reserve_backups(chosen)
        all_logits = any(run.keep_all_logits for run, _ in chosen)
        self.group.step = self.steps
        if self.cp > 1:
            if all_logits:
                raise ConfigError("all-token logits are not kept under context parallelism")
            logits = self._forward_cp(chosen)
        else:
            logits = self._forward(chosen, all_logits)
        if self.backups is not None:
            self.backups.end_forward()
        if self.loads is not None:
            self.loads.end_forward()
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        after = self._moved()
        self.load_wait_s += self.clock.charge(
            StepWork(
                computed_tokens=sum(extend for _, extend in chosen),
                h2d_bytes=after[0] - before[0],
                d2h_bytes=after[1] - before[1],
                load_wait_s=after[2] - before[2],
            )
        )
        now = self.clock.now()
        offset = 0
        for i, (run, extend) in enumerate(chosen):
            run.done_len += extend
            offset += extend
            if logits is not None and run.keep_all_logits:
                run.logit_chunks.append(logits[offset - extend : offset].float().cpu())
            self._insert_chunk(run)
            if run.done_len == len(run.key):
                if logits is not None and run.keep_logits:
                    run.logits = logits[offset - 1 if all_logits else i].float().cpu()
                finished.append(self._finish(run, now))
        self.running = [r for r in self.running if r.done_len < len(r.key)]
        self.steps += 1
        if self.config.check_every_step:
            self.check()
        if self.config.check_digests:
            self.check_digests()
        return finished

    def run(self, requests: Iterable[Request], check: bool = False) -> dict[int, Finished]:
        """Add ``requests``, step until nothing is left, drain the copies in flight; every
        outcome by request id (``check``: every invariant after each step and at the end)."""
        for r in requests:
            self.add(r)
        out: dict[int, Finished] = {}
        while self.has_work():
            for f in self.step():
                out[f.rid] = f
            if check:
                self.check()
        self.drain()
        if check:
            self.check()
        return out

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait (bounded) for every copy in flight and settle it at the frontier. Disk lookups
        still waiting for the ranks' agreement are given up (their requests wait again and will
        compute), so settling starts no new reload."""
        if self._lookups:
            self.waiting.extendleft(reversed([lk.waiting for lk in self._lookups]))
            self._lookups = []
        if self.transfer is not None:
            self.transfer.synchronize(timeout_s)
            if self.disk is not None:
                self.disk.store.flush(timeout_s)
            self._settle()

    def check(self) -> None:
        """Tree and allocator invariants; every page free, cached, held by a running request or
        by an in-flight backup; one lock per running request and one host lock per load."""
        self.tree.check()
        self.allocator.check()
        self.ledger.check()
        held = sum(int((~self.tree.holds(r.own_pages())).sum()) for r in self.running)
        for r in self.running:
            if not r.cached_len <= r.inserted_len <= r.done_len <= len(r.key):
                raise AssertionError(
                    f"request {r.request.rid}: cached {r.cached_len}, inserted "
                    f"{r.inserted_len}, done {r.done_len} of {len(r.key)} out of order"
                )
        if self.allocator.num_used != self.tree.num_pages + held:
            raise AssertionError(
                f"device pages used {self.allocator.num_used} != tree {self.tree.num_pages} + "
                f"running {held}"
            )
        held_back = [lk.waiting.request.rid for lk in self._lookups] + [
            w.request.rid for parked in self._parked.values() for w in parked
        ]
        elsewhere = {w.request.rid for w in self.waiting} | {r.request.rid for r in self.running}
        if len(set(held_back)) != len(held_back) or elsewhere.intersection(held_back):
            raise AssertionError(
                f"a request waits for the disk twice or also runs / waits: {sorted(held_back)}"
            )
        nodes = self.tree.nodes()
        locks = self.tree.root.lock_ref + sum(n.lock_ref for n in nodes)
        if locks != len(self.running):
            raise AssertionError(
                f"{locks} node locks held for {len(self.running)} running requests"
            )
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

    def transfer_stats(self) -> TransferStats | None:
        return self.transfer.stats() if self.transfer is not None else None

    def _moved(self) -> tuple[int, int, float]:
        """Bytes submitted host -> device and device -> host, and the measured load-back wait,
        so far (what the clock charges a step by)."""
        if self.transfer is None or self.loads is None:
            return 0, 0, 0.0
        stats = self.transfer.stats()
        return stats.h2d_submitted_bytes, stats.d2h_submitted_bytes, self.loads.stats.wait_s

    # -- copies: the frontier and the per-layer hooks --------------------------------------------

    def _drain(self) -> None:
        """Route landed copies to load-back (which stops waiting for them) and to the ledger
        (this rank's progress). ``report_delay``, a test hook, may hold completions back before
        they count as progress, as a slow rank would."""
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

    def _settle(self) -> None:
        """Apply every ticket the commit frontier covers, in issue order."""
        if self.transfer is None:
            return
        self._drain()
        lookups, self._lookups = self._lookups, []
        progress = replace(self.ledger.progress(), agree=tuple(lk.found for lk in lookups))
        frontier = self.frontier(progress)
        back: list[_Waiting] = []  # requests whose disk wait ended, in the order they waited
        for ticket, kind, ok in self.ledger.advance(frontier):
            if kind is TicketKind.BACKUP:
                assert self.backups is not None
                self.backups.settle(ticket, ok)
                for node, hashes, host_pages in self._spill_after.pop(ticket, []):
                    if ok and self.disk is not None:
                        self.disk.spill(node, hashes, host_pages, node.hit_count + 1)
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
                back += self._parked.pop(ticket)
        agreed = frontier.agree if len(frontier.agree) == len(lookups) else progress.agree
        for lk, n in zip(lookups, agreed, strict=True):
            if not self._reload_agreed(lk, n):
                back += [lk.waiting, *lk.followers]
        self.waiting.extendleft(reversed(back))

    def before_layer(self, layer: int) -> None:
        if self.loads is not None:
            self.loads.before_layer(layer)

    def after_layer(self, layer: int) -> None:
        if self.backups is not None:
            self.backups.after_layer(layer)

    def _reserve_backups(self, chosen: list[tuple[_Running, int]]) -> None:
        """Reserve host pages for the full pages each chosen chunk completes (write-through)."""
        self._reservations.clear()
        if self.backups is None:
            return
        P = self.config.page_size
        for run, extend in chosen:
            first, last = run.inserted_len // P, page_span(self._insertable(run, extend), P)
            if last > first:
                res = self.backups.reserve_chunk(run.node, first, run.pages[first:last])
                if res is not None:
                    self._reservations[id(run)] = res

    def _insertable(self, run: _Running, extend: int) -> int:
        """Tokens of ``run`` the tree can hold once ``extend`` more are computed: whole pages,
        or everything when the request completes."""
        done = run.done_len + extend
        return (
            done if done == len(run.key) else done // self.config.page_size * self.config.page_size
        )

    # -- admission -------------------------------------------------------------------------------

    def _admit(self, now: float) -> list[Finished]:
        failed, self._refused = self._refused, []
        cfg = self.config
        budget = cfg.max_batch_tokens - sum(
            min(cfg.chunk_size, len(r.key) - r.done_len) for r in self.running
        )
        passed: list[_Waiting] = []
        looked = self._looking()  # under CP a lookup takes the admission slot it would use
        while self.waiting and len(self.running) + looked < cfg.max_batch_requests and budget > 0:
            waiting = self.waiting.popleft()
            request, key, arrived_at = waiting
            if self._computing_now(key):
                passed.append(waiting)
                self.deferred += 1
                continue
            if self.disk is not None and self._start_reload(waiting):
                looked = self._looking()
                continue  # parked until the disk read lands; the others go on
            try:
                run = self._try_start(request, key, arrived_at, now)
            except RequestError as error:
                self._forget(request.rid)
                failed.append(
                    Finished(request.rid, len(key), 0, None, now - arrived_at, str(error))
                )
                continue
            if run is None:
                self.waiting.appendleft(waiting)
                break  # wait for running requests (or pending backups) to release pages
            self.running.append(run)
            budget -= min(cfg.chunk_size, len(key) - run.done_len)
        self.waiting.extendleft(reversed(passed))
        return failed

    def _looking(self) -> int:
        """Requests waiting for the ranks to agree on a disk lookup (followers included)."""
        return sum(1 + len(lk.followers) for lk in self._lookups)

    def _page_hashes(self, request: Request, key: TokenKey) -> list[bytes]:
        """The content addresses of ``request``'s full pages (computed once)."""
        hashes = self._hashes.get(request.rid)
        if hashes is None:
            assert self.namespace is not None
            full = key.num_full_pages * self.config.page_size
            hashes = self._hashes[request.rid] = page_hashes(self.namespace, key.tokens[:full])
        return hashes

    def _start_reload(self, waiting: _Waiting) -> bool:
        """Park ``waiting`` behind a reload of the pages the tree misses that the disk holds."""
        request, key = waiting.request, waiting.key
        if request.rid in self._reload_tried:
            return False
        self._reload_tried.add(request.rid)
        assert self.disk is not None
        limit = self._reusable_len(len(key))
        hit = self.tree.match_prefix(key, max_len=limit, record=False)
        if hit.valid_len >= limit:
            return False
        hashes = self._page_hashes(request, key)
        P = self.config.page_size
        first, last, parent = hit.valid_len // P, limit // P, hit.last_node
        if last <= first:
            return False
        # The same pages already on their way (same parent, same first page): wait for that read.
        # A follower may look again once that read lands: it may need pages past the first's.
        ticket = self.disk.pending_reload(parent, hashes[first])
        if ticket is not None:
            self._parked[ticket].append(waiting)
            self._reload_tried.discard(request.rid)
            return True
        if self.cp > 1:  # each rank knows its own pages: the next frontier agrees on the count
            for lk in self._lookups:
                if lk.parent is parent and lk.first_hash == hashes[first]:
                    lk.followers.append(waiting)
                    self._reload_tried.discard(request.rid)
                    return True
            if parent is not self.tree.root and not parent.on_host:
                return False  # nothing a reload could attach to: decided alike, no lookup
            found = self.disk.local_count(hashes, first, last)
            self._lookups.append(_Lookup(waiting, first, found, parent, hashes[first], []))
            return True
        ticket = self.disk.try_reload(key, hashes, hit.valid_len, limit, parent, request.rid)
        if ticket is None:
            return False
        self._parked[ticket] = [waiting]
        return True

    def _reload_agreed(self, lookup: _Lookup, count: int) -> bool:
        """Start the reload every rank agreed on (``count`` pages from ``lookup.first``, the MIN
        over ranks); False when there is nothing left to read (the request computes)."""
        assert self.disk is not None
        request, key = lookup.waiting.request, lookup.waiting.key
        limit = self._reusable_len(len(key))
        hit = self.tree.match_prefix(key, max_len=limit, record=False)  # it may have grown
        P = self.config.page_size
        now = hit.valid_len // P
        if now < lookup.first or hit.valid_len >= limit:  # shrank: pages no rank looked up
            return False
        count = lookup.first + count - now
        if count <= 0:
            return False
        ticket = self.disk.try_reload(
            key, self._page_hashes(request, key), hit.valid_len, limit, hit.last_node,
            request.rid, count,
        )  # fmt: skip
        if ticket is None:
            return False
        self._parked[ticket] = [lookup.waiting, *lookup.followers]
        return True

    def _refusal(self, request: Request) -> RequestError | None:
        """Why ``request`` can never run on this engine, or None."""
        n, cfg = request.tokens.size, self.config
        if n > self.compute.max_seq_len:
            return RequestError(
                f"request {request.rid}: {n} tokens exceed the model's {self.compute.max_seq_len} "
                "positions (max_position_embeddings)"
            )
        per_rank = -(-page_span(n, cfg.page_size) // self.cp)  # the busiest lane's pages
        if per_rank > cfg.pool_pages:
            return RequestError(
                f"request {request.rid}: {n} tokens need {per_rank} pages of {cfg.page_size} on "
                f"one rank, its device pool has {cfg.pool_pages}; raise the pool size"
            )
        if int(request.tokens.max()) >= self.compute.vocab_size:
            return RequestError(
                f"request {request.rid}: token id {int(request.tokens.max())} is outside the "
                f"model's vocabulary of {self.compute.vocab_size}"
            )
        return None

    def _computing_now(self, key: TokenKey) -> bool:
        """Whether a running request is computing the first page ``key`` would compute and
        could reuse (not the page of its own last token, which it recomputes anyway).

        Page keys are prefix-closed and fold in the length, so a running request computes that
        page exactly when its key at the same position is equal and it has not inserted the
        page yet: one comparison per running request, and nothing to update as chunks finish.
        """
        if not self.running:
            return False
        P = self.config.page_size
        m = min(self.tree.match_length(key), self._reusable_len(len(key))) // P
        if m >= (len(key) - 1) // P:
            return False
        k = key.page_keys.item(m)
        return any(
            r.inserted_len // P <= m < r.key.num_full_pages and r.key.page_keys.item(m) == k
            for r in self.running
        )

    def _reusable_len(self, n: int) -> int:
        """The longest cached prefix a request of ``n`` tokens may use: whole pages, and never
        its last token (a prefill needs that token's logits)."""
        return (n - 1) // self.config.page_size * self.config.page_size

    def _try_start(
        self, request: Request, key: TokenKey, arrived_at: float, now: float
    ) -> _Running | None:
        P = self.config.page_size
        tree, allocator = self.tree, self.allocator
        n = len(key)
        # Not recorded yet: a request that has to wait would count a hit on every retry.
        hit = tree.match_prefix(key, max_len=self._reusable_len(n), record=False)
        host_part = hit.valid_len > hit.device_len
        tree.lock(hit.device_node)
        if host_part:
            tree.host_lock(hit.last_node)
        first = hit.device_len // P
        need = page_span(n, P) - first
        new_pages = self._alloc_evicting(first, need)
        if new_pages is None:
            tree.unlock(hit.device_node)
            if host_part:
                tree.host_unlock(hit.last_node)
            if not self.running and not self.ledger.in_flight(TicketKind.BACKUP):
                raise RequestError(  # nothing will release pages: _refusal should have caught it
                    f"request {request.rid}: {need} pages do not fit even after eviction "
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
        from_disk = min(self._l3_tokens.pop(request.rid, 0), host_len)
        self.hit_tokens[Tier.L1] += cached_len - host_len
        self.hit_tokens[Tier.L2] += host_len - from_disk
        self.hit_tokens[Tier.L3] += from_disk
        if self.disk is not None:
            self.disk.stats.hit_tokens += from_disk
        self.peak_pages_used = max(self.peak_pages_used, allocator.num_used)
        pages = np.concatenate((hit.device_pages, new_pages))
        return _Running(
            request=request,
            key=key,
            node=node,
            pages=pages,
            cached_len=cached_len,
            host_len=host_len,
            done_len=cached_len,
            inserted_len=cached_len,
            arrived_at=arrived_at,
            entered_at=now,
            load_wait_at_entry=self.load_wait_s,
            keep_logits=request.rid in self.keep_logits,
            keep_all_logits=request.rid in self.keep_all_logits,
        )

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

    # -- forward, insert and finish --------------------------------------------------------------

    def _forward(self, chosen: list[tuple[_Running, int]], all_logits: bool) -> torch.Tensor | None:
        # Tokens, page tables and lengths reach the device in one copy (ForwardBatch.build).
        ids = np.concatenate(
            [run.key.tokens[run.done_len : run.done_len + extend] for run, extend in chosen]
        )
        batch = ForwardBatch.build(
            prefix_lens=[run.done_len for run, _ in chosen],
            extend_lens=[extend for _, extend in chosen],
            page_tables=[run.pages for run, _ in chosen],
            page_size=self.config.page_size,
            device=self.pool.device,
            input_ids=ids.astype(np.int64),
        )
        assert batch.input_ids is not None
        hooks = self if self.transfer is not None else None
        return self.compute.forward(batch.input_ids, batch, self.pool, all_logits, hooks)

    def _forward_cp(self, chosen: list[tuple[_Running, int]]) -> torch.Tensor | None:
        """This rank's share of the step: the tokens of the pages it owns, the rest exchanged."""
        prefix = [run.done_len for run, _ in chosen]
        extend = [e for _, e in chosen]
        strategy = self.config.cp_attention
        if strategy == "auto":
            cost = attention_bytes(prefix, extend, self.compute.exchange)
            strategy = min(cost, key=lambda name: cost[name])
        self.strategy_steps[strategy] = self.strategy_steps.get(strategy, 0) + 1
        batch, input_ids = build_cp_batch(
            prefix,
            extend,
            [run.pages for run, _ in chosen],
            [run.key.tokens[run.done_len : run.done_len + e] for run, e in chosen],
            self.config.page_size,
            self.group,
            strategy,
            any(run.keep_logits for run, _ in chosen),
            self.pool.device,
        )
        hooks = self if self.transfer is not None else None
        return self.compute.forward(input_ids, batch, self.pool, False, hooks)

    def _insert_chunk(self, run: _Running) -> None:
        """Insert what ``run`` has computed in whole pages (all of it once complete), move its
        lock to the node that now ends it, and attach this step's backup."""
        P = self.config.page_size
        upto = self._insertable(run, 0)
        if upto <= run.inserted_len:
            return
        key = run.key.prefix(upto)
        span = page_span(upto, P)
        # The tree has held the first inserted_len tokens, locked, since this request matched or
        # inserted them: only this chunk's tokens need comparing.
        result = self.tree.insert(key, run.pages[:span], run.inserted_len, run.inserted_len)
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
        res = self._reservations.pop(id(run), None)
        if res is not None:
            assert self.backups is not None
            if self.backups.attach(res, result.node) and self.disk is not None:
                full = min(res.host_pages.size, upto // P - res.first_page)  # no valid tail
                hashes = self._page_hashes(run.request, run.key)
                self._spill_after.setdefault(res.ticket, []).append(
                    (
                        result.node,
                        hashes[res.first_page : res.first_page + full],
                        res.host_pages[:full],
                    )
                )
        run.inserted_len = upto

    def _snapshot(self, run: _Running) -> torch.Tensor | None:
        """The sequence's cached payload (synthetic compute only), gathered from its owners."""
        n, cp = len(run.key), self.cp
        payload = self.compute.snapshot(self.pool, run.pages // cp, n)
        if payload is None or cp == 1:
            return payload
        owner = (torch.arange(n) // self.config.page_size) % cp
        payload[owner != self.rank] = 0  # rows read from slots this rank does not own
        self.group.all_reduce(payload, "sum", "verify")
        return payload

    def check_digests(self) -> None:
        """Compare every replicated digest across ranks; raise naming the first that differs."""
        mine = {
            "device allocator": self.allocator.digest(),
            "tree": self.tree.digest(),
            "host allocator": self.host_allocator.digest() if self.host_allocator else "",
            "waiting requests": str([w.request.rid for w in self.waiting]),
            "running requests": str([(r.request.rid, r.done_len) for r in self.running]),
        }
        every = self.group.all_gather_object(mine, "digests")
        for name, value in mine.items():
            differ = [rank for rank, d in enumerate(every) if d[name] != value]
            if differ:
                raise DivergenceError(
                    f"after engine step {self.steps}: the {name} of rank {self.rank} differs "
                    f"from rank(s) {differ} ({value[:16]} vs {every[differ[0]][name][:16]})"
                )

    def _forget(self, rid: int) -> None:
        """Drop what the engine kept for request ``rid`` (it finished or failed)."""
        self._hashes.pop(rid, None)
        self._reload_tried.discard(rid)
        self._l3_tokens.pop(rid, None)
        self.keep_handoff.discard(rid)

    def _finish(self, run: _Running, now: float) -> Finished:
        payload = self._snapshot(run) if run.keep_logits else None
        handoff = None
        if run.request.rid in self.keep_handoff:
            handoff = export_handoff(
                self.pool, run.request.rid, run.pages, len(run.key), self.rank, self.cp,
                self.fingerprint,
            )  # fmt: skip
        self._forget(run.request.rid)
        logits, draft_logits = _split_draft(run.logits, self.has_draft)
        all_logits = torch.cat(run.logit_chunks) if run.logit_chunks else None
        if run.duplicates:
            self.allocator.free(np.unique(np.concatenate(run.duplicates)))
        self.tree.unlock(run.node)
        return Finished(
            rid=run.request.rid,
            prompt_len=len(run.key),
            cached_len=run.cached_len,
            logits=logits,
            ttft_s=now - run.arrived_at,
            payload=payload,
            all_logits=_split_draft(all_logits, self.has_draft)[0],
            host_len=run.host_len,
            queue_s=run.entered_at - run.arrived_at,
            load_wait_s=self.load_wait_s - run.load_wait_at_entry,
            draft_logits=draft_logits,
            handoff=handoff,
        )


def _split_draft(
    logits: torch.Tensor | None, has_draft: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Target and draft logits of a :class:`~kvstrata.model.compute.PairCompute` (``[..., 2, V]``);
    a single model's pass through with no draft."""
    if logits is None or not has_draft:
        return logits, None
    return logits[..., 0, :], logits[..., 1, :]
