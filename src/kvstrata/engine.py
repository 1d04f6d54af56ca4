"""The step-based prefill engine: the cache's reason to exist.

Per request::

    match_prefix ──▶ lock ──▶ alloc pages for the uncached suffix (evict if short)
        ──▶ compute the suffix in chunks over several steps ──▶ insert ──▶ free duplicates ──▶ unlock

Each :meth:`Engine.step` admits waiting requests in arrival order, then packs one chunk of every
running request into a single forward without padding. A request always recomputes at least its
last token (a prefill needs its logits), so a full hit is trimmed to the page boundary before it.
A request that cannot fit even in an empty pool fails alone with a :class:`RequestError`; one that
only has to wait for running requests to release pages stays queued.

Admission defers a request whose first uncached page is being computed right now by a running
request (same prefix key): it would compute the same KV twice. It waits until that request has
inserted its pages and then hits them; later requests may pass it meanwhile. This reads only
replicated inputs (arrival order, prefix keys), so every rank defers identically.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from .allocator import PageAllocator
from .compute import Compute
from .config import CacheConfig, PoolConfig
from .errors import ConfigError, RequestError
from .keys import TokenKey
from .model.batch import ForwardBatch
from .ownership import owners, page_span
from .pool import DevicePool
from .radix import Node, RadixTree
from .workloads import Request

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes. ``pool_tokens`` is the L1 device pool, in tokens (whole pages)."""

    page_size: int = 16
    pool_tokens: int = 262_144
    chunk_size: int = 2_048
    max_batch_tokens: int = 8_192
    max_batch_requests: int = 64
    eviction: str = "lru"
    device: str = "cpu"
    check_every_step: bool = False

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

    @property
    def pool_pages(self) -> int:
        return self.pool_tokens // self.page_size


@dataclass
class Finished:
    """The outcome of one request."""

    rid: int
    prompt_len: int
    cached_len: int  # tokens served from the cache
    logits: torch.Tensor | None  # last-token logits on the CPU (None without a model or on error)
    ttft_s: float  # engine time from the step it entered to its last-token logits
    error: str | None = None
    payload: torch.Tensor | None = None  # the sequence's cached payload rows, when kept (no model)
    all_logits: torch.Tensor | None = None  # logits of every computed token, when asked for

    @property
    def computed_len(self) -> int:
        return 0 if self.error else self.prompt_len - self.cached_len


class _Waiting(NamedTuple):
    request: Request
    key: TokenKey  # hashed once, when the request is added


@dataclass
class _Running:
    request: Request
    key: TokenKey
    node: Node  # locked while the request runs
    pages: IntArray  # one logical page per page of the whole sequence
    cached_len: int
    done_len: int
    entered_at: float
    keep_logits: bool
    keep_all_logits: bool
    logits: torch.Tensor | None = field(default=None)
    logit_chunks: list[torch.Tensor] = field(default_factory=list)


