"""Prometheus metrics of a replay: scraped over HTTP while it runs, they agree with its summary."""

from __future__ import annotations

import socket
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.cli import main
from kvstrata.engine import EngineConfig
from kvstrata.errors import ConfigError
from kvstrata.metrics import MetricsServer
from kvstrata.replay import ReplayConfig, ReplayRun, run_replay

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@dataclass
class Scraper:
    """Scrapes the endpoint from the replay's own thread: at a step in the middle, and at the end
    (after the drain, before the summary)."""

    at_step: int
    middle: Samples = field(default_factory=dict)
    end: Samples = field(default_factory=dict)
    url: str = ""

    def on_start(self, run: ReplayRun) -> None:
        assert run.metrics_url is not None
        self.url = run.metrics_url

    def on_step(self, run: ReplayRun) -> None:
        if run.engine.steps == self.at_step and not self.middle:
            self.middle = scrape(self.url)

    def on_end(self, run: ReplayRun) -> None:
        self.end = scrape(self.url)


def test_scraped_counters_agree_with_the_summary() -> None:
    scraper = Scraper(at_step=20)
    cfg = ReplayConfig(
        workload="synthetic:5:120",
        model="none",
        kv_width=8,
        engine=EngineConfig(page_size=16, pool_tokens=1 << 14, l2_tokens=1 << 16),
        metrics_port=0,
    )
    summary = run_replay(cfg, progress=False, observers=[scraper])
    data, end, mid = summary.to_json(), scraper.end, scraper.middle
    assert scraper.url.startswith("http://127.0.0.1:")

    assert value(end, "kvstrata_requests_total", outcome="ok") == data["requests"] - data["failed"]
    assert value(end, "kvstrata_requests_total", outcome="failed") == data["failed"]
    for name in ("prompt_tokens", "cached_tokens", "computed_tokens"):
        assert value(end, f"kvstrata_{name}_total") == data[name]
    for tier in ("l1", "l2"):
        assert (
            value(end, "kvstrata_hit_tokens_total", tier=tier) == data["hit_tokens_by_tier"][tier]
        )
    tiers = data["tiers"]
    assert tiers["d2h_bytes"] > 0 and tiers["h2d_bytes"] > 0
    for direction in ("d2h", "h2d"):
        assert (
            value(end, "kvstrata_moved_bytes_total", direction=direction)
            == tiers[f"{direction}_bytes"]
        )
        assert (
            value(end, "kvstrata_moved_pages_total", direction=direction)
            == tiers[f"{direction}_pages"]
        )
    for outcome in ("done", "skipped", "failed"):
        assert value(end, "kvstrata_backups_total", outcome=outcome) == tiers[f"backups_{outcome}"]
    assert value(end, "kvstrata_load_backs_total", outcome="done") == tiers["loads"]
    assert value(end, "kvstrata_steps_total") == data["steps"]
    assert value(end, "kvstrata_clock_seconds") == pytest.approx(data["clock"]["seconds"], abs=1e-6)
    assert value(end, "kvstrata_pages_total", tier="l1", lane="0") == data["pool"]["pages"]
    assert value(end, "kvstrata_pages_total", tier="l2", lane="0") == tiers["host_pages"]
    assert (
        value(end, "kvstrata_pages_used", tier="l1", lane="0") == data["pool"]["pages_cached_end"]
    )
    assert value(end, "kvstrata_pages_used", tier="l2", lane="0") == tiers["host_pages_cached_end"]
    assert value(end, "kvstrata_queue_depth", queue="waiting") == 0
    assert value(end, "kvstrata_copies_in_flight", kind="backup") == 0

    # In the middle of the run: a consistent snapshot, behind the end on every counter.
    assert mid, "the replay ended before the middle scrape"
    assert value(mid, "kvstrata_steps_total") == 20
    assert 0 < value(mid, "kvstrata_prompt_tokens_total") < data["prompt_tokens"]
    for key, v in mid.items():
        if key[0].endswith("_total"):
            assert v <= end[key], key
    # Nothing went to prometheus_client's global registry.
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("kvstrata")]


def test_metrics_server_binds_loopback_by_default_and_refuses_a_taken_port(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        with pytest.raises(ConfigError, match="--metrics-port"):
            MetricsServer(CollectorRegistry(), "127.0.0.1", server.port)
        code = main(
            ["replay", "--model", "none", "--no-progress", "--metrics-port", str(server.port)]
        )
        assert code == 2
        assert "cannot serve metrics" in capsys.readouterr().err
    finally:
        server.close()
    with pytest.raises(ConnectionRefusedError):  # closed: the port is free again
        socket.create_connection(("127.0.0.1", server.port), timeout=1)


def test_metrics_port_is_validated() -> None:
    with pytest.raises(ConfigError, match="--metrics-port"):
        ReplayConfig(metrics_port=70_000)
    with pytest.raises(ConfigError, match="--metrics-port"):
        MetricsServer(CollectorRegistry(), "127.0.0.1", -1)


def test_replay_prints_where_metrics_are_served(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["replay", "--model", "none", "--metrics-port", "0", "--limit", "5"])
    assert code == 0
    assert "metrics on http://127.0.0.1:" in capsys.readouterr().err


@pytest.mark.parametrize(("host", "warned"), [("127.0.0.1", False), ("0.0.0.0", True)])
def test_a_metrics_host_off_loopback_is_warned_about(
    capsys: pytest.CaptureFixture[str], host: str, warned: bool
) -> None:
    argv = ["replay", "--model", "none", "--metrics-port", "0", "--metrics-host", host]
    assert main([*argv, "--limit", "3", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert ("warning: --metrics-host 0.0.0.0 serves the metrics" in err) is warned, err
    from kvstrata.metrics import exposure_warning

    assert exposure_warning("::1") is None and exposure_warning("localhost") is None
    assert exposure_warning("metrics.example.com") is not None


def test_the_disk_tier_joins_the_families(tmp_path: Path) -> None:
    """With an L3, its slots are a tier's pages and its counters are exported; the tokens the
    engine counts as disk hits equal what the disk tier says it served."""
    scraper = Scraper(at_step=-1)
    cfg = ReplayConfig(
        workload="builtin",
        model="none",
        kv_width=8,
        vocab_size=1000,
        engine=EngineConfig(
            page_size=16,
            pool_tokens=640,
            chunk_size=64,
            max_batch_tokens=128,
            max_batch_requests=4,
            l2_tokens=640,
            l3_dir=str(tmp_path / "l3"),
            l3_gib=0.05,
        ),
        metrics_port=0,
    )
    run_replay(cfg, progress=False, observers=[scraper])
    end = scraper.end
    assert value(end, "kvstrata_pages_total", tier="l3", lane="0") > 0
    assert value(end, "kvstrata_disk_total", event="spilled_pages") > 0
    assert value(end, "kvstrata_hit_tokens_total", tier="l3") == value(
        end, "kvstrata_disk_total", event="hit_tokens"
    )
    assert any(name == "kvstrata_disk_store_total" for name, _ in end)
