"""The replay's summary: :class:`ReplaySummary`, its table and its JSON form (``to_json()``,
versioned by ``SUMMARY_SCHEMA``), gathered from a finished run by :func:`summarize`. The config
block is derived from the config dataclasses, not written key by key: every knob appears under
its field's name."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..cache.node import TreeStats
from ..dist.group import Group
from ..model.compute import Compute
from ..workloads import SkippedLine
from .config import ReplayConfig
from .cost import describe_cost
from .feed import WorkloadSource
from .planning import planner_block, planner_rows
from .reports import TierReport, VerifyReport
from .state import LISTED_ERRORS, Driven, ReplayRun, percentiles

#: 2: TTFT counts from each request's arrival (``ttft_ms`` gains ``mean``), with ``ttft_parts_ms``,
#: ``ttft_by_hit_ms``, ``clock`` and ``arrivals``.
SUMMARY_SCHEMA = 2


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
    # The capacity planner's answers on the simulated clock (replay/planning.py); None on wall.
    planner: dict[str, Any] | None = None

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
            "planner": self.planner,
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
        cost = self.clock.get("cost") if self.clock else None
        if cost is not None and "provenance" in cost:
            rows.append(("cost profile", self.describe_profile()))
        if self.clock.get("disk_wait_s"):
            rows.append(("disk wait (sim)", f"{self.clock['disk_wait_s'] * 1e3:,.1f} ms in all"))
        rows += planner_rows(self.planner, bool(self.config.get("l3_dir")))
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
        if self.clock["kind"] in ("wall", "cpu"):
            return f"{self.clock['kind']}, {self.clock['seconds']:,.1f} s"
        cost = self.clock["cost"]
        if "provenance" in cost:
            return f"simulated {self.clock['seconds']:,.1f} s (profile {cost['name']})"
        return (
            f"simulated {self.clock['seconds']:,.1f} s ({cost['tokens_per_s']:,.0f} tokens/s, "
            f"h2d {cost['h2d_gbps']:g} / d2h {cost['d2h_gbps']:g} GB/s)"
        )

    def describe_profile(self) -> str:
        """The cost profile, its kind and provenance, in words (an estimate says so)."""
        cost = self.clock["cost"]
        prov = cost["provenance"]
        err = prov.get("fit_error", {})
        fit = f", fit error mean {err['mean']:.1%}" if "mean" in err else ""
        kind = (
            "ESTIMATE from the model's shape and the device's matmul rate, not calibrated"
            if cost["kind"] == "estimate"
            else cost["kind"]
        )
        missing = (
            "; MISSING prefix_pair_s (calibrated before the term): pairs over a prefix charged "
            "at pair_s"
            if cost.get("prefix_pair_s") is None and cost["kind"] != "flat"
            else ""
        )
        return (
            f"{cost['name']}: {kind}; {prov['model']} {prov['dtype']} on {prov['device']}"
            f"{fit}{', ' + prov['date'] if prov.get('date') else ''}{missing}"
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


#: ReplayConfig fields the config block does not copy as they are: ``engine``'s fields are copied
#: flat beside the others, ``arrivals`` is described (with ``time_scale`` beside it), and
#: ``cost`` is under the summary's ``clock``.
_NOT_COPIED = ("engine", "arrivals", "cost")
#: Config fields the block names otherwise (the CLI's flag names).
_RENAMED = {"pool_tokens": "l1_tokens", "remote_url": "remote"}
#: Config fields the block never shows (a store password is each rank's own business).
_HIDDEN = ("remote_password",)


def shown_url(url: str | None) -> str | None:
    """A store URL without its password (what the JSON and messages show)."""
    from ..tiers.remote.config import parse_url

    return parse_url(url).shown if url is not None else None


def config_block(
    cfg: ReplayConfig, run: ReplayRun, group: Group, source: WorkloadSource, compute: Compute
) -> dict[str, Any]:
    """The summary's ``config``: every field of ``cfg`` and ``cfg.engine`` (None where it does
    not apply to this run), then what the run resolved: the workload's source, the model's
    dtype and vocabulary, the look-ahead, the threads, the arrivals, the clock, the ranks."""
    engine = cfg.engine
    block = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in _NOT_COPIED}
    block |= {_RENAMED.get(k, k): v for k, v in asdict(engine).items() if k not in _HIDDEN}
    block["remote"] = shown_url(engine.remote_url)
    block["sim_links"] = asdict(cfg.sim_links)
    applies = {
        ("l3_gib", "l3_start", "l3_min_hits", "l3_io"): bool(engine.l3_dir),
        (
            "remote_gib",
            "remote_timeout_ms",
            "remote_min_hits",
            "remote_connections",
            "remote_publish_window",
        ): bool(engine.remote_url),
        ("host_layout", "write_policy", "write_through_hits"): engine.has_l2,
        ("kv_width",): cfg.model == "none",
        ("attention",): cfg.model != "none",
        ("cp_attention", "cp_timeout_s", "check_digests"): group.size > 1,
        ("metrics_host",): cfg.metrics_port is not None,
    }
    for names, used in applies.items():
        if not used:
            block |= dict.fromkeys(names)
    workload, arrivals = source.workload, source.arrivals
    return block | {
        "workload": workload.source if workload is not None else cfg.workload,
        "skipped_lines": workload.num_skipped if workload is not None else 0,
        "dtype": str(next(iter(compute.layout.payloads)).dtype),
        "vocab_size": compute.vocab_size,
        "lookahead": cfg.lookahead or 2 * engine.max_batch_requests,
        "threads": torch.get_num_threads(),
        "arrivals": arrivals.describe(),
        "time_scale": arrivals.time_scale,
        "clock": run.clock.kind,
        "cp": group.size,
        "cp_attention_steps": dict(run.engine.strategy_steps),
        "cp_bytes_per_rank": dict(group.traffic.bytes),
    }


def summarize(
    run: ReplayRun,
    group: Group,
    source: WorkloadSource,
    compute: Compute,
    driven: Driven,
    verify: VerifyReport,
) -> ReplaySummary:
    """The summary of ``run`` as it ended (``driven``), with what ``--verify`` found."""
    cfg, engine, tally, clock = run.config, run.engine, run.tally, run.clock
    workload = source.workload
    return ReplaySummary(
        requests=tally.requests,
        failed=tally.failed,
        prompt_tokens=tally.prompt_tokens,
        cached_tokens=tally.cached_tokens,
        computed_tokens=tally.computed_tokens,
        seconds=driven.timer.wall_s,
        cpu_seconds=driven.timer.cpu_s,
        ttft_ms=percentiles(tally.ttft_s, mean=True),
        pool_pages=engine.cache.allocator.num_pages,
        pool_pages_used_peak=engine.peak_pages_used,
        pool_pages_cached_end=engine.cache.tree.num_pages,
        steps=engine.steps,
        verify=verify,
        config=config_block(cfg, run, group, source, compute),
        errors=tally.errors,
        skipped=tuple(workload.skipped) if workload is not None else (),
        num_skipped=workload.num_skipped if workload is not None else 0,
        interrupted=driven.interrupted,
        total_requests=(workload.num_requests if workload is not None else None) or driven.read,
        tiers=TierReport.of(engine),
        tree=engine.cache.tree.stats(),
        ttft_parts_ms=tally.ttft_parts_ms(),
        ttft_by_hit_ms=tally.ttft_by_hit_ms(),
        clock={
            "kind": clock.kind,
            "seconds": round(clock.now(), 6),
            "startup_s": round(run.startup_s, 6),  # counted before the loop, then zeroed
            "cost": describe_cost(run.cost) if run.cost is not None else None,
            "disk_wait_s": round(getattr(clock, "disk_wait_s", 0.0), 6),
            "disk_busy_s": round(getattr(clock, "disk_busy_s", 0.0), 6),
            # Steps' own time on the clock (sim: their cost; wall / cpu: the engine's time).
            "busy_s": round(
                getattr(
                    clock,
                    "busy_s",
                    driven.timer.cpu_s if clock.kind == "cpu" else driven.timer.wall_s,
                ),
                6,
            ),
        },
        arrivals=source.arrivals.describe(),
        rank=group.rank,
        planner=planner_block(engine, tally, run.cost),
    )
