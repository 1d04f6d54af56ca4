"""``kvstrata replay``: run a workload through the engine and report what the cache saved.

Builds the compute (a model preset or checkpoint, or ``none`` for cache-only replay with synthetic
payloads), streams the workload's requests into the :class:`~kvstrata.engine.Engine` in order, a
bounded look-ahead window at a time (a finished request is folded into running totals and dropped,
so memory does not grow with the workload's length), and summarises: hit ratio, computed tokens,
prefill throughput, TTFT percentiles, pool usage, and — with ``--verify N`` — how far the cached
answers are from answers computed without the cache.

Everything that can be checked is checked before anything large is built: the configuration, then
the workload (a trace that cannot be opened, or has no request, fails before a model loads; a trace
line longer than the engine can ever serve is refused before its tokens are expanded; a malformed
line further on stops the replay when it is read, naming ``path:line``), then the memory the pool
and the weights need against what the device has. A Ctrl-C during the run ends it with the summary of the requests
finished so far (``interrupted``).

The summary is a :class:`ReplaySummary`; ``to_json()`` is the stable machine-readable form
(``SUMMARY_SCHEMA`` versions it).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import platform
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from . import __version__
from .arrivals import ArrivalSpec, ArrivalTimes
from .cache.radix import TreeStats
from .clock import Clock, CostModel, make_clock
from .config import KVLayout
from .decode import Decoded, greedy_decode
from .dist.group import Group, SoloGroup
from .dist.launch import run_ranks, torchrun_group, under_torchrun
from .engine import Engine, EngineConfig, Finished
from .errors import ConfigError, DivergenceError
from .handoff import (
    DirectoryTransport,
    Handoff,
    HandoffTransport,
    LoopbackTransport,
    assemble,
    layout_fingerprint,
)
from .limits import ALLOCATOR_BYTES_PER_PAGE, check_device, check_fits
from .metrics import CacheMetrics, MetricsServer, RequestTotals
from .model.attention import ATTENTION_BACKENDS, PagedAttention
from .model.compute import Compute, ModelCompute, PairCompute, SyntheticCompute, synthetic_payload
from .model.llama import LlamaModel
from .model.loader import load_model, read_model_config, resolve_dtype, weight_bytes
from .ownership import page_span
from .progress import Progress
from .residency import Tier
from .workloads import DEFAULT_VOCAB_SIZE, Request, SkippedLine, load_workload

#: 2: TTFT counts from each request's arrival (``ttft_ms`` gains ``mean``), with ``ttft_parts_ms``,
#: ``ttft_by_hit_ms``, ``clock`` and ``arrivals``.
SUMMARY_SCHEMA = 2
#: Failed requests and skipped trace lines a summary lists by message (the counts are complete).
LISTED_ERRORS = 20
_MAX_SEED = 2**64 - 1  # torch generators take seeds up to 2**64 - 1


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
    threads: int | None = None  # torch intra-op threads while replaying; None leaves torch's
    lookahead: int | None = None  # requests read ahead of the engine; None: 2 x max_batch_requests
    arrivals: ArrivalSpec = field(default_factory=ArrivalSpec)  # None kind: from the workload
    clock: str = "auto"  # auto (sim with model "none", else wall), wall or sim
    cost: CostModel | None = None  # the simulated clock's; None: the device's measured defaults
    metrics_port: int | None = None  # serve Prometheus metrics on this port (0: any free one)
    metrics_host: str = "127.0.0.1"
    cp: int = 1  # context-parallel ranks (local processes, or torchrun's world)
    cp_timeout_s: float = 300.0  # every collective's timeout: a dead or hung rank fails the run
    attention: str = "auto"  # the model's attention backend (kvstrata.model.attention)
    draft_model: str | None = None  # a speculative draft prefilled on the same pages
    decode_tokens: int = 0  # greedy tokens decoded from each --verify request's handoff
    handoff_dir: str | None = None  # where CP ranks hand their parts over (decode under CP)

    def __post_init__(self) -> None:
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or not 1 <= self.cp <= 64:
            raise ConfigError(f"--cp must be an integer in [1, 64], got {self.cp!r}")
        if not 1 <= self.cp_timeout_s <= 86_400:
            raise ConfigError(
                f"--cp-timeout must lie in [1, 86400] seconds, got {self.cp_timeout_s!r}"
            )
        if not 0 <= self.seed <= _MAX_SEED:
            raise ConfigError(f"--seed must lie in [0, 2**64 - 1], got {self.seed}")
        check_device(self.engine.device)
        cores = os.cpu_count() or 1
        if self.threads is not None and not 1 <= self.threads <= cores:
            raise ConfigError(
                f"--threads must lie in [1, {cores}] (this machine's CPU cores), got {self.threads}"
            )
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.model == "none" and self.dtype is not None:
            raise ConfigError(
                "--dtype applies to a model's K/V; --model none stores uint8 synthetic payloads "
                "(size them with --kv-width)"
            )
        if self.attention not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"--attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}"
            )
        if self.vocab_size < 1:
            raise ConfigError(f"--vocab-size must be >= 1, got {self.vocab_size}")
        if self.verify < 0:
            raise ConfigError(f"--verify takes a number of requests >= 0, got {self.verify}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if self.clock not in ("auto", "wall", "sim"):
            raise ConfigError(f"--clock must be auto, wall or sim, got {self.clock!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must lie in [0, 65535], got {self.metrics_port}")
        if not self.metrics_host.strip():
            raise ConfigError(
                "--metrics-host must name an address (127.0.0.1 by default; 0.0.0.0 for every "
                "interface)"
            )
        if self.draft_model is not None and self.model == "none":
            raise ConfigError(
                "--draft-model runs beside a model: give --model too (--model none has no draft)"
            )
        if self.draft_model == "":
            raise ConfigError("--draft-model needs a preset (e.g. tiny-draft) or a checkpoint")
        if not 0 <= self.decode_tokens <= 65_536:
            raise ConfigError(f"--decode-tokens must lie in [0, 65536], got {self.decode_tokens}")
        if self.decode_tokens and self.model == "none":
            raise ConfigError("--decode-tokens decodes with a model: give --model (not none)")
        if self.decode_tokens and not self.verify:
            raise ConfigError(
                "--decode-tokens decodes from the handoff of each --verify request: give "
                "--verify N too"
            )
        if self.lookahead is not None and self.lookahead < self.engine.max_batch_requests:
            raise ConfigError(
                f"--lookahead ({self.lookahead}) must be >= --max-batch-requests "
                f"({self.engine.max_batch_requests}), or the engine could never fill a batch"
            )


@dataclass
class VerifyReport:
    """What ``--verify`` found. ``max_abs_logit_diff`` is over the values finite on both sides;
    ``nonfinite_logits`` counts NaN/inf values of either side (each one is a failure)."""

    requests: int = 0
    max_abs_logit_diff: float | None = None
    argmax_agree: float | None = None
    payload_mismatched_bytes: int | None = None
    nonfinite_logits: int | None = None
    draft_max_abs_logit_diff: float | None = None  # the draft model's, with --draft-model
    draft_argmax_agree: float | None = None
    decode: DecodeReport | None = None  # with --decode-tokens

    @property
    def ok(self) -> bool:
        """No non-finite logit and no mismatched payload byte. Logit differences are reported,
        not judged: how large they may be depends on the dtype."""
        return not self.nonfinite_logits and not self.payload_mismatched_bytes

    def describe(self) -> str:
        if self.max_abs_logit_diff is None:
            return f"payload bytes mismatched {self.payload_mismatched_bytes:,}" + (
                "" if self.ok else " (FAIL)"
            )
        text = (
            f"max |logit diff| {self.max_abs_logit_diff:.3g}, argmax agree {self.argmax_agree:.3f}"
        )
        if self.draft_max_abs_logit_diff is not None:
            text += (
                f"; draft: max |logit diff| {self.draft_max_abs_logit_diff:.3g}, argmax agree "
                f"{self.draft_argmax_agree:.3f}"
            )
        if self.nonfinite_logits:
            text = (
                f"FAIL: {self.nonfinite_logits:,} non-finite logit values; {text} (finite values)"
            )
        return text


@dataclass
class DecodeReport:
    """What ``--decode-tokens`` found: greedy decoding from each sampled request's handoff
    against decoding from a prefill of the same request with an empty cache.

    tokens_equal: requests whose decoded tokens (and, with a draft, the draft's verdict at every
        position) equal the uncached run's.
    acceptance_*: the draft's greedy acceptance rate (share of decoded positions where its
        greedy token equals the target's), over the sampled requests that hit the cache, from
        the cached prefill's handoff and from the uncached one (they must be equal); None
        without a draft or without hits.
    """

    requests: int
    tokens: int
    tokens_equal: int
    hit_requests: int
    acceptance_cached: float | None
    acceptance_uncached: float | None
    handoff_bytes: int

    def describe(self) -> str:
        text = (
            f"{self.tokens_equal}/{self.requests} requests decode the same {self.tokens} tokens "
            f"from the handoff as without the cache ({self.handoff_bytes:,} handoff bytes)"
        )
        if self.acceptance_cached is not None:
            text += (
                f"; draft acceptance on {self.hit_requests} requests with cache hits "
                f"{self.acceptance_cached:.4f}, without the cache {self.acceptance_uncached:.4f}"
            )
        return text


@dataclass
class TierReport:
    """What the L2 host tier did during a replay (``hit_tokens_by_tier`` and friends)."""

    l2_hit_tokens: int
    host_pages: int
    host_pages_cached_end: int
    d2h_pages: int
    d2h_bytes: int
    h2d_pages: int
    h2d_bytes: int
    backups_done: int
    backups_skipped: int
    backups_failed: int
    loads: int
    loads_failed: int
    load_back_wait_ms: float
    l3_hit_tokens: int = 0
    l3: dict[str, int] | None = None  # the disk store's counters (spills, reads, GC, errors)
    remote: dict[str, int] | None = None  # the shared store's (in L3's place): hits, breaker, ...

    @classmethod
    def of(cls, engine: Engine) -> TierReport | None:
        stats, backups, loads = (
            engine.cache.transfer_stats(),
            engine.cache.backups,
            engine.cache.loads,
        )
        if stats is None or backups is None or loads is None or engine.cache.host_allocator is None:
            return None
        return cls(
            l2_hit_tokens=engine.hit_tokens[Tier.L2],
            host_pages=engine.cache.host_allocator.num_pages,
            host_pages_cached_end=engine.cache.tree.num_host_pages,
            d2h_pages=stats.d2h_pages,
            d2h_bytes=stats.d2h_bytes,
            h2d_pages=stats.h2d_pages,
            h2d_bytes=stats.h2d_bytes,
            backups_done=backups.stats.done,
            backups_skipped=backups.stats.skipped,
            backups_failed=backups.stats.failed,
            loads=loads.stats.loads,
            loads_failed=loads.stats.failed,
            load_back_wait_ms=round(loads.stats.wait_s * 1e3, 3),
            l3_hit_tokens=engine.hit_tokens[Tier.L3],
            l3=(
                dict(engine.cache.disk.store.stats().counters) | asdict(engine.cache.disk.stats)
                if engine.cache.disk is not None and engine.cache.remote is None
                else None
            ),
            remote=_remote_counters(engine),
        )

    def rows(self, cached_tokens: int) -> list[tuple[str, str]]:
        l3 = self.l3
        disk = (
            [
                (
                    "disk: spilled / reloaded pages",
                    f"{l3['pages_written']:,} / {l3['reloaded_pages']:,} "
                    f"(verify failures {l3['verify_failures']}, write errors "
                    f"{l3['write_errors']}, GC {l3['gc_reclaimed']:,})",
                )
            ]
            if l3 is not None
            else []
        )
        r = self.remote
        if r is not None:
            disk.append(
                (
                    "remote: published / fetched pages",
                    f"{r['pages_written']:,} (+{r['pages_present']:,} there) / "
                    f"{r['reloaded_pages']:,} (misses {r['misses']:,}, verify failures "
                    f"{r['verify_failures']}, timeouts {r['timeouts']}, breaker opens "
                    f"{r['breaker_opens']}, writes skipped {r['writes_skipped']:,})",
                )
            )
        return disk + [
            (
                "hit tokens L1 / L2 / L3",
                f"{cached_tokens - self.l2_hit_tokens - self.l3_hit_tokens:,} / "
                f"{self.l2_hit_tokens:,} / {self.l3_hit_tokens:,}",
            ),
            (
                "host pages (end / total)",
                f"{self.host_pages_cached_end:,} / {self.host_pages:,}",
            ),
            (
                "moved d2h / h2d",
                f"{self.d2h_pages:,} pages {self.d2h_bytes / 2**20:,.1f} MiB / "
                f"{self.h2d_pages:,} pages {self.h2d_bytes / 2**20:,.1f} MiB",
            ),
            (
                "backups done / skipped / failed",
                f"{self.backups_done:,} / {self.backups_skipped:,} / {self.backups_failed:,}",
            ),
            (
                "load-backs (failed), wait ms",
                f"{self.loads:,} ({self.loads_failed}), {self.load_back_wait_ms:.1f}",
            ),
        ]


@dataclass
class ReplaySummary:
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    seconds: float  # wall time in the engine
    ttft_ms: dict[str, float]
    pool_pages: int
    pool_pages_used_peak: int
    pool_pages_cached_end: int
    steps: int
    verify: VerifyReport
    config: dict[str, Any]
    errors: list[str]  # the first LISTED_ERRORS failures; ``failed`` counts them all
    skipped: tuple[SkippedLine, ...] = ()  # the first skipped trace lines; ``num_skipped`` counts
    num_skipped: int = 0
    interrupted: bool = False
    # Requests in the workload when known (generated ones), else those read before it ended.
    total_requests: int = 0
    tiers: TierReport | None = None  # what the L2 host tier did (None without one)
    tree: TreeStats | None = None  # the radix tree's own size at the end
    # TTFT's parts (queue wait, load-back wait, compute), and TTFT of requests served partly from
    # the cache against those computed whole: {name: {mean, p50, p90, p99}} in ms.
    ttft_parts_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    ttft_by_hit_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    clock: dict[str, Any] = field(default_factory=dict)  # kind, seconds (its time at the end), cost
    arrivals: str = "burst"
    cpu_seconds: float = 0.0  # CPU time of the replay's thread in the engine
    rank: int = 0  # the CP rank that wrote this summary (only rank 0's is printed)

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
            "interrupted": self.interrupted,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_ratio": round(self.hit_ratio, 6),
            "hit_tokens_by_tier": {
                "l1": self.cached_tokens
                - (self.tiers.l2_hit_tokens + self.tiers.l3_hit_tokens if self.tiers else 0),
                "l2": self.tiers.l2_hit_tokens if self.tiers else 0,
                "l3": self.tiers.l3_hit_tokens if self.tiers else 0,
            },
            "tiers": asdict(self.tiers) if self.tiers else None,
            "tree": (
                asdict(self.tree) | {"bytes_per_token": round(self.tree.bytes_per_token, 3)}
                if self.tree
                else None
            ),
            "computed_tokens": self.computed_tokens,
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
            "ttft_ms": self.ttft_ms,
            "ttft_parts_ms": self.ttft_parts_ms,
            "ttft_by_hit_ms": self.ttft_by_hit_ms,
            "arrivals": self.arrivals,
            "clock": self.clock,
            "seconds": round(self.seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "steps": self.steps,
            "pool": {
                "pages": self.pool_pages,
                "pages_used_peak": self.pool_pages_used_peak,
                "pages_cached_end": self.pool_pages_cached_end,
            },
            "verify": asdict(self.verify) | {"ok": self.verify.ok},
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
        ]
        if self.interrupted:
            rows.append(("interrupted", f"after {self.requests} of {self.total_requests} requests"))
        if self.num_skipped:
            rows.append(("skipped trace lines", f"{self.num_skipped:,}"))
        rows += [
            ("prompt tokens", f"{self.prompt_tokens:,}"),
            ("cached tokens", f"{self.cached_tokens:,}"),
            ("hit ratio", f"{self.hit_ratio:.4f}"),
            ("computed tokens", f"{self.computed_tokens:,}"),
            ("prefill tokens/s", f"{self.prefill_tokens_per_s:,.0f}"),
            ("arrivals, clock", f"{self.arrivals}, {self.describe_clock()}"),
            (
                "TTFT p50/p90/p99 ms",
                f"{self.ttft_ms['p50']:.2f} / {self.ttft_ms['p90']:.2f} / {self.ttft_ms['p99']:.2f}",
            ),
        ]
        if self.ttft_parts_ms:
            parts = self.ttft_parts_ms
            rows.append(
                (
                    "TTFT mean ms: queue + load + compute",
                    f"{self.ttft_ms['mean']:.2f} = {parts['queue']['mean']:.2f} + "
                    f"{parts['load_back']['mean']:.2f} + {parts['compute']['mean']:.2f}",
                )
            )
        rows += [
            (
                "pool pages used (peak / end / total)",
                f"{self.pool_pages_used_peak:,} / {self.pool_pages_cached_end:,} / {self.pool_pages:,}",
            ),
            ("engine steps", f"{self.steps:,}"),
        ]
        if self.tree is not None:
            rows.append(
                (
                    "tree nodes / bytes per token",
                    f"{self.tree.nodes:,} / {self.tree.bytes_per_token:.2f}",
                )
            )
        if self.tiers is not None:
            rows += self.tiers.rows(self.cached_tokens)
        if self.config.get("cp", 1) > 1:
            steps = ", ".join(f"{k} {v:,}" for k, v in self.config["cp_attention_steps"].items())
            moved = sum(self.config["cp_bytes_per_rank"].values())
            rows.append(
                (
                    "context parallel",
                    f"{self.config['cp']} ranks; steps by attention: {steps}; "
                    f"{moved / 2**20:,.1f} MiB exchanged by rank 0",
                )
            )
        if self.verify.requests:
            rows.append((f"verify ({self.verify.requests} requests)", self.verify.describe()))
        if self.verify.decode is not None:
            rows.append(("decode from handoff", self.verify.decode.describe()))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {val}" for k, val in rows)

    def describe_clock(self) -> str:
        """The clock the times are on, in words."""
        if not self.clock:
            return "wall"
        if self.clock["kind"] == "wall":
            return f"wall, {self.clock['seconds']:,.1f} s"
        cost = self.clock["cost"]
        return (
            f"simulated {self.clock['seconds']:,.1f} s ({cost['tokens_per_s']:,.0f} tokens/s, "
            f"h2d {cost['h2d_gbps']:g} / d2h {cost['d2h_gbps']:g} GB/s)"
        )

    def problems(self) -> list[str]:
        """The failed requests and skipped trace lines, one line each, cut at
        :data:`LISTED_ERRORS` of each with a count of the rest."""
        lines = [f"failed: {error}" for error in self.errors]
        if self.failed > len(self.errors):
            lines.append(f"failed: ... and {self.failed - len(self.errors):,} more")
        listed = self.skipped[:LISTED_ERRORS]
        lines += [f"skipped: line {s.line_no}: {s.reason}" for s in listed]
        if self.num_skipped > len(listed):
            lines.append(f"skipped: ... and {self.num_skipped - len(listed):,} more")
        return lines


def build_compute(cfg: ReplayConfig) -> Compute:
    """The model the replay runs (or synthetic payloads for ``model="none"``)."""
    if cfg.model == "none":
        return SyntheticCompute(cfg.kv_width, cfg.vocab_size)
    _, model = load_model(cfg.model, device=cfg.engine.device, dtype=cfg.dtype, seed=cfg.seed)
    model.use_attention(cfg.attention)
    PagedAttention.for_device(  # refuse a backend the device cannot run before any work
        cfg.attention, torch.device(cfg.engine.device), model.config.head_dim
    )
    dtype = next(model.parameters()).dtype
    if cfg.draft_model is None:
        return ModelCompute(model, dtype)
    _, draft = load_model(cfg.draft_model, device=cfg.engine.device, dtype=dtype, seed=cfg.seed)
    draft.use_attention(cfg.attention)
    return PairCompute(model, draft, dtype)


@dataclass(frozen=True)
class _Shape:
    """What the compute will be, known before its weights are loaded."""

    vocab_size: int
    max_seq_len: int
    layout: KVLayout
    weight_bytes: int


def _shape(cfg: ReplayConfig, compute: Compute | None) -> _Shape:
    if compute is None and cfg.model == "none":
        compute = SyntheticCompute(cfg.kv_width, cfg.vocab_size)  # allocates nothing
    if compute is not None:
        return _Shape(compute.vocab_size, compute.max_seq_len, compute.layout, 0)
    config = read_model_config(cfg.model)  # config.json only: weights come after the checks
    dtype = resolve_dtype(cfg.dtype, torch.device(cfg.engine.device))
    draft = read_model_config(cfg.draft_model) if cfg.draft_model is not None else None
    return _Shape(
        vocab_size=config.vocab_size,
        max_seq_len=min(
            config.max_position_embeddings,
            draft.max_position_embeddings if draft else config.max_position_embeddings,
        ),
        layout=config.kv_layout(str(dtype).removeprefix("torch."), draft=draft),
        weight_bytes=weight_bytes(config, dtype) + (weight_bytes(draft, dtype) if draft else 0),
    )


def _check_memory(cfg: ReplayConfig, shape: _Shape) -> None:
    engine = cfg.engine
    device = torch.device(engine.device)
    pool_bytes = engine.pool_pages * shape.layout.page_bytes(engine.page_size)
    allocator_bytes = engine.pool_pages * ALLOCATOR_BYTES_PER_PAGE
    if device.type == "cpu":
        parts = [(f"the L1 pool ({engine.pool_pages:,} pages)", pool_bytes + allocator_bytes)]
    else:
        check_fits(
            [("the page allocator", allocator_bytes)], torch.device("cpu"), "lower --l1-tokens"
        )
        parts = [(f"the L1 pool ({engine.pool_pages:,} pages)", pool_bytes)]
    if shape.weight_bytes:
        parts.append(("the model weights", shape.weight_bytes))
    check_fits(parts, device, hint="lower --l1-tokens")
    if engine.has_l2:  # the L2 host pool: pinned CPU memory, plus its allocator
        page_bytes = shape.layout.page_bytes(engine.page_size)
        host_pages = (
            engine.l2_tokens // engine.page_size
            if engine.l2_tokens
            else int(engine.l2_gib * 2**30) // page_bytes
        )
        host = host_pages * (page_bytes + ALLOCATOR_BYTES_PER_PAGE)
        cpu_parts = [(f"the L2 host pool ({host_pages:,} pages)", host)]
        if device.type == "cpu":
            cpu_parts = parts + cpu_parts
        check_fits(cpu_parts, torch.device("cpu"), hint="lower --l1-tokens or the L2 size")


def _percentiles(values: Sequence[float] | np.ndarray, mean: bool = False) -> dict[str, float]:
    """p50/p90/p99 (and the mean) of seconds, in ms rounded to the µs."""
    out = {"mean": 0.0} if mean else {}
    if not len(values):
        return out | {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    ms = np.asarray(values, dtype=np.float64) * 1e3
    q = np.percentile(ms, [50, 90, 99])
    if mean:
        out["mean"] = round(float(ms.mean()), 3)
    return out | {
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

    def __init__(
        self, size: int, seed: int, keep_logits: set[int], keep_handoff: set[int] | None = None
    ) -> None:
        self.size = size
        self._handoff = keep_handoff if keep_handoff is not None else set()
        self.decode = keep_handoff is not None
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
            self._handoff.discard(old)
            del self.requests[old]
            self.finished.pop(old, None)
            self._slots[slot] = request.rid
        self.requests[request.rid] = request
        self._keep.add(request.rid)
        if self._handoff is not self._keep and self.decode:
            self._handoff.add(request.rid)

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
    l2_cached_tokens: int = 0
    # Per served request (25 bytes each): TTFT, its queue and load-back parts, whether it hit.
    ttft_s: array[float] = field(default_factory=lambda: array("d"))
    queue_s: array[float] = field(default_factory=lambda: array("d"))
    load_wait_s: array[float] = field(default_factory=lambda: array("d"))
    hit: array[int] = field(default_factory=lambda: array("b"))
    errors: list[str] = field(default_factory=list)  # the first LISTED_ERRORS

    def add(self, f: Finished) -> None:
        self.requests += 1
        if f.error is not None:
            self.failed += 1
            if len(self.errors) < LISTED_ERRORS:
                self.errors.append(f.error)
            return
        self.prompt_tokens += f.prompt_len
        self.cached_tokens += f.cached_len
        self.computed_tokens += f.computed_len
        self.l2_cached_tokens += f.host_len
        self.ttft_s.append(f.ttft_s)
        self.queue_s.append(f.queue_s)
        self.load_wait_s.append(f.load_wait_s)
        self.hit.append(f.cached_len > 0)

    def totals(self) -> RequestTotals:
        return RequestTotals(
            self.requests, self.failed, self.prompt_tokens, self.cached_tokens, self.computed_tokens
        )

    def ttft_parts_ms(self) -> dict[str, dict[str, float]]:
        ttft, queue, load = (
            np.frombuffer(a, dtype=np.float64)
            for a in (self.ttft_s, self.queue_s, self.load_wait_s)
        )
        return {
            "queue": _percentiles(queue, mean=True),
            "load_back": _percentiles(load, mean=True),
            "compute": _percentiles(ttft - queue - load, mean=True),
        }

    def ttft_by_hit_ms(self) -> dict[str, dict[str, float]]:
        ttft = np.frombuffer(self.ttft_s, dtype=np.float64)
        hit = np.frombuffer(self.hit, dtype=np.int8).astype(bool)
        return {
            name: {"requests": int(mask.sum())} | _percentiles(ttft[mask], mean=True)
            for name, mask in (("cached", hit), ("recomputed", ~hit))
        }


#: Engine steps between returns of freed heap memory to the OS (see :func:`release_free_heap`).
TRIM_EVERY_STEPS = 256


def release_free_heap() -> None:
    """Hand memory that glibc's allocator keeps after frees back to the OS (``malloc_trim``).

    A long replay allocates and frees token, key and page arrays of every size; glibc keeps the
    freed blocks and peak RSS creeps up with the trace's length although live data stays flat
    (docs/benchmarks.md, "Streamed replay memory"). No-op where the C library has no
    ``malloc_trim``.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()


