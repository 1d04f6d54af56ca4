"""``kvstrata sweep`` and ``kvstrata compare``: the capacity planner's two questions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report import check_cells, parse

from kvstrata.cli import main
from kvstrata.compare import compare, load_summary, ratio
from kvstrata.errors import ConfigError
from kvstrata.replay import ReplayConfig
from kvstrata.sweep import COLUMNS, SweepGrid, configs, parse_sizes

SIZES = ["16k", "64k", "256k"]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    code = main(
        [
            "sweep",
            "--trace",
            "synthetic:2:200",
            "--l1-tokens",
            *SIZES,
            "--eviction",
            "lru",
            "slru",
            "--max-batch-requests",
            "1",
            "--kv-width",
            "4",
            "--no-progress",
            "--report",
            str(out),
        ]
    )
    assert code == 0
    return out


def test_sweep_runs_every_point_and_lru_hits_more_with_more_cache(sweep_dir: Path) -> None:
    runs = json.loads((sweep_dir / "sweep.json").read_text())["runs"]
    assert [(r["point"]["eviction"], r["point"]["l1_tokens"]) for r in runs] == [
        (e, s) for e in ("lru", "slru") for s in (16384, 65536, 262144)
    ]
    for run in runs:
        summary = run["summary"]
        assert summary["config"]["l1_tokens"] == run["point"]["l1_tokens"]
        assert summary["config"]["eviction"] == run["point"]["eviction"]
        assert summary["clock"]["kind"] == "sim" and summary["config"]["model"] == "none"
        assert summary["failed"] == 0
    # One request at a time under LRU, page by page: a larger cache holds a superset of a smaller
    # one's pages (LRU's inclusion property), so it never hits less.
    lru = [r["summary"]["hit_ratio"] for r in runs if r["point"]["eviction"] == "lru"]
    assert lru == sorted(lru) and lru[0] < lru[-1]
    # One knee per curve: the smallest size within 2 % of the curve's best hit ratio.
    for eviction in ("lru", "slru"):
        curve = [r for r in runs if r["point"]["eviction"] == eviction]
        best = max(r["summary"]["hit_ratio"] for r in curve)
        knees = [r for r in curve if r["knee"]]
        assert len(knees) == 1 and knees[0]["summary"]["hit_ratio"] >= 0.98 * best
        assert all(r["summary"]["hit_ratio"] < 0.98 * best for r in curve[: curve.index(knees[0])])
    # The ideal (a cache that never evicts) bounds every run, and the largest LRU size, which
    # holds this whole workload, reaches it.
    ideal = runs[0]["ideal_hit_ratio"]
    assert all(r["ideal_hit_ratio"] == ideal for r in runs) and 0 < ideal <= 1
    assert all(r["summary"]["hit_ratio"] <= ideal + 1e-9 for r in runs)
    assert lru[-1] == pytest.approx(ideal, abs=1e-6) and lru[0] < ideal
    assert all(r["of_ideal"] == round(r["summary"]["hit_ratio"] / ideal, 6) for r in runs)


def test_sweep_page_numbers_are_sweep_json(sweep_dir: Path) -> None:
    doc = json.loads((sweep_dir / "sweep.json").read_text())
    runs = doc["runs"]
    text = (sweep_dir / "report.html").read_text()
    cells = parse(text)
    assert sorted(cells.images) == ["hit_ratio.png", "tiers.png", "ttft.png"]
    table = {f"runs.{i}.summary.{key}" for i in range(len(runs)) for _, key in COLUMNS}
    assert table <= set(cells.values)
    check_cells(cells, doc)
    # The lead names what priced the TTFT curves: the cost profile, or the flat model.
    cost = runs[0]["summary"]["clock"]["cost"]
    named = f"cost profile {cost['name']}" if cost.get("name") else "the flat cost model"
    assert f"TTFT priced by {named}" in text
    # The page opens with each curve's knee: its size, hit ratio, TTFT p50 / p90.
    head = parse(text[: text.index("<img")])
    for i, run in enumerate(runs):
        shown = f"runs.{i}.point.l1_tokens" in head.values
        assert shown == run["knee"], (i, run["knee"])
        if run["knee"]:
            for key in ("hit_ratio", "ttft_ms.p50", "ttft_ms.p90", "planner.compute_s_saved"):
                assert f"runs.{i}.summary.{key}" in head.values, key
            pair = (f"runs.{i}.summary.hit_tokens_by_tier.l1", f"runs.{i}.summary.prompt_tokens")
            assert pair in {(n, d) for n, d, _ in head.shares}


def test_sweep_checks_every_point_before_running_any() -> None:
    base = ReplayConfig(model="none")
    with pytest.raises(ConfigError, match="pool_tokens"):
        configs(base, SweepGrid(l1_tokens=(4096, 8)))  # 8 tokens: less than a page
    with pytest.raises(ConfigError, match="twice"):
        SweepGrid(l1_tokens=(4096, 4096))
    assert len(configs(base, SweepGrid((1024, 2048), (0, 4096), ("lru", "slru")))) == 8


def test_sizes_take_binary_suffixes() -> None:
    assert parse_sizes(["16", "2k", "3M", "1G"], "--l1-tokens") == (16, 2048, 3 << 20, 1 << 30)
    with pytest.raises(ConfigError, match="--l1-tokens"):
        parse_sizes(["4.5M"], "--l1-tokens")


def test_compare_reads_summaries_reports_and_json_output(
    sweep_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = json.loads((sweep_dir / "sweep.json").read_text())["runs"]
    a, b = runs[0]["summary"], runs[2]["summary"]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text(json.dumps(a))
    (tmp_path / "b.txt").write_text("requests 200\nsome table\n" + json.dumps(b) + "\n")
    assert load_summary(tmp_path / "a") == a
    assert load_summary(tmp_path / "b.txt") == b
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b.txt"), "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {r["name"]: r for r in json.loads(out[-1])["rows"]}
    assert rows["hit ratio"]["b_over_a"] == f"{b['hit_ratio'] / a['hit_ratio']:.3f}"
    assert (
        rows["config: l1_tokens"]["a"] == "16,384" and rows["config: l1_tokens"]["b"] == "262,144"
    )
    assert "config: eviction" not in rows  # equal on both sides
    assert any(line.startswith("hit ratio") for line in out)


def test_compare_rows_and_ratios() -> None:
    a = {"schema": 2, "hit_ratio": 0.25, "requests": 10, "tiers": None, "config": {"x": 1}}
    b = {"schema": 1, "hit_ratio": 0.5, "requests": 10, "config": {"x": 2}}
    rows = {r[0]: r[1:] for r in compare(a, b)}
    assert rows["hit ratio"] == ("0.25", "0.5", "2.000")
    assert rows["requests"] == ("10", "10", "1.000")
    assert "moved d2h bytes" not in rows  # neither side has it
    assert rows["config: x"] == ("1", "2", "")
    assert ratio(0, 0) == "—" and ratio(0, 3) == "inf" and ratio(None, 3) == "—"


def test_compare_refuses_what_is_not_a_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x.json").write_text('{"bench": "radix"}')
    assert main(["compare", str(tmp_path / "x.json"), str(tmp_path / "missing.json")]) == 2
    assert "holds no replay summary" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing.json"), str(tmp_path / "x.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_the_l1_axis_is_in_gib_when_every_run_plans_a_model() -> None:
    from kvstrata.sweep import _l1_axis

    planned = [{"summary": {"planner": {"tier_gib": {"l1": 1.0}}}} for _ in range(2)]
    assert _l1_axis(planned) == ("planner.tier_gib.l1", "L1 size, GiB of KV")
    mixed = [*planned, {"summary": {"planner": None}}]
    assert _l1_axis(mixed) == ("config.l1_tokens", "L1 size, tokens")


def test_the_report_names_the_cost_profile_that_priced_it(tmp_path: Path) -> None:
    """With --cost-profile the sweep's TTFT comes from that profile, and the page says which."""
    from kvstrata.cost import load_profile

    profile = load_profile("h200-llama-3.2-1b-bf16")
    argv = ["sweep", "--trace", "synthetic:2:40", "--l1-tokens", "8192", "65536", "--kv-width"]
    argv += ["4", "--cost-profile", profile.name, "--no-progress", "--report", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert {r["summary"]["clock"]["cost"]["name"] for r in doc["runs"]} == {profile.name}
    text = (tmp_path / "report.html").read_text()
    assert f"TTFT priced by cost profile {profile.name} (calibrated)" in text
