"""``kvstrata bench planner``: how long one owner-lane eviction plan takes on a large deficit.

The production fork's worst case: about 2,000 evictable candidates, cp_size 4, and one lane short
by 7,877 pages. The tree here holds ``--leaves`` sequences of ``--pages`` pages under a shared
prefix; a deficit in lane 0 makes the planner walk the candidates in LRU order and trim each one
until lane 0 has its pages. Prints a table, then one JSON line (``plan_ms`` is the median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from ..cache.allocator import PageAllocator
from ..cache.radix import RadixTree
from ..command import CommandParser, run_command
from ..config import CacheConfig, PoolConfig
from ..errors import ConfigError
from ..limits import ALLOCATOR_BYTES_PER_PAGE, check_fits
from ..ownership import page_span
from ..residency import Tier


def build(
    leaves: int, pages: int, cp_size: int, page_size: int, seed: int
) -> tuple[RadixTree, PageAllocator]:
    """A tree of ``leaves`` unlocked leaves of ``pages`` pages each under one shared page."""
    rng = np.random.default_rng(seed)
    total = leaves * (pages + 1) + cp_size
    tree = RadixTree(CacheConfig(page_size=page_size, cp_size=cp_size), total)
    alloc = PageAllocator(PoolConfig(total, cp_size))
    shared = rng.integers(0, 1 << 31, page_size, dtype=np.uint32)
    for _ in range(leaves):
        tokens = np.concatenate(
            [shared, rng.integers(0, 1 << 31, pages * page_size, dtype=np.uint32)]
        )
        key = tree.key(tokens)
        hit = tree.match_prefix(key)
        start = hit.valid_len // page_size
        fresh = alloc.alloc(start, page_span(tokens.size, page_size) - start)
        assert fresh is not None
        result = tree.insert(key, np.concatenate([hit.device_pages, fresh]), hit.valid_len)
        alloc.free(result.free_pages)
    return tree, alloc


def run(leaves: int, pages: int, cp_size: int, deficit: int, repeat: int, seed: int) -> dict:
    times, freed_pages, victims = [], 0, 0
    need = np.zeros(cp_size, dtype=np.int64)
    need[0] = deficit
    for i in range(repeat):
        tree, alloc = build(leaves, pages, cp_size, 16, seed + i)
        before = tree.num_nodes
        t0 = time.perf_counter()
        freed = tree.evict(need, Tier.L1)
        times.append(time.perf_counter() - t0)
        freed_pages, victims = freed.size, before - tree.num_nodes
        lane0 = int(np.count_nonzero(freed % cp_size == 0))
        assert lane0 >= deficit, (lane0, deficit)
        alloc.free(freed)
        tree.check()
    return {
        "plan_ms": round(statistics.median(times) * 1e3, 3),
        "plan_ms_min": round(min(times) * 1e3, 3),
        "freed_pages": int(freed_pages),
        "victims_removed": int(victims),
    }


PROG = "kvstrata bench planner"
#: Host bytes per page of the benchmark's tree beyond the allocator's: 16 uint32 tokens, their
#: 64-bit page keys and node bookkeeping (rounded up).
_TREE_BYTES_PER_PAGE = 128
#: More timed plans than this is a typo, not a measurement.
_MAX_REPEAT = 10_000


def build_parser() -> CommandParser:
    """The benchmark's flags."""
    ap = CommandParser(
        prog=PROG,
        description="Owner-lane eviction planner on the production fork's worst case: a table, "
        "then one JSON line with plan_ms.",
    )
    ap.add_argument("--leaves", type=int, default=2000, help="evictable candidates (leaves)")
    ap.add_argument("--pages", type=int, default=16, help="pages per leaf")
    ap.add_argument("--cp-size", type=int, default=4, help="lanes (context-parallel ranks)")
    ap.add_argument("--deficit", type=int, default=7877, help="pages short in lane 0")
    ap.add_argument("--repeat", type=int, default=5, help="plans timed (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values the benchmark cannot run with, before it builds anything."""
    for name in ("leaves", "pages", "cp_size", "repeat"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.repeat > _MAX_REPEAT:
        raise ConfigError(f"--repeat must be <= {_MAX_REPEAT:,}, got {args.repeat}")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed must lie in [0, 2**63), got {args.seed}")
    if not 0 <= args.deficit <= args.leaves * -(-args.pages // args.cp_size):
        raise ConfigError(
            f"--deficit must lie between 0 and the lane's pages in the candidates, got {args.deficit}"
        )
    pages = args.leaves * (args.pages + 1) + args.cp_size
    check_fits(
        [(f"a tree of {pages:,} pages", pages * (ALLOCATOR_BYTES_PER_PAGE + _TREE_BYTES_PER_PAGE))],
        torch.device("cpu"),
        hint="lower --leaves or --pages",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for command-line arguments ``argv``; returns the exit status."""
    args = build_parser().parse_args(argv)
    check_args(args)
    result = run(args.leaves, args.pages, args.cp_size, args.deficit, args.repeat, args.seed)
    rows = [
        ("candidates", f"{args.leaves:,} leaves x {args.pages} pages, cp_size {args.cp_size}"),
        ("deficit", f"{args.deficit:,} pages in lane 0"),
        ("plan ms (median / min)", f"{result['plan_ms']:.2f} / {result['plan_ms_min']:.2f}"),
        ("pages freed", f"{result['freed_pages']:,}"),
        ("victims removed", f"{result['victims_removed']:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(json.dumps({"bench": "planner", **vars(args), **result}))
    return 0


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench planner``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