class EngineTimer:
    """Wall and CPU time (of the calling thread) spent in the engine: the CPU time is the
    steadier figure on a machine other processes share."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self._wall = self._cpu = 0.0

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def stop(self) -> None:
        self.wall_s += time.perf_counter() - self._wall
        self.cpu_s += time.thread_time() - self._cpu


class ReplayObserver(Protocol):
    """Watches a replay: the report's timeline and tests plug in here. Called outside the
    engine lock, from the replay's own thread."""

    def on_start(self, run: ReplayRun) -> None: ...

    def on_step(self, run: ReplayRun) -> None: ...

    def on_end(self, run: ReplayRun) -> None:
        """After the last step and the final drain; the metrics endpoint still serves."""
        ...


@dataclass
class ReplayRun:
    """A replay in progress: what observers see."""

    config: ReplayConfig
    engine: Engine
    tally: _Tally
    clock: Clock
    lock: threading.Lock  # held around every engine call; a metrics scrape takes it too
    metrics_url: str | None = None
    metrics: CacheMetrics | None = None  # the collector, while metrics are served


def run_replay(
    cfg: ReplayConfig,
    progress: bool = True,
    compute: Compute | None = None,
    observers: Sequence[ReplayObserver] = (),
) -> ReplaySummary:
    """Replay ``cfg.workload`` and return the summary (also used by tests and benchmarks).

    Requests enter the engine at their arrival time on the engine's clock (``cfg.arrivals``), and
    at most ``cfg.lookahead`` requests (default twice ``max_batch_requests``) are read ahead of
    the engine, counting those waiting and running; a finished request is folded into the
    summary's totals and dropped. Memory therefore holds the cache plus the requests in flight,
    whatever the workload's length. With ``cfg.metrics_port`` the engine's Prometheus metrics are
    served meanwhile.

    Runs with ``cfg.threads`` torch intra-op threads (restored afterwards). A KeyboardInterrupt
    while requests run ends the replay early: the summary covers the requests finished so far
    and says ``interrupted``.
    """
    if cfg.cp > 1 or under_torchrun():
        if compute is not None:
            raise ConfigError("a compute object cannot be shared by context-parallel ranks")
        if observers or cfg.metrics_port is not None:
            raise ConfigError(
                "--report and --metrics-port watch one engine; run them without context "
                "parallelism (--cp 1)"
            )
        if under_torchrun():  # this process is one rank of torchrun's world
            group = torchrun_group(cfg.engine.device, cfg.cp_timeout_s)
            return _rank_main(group, cfg, progress)
        with tempfile.TemporaryDirectory(prefix="kvstrata-handoff-") as tmp:
            if cfg.decode_tokens and cfg.handoff_dir is None:  # local ranks share this machine
                cfg = replace(cfg, handoff_dir=tmp)
            ranks = run_ranks(
                cfg.cp, _rank_main, (cfg, progress), cfg.engine.device, cfg.cp_timeout_s
            )
        summary: ReplaySummary = ranks[0]
        return summary
    return _rank_main(SoloGroup(), cfg, progress, compute, observers)


