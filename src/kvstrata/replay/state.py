"""A replay in progress: what observers see (:class:`ReplayRun`), the running totals that stand in
for the finished requests (:class:`_Tally`), and the time spent in the engine."""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from ..clock import Clock
from ..engine import Engine, Finished
from ..metrics import CacheMetrics, RequestTotals
from .config import ReplayConfig

if TYPE_CHECKING:
    from .cost import SimCost

#: Failed requests and skipped trace lines a summary lists by message (the counts are complete).
LISTED_ERRORS = 20


def percentiles(values: Sequence[float] | np.ndarray, mean: bool = False) -> dict[str, float]:
    """p50/p90/p99 (and the mean) of seconds, in ms rounded to the µs."""
    out = {"mean": 0.0} if mean else {}
    if not len(values):
        return out | {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    ms = np.asarray(values, dtype=np.float64) * 1e3
    q = np.percentile(ms, [50, 90, 99])
    if mean:
        out["mean"] = round(float(ms.mean()), 3)
    return out | {
        "p50": round(float(q[0]), 3),
        "p90": round(float(q[1]), 3),
        "p99": round(float(q[2]), 3),
    }


@dataclass
class _Tally:
    """The aggregates a summary needs, so that no finished request has to be kept."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    l2_cached_tokens: int = 0  # loaded back from L2, L3's reloads included
    l3_cached_tokens: int = 0
    prompt_sq: int = 0  # sums of squares: attention pairs without the cache and saved by it
    cached_sq: int = 0
    # Per served request (25 bytes each): TTFT, its queue and load-back parts, whether it hit.
    ttft_s: array[float] = field(default_factory=lambda: array("d"))
    queue_s: array[float] = field(default_factory=lambda: array("d"))
    load_wait_s: array[float] = field(default_factory=lambda: array("d"))
    hit: array[int] = field(default_factory=lambda: array("b"))
    errors: list[str] = field(default_factory=list)  # the first LISTED_ERRORS

    def add(self, f: Finished) -> None:
        self.requests += 1
        if f.error is not None:
            self.failed += 1
            if len(self.errors) < LISTED_ERRORS:
                self.errors.append(f.error)
            return
        self.prompt_tokens += f.prompt_len
        self.cached_tokens += f.cached_len
        self.computed_tokens += f.computed_len
        self.l2_cached_tokens += f.host_len
        self.l3_cached_tokens += f.disk_len
        self.prompt_sq += f.prompt_len * f.prompt_len
        self.cached_sq += f.cached_len * f.cached_len
        self.ttft_s.append(f.ttft_s)
        self.queue_s.append(f.queue_s)
        self.load_wait_s.append(f.load_wait_s)
        self.hit.append(f.cached_len > 0)

    def totals(self) -> RequestTotals:
        return RequestTotals(
            self.requests, self.failed, self.prompt_tokens, self.cached_tokens, self.computed_tokens
        )

    def ttft_parts_ms(self) -> dict[str, dict[str, float]]:
        ttft, queue, load = (
            np.frombuffer(a, dtype=np.float64)
            for a in (self.ttft_s, self.queue_s, self.load_wait_s)
        )
        return {
            "queue": percentiles(queue, mean=True),
            "load_back": percentiles(load, mean=True),
            "compute": percentiles(ttft - queue - load, mean=True),
        }

    def ttft_by_hit_ms(self) -> dict[str, dict[str, float]]:
        ttft = np.frombuffer(self.ttft_s, dtype=np.float64)
        hit = np.frombuffer(self.hit, dtype=np.int8).astype(bool)
        return {
            name: {"requests": int(mask.sum())} | percentiles(ttft[mask], mean=True)
            for name, mask in (("cached", hit), ("recomputed", ~hit))
        }


class EngineTimer:
    """Wall and CPU time (of the calling thread) spent in the engine: the CPU time is the
    steadier figure on a machine other processes share."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self._wall = self._cpu = 0.0

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def stop(self) -> None:
        self.wall_s += time.perf_counter() - self._wall
        self.cpu_s += time.thread_time() - self._cpu


class Driven(NamedTuple):
    """How the run loop ended: interrupted or not, the time spent in the engine, and the
    requests read from the workload."""

    interrupted: bool
    timer: EngineTimer
    read: int


class ReplayObserver(Protocol):
    """Watches a replay: the report's timeline and tests plug in here. Called outside the
    engine lock, from the replay's own thread."""

    def on_start(self, run: ReplayRun) -> None: ...

    def on_step(self, run: ReplayRun) -> None: ...

    def on_end(self, run: ReplayRun) -> None:
        """After the last step and the final drain; the metrics endpoint still serves."""
        ...


@dataclass
class ReplayRun:
    """A replay in progress: what observers see."""

    config: ReplayConfig
    engine: Engine
    tally: _Tally
    clock: Clock
    lock: threading.Lock  # held around every engine call; a metrics scrape takes it too
    metrics_url: str | None = None
    metrics: CacheMetrics | None = None  # the collector, while metrics are served
    cost: SimCost | None = None  # the simulated clock's cost model (None on the wall clock)
    # On the replay's clock, from the loop's start: when the last engine step began and ended,
    # and the loop's time so far idle (waiting for the next arrival) and adding requests to the
    # engine (replay/steps.py).
    step_span: tuple[float, float] = (0.0, 0.0)
    startup_s: float = 0.0  # what the clock had counted when the loop began (clock.start())
    idle_s: float = 0.0
    add_s: float = 0.0
