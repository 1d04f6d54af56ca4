"""The ``kvstrata`` command line: a thin skin over the config dataclasses.

kvstrata replay         run a workload through the prefill engine and report the cache's savings
kvstrata sweep          replay one workload over several cache sizes and policies, in one report
kvstrata compare        two replay results side by side, with ratios
kvstrata check-model    compare a checkpoint's logits with transformers before serving it
kvstrata bench radix    radix tree speed on the shared synthetic workload
kvstrata bench prefill  prefill tokens/s against transformers on the same inputs
kvstrata bench planner  one owner-lane eviction plan on the production fork's worst case
kvstrata bench transfer batched page copies device <-> host against a contiguous pinned copy
kvstrata bench workload workload statistics: sizes, unique tokens, ideal hit ratio
kvstrata bench memory   peak RSS of a streamed replay at several workload sizes
kvstrata bench replay   cache-only replay speed on a whole trace, and what metrics cost
kvstrata bench cp       bytes moved and step time of both CP attention strategies, cp = 1, 2, 4
kvstrata bench disk     spill and reload through the disk tier against dd with O_DIRECT
kvstrata disk check     audit a disk tier directory: slabs against the index (--fix repairs)
kvstrata bench attention paged attention kernels against SDPA on the same pages (CUDA)
kvstrata bench gpu      end-to-end GPU figures: ceilings, replay, L1/L2 TTFT, write-through

Errors in the input end in one stderr line and exit status 2; :mod:`kvstrata.command` lists the
exit codes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import __version__
from .clock import CLOCKS, COST_DEFAULTS
from .command import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    CommandParser,
    HelpFormatter,
    run_command,
)
from .config import DEFAULT_HOST_LAYOUT, HOST_LAYOUTS, WRITE_POLICIES
from .model.attention import ATTENTION_BACKENDS
from .tiers.remote.config import password_from_env

if TYPE_CHECKING:
    from .replay import ReplayConfig, ReplayObserver, ReplayRun

#: Default torch intra-op threads of ``replay``: one, because the engine's per-step ops are small
#: and two threads make a replay 10-20x slower as soon as another process uses a core
#: (docs/benchmarks.md, "CPU threads"), while they gain at most ~1.3x on an idle machine.
DEFAULT_THREADS = 1
#: ``kvstrata bench NAME`` runs ``run_main`` of ``kvstrata.benchmarks`` module
#: :func:`bench_module` ``(NAME)``: NAME itself, with its hyphens dropped (``multi-gpu``).
BENCHMARKS = (
    "radix",
    "prefill",
    "planner",
    "transfer",
    "workload",
    "memory",
    "cp",
    "disk",
    "remote",
    "attention",
    "gpu",
    "replay",
    "multi-gpu",
)


def bench_module(name: str) -> str:
    """The module under ``kvstrata.benchmarks`` that runs ``kvstrata bench NAME``."""
    return name.replace("-", "")


def _replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a workload through the engine (the main job)",
        description="Replay a workload through the prefill engine on top of the prefix cache and "
        "report what the cache saved: hit ratio, computed tokens, prefill tokens/s, TTFT "
        "(from each request's arrival) and its parts, pool usage. With no arguments: the "
        "built-in workload through the `tiny` model on the CPU. The last line of output is a "
        "JSON summary with --json.",
        formatter_class=HelpFormatter,
    )
    _workload_flags(p, model_default="tiny")
    _engine_flags(p, grid=False)
    _timing_flags(p)
    p.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="N",
        help="recompute N sampled requests without the cache and report the largest |logit "
        "difference| and argmax agreement (payload bytes with --model none)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="MODEL",
        help="a speculative draft model prefilled in the same step, its K/V on the target's "
        "pages in every tier: a preset (tiny-draft: tiny's first layer) or a checkpoint "
        "directory; same vocabulary as --model, at most its layers",
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=0,
        metavar="N",
        help="greedy-decode N tokens from the prefill -> decode handoff of each --verify request "
        "(its KV assembled from every rank's pages) and from an uncached prefill of it; reports "
        "whether the tokens agree and, with --draft-model, the draft's acceptance rate both ways",
    )
    p.add_argument(
        "--handoff-dir",
        default=None,
        metavar="DIR",
        help="with --decode-tokens under torchrun: a directory every rank writes its handoff "
        "parts to and rank 0 reads (local --cp ranks use a temporary one)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="P",
        help="serve Prometheus metrics on this port while replaying (0: any free port; the URL "
        "goes to stderr); on 127.0.0.1 unless --metrics-host says otherwise",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address --metrics-port listens on; anything but a loopback address exposes "
        "the metrics to the network",
    )
    p.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="write DIR/report.html with plots (hit ratio over time by tier, tier occupancy, "
        "bytes moved, TTFT distribution) and DIR/summary.json; needs matplotlib "
        "(pip install 'kvstrata[report]')",
    )
    p.add_argument(
        "--fail-on-error",
        action="store_true",
        help="exit 1 if any request failed (without it: only if every request failed)",
    )
    p.add_argument(
        "--check", action="store_true", help="debug: check every invariant after each step"
    )
    p.add_argument("--json", action="store_true", help="print the JSON summary as the last line")
    _progress_flag(p)
    p.set_defaults(func=_run_replay)


def _workload_flags(p: argparse.ArgumentParser, model_default: str) -> None:
    p.add_argument(
        "--trace",
        "--workload",
        dest="workload",
        default="builtin",
        help="'builtin', 'synthetic[:SEED[:N]]', 'agentic[:SEED[:N]]' (long agentic coding "
        "sessions, README 'Workloads'), or a Mooncake JSONL trace file (each hash id is a "
        "512-token block); read lazily, never loaded whole",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--model",
        default=model_default,
        help="a preset (tiny, tiny-qwen2, tiny-qwen3, small, llama-3.2-1b), a Hugging Face "
        "checkpoint directory (config.json + *.safetensors), or 'none' for cache-only replay "
        "with synthetic KV payloads",
    )
    p.add_argument(
        "--dtype", default=None, help="float32 or bfloat16 (default: fp32 on CPU, bf16 on GPU)"
    )
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument(
        "--attention",
        choices=list(ATTENTION_BACKENDS),
        default="auto",
        help="attention over the paged K/V: triton (CUDA: a kernel reads the pages in place), sdpa "
        "(torch SDPA per request, gathering a cached prefix; the CPU path), auto (triton on CUDA, "
        "sdpa on CPU); no silent fallback",
    )
    p.add_argument(
        "--kv-width", type=int, default=64, help="with --model none: synthetic KV bytes per token"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=128_256,
        help="with --model none: the vocabulary token ids are mapped into; hit ratios equal a "
        "model's when this equals its vocabulary (a model run always uses the model's)",
    )
    p.add_argument(
        "--on-error",
        choices=["stop", "skip"],
        default="stop",
        help="a malformed trace line: stop with its line number, or skip it (and count it)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for preset weights, --verify sampling and poisson arrivals",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        metavar="N",
        help="torch intra-op CPU threads; more than 1 helps only a large model on an idle machine "
        "and slows the engine's small per-step ops 10-20x when other processes use the CPU",
    )
    p.add_argument(
        "--lookahead",
        type=int,
        default=None,
        metavar="N",
        help="requests read ahead of the engine, waiting or running (default: 2 x "
        "--max-batch-requests); replay memory holds the cache plus these",
    )


def _engine_flags(p: argparse.ArgumentParser, grid: bool) -> None:
    """The engine's knobs; with ``grid`` (sweep), the swept ones take several values."""
    many: dict[str, Any] = {"nargs": "+"} if grid else {}
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument(
        "--l1-tokens",
        "--pool-tokens",
        dest="l1_tokens",
        type=str if grid else int,
        default=["262144"] if grid else 262_144,
        metavar="N",
        help="device pool (L1) size in tokens"
        + ("; several sizes (k, M, G suffixes: 2**10, 2**20, 2**30)" if grid else ""),
        **many,
    )
    p.add_argument(
        "--l2-tokens",
        type=str if grid else int,
        default=["0"] if grid else 0,
        metavar="N",
        help="host pool (L2) size in tokens: pinned host memory on a CUDA machine, plain memory "
        "otherwise; 0" + (" (no L2)" if grid else " with no --l2-gib: no L2"),
        **many,
    )
    if not grid:
        p.add_argument(
            "--l2-gib",
            type=float,
            default=0.0,
            help="host pool (L2) size in GiB (instead of --l2-tokens)",
        )
    p.add_argument(
        "--host-layout",
        choices=list(HOST_LAYOUTS),
        default=DEFAULT_HOST_LAYOUT,
        help="L2 page layout: page_first keeps one page's layers together (one extent per page "
        "for the disk tier), layer_first mirrors the device pool; both copy at the same speed",
    )
    p.add_argument(
        "--write-policy",
        choices=list(WRITE_POLICIES),
        default=["write_through"] if grid else "write_through",
        help="when device pages are backed up to L2: write_through (every computed chunk, layer "
        "by layer during the forward), write_through_selective (a node once hit "
        "--write-through-hits times), write_back (a node when L1 eviction would drop it)",
        **many,
    )
    p.add_argument(
        "--write-through-hits",
        type=int,
        default=2,
        metavar="N",
        help="with write_through_selective: back a node up once it has N hits",
    )
    p.add_argument(
        "--l3-dir",
        default=None,
        metavar="DIR",
        help="the disk tier (L3): a directory of preallocated, checksummed slab files and an "
        "LMDB index; committed host pages spill there and misses reload from it (needs an L2)",
    )
    p.add_argument("--l3-gib", type=float, default=0.0, help="disk bytes of the L3 slabs, in GiB")
    p.add_argument(
        "--l3-start",
        choices=["clear", "load"],
        default="clear",
        help="clear: start with an empty disk tier; load: keep (and verify) what DIR holds",
    )
    p.add_argument(
        "--l3-min-hits",
        type=int,
        default=1,
        metavar="N",
        help="spill only pages used at least N times (their first use counts)",
    )
    p.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="the shared tier in L3's place: a Redis store a fleet of instances shares, "
        "redis://HOST:PORT[/DB] or redis+cluster://HOST:PORT[,HOST:PORT...]; a password in the "
        "URL or REDIS_PASSWORD / REDISCLI_AUTH (needs an L2; not with --l3-dir yet)",
    )
    p.add_argument(
        "--remote-gib",
        type=float,
        default=0.0,
        help="this namespace's share of the store, in GiB, all ranks together",
    )
    p.add_argument(
        "--remote-timeout-ms",
        type=float,
        default=500.0,
        help="socket timeout of each round trip; a timeout opens the breaker (misses for 5 s)",
    )
    p.add_argument(
        "--remote-min-hits",
        type=int,
        default=1,
        metavar="N",
        help="publish only pages used at least N times (their first use counts)",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        metavar="N",
        help="context-parallel ranks: N local processes (gloo on CPU, one GPU each with NCCL); "
        "under torchrun, its world instead. Sizes stay per rank: N ranks cache N times more",
    )
    p.add_argument(
        "--cp-attention",
        choices=["auto", "move_kv", "move_queries"],
        default="auto",
        help="how ranks get the keys other ranks own: move_kv (exchange K/V, bytes grow with "
        "the context), move_queries (exchange queries and partial outputs, bytes grow with the "
        "extend), or auto (the cheaper per step by bytes moved)",
    )
    p.add_argument(
        "--cp-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="timeout of every collective: a rank that dies or hangs fails the run, named",
    )
    p.add_argument(
        "--check-digests",
        action="store_true",
        help="under --cp: compare allocator digests and the tree hash across ranks after every "
        "step, and fail naming the first that differs",
    )
    p.add_argument(
        "--chunk-size", type=int, default=2048, help="max tokens a request computes per step"
    )
    p.add_argument(
        "--max-batch-tokens", type=int, default=8192, help="max tokens computed per step"
    )
    p.add_argument(
        "--max-batch-requests", type=int, default=64, help="max requests running at once"
    )
    p.add_argument(
        "--eviction",
        choices=["lru", "slru"],
        default=["lru"] if grid else "lru",
        help="eviction policy" + ("; several to compare them" if grid else ""),
        **many,
    )


