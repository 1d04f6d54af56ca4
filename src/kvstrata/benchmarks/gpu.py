"""End-to-end GPU figures in one run (``kvstrata bench gpu``, CUDA only; docs/benchmarks.md).

One model (the ``llama-3.2-1b`` preset, random weights, bf16) serves every section:

1. **ceilings** measured here: a bf16 8192^3 matmul (TFLOP/s), and a 1 GiB pinned host <-> device
   copy each way (GB/s);
2. **bare model**: one prefill of the trace's mean request length, no engine, with each attention
   backend; and every replayed request's length prefilled alone once (``solo``: the same model on
   the same lengths, without the cache or batching);
3. **replay**: the first ``--limit`` requests of ``--trace`` through the engine (no L2), per
   ``--attention`` backend; target: >= 0.9x the bare model's tokens/s at the mean length;
4. **TTFT** (for each ``--copy-programs`` cap of the copy kernel, and its default): one request of a ``--prefix``-token prefix plus ``--suffix`` new tokens with the prefix
   in L2 (loaded back layer by layer), in L1, and not cached (full recompute), medians of
   ``--repeats``; targets: L2 <= 1.5x L1, recompute >= 7x L2. Also the load-back copy alone
   (device time of the same pages' H2D copy on its stream) against the pinned ceiling;
5. **write-through**: fresh ``--wt-tokens`` prefills with L2 write-through on and with no L2,
   alternating, medians; target: on <= 1.05x off.

``--profile DIR`` writes torch profiler tables (CUDA time per kernel) of one L2-hit request, one
write-through prefill and one long-prefix chunk there. Output: the tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..command import CommandParser, HelpFormatter, run_command
from ..engine import Engine, EngineConfig, Finished
from ..errors import ConfigError
from ..limits import check_device
from ..model.attention import ATTENTION_BACKENDS
from ..model.batch import ForwardBatch
from ..model.compute import ModelCompute
from ..model.llama import LlamaModel
from ..model.loader import load_model
from ..ownership import page_span
from ..replay import ReplayConfig, ReplaySummary, run_replay
from ..tiers.pool import DevicePool
from ..tiers.transfer import Transfer
from ..tiers.transfer_kernel import KernelConfig
from ..workloads import Request, load_workload

PROG = "kvstrata bench gpu"
GIB = 1 << 30
PAGE = 16


def _events_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median device milliseconds of ``fn`` (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings(device: torch.device) -> dict[str, float]:
    """bf16 matmul TFLOP/s on random data; pinned 1 GiB H2D and D2H GB/s."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = _events_ms(lambda: a @ b, repeats=10, warmup=3)
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.randint(0, 255, (GIB,), dtype=torch.uint8, device=device)
    host.copy_(dev)
    h2d = _events_ms(lambda: dev.copy_(host, non_blocking=True), repeats=5)
    d2h = _events_ms(lambda: host.copy_(dev, non_blocking=True), repeats=5)
    return {
        "matmul_tflops": 2 * n**3 / ms / 1e9,
        "h2d_gbps": GIB / h2d / 1e6,
        "d2h_gbps": GIB / d2h / 1e6,
    }