def _rank_main(
    group: Group,
    cfg: ReplayConfig,
    progress: bool,
    compute: Compute | None = None,
    observers: Sequence[ReplayObserver] = (),
) -> ReplaySummary:
    """One rank's replay (the only one without CP)."""
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, progress and group.rank == 0, compute, group, observers)
    finally:
        torch.set_num_threads(threads_before)


def cost_model(cfg: ReplayConfig) -> CostModel:
    """The simulated clock's cost model: ``cfg.cost``, or the device's measured defaults."""
    return cfg.cost or CostModel.for_device(cfg.engine.device)


def _agree_on_config(group: Group, cfg: ReplayConfig) -> None:
    """Every rank must run the same configuration: compare them, naming a field that differs."""
    if group.size == 1:
        return
    mine = {**asdict(cfg), "kvstrata": __version__, "torch": torch.__version__}
    # A store password is each rank's own business, and a mismatch message must not print it.
    url = _shown_url(cfg.engine.remote_url)
    mine["engine"] = {**mine["engine"], "remote_url": url, "remote_password": None}
    every = group.all_gather_object(mine, "config")
    for rank, other in enumerate(every):
        for name in sorted(mine):
            if other.get(name) != mine[name]:
                raise DivergenceError(
                    f"rank {rank} runs {name}={other.get(name)!r}, rank {group.rank} runs "
                    f"{name}={mine[name]!r}: start every rank with the same configuration"
                )