def _timing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--arrivals",
        default=None,
        metavar="KIND",
        help="when requests enter the engine: trace (the trace's timestamps; the default when "
        "the workload has them), burst (all at time 0, read ahead --lookahead at most; the "
        "default otherwise) or poisson:RATE (RATE requests/s, seeded by --seed)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply every arrival time by X (0.5: the same arrivals twice as fast)",
    )
    p.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="auto",
        help="the clock TTFT is measured on: sim (a cost model advances it; deterministic), "
        "wall (real time; a trace replays in real time), auto (sim with --model none, else wall)",
    )
    p.add_argument(
        "--sim-tokens-per-s",
        type=float,
        default=None,
        metavar="R",
        help="simulated clock: prefill tokens computed per second (default: measured, per "
        "device: "
        + ", ".join(f"{k} {v[0]:,.0f}" for k, v in COST_DEFAULTS.items())
        + "; docs/benchmarks.md)",
    )
    p.add_argument(
        "--sim-h2d-gbps",
        type=float,
        default=None,
        metavar="G",
        help="simulated clock: host -> device (load-back) GB/s (default: "
        + ", ".join(f"{k} {v[1]:g}" for k, v in COST_DEFAULTS.items())
        + ")",
    )
    p.add_argument(
        "--sim-d2h-gbps",
        type=float,
        default=None,
        metavar="G",
        help="simulated clock: device -> host (backup) GB/s (default: "
        + ", ".join(f"{k} {v[2]:g}" for k, v in COST_DEFAULTS.items())
        + ")",
    )


