"""What a replay looked like over time: the samples behind ``kvstrata replay --report``'s plots.

:class:`Timeline` is a replay observer. After engine steps it records, on the engine's clock, the
finished requests' totals (prompt tokens, hit tokens by tier: L1, L2, L3), the pages each tier
(the disk tier's slots included) holds and the
bytes copied each way. It keeps at most ``max_points`` samples (and the final one) whatever the
replay's length: every
step at first; when full, every other sample is dropped and the stride between samples doubles,
so the samples stay evenly spaced in steps. At the end it copies each served request's TTFT and
whether it hit the cache (for the TTFT distribution).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from .replay import ReplayRun

COLUMNS = (
    "step",
    "clock_s",
    "requests",
    "prompt_tokens",
    "l1_hit_tokens",
    "l2_hit_tokens",
    "l3_hit_tokens",
    "l1_pages_used",
    "l2_pages_used",
    "l3_pages_used",
    "d2h_bytes",
    "h2d_bytes",
)
MAX_POINTS = 2048


class Timeline:
    """Samples a replay as it runs (a :class:`~kvstrata.replay.ReplayObserver`)."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        assert max_points >= 2 and max_points % 2 == 0, max_points
        self.max_points = max_points
        self.stride = 1
        self.columns: dict[str, array[float]] = {c: array("d") for c in COLUMNS}
        self.l1_pages = 0
        self.l2_pages = 0
        self.l3_pages = 0  # the disk tier's slots (0: no L3)
        self.clock_kind = "wall"
        self.ttft_s: npt.NDArray[np.float64] = np.empty(0)
        self.hit: npt.NDArray[np.bool_] = np.empty(0, dtype=np.bool_)

    def on_start(self, run: ReplayRun) -> None:
        engine = run.engine
        self.l1_pages = engine.cache.allocator.num_pages
        self.l2_pages = engine.cache.host_allocator.num_pages if engine.cache.host_allocator else 0
        self._disk = engine.cache.disk_store  # the shared tier in its place has none
        self.l3_pages = self._disk.num_slots if self._disk is not None else 0
        self.clock_kind = run.clock.kind
        self._record(run)

    def on_step(self, run: ReplayRun) -> None:
        steps = run.engine.steps
        if steps % self.stride == 0 and self.columns["step"][-1] != steps:
            self._record(run)

    def on_end(self, run: ReplayRun) -> None:
        if self.columns["step"][-1] != run.engine.steps:
            self._record(run, final=True)
        self.ttft_s = np.frombuffer(run.tally.ttft_s, dtype=np.float64).copy()
        self.hit = np.frombuffer(run.tally.hit, dtype=np.int8).astype(np.bool_)

    def _record(self, run: ReplayRun, final: bool = False) -> None:
        """Append a sample; when that fills the timeline (unless it is the final one, which is
        always kept), drop every other sample and double the stride."""
        engine, tally = run.engine, run.tally
        stats = engine.cache.transfer_stats()
        host = engine.cache.host_allocator
        row = (
            engine.steps,
            run.clock.now(),
            tally.requests,
            tally.prompt_tokens,
            tally.cached_tokens - tally.l2_cached_tokens,
            tally.l2_cached_tokens - tally.l3_cached_tokens,
            tally.l3_cached_tokens,
            engine.cache.allocator.num_used,
            host.num_used if host is not None else 0,
            self._disk.pool.num_used if self._disk is not None else 0,
            stats.d2h_bytes if stats else 0,
            stats.h2d_bytes if stats else 0,
        )
        for name, value in zip(COLUMNS, row, strict=True):
            self.columns[name].append(float(value))
        if not final and len(self.columns["step"]) >= self.max_points:
            for name in COLUMNS:  # keep samples 0, 2, 4, ...: evenly spaced at twice the stride
                self.columns[name] = self.columns[name][::2]
            self.stride *= 2

    def column(self, name: str) -> npt.NDArray[np.float64]:
        return np.frombuffer(self.columns[name], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.columns["step"])