def _run(
    cfg: ReplayConfig,
    progress: bool,
    compute: Compute | None,
    group: Group,
    observers: Sequence[ReplayObserver] = (),
) -> ReplaySummary:
    if cfg.decode_tokens and cfg.handoff_dir is not None and group.rank == 0:
        DirectoryTransport(cfg.handoff_dir).clear()  # no rank sends before the ranks meet below
    _agree_on_config(group, cfg)
    shape = _shape(cfg, compute)
    # Under CP a request spreads over every rank's pool, so cp pools bound its length.
    pool_tokens = cfg.engine.pool_pages * cfg.engine.page_size * group.size
    requests: Iterator[Request] | None = iter(())  # rank > 0: they come from rank 0
    workload = None
    if group.rank == 0:  # only rank 0 reads the workload; it broadcasts what it reads
        workload = load_workload(
            cfg.workload,
            limit=cfg.limit,
            vocab_size=shape.vocab_size,
            on_error=cfg.on_error,
            max_tokens=min(shape.max_seq_len, pool_tokens),
        )
        stream = iter(workload)
        first = next(stream, None)  # an empty (or wholly malformed) workload fails early
        if first is None:
            skipped = (
                f" ({workload.num_skipped} malformed lines skipped)" if workload.num_skipped else ""
            )
            raise ConfigError(f"workload {cfg.workload!r} has no requests{skipped}")
        arrivals = cfg.arrivals.resolve(first)
        requests = itertools.chain([first], stream)
    else:  # rank 0 decides when requests arrive; the others only stamp what it sends
        arrivals = ArrivalSpec("burst", None, cfg.arrivals.time_scale)
    cost = cost_model(cfg)
    _check_memory(cfg, shape)
    compute = compute or build_compute(cfg)
    clock = make_clock(cfg.clock, cfg.model, cost)
    engine = Engine(compute, cfg.engine, group=group, clock=clock, model_id=model_id(cfg))
    sample = VerifySample(
        cfg.verify, cfg.seed, engine.keep_logits, engine.keep_handoff if cfg.decode_tokens else None
    )
    tally = _Tally()
    run = ReplayRun(cfg, engine, tally, clock, threading.Lock())
    server = None
    if cfg.metrics_port is not None:
        from prometheus_client import CollectorRegistry  # an extra: imported when asked for

        registry = CollectorRegistry()
        run.metrics = CacheMetrics(registry, engine, run.lock, tally.totals)
        server = MetricsServer(registry, cfg.metrics_host, cfg.metrics_port)
        run.metrics_url = server.url
    try:
        feed = _Feed(group, requests, ArrivalTimes(arrivals, cfg.seed), clock)
        total = workload.num_requests if workload is not None else None
        interrupted, timer, read = _drive(cfg, run, feed, sample, observers, progress, total)
        for observer in observers:
            observer.on_end(run)
    finally:
        if server is not None:
            server.close()
        engine.close()  # the disk tier's threads and files

    verify = VerifyReport()
    transport = handoff_transport(cfg, group) if cfg.decode_tokens else None
    if not interrupted and transport is not None:  # every rank hands its part of each sample
        for f in sample.finished.values():
            if f.handoff is not None:
                transport.send(f.handoff)
    if not interrupted and group.rank == 0:  # recomputing without the cache needs no peers
        sampled = [f for f in sample.finished.values() if f.error is None]
        try:
            verify = _verify(cfg, compute, sampled, sample.requests, progress, transport)
        except KeyboardInterrupt:
            interrupted = True
    lookahead = cfg.lookahead or 2 * cfg.engine.max_batch_requests
    return ReplaySummary(
        requests=tally.requests,
        failed=tally.failed,
        prompt_tokens=tally.prompt_tokens,
        cached_tokens=tally.cached_tokens,
        computed_tokens=tally.computed_tokens,
        seconds=timer.wall_s,
        cpu_seconds=timer.cpu_s,
        ttft_ms=_percentiles(tally.ttft_s, mean=True),
        pool_pages=engine.cache.allocator.num_pages,
        pool_pages_used_peak=engine.peak_pages_used,
        pool_pages_cached_end=engine.cache.tree.num_pages,
        steps=engine.steps,
        verify=verify,
        config={
            "workload": workload.source if workload is not None else cfg.workload,
            "limit": cfg.limit,
            "skipped_lines": workload.num_skipped if workload is not None else 0,
            "model": cfg.model,
            "dtype": str(next(iter(compute.layout.payloads)).dtype),
            "vocab_size": compute.vocab_size,
            "page_size": cfg.engine.page_size,
            "l1_tokens": cfg.engine.pool_tokens,
            "l2_tokens": cfg.engine.l2_tokens,
            "l2_gib": cfg.engine.l2_gib,
            "l3_dir": cfg.engine.l3_dir,
            "l3_gib": cfg.engine.l3_gib if cfg.engine.l3_dir else None,
            "l3_start": cfg.engine.l3_start if cfg.engine.l3_dir else None,
            "l3_min_hits": cfg.engine.l3_min_hits if cfg.engine.l3_dir else None,
            "remote": _shown_url(cfg.engine.remote_url),
            "remote_gib": cfg.engine.remote_gib if cfg.engine.remote_url else None,
            "remote_timeout_ms": cfg.engine.remote_timeout_ms if cfg.engine.remote_url else None,
            "remote_min_hits": cfg.engine.remote_min_hits if cfg.engine.remote_url else None,
            "host_layout": cfg.engine.host_layout if cfg.engine.has_l2 else None,
            "write_policy": cfg.engine.write_policy if cfg.engine.has_l2 else None,
            "write_through_hits": cfg.engine.write_through_hits if cfg.engine.has_l2 else None,
            "chunk_size": cfg.engine.chunk_size,
            "max_batch_tokens": cfg.engine.max_batch_tokens,
            "max_batch_requests": cfg.engine.max_batch_requests,
            "lookahead": lookahead,
            "eviction": cfg.engine.eviction,
            "device": cfg.engine.device,
            "kv_width": cfg.kv_width if cfg.model == "none" else None,
            "verify": cfg.verify,
            "draft_model": cfg.draft_model,
            "decode_tokens": cfg.decode_tokens,
            "handoff_dir": cfg.handoff_dir,
            "seed": cfg.seed,
            "threads": torch.get_num_threads(),
            "arrivals": arrivals.describe(),
            "time_scale": arrivals.time_scale,
            "clock": clock.kind,
            "cp": group.size,
            "cp_attention": cfg.engine.cp_attention if group.size > 1 else None,
            "cp_attention_steps": dict(engine.strategy_steps),
            "cp_bytes_per_rank": dict(group.traffic.bytes),
            "attention": cfg.attention if cfg.model != "none" else None,
        },
        errors=tally.errors,
        skipped=tuple(workload.skipped) if workload is not None else (),
        num_skipped=workload.num_skipped if workload is not None else 0,
        interrupted=interrupted,
        total_requests=(workload.num_requests if workload is not None else None) or read,
        tiers=TierReport.of(engine),
        tree=engine.cache.tree.stats(),
        ttft_parts_ms=tally.ttft_parts_ms(),
        ttft_by_hit_ms=tally.ttft_by_hit_ms(),
        clock={
            "kind": clock.kind,
            "seconds": round(clock.now(), 6),
            "cost": asdict(cost) if clock.kind == "sim" else None,
        },
        arrivals=arrivals.describe(),
        rank=group.rank,
    )