def _progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, else a line every few seconds on stderr)",
    )


def _replay_config(args: argparse.Namespace) -> ReplayConfig:
    """The replay configuration the flags describe (sweep: its first grid point)."""
    from .arrivals import ArrivalSpec
    from .clock import CostModel
    from .engine import EngineConfig
    from .replay import ReplayConfig

    grid = isinstance(args.l1_tokens, list)
    cost = None
    if (args.sim_tokens_per_s, args.sim_h2d_gbps, args.sim_d2h_gbps) != (None, None, None):
        cost = CostModel.for_device(
            args.device, args.sim_tokens_per_s, args.sim_h2d_gbps, args.sim_d2h_gbps
        )
    return ReplayConfig(
        workload=args.workload,
        limit=args.limit,
        model=args.model,
        dtype=args.dtype,
        kv_width=args.kv_width,
        vocab_size=args.vocab_size,
        engine=EngineConfig(
            page_size=args.page_size,
            pool_tokens=_sizes(args.l1_tokens, "--l1-tokens")[0] if grid else args.l1_tokens,
            l2_tokens=_sizes(args.l2_tokens, "--l2-tokens")[0] if grid else args.l2_tokens,
            l2_gib=0.0 if grid else args.l2_gib,
            host_layout=args.host_layout,
            write_policy=args.write_policy[0] if grid else args.write_policy,
            write_through_hits=args.write_through_hits,
            l3_dir=args.l3_dir,
            l3_gib=args.l3_gib,
            l3_start=args.l3_start,
            l3_min_hits=args.l3_min_hits,
            remote_url=args.remote,
            remote_gib=args.remote_gib,
            remote_timeout_ms=args.remote_timeout_ms,
            remote_min_hits=args.remote_min_hits,
            remote_password=password_from_env(os.environ) if args.remote else None,
            cp_attention=args.cp_attention,
            check_digests=args.check_digests,
            chunk_size=args.chunk_size,
            max_batch_tokens=args.max_batch_tokens,
            max_batch_requests=args.max_batch_requests,
            eviction=args.eviction[0] if grid else args.eviction,
            device=args.device,
            check_every_step=getattr(args, "check", False),
        ),
        verify=getattr(args, "verify", 0),
        draft_model=getattr(args, "draft_model", None),
        decode_tokens=getattr(args, "decode_tokens", 0),
        handoff_dir=getattr(args, "handoff_dir", None),
        on_error=args.on_error,
        seed=args.seed,
        threads=args.threads,
        cp=args.cp,
        cp_timeout_s=args.cp_timeout,
        lookahead=args.lookahead,
        attention=args.attention,
        arrivals=ArrivalSpec.parse(args.arrivals, args.time_scale),
        clock=args.clock,
        cost=cost,
        metrics_port=getattr(args, "metrics_port", None),
        metrics_host=getattr(args, "metrics_host", "127.0.0.1"),
    )


