"""The engine's clock: wall time, or simulated time advanced by a cost model.

Every time the engine reports (a request's arrival, admission and first token) is read from one
:class:`Clock`. Two kinds:

* :class:`WallClock` — seconds of ``time.perf_counter`` since the clock was made. A model run
  uses it: the forward's own duration is the compute time.
* :class:`SimClock` — seconds that only :meth:`~SimClock.charge` moves, by a cost model: a
  :class:`~kvstrata.cost.CostProfile` (the step model: per step, request, token and attention
  pair, the tier links with the engine's overlap; ``kvstrata calibrate`` fits one), or the flat
  :class:`CostModel` (a step that computes ``T`` tokens, copies ``h`` bytes host -> device and
  ``d`` bytes device -> host lasts ``h / h2d_rate + max(T / tokens_per_s, d / d2h_rate)``).
  Either way the disk's reads and writes queue on the disk from the step that issued them, and
  the next step starts only once they are done (the engine's fixed point): that wait is
  ``disk_wait_s``. ``--model none`` uses it, so a whole trace's TTFT is estimated in seconds,
  and identically on every run: nothing here reads the wall clock.

Neither clock takes part in a structural decision (docs/design.md: nothing structural depends on
wall-clock time); they only stamp times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Protocol

from .errors import ConfigError

GB = 1e9

ClockKind = Literal["wall", "sim", "cpu"]
CLOCKS = ("auto", "wall", "sim", "cpu")

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
    """The flat cost model: compute tokens per second whatever the context, and copy GB/s
    (10**9 bytes) per tier link and direction (disk defaults: ``cost.DISK_DEFAULTS``)."""

    tokens_per_s: float
    h2d_gbps: float
    d2h_gbps: float
    disk_read_gbps: float = 1.31
    disk_write_gbps: float = 2.0

    def __post_init__(self) -> None:
        for name, flag in (
            ("tokens_per_s", "--sim-tokens-per-s"),
            ("h2d_gbps", "--sim-h2d-gbps"),
            ("d2h_gbps", "--sim-d2h-gbps"),
            ("disk_read_gbps", "--sim-disk-read-gbps"),
            ("disk_write_gbps", "--sim-disk-write-gbps"),
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
        disk_read_gbps: float | None = None,
        disk_write_gbps: float | None = None,
    ) -> CostModel:
        """The measured defaults for ``device``'s type, with any value given replacing its own."""
        from .cost.profile import DISK_DEFAULTS

        kind = device.split(":")[0]
        if kind not in COST_DEFAULTS:
            raise ConfigError(
                f"no measured cost model for device {device!r}; give --sim-tokens-per-s, "
                "--sim-h2d-gbps and --sim-d2h-gbps"
            )
        tps, h2d, d2h = COST_DEFAULTS[kind]
        read, write = DISK_DEFAULTS[kind]
        return cls(
            tokens_per_s=tps if tokens_per_s is None else tokens_per_s,
            h2d_gbps=h2d if h2d_gbps is None else h2d_gbps,
            d2h_gbps=d2h if d2h_gbps is None else d2h_gbps,
            disk_read_gbps=read if disk_read_gbps is None else disk_read_gbps,
            disk_write_gbps=write if disk_write_gbps is None else disk_write_gbps,
        )

    def step(
        self,
        requests: int,
        tokens: int,
        pairs: float,
        h2d_bytes: float,
        d2h_bytes: float,
        prefix_tokens: int = 0,
        prefix_pairs: float = 0.0,
    ) -> tuple[float, float]:
        """``(seconds, load-back wait)``: load-back in full before the compute (an upper bound),
        backups beside it."""
        load = h2d_bytes / (self.h2d_gbps * GB)
        compute = tokens / self.tokens_per_s
        return load + max(compute, d2h_bytes / (self.d2h_gbps * GB)), load


