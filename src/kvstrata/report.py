"""``kvstrata replay --report DIR``: one replay as a page people want to look at.

:func:`write_report` writes into ``DIR``:

* ``summary.json`` — the replay's ``--json`` summary;
* ``hit_ratio.png`` — the hit ratio over time, by the tier that served the hits;
* ``occupancy.png`` — the share of each tier's pages in use;
* ``bytes_moved.png`` — bytes copied device -> host and host -> device, cumulated;
* ``ttft.png`` — the TTFT distribution of requests served partly from the cache against those
  computed whole;
* ``report.html`` — the answer first (:mod:`kvstrata.headline`: hit ratio by tier, what the
  cache saved, TTFT p50/p90 and its parts), the plots, the configuration, versions and machine,
  then every number of ``summary.json`` (each cell carries its JSON path in ``data-key``); the
  layout is :mod:`kvstrata.report_html`'s.

Plots are drawn with matplotlib (the ``report`` extra), off screen. :mod:`kvstrata.sweep` reuses
the page layout for a sweep over cache sizes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .errors import ConfigError
from .headline import replay_headline
from .report_html import figure, flatten, page, table

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .timeline import Timeline

PLOTS = ("hit_ratio.png", "occupancy.png", "bytes_moved.png", "ttft.png")
#: Every file :func:`write_report` writes.
REPORT_FILES = ("summary.json", *PLOTS, "report.html")
#: Summary fields the header shows instead of the numbers table.
_HEADER_FIELDS = ("config", "versions", "errors")
_WINDOWS = 100  # windows the hit-ratio plot averages over


def require_matplotlib() -> None:
    """Fail fast, before a replay runs, when the plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--report needs matplotlib: pip install 'kvstrata[report]'") from None


def pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # off screen, whatever the environment says
    import matplotlib.pyplot as plt

    return plt


def prepare_report_dir(directory: str | Path, names: Iterable[str], flag: str = "--report") -> Path:
    """Create the report directory and check that each of ``names`` can be written there, before
    the work whose results it will hold (a replay, a sweep) runs."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create the report directory {out}: {err.strerror}") from None
    for name in names:
        path = out / name
        if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
            raise ConfigError(
                f"{path} exists and is not a regular file; the report writes that name: remove "
                f"it or give {flag} another directory"
            )
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write into the report directory {out}: permission denied")
    return out


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then rename it over ``path``: a full
    disk or a crash leaves the previous file (or none), never half of one."""
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigError(
            f"cannot write the report file {path}: {err.strerror}; free space or give the "
            "report another directory"
        ) from None


def write_text(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format=path.suffix[1:]))
    finally:
        pyplot().close(fig)


