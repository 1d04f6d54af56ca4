"""Radix tree benchmark over the shared synthetic workload (``kvstrata bench radix``).

Replays the workload as a serving engine drives the cache: per request, hash + ``match_prefix``,
then allocate pages for the uncached suffix, ``insert`` (freeing duplicate pages), and evict leaf-up
whenever the tree holds more than ``--budget`` tokens, down to 90 % of it. Requests are turned into
``uint32`` arrays before the clock starts, as a server receives token ids.

For each page size it also replays with no eviction and compares the matched-length checksum with
the workload's tree-free reference (``synthetic.reference_matched_lengths``).

In the same run, rounds alternating with kvstrata's, the peer (:mod:`.radix_peer`: SGLang's Rust
token tree, ``peers/sglang-tree``) replays the same requests from a dump; the table's ratio is
kvstrata's requests/s over the peer's, medians over ``--rounds``. With no peer built the benchmark
says so and its JSON has ``peer: null`` and the reason.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch

from ..cache.allocator import PageAllocator
from ..cache.radix import RadixTree
from ..command import CommandParser, run_command
from ..config import CacheConfig, PoolConfig
from ..errors import ConfigError
from ..limits import ALLOCATOR_BYTES_PER_PAGE, check_fits
from ..ownership import page_span
from ..workloads import shared_synthetic as synthetic
from . import radix_peer
from .radix_peer import PeerStats

PROG = "kvstrata bench radix"
#: What the generator's requests cost while they are built: about 6,700 tokens per request on
#: average (seed 0, 2,000 requests), about 15 bytes per token in its Python lists (measured with
#: ru_maxrss) plus 4 in the uint32 arrays.
_TOKENS_PER_REQUEST = 6_721
_BYTES_PER_TOKEN = 20

#: Rounds are cheap (one replay of the default workload takes a fraction of a second); this bounds
#: a typo, not a measurement.
MAX_ROUNDS = 100

#: The workload's own no-eviction references for seed 0 and 2,000 requests (from
#: ``python -m kvstrata.workloads.shared_synthetic --seed 0 --reference P``); ``--recompute-reference`` recomputes them.
KNOWN_REFERENCES = {
    (0, 2000): {1: "fcd11de4dbecc7ff", 16: "ba3b32e878c369f4", 64: "c9ce49f1968ab200"}
}


@dataclass
class RunStats:
    page_size: int
    evict: bool
    requests: int
    seconds: float
    match_us: float
    insert_us: float
    evicted_nodes: int
    evicted_pages: int
    matched_tokens: int
    checksum: str

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


def replay(
    requests: list[npt.NDArray[np.uint32]],
    page_size: int,
    budget_tokens: int | None,
    eviction: str = "lru",
) -> RunStats:
    """Replay ``requests`` through a tree and allocator; ``budget_tokens=None`` never evicts."""
    P = page_size
    longest = max(r.size for r in requests)
    if budget_tokens is None:
        budget_pages = sum(page_span(r.size, P) for r in requests)
    else:
        budget_pages = budget_tokens // P
    pool_pages = budget_pages + page_span(longest, P) + 1
    tree = RadixTree(CacheConfig(page_size=P, eviction=eviction), capacity_pages=pool_pages)
    alloc = PageAllocator(PoolConfig(num_pages=pool_pages))
    low_pages = int(budget_pages * 0.9)
    matched: list[int] = []
    t_match = t_insert = 0.0
    evicted_nodes = evicted_pages = 0
    clock = time.perf_counter
    start = clock()
    for tokens in requests:
        t0 = clock()
        key = tree.key(tokens)
        hit = tree.match_prefix(key)
        t1 = clock()
        cached_pages = hit.valid_len // P
        new_pages = alloc.alloc(cached_pages, page_span(tokens.size, P) - cached_pages)
        assert new_pages is not None, "pool sized to hold the budget plus one request"
        result = tree.insert(key, np.concatenate((hit.device_pages, new_pages)), hit.valid_len)
        alloc.free(result.free_pages)
        if tree.num_pages > budget_pages:
            nodes_before = tree.num_nodes
            freed = tree.evict(tree.num_pages - low_pages)
            alloc.free(freed)
            evicted_pages += freed.size
            evicted_nodes += nodes_before - tree.num_nodes
        t2 = clock()
        t_match += t1 - t0
        t_insert += t2 - t1
        matched.append(hit.valid_len)
    seconds = clock() - start
    assert alloc.num_used == tree.num_pages, "every page is either free or held by the tree"
    n = len(requests)
    return RunStats(
        page_size=P,
        evict=budget_tokens is not None,
        requests=n,
        seconds=seconds,
        match_us=t_match / n * 1e6,
        insert_us=t_insert / n * 1e6,
        evicted_nodes=evicted_nodes,
        evicted_pages=evicted_pages,
        matched_tokens=sum(matched),
        checksum=synthetic.matched_checksum(matched),
    )


def build_parser() -> CommandParser:
    """The benchmark's flags."""
    ap = CommandParser(
        prog=PROG,
        description="Radix prefix-tree benchmark on the shared synthetic workload: match -> insert "
        "-> evict when over budget. Prints a table, then one JSON line.",
    )
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--requests", type=int, default=2000, help="number of requests (default 2000)")
    ap.add_argument(
        "--page-sizes",
        type=int,
        nargs="+",
        default=[1, 16, 64],
        help="page sizes (default 1 16 64)",
    )
    ap.add_argument(
        "--budget", type=int, default=262_144, help="tree budget in tokens (default 262144)"
    )
    ap.add_argument("--eviction", choices=["lru", "slru"], default="lru")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds per page size, kvstrata and the peer alternating; the table shows medians "
        "(default 3)",
    )
    ap.add_argument(
        "--peer",
        metavar="PATH",
        help="the peer binary, sglang-tree-bench (default: peers/sglang-tree/target/release/"
        f"sglang-tree-bench if built; build: {radix_peer.BUILD_COMMAND})",
    )
    ap.add_argument(
        "--no-peer",
        action="store_true",
        help="run kvstrata's tree alone (the JSON says peer: null and why)",
    )
    ap.add_argument(
        "--recompute-reference",
        action="store_true",
        help="recompute the no-eviction reference checksums from the workload (slow)",
    )
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values the benchmark cannot run with, before it generates anything."""
    if not 0 <= args.seed < 2**64:
        raise ConfigError(f"--seed must lie in [0, 2**64), got {args.seed}")
    if args.requests < 1:
        raise ConfigError(f"--requests must be >= 1, got {args.requests}")
    if min(args.page_sizes) < 1:
        raise ConfigError(f"--page-sizes must all be >= 1, got {args.page_sizes}")
    if not 1 <= args.rounds <= MAX_ROUNDS:
        raise ConfigError(f"--rounds must lie in [1, {MAX_ROUNDS}], got {args.rounds}")
    if args.no_peer and args.peer is not None:
        raise ConfigError("--peer and --no-peer contradict each other; give one")
    if args.budget < max(args.page_sizes):
        raise ConfigError(
            f"--budget ({args.budget} tokens) must hold at least one page of every page size "
            f"(the largest is {max(args.page_sizes)})"
        )
    check_fits(
        [
            (
                f"{args.requests:,} generated requests",
                args.requests * _TOKENS_PER_REQUEST * _BYTES_PER_TOKEN,
            ),
            (
                # The larger of the two replays' pools, at the smallest page size.
                "the page allocator",
                max(args.budget, args.requests * _TOKENS_PER_REQUEST)
                // min(args.page_sizes)
                * ALLOCATOR_BYTES_PER_PAGE,
            ),
        ],
        torch.device("cpu"),
        hint="lower --requests or --budget",
    )


_R = TypeVar("_R", RunStats, PeerStats)


def _median_round(rounds: list[_R]) -> _R:
    """The median round by requests/s (the lower of the middle two for an even count)."""
    ranked = sorted(rounds, key=lambda r: r.requests_per_s)
    return ranked[(len(ranked) - 1) // 2]


@dataclass
class PageRow:
    """One page size's results: kvstrata's rounds and, when there is a peer, the peer's."""

    page_size: int
    reference: str
    noevict: RunStats
    rounds: list[RunStats]
    peer_rounds: list[PeerStats]

    @property
    def evict(self) -> RunStats:
        """kvstrata's median round by requests/s (the one the table shows)."""
        return _median_round(self.rounds)

    @property
    def peer(self) -> PeerStats | None:
        """The peer's median round by requests/s, or None without a peer."""
        return _median_round(self.peer_rounds) if self.peer_rounds else None

    @property
    def ratio(self) -> float | None:
        """Median kvstrata requests/s over median peer requests/s."""
        if not self.peer_rounds:
            return None
        kv = statistics.median(r.requests_per_s for r in self.rounds)
        return kv / statistics.median(r.requests_per_s for r in self.peer_rounds)

    @property
    def reference_ok(self) -> bool:
        """kvstrata's no-eviction checksum equals the workload's reference."""
        return self.noevict.checksum == self.reference

    @property
    def peer_reference_ok(self) -> bool | None:
        """The peer's no-eviction checksum equals the reference (None without a peer)."""
        peer = self.peer
        return None if peer is None else peer.noevict_matched_checksum == self.reference

    @property
    def ok(self) -> bool:
        """Both trees' no-eviction checksums equal the workload's reference."""
        return self.reference_ok and self.peer_reference_ok is not False


