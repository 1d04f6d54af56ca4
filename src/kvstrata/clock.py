"""The engine's clock: wall time, or simulated time advanced by a cost model.

Every time the engine reports (a request's arrival, admission and first token) is read from one
:class:`Clock`. Two kinds:

* :class:`WallClock` — seconds of ``time.perf_counter`` since the clock was made. A model run
  uses it: the forward's own duration is the compute time.
* :class:`SimClock` — seconds that only :meth:`~SimClock.charge` moves, by a :class:`CostModel`:
  a step that computes ``T`` tokens, copies ``h`` bytes host -> device and ``d`` bytes device ->
  host lasts::

      h / h2d_rate  +  max(T / tokens_per_s, d / d2h_rate)

  Load-back is charged in full before the compute (the engine overlaps it layer by layer, so this
  is an upper bound); write-through copies run beside the compute and cost only what they exceed
  it by. ``--model none`` uses it, so a whole trace's TTFT is estimated in seconds, and identically
  on every run: nothing here reads the wall clock.

Neither clock takes part in a structural decision (docs/design.md: nothing structural depends on
wall-clock time); they only stamp times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Protocol

from .errors import ConfigError

ClockKind = Literal["wall", "sim"]
CLOCKS = ("auto", "wall", "sim")

#: Cost-model defaults per device type, measured (docs/benchmarks.md, "Simulated clock").
#: CPU: computed tokens/s of ``kvstrata replay --model none`` on the whole Mooncake conversation
#: trace, and the CPU pools' batched page copy (``kvstrata bench transfer --device cpu``).
#: CUDA: the H200 rows of docs/benchmarks.md: Llama-3.2-1B-shaped prefill at 8,192 tokens, and the
#: batched page copy device <-> pinned host (Triton kernel, GQA pages).
COST_DEFAULTS: dict[str, tuple[float, float, float]] = {
    # device type: (tokens_per_s, h2d GB/s, d2h GB/s)
    "cpu": (10_700_000.0, 1.89, 1.83),
    "cuda": (162_833.0, 51.29, 52.56),
}


@dataclass(frozen=True)
class CostModel:
    """What a simulated step costs: compute tokens per second and copy GB/s (10**9 bytes) per
    tier link and direction."""

    tokens_per_s: float
    h2d_gbps: float
    d2h_gbps: float

    def __post_init__(self) -> None:
        for name, flag in (
            ("tokens_per_s", "--sim-tokens-per-s"),
            ("h2d_gbps", "--sim-h2d-gbps"),
            ("d2h_gbps", "--sim-d2h-gbps"),
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"{flag} must be a positive number, got {value!r}")

    @classmethod
    def for_device(
        cls,
        device: str,
        tokens_per_s: float | None = None,
        h2d_gbps: float | None = None,
        d2h_gbps: float | None = None,
    ) -> CostModel:
        """The measured defaults for ``device``'s type, with any value given replacing its own."""
        kind = device.split(":")[0]
        if kind not in COST_DEFAULTS:
            raise ConfigError(
                f"no measured cost model for device {device!r}; give --sim-tokens-per-s, "
                "--sim-h2d-gbps and --sim-d2h-gbps"
            )
        tps, h2d, d2h = COST_DEFAULTS[kind]
        return cls(
            tokens_per_s=tps if tokens_per_s is None else tokens_per_s,
            h2d_gbps=h2d if h2d_gbps is None else h2d_gbps,
            d2h_gbps=d2h if d2h_gbps is None else d2h_gbps,
        )


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one engine step did, for the clock to charge."""

    computed_tokens: int
    h2d_bytes: int
    d2h_bytes: int
    load_wait_s: float  # the forward's measured wait for load-back copies (host clock)


class Clock(Protocol):
    """Seconds since the run began, on one clock."""

    kind: ClockKind

    def now(self) -> float: ...

    def charge(self, work: StepWork) -> float:
        """Account for one finished step; return the part of it spent waiting for load-back."""
        ...

    def wait_until(self, t: float) -> None:
        """Let time pass until ``t`` (the next arrival) when there is nothing to do."""
        ...


class WallClock:
    """``time.perf_counter`` seconds since construction; steps take the time they take."""

    kind: ClockKind = "wall"

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def charge(self, work: StepWork) -> float:
        return work.load_wait_s

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class SimClock:
    """Simulated seconds: only :meth:`charge` (a step's cost) and :meth:`wait_until` (idle until
    the next arrival) move it."""

    kind: ClockKind = "sim"

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self._t = 0.0

    def now(self) -> float:
        return self._t

    def charge(self, work: StepWork) -> float:
        m = self.model
        load = work.h2d_bytes / (m.h2d_gbps * 1e9)
        compute = work.computed_tokens / m.tokens_per_s
        self._t += load + max(compute, work.d2h_bytes / (m.d2h_gbps * 1e9))
        return load

    def wait_until(self, t: float) -> None:
        self._t = max(self._t, t)


def make_clock(kind: str, model_name: str, cost: CostModel) -> Clock:
    """The clock a replay runs on: ``auto`` is simulated with ``--model none`` (nothing measured
    would mean anything) and the wall clock with a model."""
    if kind not in CLOCKS:
        raise ConfigError(f"--clock must be one of {', '.join(CLOCKS)}, got {kind!r}")
    if kind == "sim" or (kind == "auto" and model_name == "none"):
        return SimClock(cost)
    return WallClock()