def _x(timeline: Timeline) -> tuple[npt.NDArray[np.float64], str]:
    clock = timeline.column("clock_s")
    if clock.size and clock[-1] > clock[0]:
        return clock, f"{'simulated' if timeline.clock_kind == 'sim' else 'wall'} clock, s"
    return timeline.column("step"), "engine step"


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#777")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_hit_ratio(timeline: Timeline, path: Path) -> None:
    """Per window of the run, the share of the prompt tokens each tier served (stacked)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x, label = _x(timeline)
    prompt = timeline.column("prompt_tokens")
    if prompt.size < 2 or prompt[-1] == 0:
        _empty(ax, "no request finished")
    else:
        edges = np.unique(
            np.linspace(0, prompt.size - 1, min(_WINDOWS, prompt.size - 1) + 1).astype(int)
        )
        dp = np.diff(prompt[edges])
        mid = x[edges[1:]]
        shares = []
        tiers = [("l1", "L1 (device)"), ("l2", "L2 (host)")]
        if timeline.l3_pages:
            tiers.append(("l3", "L3 (disk)"))
        for tier, _ in tiers:
            dh = np.diff(timeline.column(f"{tier}_hit_tokens")[edges])
            shares.append(np.divide(dh, dp, out=np.zeros_like(dh), where=dp > 0))
        ax.stackplot(mid, *shares, labels=[name for _, name in tiers], alpha=0.8, step="pre")
        total = sum(timeline.column(f"{tier}_hit_tokens") for tier, _ in tiers)
        cumulative = np.divide(total, prompt, out=np.zeros_like(total), where=prompt > 0)
        ax.plot(x, cumulative, color="k", lw=1.2, label="cumulative")
        ax.set_ylim(0, 1)
        ax.set_ylabel("hit ratio")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xlabel(label)
    ax.set_title("Hit ratio over time, by tier")
    save(fig, path)


def plot_occupancy(timeline: Timeline, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x, label = _x(timeline)
    tiers = (("l1", timeline.l1_pages), ("l2", timeline.l2_pages), ("l3", timeline.l3_pages))
    for tier, total in tiers:
        if total:
            ax.plot(
                x,
                timeline.column(f"{tier}_pages_used") / total,
                label=f"{tier.upper()} ({total:,} pages)",
            )
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("pages in use")
    ax.set_xlabel(label)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Tier occupancy")
    save(fig, path)


def plot_bytes_moved(timeline: Timeline, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x, label = _x(timeline)
    if not timeline.l2_pages:
        _empty(ax, "no L2 tier: nothing moves between tiers")
    else:
        ax.plot(x, timeline.column("d2h_bytes") / 2**30, label="device -> host (backups)")
        ax.plot(x, timeline.column("h2d_bytes") / 2**30, label="host -> device (load-backs)")
        ax.set_ylabel("GiB, cumulative")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xlabel(label)
    ax.set_title("Bytes moved between tiers")
    save(fig, path)


def plot_ttft(timeline: Timeline, path: Path) -> None:
    """Empirical CDFs of TTFT for requests that hit the cache and those computed whole."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    drawn = False
    for name, mask in (
        ("served partly from the cache", timeline.hit),
        ("computed whole", ~timeline.hit),
    ):
        ms = np.sort(timeline.ttft_s[mask]) * 1e3
        if ms.size:
            ax.step(
                ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=f"{name} ({ms.size:,})"
            )
            drawn = True
    if drawn:
        if (timeline.ttft_s > 0).all():
            ax.set_xscale("log")
        ax.set_xlabel("TTFT, ms")
        ax.set_ylabel("share of requests")
        ax.legend(loc="lower right", fontsize=8)
    else:
        _empty(ax, "no request finished")
    ax.set_title("TTFT distribution")
    save(fig, path)


def write_report(directory: str | Path, data: dict[str, Any], timeline: Timeline) -> Path:
    """Write ``summary.json`` (``data``), the plots and ``report.html`` into ``directory``
    (created if needed); returns the page's path."""
    out = prepare_report_dir(directory, REPORT_FILES)
    write_text(out / "summary.json", json.dumps(data, indent=1) + "\n")
    plot_hit_ratio(timeline, out / "hit_ratio.png")
    plot_occupancy(timeline, out / "occupancy.png")
    plot_bytes_moved(timeline, out / "bytes_moved.png")
    plot_ttft(timeline, out / "ttft.png")
    figures = [
        figure(
            "hit_ratio.png",
            "Share of each window's prompt tokens served from L1, L2 and L3 (with a disk tier); "
            "the line is the hit ratio so far.",
        ),
        figure(
            "occupancy.png",
            "Pages of each tier in use (cached, held by running requests, or reserved; L3: disk "
            "slots holding pages).",
        ),
        figure(
            "bytes_moved.png", "Bytes copied between the device and host tiers (landed copies)."
        ),
        figure(
            "ttft.png",
            "TTFT from arrival, requests served partly from the cache against those computed whole.",
        ),
    ]
    numbers = [(k, v) for k, v in flatten(data) if k.split(".")[0] not in _HEADER_FIELDS]
    config = data.get("config", {})
    lead = (
        f"{data.get('requests', 0):,} requests of {config.get('workload', '?')}, hit ratio "
        f"{data.get('hit_ratio', 0.0)}, arrivals {data.get('arrivals', '?')}, "
        f"{data.get('clock', {}).get('kind', 'wall')} clock."
    )
    path = out / "report.html"
    headline = replay_headline(data)
    write_text(
        path, page("kvstrata replay", lead, data, headline, figures, table(numbers, keyed=True))
    )
    return path
