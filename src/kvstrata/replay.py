"""``kvstrata replay``: run a workload through the engine and report what the cache saved.

Builds the compute (a model preset or checkpoint, or ``none`` for cache-only replay with synthetic
payloads), feeds every request of the workload to the :class:`~kvstrata.engine.Engine` in order,
and summarises: hit ratio, computed tokens, prefill throughput, TTFT percentiles, pool usage, and —
with ``--verify N`` — how far the cached answers are from answers computed without the cache.

The summary is a :class:`ReplaySummary`; ``to_json()`` is the stable machine-readable form
(``SUMMARY_SCHEMA`` versions it).
"""

from __future__ import annotations

import platform
import time
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


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    q = np.percentile(np.array(values) * 1e3, [50, 90, 99])
    return {
        "p50": round(float(q[0]), 3),
        "p90": round(float(q[1]), 3),
        "p99": round(float(q[2]), 3),
    }


def verify_sample(num_requests: int, verify: int, seed: int) -> set[int]:
    """Which request indices ``--verify`` recomputes: a seeded sample, the same on every run."""
    k = min(verify, num_requests)
    rng = np.random.default_rng(seed)
    return {int(i) for i in rng.choice(num_requests, size=k, replace=False)}


def run_replay(
    cfg: ReplayConfig, progress: bool = True, compute: Compute | None = None
) -> ReplaySummary:
    """Replay ``cfg.workload`` and return the summary (also used by tests and benchmarks)."""
    compute = compute or build_compute(cfg)
    workload = load_workload(
        cfg.workload, limit=cfg.limit, vocab_size=compute.vocab_size, on_error=cfg.on_error
    )
    requests = workload.requests
    if not requests:
        raise ConfigError(f"workload {cfg.workload!r} has no requests")
    engine = Engine(compute, cfg.engine)
    sampled = verify_sample(len(requests), cfg.verify, cfg.seed)
    engine.keep_logits = {requests[i].rid for i in sampled}
    for request in requests:
        engine.add(request)

    finished: list[Finished] = []
    start = time.perf_counter()
    with tqdm(
        total=len(requests), desc="replay", unit="req", disable=not progress, leave=False
    ) as bar:
        while engine.has_work():
            done = engine.step()
            finished.extend(done)
            bar.update(len(done))
    seconds = time.perf_counter() - start

    ok = [f for f in finished if f.error is None]
    by_rid = {r.rid: r for r in requests}
    verify = _verify(cfg, compute, [f for f in ok if f.rid in engine.keep_logits], by_rid, progress)
    return ReplaySummary(
        requests=len(finished),
        failed=len(finished) - len(ok),
        prompt_tokens=sum(f.prompt_len for f in ok),
        cached_tokens=sum(f.cached_len for f in ok),
        computed_tokens=sum(f.computed_len for f in ok),
        seconds=seconds,
        ttft_ms=_percentiles([f.ttft_s for f in ok]),
        pool_pages=engine.allocator.num_pages,
        pool_pages_used_peak=engine.peak_pages_used,
        pool_pages_cached_end=engine.tree.num_pages,
        steps=engine.steps,
        verify=verify,
        config={
            "workload": workload.source,
            "limit": cfg.limit,
            "skipped_lines": len(workload.skipped),
            "model": cfg.model,
            "dtype": str(next(iter(compute.layout.payloads)).dtype),
            "vocab_size": compute.vocab_size,
            "page_size": cfg.engine.page_size,
            "l1_tokens": cfg.engine.pool_tokens,
            "chunk_size": cfg.engine.chunk_size,
            "max_batch_tokens": cfg.engine.max_batch_tokens,
            "max_batch_requests": cfg.engine.max_batch_requests,
            "eviction": cfg.engine.eviction,
            "device": cfg.engine.device,
            "kv_width": cfg.kv_width if cfg.model == "none" else None,
            "verify": cfg.verify,
            "seed": cfg.seed,
        },
        errors=[f.error for f in finished if f.error][:20],
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
