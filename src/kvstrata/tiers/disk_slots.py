"""Disk slots of one rank: which are free, which page each live slot holds, and their LRU order.

Every slot is in exactly one state::

    free ──alloc──▶ writing ──publish (index committed)──▶ live ──evict / drop──▶ free
                       └────────release (write failed)────────▶ free

A page's payloads share one slot number (slot ``s`` of every payload's slab), so a page is the
unit of allocation and of GC. ``last_access`` is a logical clock bumped on every publish and
touch (never wall-clock time); GC takes live pages from the least recently used. The writer
thread is the only one that changes a pool; others read it under the store's lock.
"""

from __future__ import annotations

from collections import OrderedDict

from ..errors import PoolInvariantError


class SlotPool:
    """Free list, live pages in LRU order, and the slots being written, of ``num_slots``."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._live: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # hash -> (slot, clock)
        self._writing: set[int] = set()
        self.clock = 0

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_used(self) -> int:
        """Slots not free: live plus being written."""
        return self.num_slots - len(self._free)

    def slot_of(self, page_hash: bytes) -> int | None:
        found = self._live.get(page_hash)
        return found[0] if found is not None else None

    def live(self) -> list[tuple[bytes, int, int]]:
        """``(page hash, slot, last_access)`` of every live page, least recently used first."""
        return [(h, slot, last) for h, (slot, last) in self._live.items()]

    def coldest(self, n: int) -> list[tuple[bytes, int]]:
        """The ``n`` least recently used live pages ``(hash, slot)``, coldest first."""
        out: list[tuple[bytes, int]] = []
        for h, (slot, _) in self._live.items():
            if len(out) >= n:
                break
            out.append((h, slot))
        return out

    # -- transitions -----------------------------------------------------------------------------

    def alloc(self) -> int | None:
        """A free slot to write, or None when every slot is used."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._writing.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """A slot whose write failed goes back to the free list."""
        self._writing.remove(slot)
        self._free.append(slot)

    def publish(self, page_hash: bytes, slot: int) -> int:
        """The page's index entries are committed: the slot is live. Returns its last_access."""
        assert page_hash not in self._live, "a page is published twice"
        self._writing.remove(slot)
        self.clock += 1
        self._live[page_hash] = (slot, self.clock)
        return self.clock

    def touch(self, page_hash: bytes) -> tuple[int, int] | None:
        """Mark a live page most recently used; returns ``(slot, last_access)``, None if absent."""
        found = self._live.get(page_hash)
        if found is None:
            return None
        self.clock += 1
        self._live[page_hash] = (found[0], self.clock)
        self._live.move_to_end(page_hash)
        return found[0], self.clock

    def remove(self, page_hash: bytes) -> int:
        """The page's index entries are deleted: free its slot (returned)."""
        slot, _ = self._live.pop(page_hash)
        self._free.append(slot)
        return slot

    def rebuild(self, pages: list[tuple[bytes, int, int]]) -> None:
        """Start from ``(page hash, slot, last_access)`` live pages (a ``load`` cold start):
        the LRU follows last_access (page hash breaks ties), every other slot is free."""
        assert not self._live and not self._writing, "rebuild an unused pool only"
        ordered = sorted(pages, key=lambda p: (p[2], p[0]))
        taken = {slot for _, slot, _ in ordered}
        assert len(taken) == len(ordered), "two live pages in one slot"
        assert all(0 <= s < self.num_slots for s in taken)
        self._live = OrderedDict((h, (slot, last)) for h, slot, last in ordered)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in taken]
        self.clock = max((last for _, _, last in ordered), default=0)

    def check(self) -> None:
        """Free, writing and live slots partition ``[0, num_slots)``; clocks are consistent."""
        live_slots = [slot for slot, _ in self._live.values()]
        parts = [*self._free, *self._writing, *live_slots]
        if sorted(parts) != list(range(self.num_slots)):
            dup = len(parts) - len(set(parts))
            raise PoolInvariantError(
                f"disk slots: {len(self._free)} free + {len(self._writing)} writing + "
                f"{len(live_slots)} live != {self.num_slots} slots ({dup} handed out twice)"
            )
        clocks = [last for _, last in self._live.values()]
        if clocks != sorted(clocks) or (clocks and clocks[-1] > self.clock):
            raise PoolInvariantError("disk LRU order disagrees with last_access")
