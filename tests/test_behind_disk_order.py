"""RemoteBehindDisk against scripted stores: the order in which the disk's and the shared
store's news arrive never changes what the pair reports. A reload is done once every part ended
(the disk's, its tail's and a retry's, in any order), a spill is released once by both stores,
and a store whose poll raises loses none of the other store's news (host-slot pins, reloads)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvstrata.errors import PoolInvariantError
from kvstrata.tiers.disk_config import DiskPoll
from kvstrata.tiers.disk_events import ReloadDone
from kvstrata.tiers.remote.behind_disk import RemoteBehindDisk


class _Store:
    """A store whose answers the test scripts: which pages it holds, whether it takes a job,
    and the news its next poll returns."""

    def __init__(self, held: Sequence[bytes] = ()) -> None:
        self.held = set(held)
        self.take = True
        self.reloads: list[tuple[int, list[bytes], list[int]]] = []
        self.spills: list[int] = []
        self.news: list[DiskPoll] = []
        self.raise_on_poll: Exception | None = None
        self.where, self.num_slots, self.io_timeout_s = "here", 10, 1.0

    def lookup(self, hashes: Sequence[bytes]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n

    def reload(self, ticket: int, hashes: Sequence[bytes], pool: Any, slots: Sequence[int]) -> bool:
        if self.take:
            self.reloads.append((ticket, list(hashes), list(slots)))
        return self.take

    def spill(self, ticket: int, pages: Sequence[Any], pool: Any) -> bool:
        if self.take:
            self.spills.append(ticket)
        return self.take

    def poll(self) -> DiskPoll:
        if self.raise_on_poll is not None:
            raise self.raise_on_poll
        out = DiskPoll(
            tuple(t for p in self.news for t in p.released),
            tuple(s for p in self.news for s in p.spilled),
            tuple(r for p in self.news for r in p.reloaded),
            tuple(d for p in self.news for d in p.dropped),
        )
        self.news = []
        return out

    def done(self, ticket: int, ok: Sequence[bool]) -> None:
        self.news.append(DiskPoll(reloaded=(ReloadDone(ticket, tuple(ok)),)))

    def release(self, ticket: int) -> None:
        self.news.append(DiskPoll(released=(ticket,)))

    def wait(self, timeout_s: float, spills_writing: int) -> bool:
        return True

    def close(self) -> None:
        pass


class _Remote(_Store):
    @property
    def remote(self) -> _Remote:  # RemotePages.remote: the store's own check
        return self

    def check(self) -> None:
        pass


H = [bytes([i]) * 32 for i in range(8)]


def _pair(disk_pages: int = 3, remote_pages: int = 8) -> tuple[RemoteBehindDisk, _Store, _Remote]:
    disk, remote = _Store(H[:disk_pages]), _Remote(H[:remote_pages])
    return RemoteBehindDisk(disk, remote), disk, remote  # type: ignore[arg-type]


@pytest.mark.parametrize("order", ["disk_first", "tail_first"])
def test_a_reload_is_done_only_once_its_disk_part_tail_and_retry_all_ended(order: str) -> None:
    both, disk, remote = _pair()
    assert both.lookup(H[:5]) == 5
    assert both.reload(7, H[:5], None, [10, 11, 12, 13, 14])  # type: ignore[arg-type]
    assert disk.reloads == [(7, H[:3], [10, 11, 12])]
    ((tail, hashes, slots),) = remote.reloads
    assert (hashes, slots) == (H[3:5], [13, 14])
    if order == "tail_first":
        remote.done(tail, [True, True])
        assert both.poll().reloaded == ()
    disk.done(7, [True, False, True])  # page 1 failed verification: 1 and 2 from the remote
    assert both.poll().reloaded == ()
    retry = remote.reloads[-1]
    assert retry[1:] == (H[1:3], [11, 12])
    both.check()
    if order == "disk_first":
        remote.done(tail, [True, True])
        assert both.poll().reloaded == ()
    remote.done(retry[0], [True, True])
    assert both.poll().reloaded == (ReloadDone(7, (True,) * 5),)
    c = both.counters.snapshot()
    assert (c["disk_retried"], c["reloaded_from_disk"], c["reloaded_from_remote"]) == (2, 1, 4)
    both.check()
    assert both.poll().reloaded == ()


def test_a_refused_retry_reports_the_disks_verdict_at_once() -> None:
    both, disk, remote = _pair(disk_pages=3, remote_pages=0)
    assert both.reload(1, H[:3], None, [0, 1, 2])  # type: ignore[arg-type]
    assert remote.reloads == []  # nothing past the disk's pages
    remote.take = False
    disk.done(1, [True, False, False])
    assert both.poll().reloaded == (ReloadDone(1, (True, False, False)),)
    both.check()


def test_a_spill_is_released_once_both_stores_released_it() -> None:
    both, disk, remote = _pair()
    assert both.spill(3, [(H[0], 0, 1)], None)  # type: ignore[arg-type]
    disk.release(3)
    assert both.poll().released == ()
    remote.release(3)
    assert both.poll().released == (3,)
    both.check()


def test_a_shared_store_whose_poll_raises_loses_none_of_the_disks_news() -> None:
    """The disk's releases and reload results taken by the same poll are handed out later:
    dropped, a spill's host slots would stay pinned and a reload would never end."""
    both, disk, remote = _pair(disk_pages=3, remote_pages=0)
    remote.take = False
    assert both.spill(1, [(H[0], 0, 1)], None)  # type: ignore[arg-type]  # the disk's only
    assert both.reload(2, H[:3], None, [0, 1, 2])  # type: ignore[arg-type]
    disk.release(1)
    disk.done(2, [True, True, True])
    remote.raise_on_poll = RuntimeError("a store thread failed")
    with pytest.raises(RuntimeError):
        both.poll()
    remote.raise_on_poll = None
    news = both.poll()
    assert news.released == (1,) and news.reloaded == (ReloadDone(2, (True,) * 3),)
    both.check()


def test_check_names_a_reload_with_no_part_left() -> None:
    both, disk, _ = _pair()
    assert both.reload(1, H[:3], None, [0, 1, 2])  # type: ignore[arg-type]
    both._reloads[1].parts = 0
    with pytest.raises(PoolInvariantError):
        both.check()
