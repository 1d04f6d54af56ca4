"""``kvstrata sweep``: one workload over a grid of cache sizes and policies, in one report.

The capacity planner's first question is how the hit ratio and TTFT move with the cache size.
:func:`run_sweep` replays the same workload once per point of the grid (every combination of L1
size, L2 size, eviction policy and write policy; ``--model none`` by default, on the simulated
clock), each a fresh engine, and :func:`write_sweep_report` writes into a directory:

* ``sweep.json`` — ``{"runs": [{"point": ..., "summary": ..., "knee": ..., "ideal_hit_ratio":
  ..., "of_ideal": ...}, ...]}``: each run's grid point, ``--json`` summary, whether it is its
  curve's knee, the workload's ideal hit ratio and the run's share of it;
* ``hit_ratio.png`` — hit ratio against L1 size, one line per (L2 size, policies), and the
  workload's ideal hit ratio (a cache that never evicts, :func:`ideal_hit_ratio`) as a line;
* ``ttft.png`` — TTFT p50 and p99 against L1 size, same lines;
* ``tiers.png`` — hit tokens by tier against L1 size;
* ``report.html`` — the knee of each curve first (:mod:`kvstrata.headline`: its size, hit ratio
  by tier, savings, TTFT and its parts), the plots, the configuration, versions and machine, and a
  table of every run (cells carry ``data-key`` = ``runs.I.summary.FIELD``, as in ``sweep.json``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .engine import EngineConfig
from .errors import ConfigError
from .headline import sweep_headline
from .model.loader import read_model_config
from .replay import ReplayConfig, run_replay
from .report import prepare_report_dir, pyplot, save, write_text
from .report_html import figure, format_value, lookup, page

#: Columns of the runs table: (label, path in a run's summary).
#: Every file :func:`write_sweep_report` writes.
SWEEP_FILES = ("sweep.json", "hit_ratio.png", "ttft.png", "tiers.png", "report.html")
COLUMNS = (
    ("L1 tokens", "config.l1_tokens"),
    ("L2 tokens", "config.l2_tokens"),
    ("eviction", "config.eviction"),
    ("write policy", "config.write_policy"),
    ("L1 GiB", "planner.tier_gib.l1"),
    ("L2 GiB", "planner.tier_gib.l2"),
    ("hit ratio", "hit_ratio"),
    ("L1 hit tokens", "hit_tokens_by_tier.l1"),
    ("L2 hit tokens", "hit_tokens_by_tier.l2"),
    ("computed tokens", "computed_tokens"),
    ("TTFT p50 ms", "ttft_ms.p50"),
    ("TTFT p90 ms", "ttft_ms.p90"),
    ("TTFT p99 ms", "ttft_ms.p99"),
    ("queue mean ms", "ttft_parts_ms.queue.mean"),
    ("load mean ms", "ttft_parts_ms.load_back.mean"),
    ("compute saved s", "planner.compute_s_saved"),
    ("failed", "failed"),
    ("engine s", "seconds"),
)


@dataclass(frozen=True)
class SweepGrid:
    """The values each swept knob takes; every combination is one run."""

    l1_tokens: tuple[int, ...]
    l2_tokens: tuple[int, ...] = (0,)
    eviction: tuple[str, ...] = ("lru",)
    write_policy: tuple[str, ...] = ("write_through",)

    def __post_init__(self) -> None:
        for name in ("l1_tokens", "l2_tokens", "eviction", "write_policy"):
            values = getattr(self, name)
            if not values:
                raise ConfigError(f"--{name.replace('_', '-')} needs at least one value")
            if len(set(values)) != len(values):
                raise ConfigError(f"--{name.replace('_', '-')} lists a value twice: {values}")

    def points(self) -> list[dict[str, Any]]:
        """The grid's points, L1 size varying fastest (one curve per other combination)."""
        out = []
        for l2, eviction, policy, l1 in itertools.product(
            self.l2_tokens, self.eviction, self.write_policy, self.l1_tokens
        ):
            out.append(
                {"l1_tokens": l1, "l2_tokens": l2, "eviction": eviction, "write_policy": policy}
            )
        return out


def configs(base: ReplayConfig, grid: SweepGrid) -> list[ReplayConfig]:
    """One replay configuration per grid point (checked before any of them runs)."""
    out = []
    for point in grid.points():
        engine = dataclasses.replace(
            base.engine,
            pool_tokens=point["l1_tokens"],
            l2_tokens=point["l2_tokens"],
            l2_gib=0.0,
            eviction=point["eviction"],
            write_policy=point["write_policy"],
        )
        out.append(dataclasses.replace(base, engine=engine))
    return out


