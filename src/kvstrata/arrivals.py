"""When each request arrives, in seconds on the engine's clock (``kvstrata replay --arrivals``).

============  =======================================================================================
``trace``     the trace's own timestamps (``arrival_ms``), from the first request's; the default
              when the workload has them (Mooncake traces, ``agentic``)
``burst``     every request at time 0: the engine takes them as fast as it can (read ahead at most
              ``--lookahead``); the default for workloads without timestamps (``builtin``,
              ``synthetic``)
``poisson:R`` a Poisson process of R requests per second: exponential gaps drawn from
              ``numpy.random.PCG64(seed)``, the same on every run
============  =======================================================================================

``--time-scale X`` multiplies every arrival time by X (0.5: the same trace twice as fast). Requests
keep the workload's order: a trace timestamp earlier than its predecessor's arrives with it (a
trace's order is the order a server received it in). A gap between two arrivals of more than
:data:`MAX_GAP_S` (a day) is refused, naming the request: it is a timestamp in other units or a
broken line far more often than a day of silence, and on the wall clock the replay would sleep
through it (10^12 ms is 31 years); ``--time-scale`` brings a real one in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError
from .workloads import Request

ARRIVAL_KINDS = ("trace", "burst", "poisson")
#: The longest gap between two consecutive arrivals (after ``--time-scale``), in seconds.
MAX_GAP_S = 86_400.0


@dataclass(frozen=True)
class ArrivalSpec:
    """A parsed ``--arrivals`` value: ``kind`` is trace, burst or poisson (with ``rate`` > 0
    requests per second); None picks trace or burst from the workload (:meth:`resolve`)."""

    kind: str | None = None
    rate: float | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in ARRIVAL_KINDS:
            raise ConfigError(f"--arrivals must be trace, burst or poisson:RATE, got {self.kind!r}")
        if (self.kind == "poisson") != (self.rate is not None):
            raise ConfigError("--arrivals poisson takes a rate (poisson:RATE); no other kind does")
        if self.rate is not None and not 0 < self.rate < float("inf"):
            raise ConfigError(
                f"--arrivals poisson:RATE needs a rate > 0 requests per second, got {self.rate!r}"
            )
        if not 0 < self.time_scale < float("inf"):
            raise ConfigError(f"--time-scale must be a number > 0, got {self.time_scale!r}")

    @classmethod
    def parse(cls, text: str | None, time_scale: float = 1.0) -> ArrivalSpec:
        """``trace``, ``burst``, ``poisson:RATE`` or None (pick from the workload)."""
        if text is None:
            return cls(None, None, time_scale)
        kind, sep, rate = text.partition(":")
        if kind != "poisson" or not sep:
            if sep:
                raise ConfigError(f"--arrivals {kind} takes no rate, got {text!r}")
            return cls(kind, None, time_scale)
        try:
            value = float(rate)
        except ValueError:
            raise ConfigError(
                f"--arrivals poisson:RATE needs a number of requests per second, got {rate!r}"
            ) from None
        return cls("poisson", value, time_scale)

    def resolve(self, first: Request) -> ArrivalSpec:
        """The spec with its kind decided: ``trace`` if the workload's first request has a
        timestamp, else ``burst``; ``trace`` asked of a workload without timestamps is refused."""
        has_times = first.arrival_ms is not None
        if self.kind == "trace" and not has_times:
            raise ConfigError(
                "--arrivals trace needs a workload with timestamps (a Mooncake trace or "
                "agentic); this one has none: use burst or poisson:RATE"
            )
        if self.kind is not None:
            return self
        return ArrivalSpec("trace" if has_times else "burst", None, self.time_scale)

    def describe(self) -> str:
        kind = f"poisson:{self.rate:g}" if self.kind == "poisson" else str(self.kind)
        return kind if self.time_scale == 1.0 else f"{kind} x{self.time_scale:g}"


class ArrivalTimes:
    """Hands out each request's arrival time, in workload order (a resolved spec)."""

    def __init__(self, spec: ArrivalSpec, seed: int) -> None:
        assert spec.kind is not None, "resolve() the spec against the workload first"
        self.spec = spec
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._origin_ms: int | None = None
        self._last = 0.0

    def next(self, request: Request) -> float:
        """The arrival time of ``request``, the next request of the workload, in seconds."""
        spec = self.spec
        if spec.kind == "burst":
            return 0.0
        if spec.kind == "poisson":
            assert spec.rate is not None
            t = self._last + float(self._rng.exponential(1.0 / spec.rate)) * spec.time_scale
        else:
            if request.arrival_ms is None:
                raise ConfigError(
                    f"request {request.rid} has no timestamp, but --arrivals trace needs one on "
                    "every request"
                )
            if self._origin_ms is None:
                self._origin_ms = request.arrival_ms
            t = max(self._last, (request.arrival_ms - self._origin_ms) / 1e3 * spec.time_scale)
        if not t - self._last <= MAX_GAP_S:  # also NaN and inf
            stamp = f" (timestamp {request.arrival_ms} ms)" if spec.kind == "trace" else ""
            raise ConfigError(
                f"request {request.rid}{stamp} arrives {t - self._last:.3g} s after the one "
                f"before it, more than a day: a timestamp in other units? --time-scale "
                f"{MAX_GAP_S / (t - self._last) * spec.time_scale:.2g} or less brings it within "
                "a day, or --arrivals burst ignores the timestamps"
            )
        self._last = t
        return t
