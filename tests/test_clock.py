"""The engine's clocks and the arrival processes (``--clock``, ``--sim-*``, ``--arrivals``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.arrivals import ArrivalSpec, ArrivalTimes
from kvstrata.clock import COST_DEFAULTS, CostModel, SimClock, StepWork, WallClock, make_clock
from kvstrata.errors import ConfigError
from kvstrata.workloads import Request

COST = CostModel(tokens_per_s=1000.0, h2d_gbps=2.0, d2h_gbps=1.0)


def work(tokens: int = 0, h2d: int = 0, d2h: int = 0, wait: float = 0.0) -> StepWork:
    return StepWork(tokens, h2d, d2h, wait)


def test_sim_clock_charges_load_back_then_the_larger_of_compute_and_backup() -> None:
    clock = SimClock(COST)
    assert clock.now() == 0.0
    assert clock.charge(work(tokens=500)) == 0.0  # 0.5 s of compute, no load-back
    assert clock.now() == pytest.approx(0.5)
    # 2e9 bytes of load-back at 2 GB/s come first (1 s); 1e8 bytes of backup at 1 GB/s (0.1 s)
    # hide under 0.2 s of compute.
    assert clock.charge(work(tokens=200, h2d=2 * 10**9, d2h=10**8)) == pytest.approx(1.0)
    assert clock.now() == pytest.approx(0.5 + 1.0 + 0.2)
    # A backup longer than the compute is what the step lasts.
    clock.charge(work(tokens=100, d2h=10**9))
    assert clock.now() == pytest.approx(1.7 + 1.0)


def test_sim_clock_waits_forward_only() -> None:
    clock = SimClock(COST)
    clock.wait_until(3.0)
    assert clock.now() == 3.0
    clock.wait_until(1.0)  # the past: nothing happens
    assert clock.now() == 3.0


def test_sim_clock_ignores_measured_wall_time() -> None:
    clock = SimClock(COST)
    assert clock.charge(work(tokens=0, wait=5.0)) == 0.0
    assert clock.now() == 0.0


def test_wall_clock_reports_the_measured_load_wait_and_moves_by_itself() -> None:
    clock = WallClock()
    t0 = clock.now()
    assert clock.charge(work(tokens=10**9, wait=0.25)) == 0.25
    clock.wait_until(t0 + 0.02)
    assert clock.now() >= t0 + 0.02


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"tokens_per_s": 0.0}, "--sim-tokens-per-s"),
        ({"h2d_gbps": -1.0}, "--sim-h2d-gbps"),
        ({"d2h_gbps": float("inf")}, "--sim-d2h-gbps"),
        ({"d2h_gbps": float("nan")}, "--sim-d2h-gbps"),
    ],
)
def test_cost_model_refuses_non_positive_rates(kwargs: dict[str, float], flag: str) -> None:
    values = {"tokens_per_s": 1.0, "h2d_gbps": 1.0, "d2h_gbps": 1.0} | kwargs
    with pytest.raises(ConfigError, match=flag):
        CostModel(**values)


def test_cost_model_defaults_per_device_type_and_overrides() -> None:
    cpu = CostModel.for_device("cpu")
    assert (cpu.tokens_per_s, cpu.h2d_gbps, cpu.d2h_gbps) == COST_DEFAULTS["cpu"]
    cuda = CostModel.for_device("cuda:1", tokens_per_s=5.0)
    assert (cuda.tokens_per_s, cuda.h2d_gbps, cuda.d2h_gbps) == (5.0, *COST_DEFAULTS["cuda"][1:])
    with pytest.raises(ConfigError, match="--sim-tokens-per-s"):
        CostModel.for_device("mps")


def test_auto_clock_is_simulated_only_without_a_model() -> None:
    assert make_clock("auto", "none", COST).kind == "sim"
    assert make_clock("auto", "tiny", COST).kind == "wall"
    assert make_clock("sim", "tiny", COST).kind == "sim"
    assert make_clock("wall", "none", COST).kind == "wall"
    with pytest.raises(ConfigError, match="--clock"):
        make_clock("lunar", "none", COST)


# -- arrivals ------------------------------------------------------------------------------------


def req(rid: int, arrival_ms: int | None = None) -> Request:
    return Request(rid, np.arange(1, 5, dtype=np.uint32), arrival_ms)


@pytest.mark.parametrize(
    ("text", "kind", "rate"),
    [
        (None, None, None),
        ("trace", "trace", None),
        ("burst", "burst", None),
        ("poisson:2.5", "poisson", 2.5),
    ],
)
def test_arrivals_parse(text: str | None, kind: str | None, rate: float | None) -> None:
    spec = ArrivalSpec.parse(text)
    assert (spec.kind, spec.rate) == (kind, rate)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("poisson", "rate"),
        ("poisson:", "number"),
        ("poisson:fast", "number"),
        ("poisson:0", "rate > 0"),
        ("poisson:-3", "rate > 0"),
        ("burst:3", "takes no rate"),
        ("uniform", "trace, burst or poisson"),
    ],
)
def test_arrivals_refuse_bad_specs(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ArrivalSpec.parse(text)


def test_time_scale_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--time-scale"):
        ArrivalSpec.parse("burst", time_scale=0.0)


def test_default_arrivals_follow_the_workload() -> None:
    assert ArrivalSpec.parse(None).resolve(req(0, 1234)).kind == "trace"
    assert ArrivalSpec.parse(None).resolve(req(0)).kind == "burst"
    assert ArrivalSpec.parse("burst").resolve(req(0, 5)).kind == "burst"
    with pytest.raises(ConfigError, match="timestamps .* has none"):
        ArrivalSpec.parse("trace").resolve(req(0))


def test_trace_arrivals_count_from_the_first_request_scaled_and_in_order() -> None:
    times = ArrivalTimes(ArrivalSpec("trace", time_scale=0.5), seed=0)
    stamps = [1000, 1000, 3000, 2000, 7000]  # 2000 is out of order: it arrives with its predecessor
    got = [times.next(req(i, ms)) for i, ms in enumerate(stamps)]
    assert got == [0.0, 0.0, 1.0, 1.0, 3.0]


def test_burst_arrivals_are_all_at_zero() -> None:
    times = ArrivalTimes(ArrivalSpec("burst"), seed=0)
    assert [times.next(req(i, 10 * i)) for i in range(5)] == [0.0] * 5


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate() -> None:
    def draw(seed: int) -> list[float]:
        times = ArrivalTimes(ArrivalSpec("poisson", rate=20.0), seed=seed)
        return [times.next(req(i)) for i in range(4000)]

    a, b = draw(7), draw(7)
    assert a == b and a != draw(8)
    gaps = np.diff([0.0, *a])
    assert (gaps > 0).all()
    assert abs(gaps.mean() - 1 / 20) < 0.05 / 20 * 4  # 4000 gaps: the mean is within 5 %
    scaled = ArrivalTimes(ArrivalSpec("poisson", rate=20.0, time_scale=2.0), seed=7)
    assert [scaled.next(req(i)) for i in range(10)] == pytest.approx([2 * t for t in a[:10]])