def run(args: argparse.Namespace, peer: Path | None) -> list[PageRow]:
    """One :class:`PageRow` per page size; ``peer`` (a binary) runs after each kvstrata round."""
    raw = synthetic.generate(args.seed, args.requests)
    requests = [np.array(r, dtype=np.uint32) for r in raw]
    known = KNOWN_REFERENCES.get((args.seed, args.requests), {})
    refs = {
        P: known[P]
        if P in known and not args.recompute_reference
        else synthetic.matched_checksum(synthetic.reference_matched_lengths(raw, P))
        for P in args.page_sizes
    }
    # The generator's lists hold ~14 M int references; left alive, every garbage-collector pass
    # walks them and the timings measure the collector instead of the tree.
    del raw
    gc.collect()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstrata-radix-") as tmp:
        dump = Path(tmp) / "workload.bin"
        if peer is not None:
            radix_peer.write_dump(requests, dump)
        for P in args.page_sizes:
            noevict = replay(requests, P, None, args.eviction)
            rounds, peer_rounds = [], []
            for _ in range(args.rounds):
                rounds.append(replay(requests, P, args.budget, args.eviction))
                if peer is not None:
                    peer_rounds.append(radix_peer.run_peer(peer, dump, P, args.budget))
            rows.append(PageRow(P, refs[P], noevict, rounds, peer_rounds))
    return rows


