"""``kvstrata replay --report``: the page's numbers are summary.json's, and a browser shows it whole."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers import trace_line, write_trace

from kvstrata.cli import main
from kvstrata.headline import replay_headline
from kvstrata.report import PLOTS
from kvstrata.report_html import flatten, lookup
from kvstrata.sweep import SWEEP_FILES
from kvstrata.timeline import Timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Cells(HTMLParser):
    """Collects every element's ``data-key`` and text (``values``: the last of each key;
    ``keyed``: every one, in page order), every share's ``data-num`` / ``data-den`` and text, and
    every image source."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.keyed: list[tuple[str, str]] = []
        self.shares: list[tuple[str, str, str]] = []
        self.images: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.images.append(a["src"] or "")
        self._cell = None
        if a.get("data-key") is not None:
            self._cell = [a["data-key"] or "", ""]
        elif a.get("data-num") is not None:
            self._cell = [a["data-num"] or "", a["data-den"] or "", ""]

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell[-1] += data

    def handle_endtag(self, tag: str) -> None:
        if self._cell is not None and len(self._cell) == 2:
            key, text = self._cell
            self.values[key] = text
            self.keyed.append((key, text))
        elif self._cell is not None:
            num, den, text = self._cell
            self.shares.append((num, den, text))
        self._cell = None


def parse(text: str) -> Cells:
    cells = Cells()
    cells.feed(text)
    return cells


def same(shown: str, value: object) -> bool:
    """Whether a cell's text shows ``value`` (numbers compared as numbers; a percentage to the
    one decimal it shows)."""
    if value is None:
        return shown == "—"
    if isinstance(value, bool):
        return shown == ("true" if value else "false")
    if isinstance(value, (int, float)) and shown.endswith("%"):
        return abs(float(shown[:-1]) - 100 * value) <= 0.05 + 1e-9
    if isinstance(value, (int, float)):
        return float(shown.replace(",", "")) == float(value)
    return shown == str(value)


def check_cells(cells: Cells, data: object) -> None:
    """Every keyed cell of a page shows the value at its path of ``data``, and every share is
    its two paths' quotient."""
    for key, shown in cells.keyed:
        assert same(shown, lookup(data, key)), (key, shown, lookup(data, key))
    for num, den, shown in cells.shares:
        a, b = lookup(data, num), lookup(data, den)
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), (num, den)
        assert same(shown, a / b) if b else shown == "—", (num, den, shown)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    code = main(
        [
            "replay",
            "--model",
            "none",
            "--trace",
            "synthetic:1:150",
            "--l1-tokens",
            "16384",
            "--l2-tokens",
            "65536",
            "--arrivals",
            "poisson:30",
            "--kv-width",
            "8",
            "--verify",
            "3",
            "--no-progress",
            "--report",
            str(out),
        ]
    )
    assert code == 0
    return out


def test_every_number_of_the_page_is_summary_json(report_dir: Path) -> None:
    data = json.loads((report_dir / "summary.json").read_text())
    cells = parse((report_dir / "report.html").read_text())
    leaves = {
        k: v for k, v in flatten(data) if k.split(".")[0] not in ("config", "versions", "errors")
    }
    assert set(cells.values) == set(leaves)
    for key, value in leaves.items():
        assert same(cells.values[key], value), (key, cells.values[key], value)
    check_cells(cells, data)  # the headline's cells too
    # What a reader looks for first is there, and has moved between tiers.
    assert data["hit_tokens_by_tier"]["l2"] > 0 and data["tiers"]["h2d_bytes"] > 0
    assert "ttft_parts_ms.queue.p99" in cells.values
    assert data["verify"]["payload_mismatched_bytes"] == 0


def test_the_page_opens_with_the_answer(report_dir: Path) -> None:
    """Before the plots: the hit ratio of each tier (its hit tokens over the prompt tokens), the
    tokens and compute seconds saved, and TTFT p50 / p90 with its parts' shares."""
    data = json.loads((report_dir / "summary.json").read_text())
    text = (report_dir / "report.html").read_text()
    head = text[: text.index("<img")]
    assert '<section id="headline">' in head
    cells = parse(head)
    shares = {(num, den) for num, den, _ in cells.shares}
    for tier in ("l1", "l2"):
        assert (f"hit_tokens_by_tier.{tier}", "prompt_tokens") in shares
    assert ("hit_tokens_by_tier.l3", "prompt_tokens") not in shares  # no disk tier in this run
    for part in ("queue", "load_back", "compute"):
        assert (f"ttft_parts_ms.{part}.mean", "ttft_ms.mean") in shares
        assert f"ttft_parts_ms.{part}.p90" in cells.values
    for key in (
        "hit_ratio",
        "cached_tokens",
        "ttft_ms.p50",
        "ttft_ms.p90",
        "planner.compute_s_saved",
        "planner.compute_s_no_cache",
        "clock.cost.kind",
    ):
        assert key in cells.values, key
    check_cells(cells, data)
    # The parts' means add up to TTFT's mean (the split the block shows).
    parts = data["ttft_parts_ms"]
    assert sum(p["mean"] for p in parts.values()) == pytest.approx(
        data["ttft_ms"]["mean"], abs=2e-3
    )
    # The setup tables follow the plots.
    assert text.index("<h2>Configuration</h2>") > text.rindex("<img")


