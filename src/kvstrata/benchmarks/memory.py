"""Replay memory (``kvstrata bench memory``): does a streamed replay's peak RSS grow with the trace?

For each size N in ``--sizes`` it runs two child processes on ``agentic:SEED:N``:

* ``replay`` — ``kvstrata replay --model none --trace agentic:SEED:N`` with the given cache
  (``--l1-tokens``, ``--kv-width``) and any ``--replay-args``;
* ``stream`` — the same workload iterated with no engine: the workload side alone, which must not
  grow with N.

Each child's own peak RSS comes from ``os.wait4`` (the per-child form of
``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``, which would report the largest child so far),
in MiB, measured through a small launcher (see :func:`run_child`). Requests/s is over the child's
wall time, start-up included; the hit ratio comes from the replay's JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from ..command import EXIT_USAGE, CommandParser, HelpFormatter, run_command
from ..errors import ConfigError

PROG = "kvstrata bench memory"

_STREAM = (
    "import sys\n"
    "from kvstrata.workloads import load_workload\n"
    "print(sum(1 for _ in load_workload(sys.argv[1])))\n"
)


@dataclass(frozen=True)
class ChildRun:
    mode: str
    requests: int
    peak_rss_mib: float
    wall_s: float
    hit_ratio: float | None
    prompt_tokens: int | None
    cache_pages_end: int | None  # pages the cache held at the end (is it full?)
    cache_pages: int | None

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0


# Linux charges a process with the peak RSS of the process image it replaced at exec, so a child
# forked straight from a large parent (a test runner with torch loaded) reports at least the
# parent's size. Children are therefore started from this small launcher, which reports the
# child's own ru_maxrss (from os.wait4) in a file.
_LAUNCHER = (
    "import os, sys\n"
    "pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    f.write(str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def run_child(argv: list[str]) -> tuple[float, float, str]:
    """Run ``argv``; return its own peak RSS (MiB), wall seconds and output (stdout and stderr).
    A child that refuses its input (exit 2) raises :class:`ConfigError` with its error line; any
    other failure raises ``RuntimeError`` with the output's tail."""
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = os.path.join(tmp, "maxrss")
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, rss_file, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        wall = time.perf_counter() - start
        if proc.returncode == EXIT_USAGE:  # the child refused its input: pass its one line on
            raise ConfigError(proc.stdout.strip().splitlines()[-1])
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-2000:]}")
        with open(rss_file) as f:
            maxrss = int(f.read())
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return maxrss * scale / 2**20, wall, proc.stdout


def measure(spec: str, n: int, replay_args: list[str]) -> list[ChildRun]:
    rss, wall, text = run_child([sys.executable, "-c", _STREAM, spec])
    runs = [ChildRun("stream", int(text.split()[-1]), rss, wall, None, None, None, None)]
    argv = [sys.executable, "-m", "kvstrata.cli", "replay", "--model", "none", "--trace", spec]
    rss, wall, text = run_child([*argv, *replay_args, "--json", "--no-progress"])
    summary = json.loads(text.strip().splitlines()[-1])
    pool = summary["pool"]
    runs.append(
        ChildRun(
            "replay",
            summary["requests"],
            rss,
            wall,
            summary["hit_ratio"],
            summary["prompt_tokens"],
            pool["pages_cached_end"],
            pool["pages"],
        )
    )
    assert runs[0].requests == runs[1].requests == n, (runs, n)
    return runs


def build_parser() -> CommandParser:
    """The benchmark's flags."""
    parser = CommandParser(
        prog=PROG,
        description="Peak RSS of `kvstrata replay --model none --trace agentic:SEED:N` and of "
        "the workload streamed alone, at several N: neither may grow with N beyond the cache. "
        "Prints a table, then one JSON line.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[5_000, 10_000, 20_000],
        help="workload sizes N (the default cache fills up between the first two)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the agentic workload's seed")
    parser.add_argument(
        "--l1-tokens",
        type=int,
        default=16_777_216,
        help="the replay's cache: holds most of the 256 open sessions, so most tokens hit",
    )
    parser.add_argument("--kv-width", type=int, default=4, help="synthetic KV bytes per token")
    parser.add_argument(
        "--replay-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="anything else for kvstrata replay (everything after this flag)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.seed < 0:
        raise ConfigError(f"--sizes must be >= 1 and --seed >= 0, got {args.sizes}, {args.seed}")
    replay_args = [
        "--l1-tokens",
        str(args.l1_tokens),
        "--kv-width",
        str(args.kv_width),
        *args.replay_args,
    ]
    runs: list[ChildRun] = []
    for n in args.sizes:
        runs.extend(measure(f"agentic:{args.seed}:{n}", n, replay_args))
    print(f"replay args: {' '.join(replay_args)}")
    print(
        f"{'mode':<7} {'requests':>9} {'prompt tokens':>15} {'peak RSS MiB':>13} "
        f"{'wall s':>8} {'req/s':>8} {'hit ratio':>9} {'cache pages end / total':>24}"
    )
    for r in runs:
        tokens = f"{r.prompt_tokens:,}" if r.prompt_tokens is not None else "-"
        hit = f"{r.hit_ratio:.4f}" if r.hit_ratio is not None else "-"
        cache = f"{r.cache_pages_end:,} / {r.cache_pages:,}" if r.cache_pages else "-"
        print(
            f"{r.mode:<7} {r.requests:>9,} {tokens:>15} {r.peak_rss_mib:>13,.1f} "
            f"{r.wall_s:>8.1f} {r.requests_per_s:>8.1f} {hit:>9} {cache:>24}"
        )
    rows = [{**asdict(r), "requests_per_s": round(r.requests_per_s, 2)} for r in runs]
    print(json.dumps({"bench": "memory", "replay_args": replay_args, "runs": rows}))
    return 0


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench memory``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
