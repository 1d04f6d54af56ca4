"""``kvstrata check-model``, ``kvstrata bench`` and ``kvstrata disk``: the tools beside the jobs."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from collections.abc import Callable
from typing import Any

from ..calibrate import calibrate
from ..check_model import check_model
from ..command import EXIT_FAILED, EXIT_OK, HelpFormatter
from ..cost import CostProfile

#: ``kvstrata bench NAME`` runs ``run_main`` of ``kvstrata.benchmarks`` module
#: :func:`bench_module` ``(NAME)``: NAME itself, with its hyphens dropped (``multi-gpu``).
BENCHMARKS = (
    "radix",
    "prefill",
    "planner",
    "transfer",
    "workload",
    "memory",
    "cp",
    "disk",
    "remote",
    "sglang-backend",
    "attention",
    "gpu",
    "replay",
    "multi-gpu",
    "tiers",
    "planner-accuracy",
)


#: ``kvstrata check-model``'s defaults: :func:`~kvstrata.check_model.check_model`'s own.
CHECK_DEFAULTS: dict[str, Any] = {
    name: param.default
    for name, param in inspect.signature(check_model).parameters.items()
    if param.default is not param.empty
}


#: ``kvstrata calibrate``'s defaults: :func:`~kvstrata.calibrate.calibrate`'s own.
CALIBRATE_DEFAULTS: dict[str, Any] = {
    name: param.default
    for name, param in inspect.signature(calibrate).parameters.items()
    if param.default is not param.empty
}


def calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit a cost profile for the planner's simulated clock to the real engine",
        description="Drive the engine with a model through a designed set of steps (fresh "
        "prefills of several lengths, chunks over cached prefixes, batches, and with an L2 "
        "backups and load-backs), time each, fit the step cost model (per step, request, token "
        "and attention pair; link GB/s) by least squares, predict a held-back set of other "
        "steps, print every step's measured and predicted time, and write the profile "
        "(--cost-profile FILE of kvstrata replay and sweep).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default=CALIBRATE_DEFAULTS["model"], help="a preset or checkpoint")
    p.add_argument("--device", default=CALIBRATE_DEFAULTS["device"], help="cpu or cuda")
    p.add_argument(
        "--dtype",
        default=CALIBRATE_DEFAULTS["dtype"],
        help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument("--page-size", type=int, default=CALIBRATE_DEFAULTS["page_size"])
    p.add_argument(
        "--max-tokens",
        type=int,
        default=CALIBRATE_DEFAULTS["max_tokens"],
        metavar="N",
        help="the longest fresh prefill of the design; prefixes reach 2N (default: 2,048 on "
        "CPU, 16,384 on CUDA)",
    )
    p.add_argument(
        "--max-prefix",
        type=int,
        default=CALIBRATE_DEFAULTS["max_prefix"],
        metavar="N",
        help="the longest cached prefix a designed chunk extends (default 2 x --max-tokens); "
        "give the longest prompts of the traces the profile will plan, so that chunks over "
        "long prefixes are measured rather than extrapolated",
    )
    p.add_argument(
        "--l2-tokens",
        type=int,
        default=CALIBRATE_DEFAULTS["l2_tokens"],
        metavar="N",
        help="the L2 of the backup and load-back steps (default 16 x --max-tokens; 0: no link "
        "steps, the profile keeps 1 GB/s links)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=CALIBRATE_DEFAULTS["repeats"],
        help="runs of each design point (the fastest counts: noise only adds time)",
    )
    p.add_argument("--seed", type=int, default=CALIBRATE_DEFAULTS["seed"], help="weights, tokens")
    p.add_argument(
        "--name",
        default=CALIBRATE_DEFAULTS["name"],
        help="the profile's name (default: DEVICE-MODEL-DTYPE)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=CALIBRATE_DEFAULTS["threads"],
        help="torch intra-op CPU threads while timing (kvstrata replay's default is 1)",
    )
    p.add_argument(
        "--from-steps",
        nargs="+",
        default=None,
        metavar="FILE",
        help="fit the compute terms to these step logs of measured replays instead (the "
        "*-measured.jsonl files of kvstrata bench planner-accuracy --steps-out DIR); no engine "
        "runs. The link rates come from --base-profile",
    )
    p.add_argument(
        "--base-profile",
        default=None,
        metavar="NAME|FILE",
        help="with --from-steps: the profile whose link rates and provenance the fit keeps "
        "(default: the shipped profile of --model, --device and --dtype)",
    )
    p.add_argument("--out", required=True, metavar="FILE", help="where the profile is written")
    p.add_argument("--json", action="store_true", help="the profile as one JSON line, last")
    p.set_defaults(func=_run_calibrate)


def _run_from_steps(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from ..calibrate_steps import fit_steps
    from ..cost import find_shipped, load_profile
    from ..errors import ConfigError

    if args.base_profile is not None:
        base = load_profile(args.base_profile)
    else:
        dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
        shipped = find_shipped(args.device.split(":")[0], args.model, dtype)
        if shipped is None:
            raise ConfigError(
                f"--from-steps: no shipped profile for {args.model} {dtype} on {args.device}; "
                "give --base-profile (a profile of kvstrata calibrate on that device)"
            )
        base = shipped
    name = args.name or f"{base.name}-steps"
    profile, stats = fit_steps(
        [Path(f) for f in args.from_steps], base, name,
        command="kvstrata calibrate " + " ".join(sys.argv[2:]),
    )  # fmt: skip
    print(f"{_terms(profile)}; links from {base.name}")
    print(
        f"{stats['steps']} forward steps: {stats['fitted']} fitted, {stats['outliers']} "
        f"outliers left out, {stats['held_back']} held back; fit error mean {stats['mean']:.1%}, "
        f"max {stats['max']:.1%}; held back mean {stats['held_back_mean']:.1%}, max "
        f"{stats['held_back_max']:.1%}"
    )
    return _save(profile, args.out, args.json)


def _terms(p: CostProfile) -> str:
    """A profile's compute terms, one line (what both ways of calibrating print)."""
    return (
        f"profile {p.name}: step {p.step_s * 1e3:.3f} ms + request {p.request_s * 1e3:.3f} ms + "
        f"token {p.token_s * 1e6:.4f} us + pair {p.pair_s * 1e9:.5f} ns + pair over a prefix "
        f"{(p.prefix_pair_s or 0.0) * 1e9:.5f} ns + prefix token {p.prefix_s * 1e9:.3f} ns"
    )


