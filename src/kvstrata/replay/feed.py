"""The workload feed: rank 0 opens the workload and decides when each request arrives; every
rank adds the same requests at the same step."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import NamedTuple

from ..arrivals import ArrivalSpec, ArrivalTimes
from ..clock import Clock
from ..dist.group import Group
from ..errors import ConfigError
from ..workloads import Request, Workload, load_workload
from .config import ReplayConfig


class WorkloadSource(NamedTuple):
    """An opened workload: what rank 0 reads (``workload`` is None on the other ranks, whose
    ``requests`` come from rank 0) and when its requests arrive."""

    workload: Workload | None
    requests: Iterator[Request] | None
    arrivals: ArrivalSpec


def open_workload(
    cfg: ReplayConfig, group: Group, vocab_size: int, max_tokens: int
) -> WorkloadSource:
    """Open ``cfg.workload`` on rank 0 and read its first request, so that one that cannot be
    opened, or has no request, fails before anything large is built; a request longer than
    ``max_tokens`` is refused before its tokens are expanded."""
    if group.rank != 0:  # rank 0 decides when requests arrive; the others only stamp what it sends
        return WorkloadSource(None, iter(()), ArrivalSpec("burst", None, cfg.arrivals.time_scale))
    workload = load_workload(
        cfg.workload,
        limit=cfg.limit,
        vocab_size=vocab_size,
        on_error=cfg.on_error,
        max_tokens=max_tokens,
    )
    stream = iter(workload)
    first = next(stream, None)  # an empty (or wholly malformed) workload fails early
    if first is None:
        skipped = (
            f" ({workload.num_skipped} malformed lines skipped)" if workload.num_skipped else ""
        )
        raise ConfigError(f"workload {cfg.workload!r} has no requests{skipped}")
    return WorkloadSource(workload, itertools.chain([first], stream), cfg.arrivals.resolve(first))


class Feed:
    """Hands the replay the requests that have arrived, the same ones on every rank.

    Rank 0 reads the workload, gives each request its arrival time, and decides by its clock
    which have arrived; under context parallelism it broadcasts them, with their arrival times
    and when the next one comes, so every rank adds the same requests at the same step.
    """

    def __init__(self, group: Group, source: WorkloadSource, seed: int, clock: Clock) -> None:
        self.group = group
        self.requests = source.requests
        self.arrival_times = ArrivalTimes(source.arrivals, seed)
        self.clock = clock
        self.pending: tuple[Request, float] | None = None  # read, not arrived yet
        self.more = True

    def take(self, count: int, idle: bool) -> tuple[list[tuple[Request, float]], float | None]:
        """Up to ``count`` arrived requests with their arrival times, and, when the engine is
        ``idle`` and none has arrived, when the next one does (None: no more requests).
        ``count`` and ``idle`` come from replicated state, so every rank calls this at the
        same points."""
        batch: list[tuple[Request, float]] = []
        wake: float | None = None
        if self.group.rank == 0:
            while len(batch) < count:
                if self.pending is None:
                    request = next(self.requests, None) if self.requests is not None else None
                    if request is None:
                        self.requests = None
                        break
                    self.pending = (request, self.arrival_times.next(request))
                if self.pending[1] > self.clock.now():
                    break
                batch.append(self.pending)
                self.pending = None
            self.more = self.pending is not None or self.requests is not None
            if idle and not batch and self.pending is not None:
                wake = self.pending[1]
        if self.group.size == 1:
            return batch, wake
        sent = self.group.broadcast_object(
            ([(r.rid, r.tokens, r.arrival_ms, t) for r, t in batch], wake, self.more), "workload"
        )
        self.more = sent[2]
        return [(Request(rid, tok, ms), t) for rid, tok, ms, t in sent[0]], sent[1]
