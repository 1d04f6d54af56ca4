"""The flags that fill the config dataclasses, and :func:`replay_config`, which fills them.

Every default is read from the field it fills (``default=EngineConfig.chunk_size``), never
written again as a literal; ``tests/test_cli_defaults.py`` walks every parser to hold this.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..arrivals import ArrivalSpec
from ..clock import CLOCKS, COST_DEFAULTS, CostModel
from ..config import HOST_LAYOUTS, WRITE_POLICIES
from ..cost import DISK_DEFAULTS, shipped_profiles
from ..engine import EngineConfig
from ..model.attention import ATTENTION_BACKENDS
from ..replay import ReplayConfig, SimLinks
from ..tiers.disk_config import IO_MODES
from ..tiers.remote.config import password_from_env

#: Default torch intra-op threads of ``replay``: one, because the engine's per-step ops are small
#: and two threads make a replay 10-20x slower as soon as another process uses a core
#: (docs/benchmarks.md, "CPU threads"), while they gain at most ~1.3x on an idle machine.
DEFAULT_THREADS = 1


def workload_flags(p: argparse.ArgumentParser, model_default: str) -> None:
    p.add_argument(
        "--trace",
        "--workload",
        dest="workload",
        default=ReplayConfig.workload,
        help="'builtin', 'synthetic[:SEED[:N]]', 'agentic[:SEED[:N]]' (long agentic coding "
        "sessions, README 'Workloads'), or a Mooncake JSONL trace file (each hash id is a "
        "512-token block); read lazily, never loaded whole",
    )
    p.add_argument(
        "--limit", type=int, default=ReplayConfig.limit, help="replay only the first N requests"
    )
    p.add_argument(
        "--model",
        default=model_default,
        help="a preset (tiny, tiny-qwen2, tiny-qwen3, small, llama-3.2-1b; MLA: tiny-mla, "
        "tiny-moe, deepseek-v2-lite), a Hugging Face "
        "checkpoint directory (config.json + *.safetensors), or 'none' for cache-only replay "
        "with synthetic KV payloads",
    )
    p.add_argument(
        "--dtype",
        default=ReplayConfig.dtype,
        help="float32 or bfloat16 (default: fp32 on CPU, bf16 on GPU)",
    )
    p.add_argument("--device", default=EngineConfig.device, help="torch device, e.g. cpu or cuda")
    p.add_argument(
        "--attention",
        choices=list(ATTENTION_BACKENDS),
        default=ReplayConfig.attention,
        help="attention over the paged K/V: triton (CUDA: a kernel reads the pages in place), sdpa "
        "(torch SDPA per request, gathering a cached prefix; the CPU path), auto (triton on CUDA, "
        "sdpa on CPU); no silent fallback",
    )
    p.add_argument(
        "--model-shape",
        default=ReplayConfig.model_shape,
        metavar="NAME|config.json",
        help="with --model none: plan this model (a preset, a Hugging Face config.json or its "
        "checkpoint directory; no weights needed): its KV bytes per token are accounted and "
        "reported, sizes in GiB count them, and its cost profile (shipped, or estimated from its "
        "shape) drives the simulated clock; --dtype picks its KV dtype (default bfloat16)",
    )
    p.add_argument(
        "--kv-width",
        type=int,
        default=ReplayConfig.kv_width,
        help="with --model none: synthetic KV bytes per token",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=ReplayConfig.vocab_size,
        help="with --model none: the vocabulary token ids are mapped into; hit ratios equal a "
        "model's when this equals its vocabulary (a model run always uses the model's)",
    )
    p.add_argument(
        "--on-error",
        choices=["stop", "skip"],
        default=ReplayConfig.on_error,
        help="a malformed trace line: stop with its line number, or skip it (and count it)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=ReplayConfig.seed,
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
        default=ReplayConfig.lookahead,
        metavar="N",
        help="requests read ahead of the engine, waiting or running (default: 2 x "
        "--max-batch-requests); replay memory holds the cache plus these",
    )


def engine_flags(p: argparse.ArgumentParser, grid: bool) -> None:
    """The engine's knobs; with ``grid`` (sweep), the swept ones take several values."""
    many: dict[str, Any] = {"nargs": "+"} if grid else {}
    p.add_argument(
        "--page-size", type=int, default=EngineConfig.page_size, help="tokens per KV page"
    )
    p.add_argument(
        "--l1-tokens",
        "--pool-tokens",
        dest="l1_tokens",
        type=str if grid else int,
        default=[str(EngineConfig.pool_tokens)] if grid else EngineConfig.pool_tokens,
        metavar="N",
        help="device pool (L1) size in tokens"
        + ("; several sizes (k, M, G suffixes: 2**10, 2**20, 2**30)" if grid else ""),
        **many,
    )
    p.add_argument(
        "--l1-gib",
        type=float,
        default=[ReplayConfig.l1_gib] if grid else ReplayConfig.l1_gib,
        metavar="G",
        help="device pool (L1) size in GiB of KV instead of --l1-tokens: the --model-shape "
        "model's KV with --model none (or the --cost-profile's model), else the run's own"
        + ("; several sizes" if grid else ""),
        **many,
    )
    p.add_argument(
        "--l2-tokens",
        type=str if grid else int,
        default=[str(EngineConfig.l2_tokens)] if grid else EngineConfig.l2_tokens,
        metavar="N",
        help="host pool (L2) size in tokens: pinned host memory on a CUDA machine, plain memory "
        "otherwise; 0" + (" (no L2)" if grid else " with no --l2-gib: no L2"),
        **many,
    )
    p.add_argument(
        "--l2-gib",
        type=float,
        default=[EngineConfig.l2_gib] if grid else EngineConfig.l2_gib,
        metavar="G",
        help="host pool (L2) size in GiB (instead of --l2-tokens), of the KV --l1-gib counts"
        + ("; several sizes" if grid else ""),
        **many,
    )
    p.add_argument(
        "--host-layout",
        choices=list(HOST_LAYOUTS),
        default=EngineConfig.host_layout,
        help="L2 page layout: page_first keeps one page's layers together (one extent per page "
        "for the disk tier), layer_first mirrors the device pool; both copy at the same speed",
    )
    p.add_argument(
        "--write-policy",
        choices=list(WRITE_POLICIES),
        default=[EngineConfig.write_policy] if grid else EngineConfig.write_policy,
        help="when device pages are backed up to L2: write_through (every computed chunk, layer "
        "by layer during the forward), write_through_selective (a node once hit "
        "--write-through-hits times), write_back (a node when L1 eviction would drop it)",
        **many,
    )
    p.add_argument(
        "--write-through-hits",
        type=int,
        default=EngineConfig.write_through_hits,
        metavar="N",
        help="with write_through_selective: back a node up once it has N hits",
    )
    p.add_argument(
        "--l3-dir",
        action="append",
        default=EngineConfig.l3_dir,
        metavar="DIR",
        help="the disk tier (L3): a directory of preallocated, checksummed slab files and an "
        "LMDB index; committed host pages spill there and misses reload from it (needs an L2). "
        "Repeat it, one directory per drive: of n directories rank r takes the (r %% n)-th, "
        "or, with more directories than ranks, every cp-th from the r-th, its slots striped "
        "over them (each rank's --l3-gib split evenly); a load start needs the same "
        "directories in the same order",
    )
    p.add_argument(
        "--l3-gib",
        type=float,
        default=EngineConfig.l3_gib,
        help="disk tier (L3) size in GiB per rank, all its directories together: of its slabs, "
        "or with --model none and --model-shape (or --cost-profile) of the modeled KV (the "
        "slabs then hold as many pages)",
    )
    p.add_argument(
        "--l3-start",
        choices=["clear", "load"],
        default=EngineConfig.l3_start,
        help="clear: start with an empty disk tier; load: keep (and verify) what DIR holds",
    )
    p.add_argument(
        "--l3-io",
        choices=IO_MODES,
        default=EngineConfig.l3_io,
        help="how the disk tier reads and writes its slabs: auto (O_DIRECT where the "
        "filesystem allows, else the page cache, with a warning), direct (refuse to start "
        "without O_DIRECT), buffered (the page cache; writes still fsynced before a page is "
        "published), packed (small pages, such as --model none's: slots of 64-byte multiples "
        "instead of 4 KiB, through the page cache; the budget pays for each page's index room "
        "too). A --model none replay's disk time is simulated (--sim-disk-read-gbps), so "
        "buffered only makes its wall clock shorter",
    )
    p.add_argument(
        "--l3-min-hits",
        type=int,
        default=EngineConfig.l3_min_hits,
        metavar="N",
        help="spill only pages used at least N times (their first use counts)",
    )
    p.add_argument(
        "--remote",
        default=EngineConfig.remote_url,
        metavar="URL",
        help="the shared tier: a Redis store a fleet of instances shares, "
        "redis://HOST:PORT[/DB] or redis+cluster://HOST:PORT[,HOST:PORT...]; a password in the "
        "URL or REDIS_PASSWORD / REDISCLI_AUTH. Behind the disk with --l3-dir (misses look at "
        "the disk, then the store; spilled pages go to both), else in L3's place (needs an L2)",
    )
    p.add_argument(
        "--remote-gib",
        type=float,
        default=EngineConfig.remote_gib,
        help="this namespace's share of the store, in GiB, all ranks together",
    )
    p.add_argument(
        "--remote-timeout-ms",
        type=float,
        default=EngineConfig.remote_timeout_ms,
        help="socket timeout of each round trip; a timeout opens the breaker (misses for 5 s)",
    )
    p.add_argument(
        "--remote-min-hits",
        type=int,
        default=EngineConfig.remote_min_hits,
        metavar="N",
        help="publish only pages used at least N times (their first use counts)",
    )
    p.add_argument(
        "--remote-connections",
        type=int,
        default=EngineConfig.remote_connections,
        metavar="N",
        help="round trips in flight to the store, each on a connection and thread of its own",
    )
    p.add_argument(
        "--remote-publish-window",
        type=int,
        default=EngineConfig.remote_publish_window,
        metavar="N",
        help="SET pipelines a publish keeps in flight on each connection (more can hide a "
        "network's round trip; 1 measured best on loopback)",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=ReplayConfig.cp,
        metavar="N",
        help="context-parallel ranks: N local processes (gloo on CPU, one GPU each with NCCL); "
        "under torchrun, its world instead. Sizes stay per rank: N ranks cache N times more",
    )
    p.add_argument(
        "--cp-attention",
        choices=["auto", "move_kv", "move_queries"],
        default=EngineConfig.cp_attention,
        help="how ranks get the keys other ranks own: move_kv (exchange K/V, or an MLA "
        "model's latents, bytes grow with "
        "the context), move_queries (exchange queries and partial outputs, bytes grow with the "
        "extend), or auto (the cheaper per step by bytes moved)",
    )
    p.add_argument(
        "--cp-timeout",
        type=float,
        default=ReplayConfig.cp_timeout_s,
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
        "--chunk-size",
        type=int,
        default=EngineConfig.chunk_size,
        help="max tokens a request computes per step",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=EngineConfig.max_batch_tokens,
        help="max tokens computed per step",
    )
    p.add_argument(
        "--max-batch-requests",
        type=int,
        default=EngineConfig.max_batch_requests,
        help="max requests running at once",
    )
    p.add_argument(
        "--eviction",
        choices=["lru", "slru"],
        default=[EngineConfig.eviction] if grid else EngineConfig.eviction,
        help="eviction policy" + ("; several to compare them" if grid else ""),
        **many,
    )


