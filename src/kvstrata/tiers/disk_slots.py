"""Disk slots of one rank: which are free, which page each used slot holds, and their LRU order.

Every slot is in exactly one state::

    free ──alloc(page)──▶ writing ──publish (index committed)──▶ live ──remove (GC, drop)──▶ free
                             └──────────release (write failed)──────────▶ free

A page's payloads share one slot number (slot ``s`` of every payload's slab), so a page is the
unit of allocation and of GC. ``last_access`` is a logical clock bumped on every alloc and touch
(never wall-clock time), so a page takes its place in the LRU order when its spill is *planned*,
not when its write happens to land: the order, and so what GC picks, is a function of the calls
made, however fast the disk is. GC takes live pages from the least recently used; a page still
being written is never a victim. Callers hold the store's state lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from ..errors import PoolInvariantError

#: What :meth:`SlotPool.touch_or_alloc` did with a page.
LIVE, WRITING, ALLOCATED, FULL = range(4)


class _Entry:
    """A used slot's page: changed in place by touch and publish (no new object per access)."""

    __slots__ = ("slot", "last_access", "live")

    def __init__(self, slot: int, last_access: int, live: bool) -> None:
        self.slot = slot
        self.last_access = last_access
        self.live = live  # False while its write is in flight


class SlotPool:
    """Free list, and the pages of used slots in LRU order (writing and live), of ``num_slots``."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._pages: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._num_writing = 0
        #: Slots neither free nor a page's: index entries of a page that lives elsewhere still
        #: name them and could not be deleted (a fault); never handed out until they are.
        self.withheld: set[int] = set()
        self.clock = 0

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return len(self._pages) - self._num_writing

    @property
    def num_writing(self) -> int:
        return self._num_writing

    @property
    def num_used(self) -> int:
        """Slots not free: live plus being written."""
        return self.num_slots - len(self._free)

    def slot_of(self, page_hash: bytes) -> int | None:
        """The slot of a live page (None when absent or still being written)."""
        found = self._pages.get(page_hash)
        return found.slot if found is not None and found.live else None

    def writing_slot(self, page_hash: bytes) -> int | None:
        """The slot a page is being written to (None when it is not)."""
        found = self._pages.get(page_hash)
        return found.slot if found is not None and not found.live else None

    def slots_of(self, page_hashes: Sequence[bytes]) -> list[int | None]:
        """:meth:`slot_of` of each of ``page_hashes``."""
        get = self._pages.get
        return [e.slot if (e := get(h)) is not None and e.live else None for h in page_hashes]

    def any_writing(self, page_hashes: Sequence[bytes]) -> bool:
        """Whether any of ``page_hashes`` is being written."""
        get = self._pages.get
        return any((e := get(h)) is not None and not e.live for h in page_hashes)

    def leading(self, page_hashes: Sequence[bytes]) -> int:
        """How many of ``page_hashes``, from the first, are live or being written."""
        pages = self._pages
        for i, h in enumerate(page_hashes):
            if h not in pages:
                return i
        return len(page_hashes)

    def last_access(self, page_hash: bytes) -> int:
        return self._pages[page_hash].last_access

    def live(self) -> list[tuple[bytes, int, int]]:
        """``(page hash, slot, last_access)`` of every live page, least recently used first."""
        return [(h, e.slot, e.last_access) for h, e in self._pages.items() if e.live]

    def coldest(self, n: int) -> list[tuple[bytes, int]]:
        """The ``n`` least recently used live pages ``(hash, slot)``, coldest first."""
        out: list[tuple[bytes, int]] = []
        for h, e in self._pages.items():
            if len(out) >= n:
                break
            if e.live:
                out.append((h, e.slot))
        return out

    # -- transitions -----------------------------------------------------------------------------

    def alloc(self, page_hash: bytes) -> int | None:
        """A free slot to write ``page_hash`` into (the newest in LRU order), or None when every
        slot is used."""
        assert page_hash not in self._pages, "a page is allocated twice"
        if not self._free:
            return None
        slot = self._free.pop()
        self.clock += 1
        self._pages[page_hash] = _Entry(slot, self.clock, False)
        self._num_writing += 1
        return slot

    def release(self, page_hash: bytes) -> int:
        """A page whose write failed: its slot goes back to the free list (returned)."""
        entry = self._pages.pop(page_hash)
        assert not entry.live, "release a page being written only"
        self._num_writing -= 1
        self._free.append(entry.slot)
        return entry.slot

    def publish(self, page_hash: bytes) -> int:
        """The page's index entries are committed: its slot is live. Returns its last_access."""
        entry = self._pages[page_hash]
        assert not entry.live, "a page is published twice"
        entry.live = True
        self._num_writing -= 1
        return entry.last_access

    def touch(self, page_hash: bytes) -> tuple[int, int] | None:
        """Mark a page most recently used, live or being written (where it stands must not
        depend on how far its write got); returns ``(slot, last_access)``, None if absent."""
        touched = self.touch_many((page_hash,))
        return (touched[0][1], self.clock) if touched else None

    def touch_many(self, page_hashes: Iterable[bytes]) -> list[tuple[bytes, int]]:
        """:meth:`touch` of each of ``page_hashes`` in order; ``(hash, slot)`` of those found."""
        pages = self._pages
        out: list[tuple[bytes, int]] = []
        get, to_end, add = pages.get, pages.move_to_end, out.append
        clock = self.clock
        for h in page_hashes:
            found = get(h)
            if found is not None:
                clock += 1
                found.last_access = clock
                to_end(h)
                add((h, found.slot))
        self.clock = clock
        return out

    def touch_or_alloc(
        self,
        page_hashes: Sequence[bytes],
        high_slots: int,
        collect: Callable[[], None],
        touched: dict[bytes, int],
    ) -> list[tuple[int, int]]:
        """A spill's pages, in order: a page held (live or being written) is touched as by
        :meth:`touch` (its slot recorded in ``touched``); any other gets a free slot as by
        :meth:`alloc`, after ``collect()`` (GC) whenever one more used slot would pass
        ``high_slots``. Returns ``(LIVE | WRITING | ALLOCATED, slot)`` per page, ``(FULL, -1)``
        where no slot was free. One loop for a whole spill: a call per page was a fifth of the
        engine thread's time in a replay that spills every page."""
        pages, free, alloc = self._pages, self._free, self.alloc
        get, to_end = pages.get, pages.move_to_end
        out: list[tuple[int, int]] = []
        add = out.append
        for h in page_hashes:
            found = get(h)
            if found is not None:  # touch_many's step, inline: a call per page is what it saves
                self.clock += 1
                found.last_access = self.clock
                to_end(h)
                touched[h] = found.slot
                add((LIVE if found.live else WRITING, found.slot))
                continue
            if self.num_slots - len(free) + 1 > high_slots:
                collect()  # frees slots into the same free list
            slot = alloc(h)
            add((FULL, -1) if slot is None else (ALLOCATED, slot))
        return out

    def remove_coldest(self, n: int) -> list[tuple[bytes, int, int]]:
        """Free the ``n`` least recently used live pages (:meth:`remove` each), coldest first;
        returns their ``(page hash, slot, last_access)``."""
        victims = [(h, slot, self._pages[h].last_access) for h, slot in self.coldest(n)]
        for h, _, _ in victims:
            self.remove(h)
        return victims

    def remove(self, page_hash: bytes) -> int:
        """The page's index entries are (being) deleted: free its slot (returned)."""
        entry = self._pages.pop(page_hash)
        assert entry.live, "remove a live page only"
        self._free.append(entry.slot)
        return entry.slot

    def sort_free(self) -> None:
        """Hand free slots out lowest first from now on, so that pages planned together get
        runs of consecutive slots (one vectored write, and later one read, per run)."""
        self._free.sort(reverse=True)

    def withhold(self, slot: int) -> None:
        """Take a free ``slot`` out of use (see ``withheld``)."""
        self._free.remove(slot)
        self.withheld.add(slot)

    def release_withheld(self, slot: int) -> None:
        """The entries naming a withheld ``slot`` are gone: it is free again."""
        self.withheld.remove(slot)
        self._free.append(slot)

    def take_back(self, page_hash: bytes, slot: int, last_access: int) -> bool:
        """Make ``slot`` live again with ``page_hash`` (whose index entries still name it: their
        deletion failed); False when the slot is handed out again or the page lives elsewhere."""
        if page_hash in self._pages or slot not in self._free:
            return False
        self._free.remove(slot)
        self._pages[page_hash] = _Entry(slot, last_access, True)
        # Back in its place in the LRU order (a rare fault path: the order is rebuilt whole).
        self._pages = OrderedDict(sorted(self._pages.items(), key=lambda kv: kv[1].last_access))
        return True

    def rebuild(self, pages: list[tuple[bytes, int, int]]) -> None:
        """Start from ``(page hash, slot, last_access)`` live pages (a ``load`` cold start):
        the LRU follows last_access (page hash breaks ties), every other slot is free."""
        assert not self._pages, "rebuild an unused pool only"
        ordered = sorted(pages, key=lambda p: (p[2], p[0]))
        taken = {slot for _, slot, _ in ordered}
        assert len(taken) == len(ordered), "two live pages in one slot"
        assert all(0 <= s < self.num_slots for s in taken)
        self._pages = OrderedDict((h, _Entry(slot, last, True)) for h, slot, last in ordered)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in taken]
        self.clock = max((last for _, _, last in ordered), default=0)

    def check(self) -> None:
        """Free and used slots partition ``[0, num_slots)``; clocks are consistent."""
        used = [e.slot for e in self._pages.values()]
        parts = [*self._free, *used, *self.withheld]
        if sorted(parts) != list(range(self.num_slots)):
            dup = len(parts) - len(set(parts))
            raise PoolInvariantError(
                f"disk slots: {len(self._free)} free + {self._num_writing} writing + "
                f"{self.num_live} live != {self.num_slots} slots ({dup} handed out twice)"
            )
        if self._num_writing != sum(1 for e in self._pages.values() if not e.live):
            raise PoolInvariantError("disk slots: the count of slots being written is off")
        clocks = [e.last_access for e in self._pages.values()]
        if clocks != sorted(clocks) or (clocks and clocks[-1] > self.clock):
            raise PoolInvariantError("disk LRU order disagrees with last_access")
