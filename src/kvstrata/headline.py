"""The headline block a report page opens with: the answer before the plots and the tables.

For a replay (:func:`replay_headline`): the hit ratio by tier (each tier's hit tokens over the
prompt tokens), what the cache saved (tokens not computed; on the simulated clock the compute
seconds of the modeled device, against the same workload without a cache), and TTFT p50 / p90
with where it goes (queue, load-back, compute: the means add up to TTFT's mean).

For a sweep (:func:`sweep_headline`): each curve's knee (the smallest L1 size within 2 % of the
curve's best hit ratio; ``run["knee"]`` in sweep.json) with its hit ratio by tier, the savings,
and its TTFT and parts.

Every number is a cell of :mod:`kvstrata.report_html` naming its JSON path (summary.json's for a
replay, sweep.json's ``runs.I.…`` for a sweep).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .report_html import grid, lookup, share_cell, value_cell

#: TTFT's parts in the summary's ``ttft_parts_ms``, with the label each reads as.
PARTS = {"queue": "queue", "load_back": "load-back", "compute": "compute"}
#: (tier, label): the tiers of ``hit_tokens_by_tier``.
TIERS = (("l1", "L1 (device)"), ("l2", "L2 (host)"), ("l3", "L3 (disk)"))


def tiers_of(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The tiers worth a row: L1 always; L2 and L3 where some run has one or hit in it."""
    config = [s.get("config", {}) for s in summaries]
    has = {
        "l1": True,
        "l2": any(c.get("l2_tokens") for c in config),
        "l3": any(c.get("l3_dir") or c.get("remote") for c in config),
    }
    out = []
    for tier, label in TIERS:
        if has[tier] or any(lookup(s, f"hit_tokens_by_tier.{tier}") for s in summaries):
            remote = tier == "l3" and any(c.get("remote") for c in config)
            out.append((tier, "L3 (shared)" if remote else label))
    return out


def _hits(summary: dict[str, Any]) -> str:
    rows = [
        [
            label,
            value_cell(summary, f"hit_tokens_by_tier.{t}"),
            share_cell(summary, f"hit_tokens_by_tier.{t}", "prompt_tokens"),
        ]
        for t, label in tiers_of([summary])
    ]
    rows.append(
        [
            "all tiers",
            value_cell(summary, "cached_tokens"),
            value_cell(summary, "hit_ratio", percent=True),
        ]
    )
    rows.append(["prompt tokens", value_cell(summary, "prompt_tokens"), "<td></td>"])
    return grid("Hit ratio by tier", ["", "hit tokens", "of prompt tokens"], rows)


def _saved(summary: dict[str, Any]) -> str:
    rows = [
        ["prompt tokens not computed", value_cell(summary, "cached_tokens")],
        ["prompt tokens computed", value_cell(summary, "computed_tokens")],
    ]
    note = ""
    if summary.get("planner"):
        rows += [
            ["compute seconds saved", value_cell(summary, "planner.compute_s_saved")],
            ["compute seconds without a cache", value_cell(summary, "planner.compute_s_no_cache")],
            ["share saved", value_cell(summary, "planner.compute_saved_share", percent=True)],
        ]
        cost = lookup(summary, "clock.cost") or {}
        key = "clock.cost.name" if "name" in cost else "clock.cost.kind"
        rows.append(["cost model", value_cell(summary, key)])
        note = "Seconds of the modeled GPU (the simulated clock's cost model)."
    return grid("Saved against no cache", ["", ""], rows, note)


def _ttft_rows(summary: dict[str, Any], prefix: str = "") -> list[list[str]]:
    """TTFT's row and one per part: mean, p50, p90 and the part's share of the mean."""
    rows = [
        [
            "TTFT",
            *(value_cell(summary, f"ttft_ms.{q}", prefix) for q in ("mean", "p50", "p90")),
            "<td></td>",
        ]
    ]
    for part in summary.get("ttft_parts_ms") or {}:
        path = f"ttft_parts_ms.{part}"
        rows.append(
            [
                PARTS.get(part, part.replace("_", " ")),
                *(value_cell(summary, f"{path}.{q}", prefix) for q in ("mean", "p50", "p90")),
                share_cell(summary, f"{path}.mean", "ttft_ms.mean", prefix),
            ]
        )
    return rows


_TTFT_NOTE = (
    "From each request's arrival. The parts' means add up to TTFT's mean; each part's "
    "percentiles are its own."
)


def replay_headline(summary: dict[str, Any]) -> str:
    """The headline block of one replay's page (``summary``: its summary.json)."""
    ttft = grid(
        "TTFT, ms, and where it goes",
        ["", "mean", "p50", "p90", "share of mean"],
        _ttft_rows(summary),
        _TTFT_NOTE,
    )
    return "\n".join([_hits(summary), _saved(summary), ttft])


def sweep_headline(curves: dict[str, list[int]], runs: list[dict[str, Any]]) -> str:
    """The headline block of a sweep's page: ``curves`` maps each curve's label to its runs'
    indices into ``runs`` (sweep.json's), in L1 order."""
    tiers = tiers_of([r["summary"] for r in runs])
    parts = list(runs[0]["summary"].get("ttft_parts_ms") or {})
    knees, ttft = [], []
    for label, indices in curves.items():
        knee = next((i for i in indices if runs[i].get("knee")), indices[-1])
        best = max(indices, key=lambda i: runs[i]["summary"]["hit_ratio"])
        at = f"runs.{knee}.summary."
        s = runs[knee]["summary"]
        knees.append(
            [
                label,
                value_cell(runs, f"{knee}.point.l1_tokens", "runs."),
                value_cell(s, "planner.tier_gib.l1", at),
                value_cell(s, "hit_ratio", at, percent=True),
                value_cell(runs, f"{best}.summary.hit_ratio", "runs.", percent=True),
                *(share_cell(s, f"hit_tokens_by_tier.{t}", "prompt_tokens", at) for t, _ in tiers),
                value_cell(s, "cached_tokens", at),
                value_cell(s, "planner.compute_s_saved", at),
            ]
        )
        ttft.append(
            [
                label,
                *(value_cell(s, f"ttft_ms.{q}", at) for q in ("p50", "p90", "mean")),
                *(value_cell(s, f"ttft_parts_ms.{part}.mean", at) for part in parts),
            ]
        )
    head = [
        "curve",
        "knee: L1 tokens",
        "L1 GiB",
        "hit ratio",
        "curve's best",
        *(f"{name} hits" for _, name in tiers),
        "tokens saved",
        "compute s saved",
    ]
    knee_note = (
        "The knee: the smallest L1 size whose hit ratio is within 2 % of the best its curve "
        "reached. Hits by tier are shares of the prompt tokens; compute seconds are the modeled "
        "GPU's, saved against no cache."
    )
    ttft_head = ["curve", "p50", "p90", "mean", *(f"{PARTS.get(p, p)} mean" for p in parts)]
    ttft_note = "From each request's arrival; the mean is the sum of its parts' means."
    return "\n".join(
        [
            grid("The knee of each curve", head, knees, knee_note),
            grid("TTFT at each knee, ms, and where it goes", ttft_head, ttft, ttft_note),
        ]
    )