def bare_seconds(model: LlamaModel, pool: DevicePool, tokens: torch.Tensor) -> float:
    """Wall seconds of one uncached prefill of ``tokens`` (device drained before and after)."""
    n = tokens.numel()
    table = torch.arange(page_span(n, PAGE))
    _sync(pool.device)
    start = time.perf_counter()
    batch = ForwardBatch.build([0], [n], [table], PAGE, pool.device)
    model(tokens, batch, pool, logits="last")
    _sync(pool.device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TTFT:
    l1_ms: float
    l2_ms: float
    recompute_ms: float
    copy_ms: float
    copy_gbps: float
    copy_bytes: int


class _Server:
    """An engine and a counter of request ids; serves one request at a time. ``copy`` sets the
    launch shape of its L1 <-> L2 copy kernel."""

    def __init__(
        self, compute: ModelCompute, config: EngineConfig, copy: KernelConfig | None = None
    ) -> None:
        self.engine = Engine(compute, config)
        if (
            copy is not None
            and self.engine.cache.transfer is not None
            and self.engine.cache.transfer.cuda
        ):
            self.engine.cache.transfer.use_kernel(copy)
        self.rid = 0

    def serve(self, tokens: np.ndarray) -> Finished:
        self.rid += 1
        self.engine.add(Request(self.rid, tokens.astype(np.uint32)))
        done: list[Finished] = []
        while self.engine.has_work():
            done += self.engine.step()
        (finished,) = done
        if finished.error is not None:
            raise ConfigError(f"{PROG}: a benchmark request failed: {finished.error}")
        self.engine.drain()
        return finished

    def demote_l1(self) -> None:
        """Evict every unlocked L1 page: nodes backed up in L2 become host-only."""
        engine = self.engine
        engine.cache.allocator.free(engine.cache.tree.evict(engine.cache.allocator.num_pages))


def ttft(
    compute: ModelCompute,
    args: argparse.Namespace,
    rng: np.random.Generator,
    copy: KernelConfig | None = None,
) -> TTFT:
    vocab = compute.vocab_size
    n = args.prefix + args.suffix
    # Room for the prefix and a few rounds (a fresh request and two suffixes each); LRU eviction
    # takes older fresh requests first, the prefix is used every round.
    config = EngineConfig(
        page_size=PAGE,
        pool_tokens=5 * n,
        chunk_size=n,
        max_batch_tokens=n,
        device=args.device,
        l2_tokens=5 * n,
    )
    server = _Server(compute, config, copy)
    prefix = rng.integers(0, vocab, args.prefix)

    def with_suffix(head: np.ndarray) -> np.ndarray:
        return np.concatenate([head, rng.integers(0, vocab, args.suffix)])

    server.serve(with_suffix(prefix))  # warm-up; the prefix is now in L1 and L2
    l1, l2, full = [], [], []
    for _ in range(args.repeats):
        f = server.serve(with_suffix(rng.integers(0, vocab, args.prefix)))
        assert f.cached_len == 0, f
        full.append(f.ttft_s)
        f = server.serve(with_suffix(prefix))
        assert f.cached_len == args.prefix and f.host_len == 0, f
        l1.append(f.ttft_s)
        server.demote_l1()
        f = server.serve(with_suffix(prefix))
        assert f.cached_len == args.prefix and f.host_len == args.prefix, f
        l2.append(f.ttft_s)
    copy_ms, copy_bytes = _copy_alone(server.engine, args.prefix // PAGE, copy)
    ms = 1000 * statistics.median(l1), 1000 * statistics.median(l2)
    return TTFT(
        l1_ms=ms[0],
        l2_ms=ms[1],
        recompute_ms=1000 * statistics.median(full),
        copy_ms=copy_ms,
        copy_gbps=copy_bytes / copy_ms / 1e6,
        copy_bytes=copy_bytes,
    )


def _copy_alone(engine: Engine, num_pages: int, copy: KernelConfig | None) -> tuple[float, int]:
    """Device ms of a load-back's H2D copy of ``num_pages`` pages (every layer) on its stream
    (host ms on the CPU), median of 5 after 2 warm-ups, into free device pages (a Transfer of its
    own, so no engine ticket is touched)."""
    assert engine.cache.host_pool is not None
    transfer = Transfer(engine.cache.pool, engine.cache.host_pool, kernel=copy)
    device_pages = engine.cache.allocator.alloc(0, num_pages)
    assert device_pages is not None, "the TTFT pool has no room for the copy"
    host_slots = np.random.default_rng(0).permutation(engine.cache.host_pool.num_slots)[:num_pages]
    stream = transfer.stream("h2d")
    times = []
    for ticket in range(7):
        t0 = time.perf_counter()
        if stream is not None:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(stream)
        for layer in range(engine.cache.pool.layout.num_layers):
            transfer.h2d(ticket, layer, host_slots, device_pages)
        transfer.close(ticket, engine.cache.pool.layout.num_layers)
        if stream is not None:
            end.record(stream)
        transfer.wait(ticket)
        times.append(
            start.elapsed_time(end) if stream is not None else 1000 * (time.perf_counter() - t0)
        )
        transfer.poll()
    engine.cache.allocator.free(device_pages)
    return statistics.median(times[2:]), num_pages * engine.cache.pool.page_bytes


def write_through(
    compute: ModelCompute,
    args: argparse.Namespace,
    rng: np.random.Generator,
    copy: KernelConfig | None = None,
) -> tuple[float, float]:
    """Median TTFT (ms) of fresh ``--wt-tokens`` prefills with write-through on, and with no L2."""
    n = args.wt_tokens
    pool = 3 * n  # LRU eviction makes room for each fresh request
    common = {
        "page_size": PAGE,
        "pool_tokens": pool,
        "chunk_size": args.chunk_size,
        "max_batch_tokens": args.max_batch_tokens,
        "device": args.device,
    }
    on = _Server(compute, EngineConfig(**common, l2_tokens=pool), copy)
    off = _Server(compute, EngineConfig(**common))
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(args.repeats + 1):
        for name, server in (("on", on), ("off", off)):
            f = server.serve(rng.integers(0, compute.vocab_size, n))
            if i:  # the first round warms up
                times[name].append(f.ttft_s)
    assert on.engine.cache.backups is not None and on.engine.cache.backups.stats.done > 0
    return 1000 * statistics.median(times["on"]), 1000 * statistics.median(times["off"])


def _profile(fn: Callable[[], object], path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    path.write_text(table)


def profiles(compute: ModelCompute, args: argparse.Namespace, out: Path) -> None:
    """Profiler tables of an L2-hit request, a write-through prefill and a long-prefix chunk."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed + 1)
    _profile_tiers(compute, args, out, rng)
    _release()
    vocab = compute.vocab_size
    long = _Server(
        compute,
        EngineConfig(page_size=PAGE, pool_tokens=2 * 98304, chunk_size=8192, device=args.device),
    )
    tokens = rng.integers(0, vocab, 98304)
    long.serve(tokens[:90112])
    _profile(lambda: long.serve(tokens), out / "long_prefix_chunk.txt")


def _profile_tiers(
    compute: ModelCompute, args: argparse.Namespace, out: Path, rng: np.random.Generator
) -> None:
    vocab = compute.vocab_size
    n = args.prefix + args.suffix
    server = _Server(
        compute,
        EngineConfig(
            page_size=PAGE,
            pool_tokens=5 * n,
            chunk_size=n,
            max_batch_tokens=n,
            device=args.device,
            l2_tokens=5 * n,
        ),
    )
    prefix = rng.integers(0, vocab, args.prefix)

    def l2_hit() -> Finished:
        server.demote_l1()
        return server.serve(np.concatenate([prefix, rng.integers(0, vocab, args.suffix)]))

    server.serve(np.concatenate([prefix, rng.integers(0, vocab, args.suffix)]))
    l2_hit()  # warm-up
    _profile(l2_hit, out / "l2_hit.txt")
    _profile(lambda: server.serve(rng.integers(0, vocab, n)), out / "write_through_prefill.txt")


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def build_parser() -> CommandParser:
    p = CommandParser(
        prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--trace",
        required=True,
        help="Mooncake conversation trace (JSONL), e.g. conversation_trace.jsonl",
    )
    p.add_argument("--limit", type=int, default=200, help="replay the first N requests")
    p.add_argument(
        "--attention",
        nargs="+",
        choices=list(ATTENTION_BACKENDS),
        default=["triton", "sdpa"],
        help="attention backends to replay and to time the bare model with",
    )
    p.add_argument(
        "--replay-attention",
        nargs="+",
        choices=list(ATTENTION_BACKENDS),
        default=None,
        help="attention backends to replay with (default: those of --attention)",
    )
    p.add_argument("--l1-tokens", type=int, default=1 << 20, help="replay device pool, tokens")
    p.add_argument("--chunk-size", type=int, default=8192, help="replay chunk size")
    p.add_argument("--max-batch-tokens", type=int, default=16384, help="replay tokens per step")
    p.add_argument("--verify", type=int, default=4, help="replay: requests recomputed and compared")
    p.add_argument("--prefix", type=int, default=32768, help="TTFT: cached prefix, tokens")
    p.add_argument("--suffix", type=int, default=1024, help="TTFT: new tokens after it")
    p.add_argument("--wt-tokens", type=int, default=32768, help="write-through: prefill tokens")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (medians)")
    p.add_argument("--no-solo", action="store_true", help="skip prefilling every request alone")
    p.add_argument(
        "--copy-programs",
        type=int,
        nargs="*",
        default=[0, 16, 64],
        metavar="N",
        help="also measure TTFT and write-through with the copy kernel capped at N programs "
        "(0: one program per step); the default cap is always measured",
    )
    p.add_argument("--skip", nargs="*", default=[], choices=["replay", "ttft", "wt"])
    p.add_argument("--profile", type=Path, default=None, metavar="DIR", help="profiler tables")
    p.add_argument("--seed", type=int, default=0)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse values the benchmark cannot run with, before anything is built."""
    positive = ("limit", "l1_tokens", "chunk_size", "max_batch_tokens", "suffix", "wt_tokens")
    for name in (*positive, "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.repeats > 1000 or args.verify < 0 or args.verify > args.limit:
        raise ConfigError(
            f"--repeats must lie in [1, 1000] and --verify in [0, --limit], got {args.repeats} "
            f"and {args.verify}"
        )
    if args.prefix < PAGE or args.prefix % PAGE:
        raise ConfigError(f"--prefix must be a positive multiple of the page size {PAGE}")
    if any(n < 0 for n in args.copy_programs):
        raise ConfigError(f"--copy-programs takes counts >= 0, got {args.copy_programs}")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed must lie in [0, 2**63), got {args.seed}")
    if not Path(args.trace).is_file():
        raise ConfigError(f"--trace {args.trace!r} is not a file")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    device = check_device(args.device)
    if device.type != "cuda":
        raise ConfigError(f"{PROG} measures the GPU path; run it with --device cuda")
    ceiling = ceilings(device)
    _release()
    _, model = load_model("llama-3.2-1b", device=device, dtype="bfloat16", seed=args.seed)
    result = measure(args, device, model, ceiling)
    print(_table(result, args))
    print(json.dumps(result, default=float))
    return 0


def measure(
    args: argparse.Namespace, device: torch.device, model: LlamaModel, ceiling: dict[str, float]
) -> dict[str, Any]:
    """Every section but the ceilings, with ``model``; the JSON summary as a dict."""
    rng = np.random.default_rng(args.seed)
    result: dict[str, Any] = {
        "bench": "gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": _driver(),
        "ceilings": ceiling,
    }
    t0 = time.perf_counter()
    compute = ModelCompute(model, next(model.parameters()).dtype)

    # -- bare model -------------------------------------------------------------------------------
    requests = list(load_workload(args.trace, limit=args.limit, vocab_size=compute.vocab_size))
    lengths = [r.tokens.size for r in requests]
    mean_len = round(sum(lengths) / len(lengths))
    pool = DevicePool(compute.layout, PAGE, page_span(max(lengths), PAGE), device)
    tokens = torch.from_numpy(rng.integers(0, compute.vocab_size, max(lengths))).to(device)
    bare: dict[str, float] = {}
    for backend in args.attention:
        model.use_attention(backend)
        for _ in range(2):
            bare_seconds(model, pool, tokens[:mean_len])
        s = statistics.median(
            bare_seconds(model, pool, tokens[:mean_len]) for _ in range(args.repeats)
        )
        bare[backend] = mean_len / s
    best_backend = max(bare, key=lambda b: bare[b])
    result["bare"] = {"mean_len": mean_len, "tok_s": bare, "best": best_backend}
    if not args.no_solo:
        model.use_attention(best_backend)
        seconds = sum(
            bare_seconds(model, pool, torch.from_numpy(r.tokens.astype(np.int64)).to(device))
            for r in requests
        )
        result["bare"]["solo_tok_s"] = sum(lengths) / seconds
    del pool
    _release()

    # -- replay -----------------------------------------------------------------------------------
    if "replay" not in args.skip:
        result["replay"] = {}
        for backend in args.replay_attention or args.attention:
            model.use_attention(backend)
            summary = _replay(compute, args, backend)
            result["replay"][backend] = {
                "tok_s": summary.prefill_tokens_per_s,
                "seconds": summary.seconds,
                "computed_tokens": summary.computed_tokens,
                "hit_ratio": summary.hit_ratio,
                "steps": summary.steps,
                "ttft_ms": summary.ttft_ms,
                "verify_max_abs_logit_diff": summary.verify.max_abs_logit_diff,
                "verify_argmax_agree": summary.verify.argmax_agree,
                "ratio_to_bare_mean": summary.prefill_tokens_per_s / bare[best_backend],
            }
            _release()
    model.use_attention(args.attention[0])

    # -- TTFT and write-through, per launch shape of the copy kernel ------------------------------
    default = KernelConfig().max_programs or 0
    shapes = sorted(set(args.copy_programs) | {default})
    result["copy_programs_default"] = default
    for programs in shapes:
        copy = KernelConfig(max_programs=programs or None)
        row: dict[str, Any] = {}
        if "ttft" not in args.skip:
            t = ttft(compute, args, rng, copy)
            row["ttft"] = {
                **t.__dict__,
                "l2_over_l1": t.l2_ms / t.l1_ms,
                "recompute_over_l2": t.recompute_ms / t.l2_ms,
                "copy_over_pinned_h2d": t.copy_gbps / result["ceilings"]["h2d_gbps"],
            }
            _release()
        if "wt" not in args.skip:
            on_ms, off_ms = write_through(compute, args, rng, copy)
            row["write_through"] = {"on_ms": on_ms, "off_ms": off_ms, "ratio": on_ms / off_ms}
            _release()
        result.setdefault("copy", {})[str(programs)] = row
        if programs == default:
            result.update(row)
    if args.profile is not None:
        profiles(compute, args, args.profile)
    result["targets"] = _targets(result)
    result["seconds"] = time.perf_counter() - t0
    return result


def _replay(compute: ModelCompute, args: argparse.Namespace, backend: str) -> ReplaySummary:
    cfg = ReplayConfig(
        workload=args.trace,
        limit=args.limit,
        model="llama-3.2-1b",
        engine=EngineConfig(
            page_size=PAGE,
            pool_tokens=args.l1_tokens,
            chunk_size=args.chunk_size,
            max_batch_tokens=args.max_batch_tokens,
            device=args.device,
        ),
        verify=args.verify,
        seed=args.seed,
        attention=backend,
    )
    return run_replay(cfg, progress=False, compute=compute)


def _targets(r: dict[str, Any]) -> dict[str, bool]:
    met = {}
    if "replay" in r:
        met["replay_ge_0.9x_bare"] = (
            max(v["ratio_to_bare_mean"] for v in r["replay"].values()) >= 0.9
        )
    if "ttft" in r:
        met["l2_le_1.5x_l1"] = r["ttft"]["l2_over_l1"] <= 1.5
        met["recompute_ge_7x_l2"] = r["ttft"]["recompute_over_l2"] >= 7
    if "write_through" in r:
        met["write_through_le_1.05x"] = r["write_through"]["ratio"] <= 1.05
    return met


def _table(r: dict[str, Any], args: argparse.Namespace) -> str:
    c = r["ceilings"]
    lines = [
        f"{r['device']}, torch {r['torch']} (CUDA {r['cuda']}), driver {r['driver']}",
        f"ceilings: bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s, pinned H2D "
        f"{c['h2d_gbps']:.1f} GB/s, D2H {c['d2h_gbps']:.1f} GB/s",
        "",
        f"{'figure':<44} {'value':>14}  target",
    ]

    def row(name: str, value: str, target: str = "") -> None:
        lines.append(f"{name:<44} {value:>14}  {target}")

    bare = r["bare"]
    for backend, tok_s in bare["tok_s"].items():
        row(f"bare model, {bare['mean_len']} tokens ({backend}) tok/s", f"{tok_s:,.0f}")
    if "solo_tok_s" in bare:
        row(f"bare model, each request alone ({bare['best']}) tok/s", f"{bare['solo_tok_s']:,.0f}")
    for backend, rep in r.get("replay", {}).items():
        row(f"replay {args.limit} requests ({backend}) tok/s", f"{rep['tok_s']:,.0f}")
        row(
            "  / bare at mean length",
            f"{rep['ratio_to_bare_mean']:.3f}",
            ">= 0.9",
        )
        if "solo_tok_s" in bare:
            row("  / bare, each request alone", f"{rep['tok_s'] / bare['solo_tok_s']:.3f}")
        row("  verify max |logit diff|", f"{rep['verify_max_abs_logit_diff']}")
    if "ttft" in r:
        t = r["ttft"]
        row(f"TTFT {args.prefix} in L1 + {args.suffix} new, ms", f"{t['l1_ms']:.1f}")
        row(f"TTFT {args.prefix} in L2 + {args.suffix} new, ms", f"{t['l2_ms']:.1f}")
        row("TTFT full recompute, ms", f"{t['recompute_ms']:.1f}")
        row("  L2 / L1", f"{t['l2_over_l1']:.2f}", "<= 1.5")
        row("  recompute / L2", f"{t['recompute_over_l2']:.1f}", ">= 7")
        row(
            f"  copy alone {t['copy_bytes'] / 1e9:.2f} GB, ms (GB/s)",
            f"{t['copy_ms']:.1f} ({t['copy_gbps']:.1f})",
            f"{t['copy_over_pinned_h2d']:.2f}x pinned H2D",
        )
    if "write_through" in r:
        w = r["write_through"]
        row(f"prefill {args.wt_tokens}, write-through off, ms", f"{w['off_ms']:.1f}")
        row(f"prefill {args.wt_tokens}, write-through on, ms", f"{w['on_ms']:.1f}")
        row("  on / off", f"{w['ratio']:.3f}", "<= 1.05")
    if len(r.get("copy", {})) > 1:
        lines.append("")
        lines.append(
            f"{'copy kernel programs':<22} {'L1 ms':>7} {'L2 ms':>7} {'L2/L1':>6} "
            f"{'copy ms':>8} {'GB/s':>6} {'WT on/off':>9}"
        )
        for programs, shape in r["copy"].items():
            t, w = shape.get("ttft"), shape.get("write_through")
            mark = " (default)" if int(programs) == r["copy_programs_default"] else ""
            lines.append(
                f"{(programs if programs != '0' else 'one per step') + mark:<22} "
                + (
                    f"{t['l1_ms']:>7.1f} {t['l2_ms']:>7.1f} {t['l2_over_l1']:>6.2f} "
                    f"{t['copy_ms']:>8.1f} {t['copy_gbps']:>6.1f} "
                    if t
                    else " " * 40
                )
                + (f"{w['ratio']:>9.3f}" if w else "")
            )
    met = r["targets"]
    lines.append("targets met: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in met.items()))
    return "\n".join(lines)


def _driver() -> str | None:
    """The NVIDIA driver version, as nvidia-smi reports it (None without nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
    except (FileNotFoundError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench gpu``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
