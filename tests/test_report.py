"""``kvstrata replay --report``: the page's numbers are summary.json's, and a browser shows it whole."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvstrata.cli import main
from kvstrata.report import PLOTS, flatten
from kvstrata.timeline import Timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Cells(HTMLParser):
    """Collects every element's ``data-key`` and text, and every image source."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.images: list[str] = []
        self._key: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.images.append(a["src"] or "")
        self._key = a.get("data-key")
        if self._key is not None:
            self.values[self._key] = ""

    def handle_data(self, data: str) -> None:
        if self._key is not None:
            self.values[self._key] += data

    def handle_endtag(self, tag: str) -> None:
        self._key = None


def parse(text: str) -> Cells:
    cells = Cells()
    cells.feed(text)
    return cells


def same(shown: str, value: object) -> bool:
    """Whether a cell's text shows ``value`` (numbers compared as numbers)."""
    if value is None:
        return shown == "—"
    if isinstance(value, bool):
        return shown == ("true" if value else "false")
    if isinstance(value, (int, float)):
        return float(shown.replace(",", "")) == float(value)
    return shown == str(value)


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
    # What a reader looks for first is there, and has moved between tiers.
    assert data["hit_tokens_by_tier"]["l2"] > 0 and data["tiers"]["h2d_bytes"] > 0
    assert "ttft_parts_ms.queue.p99" in cells.values
    assert data["verify"]["payload_mismatched_bytes"] == 0


def test_the_page_shows_every_plot_and_its_header(report_dir: Path) -> None:
    html = (report_dir / "report.html").read_text()
    cells = parse(html)
    assert sorted(cells.images) == sorted(PLOTS)
    for name in PLOTS:
        assert (report_dir / name).read_bytes().startswith(PNG_MAGIC), name
    for heading in ("Configuration", "Versions", "Machine", "Numbers"):
        assert f"<h2>{heading}</h2>" in html
    assert "synthetic:1:150" in html and "matplotlib" in html and "cpu cores" in html


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


_CHECK = """
<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const bad = images.filter((i) => !(i.complete && i.naturalWidth > 0)).map((i) => i.src);
  const out = document.createElement("pre");
  out.id = "image-check";
  out.textContent = JSON.stringify({images: images.length, broken: bad});
  document.body.appendChild(out);
});
</script>
"""


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
@pytest.mark.slow
def test_headless_chromium_loads_every_image(report_dir: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip(
            "no chromium on PATH: scripts/setup.sh installs Debian's chromium where apt is "
            "available (apt-get install chromium)"
        )
    # A copy of the page beside its images, with a script that reports every image once loaded.
    page = report_dir / "browser-check.html"
    page.write_text((report_dir / "report.html").read_text().replace("</body>", _CHECK + "</body>"))
    out = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",  # tests run as root in CI
            "--disable-gpu",
            "--allow-file-access-from-files",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    dom = parse(out.stdout)
    assert sorted(dom.images) == sorted(PLOTS)
    marker = out.stdout.split('<pre id="image-check">', 1)
    assert len(marker) == 2, f"the check script did not run:\n{out.stdout[-2000:]}"
    result = json.loads(marker[1].split("</pre>", 1)[0].replace("&quot;", '"'))
    assert result == {"images": len(PLOTS), "broken": []}


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