class StepCoster(Protocol):
    """What the simulated clock charges a step by: a :class:`CostModel` or a
    :class:`~kvstrata.cost.CostProfile`."""

    @property
    def disk_read_gbps(self) -> float: ...

    @property
    def disk_write_gbps(self) -> float: ...

    def step(
        self,
        requests: int,
        tokens: int,
        pairs: float,
        h2d_bytes: float,
        d2h_bytes: float,
        prefix_tokens: int = 0,
        prefix_pairs: float = 0.0,
    ) -> tuple[float, float]: ...


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one engine step did, for the clock to charge (and ``kvstrata calibrate`` to fit)."""

    computed_tokens: int
    h2d_bytes: int
    d2h_bytes: int
    load_wait_s: float  # the forward's measured wait for load-back copies (host clock)
    requests: int = 0  # requests with a chunk in the forward (0: the step ran none)
    attention_pairs: float = 0.0  # sum over them of extend x (prefix + extend / 2)
    prefix_tokens: int = 0  # sum over them of the prefix each chunk's attention reads
    prefix_pairs: float = 0.0  # the part of attention_pairs of requests over a prefix
    disk_read_bytes: int = 0  # landed this step: read while the step before ran
    disk_write_bytes: int = 0  # made durable this step: written while the step before ran


class Clock(Protocol):
    """Seconds since the run began, on one clock."""

    kind: ClockKind

    def now(self) -> float: ...

    def start(self) -> float:
        """Make now time zero; return the time counted before (the replay calls it once its
        engine is built, so arrivals count from when the engine can take requests)."""
        ...

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

    def start(self) -> float:
        before = self.now()
        self._origin += before
        return before

    def charge(self, work: StepWork) -> float:
        return work.load_wait_s

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class CpuClock:
    """The replay thread's CPU seconds (``time.thread_time``) since construction, and idle time
    jumped over: a CPU engine's steps take the CPU time they take, whatever other processes on
    a shared machine do, and waiting for the next arrival takes none (the clock jumps there).
    What ``kvstrata calibrate`` times on the CPU, so a CPU profile's predictions compare with it."""

    kind: ClockKind = "cpu"

    def __init__(self) -> None:
        self._origin = time.thread_time()
        self._idle = 0.0

    def now(self) -> float:
        return time.thread_time() - self._origin + self._idle

    def start(self) -> float:
        before = self.now()
        self._origin, self._idle = time.thread_time(), 0.0
        return before

    def charge(self, work: StepWork) -> float:
        return work.load_wait_s

    def wait_until(self, t: float) -> None:
        self._idle += max(0.0, t - self.now())


class SimClock:
    """Simulated seconds: only :meth:`charge` (a step's cost) and :meth:`wait_until` (idle until
    the next arrival) move it. ``byte_scale`` turns the engine's bytes into the modeled KV's
    (``--model none --model-shape``: the model's KV bytes per token over ``--kv-width``)."""

    kind: ClockKind = "sim"

    def __init__(self, model: StepCoster, byte_scale: float = 1.0) -> None:
        self.model = model
        self.byte_scale = byte_scale
        self._t = 0.0
        self._step_start = 0.0  # when the last step began (its I/O queued on the disk then)
        self._disk_free = 0.0  # when the disk finishes what was handed to it
        self.disk_wait_s = 0.0  # steps' waits for the disk, in total
        self.disk_busy_s = 0.0  # the disk's own time reading and writing, in total
        self.busy_s = 0.0  # steps' own time (neither idle nor waiting for the disk), in total

    def now(self) -> float:
        return self._t

    def start(self) -> float:
        """Time zero now (a replay builds its engine charging nothing: this moves nothing)."""
        before, self._t, self._step_start, self._disk_free = self._t, 0.0, 0.0, 0.0
        return before

    def charge(self, work: StepWork) -> float:
        m, scale = self.model, self.byte_scale
        start = self._t
        if work.disk_read_bytes or work.disk_write_bytes:
            # What landed at this step's settle was issued by the step before: it queued on the
            # disk when that step began, and this step could not begin before it was done.
            disk = scale * (
                work.disk_read_bytes / (m.disk_read_gbps * GB)
                + work.disk_write_bytes / (m.disk_write_gbps * GB)
            )
            self._disk_free = max(self._disk_free, self._step_start) + disk
            self.disk_busy_s += disk
            if self._disk_free > start:
                self.disk_wait_s += self._disk_free - start
                start = self._disk_free
        seconds, load = m.step(
            work.requests,
            work.computed_tokens,
            work.attention_pairs,
            scale * work.h2d_bytes,
            scale * work.d2h_bytes,
            work.prefix_tokens,
            work.prefix_pairs,
        )
        self._step_start = start
        self._t = start + seconds
        self.busy_s += seconds
        return load

    def wait_until(self, t: float) -> None:
        self._t = max(self._t, t)


def make_clock(kind: str, model_name: str, cost: StepCoster, byte_scale: float = 1.0) -> Clock:
    """The clock a replay runs on: ``auto`` is simulated with ``--model none`` (nothing measured
    would mean anything) and the wall clock with a model."""
    if kind not in CLOCKS:
        raise ConfigError(f"--clock must be one of {', '.join(CLOCKS)}, got {kind!r}")
    if kind == "sim" or (kind == "auto" and model_name == "none"):
        return SimClock(cost, byte_scale)
    if kind == "cpu":
        return CpuClock()
    return WallClock()