def timing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--arrivals",
        default=ArrivalSpec.kind,
        metavar="KIND",
        help="when requests enter the engine: trace (the trace's timestamps; the default when "
        "the workload has them), burst (all at time 0, read ahead --lookahead at most; the "
        "default otherwise) or poisson:RATE (RATE requests/s, seeded by --seed)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=ArrivalSpec.time_scale,
        metavar="X",
        help="multiply every arrival time by X (0.5: the same arrivals twice as fast)",
    )
    p.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default=ReplayConfig.clock,
        help="the clock TTFT is measured on: sim (a cost model advances it; deterministic), "
        "wall (real time; a trace replays in real time), cpu (the CPU engine's thread CPU time, "
        "jumping over idle time: steady on a shared machine), auto (sim with --model none, else "
        "wall)",
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


def cost_flags(p: argparse.ArgumentParser) -> None:
    """The simulated clock's cost profile and disk links (beside :func:`timing_flags`)."""
    p.add_argument(
        "--cost-profile",
        default=ReplayConfig.cost_profile,
        metavar="NAME|FILE",
        help="the simulated clock's step cost model: a shipped profile ("
        + ", ".join(sorted(shipped_profiles()))
        + ") or a JSON file from kvstrata calibrate. Default: the shipped profile of the model "
        "(--model, or --model-shape) on the device's kind, else an estimate from its shape "
        "(said so in the summary); without either, the flat --sim-tokens-per-s model",
    )
    p.add_argument(
        "--sim-disk-read-gbps",
        type=float,
        default=SimLinks.disk_read_gbps,
        metavar="G",
        help="simulated clock: disk tier reads, GB/s (default: the profile's, else dd O_DIRECT "
        "measured: " + ", ".join(f"{k} {v[0]:g}" for k, v in DISK_DEFAULTS.items()) + ")",
    )
    p.add_argument(
        "--sim-disk-write-gbps",
        type=float,
        default=SimLinks.disk_write_gbps,
        metavar="G",
        help="simulated clock: disk tier writes, GB/s (default: the profile's, else "
        + ", ".join(f"{k} {v[1]:g}" for k, v in DISK_DEFAULTS.items())
        + ")",
    )


def progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, else a line every few seconds on stderr)",
    )


def replay_config(args: argparse.Namespace) -> ReplayConfig:
    """The replay configuration the flags describe (sweep: its first grid point)."""
    grid = isinstance(args.l1_tokens, list)

    def replay_only(name: str) -> Any:  # a flag sweep lacks: the field's default there
        return getattr(args, name, getattr(ReplayConfig, name))

    cost = None
    if args.sim_tokens_per_s is not None:
        cost = CostModel.for_device(args.device, args.sim_tokens_per_s)
    links = SimLinks(
        args.sim_h2d_gbps, args.sim_d2h_gbps, args.sim_disk_read_gbps, args.sim_disk_write_gbps
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
            pool_tokens=sizes(args.l1_tokens, "--l1-tokens")[0] if grid else args.l1_tokens,
            l2_tokens=sizes(args.l2_tokens, "--l2-tokens")[0] if grid else args.l2_tokens,
            l2_gib=args.l2_gib[0] if grid else args.l2_gib,
            host_layout=args.host_layout,
            write_policy=args.write_policy[0] if grid else args.write_policy,
            write_through_hits=args.write_through_hits,
            l3_dir=tuple(args.l3_dir) if args.l3_dir else None,
            l3_gib=args.l3_gib,
            l3_start=args.l3_start,
            l3_min_hits=args.l3_min_hits,
            l3_io=args.l3_io,
            remote_url=args.remote,
            remote_gib=args.remote_gib,
            remote_timeout_ms=args.remote_timeout_ms,
            remote_min_hits=args.remote_min_hits,
            remote_connections=args.remote_connections,
            remote_publish_window=args.remote_publish_window,
            remote_password=password_from_env(os.environ) if args.remote else None,
            cp_attention=args.cp_attention,
            check_digests=args.check_digests,
            chunk_size=args.chunk_size,
            max_batch_tokens=args.max_batch_tokens,
            max_batch_requests=args.max_batch_requests,
            eviction=args.eviction[0] if grid else args.eviction,
            device=args.device,
            check_every_step=getattr(args, "check", EngineConfig.check_every_step),
        ),
        verify=replay_only("verify"),
        verify_atol=replay_only("verify_atol"),
        draft_model=replay_only("draft_model"),
        decode_tokens=replay_only("decode_tokens"),
        handoff_dir=replay_only("handoff_dir"),
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
        cost_profile=args.cost_profile,
        model_shape=args.model_shape,
        sim_links=links,
        l1_gib=args.l1_gib[0] if grid else args.l1_gib,
        metrics_port=replay_only("metrics_port"),
        metrics_host=replay_only("metrics_host"),
    )


def sizes(values: list[str], flag: str) -> tuple[int, ...]:
    from ..sweep import parse_sizes

    return parse_sizes(values, flag)