def _save(p: CostProfile, out: str, as_json: bool) -> int:
    """Write the profile, say where, and print it as JSON last when asked."""
    print(f"profile: {p.save(out)}")
    if as_json:
        print(json.dumps(p.to_json()))
    return EXIT_OK


def _run_calibrate(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from ..errors import ConfigError

    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():  # refused before minutes of timing, not after
        raise ConfigError(
            f"--out {out}: give a file in an existing directory (where the profile is written)"
        )
    if args.from_steps is not None:
        return _run_from_steps(args)
    if args.base_profile is not None:
        raise ConfigError("--base-profile goes with --from-steps (the designed fit measures links)")
    cal = calibrate(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        max_tokens=args.max_tokens,
        l2_tokens=args.l2_tokens,
        max_prefix=args.max_prefix,
        repeats=args.repeats,
        seed=args.seed,
        name=args.name,
        threads=args.threads,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        command="kvstrata calibrate " + " ".join(sys.argv[2:]),
    )
    print(cal.table())
    p = cal.profile
    err = p.provenance.fit_error
    print(f"{_terms(p)}; h2d {p.h2d_gbps:g} / d2h {p.d2h_gbps:g} GB/s ({p.overlap})")
    print(
        f"fit error: mean {err['mean']:.1%}, max {err['max']:.1%}; held-back steps: mean "
        f"{err['held_back_mean']:.1%}, max {err['held_back_max']:.1%}"
    )
    return _save(p, args.out, args.json)


def bench_module(name: str) -> str:
    """The module under ``kvstrata.benchmarks`` that runs ``kvstrata bench NAME``."""
    return name.replace("-", "")


def check_model_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-model",
        help="compare a checkpoint's logits with transformers",
        description="Load a checkpoint (or a preset, saved first as a checkpoint) with kvstrata and "
        "with transformers, run a few prompts of awkward lengths, and report the largest |logit "
        "difference| and argmax agreement. Exits 1 past the tolerance or on any NaN/inf logit.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "model",
        help="a Hugging Face checkpoint directory (config.json + *.safetensors) or a preset "
        "(tiny, tiny-qwen2, tiny-qwen3, small, llama-3.2-1b, tiny-mla, tiny-moe, "
        "deepseek-v2-lite)",
    )
    p.add_argument(
        "--device", default=CHECK_DEFAULTS["device"], help="torch device, e.g. cpu or cuda"
    )
    p.add_argument(
        "--dtype",
        default=CHECK_DEFAULTS["dtype"],
        help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=CHECK_DEFAULTS["page_size"],
        help="tokens per KV page; prompts straddle page boundaries and one reads a cached prefix "
        "of whole pages back from the pool",
    )
    p.add_argument(
        "--atol",
        type=float,
        default=CHECK_DEFAULTS["atol"],
        help="largest |logit difference| accepted (default: 1e-3 in float32, 0.5 otherwise)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON, last line")
    p.set_defaults(func=_run_check_model)


