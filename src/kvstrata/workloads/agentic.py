"""The ``agentic[:SEED[:N]]`` workload: long agentic coding sessions, generated lazily.

An agent re-sends its whole context on every turn and appends what happened since: its own reply
(a tool call) and the tool's output. Contexts therefore grow to 100K tokens while each request adds
only a little, sessions overlap by the hundred, and sub-agents fork from their parent's context.
The shape (:class:`AgenticShape`, defaults):

* **Prefixes.** Every session opens with one system prompt (6,000 tokens, shared by all), then one
  of four tool-definition blocks (2,000 / 4,000 / 6,000 / 10,000 tokens, picked 50 / 25 / 15 / 10 %
  of the time), then the user's task (300-3,000 tokens).
* **Turns.** Each turn appends the agent's reply (20-400 tokens) and a tool output, heavy-tailed:
  80 % small (20-1,000 tokens: a grep, a test result), 16 % medium (1,000-5,000: a file read),
  4 % large (5,000-20,000: a whole file, a build log). A session ends before the turn that would
  take it past its target length, drawn uniformly in 20,000-150,000 tokens.
* **Sub-agents.** After a turn, with probability 3 %, the session delegates: its context grows by
  the delegation message (100-800 tokens) and a sub-agent starts from that whole context, runs 3-12
  turns of its own, and ends; the parent waits, then continues with the sub-agent's summary
  (200-2,000 tokens). Sub-agents do not delegate further.
* **Time.** ``arrival_ms`` is each request's arrival. A session's next request comes after the
  agent's reply (25 ms per reply token) and the tool's run (50 ms-20 s), plus, 10 % of the time, a
  human think gap (5 s-5 min). 256 sessions are open at once: the first ones send their next
  request within the first minute, and each one that ends is replaced by a new one 1-60 s later.
  Requests come out in arrival order (ties: the one scheduled first).
* **No warm-up.** The sessions open when the trace begins are already under way: each has run a
  uniform share of its way to its target (turns drawn as above, sent before the trace began), so
  the workload looks the same from its first request on, whatever ``N``.

Sizes and durations within a range are log-uniform (many small, a few large), except the target
length (uniform). ``kvstrata bench workload --trace agentic`` measures the resulting statistics.

Determinism: the structure comes from ``Generator(PCG64([seed, 0]))``, the token ids from the raw
outputs of ``PCG64([seed, 1])`` mapped as trace blocks are (high 32 bits modulo the vocabulary), so
the same seed gives the same requests everywhere and the structure does not depend on the
vocabulary. Nothing uses ``hash()`` or the clock.

Laziness: :func:`generate` is a generator; its state is the open sessions' token arrays. A request's
tokens are a read-only view of its session's array (no copy); the array only ever grows past it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, WorkloadError

TokenArray = npt.NDArray[np.uint32]
Range = tuple[int, int]

#: Requests in ``agentic`` and ``agentic:SEED`` (``agentic:SEED:N`` sets it).
DEFAULT_REQUESTS = 20_000


@dataclass(frozen=True)
class AgenticShape:
    """What the sessions look like. Token counts are per block; ``(lo, hi)`` ranges are inclusive
    and drawn log-uniform, except ``target_tokens`` (uniform)."""

    sessions: int = 256  # top-level sessions open at once
    system_tokens: int = 6_000
    toolset_tokens: tuple[int, ...] = (2_000, 4_000, 6_000, 10_000)
    toolset_weights: tuple[float, ...] = (0.50, 0.25, 0.15, 0.10)
    task_tokens: Range = (300, 3_000)
    target_tokens: Range = (20_000, 150_000)
    reply_tokens: Range = (20, 400)
    tool_tokens: tuple[Range, ...] = ((20, 1_000), (1_000, 5_000), (5_000, 20_000))
    tool_weights: tuple[float, ...] = (0.80, 0.16, 0.04)
    subagent_probability: float = 0.03
    subagent_turns: Range = (3, 12)
    delegation_tokens: Range = (100, 800)
    summary_tokens: Range = (200, 2_000)
    ms_per_reply_token: int = 25
    tool_ms: Range = (50, 20_000)
    think_probability: float = 0.10
    think_ms: Range = (5_000, 300_000)
    start_spread_ms: int = 60_000
    start_under_way: bool = True  # the first sessions have run part of the way to their target
    restart_ms: Range = (1_000, 60_000)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_weights"):
                if len(value) == 0 or min(value) < 0 or not math.isclose(sum(value), 1.0):
                    raise ConfigError(f"{f.name} must be weights >= 0 summing to 1, got {value}")
            elif f.name == "start_under_way":
                if not isinstance(value, bool):
                    raise ConfigError(f"start_under_way must be a bool, got {value!r}")
            elif f.name.endswith("_probability"):
                if not 0.0 <= value <= 1.0:
                    raise ConfigError(f"{f.name} must lie in [0, 1], got {value}")
            elif f.name in ("toolset_tokens", "tool_tokens"):
                for item in value:
                    _check_size(f.name, item)
            else:
                _check_size(f.name, value)
        if len(self.toolset_tokens) != len(self.toolset_weights):
            raise ConfigError("toolset_tokens and toolset_weights must have the same length")
        if len(self.tool_tokens) != len(self.tool_weights):
            raise ConfigError("tool_tokens and tool_weights must have the same length")

    def scaled(self, factor: float) -> AgenticShape:
        """The same shape with every token count multiplied by ``factor`` (at least 1 token);
        times, probabilities and the number of sessions unchanged. Tests use small scales."""

        def scale(n: int) -> int:
            return max(1, round(n * factor))

        def scale_range(r: Range) -> Range:
            return scale(r[0]), scale(r[1])

        return replace(
            self,
            system_tokens=scale(self.system_tokens),
            toolset_tokens=tuple(scale(n) for n in self.toolset_tokens),
            task_tokens=scale_range(self.task_tokens),
            target_tokens=scale_range(self.target_tokens),
            reply_tokens=scale_range(self.reply_tokens),
            tool_tokens=tuple(scale_range(r) for r in self.tool_tokens),
            delegation_tokens=scale_range(self.delegation_tokens),
            summary_tokens=scale_range(self.summary_tokens),
        )


def _check_size(name: str, value: object) -> None:
    """A count >= 0, or a range ``(lo, hi)`` with ``0 < lo <= hi`` (``sessions`` >= 1)."""
    if isinstance(value, tuple):
        ok = len(value) == 2 and all(isinstance(v, int) for v in value) and 0 < value[0] <= value[1]
        if not ok:
            raise ConfigError(f"{name} must be a range (lo, hi) with 0 < lo <= hi, got {value}")
    elif not isinstance(value, int) or value < (1 if name == "sessions" else 0):
        raise ConfigError(f"{name} must be an integer >= 0 (sessions >= 1), got {value!r}")


class AgenticRequest(NamedTuple):
    """One generated request: its tokens (a read-only view), arrival time, session and the
    session it was forked from (``-1`` for a top-level session)."""

    tokens: TokenArray
    arrival_ms: int
    session: int
    parent: int


def _token_buffer(num_tokens: int) -> TokenArray:
    """A uint32 array in its own anonymous memory map: capacity never written costs no memory,
    and the whole map goes back to the OS once the last view of it is gone (a heap allocation
    of this size would leave its pages behind in the allocator, and RSS would creep)."""
    return np.frombuffer(mmap.mmap(-1, 4 * max(num_tokens, 1)), dtype=np.uint32)


class _Context:
    """A session's tokens so far, in an array that grows by half when full."""

    __slots__ = ("buf", "length")

    def __init__(self, capacity: int) -> None:
        self.buf: TokenArray = _token_buffer(capacity)
        self.length = 0

    def extend(self, tokens: TokenArray) -> None:
        end = self.length + tokens.size
        if end > self.buf.size:
            grown = _token_buffer(max(end, self.buf.size * 3 // 2))
            grown[: self.length] = self.buf[: self.length]
            self.buf = grown
        # Only [length, end) is written: every view handed out before stays unchanged.
        self.buf[self.length : end] = tokens
        self.length = end

    def view(self) -> TokenArray:
        view = self.buf[: self.length]
        view.flags.writeable = False
        return view


@dataclass(eq=False)
class _Session:
    id: int
    parent: _Session | None
    context: _Context
    limit: int  # the session ends before a turn that would take it past this many tokens
    turns_left: int  # sub-agents only (-1: a top-level session)
    requests: int = 0
    summary_due: bool = False  # a sub-agent just returned: the next turn appends its summary


def generate(
    seed: int, n_requests: int, vocab_size: int, shape: AgenticShape | None = None
) -> Iterator[AgenticRequest]:
    """Yield ``n_requests`` requests of agentic sessions (see the module docstring), lazily."""
    shape = shape or AgenticShape()
    rng = np.random.Generator(np.random.PCG64([seed, 0]))
    bits = np.random.PCG64([seed, 1])
    toolset_cum = list(itertools.accumulate(shape.toolset_weights))
    tool_cum = list(itertools.accumulate(shape.tool_weights))

    def fresh(num_tokens: int) -> TokenArray:
        raw = bits.random_raw(num_tokens)
        return ((raw >> np.uint64(32)) % np.uint64(vocab_size)).astype(np.uint32)

    def log_uniform(r: Range) -> int:
        lo, hi = r
        return min(hi, int(lo * (hi / lo) ** rng.random()))

    def pick(cumulative: list[float]) -> int:
        return min(bisect.bisect_right(cumulative, rng.random()), len(cumulative) - 1)

    def turn_tokens() -> TokenArray:
        reply = log_uniform(shape.reply_tokens)
        return fresh(reply + log_uniform(shape.tool_tokens[pick(tool_cum)]))

    def gap_ms() -> int:
        reply_ms = log_uniform(shape.reply_tokens) * shape.ms_per_reply_token
        think = log_uniform(shape.think_ms) if rng.random() < shape.think_probability else 0
        return reply_ms + log_uniform(shape.tool_ms) + think

    system = fresh(shape.system_tokens)
    toolsets = [fresh(n) for n in shape.toolset_tokens]
    heap: list[tuple[int, int, _Session]] = []
    order = itertools.count()  # breaks ties between equal arrival times: first scheduled first
    session_ids = itertools.count()

    def schedule(at_ms: int, session: _Session) -> None:
        heapq.heappush(heap, (at_ms, next(order), session))

    def open_session(at_ms: int, under_way: bool = False) -> None:
        target = int(rng.integers(shape.target_tokens[0], shape.target_tokens[1] + 1))
        # Room for the whole session up front (a delegation message may pass the target): one
        # array per session, whose untouched tail costs no memory until written.
        context = _Context(target + shape.delegation_tokens[1])
        context.extend(system)
        context.extend(toolsets[pick(toolset_cum)])
        context.extend(fresh(log_uniform(shape.task_tokens)))
        if under_way:  # the turns it ran before the trace began
            stop = context.length + int(rng.random() * max(0, target - context.length))
            while context.length + (tokens := turn_tokens()).size <= stop:
                context.extend(tokens)
        schedule(at_ms, _Session(next(session_ids), None, context, target, -1))

    def fork(parent: _Session, at_ms: int) -> None:
        parent.context.extend(fresh(log_uniform(shape.delegation_tokens)))
        context = _Context(parent.context.length + parent.limit // 4)
        context.extend(parent.context.view())
        turns = int(rng.integers(shape.subagent_turns[0], shape.subagent_turns[1] + 1))
        limit = shape.target_tokens[1]
        child = _Session(next(session_ids), parent, context, limit, turns)
        schedule(at_ms + gap_ms(), child)

    def close(session: _Session, at_ms: int) -> None:
        parent = session.parent
        if parent is None:
            open_session(at_ms + log_uniform(shape.restart_ms))
        else:
            parent.summary_due = True
            schedule(at_ms + gap_ms(), parent)

    for _ in range(shape.sessions):
        at_ms = int(rng.integers(0, shape.start_spread_ms + 1))
        open_session(at_ms, under_way=shape.start_under_way)
    emitted = 0
    while emitted < n_requests:
        now, _, session = heapq.heappop(heap)
        if session.requests:
            if session.summary_due:
                session.summary_due = False
                tokens = fresh(log_uniform(shape.summary_tokens))
            else:
                tokens = turn_tokens()
            if session.context.length + tokens.size > session.limit:
                close(session, now)
                continue
            session.context.extend(tokens)
        parent_id = session.parent.id if session.parent is not None else -1
        yield AgenticRequest(session.context.view(), now, session.id, parent_id)
        emitted += 1
        session.requests += 1
        if session.parent is not None:
            session.turns_left -= 1
            if session.turns_left == 0:
                close(session, now)
            else:
                schedule(now + gap_ms(), session)
        elif rng.random() < shape.subagent_probability:
            fork(session, now)  # the parent waits until the sub-agent closes
        else:
            schedule(now + gap_ms(), session)


def parse_spec(spec: str) -> tuple[int, int]:
    """``agentic[:SEED[:N]]`` -> ``(seed, n_requests)``; defaults seed 0, :data:`DEFAULT_REQUESTS`.
    Anything else raises :class:`WorkloadError`."""
    name, *parts = spec.split(":")
    if (
        name != "agentic"
        or len(parts) > 2
        or not all(p.isascii() and p.isdigit() for p in parts)
        or (len(parts) == 2 and int(parts[1]) < 1)
    ):
        raise WorkloadError(
            f"bad agentic workload {spec!r}: expected agentic, agentic:SEED or agentic:SEED:N "
            "(N >= 1)"
        )
    seed = int(parts[0]) if parts else 0
    n_requests = int(parts[1]) if len(parts) == 2 else DEFAULT_REQUESTS
    return seed, n_requests