class Engine:
    """Prefill engine over one device pool, one radix tree and one page allocator (one rank)."""

    def __init__(self, compute: Compute, config: EngineConfig) -> None:
        self.compute = compute
        self.config = config
        P = config.page_size
        self.pool = DevicePool(compute.layout, P, config.pool_pages, config.device)
        self.allocator = PageAllocator(PoolConfig(num_pages=config.pool_pages))
        self.tree = RadixTree(
            CacheConfig(page_size=P, eviction=config.eviction), capacity_pages=config.pool_pages
        )
        self.waiting: deque[_Waiting] = deque()
        self._refused: list[Finished] = []
        self.running: list[_Running] = []
        self.keep_logits: set[int] = set()  # request ids whose last-token logits are returned
        self.keep_all_logits: set[int] = set()  # ... whose logits for every computed token are
        # Prefix keys of the full pages running requests are computing, with multiplicity.
        self._inflight: dict[int, int] = {}
        self.deferred = 0
        self.steps = 0
        self.peak_pages_used = 0

    # -- public ----------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request. One that can never run here is refused at once: the next
        :meth:`step` returns it with its error."""
        error = self._refusal(request)
        if error is not None:
            self._refused.append(
                Finished(request.rid, request.tokens.size, 0, None, 0.0, str(error))
            )
            return
        self.waiting.append(_Waiting(request, self.tree.key(request.tokens)))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._refused)

    def step(self) -> list[Finished]:
        """Admit what fits, run one packed forward, finish the requests it completed."""
        started = time.perf_counter()
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
        all_logits = any(run.keep_all_logits for run, _ in chosen)
        logits = self._forward(chosen, all_logits)
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        now = time.perf_counter()
        offset = 0
        for i, (run, extend) in enumerate(chosen):
            run.done_len += extend
            offset += extend
            if logits is not None and run.keep_all_logits:
                run.logit_chunks.append(logits[offset - extend : offset].float().cpu())
            if run.done_len == len(run.key):
                if logits is not None and run.keep_logits:
                    run.logits = logits[offset - 1 if all_logits else i].float().cpu()
                finished.append(self._finish(run, now))
        self.running = [r for r in self.running if r.done_len < len(r.key)]
        self.steps += 1
        if self.config.check_every_step:
            self.check()
        return finished

    def check(self) -> None:
        """Tree and allocator invariants; every page free, cached or held by a running request;
        one lock and one set of in-flight keys per running request."""
        self.tree.check()
        self.allocator.check()
        P = self.config.page_size
        held = sum(int(r.pages.size) - r.cached_len // P for r in self.running)
        inflight = sum(r.key.num_full_pages - r.cached_len // P for r in self.running)
        if sum(self._inflight.values()) != inflight:
            raise AssertionError(
                f"in-flight page keys {sum(self._inflight.values())} != {inflight}"
            )
        if self.allocator.num_used != self.tree.num_pages + held:
            raise AssertionError(
                f"pages used {self.allocator.num_used} != tree {self.tree.num_pages} + running {held}"
            )
        locks = self.tree.root.lock_ref + sum(n.lock_ref for n in self.tree.nodes())
        if locks != len(self.running):
            raise AssertionError(
                f"{locks} node locks held for {len(self.running)} running requests"
            )

    # -- admission -------------------------------------------------------------------------------

    def _admit(self, now: float) -> list[Finished]:
        failed, self._refused = self._refused, []
        cfg = self.config
        budget = cfg.max_batch_tokens - sum(
            min(cfg.chunk_size, len(r.key) - r.done_len) for r in self.running
        )
        passed: list[_Waiting] = []
        while self.waiting and len(self.running) < cfg.max_batch_requests and budget > 0:
            waiting = self.waiting.popleft()
            request, key = waiting
            if self._computing_now(key):
                passed.append(waiting)
                self.deferred += 1
                continue
            try:
                run = self._try_start(request, key, now)
            except RequestError as error:
                failed.append(Finished(request.rid, len(key), 0, None, 0.0, str(error)))
                continue
            if run is None:
                self.waiting.appendleft(waiting)
                break  # wait for running requests to release pages
            self.running.append(run)
            self._track(run, +1)
            budget -= min(cfg.chunk_size, len(key) - run.done_len)
        self.waiting.extendleft(reversed(passed))
        return failed

    def _refusal(self, request: Request) -> RequestError | None:
        """Why ``request`` can never run on this engine, or None."""
        n, cfg = request.tokens.size, self.config
        if n > self.compute.max_seq_len:
            return RequestError(
                f"request {request.rid}: {n} tokens exceed the model's {self.compute.max_seq_len} "
                "positions (max_position_embeddings)"
            )
        if page_span(n, cfg.page_size) > cfg.pool_pages:
            return RequestError(
                f"request {request.rid}: {n} tokens need {page_span(n, cfg.page_size)} pages of "
                f"{cfg.page_size}, the device pool has {cfg.pool_pages}; raise the pool size"
            )
        if int(request.tokens.max()) >= self.compute.vocab_size:
            return RequestError(
                f"request {request.rid}: token id {int(request.tokens.max())} is outside the "
                f"model's vocabulary of {self.compute.vocab_size}"
            )
        return None

    def _computing_now(self, key: TokenKey) -> bool:
        """Whether a running request is computing the first page ``key`` would compute and
        could reuse (not the page of its own last token, which it recomputes anyway)."""
        if not self._inflight:
            return False
        P = self.config.page_size
        m = min(self.tree.match_length(key), self._reusable_len(len(key))) // P
        return m < (len(key) - 1) // P and key.page_keys.item(m) in self._inflight

    def _reusable_len(self, n: int) -> int:
        """The longest cached prefix a request of ``n`` tokens may use: whole pages, and never
        its last token (a prefill needs that token's logits)."""
        return (n - 1) // self.config.page_size * self.config.page_size

    def _track(self, run: _Running, sign: int) -> None:
        first = run.cached_len // self.config.page_size
        for k in run.key.page_keys[first:].tolist():
            count = self._inflight.get(k, 0) + sign
            if count:
                self._inflight[k] = count
            else:
                del self._inflight[k]

    def _try_start(self, request: Request, key: TokenKey, now: float) -> _Running | None:
        P = self.config.page_size
        tree, allocator = self.tree, self.allocator
        n = len(key)
        # Not recorded yet: a request that has to wait would count a hit on every retry.
        hit = tree.match_prefix(key, max_len=self._reusable_len(n), record=False)
        cached_len = hit.valid_len
        tree.lock(hit.last_node)
        need = page_span(n, P) - cached_len // P
        new_pages = allocator.alloc(cached_len // P, need)
        if new_pages is None:
            short = allocator.deficit(owners(cached_len // P, need, allocator.cp_size))
            allocator.free(tree.evict(short))
            new_pages = allocator.alloc(cached_len // P, need)
        if new_pages is None:
            tree.unlock(hit.last_node)
            if not self.running:  # nothing will release pages: _refusal should have caught it
                raise RequestError(
                    f"request {request.rid}: {need} pages do not fit even after eviction "
                    f"({allocator.num_free} free of {allocator.num_pages})"
                )
            return None
        tree.record_hit(hit.last_node)
        self.peak_pages_used = max(self.peak_pages_used, allocator.num_used)
        pages = np.concatenate((hit.device_pages[: cached_len // P], new_pages))
        return _Running(
            request=request,
            key=key,
            node=hit.last_node,
            pages=pages,
            cached_len=cached_len,
            done_len=cached_len,
            entered_at=now,
            keep_logits=request.rid in self.keep_logits,
            keep_all_logits=request.rid in self.keep_all_logits,
        )

    # -- forward and finish ----------------------------------------------------------------------

    def _forward(self, chosen: list[tuple[_Running, int]], all_logits: bool) -> torch.Tensor | None:
        device = self.pool.device
        ids = np.concatenate(
            [run.key.tokens[run.done_len : run.done_len + extend] for run, extend in chosen]
        )
        batch = ForwardBatch.build(
            prefix_lens=[run.done_len for run, _ in chosen],
            extend_lens=[extend for _, extend in chosen],
            page_tables=[run.pages for run, _ in chosen],
            page_size=self.config.page_size,
            device=device,
        )
        input_ids = torch.from_numpy(ids.astype(np.int64)).to(device)
        return self.compute.forward(input_ids, batch, self.pool, all_logits)

    def _finish(self, run: _Running, now: float) -> Finished:
        self._track(run, -1)
        payload = (
            self.compute.snapshot(self.pool, run.pages, len(run.key)) if run.keep_logits else None
        )
        result = self.tree.insert(run.key, run.pages)
        self.allocator.free(result.free_pages)
        self.tree.unlock(run.node)
        return Finished(
            rid=run.request.rid,
            prompt_len=len(run.key),
            cached_len=run.cached_len,
            logits=run.logits,
            ttft_s=now - run.entered_at,
            payload=payload,
            all_logits=torch.cat(run.logit_chunks) if run.logit_chunks else None,
        )
