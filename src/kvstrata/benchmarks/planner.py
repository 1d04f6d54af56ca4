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

from ..allocator import PageAllocator
from ..config import CacheConfig, PoolConfig
from ..ownership import page_span
from ..radix import RadixTree
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
        alloc.free(tree.insert(key, np.concatenate([hit.device_pages, fresh])).free_pages)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvstrata bench planner",
        description="Owner-lane eviction planner on the production fork's worst case: a table, "
        "then one JSON line with plan_ms.",
    )
    ap.add_argument("--leaves", type=int, default=2000, help="evictable candidates (leaves)")
    ap.add_argument("--pages", type=int, default=16, help="pages per leaf")
    ap.add_argument("--cp-size", type=int, default=4, help="lanes (context-parallel ranks)")
    ap.add_argument("--deficit", type=int, default=7877, help="pages short in lane 0")
    ap.add_argument("--repeat", type=int, default=5, help="plans timed (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("leaves", "pages", "cp_size", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.deficit <= args.leaves * -(-args.pages // args.cp_size):
        ap.error("--deficit must lie between 0 and the lane's pages in the candidates")
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
