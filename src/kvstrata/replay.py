"""``kvstrata replay``: run a workload through the engine and report what the cache saved.

Builds the compute (a model preset or checkpoint, or ``none`` for cache-only replay with synthetic
payloads), streams the workload's requests into the :class:`~kvstrata.engine.Engine` in order, a
bounded look-ahead window at a time (a finished request is folded into running totals and dropped,
so memory does not grow with the workload's length), and summarises: hit ratio, computed tokens,
prefill throughput, TTFT percentiles, pool usage, and — with ``--verify N`` — how far the cached
answers are from answers computed without the cache.

The summary is a :class:`ReplaySummary`; ``to_json()`` is the stable machine-readable form
(``SUMMARY_SCHEMA`` versions it).
"""

from __future__ import annotations

import platform
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from . import __version__
from .compute import Compute, ModelCompute, SyntheticCompute, synthetic_payload
from .engine import Engine, EngineConfig, Finished
from .errors import ConfigError
from .model.loader import load_model
from .ownership import page_span
from .workloads import DEFAULT_VOCAB_SIZE, Request, load_workload

SUMMARY_SCHEMA = 1
MAX_ERRORS_KEPT = 20  # failed requests whose messages a summary keeps (all are counted)


@dataclass(frozen=True)
class ReplayConfig:
    """Everything ``kvstrata replay`` needs; the CLI is a thin skin over this."""

    workload: str = "builtin"
    limit: int | None = None
    model: str = "tiny"  # a preset, a checkpoint directory, or "none"
    dtype: str | None = None
    kv_width: int = 64  # bytes per token with model "none"
    vocab_size: int = DEFAULT_VOCAB_SIZE  # token id range with model "none"
    engine: EngineConfig = field(default_factory=EngineConfig)
    verify: int = 0
    on_error: str = "stop"
    seed: int = 0
    lookahead: int | None = None  # requests read ahead of the engine; None: 2 x max_batch_requests

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.model == "none" and self.dtype is not None:
            raise ConfigError(
                "--dtype applies to a model's K/V; --model none stores uint8 synthetic payloads "
                "(size them with --kv-width)"
            )
        if self.vocab_size < 1:
            raise ConfigError(f"--vocab-size must be >= 1, got {self.vocab_size}")
        if self.verify < 0:
            raise ConfigError(f"--verify takes a number of requests >= 0, got {self.verify}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if self.lookahead is not None and self.lookahead < self.engine.max_batch_requests:
            raise ConfigError(
                f"--lookahead ({self.lookahead}) must be >= --max-batch-requests "
                f"({self.engine.max_batch_requests}), or the engine could never fill a batch"
            )


@dataclass
class VerifyReport:
    requests: int = 0
    max_abs_logit_diff: float | None = None
    argmax_agree: float | None = None
    payload_mismatched_bytes: int | None = None


@dataclass
class ReplaySummary:
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    seconds: float
    ttft_ms: dict[str, float]
    pool_pages: int
    pool_pages_used_peak: int
    pool_pages_cached_end: int
    steps: int
    verify: VerifyReport
    config: dict[str, Any]
    errors: list[str]

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.computed_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SUMMARY_SCHEMA,
            "requests": self.requests,
            "failed": self.failed,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_ratio": round(self.hit_ratio, 6),
            "hit_tokens_by_tier": {"l1": self.cached_tokens, "l2": 0, "l3": 0},
            "computed_tokens": self.computed_tokens,
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
            "ttft_ms": self.ttft_ms,
            "seconds": round(self.seconds, 3),
            "steps": self.steps,
            "pool": {
                "pages": self.pool_pages,
                "pages_used_peak": self.pool_pages_used_peak,
                "pages_cached_end": self.pool_pages_cached_end,
            },
            "verify": asdict(self.verify),
            "config": self.config,
            "versions": {
                "kvstrata": __version__,
                "torch": torch.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
        }

    def table(self) -> str:
        rows = [
            ("requests", f"{self.requests}" + (f" ({self.failed} failed)" if self.failed else "")),
            ("prompt tokens", f"{self.prompt_tokens:,}"),
            ("cached tokens", f"{self.cached_tokens:,}"),
            ("hit ratio", f"{self.hit_ratio:.4f}"),
            ("computed tokens", f"{self.computed_tokens:,}"),
            ("prefill tokens/s", f"{self.prefill_tokens_per_s:,.0f}"),
            (
                "TTFT p50/p90/p99 ms",
                f"{self.ttft_ms['p50']:.2f} / {self.ttft_ms['p90']:.2f} / {self.ttft_ms['p99']:.2f}",
            ),
            (
                "pool pages used (peak / end / total)",
                f"{self.pool_pages_used_peak:,} / {self.pool_pages_cached_end:,} / {self.pool_pages:,}",
            ),
            ("engine steps", f"{self.steps:,}"),
        ]
        v = self.verify
        if v.requests:
            if v.max_abs_logit_diff is not None:
                rows.append(
                    (
                        f"verify ({v.requests} requests)",
                        f"max |logit diff| {v.max_abs_logit_diff:.3g}, argmax agree {v.argmax_agree:.3f}",
                    )
                )
            else:
                rows.append(
                    (
                        f"verify ({v.requests} requests)",
                        f"payload bytes mismatched {v.payload_mismatched_bytes}",
                    )
                )
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {val}" for k, val in rows)


def build_compute(cfg: ReplayConfig) -> Compute:
    """The model the replay runs (or synthetic payloads for ``model="none"``)."""
    if cfg.model == "none":
        return SyntheticCompute(cfg.kv_width, cfg.vocab_size)
    _, model = load_model(cfg.model, device=cfg.engine.device, dtype=cfg.dtype, seed=cfg.seed)
    return ModelCompute(model, next(model.parameters()).dtype)


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not len(values):
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    q = np.percentile(np.array(values) * 1e3, [50, 90, 99])
    return {
        "p50": round(float(q[0]), 3),
        "p90": round(float(q[1]), 3),
        "p99": round(float(q[2]), 3),
    }


class VerifySample:
    """Which requests ``--verify`` recomputes: a uniform random sample of ``size`` of them, drawn
    while they stream by, without knowing how many there will be.

    Reservoir sampling (Vitter's Algorithm R) over a ``numpy`` generator seeded with ``seed``: the
    first ``size`` requests fill the sample; request ``i`` (0-based) after them replaces a uniform
    slot with probability ``size / (i + 1)``. The sample depends only on the seed and the request
    order, so it is the same on every run, and it holds at most ``size`` requests and their
    results. A chosen request's id goes into the engine's ``keep_logits`` and comes out again when
    it is replaced.
    """

    def __init__(self, size: int, seed: int, keep_logits: set[int]) -> None:
        self.size = size
        self._rng = np.random.default_rng(seed)
        self._seen = 0
        self._keep = keep_logits
        self.requests: dict[int, Request] = {}  # rid -> request, at most `size` of them
        self._slots: list[int] = []  # rids, one per reservoir slot
        self.finished: dict[int, Finished] = {}  # results of sampled requests, once they finish

    def offer(self, request: Request) -> None:
        """Consider the next request of the stream (before it is added to the engine)."""
        i, self._seen = self._seen, self._seen + 1
        if self.size == 0:
            return
        if len(self._slots) < self.size:
            slot = len(self._slots)
            self._slots.append(request.rid)
        else:
            slot = int(self._rng.integers(0, i + 1))
            if slot >= self.size:
                return
            old = self._slots[slot]
            self._keep.discard(old)
            del self.requests[old]
            self.finished.pop(old, None)
            self._slots[slot] = request.rid
        self.requests[request.rid] = request
        self._keep.add(request.rid)

    def collect(self, finished: Finished) -> None:
        """Keep ``finished`` if its request is in the sample."""
        if finished.rid in self.requests:
            self.finished[finished.rid] = finished


@dataclass
class _Tally:
    """The aggregates a summary needs, so that no finished request has to be kept."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: array[float] = field(default_factory=lambda: array("d"))  # 8 bytes per request
    errors: list[str] = field(default_factory=list)  # the first MAX_ERRORS_KEPT

    def add(self, f: Finished) -> None:
        self.requests += 1
        if f.error is not None:
            self.failed += 1
            if len(self.errors) < MAX_ERRORS_KEPT:
                self.errors.append(f.error)
            return
        self.prompt_tokens += f.prompt_len
        self.cached_tokens += f.cached_len
        self.computed_tokens += f.computed_len
        self.ttft_s.append(f.ttft_s)


def run_replay(
    cfg: ReplayConfig, progress: bool = True, compute: Compute | None = None
) -> ReplaySummary:
    """Replay ``cfg.workload`` and return the summary (also used by tests and benchmarks).

    The workload streams: at most ``cfg.lookahead`` requests (default twice
    ``max_batch_requests``) are read ahead of the engine, counting those waiting and running, and
    a finished request is folded into the summary's aggregates and dropped. Memory therefore
    holds the cache plus the requests in flight, whatever the workload's length.
    """
    compute = compute or build_compute(cfg)
    workload = load_workload(
        cfg.workload, limit=cfg.limit, vocab_size=compute.vocab_size, on_error=cfg.on_error
    )
    engine = Engine(compute, cfg.engine)
    sample = VerifySample(cfg.verify, cfg.seed, engine.keep_logits)
    tally = _Tally()
    lookahead = cfg.lookahead or 2 * cfg.engine.max_batch_requests
    requests: Iterator[Request] | None = iter(workload)
    in_flight = 0  # added to the engine and not finished yet
    seconds = 0.0  # engine time only: reading or generating the workload is not prefill
    with tqdm(
        total=workload.num_requests, desc="replay", unit="req", disable=not progress, leave=False
    ) as bar:
        while True:
            while requests is not None and in_flight < lookahead:
                request = next(requests, None)
                if request is None:
                    requests = None
                    break
                sample.offer(request)
                engine.add(request)
                in_flight += 1
            if not engine.has_work():
                break
            start = time.perf_counter()
            done = engine.step()
            seconds += time.perf_counter() - start
            in_flight -= len(done)
            for f in done:
                tally.add(f)
                sample.collect(f)
            bar.update(len(done))
    if not tally.requests:
        raise ConfigError(f"workload {cfg.workload!r} has no requests")

    sampled = [f for f in sample.finished.values() if f.error is None]
    verify = _verify(cfg, compute, sampled, sample.requests, progress)
    return ReplaySummary(
        requests=tally.requests,
        failed=tally.failed,
        prompt_tokens=tally.prompt_tokens,
        cached_tokens=tally.cached_tokens,
        computed_tokens=tally.computed_tokens,
        seconds=seconds,
        ttft_ms=_percentiles(tally.ttft_s),
        pool_pages=engine.allocator.num_pages,
        pool_pages_used_peak=engine.peak_pages_used,
        pool_pages_cached_end=engine.tree.num_pages,
        steps=engine.steps,
        verify=verify,
        config={
            "workload": workload.source,
            "limit": cfg.limit,
            "skipped_lines": workload.num_skipped,
            "model": cfg.model,
            "dtype": str(next(iter(compute.layout.payloads)).dtype),
            "vocab_size": compute.vocab_size,
            "page_size": cfg.engine.page_size,
            "l1_tokens": cfg.engine.pool_tokens,
            "chunk_size": cfg.engine.chunk_size,
            "max_batch_tokens": cfg.engine.max_batch_tokens,
            "max_batch_requests": cfg.engine.max_batch_requests,
            "lookahead": lookahead,
            "eviction": cfg.engine.eviction,
            "device": cfg.engine.device,
            "kv_width": cfg.kv_width if cfg.model == "none" else None,
            "verify": cfg.verify,
            "seed": cfg.seed,
        },
        errors=tally.errors,
    )


def recompute_uncached(compute: Compute, config: EngineConfig, request: Request) -> torch.Tensor:
    """Last-token logits of ``request`` computed by a fresh engine with an empty cache (same
    page size and chunking), sized for that one request."""
    P = config.page_size
    pool_tokens = page_span(request.tokens.size, P) * P
    solo = Engine(compute, EngineConfig(**{**asdict(config), "pool_tokens": pool_tokens}))
    solo.keep_logits = {request.rid}
    solo.add(request)
    out: list[Finished] = []
    while solo.has_work():
        out.extend(solo.step())
    (finished,) = out
    if finished.error is not None or finished.logits is None:
        raise ConfigError(f"request {request.rid} cannot be recomputed: {finished.error}")
    return finished.logits


def _verify(
    cfg: ReplayConfig,
    compute: Compute,
    sampled: list[Finished],
    requests: dict[int, Request],
    progress: bool,
) -> VerifyReport:
    """Recompute each sampled request with an empty cache and compare with the cached run."""
    report = VerifyReport(requests=len(sampled))
    if not sampled:
        return report
    if isinstance(compute, SyntheticCompute):
        mismatched = 0
        for f in sampled:
            tokens = torch.from_numpy(requests[f.rid].tokens.astype(np.int64))
            expected = synthetic_payload(tokens, compute.kv_width)
            assert f.payload is not None
            mismatched += int((f.payload != expected).sum())
        report.payload_mismatched_bytes = mismatched
        return report
    max_diff, agree = 0.0, 0
    for f in tqdm(sampled, desc="verify", unit="req", leave=False, disable=not progress):
        fresh = recompute_uncached(compute, cfg.engine, requests[f.rid])
        assert f.logits is not None
        max_diff = max(max_diff, float((fresh - f.logits).abs().max()))
        agree += int(int(fresh.argmax()) == int(f.logits.argmax()))
    report.max_abs_logit_diff = max_diff
    report.argmax_agree = agree / len(sampled)
    return report