def run_sweep(base: ReplayConfig, grid: SweepGrid, progress: bool = True) -> list[dict[str, Any]]:
    """Replay ``base`` at every grid point; each run's point and JSON summary, in grid order."""
    runs: list[dict[str, Any]] = []
    cfgs = configs(base, grid)
    for i, (point, cfg) in enumerate(zip(grid.points(), cfgs, strict=True)):
        if progress:
            described = ", ".join(f"{k} {v}" for k, v in point.items())
            print(f"kvstrata sweep: run {i + 1} of {len(cfgs)}: {described}", file=sys.stderr)
        summary = run_replay(cfg, progress=progress)
        runs.append({"point": point, "summary": summary.to_json()})
        if summary.interrupted:
            break
    mark_knees(runs)
    if runs and not runs[-1]["summary"]["interrupted"]:
        ideal = ideal_hit_ratio(base, runs[0]["summary"]["prompt_tokens"])
        for run in runs:
            run["ideal_hit_ratio"] = ideal
            run["of_ideal"] = round(run["summary"]["hit_ratio"] / ideal, 6) if ideal else None
    return runs


def ideal_hit_ratio(base: ReplayConfig, prompt_tokens: int) -> float:
    """The workload's hit ratio with a cache that never evicts: ``--model none`` (the cache's
    decisions do not depend on the model) with an L1 as large as every prompt token of the
    workload (``prompt_tokens``, from a run of it), no L2, the same pages, chunks, batches and
    arrivals. What no size of the sweep can beat."""
    e = base.engine
    pages = -(-prompt_tokens // e.page_size) + -(-e.max_batch_tokens // e.page_size) + 1
    vocab = base.vocab_size if base.model == "none" else read_model_config(base.model).vocab_size
    cfg = ReplayConfig(
        workload=base.workload,
        limit=base.limit,
        model="none",
        kv_width=4,
        vocab_size=vocab,
        engine=EngineConfig(
            page_size=e.page_size,
            pool_tokens=pages * e.page_size,
            chunk_size=e.chunk_size,
            max_batch_tokens=e.max_batch_tokens,
            max_batch_requests=e.max_batch_requests,
        ),
        on_error=base.on_error,
        seed=base.seed,
        threads=base.threads,
        arrivals=base.arrivals,
        clock="sim",
    )
    return round(run_replay(cfg, progress=False).hit_ratio, 6)


def mark_knees(runs: list[dict[str, Any]]) -> None:
    """Mark each curve's knee (``run["knee"]``): the smallest L1 size whose hit ratio is within
    2 % of the best that curve reached."""
    for group in _curves(runs).values():
        best = max(r["summary"]["hit_ratio"] for r in group)
        knee = next(r for r in group if r["summary"]["hit_ratio"] >= 0.98 * best)
        for r in group:
            r["knee"] = r is knee


def _curves(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by everything but the L1 size, each group in L1 order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        p = run["point"]
        label = f"L2 {p['l2_tokens']:,}, {p['eviction']}" + (
            f", {p['write_policy']}" if p["l2_tokens"] else ""
        )
        groups.setdefault(label, []).append(run)
    for group in groups.values():
        group.sort(key=lambda r: r["point"]["l1_tokens"])
    return groups


def _l1_axis(runs: list[dict[str, Any]]) -> tuple[str, str]:
    """The x axis: GiB of the modeled KV when every run has a planner block, else tokens."""
    if all((r["summary"].get("planner") or {}).get("tier_gib") for r in runs):
        return "planner.tier_gib.l1", "L1 size, GiB of KV"
    return "config.l1_tokens", "L1 size, tokens"


def _plot(runs: list[dict[str, Any]], path: Path, what: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x_key, x_label = _l1_axis(runs)
    for label, group in _curves(runs).items():
        x = [lookup(r["summary"], x_key) for r in group]
        s = [r["summary"] for r in group]
        if what == "hit_ratio":
            ax.plot(x, [d["hit_ratio"] for d in s], marker="o", label=label)
        elif what == "ttft":
            (line,) = ax.plot(
                x, [d["ttft_ms"]["p50"] for d in s], marker="o", label=f"{label}: p50"
            )
            ax.plot(
                x,
                [d["ttft_ms"]["p99"] for d in s],
                marker="s",
                ls="--",
                color=line.get_color(),
                label=f"{label}: p99",
            )
        else:
            l1 = np.array([d["hit_tokens_by_tier"]["l1"] for d in s], dtype=float)
            l2 = np.array([d["hit_tokens_by_tier"]["l2"] for d in s], dtype=float)
            (line,) = ax.plot(x, l1, marker="o", label=f"{label}: L1")
            if l2.any():
                ax.plot(x, l2, marker="s", ls="--", color=line.get_color(), label=f"{label}: L2")
    ideal = runs[0].get("ideal_hit_ratio")
    if what == "hit_ratio" and ideal is not None:
        ax.axhline(
            ideal, color="0.4", ls=":", label=f"ideal (a cache that never evicts): {ideal:.3f}"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x_label)
    if what == "hit_ratio":
        ax.set_ylabel("hit ratio")
        ax.set_ylim(bottom=0)
        ax.set_title("Hit ratio against cache size")
    elif what == "ttft":
        ax.set_ylabel("TTFT, ms")
        ax.set_title("TTFT against cache size")
    else:
        ax.set_ylabel("hit tokens")
        ax.set_title("Hit tokens by tier against cache size")
    ax.legend(fontsize=7)
    save(fig, path)


def write_sweep_report(directory: str | Path, runs: list[dict[str, Any]]) -> Path:
    """Write ``sweep.json``, the plots and ``report.html`` for ``runs`` into ``directory``."""
    if not runs:
        raise ConfigError("the sweep finished no run; nothing to report")
    out = prepare_report_dir(directory, SWEEP_FILES)
    write_text(out / "sweep.json", json.dumps({"runs": runs}, indent=1) + "\n")
    for what in ("hit_ratio", "ttft", "tiers"):
        _plot(runs, out / f"{what}.png", what)
    first = runs[0]["summary"]
    config = {
        k: v
        for k, v in first["config"].items()
        if k not in ("l1_tokens", "l2_tokens", "eviction", "write_policy")
    }
    figures = [
        figure(
            "hit_ratio.png",
            "Hit ratio of the whole workload at each L1 size; dotted: the workload's ideal "
            "(a cache that never evicts).",
        ),
        figure("ttft.png", "TTFT p50 (solid) and p99 (dashed) from arrival at each L1 size."),
        figure("tiers.png", "Prompt tokens served by each tier at each L1 size."),
    ]
    head = "".join(f"<th>{label}</th>" for label, _ in COLUMNS)
    rows = []
    for i, run in enumerate(runs):
        cells = []
        for _, key in COLUMNS:
            value = lookup(run["summary"], key)
            cls = (
                ' class="num"'
                if isinstance(value, (int, float)) and not isinstance(value, bool)
                else ""
            )
            cells.append(f'<td{cls} data-key="runs.{i}.summary.{key}">{format_value(value)}</td>')
        rows.append(f"<tr>{''.join(cells)}</tr>")
    numbers = f"<table><tr>{head}</tr>\n" + "\n".join(rows) + "\n</table>"
    clock = first.get("clock") or {}
    cost = clock.get("cost") or {}
    priced = (
        f", TTFT priced by cost profile {cost['name']} ({cost.get('kind', '?')})"
        if cost.get("name")
        else (", TTFT priced by the flat cost model" if cost else "")
    )
    lead = (
        f"{len(runs)} runs of {config.get('workload', '?')} ({first['requests']:,} requests each), "
        f"arrivals {first.get('arrivals', '?')}, {clock.get('kind', 'wall')} clock{priced}."
    )
    index = {id(run): i for i, run in enumerate(runs)}
    curves = {label: [index[id(r)] for r in group] for label, group in _curves(runs).items()}
    headline = sweep_headline(curves, runs)
    path = out / "report.html"
    data = first | {"config": config}
    write_text(path, page("kvstrata sweep", lead, data, headline, figures, numbers))
    return path


def parse_sizes(values: Sequence[str], flag: str) -> tuple[int, ...]:
    """Token counts from the command line; ``k``, ``M``, ``G`` multiply by 2**10, 2**20, 2**30."""
    out = []
    for text in values:
        scale = {"k": 1 << 10, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if scale > 1 else text
        if not digits.isdigit():
            raise ConfigError(f"{flag} takes token counts like 262144 or 256k, got {text!r}")
        out.append(int(digits) * scale)
    return tuple(out)
