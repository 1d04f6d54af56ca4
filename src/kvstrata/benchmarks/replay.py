"""Cache-only replay speed (``kvstrata bench replay``), and what Prometheus metrics cost.

Replays one workload with ``--model none`` (the capacity planner's engine: the whole cache path,
hit accounting included, with synthetic payloads) ``--repeats`` times with metrics off and as
many with metrics on, alternating (off, on, on, off, ...). Each run is a fresh process (spawned,
so no run inherits another's heap) that first replays the workload's first 200 requests unmeasured
(imports, allocator, weight tables). A metrics-on run serves the engine's metrics on a free
loopback port and a scraper thread fetches them every ``--scrape-interval`` seconds meanwhile, as
Prometheus would (more often: its default is 15 s).

For each run: engine seconds (wall time in the engine, the replay summary's ``seconds``: adding
requests, which hashes them, and stepping; not reading the workload), engine CPU seconds (the
replay thread's CPU time in the same calls: what a loaded machine disturbs least), the process's
CPU seconds over the whole replay (every thread: reading the workload, and serving metrics),
prompt tokens per engine second, and the hit ratio (equal in every run: nothing structural
depends on metrics or time). The JSON line has ``prompt_tokens_per_s`` and
``prompt_tokens_per_cpu_s`` of the fastest metrics-off run, and ``metrics_overhead``: the extra
process CPU seconds of the metrics-on runs over the metrics-off runs (medians), as a share of the
metrics-off runs' engine CPU seconds.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..arrivals import ArrivalSpec
from ..command import CommandParser, HelpFormatter, run_command
from ..engine import EngineConfig
from ..errors import ConfigError
from ..replay import ReplayConfig, ReplayRun, run_replay

PROG = "kvstrata bench replay"
#: The most runs of each kind --repeats asks for
MAX_REPEATS = 100
DEFAULT_TRACE = "../shared/traces/mooncake/conversation_trace.jsonl"
WARMUP_REQUESTS = 200  # replayed once, unmeasured, first (imports, allocator, weight tables)


@dataclass(frozen=True)
class Run:
    metrics: bool
    engine_s: float
    engine_cpu_s: float
    cpu_s: float
    prompt_tokens: int
    hit_ratio: float
    steps: int
    scrapes: int
    scrape_cpu_s: float = 0.0  # measured in the scraping threads: collector, exposition, client

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.engine_s if self.engine_s > 0 else 0.0

    @property
    def prompt_tokens_per_cpu_s(self) -> float:
        return self.prompt_tokens / self.engine_cpu_s if self.engine_cpu_s > 0 else 0.0


class _Scraper:
    """Fetches the metrics endpoint every ``interval`` seconds while the replay runs."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.scrapes = 0
        self.client_cpu_s = 0.0  # the scraping thread's own CPU (HTTP client)
        self.collector_cpu_s = 0.0  # the server side: reading the engine and formatting
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_start(self, run: ReplayRun) -> None:
        url = run.metrics_url
        assert url is not None

        def loop() -> None:
            start = time.thread_time()
            while not self._stop.wait(self.interval):
                with urllib.request.urlopen(url, timeout=30) as response:
                    response.read()
                self.scrapes += 1
            self.client_cpu_s = time.thread_time() - start

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def on_step(self, run: ReplayRun) -> None:
        pass

    def on_end(self, run: ReplayRun) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if run.metrics is not None:
            self.collector_cpu_s = run.metrics.cpu_s


def measure(cfg: ReplayConfig, metrics: bool, scrape_interval: float) -> Run:
    """One replay of ``cfg`` in this process, with metrics served and scraped or not."""
    observers = []
    scraper = None
    if metrics:
        cfg = replace(cfg, metrics_port=0)
        scraper = _Scraper(scrape_interval)
        observers.append(scraper)
    cpu = time.process_time()
    summary = run_replay(cfg, progress=False, observers=observers)
    cpu = time.process_time() - cpu
    return Run(
        metrics=metrics,
        engine_s=summary.seconds,
        engine_cpu_s=summary.cpu_seconds,
        cpu_s=cpu,
        prompt_tokens=summary.prompt_tokens,
        hit_ratio=round(summary.hit_ratio, 6),
        steps=summary.steps,
        scrapes=scraper.scrapes if scraper else 0,
        scrape_cpu_s=scraper.client_cpu_s + scraper.collector_cpu_s if scraper else 0.0,
    )


def _child(cfg: ReplayConfig, metrics: bool, scrape_interval: float) -> Run:
    """A spawned process's job: warm up on the first requests, then the measured replay."""
    warm = min(cfg.limit or WARMUP_REQUESTS, WARMUP_REQUESTS)
    measure(replace(cfg, limit=warm), False, scrape_interval)
    return measure(cfg, metrics, scrape_interval)


