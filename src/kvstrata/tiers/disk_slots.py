"""Disk slots of one rank: which are free, which page each used slot holds, and their LRU order.

Every slot is in exactly one state::

    free ──alloc(page)──▶ writing ──publish (index committed)──▶ live ──remove (GC, drop)──▶ free
                             └──────────release (write failed)──────────▶ free

A page's payloads share one slot number (slot ``s`` of every payload's slab), so a page is the
unit of allocation and of GC. ``last_access`` is a logical clock bumped on every alloc and touch
(never wall-clock time), so a page takes its place in the LRU order when its spill is *planned*,
not when its write happens to land: the order, and so what GC picks, is a function of the calls
made, however fast the disk is. GC takes live pages from the least recently used (ties by
slot: pages a ``load`` start finds with the same clock, such as every page of an index that
``kvstrata disk check --fix`` rebuilt, or a page taken back); a page still being written is
never a victim. Callers hold the store's state lock.

The LRU order is kept as arrays indexed by slot (``last_access`` and whether it was touched
since its index entry was written), not as a linked order of page objects: a reload touches
thousands of pages, which is then one dict lookup a page and one array assignment, and GC finds
its victims with one partial sort of the clocks when it runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat

import numpy as np

from ..errors import PoolInvariantError


def _each(calls: Iterable[None]) -> None:
    """Run a ``map`` of calls made for their effect (``page.__setitem__`` over slots): the loop
    in C, not a Python step a page."""
    deque(calls, maxlen=0)


#: What :meth:`SlotPool.touch_or_alloc` did with a page.
LIVE, WRITING, ALLOCATED, FULL = range(4)
#: ``last_access`` of a slot no page holds (after every real clock value).
_UNUSED = np.iinfo(np.int64).max
#: The latest clock a ``load`` start takes from the index (a u64 there; a damaged or foreign
#: value past it counts as this recent, and the clock keeps room to run on).
MAX_LOADED_CLOCK = 1 << 62


class SlotPool:
    """Free list, and the pages of used slots in LRU order (writing and live), of ``num_slots``."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._slot: dict[bytes, int] = {}  # the slot of every page written or being written
        self._writing: set[bytes] = set()  # pages whose write is in flight
        self._page: list[bytes | None] = [None] * num_slots  # slot -> its page
        self._last = np.full(num_slots, _UNUSED, dtype=np.int64)  # slot -> its last_access
        #: slots whose page was accessed since its index entry was written (``touched``)
        self._dirty = np.zeros(num_slots, dtype=bool)
        #: Slots neither free nor a page's: index entries of a page that lives elsewhere still
        #: name them and could not be deleted (a fault); never handed out until they are.
        self.withheld: set[int] = set()
        self.clock = 0
        #: Bumped whenever a page leaves its slot or a slot takes a page back: slots read from
        #: the pool are still those pages' while it is unchanged (a lookup's, for the reload
        #: that follows it).
        self.moves = 0

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return len(self._slot) - len(self._writing)

    @property
    def num_writing(self) -> int:
        return len(self._writing)

    @property
    def num_used(self) -> int:
        """Slots not free: live plus being written."""
        return self.num_slots - len(self._free)

    def slot_of(self, page_hash: bytes) -> int | None:
        """The slot of a live page (None when absent or still being written)."""
        return None if page_hash in self._writing else self._slot.get(page_hash)

    def writing_slot(self, page_hash: bytes) -> int | None:
        """The slot a page is being written to (None when it is not)."""
        return self._slot[page_hash] if page_hash in self._writing else None

    def slots_of(self, page_hashes: Sequence[bytes]) -> list[int | None]:
        """:meth:`slot_of` of each of ``page_hashes``."""
        writing = self._writing
        held = self.held_slots(page_hashes)
        if not writing:
            return held
        return [None if h in writing else s for h, s in zip(page_hashes, held, strict=True)]

    def held_slots(self, page_hashes: Sequence[bytes]) -> list[int | None]:
        """The slot of each of ``page_hashes`` that is live or being written (None where
        absent): one dict lookup a page, no Python step."""
        return list(map(self._slot.get, page_hashes))

    def holds(self, page_hashes: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """Whether each page is live at its slot (``slot_of(page_hashes[i]) == slots[i]``),
        from the slot -> page list, not the page -> slot dict: a list index a page."""
        found = list(map(self._page.__getitem__, slots))
        writing = self._writing
        if found == list(page_hashes) and (not writing or writing.isdisjoint(page_hashes)):
            return [True] * len(found)
        return [f == h and h not in writing for f, h in zip(found, page_hashes, strict=True)]

    def any_writing(self, page_hashes: Sequence[bytes]) -> bool:
        """Whether any of ``page_hashes`` is being written."""
        writing = self._writing
        return bool(writing) and not writing.isdisjoint(page_hashes)

    def leading(self, page_hashes: Sequence[bytes]) -> list[int]:
        """The slots of the leading pages of ``page_hashes`` that are live or being written (as
        many as lead, the first absent page ends them): one dict lookup a page, no Python
        step."""
        held: list[int] = list(map(self._slot.get, page_hashes, repeat(-1)))
        try:  # -1 is one object: found by identity, where None would be compared with each int
            return held[: held.index(-1)]
        except ValueError:
            return held

    def last_access(self, page_hash: bytes) -> int:
        return int(self._last[self._slot[page_hash]])

    def last_accesses(self, page_hashes: Sequence[bytes]) -> list[int]:
        """:meth:`last_access` of each of ``page_hashes`` (every one held)."""
        slots = list(map(self._slot.__getitem__, page_hashes))
        return self._last[slots].tolist()

    def _order(self, slots: np.ndarray) -> np.ndarray:
        """``slots`` least recently used first (ties by slot)."""
        return slots[np.lexsort((slots, self._last[slots]))]

    def _is_live(self, slot: int) -> bool:
        page = self._page[slot]
        return page is not None and page not in self._writing

    def live(self) -> list[tuple[bytes, int, int]]:
        """``(page hash, slot, last_access)`` of every live page, least recently used first."""
        used = self._order(np.flatnonzero(self._last != _UNUSED)).tolist()
        page, last = self._page, self._last
        return [(page[s], s, int(last[s])) for s in used if self._is_live(s)]

    def coldest(self, n: int) -> list[tuple[bytes, int]]:
        """The ``n`` least recently used live pages ``(hash, slot)``, coldest first."""
        slots = self._coldest_slots(n).tolist()
        page = self._page
        return [(page[s], s) for s in slots]

    def _coldest_slots(self, n: int) -> np.ndarray:
        """The slots of the ``n`` least recently used live pages, coldest first (ties by slot),
        from one partial sort of the clocks: slots free or being written sort last."""
        n = min(n, self.num_live)
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        last = self._last
        if self._writing:  # never a victim: keyed past every page's clock, as free slots are
            last = last.copy()
            last[list(map(self._slot.__getitem__, self._writing))] = _UNUSED
        if n < self.num_slots:  # the n smallest (clock, slot): of those tied with the n-th,
            kth = last[np.argpartition(last, n - 1)[n - 1]]  # the lowest slots
            below = np.flatnonzero(last < kth)
            cand = np.concatenate((below, np.flatnonzero(last == kth)[: n - below.size]))
        else:
            cand = np.arange(n)
        return self._order(cand)  # every candidate live: its clock in the array is its key

    def dirty_pages(self) -> dict[bytes, int]:
        """``page hash -> slot`` of the pages touched since their index entry was written."""
        page = self._page
        return {page[s]: s for s in np.flatnonzero(self._dirty).tolist()}  # type: ignore[misc]

    # -- transitions -----------------------------------------------------------------------------

    def alloc(self, page_hash: bytes) -> int | None:
        """A free slot to write ``page_hash`` into (the newest in LRU order), or None when every
        slot is used."""
        assert page_hash not in self._slot, "a page is allocated twice"
        if not self._free:
            return None
        slot = self._free.pop()
        self.clock += 1
        self._hold(page_hash, slot, self.clock)
        self._writing.add(page_hash)
        return slot

    def _hold(self, page_hash: bytes, slot: int, last_access: int) -> None:
        self._slot[page_hash] = slot
        self._page[slot] = page_hash
        self._last[slot] = last_access
        self._dirty[slot] = False

    def _let_go(self, page_hash: bytes) -> int:
        self.moves += 1
        slot = self._slot.pop(page_hash)
        self._page[slot] = None
        self._last[slot] = _UNUSED
        self._dirty[slot] = False
        self._free.append(slot)
        return slot

    def release(self, page_hash: bytes) -> int:
        """A page whose write failed: its slot goes back to the free list (returned)."""
        assert page_hash in self._writing, "release a page being written only"
        self._writing.discard(page_hash)
        return self._let_go(page_hash)

    def publish(self, page_hash: bytes) -> int:
        """The page's index entries are committed: its slot is live. Returns its last_access."""
        assert page_hash in self._writing, "a page is published twice"
        self._writing.discard(page_hash)
        return self.last_access(page_hash)

    def publish_many(self, page_hashes: Sequence[bytes]) -> None:
        """:meth:`publish` of each of ``page_hashes``."""
        if not self._writing.issuperset(page_hashes):
            raise AssertionError("a page is published twice")
        self._writing.difference_update(page_hashes)

    def touch(self, page_hash: bytes) -> tuple[int, int] | None:
        """Mark a page most recently used, live or being written (where it stands must not
        depend on how far its write got); returns ``(slot, last_access)``, None if absent."""
        self.touch_many((page_hash,))
        slot = self._slot.get(page_hash)
        return None if slot is None else (slot, self.clock)

    def touch_many(self, page_hashes: Iterable[bytes]) -> None:
        """:meth:`touch` of each of ``page_hashes`` in order (a page given twice takes the later
        place)."""
        self.touch_slots([s for s in map(self._slot.get, page_hashes) if s is not None])

    def touch_slots(self, slots: Sequence[int]) -> None:
        """:meth:`touch_many` of the pages at ``slots`` (each held), in order: clocks as one
        array when no slot repeats (the usual case), else a slot given twice takes the later
        place."""
        n = len(slots)
        if n == 0:
            return
        if len(set(slots)) == n:  # a set of ints: a tenth of np.unique's time at 2,000 slots
            idx = np.asarray(slots, dtype=np.int64)
            self._last[idx] = np.arange(self.clock + 1, self.clock + 1 + n, dtype=np.int64)
            self._dirty[idx] = True
        else:
            self._stamp({s: i for i, s in enumerate(slots, self.clock + 1)}, touched=True)
        self.clock += n

    def _stamp(self, clocks: dict[int, int], touched: bool) -> None:
        """Set ``last_access`` of slots (``slot -> clock``), marked as accessed since their index
        entry was written or not (``touched``: a new page's entry will carry its clock)."""
        if not clocks:
            return
        slots = np.fromiter(clocks, dtype=np.int64, count=len(clocks))
        self._last[slots] = np.fromiter(clocks.values(), dtype=np.int64, count=len(clocks))
        self._dirty[slots] = touched

    def touch_or_alloc(
        self, page_hashes: Sequence[bytes], high_slots: int, collect: Callable[[], None]
    ) -> tuple[list[int] | None, list[int]]:
        """A spill's pages, in order: a page held (live or being written) is touched as by
        :meth:`touch`; any other gets a free slot as by :meth:`alloc`, after ``collect()`` (GC)
        whenever one more used slot would pass ``high_slots``. Returns ``(fates, slots)``: per
        page ``LIVE | WRITING | ALLOCATED`` and its slot, ``FULL`` and -1 where no slot was
        free; ``fates`` is None when every page was allocated (the usual spill).

        One call for a whole spill (a call per page was a fifth of the engine thread's time in
        a replay that spills every page), and the usual part of it without a Python step a page:
        a run of pages the pool does not hold that fits under ``high_slots`` takes the next free
        slots, clocks and entries in a few bulk operations. Pages held, GC and a full pool go
        one by one; the clocks go into the arrays before GC looks and at the end."""
        hashes = list(page_hashes)
        if len(set(hashes)) != len(hashes):  # a page twice: its second time is a touch
            return self._touch_or_alloc_each(hashes, high_slots, collect)
        slot_of, page, writing, free = self._slot, self._page, self._writing, self._free
        found = list(map(slot_of.get, hashes))  # exact until GC frees slots (no page twice)
        fates: list[int] = []
        out: list[int] = []
        only_allocated = True
        touched: dict[int, int] = {}  # slot -> clock of the pages touched
        clock, i, n = self.clock, 0, len(hashes)
        while i < n:
            slot = found[i]
            if slot is not None:
                clock += 1
                touched[slot] = clock
                fates.append(WRITING if hashes[i] in writing else LIVE)
                out.append(slot)
                only_allocated = False
                i += 1
                continue
            if self.num_slots - len(free) + 1 > high_slots:  # GC first, as for any new page
                self.clock = clock
                self._stamp(touched, touched=True)
                touched = {}
                collect()  # frees slots into the same free list
                found[i + 1 :] = map(slot_of.get, hashes[i + 1 :])
            if not free:
                fates.append(FULL)
                out.append(-1)
                only_allocated = False
                i += 1
                continue
            # Page i and the absent pages after it that fit under the watermark (page i alone
            # where GC could not bring the pool below it): allocated in bulk.
            room = max(high_slots - (self.num_slots - len(free)), 1)
            j, stop = i + 1, min(n, i + room, i + len(free))
            while j < stop and found[j] is None:
                j += 1
            run, k = hashes[i:j], j - i
            slots = free[len(free) - k :][::-1]  # as pop() hands them out: lowest slot first
            del free[len(free) - k :]
            slot_of.update(zip(run, slots, strict=True))
            writing.update(run)
            _each(map(page.__setitem__, slots, run))  # page[s] = h, no Python step a page
            self._last[slots] = np.arange(clock + 1, clock + k + 1, dtype=np.int64)
            self._dirty[slots] = False
            clock += k
            fates += [ALLOCATED] * k
            out += slots
            i = j
        self.clock = clock
        self._stamp(touched, touched=True)
        return (None if only_allocated else fates), out

    def _touch_or_alloc_each(
        self, page_hashes: Sequence[bytes], high_slots: int, collect: Callable[[], None]
    ) -> tuple[list[int] | None, list[int]]:
        """:meth:`touch_or_alloc` page by page (a spill that lists a page twice)."""
        slot_of, page, writing, free = self._slot, self._page, self._writing, self._free
        get = slot_of.get
        fates: list[int] = []
        out: list[int] = []
        new: dict[int, int] = {}  # slot -> clock of the pages allocated (not yet in the arrays)
        touched: dict[int, int] = {}  # slot -> clock of the pages touched
        clock = self.clock
        for h in page_hashes:
            found = get(h)
            if found is not None:
                clock += 1
                touched[found] = clock
                fates.append(WRITING if h in writing else LIVE)
                out.append(found)
                continue
            if self.num_slots - len(free) + 1 > high_slots:
                self.clock = clock
                self._stamp(new, touched=False)
                self._stamp(touched, touched=True)
                new, touched = {}, {}
                collect()  # frees slots into the same free list
            if not free:
                fates.append(FULL)
                out.append(-1)
                continue
            slot = free.pop()
            clock += 1
            slot_of[h] = slot
            page[slot] = h
            writing.add(h)
            new[slot] = clock
            fates.append(ALLOCATED)
            out.append(slot)
        self.clock = clock
        self._stamp(new, touched=False)  # then the touches: a page allocated and touched again
        self._stamp(touched, touched=True)  # in one call takes the later clock
        return fates, out

    def remove_coldest(self, n: int) -> list[tuple[bytes, int, int]]:
        """Free the ``n`` least recently used live pages (:meth:`remove` each), coldest first;
        returns their ``(page hash, slot, last_access)``."""
        order = self._coldest_slots(n)
        self.moves += 1
        slots = order.tolist()
        lasts = self._last[order].tolist()
        page = self._page
        hashes: list[bytes] = list(map(page.__getitem__, slots))  # type: ignore[arg-type]
        _each(map(self._slot.__delitem__, hashes))
        _each(map(page.__setitem__, slots, repeat(None)))
        self._last[order] = _UNUSED
        self._dirty[order] = False
        self._free += slots
        return list(zip(hashes, slots, lasts, strict=True))

    def remove(self, page_hash: bytes) -> int:
        """The page's index entries are (being) deleted: free its slot (returned)."""
        assert page_hash in self._slot and page_hash not in self._writing, "remove a live page only"
        return self._let_go(page_hash)

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
        if page_hash in self._slot or slot not in self._free:
            return False
        self._free.remove(slot)
        self.moves += 1
        self._hold(page_hash, slot, last_access)  # back in its place in the LRU order
        return True

    def touched(self) -> list[tuple[bytes, int, int]]:
        """``(page hash, slot, last_access)`` of live pages accessed since their index entry was
        written, and forget every access (the caller writes them)."""
        dirty = np.flatnonzero(self._dirty).tolist()
        self._dirty[:] = False
        page, last = self._page, self._last
        return [(page[s], s, int(last[s])) for s in dirty if self._is_live(s)]  # type: ignore[misc]

    def rebuild(self, pages: list[tuple[bytes, int, int]]) -> None:
        """Start from ``(page hash, slot, last_access)`` live pages (a ``load`` cold start):
        the LRU follows last_access (at most :data:`MAX_LOADED_CLOCK`), every other slot is
        free."""
        assert not self._slot, "rebuild an unused pool only"
        pages = [(h, slot, min(max(last, 0), MAX_LOADED_CLOCK)) for h, slot, last in pages]
        taken = {slot for _, slot, _ in pages}
        assert len(taken) == len(pages), "two live pages in one slot"
        assert len({h for h, _, _ in pages}) == len(pages), "a page in two slots"
        assert all(0 <= s < self.num_slots for s in taken)
        self.moves += 1
        for h, slot, last in pages:
            self._hold(h, slot, last)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in taken]
        self.clock = max((last for _, _, last in pages), default=0)

    def check(self) -> None:
        """Free and used slots partition ``[0, num_slots)``; pages, slots and clocks agree."""
        used = list(self._slot.values())
        parts = [*self._free, *used, *self.withheld]
        if sorted(parts) != list(range(self.num_slots)):
            dup = len(parts) - len(set(parts))
            raise PoolInvariantError(
                f"disk slots: {len(self._free)} free + {self.num_writing} writing + "
                f"{self.num_live} live != {self.num_slots} slots ({dup} handed out twice)"
            )
        if not self._writing <= self._slot.keys():
            raise PoolInvariantError("disk slots: a page being written holds no slot")
        if any(self._page[s] != h for h, s in self._slot.items()):
            raise PoolInvariantError("disk slots: a slot's page disagrees with the page's slot")
        held = np.zeros(self.num_slots, dtype=bool)
        held[used] = True
        if sum(p is not None for p in self._page) != len(used):
            raise PoolInvariantError("disk slots: a free slot still names a page")
        if (self._last[~held] != _UNUSED).any() or (self._dirty & ~held).any():
            raise PoolInvariantError("disk slots: a free slot keeps a clock or an access")
        if used and int(self._last[held].max()) > self.clock:
            raise PoolInvariantError("disk LRU order disagrees with last_access")
