"""``kvstrata replay``, ``kvstrata sweep`` and ``kvstrata compare``: the jobs over a workload."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..command import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, HelpFormatter
from ..replay import VERIFY_ATOL, ReplayConfig, ReplayObserver, ReplayRun
from .flags import (
    cost_flags,
    engine_flags,
    progress_flag,
    replay_config,
    sizes,
    timing_flags,
    workload_flags,
)

#: ``kvstrata sweep`` replays cache only unless told otherwise (``--model none``, and with it the
#: simulated clock): a grid of sizes runs many replays.
SWEEP_MODEL = "none"


def replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a workload through the engine (the main job)",
        description="Replay a workload through the prefill engine on top of the prefix cache and "
        "report what the cache saved: hit ratio, computed tokens, prefill tokens/s, TTFT "
        "(from each request's arrival) and its parts, pool usage. With no arguments: the "
        "built-in workload through the `tiny` model on the CPU. The last line of output is a "
        "JSON summary with --json.",
        formatter_class=HelpFormatter,
    )
    workload_flags(p, model_default=ReplayConfig.model)
    engine_flags(p, grid=False)
    timing_flags(p)
    cost_flags(p)
    p.add_argument(
        "--verify",
        type=int,
        default=ReplayConfig.verify,
        metavar="N",
        help="recompute N sampled requests without the cache and report the largest |logit "
        "difference| and argmax agreement (payload bytes with --model none)",
    )
    p.add_argument(
        "--verify-atol",
        type=float,
        default=ReplayConfig.verify_atol,
        metavar="X",
        help="the largest |logit difference| --verify accepts; past it, or with an argmax flip "
        "beyond it, --verify fails (exit 1). Default: measured per dtype ("
        + ", ".join(f"{k} {v:g}" for k, v in VERIFY_ATOL.items())
        + ")",
    )
    p.add_argument(
        "--draft-model",
        default=ReplayConfig.draft_model,
        metavar="MODEL",
        help="a speculative draft model prefilled in the same step, its K/V on the target's "
        "pages in every tier: a preset (tiny-draft: tiny's first layer) or a checkpoint "
        "directory; same vocabulary as --model, at most its layers",
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=ReplayConfig.decode_tokens,
        metavar="N",
        help="greedy-decode N tokens from the prefill -> decode handoff of each --verify request "
        "(its KV assembled from every rank's pages) and from an uncached prefill of it; reports "
        "whether the tokens agree and, with --draft-model, the draft's acceptance rate both ways",
    )
    p.add_argument(
        "--handoff-dir",
        default=ReplayConfig.handoff_dir,
        metavar="DIR",
        help="with --decode-tokens under torchrun: a directory every rank writes its handoff "
        "parts to and rank 0 reads (local --cp ranks use a temporary one)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=ReplayConfig.metrics_port,
        metavar="P",
        help="serve Prometheus metrics on this port while replaying (0: any free port; the URL "
        "goes to stderr); on 127.0.0.1 unless --metrics-host says otherwise",
    )
    p.add_argument(
        "--metrics-host",
        default=ReplayConfig.metrics_host,
        metavar="ADDR",
        help="the address --metrics-port listens on; anything but a loopback address exposes "
        "the metrics to the network",
    )
    p.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="write DIR/report.html with plots (hit ratio over time by tier, tier occupancy, "
        "bytes moved, TTFT distribution) and DIR/summary.json; needs matplotlib "
        "(pip install 'kvstrata[report]')",
    )
    p.add_argument(
        "--fail-on-error",
        action="store_true",
        help="exit 1 if any request failed (without it: only if every request failed)",
    )
    p.add_argument(
        "--check", action="store_true", help="debug: check every invariant after each step"
    )
    p.add_argument("--json", action="store_true", help="print the JSON summary as the last line")
    progress_flag(p)
    p.set_defaults(func=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    from ..replay import run_replay

    cfg = replay_config(args)
    observers: list[ReplayObserver] = []
    if cfg.metrics_port is not None:
        observers.append(_AnnounceMetrics())
    timeline = None
    if args.report is not None:
        from ..report import REPORT_FILES, require_matplotlib
        from ..timeline import Timeline

        require_matplotlib()  # before the replay, not after it
        _make_dir(args.report, REPORT_FILES)
        timeline = Timeline()
        observers.append(timeline)
    summary = run_replay(cfg, progress=not args.no_progress, observers=observers)
    if summary.rank != 0:  # one rank of torchrun's world: rank 0 reports
        return EXIT_OK
    print(summary.table())
    for line in summary.problems():
        print(line)
    if timeline is not None:
        from ..report import write_report

        path = write_report(args.report, summary.to_json(), timeline)
        print(f"report: {path}")
    if args.json:
        print(json.dumps(summary.to_json()))
    if summary.interrupted:
        print(
            f"kvstrata replay: interrupted after {summary.requests} of {summary.total_requests} "
            "requests; the summary covers those",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    why = None
    if summary.failed == summary.requests:
        why = f"every request failed ({summary.failed})"
    elif args.fail_on_error and summary.failed:
        why = f"{summary.failed} of {summary.requests} requests failed (--fail-on-error)"
    elif not summary.verify.ok:
        why = f"--verify failed: {summary.verify.describe().removeprefix('FAIL: ')}"
    if why is not None:
        print(f"kvstrata replay: {why}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


class _AnnounceMetrics:
    """Says where the metrics are served (the port may have been picked by the system)."""

    def on_start(self, run: ReplayRun) -> None:
        from ..metrics import exposure_warning

        if run.metrics_url is not None:
            print(f"kvstrata replay: metrics on {run.metrics_url}", file=sys.stderr, flush=True)
            warning = exposure_warning(run.config.metrics_host)
            if warning is not None:
                print(f"kvstrata replay: warning: {warning}", file=sys.stderr, flush=True)

    def on_step(self, run: ReplayRun) -> None:
        pass

    def on_end(self, run: ReplayRun) -> None:
        pass


def sweep_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="replay one workload over several cache sizes and policies; plot hit ratio and TTFT",
        description="Replay one workload once per combination of --l1-tokens, --l2-tokens, "
        "--eviction and --write-policy values (each takes several), cache only by default "
        "(--model none, simulated clock), and write one report: hit ratio, TTFT and hit tokens "
        "by tier against the L1 size, and a table of every run. Prints the table; --json prints "
        "every run's summary as one JSON line last.",
        formatter_class=HelpFormatter,
    )
    workload_flags(p, model_default=SWEEP_MODEL)
    engine_flags(p, grid=True)
    timing_flags(p)
    cost_flags(p)
    p.add_argument(
        "--report",
        required=True,
        metavar="DIR",
        help="write DIR/report.html with the plots, and DIR/sweep.json (every run's summary)",
    )
    p.add_argument("--json", action="store_true", help="print every run as one JSON line last")
    progress_flag(p)
    p.set_defaults(func=_run_sweep)


def _run_sweep(args: argparse.Namespace) -> int:
    from ..report import require_matplotlib
    from ..sweep import (
        COLUMNS,
        SWEEP_FILES,
        SweepGrid,
        configs,
        lookup,
        run_sweep,
        write_sweep_report,
    )

    require_matplotlib()
    _make_dir(args.report, SWEEP_FILES)
    base = replay_config(args)
    l1, l2 = sizes(args.l1_tokens, "--l1-tokens"), sizes(args.l2_tokens, "--l2-tokens")
    if any(args.l1_gib) or any(args.l2_gib):  # GiB of the modeled KV, in whole pages
        from ..replay import kv_bytes_per_token, tokens_for_gib

        bpt, P = kv_bytes_per_token(base), base.engine.page_size
        if any(args.l1_gib):
            l1 = tuple(tokens_for_gib(g, bpt, P) for g in args.l1_gib)
        if any(args.l2_gib):
            l2 = tuple(tokens_for_gib(g, bpt, P) for g in args.l2_gib)
        base = dataclasses.replace(
            base, l1_gib=0.0, engine=dataclasses.replace(base.engine, l2_gib=0.0)
        )
    grid = SweepGrid(
        l1_tokens=l1,
        l2_tokens=l2,
        eviction=tuple(args.eviction),
        write_policy=tuple(args.write_policy),
    )
    configs(base, grid)  # every point checked before the first runs
    runs = run_sweep(base, grid, progress=not args.no_progress)
    path = write_sweep_report(args.report, runs)
    rows = [[label for label, _ in COLUMNS] + ["knee"]]
    for run in runs:
        cells = [_cell(lookup(run["summary"], key)) for _, key in COLUMNS]
        rows.append([*cells, "*" if run.get("knee") else ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(f"{c:>{w}}" for c, w in zip(r, widths, strict=True)))
    print(f"report: {path}")
    if args.json:
        print(json.dumps({"runs": runs}))
    if any(run["summary"]["interrupted"] for run in runs):
        print("kvstrata sweep: interrupted; the report covers the runs finished", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


def _make_dir(path: str, names: tuple[str, ...]) -> None:
    """Create a report directory now and check its file names, so a path that cannot hold the
    report fails before the replay, not after it."""
    from ..report import prepare_report_dir

    prepare_report_dir(path, names)


def _cell(value: object) -> str:
    from ..report_html import format_value

    return format_value(value)


def compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="two replay results side by side, with ratios",
        description="Print two replay summaries side by side with B / A for every number: hit "
        "ratio and hit tokens by tier, TTFT and its parts, throughput, bytes moved; then the "
        "configuration fields that differ. Each result is a summary.json, a --report "
        "directory, or saved `kvstrata replay --json` output.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("a", metavar="A", help="the baseline result")
    p.add_argument("b", metavar="B", help="the result compared with it")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON line last")
    p.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from ..compare import compare, load_summary, render

    rows = compare(load_summary(args.a), load_summary(args.b))
    print(render(rows, "A", "B"))
    print(f"A: {args.a}\nB: {args.b}")
    if args.json:
        print(
            json.dumps(
                {"rows": [dict(zip(("name", "a", "b", "b_over_a"), r, strict=True)) for r in rows]}
            )
        )
    return EXIT_OK