def measure_in_child(cfg: ReplayConfig, metrics: bool, scrape_interval: float) -> Run:
    """:func:`_child` in a fresh spawned process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        run: Run = pool.apply(_child, (cfg, metrics, scrape_interval))
    return run


def build_parser() -> CommandParser:
    parser = CommandParser(
        prog=PROG,
        description="Cache-only replay speed (prompt tokens per engine second) on a whole trace, "
        "with Prometheus metrics off and on. Prints a table, then one JSON line.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="the workload (a .jsonl trace or a generated spec); the default is the Mooncake "
        "conversation trace beside the repository",
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests")
    parser.add_argument("--l1-tokens", type=int, default=4_194_304, help="L1 size in tokens")
    parser.add_argument("--l2-tokens", type=int, default=0, help="L2 size in tokens (0: none)")
    parser.add_argument("--kv-width", type=int, default=4, help="synthetic KV bytes per token")
    parser.add_argument("--chunk-size", type=int, default=2048, help="as kvstrata replay's")
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="as kvstrata replay's")
    parser.add_argument(
        "--arrivals",
        default="burst",
        help="as kvstrata replay's; burst (the default here) runs the engine flat out",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind")
    parser.add_argument(
        "--scrape-interval", type=float, default=1.0, help="seconds between metrics scrapes"
    )
    parser.add_argument(
        "--no-metrics", action="store_true", help="only the metrics-off runs (no overhead figure)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise ConfigError(f"--repeats must lie in [1, {MAX_REPEATS}], got {args.repeats}")
    if not 0 < args.scrape_interval <= 3600:
        raise ConfigError(
            f"--scrape-interval must lie in (0, 3600] seconds, got {args.scrape_interval}"
        )
    if args.trace.endswith(".jsonl") and not Path(args.trace).is_file():
        raise ConfigError(f"trace {args.trace} not found; give one with --trace")
    cfg = ReplayConfig(
        workload=args.trace,
        limit=args.limit,
        model="none",
        kv_width=args.kv_width,
        engine=EngineConfig(
            pool_tokens=args.l1_tokens,
            l2_tokens=args.l2_tokens,
            chunk_size=args.chunk_size,
            max_batch_tokens=args.max_batch_tokens,
        ),
        threads=1,
        arrivals=ArrivalSpec.parse(args.arrivals),
    )
    kinds = [False] if args.no_metrics else [False, True]
    runs: list[Run] = []
    for i in range(args.repeats):
        for metrics in kinds if i % 2 == 0 else kinds[::-1]:
            runs.append(measure_in_child(cfg, metrics, args.scrape_interval))
    print(
        f"{'metrics':>7} {'engine s':>9} {'engine cpu s':>12} {'process cpu s':>13} "
        f"{'prompt tokens':>14} {'M tok/s':>8} {'M tok/cpu s':>11} {'hit ratio':>9} "
        f"{'steps':>7} {'scrapes':>7}"
    )
    for r in runs:
        print(
            f"{'on' if r.metrics else 'off':>7} {r.engine_s:>9.2f} {r.engine_cpu_s:>12.2f} "
            f"{r.cpu_s:>13.2f} {r.prompt_tokens:>14,} {r.prompt_tokens_per_s / 1e6:>8.2f} "
            f"{r.prompt_tokens_per_cpu_s / 1e6:>11.2f} {r.hit_ratio:>9.6f} {r.steps:>7,} "
            f"{r.scrapes:>7}"
        )
    offs = [r for r in runs if not r.metrics]
    ons = [r for r in runs if r.metrics]
    off = min(offs, key=lambda r: r.engine_s)
    on = min(ons, key=lambda r: r.engine_s, default=None)
    overhead = direct = None
    if ons:
        extra = statistics.median(r.cpu_s for r in ons) - statistics.median(r.cpu_s for r in offs)
        overhead = round(extra / statistics.median(r.engine_cpu_s for r in offs), 4)
        print(
            f"metrics overhead (extra process CPU with metrics / engine CPU, medians): "
            f"{overhead:+.2%}"
        )
        direct = statistics.median(r.scrape_cpu_s / r.engine_cpu_s for r in ons if r.engine_cpu_s)
        print(
            "metrics cost measured in the scraping threads (collector, exposition and client CPU "
            f"/ engine CPU, median): {direct:.3%}"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(
        json.dumps(
            {
                "bench": "replay",
                "workload": args.trace,
                "prompt_tokens_per_s": round(off.prompt_tokens_per_s, 1),
                "prompt_tokens_per_cpu_s": round(max(r.prompt_tokens_per_cpu_s for r in offs), 1),
                "metrics_overhead": overhead,
                "metrics_scrape_cpu_share": None if direct is None else round(direct, 6),
                "best_off": asdict(off),
                "best_on": asdict(on) if on else None,
                "runs": [asdict(r) for r in runs],
                "config": {
                    "l1_tokens": args.l1_tokens,
                    "l2_tokens": args.l2_tokens,
                    "kv_width": args.kv_width,
                    "chunk_size": args.chunk_size,
                    "max_batch_tokens": args.max_batch_tokens,
                    "arrivals": args.arrivals,
                    "scrape_interval": args.scrape_interval,
                },
                "load_average_1m": load,
            }
        )
    )
    return 0


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench replay``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
