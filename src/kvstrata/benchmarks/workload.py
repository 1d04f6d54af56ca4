"""Workload statistics (``kvstrata bench workload``): how large, how long, how much repeats.

For each workload spec: the number of requests, prompt tokens (mean / p50 / p99 / max per request),
*unique tokens* — the tokens in distinct pages, i.e. what a cache of unbounded size ends up
holding — and the *ideal hit ratio*: the share of prompt tokens an unbounded cache serves when the
requests run one at a time under the engine's rules (whole pages only, never a request's last
token). Any real cache, at any capacity, hits at most that.

Everything streams: one request at a time, plus one 64-bit prefix key per distinct page seen
(:mod:`kvstrata.cache.keys`). A request's pages already seen always form a leading run (a page's key
names its whole prefix, and every earlier request added all its pages), so the run's length is
found by binary search.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from ..cache.keys import PrefixHasher
from ..command import CommandParser, HelpFormatter, run_command
from ..errors import ConfigError
from ..workloads import DEFAULT_VOCAB_SIZE, Request, load_workload

PROG = "kvstrata bench workload"


@dataclass(frozen=True)
class WorkloadStats:
    """What :func:`describe` measures (token counts at ``page_size`` granularity where noted)."""

    requests: int
    prompt_tokens: int
    mean_tokens: float
    p50_tokens: float
    p99_tokens: float
    max_tokens: int
    unique_tokens: int  # tokens of distinct pages (a partial last page counts its valid tokens)
    ideal_hit_tokens: int
    page_size: int

    @property
    def ideal_hit_ratio(self) -> float:
        return self.ideal_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def describe(requests: Iterable[Request], page_size: int = 16) -> WorkloadStats:
    """Measure a stream of requests (see the module docstring)."""
    hasher = PrefixHasher()
    seen: set[int] = set()  # prefix keys of full pages, and end keys of partial last pages
    lengths: array[int] = array("q")
    unique = hits = 0
    for request in requests:
        n = request.tokens.size
        key = hasher.key(request.tokens, page_size)
        page_keys = key.page_keys
        lo, hi = 0, key.num_full_pages  # pages [0, lo) seen, [hi, ...) not
        while lo < hi:
            mid = (lo + hi) // 2
            if page_keys.item(mid) in seen:
                lo = mid + 1
            else:
                hi = mid
        hits += min(lo, (n - 1) // page_size) * page_size
        unique += (key.num_full_pages - lo) * page_size
        seen.update(page_keys[lo:].tolist())
        if n % page_size and key.end_key not in seen:
            unique += n % page_size
            seen.add(key.end_key)
        lengths.append(n)
    if not lengths:
        return WorkloadStats(0, 0, 0.0, 0.0, 0.0, 0, 0, 0, page_size)
    lens = np.frombuffer(lengths, dtype=np.int64)
    p50, p99 = np.percentile(lens, [50, 99])
    return WorkloadStats(
        requests=lens.size,
        prompt_tokens=int(lens.sum()),
        mean_tokens=float(lens.mean()),
        p50_tokens=float(p50),
        p99_tokens=float(p99),
        max_tokens=int(lens.max()),
        unique_tokens=unique,
        ideal_hit_tokens=hits,
        page_size=page_size,
    )


def build_parser() -> CommandParser:
    """The benchmark's flags."""
    parser = CommandParser(
        prog=PROG,
        description="Statistics of workloads: requests, prompt tokens per request, unique tokens "
        "and the ideal (unbounded-cache) hit ratio. Prints a table, then one JSON line.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--trace",
        action="append",
        required=True,
        help="a workload spec (builtin, synthetic[:SEED[:N]], agentic[:SEED[:N]] or a .jsonl "
        "trace); repeat for several",
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="token ids are taken modulo"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.page_size < 1:
        raise ConfigError(f"--page-size must be >= 1, got {args.page_size}")
    results = []
    for spec in args.trace:
        workload = load_workload(spec, limit=args.limit, vocab_size=args.vocab_size)
        stats = describe(workload, args.page_size)
        results.append({"workload": workload.source, **asdict(stats)})
        results[-1]["ideal_hit_ratio"] = round(stats.ideal_hit_ratio, 6)
    header = (
        f"{'workload':<40} {'requests':>9} {'mean tok':>9} {'p50':>8} {'p99':>8} "
        f"{'prompt tokens':>15} {'unique tokens':>14} {'ideal hit':>9}"
    )
    print(header)
    for r in results:
        print(
            f"{r['workload'][-40:]:<40} {r['requests']:>9,} {r['mean_tokens']:>9,.0f} "
            f"{r['p50_tokens']:>8,.0f} {r['p99_tokens']:>8,.0f} {r['prompt_tokens']:>15,} "
            f"{r['unique_tokens']:>14,} {r['ideal_hit_ratio']:>9.4f}"
        )
    print(json.dumps({"bench": "workload", "page_size": args.page_size, "results": results}))
    return 0


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench workload``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