class _Feed:
    """Hands the replay the requests that have arrived, the same ones on every rank.

    Rank 0 reads the workload, gives each request its arrival time, and decides by its clock
    which have arrived; under context parallelism it broadcasts them, with their arrival times
    and when the next one comes, so every rank adds the same requests at the same step.
    """

    def __init__(
        self,
        group: Group,
        requests: Iterator[Request] | None,
        arrival_times: ArrivalTimes,
        clock: Clock,
    ) -> None:
        self.group = group
        self.requests = requests
        self.arrival_times = arrival_times
        self.clock = clock
        self.pending: tuple[Request, float] | None = None  # read, not arrived yet
        self.more = True

    def take(self, count: int, idle: bool) -> tuple[list[tuple[Request, float]], float | None]:
        """Up to ``count`` arrived requests with their arrival times, and, when the engine is
        ``idle`` and none has arrived, when the next one does (None: no more requests).
        ``count`` and ``idle`` come from replicated state, so every rank calls this at the
        same points."""
        batch: list[tuple[Request, float]] = []
        wake: float | None = None
        if self.group.rank == 0:
            while len(batch) < count:
                if self.pending is None:
                    request = next(self.requests, None) if self.requests is not None else None
                    if request is None:
                        self.requests = None
                        break
                    self.pending = (request, self.arrival_times.next(request))
                if self.pending[1] > self.clock.now():
                    break
                batch.append(self.pending)
                self.pending = None
            self.more = self.pending is not None or self.requests is not None
            if idle and not batch and self.pending is not None:
                wake = self.pending[1]
        if self.group.size == 1:
            return batch, wake
        sent = self.group.broadcast_object(
            ([(r.rid, r.tokens, r.arrival_ms, t) for r, t in batch], wake, self.more), "workload"
        )
        self.more = sent[2]
        return [(Request(rid, tok, ms), t) for rid, tok, ms, t in sent[0]], sent[1]


