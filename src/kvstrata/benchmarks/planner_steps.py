"""The per-step side of ``kvstrata bench planner-accuracy --steps-out DIR``: the measured and the
predicted replay's engine steps (:class:`~kvstrata.replay.steps.StepLog`), where each run's clock
time went, and how the profile predicts the measured run's own steps.

Per run: the steps (those that ran a forward), the start-up (what the clock counted before the
loop began, building the engine; the clock then starts again at zero, and arrivals count from
there), when the first step began, the time in steps
(busy), idle (waiting for an arrival), adding requests, and the rest of the loop's time between
steps (reading the workload, bookkeeping: ``other``), and the largest gaps between steps that
were not idle. Per step kind (:data:`~kvstrata.replay.steps.STEP_KINDS`): how many steps, their
mean duration, and, on the measured run, what the profile predicts for those very steps (their
measured composition), as the ratio predicted / measured of their sums and the mean of the
per-step ratios. A ratio below 1 is time the profile does not charge for steps the engine ran.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..calibrate import predict
from ..cost import CostProfile
from ..replay.steps import STEP_KINDS, StepLog, StepRecord

#: Gaps between steps listed per run, largest first.
GAPS_LISTED = 3


def profile_seconds(profile: CostProfile, record: StepRecord) -> float:
    """What ``profile`` charges a step of ``record``'s composition (compute and links; a wait
    for the disk depends on the steps before, and is not included)."""
    return predict(profile, record.work())


def summarize_steps(log: StepLog, profile: CostProfile) -> dict[str, Any]:
    """Where one run's clock time went, step by step (see the module docstring); seconds."""
    records = log.records
    gaps = []
    last_end = log.loop_start_s
    for r in records:
        gaps.append((r.start_s - last_end - r.idle_before_s, r))
        last_end = r.end_s
    busy = sum(r.seconds for r in records)
    idle = sum(r.idle_before_s for r in records)
    add = sum(r.add_before_s for r in records)
    other = sum(g for g, _ in gaps) - add  # the gaps, net of idle, less the adds
    kinds: dict[str, dict[str, float]] = {}
    for kind in STEP_KINDS:
        of_kind = [r for r in records if r.kind == kind]
        if not of_kind:
            continue
        seconds = sum(r.seconds for r in of_kind)
        predicted = [profile_seconds(profile, r) for r in of_kind]
        ratios = [p / r.seconds for p, r in zip(predicted, of_kind, strict=True) if r.seconds > 0]
        kinds[kind] = {
            "steps": len(of_kind),
            "seconds": round(seconds, 6),
            "mean_ms": round(seconds / len(of_kind) * 1e3, 3),
            "profile_mean_ms": round(sum(predicted) / len(of_kind) * 1e3, 3),
            "ratio_of_sums": round(sum(predicted) / seconds, 4) if seconds > 0 else 0.0,
            "mean_ratio": round(statistics.fmean(ratios), 4) if ratios else 0.0,
        }
    largest = sorted(gaps, key=lambda g: g[0], reverse=True)[:GAPS_LISTED]
    return {
        "steps": len(records),
        "forward_steps": sum(1 for r in records if r.requests),
        "startup_s": round(log.startup_s, 6),
        "loop_start_s": round(log.loop_start_s, 6),
        "first_step_s": round(records[0].start_s, 6) if records else None,
        "last_step_end_s": round(last_end, 6),
        "busy_s": round(busy, 6),
        "idle_s": round(idle, 6),
        "add_s": round(add, 6),
        "other_s": round(other, 6) + 0.0,  # never -0.0
        "profile_busy_s": round(sum(profile_seconds(profile, r) for r in records), 6),
        "largest_gaps": [
            {"step": r.step, "at_s": round(r.start_s, 6), "gap_s": round(g, 6)}
            for g, r in largest
            if g > 0
        ],
        "kinds": kinds,
    }


def format_steps(measured: dict[str, Any], predicted: dict[str, Any]) -> list[str]:
    """The short table ``bench planner-accuracy --steps-out`` prints under a window's figures."""

    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:,.3f}"

    rows = [
        ("engine steps (forward)", f"{measured['steps']:,} ({measured['forward_steps']:,})",
         f"{predicted['steps']:,} ({predicted['forward_steps']:,})"),
        ("start-up before the loop s", s(measured["startup_s"]), s(predicted["startup_s"])),
        ("first step at s", s(measured["first_step_s"]), s(predicted["first_step_s"])),
        ("last step ends at s", s(measured["last_step_end_s"]), s(predicted["last_step_end_s"])),
        ("busy (in steps) s", s(measured["busy_s"]), s(predicted["busy_s"])),
        ("  the profile for them s", s(measured["profile_busy_s"]), s(predicted["profile_busy_s"])),
        ("idle (no work) s", s(measured["idle_s"]), s(predicted["idle_s"])),
        ("adding requests s", s(measured["add_s"]), s(predicted["add_s"])),
        ("other loop time s", s(measured["other_s"]), s(predicted["other_s"])),
    ]  # fmt: skip
    lines = [f"  {'steps':<28} {'measured':>14} {'predicted':>14}"]
    lines += [f"  {label:<28} {m:>14} {p:>14}" for label, m, p in rows]
    for name, run in (("measured", measured), ("predicted", predicted)):
        gaps = ", ".join(
            f"step {g['step']} at {g['at_s']:,.2f} s: {g['gap_s'] * 1e3:,.1f} ms"
            for g in run["largest_gaps"]
        )
        lines.append(f"  largest gaps not idle, {name}: {gaps or 'none'}")
    lines.append(
        f"  {'kind':<10} {'measured':>9} {'mean ms':>9} {'profile ms':>10} {'pred/meas':>9} "
        f"{'mean ratio':>10} {'predicted':>9} {'mean ms':>9}"
    )
    for kind in STEP_KINDS:
        m, p = measured["kinds"].get(kind), predicted["kinds"].get(kind)
        if m is None and p is None:
            continue
        left = (
            f"{m['steps']:>9,} {m['mean_ms']:>9,.2f} {m['profile_mean_ms']:>10,.2f} "
            f"{m['ratio_of_sums']:>9.3f} {m['mean_ratio']:>10.3f}"
            if m
            else f"{0:>9} {'-':>9} {'-':>10} {'-':>9} {'-':>10}"
        )
        right = f"{p['steps']:>9,} {p['mean_ms']:>9,.2f}" if p else f"{0:>9} {'-':>9}"
        lines.append(f"  {kind:<10} {left} {right}")
    return lines
