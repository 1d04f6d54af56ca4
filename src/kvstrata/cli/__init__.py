"""The ``kvstrata`` command line: a thin skin over the config dataclasses.

kvstrata replay         run a workload through the prefill engine and report the cache's savings
kvstrata sweep          replay one workload over several cache sizes and policies, in one report
kvstrata compare        two replay results side by side, with ratios
kvstrata check-model    compare a checkpoint's logits with transformers before serving it
kvstrata bench radix    radix tree speed on the shared synthetic workload
kvstrata bench prefill  prefill tokens/s against transformers on the same inputs
kvstrata bench planner  one owner-lane eviction plan on the production fork's worst case
kvstrata bench transfer batched page copies device <-> host against a contiguous pinned copy
kvstrata bench workload workload statistics: sizes, unique tokens, ideal hit ratio
kvstrata bench memory   peak RSS of a streamed replay at several workload sizes
kvstrata bench replay   cache-only replay speed on a whole trace, and what metrics cost
kvstrata bench cp       bytes moved and step time of both CP attention strategies, cp = 1, 2, 4
kvstrata bench disk     spill and reload through the disk tier against dd with O_DIRECT
kvstrata bench sglang-backend  the SGLang storage backend's batch_set_v1/batch_get_v1 against dd
kvstrata bench remote   shared tier publish and fetch on a loopback Redis against redis-benchmark
kvstrata disk check     audit a disk tier directory: slabs against the index (--fix repairs)
kvstrata bench attention paged attention kernels against SDPA on the same pages (CUDA)
kvstrata bench gpu      end-to-end GPU figures: ceilings, replay, L1/L2 TTFT, write-through

Errors in the input end in one stderr line and exit status 2; :mod:`kvstrata.command` lists the
exit codes. ``flags`` holds the flags that fill the config dataclasses (each default read from its
field), ``replay`` the jobs over a workload (replay, sweep, compare), ``tools`` the rest.
"""

from __future__ import annotations

from .. import __version__
from ..command import EXIT_INTERRUPTED, CommandParser, run_command
from .flags import DEFAULT_THREADS
from .replay import compare_parser, replay_parser, sweep_parser
from .tools import BENCHMARKS, bench_module, bench_parser, check_model_parser, disk_parser

__all__ = ["BENCHMARKS", "DEFAULT_THREADS", "bench_module", "build_parser", "main"]


def build_parser() -> CommandParser:
    """The ``kvstrata`` parser with every subcommand (the bench scripts parse their own flags)."""
    parser = CommandParser(
        prog="kvstrata",
        description="kvstrata: a page-granular prefix KV cache for LLM prefill, with a reference "
        "engine that runs Llama/Qwen models on top of it. Exit status: 0 ok, 1 the result is a "
        "failure, 2 bad input, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    replay_parser(sub)
    sweep_parser(sub)
    compare_parser(sub)
    check_model_parser(sub)
    bench_parser(sub)
    disk_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kvstrata`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if (
        args.command == "bench"
    ):  # the bench scripts report their own errors, as "kvstrata bench NAME"
        return int(args.func(args))
    return run_command(f"kvstrata {args.command}", lambda: int(args.func(args)))
