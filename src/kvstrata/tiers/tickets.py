"""Copy tickets and the commit frontier (docs/design.md, "Replicated state").

Every asynchronous copy batch (a step's write-through, a request's load-back) gets the next ticket
number from one :class:`TicketLedger`. Numbers are handed out in replicated order, so ticket ``t``
means the same batch on every rank. Copies *finish* per rank at their own pace; they *take effect*
only when the commit frontier covers them::

    tickets issued       1  2  3  4  5  6
    finished here        1  2  .  4  5  .        local progress: done_upto = 2, failed = {}
    frontier (MIN)       2                        -> tickets 1, 2 take effect, in order

:meth:`TicketLedger.progress` is this rank's contiguous prefix of finished tickets (and which of
them failed); the engine step turns it into the frontier (one rank: itself; under CP, a MIN
all-reduce, plus the union of failures) and hands it to :meth:`TicketLedger.advance`, which
returns the covered tickets in issue order. Nothing else makes a copy visible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class TicketKind(Enum):
    BACKUP = "backup"  # device -> host: write-through, selective, write-back
    LOAD = "load"  # host -> device: load-back
    SPILL = "spill"  # host -> disk: released once the store has gathered the pages
    RELOAD = "reload"  # disk -> host: inserted as a host-only node


@dataclass(frozen=True, slots=True)
class Progress:
    """Tickets ``1..done_upto`` finished (here, or on every rank for a frontier); ``failed``
    lists those among them whose copy failed. ``applied_upto`` and ``issued_upto`` are replicated
    (every rank issues and applies the same tickets), so a frontier collective can size its
    failure bitmap from them."""

    done_upto: int
    failed: frozenset[int] = frozenset()
    applied_upto: int = 0
    issued_upto: int = 0
    #: Per-rank numbers the frontier takes the MIN of, in replicated order (how many leading
    #: pages each pending disk lookup found on this rank): agreement rides the same collective.
    agree: tuple[int, ...] = ()


#: Turns this rank's progress into the commit frontier. One rank: the identity.
FrontierFn = Callable[[Progress], Progress]


def local_frontier(progress: Progress) -> Progress:
    return progress


@dataclass(slots=True)
class _Issued:
    kind: TicketKind
    finished: bool = False
    ok: bool = True
    error: str | None = None


@dataclass
class TicketLedger:
    """Issues tickets, records their completions, and releases them at the frontier."""

    next_ticket: int = 1
    applied_upto: int = 0  # tickets <= this have taken effect
    _issued: dict[int, _Issued] = field(default_factory=dict)
    _done_upto: int = 0

    def issue(self, kind: TicketKind) -> int:
        ticket = self.next_ticket
        self.next_ticket += 1
        self._issued[ticket] = _Issued(kind)
        return ticket

    def finish(self, ticket: int, ok: bool, error: str | None = None) -> None:
        """Record that this rank's copies of ``ticket`` landed (or failed)."""
        rec = self._issued.get(ticket)
        assert rec is not None and not rec.finished, f"ticket {ticket} finished twice or unknown"
        rec.finished, rec.ok, rec.error = True, ok, error
        while (nxt := self._issued.get(self._done_upto + 1)) is not None and nxt.finished:
            self._done_upto += 1

    def progress(self) -> Progress:
        failed = frozenset(
            t for t in range(self.applied_upto + 1, self._done_upto + 1) if not self._issued[t].ok
        )
        return Progress(self._done_upto, failed, self.applied_upto, self.next_ticket - 1)

    def advance(self, frontier: Progress) -> list[tuple[int, TicketKind, bool]]:
        """Tickets the frontier newly covers, in issue order: ``(ticket, kind, ok)``."""
        assert frontier.done_upto <= self._done_upto, "the frontier ran ahead of this rank"
        out = []
        for t in range(self.applied_upto + 1, frontier.done_upto + 1):
            rec = self._issued.pop(t)
            out.append((t, rec.kind, rec.ok and t not in frontier.failed))
        self.applied_upto = max(self.applied_upto, frontier.done_upto)
        return out

    def in_flight(self, kind: TicketKind | None = None) -> int:
        """Tickets issued and not yet applied (of one kind, or all)."""
        return sum(1 for r in self._issued.values() if kind is None or r.kind is kind)

    def check(self) -> None:
        """applied <= done <= issued, and exactly the unapplied tickets are on record."""
        issued = self.next_ticket - 1
        if not 0 <= self.applied_upto <= self._done_upto <= issued:
            raise AssertionError(
                f"tickets applied {self.applied_upto}, done {self._done_upto}, issued {issued}"
            )
        if set(self._issued) != set(range(self.applied_upto + 1, issued + 1)):
            raise AssertionError(
                "the ticket ledger lost or kept a ticket outside (applied, issued]"
            )
        if any(
            not self._issued[t].finished for t in range(self.applied_upto + 1, self._done_upto + 1)
        ):
            raise AssertionError("a ticket inside the finished prefix is not finished")

    def finished(self, ticket: int) -> bool:
        """Whether this rank's copies of ``ticket`` have landed (or it was applied already)."""
        rec = self._issued.get(ticket)
        return rec.finished if rec is not None else ticket <= self.applied_upto

    def error(self, ticket: int) -> str | None:
        rec = self._issued.get(ticket)
        return rec.error if rec is not None else None