def _row_json(row: PageRow) -> dict[str, object]:
    ev, ne, peer = row.evict, row.noevict, row.peer
    out: dict[str, object] = {
        "page_size": row.page_size,
        "requests_per_s": round(ev.requests_per_s, 1),
        "rounds_requests_per_s": [round(r.requests_per_s, 1) for r in row.rounds],
        "match_us": round(ev.match_us, 2),
        "insert_us": round(ev.insert_us, 2),
        "evicted_nodes": ev.evicted_nodes,
        "evicted_pages": ev.evicted_pages,
        "matched_checksum": ev.checksum,
        "noevict_matched_checksum": ne.checksum,
        "noevict_requests_per_s": round(ne.requests_per_s, 1),
        "reference_checksum": row.reference,
        "reference_ok": row.reference_ok,
    }
    if peer is not None:
        ratio = row.ratio
        assert ratio is not None
        out |= {
            "peer_requests_per_s": round(peer.requests_per_s, 1),
            "peer_rounds_requests_per_s": [round(r.requests_per_s, 1) for r in row.peer_rounds],
            "peer_match_us": round(peer.match_us, 2),
            "peer_insert_us": round(peer.insert_us, 2),
            "peer_evictions": peer.evictions,
            "peer_matched_checksum": peer.matched_checksum,
            "peer_noevict_matched_checksum": peer.noevict_matched_checksum,
            "peer_reference_ok": row.peer_reference_ok,
            "ratio": round(ratio, 4),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for command-line arguments ``argv``; returns the exit status."""
    args = build_parser().parse_args(argv)
    check_args(args)
    peer: Path | None = None
    no_peer_reason: str | None = "--no-peer"
    if not args.no_peer:
        peer, no_peer_reason = radix_peer.find_peer(args.peer)
    if peer is None:
        print(f"peer: none ({no_peer_reason})")
    rows = run(args, peer)
    header = (
        f"{'page':>5} {'req/s':>9} {'match us':>9} {'insert us':>10} {'evicted nodes':>14} "
        f"{'evicted pages':>14} {'checksum (evict)':>17} {'no-evict checksum':>18} {'reference':>17}"
    )
    if peer is not None:
        header += (
            f" {'peer req/s':>11} {'peer match':>11} {'peer insert':>12} {'ratio':>6} peer ref"
        )
    print(header)
    print("-" * len(header))
    for row in rows:
        ev, ne = row.evict, row.noevict
        ok = "ok" if row.reference_ok else "MISMATCH"
        line = (
            f"{row.page_size:>5} {ev.requests_per_s:>9.0f} {ev.match_us:>9.1f} "
            f"{ev.insert_us:>10.1f} {ev.evicted_nodes:>14} {ev.evicted_pages:>14} "
            f"{ev.checksum:>17} {ne.checksum:>18} {row.reference:>14} {ok:>2}"
        )
        p = row.peer
        if p is not None:
            peer_ok = "ok" if row.peer_reference_ok else "MISMATCH"
            line += (
                f" {p.requests_per_s:>11.0f} {p.match_us:>11.1f} {p.insert_us:>12.1f} "
                f"{row.ratio:>6.2f} {peer_ok}"
            )
        print(line)
    if peer is not None:
        print(
            f"ratio: kvstrata req/s / peer req/s, medians of {args.rounds} alternating rounds "
            f"(the table shows each tree's median round); peer {peer}"
        )
    summary = {
        "bench": "radix",
        "seed": args.seed,
        "requests": args.requests,
        "budget_tokens": args.budget,
        "eviction": args.eviction,
        "rounds": args.rounds,
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "peer": None
        if peer is None
        else {"binary": str(peer), "tree": rows[0].peer.tree if rows and rows[0].peer else None},
        "peer_reason": no_peer_reason,
        "results": [_row_json(row) for row in rows],
    }
    print(json.dumps(summary))
    return 0 if all(row.ok for row in rows) else 1


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench radix``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