def _sizes(values: list[str], flag: str) -> tuple[int, ...]:
    from .sweep import parse_sizes

    return parse_sizes(values, flag)


def _run_replay(args: argparse.Namespace) -> int:
    from .replay import run_replay

    cfg = _replay_config(args)
    observers: list[ReplayObserver] = []
    if cfg.metrics_port is not None:
        observers.append(_AnnounceMetrics())
    timeline = None
    if args.report is not None:
        from .report import require_matplotlib
        from .timeline import Timeline

        require_matplotlib()  # before the replay, not after it
        _make_dir(args.report)
        timeline = Timeline()
        observers.append(timeline)
    summary = run_replay(cfg, progress=not args.no_progress, observers=observers)
    if summary.rank != 0:  # one rank of torchrun's world: rank 0 reports
        return EXIT_OK
    print(summary.table())
    for line in summary.problems():
        print(line)
    if timeline is not None:
        from .report import write_report

        path = write_report(args.report, summary.to_json(), timeline)
        print(f"report: {path}")
    if args.json:
        print(json.dumps(summary.to_json()))
    if summary.interrupted:
        print(
            f"kvstrata replay: interrupted after {summary.requests} of {summary.total_requests} "
            "requests; the summary covers those",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    why = None
    if summary.failed == summary.requests:
        why = f"every request failed ({summary.failed})"
    elif args.fail_on_error and summary.failed:
        why = f"{summary.failed} of {summary.requests} requests failed (--fail-on-error)"
    elif not summary.verify.ok:
        why = f"--verify failed: {summary.verify.describe().removeprefix('FAIL: ')}"
    if why is not None:
        print(f"kvstrata replay: {why}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


class _AnnounceMetrics:
    """Says where the metrics are served (the port may have been picked by the system)."""

    def on_start(self, run: ReplayRun) -> None:
        if run.metrics_url is not None:
            print(f"kvstrata replay: metrics on {run.metrics_url}", file=sys.stderr, flush=True)

    def on_step(self, run: ReplayRun) -> None:
        pass

    def on_end(self, run: ReplayRun) -> None:
        pass


def _sweep_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="replay one workload over several cache sizes and policies; plot hit ratio and TTFT",
        description="Replay one workload once per combination of --l1-tokens, --l2-tokens, "
        "--eviction and --write-policy values (each takes several), cache only by default "
        "(--model none, simulated clock), and write one report: hit ratio, TTFT and hit tokens "
        "by tier against the L1 size, and a table of every run. Prints the table; --json prints "
        "every run's summary as one JSON line last.",
        formatter_class=HelpFormatter,
    )
    _workload_flags(p, model_default="none")
    _engine_flags(p, grid=True)
    _timing_flags(p)
    p.add_argument(
        "--report",
        required=True,
        metavar="DIR",
        help="write DIR/report.html with the plots, and DIR/sweep.json (every run's summary)",
    )
    p.add_argument("--json", action="store_true", help="print every run as one JSON line last")
    _progress_flag(p)
    p.set_defaults(func=_run_sweep)


def _run_sweep(args: argparse.Namespace) -> int:
    from .report import require_matplotlib
    from .sweep import COLUMNS, SweepGrid, configs, lookup, run_sweep, write_sweep_report

    require_matplotlib()
    _make_dir(args.report)
    grid = SweepGrid(
        l1_tokens=_sizes(args.l1_tokens, "--l1-tokens"),
        l2_tokens=_sizes(args.l2_tokens, "--l2-tokens"),
        eviction=tuple(args.eviction),
        write_policy=tuple(args.write_policy),
    )
    base = _replay_config(args)
    configs(base, grid)  # every point checked before the first runs
    runs = run_sweep(base, grid, progress=not args.no_progress)
    path = write_sweep_report(args.report, runs)
    rows = [[label for label, _ in COLUMNS]]
    for run in runs:
        rows.append([_cell(lookup(run["summary"], key)) for _, key in COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    for r in rows:
        print("  ".join(f"{c:>{w}}" for c, w in zip(r, widths, strict=True)))
    print(f"report: {path}")
    if args.json:
        print(json.dumps({"runs": runs}))
    if any(run["summary"]["interrupted"] for run in runs):
        print("kvstrata sweep: interrupted; the report covers the runs finished", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


def _make_dir(path: str) -> None:
    """Create a report directory now, so a path that cannot hold it fails before the replay."""
    from pathlib import Path

    from .errors import ConfigError

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create the report directory {path}: {err.strerror}") from None


def _cell(value: object) -> str:
    from .report import format_value

    return format_value(value)


def _compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="two replay results side by side, with ratios",
        description="Print two replay summaries side by side with B / A for every number: hit "
        "ratio and hit tokens by tier, TTFT and its parts, throughput, bytes moved; then the "
        "configuration fields that differ. Each result is a summary.json, a --report "
        "directory, or saved `kvstrata replay --json` output.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("a", metavar="A", help="the baseline result")
    p.add_argument("b", metavar="B", help="the result compared with it")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON line last")
    p.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from .compare import compare, load_summary, render

    rows = compare(load_summary(args.a), load_summary(args.b))
    print(render(rows, "A", "B"))
    print(f"A: {args.a}\nB: {args.b}")
    if args.json:
        print(
            json.dumps(
                {"rows": [dict(zip(("name", "a", "b", "b_over_a"), r, strict=True)) for r in rows]}
            )
        )
    return EXIT_OK


def _check_model_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-model",
        help="compare a checkpoint's logits with transformers",
        description="Load a checkpoint (or a preset, saved first as a checkpoint) with kvstrata and "
        "with transformers, run a few prompts of awkward lengths, and report the largest |logit "
        "difference| and argmax agreement. Exits 1 past the tolerance or on any NaN/inf logit.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "model",
        help="a Hugging Face checkpoint directory (config.json + *.safetensors) or a preset "
        "(tiny, tiny-qwen2, tiny-qwen3, small, llama-3.2-1b)",
    )
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="tokens per KV page; prompts straddle page boundaries and one reads a cached prefix "
        "of whole pages back from the pool",
    )
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="largest |logit difference| accepted (default: 1e-3 in float32, 0.5 otherwise)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON, last line")
    p.set_defaults(func=_run_check_model)


def _run_check_model(args: argparse.Namespace) -> int:
    from .check_model import check_model

    report = check_model(
        args.model, device=args.device, dtype=args.dtype, page_size=args.page_size, atol=args.atol
    )
    verdict = "OK" if report.ok else "FAIL"
    print(f"model              {report.model} ({report.architecture})")
    print(f"prompt lengths     {', '.join(map(str, report.lengths))}")
    print(f"max |logit diff|   {report.max_abs_logit_diff:.3g} (tolerance {report.atol:g})")
    print(f"argmax agreement   {report.argmax_agree:.4f}")
    print(
        f"non-finite logits  {report.nonfinite_ours:,} kvstrata, "
        f"{report.nonfinite_theirs:,} transformers"
    )
    if report.nonfinite_weights:
        names = ", ".join(report.nonfinite_weight_names)
        more = report.nonfinite_weights - len(report.nonfinite_weight_names)
        print(
            f"non-finite weights {report.nonfinite_weights:,}: {names}"
            + (f" and {more:,} more" if more else "")
        )
    print(f"verdict            {verdict}")
    if args.json:
        print(json.dumps({**report.__dict__, "ok": report.ok}))
    return EXIT_OK if report.ok else EXIT_FAILED


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks (" + ", ".join(BENCHMARKS) + "); each prints a table and a JSON line",
        description="Run a benchmark. Arguments after the name go to the benchmark "
        "(kvstrata bench radix --help).",
    )
    p.add_argument("name", choices=BENCHMARKS, metavar="NAME", help=", ".join(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS", help="the benchmark's flags")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f".benchmarks.{bench_module(args.name)}", __package__)
    run_main: Callable[[list[str]], int] = module.run_main
    return run_main(args.rest)


def _disk_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "disk",
        help="the disk tier (L3): audit a directory",
        description="Tools for a disk tier directory (slabs/ and index/ under it).",
    )
    actions = p.add_subparsers(dest="disk_command", required=True, metavar="ACTION")
    c = actions.add_parser(
        "check",
        help="audit slabs against the index; --fix repairs",
        description="Audit a disk tier directory: every index entry must name a slot of a valid, "
        "full-length slab whose header (and payload CRC) holds that page, with all its payloads "
        "in one slot and no two pages in one slot. Prints every inconsistency. With --fix, drops "
        "the index entries of pages that do not check out (they become misses), extends "
        "truncated slabs and removes slab files that are not valid, then audits again. Exit "
        "status 0 only when the directory is clean (after --fix: when the repair left it clean), "
        "1 when it is not, 2 when DIR is not a disk tier directory or a store is using it.",
        formatter_class=HelpFormatter,
    )
    c.add_argument("dir", metavar="DIR", help="the disk tier directory")
    c.add_argument("--fix", action="store_true", help="repair what does not check out")
    c.add_argument(
        "--quick",
        action="store_true",
        help="check slot headers only (4 KiB a page), not the payload CRCs (the whole page)",
    )
    c.add_argument("--json", action="store_true", help="print the report as JSON, last line")
    c.set_defaults(func=_run_disk_check)


def _run_disk_check(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .tiers.disk_audit import audit_directory

    root = Path(args.dir)
    report = audit_directory(root, fix=args.fix, payload=not args.quick)
    found = report.all_problems
    after = audit_directory(root, payload=not args.quick) if args.fix and found else report
    print(f"directory   {root}")
    for g in after.groups:
        print(
            f"group       ns {g.namespace.hex()[:16]} rank {g.rank}: {g.num_payloads} payloads, "
            f"{g.num_slots:,} slots, {len(g.pages):,} pages check out"
        )
    print(f"problems    {len(found)}")
    for problem in found:
        print(f"  {problem}")
    if after.clean:
        verdict = f"FIXED ({len(found)} repaired), clean" if found else "CLEAN"
    else:
        verdict = "DIRTY" + ("" if args.fix else " (kvstrata disk check --fix repairs it)")
    print(f"verdict     {verdict}")
    if args.json:
        doc = {
            "dir": str(root),
            "clean": after.clean,
            "fixed": bool(args.fix and found),
            "problems": [{"kind": p.kind, "where": p.where, "detail": p.detail} for p in found],
            "remaining": len(after.all_problems),
            "groups": [
                {
                    "namespace": g.namespace.hex(),
                    "rank": g.rank,
                    "payloads": g.num_payloads,
                    "slots": g.num_slots,
                    "pages": len(g.pages),
                }
                for g in after.groups
            ],
        }
        print(json.dumps(doc))
    return EXIT_OK if after.clean else EXIT_FAILED


def build_parser() -> CommandParser:
    """The ``kvstrata`` parser with every subcommand (the bench scripts parse their own flags)."""
    parser = CommandParser(
        prog="kvstrata",
        description="kvstrata: a page-granular prefix KV cache for LLM prefill, with a reference "
        "engine that runs Llama/Qwen models on top of it. Exit status: 0 ok, 1 the result is a "
        "failure, 2 bad input, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _replay_parser(sub)
    _sweep_parser(sub)
    _compare_parser(sub)
    _check_model_parser(sub)
    _bench_parser(sub)
    _disk_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kvstrata`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if (
        args.command == "bench"
    ):  # the bench scripts report their own errors, as "kvstrata bench NAME"
        return int(args.func(args))
    return run_command(f"kvstrata {args.command}", lambda: int(args.func(args)))


if __name__ == "__main__":
    raise SystemExit(main())