def _drive(
    cfg: ReplayConfig,
    run: ReplayRun,
    feed: _Feed,
    sample: VerifySample,
    observers: Sequence[ReplayObserver],
    progress: bool,
    total: int | None,
) -> tuple[bool, EngineTimer, int]:
    """The replay loop. Returns (interrupted, the time spent in the engine, requests read).

    Each turn adds the requests that have arrived by now (the window permitting), then runs one
    engine step; with nothing to run it lets the clock pass to the next arrival. Engine time is
    spent in the engine (adding requests hashes them; stepping), not in reading or generating the
    workload, nor idling between arrivals.
    """
    engine, tally, clock, lock = run.engine, run.tally, run.clock, run.lock
    lookahead = cfg.lookahead or 2 * cfg.engine.max_batch_requests
    read = 0  # requests added to the engine
    timer = EngineTimer()
    interrupted = False
    for observer in observers:
        observer.on_start(run)
    try:
        with Progress("replay", total, enabled=progress) as bar:
            while True:
                with lock:
                    want = lookahead - (read - tally.requests)
                    wake = None
                    if feed.more and want > 0:
                        batch, wake = feed.take(want, idle=not engine.has_work())
                        read += len(batch)
                        timer.start()
                        while batch:  # hand each request over and drop it: none outlives it
                            request, arrived_at = batch.pop(0)
                            sample.offer(request)
                            engine.add(request, arrived_at)
                            del request
                        timer.stop()
                    if not engine.has_work():
                        if wake is None and not feed.more:
                            break
                        if wake is not None:
                            clock.wait_until(wake)  # idle: let time pass to the next arrival
                        continue
                    timer.start()
                    done = engine.step()
                    timer.stop()
                if engine.steps % TRIM_EVERY_STEPS == 0:
                    release_free_heap()
                for f in done:
                    tally.add(f)
                    sample.collect(f)
                for observer in observers:
                    observer.on_step(run)
                bar.update(len(done), sum(f.computed_len for f in done))
    except KeyboardInterrupt:
        interrupted = True
    if not interrupted:
        with lock:
            timer.start()
            engine.drain()  # settle the copies still in flight, so the tiers report final state
            timer.stop()
    return interrupted, timer, read


