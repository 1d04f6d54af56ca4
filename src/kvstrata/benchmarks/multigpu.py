"""``kvstrata bench multi-gpu``: context parallelism across GPUs, one process per GPU over NCCL.

For each ``--cp`` N the ranks start with :func:`~kvstrata.dist.launch.run_ranks` (NCCL, one GPU
per rank; ``--device cpu`` runs the same code over gloo) and load the same seeded model:

1. **correctness**: ``--requests`` built-in chat requests through an engine that compares the
   replicated digests on every step; last-token logits at cp N against cp 1 (max |diff|, argmax
   agreement; target >= 99 %), and the final digests of every rank;
2. **scaling**: a cold prefill of one ``--prompt``-token request (TTFT, tokens/s), and the TTFT of
   a hit (``--prefix`` cached, ``--suffix`` new) with each attention strategy forced; medians of
   ``--repeats``, the device drained around each request;
3. **collectives**: the move-KV exchange of one more hit timed with the device drained around each
   of its all-reduces (bus bandwidth, nccl-tests formulas), against a plain all-reduce and an
   all-gather of the same bytes in the same run; the bytes the move-queries path saves;
4. **capacity**: distinct ``--prompt``-token requests into a ``--pool-tokens`` pool per rank until
   eviction starts: the tokens each rank stores and the tokens the group caches (every page is
   stored once, so the total grows with N).

Prints a table, then one JSON line (``{"bench": "multi-gpu", ...}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch

from ..command import CommandParser, HelpFormatter, run_command
from ..dist.group import Group, Traffic
from ..dist.launch import run_ranks
from ..engine import Engine, EngineConfig, Finished
from ..errors import ConfigError
from ..limits import check_device
from ..model.compute import ModelCompute
from ..model.loader import load_model, read_model_config
from ..ownership import page_span
from ..workloads import Request, builtin

PROG = "kvstrata bench multi-gpu"
PAGE = 16
STRATEGIES = ("move_kv", "move_queries")
#: Flags that keep NCCL off NVLink multicast (NVLS) on the lent multi-GPU machines.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}
COLLECTIVE_ITERS = 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedGroup:
    """``inner`` with a stopwatch on its attention all-reduces: while ``timing`` is on, the device
    is drained before and after each one, so its wall time is the collective's alone (off while
    TTFT is measured: the drains would serialise compute and communication)."""

    def __init__(self, inner: Group, device: torch.device) -> None:
        self.inner = inner
        self.device = device
        self.rank = inner.rank
        self.size = inner.size
        self.traffic: Traffic = inner.traffic
        self.timing = False
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0

    @property
    def step(self) -> int:
        return self.inner.step

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value

    def all_reduce(self, tensor: torch.Tensor, op: str, purpose: str) -> None:
        if not (self.timing and purpose == "attention"):
            return self.inner.all_reduce(tensor, op, purpose)
        _sync(self.device)
        t0 = time.perf_counter()
        self.inner.all_reduce(tensor, op, purpose)
        _sync(self.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return None

    def broadcast_object(self, obj: Any, purpose: str) -> Any:
        return self.inner.broadcast_object(obj, purpose)

    def all_gather_object(self, obj: Any, purpose: str) -> list[Any]:
        return self.inner.all_gather_object(obj, purpose)

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor, purpose: str) -> None:
        self.inner.all_gather_into(out, tensor, purpose)


class _Server:
    """One engine serving one request at a time, timed from its arrival to its logits."""

    def __init__(self, compute: ModelCompute, config: EngineConfig, group: Group) -> None:
        self.engine = Engine(compute, config, group=group)
        self.device = torch.device(config.device)
        self.rid = 0

    def serve(self, tokens: np.ndarray, strategy: str = "auto") -> tuple[Finished, float]:
        engine = self.engine
        engine.config = dataclasses.replace(engine.config, cp_attention=strategy)
        self.rid += 1
        _sync(self.device)
        t0 = time.perf_counter()
        engine.add(Request(self.rid, tokens.astype(np.uint32)))
        done: list[Finished] = []
        while engine.has_work():
            done += engine.step()
        _sync(self.device)
        seconds = time.perf_counter() - t0
        (finished,) = done
        if finished.error is not None:
            raise ConfigError(f"{PROG}: a benchmark request failed: {finished.error}")
        engine.drain()
        return finished, seconds

    def digest(self) -> tuple[str, str]:
        return self.engine.cache.allocator.digest(), self.engine.cache.tree.digest()


def _config(cfg: dict[str, Any], group: Group, tokens: int, **extra: Any) -> EngineConfig:
    """An engine whose pool holds ``tokens`` tokens of the group's page space (each rank its
    share, plus a page per lane of slack)."""
    per_rank = (page_span(tokens, PAGE) // group.size + 1) * PAGE
    return EngineConfig(
        page_size=PAGE,
        pool_tokens=per_rank,
        chunk_size=cfg["chunk_size"],
        max_batch_tokens=cfg["chunk_size"],
        device=cfg["device"],
        **extra,
    )


def correctness(compute: ModelCompute, group: Group, cfg: dict[str, Any]) -> dict[str, Any]:
    """The built-in requests with digests compared every step; rank 0 keeps the logits."""
    requests = builtin(compute.vocab_size, seed=cfg["seed"], n_requests=cfg["requests"])
    total = sum(r.tokens.size for r in requests) + PAGE * len(requests)
    engine = Engine(compute, _config(cfg, group, total, check_digests=True), group=group)
    engine.keep_logits = {r.rid for r in requests}
    out = engine.run(requests)
    errors = [f.error for f in out.values() if f.error]
    if errors:
        raise ConfigError(f"{PROG}: {len(errors)} correctness requests failed: {errors[0]}")
    logits = None
    if group.rank == 0:
        rows = [out[r.rid].logits for r in requests]
        assert all(row is not None for row in rows), "a kept request has no logits"
        logits = torch.stack([row.float() for row in rows if row is not None]).numpy()
    return {
        "logits": logits,
        "digest": (engine.cache.allocator.digest(), engine.cache.tree.digest()),
        "cached_tokens": sum(f.cached_len for f in out.values()),
    }


def cold(compute: ModelCompute, group: Group, cfg: dict[str, Any]) -> dict[str, Any]:
    """TTFT of fresh ``prompt``-token requests (one warm-up), median of the repeats."""
    n = cfg["prompt"]
    server = _Server(compute, _config(cfg, group, 2 * n), group)
    rng = np.random.default_rng(cfg["seed"] + 1)
    times = [
        server.serve(rng.integers(0, compute.vocab_size, n))[1] for _ in range(cfg["repeats"] + 1)
    ]
    ttft = statistics.median(times[1:])
    return {"ttft_ms": 1e3 * ttft, "tokens_per_s": n / ttft, "digest": server.digest()}


def hits(compute: ModelCompute, group: TimedGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """TTFT of ``prefix`` cached + ``suffix`` new with each strategy forced (one warm-up each),
    the attention bytes this rank sent, and one more move-KV hit with its all-reduces timed."""
    prefix, suffix = cfg["prefix"], cfg["suffix"]
    server = _Server(compute, _config(cfg, group, prefix + 4 * suffix), group)
    rng = np.random.default_rng(cfg["seed"] + 2)
    vocab = compute.vocab_size
    head = rng.integers(0, vocab, prefix)

    def request() -> np.ndarray:
        return np.concatenate([head, rng.integers(0, vocab, suffix)])

    server.serve(request())  # caches the prefix
    out: dict[str, Any] = {}
    for strategy in STRATEGIES if group.size > 1 else ("local",):
        force = "auto" if strategy == "local" else strategy
        times, moved = [], 0
        for i in range(cfg["repeats"] + 1):
            before = group.traffic.bytes.get("attention", 0)
            f, seconds = server.serve(request(), force)
            assert f.cached_len == prefix, (f.cached_len, prefix)
            moved = group.traffic.bytes.get("attention", 0) - before
            if i:
                times.append(seconds)
        out[strategy] = {"ttft_ms": 1e3 * statistics.median(times), "attention_bytes": moved}
    if group.size > 1:
        group.timing = True
        server.serve(request(), "move_kv")
        group.timing = False
        out["move_kv_exchange"] = {
            "bytes": group.bytes,
            "calls": group.calls,
            "seconds": group.seconds,
        }
    out["digest"] = server.digest()
    return out


def _median_seconds(device: torch.device, fn: Any) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(COLLECTIVE_ITERS):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reference(
    group: Group, num_bytes: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Median seconds of a plain all-reduce of ``num_bytes`` and of an all-gather whose output
    is ``num_bytes`` (each rank contributes ``1/size`` of it)."""
    size = group.size
    numel = max(num_bytes // torch.tensor([], dtype=dtype).element_size() // size, 1) * size
    buffer = torch.ones(numel, dtype=dtype, device=device)
    gathered = torch.empty(numel, dtype=dtype, device=device)
    part = buffer[: numel // size].clone()
    return {
        "bytes": numel * buffer.element_size(),
        "all_reduce_s": _median_seconds(device, lambda: group.all_reduce(buffer, "sum", "bench")),
        "all_gather_s": _median_seconds(
            device, lambda: group.all_gather_into(gathered, part, "bench")
        ),
    }


def capacity(compute: ModelCompute, group: Group, cfg: dict[str, Any]) -> dict[str, Any]:
    """Distinct ``prompt``-token requests into a ``pool_tokens`` pool per rank until the cache
    stops growing: the group's cached tokens at its largest and what each rank stores then."""
    n = cfg["prompt"]
    config = EngineConfig(
        page_size=PAGE,
        pool_tokens=cfg["pool_tokens"],
        chunk_size=cfg["chunk_size"],
        max_batch_tokens=cfg["chunk_size"],
        device=cfg["device"],
        check_digests=True,
    )
    server = _Server(compute, config, group)
    rng = np.random.default_rng(cfg["seed"] + 3)
    engine = server.engine
    lanes = engine.cache.allocator.config.slots_per_rank
    best, stored, served = 0, 0, 0
    while True:
        server.serve(rng.integers(0, compute.vocab_size, n))
        served += 1
        cached = engine.cache.tree.num_pages * PAGE
        if cached <= best:  # eviction started: the pool is full
            break
        best = cached
        stored = (lanes - int(engine.cache.allocator.free_per_lane()[group.rank])) * PAGE
    return {
        "cached_tokens": best,
        "stored_tokens": stored,
        "requests": served,
        "digest": server.digest(),
    }


def rank_main(group: Group, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every part on this rank; rank 0's result carries the figures, every rank its digests."""
    device = torch.device(cfg["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)
    _, model = load_model(cfg["model"], device=device, dtype=cfg["dtype"], seed=cfg["seed"])
    dtype = next(model.parameters()).dtype
    compute = ModelCompute(model, dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out: dict[str, Any] = {"device_name": name, "correctness": correctness(compute, group, cfg)}
    _release(device)
    out["cold"] = cold(compute, group, cfg)
    _release(device)
    out["hit"] = hits(compute, TimedGroup(group, device), cfg)
    _release(device)
    if group.size > 1:
        exchange = out["hit"]["move_kv_exchange"]
        per_call = exchange["bytes"] // max(exchange["calls"], 1)
        out["reference"] = reference(group, per_call, dtype, device)
    out["capacity"] = capacity(compute, group, cfg)
    return out


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the parent: arguments, launches, figures ------------------------------------------------------


def build_parser() -> CommandParser:
    p = CommandParser(
        prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="rank counts (with 1)")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda: NCCL, one GPU per rank; cpu: the same over gloo",
    )
    p.add_argument(
        "--model", default=None, help="preset or checkpoint (default: llama-3.2-1b; tiny on cpu)"
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    p.add_argument("--prompt", type=int, default=32768, help="cold prefill and capacity, tokens")
    p.add_argument("--prefix", type=int, default=32768, help="hit: cached prefix, tokens")
    p.add_argument("--suffix", type=int, default=1024, help="hit: new tokens after it")
    p.add_argument("--requests", type=int, default=64, help="correctness: built-in requests")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (medians)")
    p.add_argument("--chunk-size", type=int, default=8192, help="prefill chunk, tokens")
    p.add_argument("--pool-tokens", type=int, default=65536, help="capacity: pool per rank")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per cp run")
    p.add_argument("--seed", type=int, default=0)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse values the benchmark cannot run with, before any device work."""
    if any(not 1 <= c <= 8 for c in args.cp) or 1 not in args.cp:
        raise ConfigError(f"--cp values must lie in [1, 8] and include 1, got {args.cp}")
    for name, lo, hi in (
        ("prompt", PAGE, 1 << 20),
        ("prefix", PAGE, 1 << 20),
        ("suffix", 1, 1 << 17),
        ("requests", 1, 10_000),
        ("repeats", 1, 1000),
        ("chunk_size", 1, 1 << 20),
        ("pool_tokens", PAGE, 1 << 24),
    ):
        value = getattr(args, name)
        if not lo <= value <= hi:
            raise ConfigError(f"--{name.replace('_', '-')} must lie in [{lo}, {hi}], got {value}")
    for name in ("prompt", "prefix", "pool_tokens"):
        if getattr(args, name) % PAGE:
            flag = f"--{name.replace('_', '-')}"
            raise ConfigError(f"{flag} must be a multiple of the page size {PAGE}")
    if args.pool_tokens < args.prompt + PAGE:
        raise ConfigError(
            f"--pool-tokens ({args.pool_tokens}) must hold a --prompt request ({args.prompt}) "
            "and a page more"
        )
    if not 1 <= args.timeout <= 86400:
        raise ConfigError(f"--timeout must lie in [1, 86400] seconds, got {args.timeout}")
    if not 0 <= args.seed < 2**31:
        raise ConfigError(f"--seed must lie in [0, 2**31), got {args.seed}")


def check_gpus(cps: list[int], device: str) -> int | None:
    """The visible GPU count on cuda (one rank per GPU, never two on one), None on cpu."""
    if device != "cuda":
        return None
    visible = torch.cuda.device_count()
    if max(cps) > visible:
        raise ConfigError(
            f"--cp {max(cps)} needs {max(cps)} GPUs (one per rank), but {visible} CUDA "
            f"device(s) are visible; drop the larger --cp values"
        )
    return visible


def _busbw(num_bytes: int, seconds: float, factor: float) -> float:
    """nccl-tests bus bandwidth (GB/s): algbw = bytes / time, times the collective's factor."""
    return num_bytes / seconds * factor / 1e9 if seconds > 0 else 0.0


def summarise(cp: int, ranks: list[dict[str, Any]], solo_logits: np.ndarray) -> dict[str, Any]:
    """One cp's figures from its ranks' results (rank 0's timings)."""
    first = ranks[0]
    parts = ("correctness", "cold", "hit", "capacity")
    digests_equal = all(r[p]["digest"] == first[p]["digest"] for r in ranks for p in parts)
    logits = first["correctness"]["logits"]
    row: dict[str, Any] = {
        "cp": cp,
        "digests_equal": digests_equal,
        "max_abs_logit_diff": float(np.abs(logits - solo_logits).max()),
        "argmax_agree": float((logits.argmax(-1) == solo_logits.argmax(-1)).mean()),
        "cold_ttft_ms": first["cold"]["ttft_ms"],
        "cold_tokens_per_s": first["cold"]["tokens_per_s"],
        "hit": {s: v for s, v in first["hit"].items() if s in (*STRATEGIES, "local")},
    }
    if cp > 1:
        hit = row["hit"]
        row["move_queries_bytes_saved"] = (
            hit["move_kv"]["attention_bytes"] - hit["move_queries"]["attention_bytes"]
        )
        ex, ref = first["hit"]["move_kv_exchange"], first["reference"]
        ar, ag = 2 * (cp - 1) / cp, (cp - 1) / cp
        per_call_s = ex["seconds"] / max(ex["calls"], 1)
        row["exchange"] = {
            "bytes_per_call": ex["bytes"] // max(ex["calls"], 1),
            "calls": ex["calls"],
            "ms_per_call": 1e3 * per_call_s,
            "busbw_gbps": _busbw(ex["bytes"], ex["seconds"], ar),
            "ref_bytes": ref["bytes"],
            "all_reduce_ms": 1e3 * ref["all_reduce_s"],
            "all_reduce_busbw_gbps": _busbw(ref["bytes"], ref["all_reduce_s"], ar),
            "all_gather_ms": 1e3 * ref["all_gather_s"],
            "all_gather_busbw_gbps": _busbw(ref["bytes"], ref["all_gather_s"], ag),
        }
        e = row["exchange"]
        e["busbw_over_all_gather"] = (
            e["busbw_gbps"] / e["all_gather_busbw_gbps"] if e["all_gather_busbw_gbps"] else None
        )
        e["ms_over_all_gather"] = (
            e["ms_per_call"] / e["all_gather_ms"] if e["all_gather_ms"] else None
        )
    stored = [r["capacity"]["stored_tokens"] for r in ranks]
    row["capacity"] = {
        "stored_tokens_per_rank": stored,
        "cached_tokens": first["capacity"]["cached_tokens"],
        "requests": first["capacity"]["requests"],
        "every_page_once": sum(stored) == first["capacity"]["cached_tokens"],
    }
    return row


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    cps = sorted(set(args.cp))
    device = check_device(args.device)
    visible = check_gpus(cps, device.type)
    model = args.model or ("llama-3.2-1b" if device.type == "cuda" else "tiny")
    read_model_config(model)  # an unknown preset or a bad checkpoint fails here, not in a rank
    if device.type == "cuda":
        for name, value in NCCL_ENV.items():
            os.environ.setdefault(name, value)
    cfg = {
        "device": args.device,
        "model": model,
        "dtype": args.dtype,
        "seed": args.seed,
        "prompt": args.prompt,
        "prefix": args.prefix,
        "suffix": args.suffix,
        "requests": args.requests,
        "repeats": args.repeats,
        "chunk_size": args.chunk_size,
        "pool_tokens": args.pool_tokens,
    }
    t0 = time.perf_counter()
    runs: dict[int, list[dict[str, Any]]] = {}
    for cp in cps:
        runs[cp] = run_ranks(cp, rank_main, (cfg,), device=args.device, timeout_s=args.timeout)
    solo = runs[1][0]["correctness"]["logits"]
    rows = [summarise(cp, runs[cp], solo) for cp in cps]
    base = rows[0]["capacity"]["cached_tokens"]
    for row in rows:
        row["capacity"]["over_cp1"] = row["capacity"]["cached_tokens"] / base
    result = {
        "bench": "multi-gpu",
        "device": args.device,
        "device_name": runs[1][0]["device_name"],
        "gpus_visible": visible,
        "host": platform.node(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "env": {name: os.environ.get(name) for name in NCCL_ENV},
        "model": model,
        "dtype": args.dtype or ("bfloat16" if device.type == "cuda" else "float32"),
        **{k: cfg[k] for k in ("prompt", "prefix", "suffix", "requests", "repeats")},
        "chunk_size": args.chunk_size,
        "pool_tokens": args.pool_tokens,
        "runs": rows,
        "targets": {
            "argmax_agree_ge_0.99": all(r["argmax_agree"] >= 0.99 for r in rows),
            "digests_equal": all(r["digests_equal"] for r in rows),
            "every_page_once": all(r["capacity"]["every_page_once"] for r in rows),
        },
        "seconds": time.perf_counter() - t0,
    }
    print(_table(result))
    print(json.dumps(result, default=float))
    return 0


def _table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['device_name']} (up to {max(row['cp'] for row in r['runs'])} ranks on {r['host']}), torch "
        f"{r['torch']}, NCCL {r['nccl']}, {r['model']} {r['dtype']}",
        "",
        f"{'cp':>3}  {'figure':<46} {'value':>24}",
    ]

    def row(cp: int, name: str, value: str) -> None:
        lines.append(f"{cp:>3}  {name:<46} {value:>24}")

    for x in r["runs"]:
        cp = x["cp"]
        if cp > 1:
            row(
                cp,
                "logits vs cp 1: max |diff|, argmax agree",
                f"{x['max_abs_logit_diff']:.3g}, {x['argmax_agree']:.4f}",
            )
        row(cp, "digests equal on every rank", "yes" if x["digests_equal"] else "NO")
        row(
            cp,
            f"cold prefill {r['prompt']:,}: TTFT ms, tok/s",
            f"{x['cold_ttft_ms']:,.1f}, {x['cold_tokens_per_s']:,.0f}",
        )
        for strategy, hit in x["hit"].items():
            row(
                cp,
                f"hit {r['prefix']:,} + {r['suffix']:,} ({strategy}): TTFT ms",
                f"{hit['ttft_ms']:,.1f}",
            )
        if cp > 1:
            hit = x["hit"]
            row(
                cp,
                "attention bytes/rank: move KV, move queries",
                f"{hit['move_kv']['attention_bytes']:,}, {hit['move_queries']['attention_bytes']:,}",
            )
            row(cp, "  saved by move queries", f"{x['move_queries_bytes_saved']:,}")
            e = x["exchange"]
            row(
                cp,
                f"move-KV all-reduce {e['bytes_per_call']:,} B: ms, busbw GB/s",
                f"{e['ms_per_call']:.3f}, {e['busbw_gbps']:.1f}",
            )
            row(
                cp,
                "  plain all_reduce, same bytes: ms, busbw GB/s",
                f"{e['all_reduce_ms']:.3f}, {e['all_reduce_busbw_gbps']:.1f}",
            )
            row(
                cp,
                "  all_gather, same bytes: ms, busbw GB/s",
                f"{e['all_gather_ms']:.3f}, {e['all_gather_busbw_gbps']:.1f}",
            )
            ratio = e["ms_over_all_gather"]
            row(cp, "  exchange ms / all_gather ms", f"{ratio:.2f}" if ratio else "-")
        c = x["capacity"]
        row(
            cp,
            f"cached tokens, pool {r['pool_tokens']:,}/rank",
            f"{c['cached_tokens']:,} ({c['over_cp1']:.2f}x cp 1)",
        )
        row(cp, "  stored per rank", ", ".join(f"{s:,}" for s in c["stored_tokens_per_rank"]))
    met = r["targets"]
    lines.append("targets met: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in met.items()))
    return "\n".join(lines)


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
