"""``kvstrata bench tiers``: one request's TTFT with its prefix in each tier, through the engine,
against the disk's own read of the same bytes, in one run.

One request of a ``--prefix``-token prefix plus ``--suffix`` new tokens, served by the engine a
user drives (``Engine.add`` / ``step`` on the wall clock), with the prefix

* in **L1** (served before, still on the device),
* in **L2** only (L1 evicted; loaded back layer by layer),
* in **L3** only, **after a restart**: a new engine opened with ``l3_start="load"`` on the directory
  the first one spilled to, whose L1 and L2 are empty (read from disk, verified, loaded back),
* **nowhere** (full recompute),

and ``dd`` with O_DIRECT reading the same number of bytes at the disk slot's block size from a file
on the same filesystem (written with O_DIRECT first). Medians of ``--repeats`` rounds, alternating.
Target (docs/benchmarks.md): L3-hit TTFT <= L2-hit TTFT + 1.25 x dd's read. On CUDA the default is
the Llama-3.2-1B preset in bf16 and a 32,768-token prefix; on the CPU the tiny preset (the suite's
smoke test). Output: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..command import CommandParser, HelpFormatter, run_command
from ..engine import Engine, EngineConfig, Finished
from ..errors import ConfigError
from ..limits import check_device, check_fits
from ..model.compute import ModelCompute
from ..model.loader import load_model, read_model_config
from ..residency import Tier
from ..tiers.disk_format import round_up
from ..workloads import Request
from .disk import _dd

PROG = "kvstrata bench tiers"
PAGE = 16
#: The most rounds --repeats asks for (each restarts an engine; a typo of 10^10 ran for ever)
MAX_REPEATS = 1000
GIB = 1 << 30


def build_parser() -> CommandParser:
    p = CommandParser(
        prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--model", default=None, help="preset or checkpoint (default: llama-3.2-1b on CUDA, tiny)"
    )
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument(
        "--prefix", type=int, default=None, help="prefix tokens (default: 32768; CPU 2048)"
    )
    p.add_argument("--suffix", type=int, default=None, help="new tokens (default: 1024; CPU 128)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per tier (median)")
    p.add_argument(
        "--dir", default=".", help="where the disk tier and dd's file go (a scratch directory)"
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def _defaults(args: argparse.Namespace) -> None:
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("llama-3.2-1b" if cuda else "tiny")
    args.prefix = args.prefix or (32768 if cuda else 2048)
    args.suffix = args.suffix or (1024 if cuda else 128)
    for name in ("prefix", "suffix", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1")
    if args.repeats > MAX_REPEATS:  # each round restarts an engine and reads the prefix
        raise ConfigError(f"--repeats must lie in [1, {MAX_REPEATS}], got {args.repeats}")
    if args.prefix % PAGE:
        raise ConfigError(f"--prefix must be a multiple of the page size {PAGE}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if not Path(args.dir).is_dir() or not os.access(args.dir, os.W_OK):
        raise ConfigError(f"--dir {args.dir} is not a writable directory; give one on the disk")


class _Tiered:
    """An engine with L1, L2 and an L3 under ``root``; serves one request at a time."""

    def __init__(self, compute: ModelCompute, args: argparse.Namespace, root: Path, start: str):
        n = args.prefix + args.suffix
        kv = compute.layout.page_bytes(PAGE) * -(-n // PAGE)
        self.engine = Engine(
            compute,
            EngineConfig(
                page_size=PAGE,
                pool_tokens=3 * n,
                chunk_size=n,
                max_batch_tokens=n,
                device=args.device,
                l2_tokens=3 * n,
                l3_dir=str(root),
                l3_gib=max(0.05, 3 * kv / GIB),
                l3_start=start,
            ),
            model_id=f"bench-tiers:{args.model}:{args.seed}",
        )
        self.rid = 0

    def serve(self, tokens: np.ndarray) -> Finished:
        engine = self.engine
        self.rid += 1
        engine.add(Request(self.rid, tokens.astype(np.uint32)))
        done: list[Finished] = []
        while engine.has_work():
            done += engine.step()
        (f,) = done
        if f.error is not None:
            raise ConfigError(f"{PROG}: a benchmark request failed: {f.error}")
        engine.drain()
        return f

    def demote_l1(self) -> None:
        cache = self.engine.cache
        cache.allocator.free(cache.tree.evict(cache.allocator.num_pages))

    def close(self) -> None:
        self.engine.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _defaults(args)
    device = check_device(args.device)
    config = read_model_config(args.model)
    n = args.prefix + args.suffix
    if n > config.max_position_embeddings:
        raise ConfigError(
            f"--prefix + --suffix ({n:,}) exceed {args.model}'s "
            f"{config.max_position_embeddings:,} positions; give a shorter prefix"
        )
    _, model = load_model(args.model, device=device, dtype=args.dtype, seed=args.seed)
    compute = ModelCompute(model, next(model.parameters()).dtype)
    pool = 3 * compute.layout.page_bytes(PAGE) * -(-n // PAGE)  # each tier holds 3 requests
    hint = "give a shorter --prefix"
    check_fits([("L1 pool", pool)], device, hint)
    check_fits([("L2 pool", pool)], torch.device("cpu"), hint)
    rng = np.random.default_rng(args.seed)
    vocab = compute.vocab_size
    prefix = rng.integers(0, vocab, args.prefix)
    scratch = Path(tempfile.mkdtemp(prefix="kvstrata-bench-tiers-", dir=args.dir))
    times: dict[str, list[float]] = {"l1": [], "l2": [], "l3": [], "recompute": [], "dd": []}

    def with_suffix(head: np.ndarray) -> np.ndarray:
        return np.concatenate([head, rng.integers(0, vocab, args.suffix)])

    try:
        first = _Tiered(compute, args, scratch / "l3", "clear")
        first.serve(with_suffix(prefix))  # computes the prefix: L1, L2 (write-through), L3 (spill)
        first.serve(with_suffix(rng.integers(0, vocab, args.prefix)))  # warm-up of a recompute
        first.close()
        read_bytes = 0
        for _ in range(args.repeats):
            # After a restart: L1 and L2 empty, the prefix on disk only.
            again = _Tiered(compute, args, scratch / "l3", "load")
            disk = again.engine.cache.disk
            assert disk is not None
            before = disk.store.stats().bytes_read
            f = again.serve(with_suffix(prefix))
            if f.cached_len != args.prefix or again.engine.hit_tokens[Tier.L3] != args.prefix:
                raise ConfigError(f"{PROG}: the restarted engine did not hit the prefix on disk")
            times["l3"].append(f.ttft_s)
            read_bytes = disk.store.stats().bytes_read - before
            f = again.serve(with_suffix(prefix))
            assert f.cached_len == args.prefix and f.host_len == 0, f
            times["l1"].append(f.ttft_s)
            again.demote_l1()
            f = again.serve(with_suffix(prefix))
            assert f.cached_len == args.prefix and f.host_len == args.prefix, f
            times["l2"].append(f.ttft_s)
            f = again.serve(with_suffix(rng.integers(0, vocab, args.prefix)))
            assert f.cached_len == 0, f
            times["recompute"].append(f.ttft_s)
            again.close()
            times["dd"].append(_dd_read(scratch, read_bytes, compute))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    limit = ms["l2"] + 1.25 * ms["dd"]
    print(
        f"model      {args.model} ({next(model.parameters()).dtype}) on {device}, prefix "
        f"{args.prefix:,} + {args.suffix:,} new tokens, {args.repeats} rounds, median"
    )
    print(f"disk       {read_bytes / 1e9:.3f} GB read for the prefix ({scratch.parent})")
    print(f"{'prefix in':<24}{'TTFT ms':>10}")
    for name, label in (
        ("l1", "L1 (device)"),
        ("l2", "L2 (host)"),
        ("l3", "L3 (disk, after restart)"),
        ("recompute", "nowhere (recompute)"),
        ("dd", "dd O_DIRECT read"),
    ):
        print(f"{label:<24}{ms[name]:>10.1f}")
    verdict = "met" if ms["l3"] <= limit else "NOT met"
    print(f"target     L3 <= L2 + 1.25 x dd = {limit:.1f} ms: {verdict}")
    result = {
        "bench": "tiers",
        "model": args.model,
        "device": str(device),
        "prefix": args.prefix,
        "suffix": args.suffix,
        "read_bytes": read_bytes,
        "ttft_ms": {k: round(v, 3) for k, v in ms.items() if k != "dd"},
        "dd_read_ms": round(ms["dd"], 3),
        "l3_target_ms": round(limit, 3),
        "l3_met": ms["l3"] <= limit,
        "rounds_ms": {k: [round(1000 * x, 3) for x in v] for k, v in times.items()},
        "args": vars(args),
    }
    print(json.dumps(result))
    return 0


def _dd_read(scratch: Path, nbytes: int, compute: ModelCompute) -> float:
    """Seconds dd takes to read ``nbytes`` with O_DIRECT at one disk slot's block size (the file
    is written with O_DIRECT first, from random bytes, so nothing is cached)."""
    block = round_up(64 + compute.layout.page_bytes(PAGE) // len(compute.layout.payloads))
    count = max(1, -(-nbytes // block))
    path = scratch / "dd.bin"
    src = scratch / "dd.src"
    if not path.exists():
        src.write_bytes(np.random.default_rng(0).bytes(block * count))
        _dd([f"if={src}", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct",
             "conv=fdatasync"])  # fmt: skip
        src.unlink()
    rate = _dd([f"if={path}", "of=/dev/null", f"bs={block}", f"count={count}", "iflag=direct"])
    return block * count / rate


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench tiers``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
