"""The shared store as the tier behind L2: a :class:`RemoteStore` seen through the interface the
disk tier's driver (:class:`~kvstrata.tiers.spill.DiskTier`) uses, so that spill, reload, the
ranks' agreement on a lookup and the frontier work for it unchanged: in the disk's place, or
behind it (``behind_disk.RemoteBehindDisk`` drives a :class:`DiskStore` and this together).

``spill`` publishes, ``reload`` fetches, ``poll`` turns the store's completions into the disk's
(a page the store holds, written now or found there, is ``durable``; a fetched page that did not
come back verified is a failed read). The store's threads, breaker and budget are its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..disk_config import DiskPoll
from ..disk_events import ReloadDone, SpillDone
from ..host_pool import HostPool
from .results import RemoteStats

if TYPE_CHECKING:
    from .store import RemoteStore


class RemotePages:
    """A :class:`RemoteStore` with the disk store's method names (:class:`~kvstrata.tiers.spill.PageStore`)."""

    def __init__(self, store: RemoteStore) -> None:
        self.remote = store

    @property
    def where(self) -> str:
        """The store, for messages (no password)."""
        return f"at {self.remote.address.shown}"

    @property
    def num_slots(self) -> int:
        """The pages this rank's budget holds (what a disk store's slots are to the planner)."""
        return self.remote.budget_bytes // self.remote.page_bytes

    @property
    def io_timeout_s(self) -> float:
        """The longest the engine waits for the store's work of one step: every round trip of
        a batch may take the socket timeout, and the store's own waits are twice it."""
        return 4 * self.remote.config.timeout_s + 1.0

    def spill(
        self, ticket: int, pages: Sequence[tuple[bytes, int, int]], host_pool: HostPool
    ) -> bool:
        return self.remote.publish(ticket, pages, host_pool)

    def reload(
        self,
        ticket: int,
        page_hashes: Sequence[bytes],
        host_pool: HostPool,
        host_slots: Sequence[int],
    ) -> bool:
        return self.remote.fetch(ticket, page_hashes, host_pool, host_slots)

    def lookup(self, page_hashes: Sequence[bytes]) -> int:
        return self.remote.lookup(page_hashes)

    def poll(self) -> DiskPoll:
        news = self.remote.poll()
        spilled = tuple(
            SpillDone(d.ticket, d.written + d.present, d.failed, d.skipped) for d in news.published
        )
        reloaded = tuple(ReloadDone(d.ticket, d.ok) for d in news.fetched)
        return DiskPoll(news.released, spilled, reloaded, ())

    def flush(self, timeout_s: float) -> bool:
        return self.remote.flush(timeout_s)

    def wait(self, timeout_s: float, spills_writing: int) -> bool:
        """The engine's fixed point (``DiskStore.wait``). The shared store's lookups see a page
        only once its write landed, so every publish must finish whatever ``spills_writing``
        allows the disk: the same store at every step, however fast the server is."""
        del spills_writing
        return self.remote.flush(timeout_s)

    def stats(self) -> RemoteStats:
        return self.remote.stats()

    def close(self) -> None:
        self.remote.close()