def recompute_uncached(compute: Compute, config: EngineConfig, request: Request) -> torch.Tensor:
    """Last-token logits of ``request`` computed by a fresh engine with an empty cache (same
    page size and chunking), sized for that one request."""
    finished = prefill_uncached(compute, config, request)
    assert finished.logits is not None
    return finished.logits


def prefill_uncached(
    compute: Compute,
    config: EngineConfig,
    request: Request,
    handoff: bool = False,
    model_id: str = "model",
) -> Finished:
    """``request`` prefilled by a fresh engine with an empty cache (same page size and
    chunking), sized for that one request; its logits (and draft logits) kept, and with
    ``handoff`` its KV exported."""
    P = config.page_size
    pool_tokens = page_span(request.tokens.size, P) * P
    fields = {
        **asdict(config),
        "pool_tokens": pool_tokens,
        "l2_tokens": 0,
        "l2_gib": 0.0,
        "l3_dir": None,
        "remote_url": None,  # the reference computes everything itself
    }
    solo = Engine(compute, EngineConfig(**fields), model_id=model_id)
    solo.keep_logits = {request.rid}
    if handoff:
        solo.keep_handoff = {request.rid}
    solo.add(request)
    out: list[Finished] = []
    while solo.has_work():
        out.extend(solo.step())
    (finished,) = out
    if finished.error is not None or finished.logits is None:
        raise ConfigError(f"request {request.rid} cannot be recomputed: {finished.error}")
    return finished