def test_timeline_stays_bounded_and_evenly_spaced() -> None:
    class Run:  # just what Timeline reads
        def __init__(self) -> None:
            from kvstrata.clock import CostModel, SimClock
            from kvstrata.engine import Engine, EngineConfig
            from kvstrata.model.compute import SyntheticCompute
            from kvstrata.replay import _Tally

            self.engine = Engine(SyntheticCompute(4, 100), EngineConfig(pool_tokens=64))
            self.tally = _Tally()
            self.clock = SimClock(CostModel(1.0, 1.0, 1.0))

    run = Run()
    timeline = Timeline(max_points=8)
    timeline.on_start(run)  # type: ignore[arg-type]
    for step in range(1, 100):
        run.engine.steps = step
        timeline.on_step(run)  # type: ignore[arg-type]
    timeline.on_end(run)  # type: ignore[arg-type]
    steps = timeline.column("step")
    assert len(timeline) <= 8 + 1  # and the final sample
    assert steps[0] == 0 and steps[-1] == 99
    gaps = set(map(int, (steps[1:-1] - steps[:-2])))
    assert gaps == {16}  # the stride doubled from 1 to 16, and the kept samples are 16 apart


def test_report_needs_matplotlib(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code = main(["replay", "--model", "none", "--no-progress", "--report", "/nonexistent/x"])
    assert code == 2
    assert "kvstrata[report]" in capsys.readouterr().err


#: Appended to a copy of a page: once every image has loaded, writes each table's and image's box
#: (page coordinates, CSS px) into the DOM, where ``--dump-dom`` reads it.
_BOXES = """
<script>
window.addEventListener("load", () => {
  const box = (e) => {
    const r = e.getBoundingClientRect();
    const section = e.closest("section");
    return {left: r.left + scrollX, top: r.top + scrollY, right: r.right + scrollX,
            bottom: r.bottom + scrollY, section: section ? section.id : null};
  };
  const out = document.createElement("pre");
  out.id = "boxes";
  out.textContent = JSON.stringify({
    viewport: window.innerWidth,
    height: document.documentElement.scrollHeight,
    scrollWidth: document.documentElement.scrollWidth,
    tables: [...document.querySelectorAll("table")].map(box),
    images: [...document.images].map((i) => ({
      src: i.getAttribute("src"), loaded: i.complete && i.naturalWidth > 0, ...box(i)})),
  });
  document.body.appendChild(out);
});
</script>
"""
WIDTH = 1400  # CSS px: a laptop's browser window


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _headless(browser: str, page: Path, profile: Path, *args: str) -> str:
    """Run headless Chromium on ``page`` with ``args``; its stdout."""
    out = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",  # tests run as root in CI
            "--disable-gpu",
            "--hide-scrollbars",  # the viewport is the whole window's width
            "--allow-file-access-from-files",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=10000",
            *args,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    """Whether two boxes share an area (touching edges do not count)."""
    return min(a["right"], b["right"]) > max(a["left"], b["left"]) and min(
        a["bottom"], b["bottom"]
    ) > max(a["top"], b["top"])


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real sweep's report over a trace file (its path in the configuration, as a user's
    is): two curves (L2 0 and 64k) over two L1 sizes."""
    # 60 requests of 6 conversations, each turn its conversation's prefix and one more block.
    lines = [
        trace_line(512 * (2 + k // 6), [1000 * (k % 6) + b for b in range(2 + k // 6)], 100 * k)
        for k in range(60)
    ]
    traces = tmp_path_factory.mktemp("mooncake-traces")
    trace = write_trace(traces / "conversation_trace_first_60_requests.jsonl", lines)
    out = tmp_path_factory.mktemp("sweep-report")
    code = main(
        [
            "sweep",
            "--trace",
            str(trace),
            "--l1-tokens",
            "8k",
            "32k",
            "--l2-tokens",
            "0",
            "64k",
            "--kv-width",
            "4",
            "--no-progress",
            "--report",
            str(out),
        ]
    )
    assert code == 0
    return out


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.parametrize("which", ["replay", "sweep"])
def test_a_browser_shows_the_page_readably(
    which: str, report_dir: Path, sweep_report: Path, tmp_path: Path
) -> None:
    """The page as a person sees it at 1400 px: the answer first, then every plot at least 500 px
    wide and loaded, then the configuration; no table's box over another's. The screenshot is
    left in ``tmp_path``."""
    browser = _chromium()
    if browser is None:
        pytest.skip(
            "no chromium on PATH: scripts/setup.sh installs Debian's chromium where apt is "
            "available (apt-get install chromium)"
        )
    directory = report_dir if which == "replay" else sweep_report
    page = directory / "browser-check.html"
    page.write_text((directory / "report.html").read_text().replace("</body>", _BOXES + "</body>"))
    dom = _headless(browser, page, tmp_path / "profile", f"--window-size={WIDTH},900", "--dump-dom")
    marker = dom.split('<pre id="boxes">', 1)
    assert len(marker) == 2, f"the check script did not run:\n{dom[-2000:]}"
    boxes = json.loads(html.unescape(marker[1].split("</pre>", 1)[0]))
    assert boxes["viewport"] == WIDTH
    assert boxes["scrollWidth"] <= WIDTH, "the page scrolls sideways"
    shot = tmp_path / f"{which}.png"
    height = min(int(boxes["height"]), 16000)
    _headless(
        browser,
        page,
        tmp_path / "profile",
        f"--window-size={WIDTH},{height}",
        f"--screenshot={shot}",
    )
    assert shot.read_bytes().startswith(PNG_MAGIC)

    images, tables = boxes["images"], boxes["tables"]
    expected = PLOTS if which == "replay" else SWEEP_FILES[1:-1]
    assert sorted(i["src"] for i in images) == sorted(expected)
    for image in images:
        assert image["loaded"], image
        assert image["right"] - image["left"] >= 500, (f"a thumbnail at {WIDTH} px", image)
    for i, a in enumerate(tables):
        for b in tables[i + 1 :]:
            assert not _overlap(a, b), ("two tables overlap", a, b, f"screenshot: {shot}")
    # The answer first, then the plots, then the configuration and versions.
    headline = [t for t in tables if t["section"] == "headline"]
    setup = [t for t in tables if t["section"] == "setup"]
    assert headline and setup, "the page has a headline block and a setup block"
    first_plot = min(i["top"] for i in images)
    assert max(t["bottom"] for t in headline) <= first_plot
    assert max(i["bottom"] for i in images) <= min(t["top"] for t in setup)


def test_the_report_shows_the_disk_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an L3, the hit-ratio plot stacks L3 hits as their own tier (not under L2) and the
    occupancy plot has an L3 line; the timeline's L3 column ends at the summary's L3 hits."""
    from kvstrata import report
    from kvstrata.engine import EngineConfig
    from kvstrata.replay import ReplayConfig, run_replay

    engine = EngineConfig(
        page_size=16, pool_tokens=1024, l2_tokens=2048, l3_dir=str(tmp_path / "l3"), l3_gib=0.05
    )
    timeline = Timeline()
    summary = run_replay(
        ReplayConfig(model="none", kv_width=8, engine=engine), progress=False, observers=[timeline]
    ).to_json()
    by_tier = summary["hit_tokens_by_tier"]
    assert by_tier["l3"] > 0
    for tier in ("l1", "l2", "l3"):
        assert timeline.column(f"{tier}_hit_tokens")[-1] == by_tier[tier], tier
    assert timeline.l3_pages > 0 and timeline.column("l3_pages_used").max() > 0
    # The headline gives the disk tier its own share of the prompt tokens.
    cells = parse(replay_headline(summary))
    assert ("hit_tokens_by_tier.l3", "prompt_tokens") in {(n, d) for n, d, _ in cells.shares}
    check_cells(cells, summary)
    figures: list[object] = []
    monkeypatch.setattr(report, "save", lambda fig, path: figures.append(fig))
    report.plot_hit_ratio(timeline, tmp_path / "h.png")
    report.plot_occupancy(timeline, tmp_path / "o.png")
    hit, occupancy = (
        [t.get_text() for t in fig.axes[0].get_legend().get_texts()]  # type: ignore[attr-defined]
        for fig in figures
    )
    assert "L3 (disk)" in hit
    assert any(label.startswith("L3 (") for label in occupancy)
