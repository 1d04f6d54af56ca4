"""What the shared tier reports: counters, per-ticket results, and what ``poll()`` hands out."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

COUNTERS = (
    "publishes",  # publish tickets accepted
    "publishes_refused",  # publish tickets refused (too many in flight, or closed)
    "pages_written",  # pages whose every payload is now in the store, written by this rank
    "bytes_written",  # value bytes of the keys this rank created
    "pages_present",  # pages a publish found in the store already (another instance's)
    "skipped_admission",  # pages under min_hits
    "skipped_budget",  # pages not written: this namespace's share of the store is used up
    "skipped_unavailable",  # pages not written: breaker open, timeout or connection error
    "write_errors",  # pages the server refused to store (an OOM under noeviction, ...)
    "lookups",  # lookup calls
    "lookup_pages",  # pages lookups asked about
    "lookup_found",  # leading pages lookups found
    "fetches",  # fetch tickets accepted
    "fetches_refused",  # fetch tickets refused (too many in flight, or closed)
    "hits",  # pages fetched, verified and copied into their host slot
    "bytes_read",  # value bytes of those pages
    "misses",  # pages fetched that did not come back verified (the next three, and absent)
    "verify_failures",  # pages whose value failed verification (its keys are deleted)
    "read_unavailable",  # pages not read: breaker open, timeout or connection error
    "timeouts",  # round trips that timed out
    "connection_errors",  # round trips whose connection failed
    "breaker_opens",  # times the breaker opened (after a timeout or connection error)
    "breaker_skips",  # calls answered at once because the breaker was open
    "recounts",  # SCANs of this rank's keys (the budget's accounting)
    "recount_waits_cut",  # publishes that stopped waiting for the first SCAN (pages skipped)
)


@dataclass(frozen=True, slots=True)
class PublishDone:
    """Where every page of publish ``ticket`` ended: in the store (written now, or found
    there), not written (budget, store unavailable, refused by the server), or skipped by
    admission (fewer hits than min_hits)."""

    ticket: int
    written: tuple[bytes, ...]
    present: tuple[bytes, ...]
    failed: tuple[bytes, ...]
    skipped: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class FetchDone:
    """Fetch ``ticket``: ``ok[i]`` when page ``i`` was read, verified and copied to its host
    slot (pages are independent: a False page leaves its host slot as it was)."""

    ticket: int
    ok: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class RemotePoll:
    """What finished since the last ``poll()``.

    released: publish tickets whose host slots the store no longer reads (unpin them).
    published: publish tickets whose every page ended (after ``released``).
    fetched: fetch tickets done.
    """

    released: tuple[int, ...] = ()
    published: tuple[PublishDone, ...] = ()
    fetched: tuple[FetchDone, ...] = ()


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """Counters (:data:`COUNTERS`) and the store's state."""

    url: str  # without its password
    kind: str  # standalone or cluster
    budget_bytes: int  # this rank's share
    used_bytes: int  # this rank's keys' value bytes, as last counted plus written since
    page_bytes: int  # value bytes of one page, every payload
    breaker_open: bool
    malloc_tuned: bool
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def writes_skipped(self) -> int:
        c = self.counters
        return c["skipped_budget"] + c["skipped_unavailable"] + c["write_errors"]

    def __getattr__(self, name: str) -> int:
        try:
            return self.counters[name]
        except KeyError:
            raise AttributeError(name) from None


class Events:
    """Completions waiting for ``poll()``, and the jobs still running (for ``flush``)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.released: list[int] = []
        self.published: list[PublishDone] = []
        self.fetched: list[FetchDone] = []
        self.running = 0

    def take(self) -> RemotePoll:
        with self.cond:
            out = RemotePoll(tuple(self.released), tuple(self.published), tuple(self.fetched))
            self.released.clear()
            self.published.clear()
            self.fetched.clear()
        return out