def _run_check_model(args: argparse.Namespace) -> int:
    report = check_model(
        args.model, device=args.device, dtype=args.dtype, page_size=args.page_size, atol=args.atol
    )
    verdict = "OK" if report.ok else "FAIL"
    print(f"model              {report.model} ({report.architecture})")
    print(f"prompt lengths     {', '.join(map(str, report.lengths))}")
    print(f"max |logit diff|   {report.max_abs_logit_diff:.3g} (tolerance {report.atol:g})")
    print(f"argmax agreement   {report.argmax_agree:.4f}")
    print(
        f"non-finite logits  {report.nonfinite_ours:,} kvstrata, "
        f"{report.nonfinite_theirs:,} transformers"
    )
    if report.nonfinite_weights:
        names = ", ".join(report.nonfinite_weight_names)
        more = report.nonfinite_weights - len(report.nonfinite_weight_names)
        print(
            f"non-finite weights {report.nonfinite_weights:,}: {names}"
            + (f" and {more:,} more" if more else "")
        )
    print(f"verdict            {verdict}")
    if args.json:
        print(json.dumps({**report.__dict__, "ok": report.ok}))
    return EXIT_OK if report.ok else EXIT_FAILED


def bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks (" + ", ".join(BENCHMARKS) + "); each prints a table and a JSON line",
        description="Run a benchmark. Arguments after the name go to the benchmark "
        "(kvstrata bench radix --help).",
    )
    p.add_argument("name", choices=BENCHMARKS, metavar="NAME", help=", ".join(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS", help="the benchmark's flags")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"..benchmarks.{bench_module(args.name)}", __package__)
    run_main: Callable[[list[str]], int] = module.run_main
    return run_main(args.rest)


def disk_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "disk",
        help="the disk tier (L3): audit a directory, remove idle namespaces",
        description="Tools for disk tier directories (slabs/ and index/ under each).",
    )
    actions = p.add_subparsers(dest="disk_command", required=True, metavar="ACTION")
    c = actions.add_parser(
        "check",
        help="audit slabs against the index; --fix repairs",
        description="Audit a disk tier directory: every index entry must name a slot of a valid, "
        "full-length slab whose header (and payload CRC) holds that page, with all its payloads "
        "in one slot and no two pages in one slot. Prints every inconsistency. With --fix, drops "
        "the index entries of pages that do not check out (they become misses), extends "
        "truncated slabs, removes slab files of kvstrata's name pattern that are not valid and "
        "rebuilds a damaged index from the slot headers, then audits again. Without --fix "
        "nothing is written. A namespace and rank a running store holds is reported in use and "
        "not checked. Give every directory of a disk tier striped over several drives (the "
        "--l3-dir flags of the run, in any order): a rank's slots striped over them are "
        "audited together, and reported (group-split, left alone) when some are missing. "
        "Exit status 0 only when the directories are clean (after --fix: when the "
        "repair left them clean), 1 when not, 2 when a DIR is not a disk tier directory.",
        formatter_class=HelpFormatter,
    )
    c.add_argument("dir", nargs="+", metavar="DIR", help="the disk tier directories")
    c.add_argument("--fix", action="store_true", help="repair what does not check out")
    c.add_argument(
        "--quick",
        action="store_true",
        help="check slot headers only (4 KiB a page), not the payload CRCs (the whole page)",
    )
    c.add_argument("--json", action="store_true", help="print the report as JSON, last line")
    c.set_defaults(func=_run_disk_check)
    g = actions.add_parser(
        "gc",
        help="remove the namespaces no store uses",
        description="Remove the slabs and index of every namespace and rank under DIR that no "
        "running store holds (--l3-gib bounds one store; every model, budget or cp size that "
        "ran there left its own). Prints what went and the bytes freed.",
        formatter_class=HelpFormatter,
    )
    g.add_argument("dir", metavar="DIR", help="the disk tier directory")
    g.add_argument(
        "--keep",
        action="append",
        metavar="NS",
        help="a namespace to keep (the 16 hex digits 'disk check' prints, or a prefix); repeat "
        "the flag for several",
    )
    g.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    g.set_defaults(func=_run_disk_gc)


def _run_disk_gc(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..tiers.disk_gc import collect

    report = collect(Path(args.dir), keep=args.keep, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name, nbytes in report.removed:
        print(f"{verb:<12} {name}  {nbytes / 2**30:.3f} GiB")
    for name in report.kept:
        print(f"{'kept':<12} {name}")
    for name in report.in_use:
        print(f"{'in use':<12} {name}")
    print(f"{'freed' if not args.dry_run else 'would free'}  {report.freed_bytes / 2**30:.3f} GiB")
    return EXIT_OK


def _run_disk_check(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..tiers.disk_audit import audit_directories

    roots = [Path(d) for d in args.dir]
    report = audit_directories(roots, fix=args.fix, payload=not args.quick)
    found = report.all_problems
    after = audit_directories(roots, payload=not args.quick) if args.fix and found else report
    for root in roots:
        print(f"directory   {root}")
    for g in after.groups:
        print(
            f"group       ns {g.namespace.hex()[:16]} rank {g.rank}: {g.num_payloads} payloads, "
            + (f"striped over {g.stripes} directories, " if g.stripes > 1 else "")
            + f"{g.num_slots:,} slots, {len(g.pages):,} pages check out"
        )
    for name in report.in_use:
        print(f"in use      {name}: a running store holds it; not checked")
    print(f"problems    {len(found)}")
    for problem in found:
        print(f"  {problem}")
    if after.clean:
        verdict = f"FIXED ({len(found)} repaired), clean" if found else "CLEAN"
    else:
        verdict = "DIRTY" + ("" if args.fix else " (kvstrata disk check --fix repairs it)")
    if report.in_use:
        verdict += f" ({len(report.in_use)} in use, not checked)"
    print(f"verdict     {verdict}")
    if args.json:
        doc = {
            "dir": str(roots[0]),
            "dirs": [str(r) for r in roots],
            "clean": after.clean,
            "fixed": bool(args.fix and found),
            "problems": [{"kind": p.kind, "where": p.where, "detail": p.detail} for p in found],
            "remaining": len(after.all_problems),
            "in_use": report.in_use,
            "groups": [
                {
                    "namespace": g.namespace.hex(),
                    "rank": g.rank,
                    "payloads": g.num_payloads,
                    "slots": g.num_slots,
                    "stripes": g.stripes,
                    "pages": len(g.pages),
                }
                for g in after.groups
            ],
        }
        print(json.dumps(doc))
    return EXIT_OK if after.clean else EXIT_FAILED
