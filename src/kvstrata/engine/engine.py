"""The step-based prefill engine: queues, admission, chunking, the forward and outcomes.

Per request::

    claim the cached prefix (device part + host part, locked; device pages for the rest, evicting
    if short; the host part loading back layer by layer) ──▶ compute the rest in chunks over
    several steps; after each chunk insert its full pages (write-through copies them to the host
    as each layer finishes) ──▶ release (free duplicates, unlock)

Every tree and tier call goes through the :class:`~kvstrata.engine.hierarchy.CacheHierarchy`;
requests parked behind a disk read live in :class:`~kvstrata.engine.disk_wait.DiskWaits`. One
:meth:`Engine.step` reads::

    settle ─▶ admit ─▶ reserve ─▶ forward ─▶ end the forward ─▶ charge the clock ─▶ insert ─▶ finish

It settles the copies the commit frontier covers, admits waiting requests in arrival order, then
packs one chunk of every running request into a single forward without padding. A request
always recomputes at least its last token (a prefill needs its logits), so a full hit is trimmed
to the page boundary before it. A request that cannot fit even in an empty pool fails alone with
a :class:`RequestError`; one that only has to wait for running requests (or pending backups) to
release pages stays queued.

Admission defers a request whose first uncached page is being computed right now by a running
request (same prefix key): it would compute the same KV twice. Chunks are inserted as they finish,
so it waits for the chunk it needs, not the whole prefill. This reads only replicated inputs
(arrival order, prefix keys), so every rank defers identically.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np
import torch

from ..cache.keys import TokenKey
from ..clock import Clock, StepWork, WallClock
from ..dist.attention import attention_bytes
from ..dist.cp_batch import build_cp_batch
from ..dist.frontier import group_frontier
from ..dist.group import Group, SoloGroup
from ..errors import ConfigError, DivergenceError, RequestError
from ..handoff import export_handoff, layout_fingerprint
from ..model.batch import ForwardBatch
from ..model.compute import Compute, PairCompute
from ..ownership import page_span
from ..residency import Tier
from ..workloads import Request
from .config import EngineConfig
from .disk_wait import DiskWaits, Park
from .hierarchy import CacheHierarchy, FrontierFn
from .request import Finished, Running, Waiting, reusable_len, split_draft


class Engine:
    """Prefill engine over one rank's cache hierarchy (an L1 device pool, an optional L2 host
    pool and L3 disk tier, one radix tree). ``frontier`` turns this rank's copy progress into
    the commit frontier; context parallelism plugs its MIN all-reduce in there. ``clock`` stamps
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
        self.clock: Clock = clock if clock is not None else WallClock()
        if frontier is None and cp > 1:
            frontier = group_frontier(self.group)
        self.cache = CacheHierarchy(config, compute.layout, frontier, cp, self.rank, model_id)
        self.waits = (
            DiskWaits(self.cache, config.max_batch_requests)
            if self.cache.disk is not None
            else None
        )
        self.waiting: deque[Waiting] = deque()
        self._refused: list[Finished] = []
        self.running: list[Running] = []
        self.keep_logits: set[int] = set()  # request ids whose last-token logits are returned
        self.keep_all_logits: set[int] = set()  # ... whose logits for every computed token are
        self.keep_handoff: set[int] = set()  # ... whose KV this rank exports when they finish
        self.fingerprint = layout_fingerprint(model_id, compute.layout, config.page_size)
        self.has_draft = isinstance(compute, PairCompute)  # logits come as [..., 2, vocab]
        self.deferred = 0
        self.steps = 0
        self.load_wait_s = 0.0  # clock time steps spent waiting for load-back, in total
        self.strategy_steps: dict[str, int] = {}  # CP attention strategy -> steps that used it
        self.last_work = StepWork(0, 0, 0, 0.0)  # what the last step did (the clock's charge)

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
        self.waiting.append(Waiting(request, self.cache.key(request.tokens), arrived))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._refused or self.waits)

    def close(self) -> None:
        """Release what outlives a replay: the disk tier's threads, files and lock."""
        self.cache.close()

    def step(self) -> list[Finished]:
        """Settle finished copies, admit what fits, run one packed forward, insert what it
        computed, finish the requests it completed."""
        cache = self.cache
        started = self.clock.now()
        before = cache.moved()
        self._settle()
        finished = self._admit(started)
        if not self.running:
            self.last_work = cache.step_work(before, ())
            if cache.disk is not None:  # the settle may have waited for the disk
                self.clock.charge(self.last_work)
            return finished
        chosen = self._chunks()
        cache.reserve_backups(chosen)
        all_logits = any(run.keep_all_logits for run, _ in chosen)
        self.group.step = self.steps
        logits = self._forward(chosen, all_logits)
        cache.end_forward()
        self.last_work = cache.step_work(before, [(run.done_len, e) for run, e in chosen])
        self.load_wait_s += self.clock.charge(self.last_work)
        now = self.clock.now()
        offset = 0
        for i, (run, extend) in enumerate(chosen):
            run.done_len += extend
            offset += extend
            if logits is not None and run.keep_all_logits:
                run.logit_chunks.append(logits[offset - extend : offset].float().cpu())
            cache.insert_chunk(run)
            if run.left == 0:
                if logits is not None and run.keep_logits:
                    run.logits = logits[offset - 1 if all_logits else i].float().cpu()
                finished.append(self._finish(run, now))
        self.running = [r for r in self.running if r.left]
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
        if self.waits is not None:
            self.waiting.extendleft(reversed(self.waits.give_up_lookups()))
        self.cache.synchronize(timeout_s)
        self._settle()

    def check(self) -> None:
        """The cache's invariants and conservation across tiers (given the running requests);
        each request in exactly one place: waiting, running, or waiting for the disk."""
        for r in self.running:
            if not r.cached_len <= r.inserted_len <= r.done_len <= len(r.key):
                raise AssertionError(
                    f"request {r.rid}: cached {r.cached_len}, inserted {r.inserted_len}, done "
                    f"{r.done_len} of {len(r.key)} out of order"
                )
        self.cache.check(self.running)
        held_back = self.waits.held_back() if self.waits is not None else []
        elsewhere = {w.request.rid for w in self.waiting} | {r.rid for r in self.running}
        if len(set(held_back)) != len(held_back) or elsewhere.intersection(held_back):
            raise AssertionError(
                f"a request waits for the disk twice or also runs / waits: {sorted(held_back)}"
            )

    def check_digests(self) -> None:
        """Compare every replicated digest across ranks; raise naming the first that differs."""
        mine = self.cache.digests() | {
            "waiting requests": str([w.request.rid for w in self.waiting]),
            "running requests": str([(r.rid, r.done_len) for r in self.running]),
        }
        every = self.group.all_gather_object(mine, "digests")
        for name, value in mine.items():
            differ = [rank for rank, d in enumerate(every) if d[name] != value]
            if differ:
                raise DivergenceError(
                    f"after engine step {self.steps}: the {name} of rank {self.rank} differs "
                    f"from rank(s) {differ} ({value[:16]} vs {every[differ[0]][name][:16]})"
                )

    # -- the cache's totals ------------------------------------------------------------------------

    @property
    def hit_tokens(self) -> dict[Tier, int]:
        """Tokens served from the cache so far, by tier."""
        return self.cache.hit_tokens

    @property
    def peak_pages_used(self) -> int:
        return self.cache.peak_pages_used

    # -- settle and admit ------------------------------------------------------------------------

    def _settle(self) -> None:
        """Apply what the commit frontier covers; requests whose disk wait ended queue first."""
        agree = self.waits.take_lookups() if self.waits is not None else ()
        settled = self.cache.settle(agree)
        if self.waits is not None:
            self.waiting.extendleft(reversed(self.waits.settle(settled)))

    def _admit(self, now: float) -> list[Finished]:
        failed, self._refused = self._refused, []
        cfg = self.config
        budget = cfg.max_batch_tokens - sum(min(cfg.chunk_size, r.left) for r in self.running)
        passed: list[Waiting] = []
        looked = self.waits.looking if self.waits is not None else 0  # a lookup takes its slot
        while self.waiting and len(self.running) + looked < cfg.max_batch_requests and budget > 0:
            waiting = self.waiting.popleft()
            request, key, arrived_at = waiting
            if self._computing_now(key):
                passed.append(waiting)
                self.deferred += 1
                continue
            parked = self.waits.park(waiting) if self.waits is not None else Park.COMPUTE
            if parked is Park.LATER:  # this step started all the reloads it may
                passed.append(waiting)
                continue
            if parked is Park.PARKED:
                looked = self.waits.looking  # type: ignore[union-attr]
                continue  # parked until the disk read lands; the others go on
            try:
                run = self._start(waiting, now)
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
            budget -= min(cfg.chunk_size, run.left)
        self.waiting.extendleft(reversed(passed))
        return failed

    def _start(self, waiting: Waiting, now: float) -> Running | None:
        request, key, arrived_at = waiting
        limit = reusable_len(len(key), self.config.page_size)
        claim = self.cache.claim(request.rid, key, limit, others_hold=bool(self.running))
        if claim is None:
            return None
        return Running(
            request=request,
            key=key,
            node=claim.node,
            pages=claim.pages,
            cached_len=claim.cached_len,
            host_len=claim.host_len,
            disk_len=claim.disk_len,
            done_len=claim.cached_len,
            inserted_len=claim.cached_len,
            arrived_at=arrived_at,
            entered_at=now,
            load_wait_at_entry=self.load_wait_s,
            keep_logits=request.rid in self.keep_logits,
            keep_all_logits=request.rid in self.keep_all_logits,
        )

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
        m = min(self.cache.cached_len(key), reusable_len(len(key), P)) // P
        if m >= (len(key) - 1) // P:
            return False
        k = key.page_keys.item(m)
        return any(
            not r.collided
            and r.inserted_len // P <= m < r.key.num_full_pages
            and r.key.page_keys.item(m) == k
            for r in self.running
        )

    # -- forward and finish ----------------------------------------------------------------------

    def _chunks(self) -> list[tuple[Running, int]]:
        """One chunk of each running request, in admission order, within the step's budget."""
        chosen: list[tuple[Running, int]] = []
        budget = self.config.max_batch_tokens
        for run in self.running:
            if budget == 0:
                break
            extend = min(self.config.chunk_size, run.left, budget)
            chosen.append((run, extend))
            budget -= extend
        return chosen

    def _forward(self, chosen: list[tuple[Running, int]], all_logits: bool) -> torch.Tensor | None:
        """One packed forward of the chosen chunks (under CP: this rank's share of it)."""
        if self.cp > 1:
            if all_logits:
                raise ConfigError("all-token logits are not kept under context parallelism")
            return self._forward_cp(chosen)
        ids = np.concatenate(
            [run.key.tokens[run.done_len : run.done_len + extend] for run, extend in chosen]
        )
        prefix_lens = [run.done_len for run, _ in chosen]
        extend_lens = [extend for _, extend in chosen]
        page_tables = [run.pages for run, _ in chosen]
        pool, hooks = self.cache.pool, self.cache.hooks
        if self.compute.forward_pages(prefix_lens, extend_lens, page_tables, ids, pool, hooks):
            return None  # written from the page tables: no logits, no per-token indices
        # Tokens, page tables and lengths reach the device in one copy (ForwardBatch.build).
        batch = ForwardBatch.build(
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            page_tables=page_tables,
            page_size=self.config.page_size,
            device=pool.device,
            input_ids=ids.astype(np.int64),
        )
        assert batch.input_ids is not None
        return self.compute.forward(batch.input_ids, batch, pool, all_logits, hooks)

    def _forward_cp(self, chosen: list[tuple[Running, int]]) -> torch.Tensor | None:
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
            self.cache.pool.device,
        )
        return self.compute.forward(input_ids, batch, self.cache.pool, False, self.cache.hooks)

    def _snapshot(self, run: Running) -> torch.Tensor | None:
        """The sequence's cached payload (synthetic compute only), gathered from its owners."""
        n, cp = len(run.key), self.cp
        payload = self.compute.snapshot(self.cache.pool, run.pages // cp, n)
        if payload is None or cp == 1:
            return payload
        owner = (torch.arange(n) // self.config.page_size) % cp
        payload[owner != self.rank] = 0  # rows read from slots this rank does not own
        self.group.all_reduce(payload, "sum", "verify")
        return payload

    def _forget(self, rid: int) -> None:
        """Drop what the engine kept for request ``rid`` (it finished or failed)."""
        self.cache.forget(rid)
        if self.waits is not None:
            self.waits.forget(rid)
        self.keep_handoff.discard(rid)

    def _finish(self, run: Running, now: float) -> Finished:
        payload = self._snapshot(run) if run.keep_logits else None
        handoff = None
        if run.rid in self.keep_handoff:
            handoff = export_handoff(
                self.cache.pool, run.rid, run.pages, len(run.key), self.rank, self.cp,
                self.fingerprint,
            )  # fmt: skip
        self._forget(run.rid)
        logits, draft_logits = split_draft(run.logits, self.has_draft)
        all_logits = torch.cat(run.logit_chunks) if run.logit_chunks else None
        self.cache.release(run)
        return Finished(
            rid=run.rid,
            prompt_len=len(run.key),
            cached_len=run.cached_len,
            logits=logits,
            ttft_s=now - run.arrived_at,
            payload=payload,
            all_logits=split_draft(all_logits, self.has_draft)[0],
            host_len=run.host_len,
            disk_len=run.disk_len,
            queue_s=run.entered_at - run.arrived_at,
            load_wait_s=self.load_wait_s - run.load_wait_at_entry,
            draft_logits=draft_logits,
            handoff=handoff,
        )
