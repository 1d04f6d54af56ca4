"""Each engine step of a replay as it ran on the replay's clock: :class:`StepLog`, an observer
that records one :class:`StepRecord` per step, and their JSONL.

A record says when the step began on the clock and how long it took (the wall or CPU clock: the
time it took; the simulated clock: what the cost model charged it, the disk wait included), what
it computed (requests, tokens, the cached prefix its chunks read, attention pairs), what it
copied (bytes of the modeled KV: with ``--model none`` the stored bytes times the clock's byte
scale, as the clock charges them), and what the loop did on the clock since the step before:
time idle waiting for the next arrival, and time adding requests to the engine. The rest of the
gap between two steps is the loop's own time (reading the workload, bookkeeping), which only a
measured clock pays. ``kvstrata bench planner-accuracy --steps-out DIR`` writes both replays'
records and compares them (:mod:`kvstrata.benchmarks.planner_steps`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..clock import StepWork
from ..errors import ConfigError
from .state import ReplayRun

#: A step's kind, from what its forward computed: ``none`` (no forward: the step only settled
#: copies, or admitted nothing), ``fresh`` (one request from its first token), ``prefix`` (one
#: request over a prefix already in its pages: cached, or its own earlier chunks), ``batch``
#: (several requests); ``+load`` when it also loaded a cached prefix back host -> device. Backups
#: device -> host are not a kind of their own: with an L2 nearly every step makes them.
STEP_KINDS = (
    "none", "fresh", "prefix", "batch", "fresh+load", "prefix+load", "batch+load",
)  # fmt: skip


def step_kind(work: StepWork) -> str:
    if work.requests == 0:
        return "none"
    kind = "batch" if work.requests > 1 else "prefix" if work.prefix_tokens else "fresh"
    return kind + "+load" if work.h2d_bytes else kind


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step on the replay's clock (seconds; bytes of the modeled KV)."""

    step: int  # 0, 1, ... in the order the engine ran them
    start_s: float  # when it began
    seconds: float  # how long it lasted (measured, or charged by the cost model)
    idle_before_s: float  # the loop's time idle, waiting for an arrival, since the step before
    add_before_s: float  # the loop's time adding requests to the engine since the step before
    kind: str  # STEP_KINDS
    requests: int  # requests with a chunk in the forward
    tokens: int  # tokens computed
    prefix_tokens: int  # sum over its chunks of the prefix each one's attention reads
    pairs: float  # attention pairs: sum of extend x (prefix + extend / 2)
    prefix_pairs: float  # the part of them of requests over a prefix
    h2d_bytes: float
    d2h_bytes: float
    disk_read_bytes: float
    disk_write_bytes: float
    load_wait_s: float  # the step's wait for load-back copies
    waiting: int  # requests queued after the step
    running: int  # requests with chunks left after the step
    finished: int  # requests finished (or refused) so far

    @property
    def end_s(self) -> float:
        return self.start_s + self.seconds

    def work(self) -> StepWork:
        """What the step did, as the clock charged it (bytes of the modeled KV)."""
        return StepWork(
            computed_tokens=self.tokens,
            h2d_bytes=round(self.h2d_bytes),
            d2h_bytes=round(self.d2h_bytes),
            load_wait_s=self.load_wait_s,
            requests=self.requests,
            attention_pairs=self.pairs,
            prefix_tokens=self.prefix_tokens,
            prefix_pairs=self.prefix_pairs,
            disk_read_bytes=round(self.disk_read_bytes),
            disk_write_bytes=round(self.disk_write_bytes),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class StepLog:
    """A :class:`~kvstrata.replay.state.ReplayObserver` that records every engine step.

    ``startup_s`` is what the clock had counted when the replay loop began and started it
    again at zero (:meth:`~kvstrata.clock.Clock.start`): building the engine, its pools and
    tiers. ``loop_start_s`` is the clock's time when the observer saw the loop begin (zero,
    unless something ran between)."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.loop_start_s = 0.0
        self.startup_s = 0.0
        self.end_s = 0.0  # the clock's time after the final drain
        self._idle = self._add = 0.0  # the run's idle and add time at the last step

    def on_start(self, run: ReplayRun) -> None:
        self.loop_start_s = run.clock.now()
        self.startup_s = run.startup_s
        self._idle, self._add = run.idle_s, run.add_s

    def on_step(self, run: ReplayRun) -> None:
        began, ended = run.step_span
        work, engine = run.engine.last_work, run.engine
        scale = run.cost.byte_scale if run.cost is not None else 1.0
        self.records.append(
            StepRecord(
                step=len(self.records),
                start_s=began,
                seconds=ended - began,
                idle_before_s=run.idle_s - self._idle,
                add_before_s=run.add_s - self._add,
                kind=step_kind(work),
                requests=work.requests,
                tokens=work.computed_tokens,
                prefix_tokens=work.prefix_tokens,
                pairs=work.attention_pairs,
                prefix_pairs=work.prefix_pairs,
                h2d_bytes=work.h2d_bytes * scale,
                d2h_bytes=work.d2h_bytes * scale,
                disk_read_bytes=work.disk_read_bytes * scale,
                disk_write_bytes=work.disk_write_bytes * scale,
                load_wait_s=work.load_wait_s,
                waiting=len(engine.waiting),
                running=len(engine.running),
                finished=run.tally.requests,
            )
        )
        self._idle, self._add = run.idle_s, run.add_s

    def on_end(self, run: ReplayRun) -> None:
        self.end_s = run.clock.now()


def write_steps(
    records: list[StepRecord],
    path: Path,
    extra: Callable[[StepRecord], dict[str, Any]] | None = None,
) -> Path:
    """``records`` as JSONL, one step a line, each with the fields ``extra`` gives it added, in
    a new file (one already at ``path`` is refused, not overwritten)."""
    try:
        with path.open("x") as f:
            for record in records:
                f.write(json.dumps(record.to_json() | (extra(record) if extra else {})) + "\n")
    except FileExistsError:
        raise ConfigError(f"the step log {path} exists already; give another path") from None
    except OSError as err:
        raise ConfigError(f"cannot write the step log {path}: {err.strerror}") from None
    return path


def read_steps(path: Path) -> list[StepRecord]:
    """The records :func:`write_steps` wrote (fields it added are dropped)."""
    names = set(StepRecord.__dataclass_fields__)
    with path.open() as f:
        return [
            StepRecord(**{k: v for k, v in json.loads(line).items() if k in names})
            for line in f
            if line.strip()
        ]