def _verify(
    cfg: ReplayConfig,
    compute: Compute,
    sampled: list[Finished],
    requests: dict[int, Request],
    progress: bool,
    transport: HandoffTransport | None,
) -> VerifyReport:
    """Recompute each sampled request with an empty cache and compare with the cached run; with
    ``--decode-tokens``, decode from both runs' handoffs and compare those too."""
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
    draft = isinstance(compute, PairCompute)
    diffs = {"target": 0.0, "draft": 0.0}
    agree = {"target": 0, "draft": 0}
    nonfinite = 0
    decoder = _Decoder(cfg, compute) if cfg.decode_tokens else None
    with Progress("verify", len(sampled), enabled=progress) as bar:
        for f in sampled:
            fresh = prefill_uncached(
                compute, cfg.engine, requests[f.rid], decoder is not None, model_id(cfg)
            )
            pairs = [("target", fresh.logits, f.logits)]
            if draft:
                pairs.append(("draft", fresh.draft_logits, f.draft_logits))
            for name, a, b in pairs:
                assert a is not None and b is not None
                diff, bad = compare_logits(a, b)
                diffs[name] = max(diffs[name], diff)
                nonfinite += bad
                agree[name] += int(not bad and int(a.argmax()) == int(b.argmax()))
            if decoder is not None:
                assert transport is not None
                decoder.compare(f, fresh, transport.receive(f.rid, cfg.cp_timeout_s))
            bar.update(1)
    report.max_abs_logit_diff = diffs["target"]
    report.argmax_agree = agree["target"] / len(sampled)
    if draft:
        report.draft_max_abs_logit_diff = diffs["draft"]
        report.draft_argmax_agree = agree["draft"] / len(sampled)
    report.nonfinite_logits = nonfinite
    if decoder is not None:
        report.decode = decoder.report()
    return report


class _Decoder:
    """``--decode-tokens``: greedy decoding from a request's handoff (its parts from every rank,
    assembled) against decoding from a prefill of it with an empty cache."""

    def __init__(self, cfg: ReplayConfig, compute: Compute) -> None:
        self.draft: LlamaModel | None = None
        if isinstance(compute, PairCompute):
            self.target, self.draft = compute.target, compute.draft
        else:
            assert isinstance(compute, ModelCompute)
            self.target = compute.model
        self.num_tokens = cfg.decode_tokens
        self.fingerprint = layout_fingerprint(model_id(cfg), compute.layout, cfg.engine.page_size)
        self.requests = self.equal = self.hit_requests = self.handoff_bytes = 0
        self.agreed: dict[str, list[bool]] = {"cached": [], "uncached": []}

    def _decode(self, parts: list[Handoff], f: Finished) -> Decoded:
        assert f.logits is not None
        kv = assemble(parts, self.fingerprint)
        return greedy_decode(kv, self.target, f.logits, self.num_tokens, self.draft, f.draft_logits)

    def compare(self, cached: Finished, fresh: Finished, parts: list[Handoff]) -> None:
        assert fresh.handoff is not None
        self.handoff_bytes += sum(p.nbytes for p in parts)
        a, b = self._decode(parts, cached), self._decode([fresh.handoff], fresh)
        self.requests += 1
        # The same tokens, and the same draft verdict at every position (a wrong draft KV would
        # change the draft's proposals, not the target's tokens).
        self.equal += int(a.tokens == b.tokens and a.draft_agreed == b.draft_agreed)
        if cached.cached_len:
            self.hit_requests += 1
            self.agreed["cached"].extend(a.draft_agreed)
            self.agreed["uncached"].extend(b.draft_agreed)

    def report(self) -> DecodeReport:
        def rate(name: str) -> float | None:
            values = self.agreed[name]
            return round(sum(values) / len(values), 6) if values else None

        return DecodeReport(
            requests=self.requests,
            tokens=self.num_tokens,
            tokens_equal=self.equal,
            hit_requests=self.hit_requests,
            acceptance_cached=rate("cached"),
            acceptance_uncached=rate("uncached"),
            handoff_bytes=self.handoff_bytes,
        )


def _shown_url(url: str | None) -> str | None:
    """A store URL without its password (what the JSON shows)."""
    from .tiers.remote.config import parse_url

    return parse_url(url).shown if url is not None else None


def _remote_counters(engine: Engine) -> dict[str, int] | None:
    """The shared store's counters and what the engine did with it, when it has one."""
    remote, disk = engine.cache.remote, engine.cache.disk
    if remote is None or disk is None:
        return None
    stats = remote.stats()
    return (
        dict(stats.counters)
        | asdict(disk.stats)
        | {"writes_skipped": stats.writes_skipped, "used_bytes": stats.used_bytes}
    )


def model_id(cfg: ReplayConfig) -> str:
    """What the cache's namespace and the handoff's fingerprint name the compute by."""
    if cfg.model == "none":
        return f"none:{cfg.kv_width}:{cfg.vocab_size}"
    return cfg.model if cfg.draft_model is None else f"{cfg.model}+draft:{cfg.draft_model}"


def handoff_transport(cfg: ReplayConfig, group: Group) -> HandoffTransport:
    """How a replay's ranks hand parts to the decoder on rank 0: in memory with one rank, through
    ``cfg.handoff_dir`` with several."""
    if group.size == 1:
        return LoopbackTransport()
    if cfg.handoff_dir is None:
        raise ConfigError(
            "--decode-tokens under context parallelism needs --handoff-dir DIR, a directory "
            "every rank can write and rank 0 can read"
        )
    return DirectoryTransport(cfg.handoff_dir)


def compare_logits(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """``(largest |a - b| over positions finite on both sides, NaN/inf values in a and b)``.

    A NaN difference is never 0: ``max()`` over floats silently drops NaN, so non-finite values
    are counted apart and each is a failure for the caller.
    """
    finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
    nonfinite = int((~finite_a).sum()) + int((~finite_b).sum())
    both = finite_a & finite_b
    diff = (a.double() - b.double()).abs()[both]  # float64: finite logits, finite difference
    return (float(diff.max()) if diff.numel() else 0.0), nonfinite
