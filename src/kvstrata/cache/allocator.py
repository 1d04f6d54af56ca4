"""The replicated page allocator of one tier (DESIGN.md, "Ownership" and "Replicated state").

The logical page space ``[0, num_pages)`` is striped over ``cp_size`` lanes: page ``L`` belongs to
lane ``L % cp_size`` and lives in slot ``L // cp_size`` of that rank. Each lane keeps its free pages
as a stack. Every rank runs an identical allocator and feeds it the identical operation sequence, so
the free lists — and :meth:`PageAllocator.digest` — agree on every rank.

``alloc_pages_with_owners(owners)`` hands out, for each requested sequence position, a page of the
lane that owns it; it is all-or-nothing, and a short lane is a *deficit* that eviction must fill.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from ..config import PoolConfig
from ..errors import (
    AllocatorError,
    DoubleFreeError,
    ForeignPageError,
    UnknownPageError,
)

IntArray = npt.NDArray[np.int64]


class PageAllocator:
    """Free lists of one tier's logical pages, one stack per lane."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.cp_size = cp = config.cp_size
        self.num_pages = n = config.num_pages
        per_lane = config.slots_per_rank
        # Stack of lane l holds pages l, l+cp, ...; popped from the top (highest index first
        # reversed so that the lowest pages go out first).
        self._stacks = np.full((cp, per_lane), -1, dtype=np.int64)
        self._tops = np.zeros(cp, dtype=np.int64)
        for lane in range(cp):
            pages = np.arange(lane, n, cp, dtype=np.int64)[::-1]
            self._stacks[lane, : pages.size] = pages
            self._tops[lane] = pages.size
        self._lane_sizes = self._tops.copy()
        self._free = np.ones(n, dtype=np.bool_)
        self._stamp = np.zeros(n, dtype=np.int64)  # scratch for duplicate detection in free()

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return int(self._tops.sum())

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def free_per_lane(self) -> IntArray:
        """Free pages in each lane (a copy)."""
        return self._tops.copy()

    def deficit(self, owners: IntArray) -> IntArray:
        """Per lane, how many more pages ``alloc_pages_with_owners(owners)`` needs than are free."""
        need = self._lane_counts(owners)
        return np.maximum(need - self._tops, 0)

    def is_free(self, pages: IntArray) -> npt.NDArray[np.bool_]:
        self._check_known(pages)
        return self._free[pages]

    # -- alloc / free ----------------------------------------------------------------------------

    def alloc_pages_with_owners(self, owners: IntArray) -> IntArray | None:
        """One page per entry of ``owners`` whose lane equals that owner, or ``None`` if any lane
        is short (nothing is taken then). ``owners`` are ranks in ``[0, cp_size)``."""
        owners = np.asarray(owners)
        if owners.ndim != 1 or (owners.size and owners.dtype.kind not in "iu"):
            raise AllocatorError(
                f"owners must be a 1-D integer array of ranks, got {owners.dtype} {owners.shape}"
            )
        k = owners.size
        if k == 0:
            return np.empty(0, dtype=np.int64)
        need = self._lane_counts(owners)
        if np.any(need > self._tops):
            return None
        if self.cp_size == 1:
            return self._pop(0, k)
        out = np.empty(k, dtype=np.int64)
        for lane in np.flatnonzero(need):
            out[owners == lane] = self._pop(int(lane), int(need[lane]))
        return out

    def _lane_counts(self, owners: IntArray) -> IntArray:
        """Pages wanted per lane; owners outside ``[0, cp_size)`` are a contract violation."""
        if owners.size and (int(owners.min()) < 0 or int(owners.max()) >= self.cp_size):
            bad = int(owners.min()) if int(owners.min()) < 0 else int(owners.max())
            raise AllocatorError(
                f"owner {bad} is outside [0, {self.cp_size}) for cp_size={self.cp_size}"
            )
        return np.bincount(owners, minlength=self.cp_size)

    def _pop(self, lane: int, k: int) -> IntArray:
        """Take the ``k`` pages on top of ``lane``'s stack (the caller checked they exist)."""
        top = int(self._tops[lane])
        out = self._stacks[lane, top - k : top][::-1].copy()
        self._tops[lane] = top - k
        self._free[out] = False
        return out

    def alloc(self, start_position: int, num_pages: int) -> IntArray | None:
        """Pages for sequence positions ``start_position .. start_position + num_pages - 1``, or
        ``None`` if a lane is short. Counts and positions must be integers >= 0."""
        for name, value in (("start_position", start_position), ("num_pages", num_pages)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise AllocatorError(f"alloc: {name} must be an integer >= 0, got {value!r}")
        if self.cp_size == 1:  # one lane: the owners are all 0, no need to spell them out
            return self._pop(0, num_pages) if num_pages <= self._tops[0] else None
        owners = (
            np.arange(start_position, start_position + num_pages, dtype=np.int64) % self.cp_size
        )
        return self.alloc_pages_with_owners(owners)

    def free(self, pages: IntArray, owners: IntArray | None = None) -> None:
        """Return pages to their lanes. With ``owners``, each page must belong to that owner's
        lane. Raises on unknown pages, pages already free, pages listed twice, or foreign pages."""
        pages = np.asarray(pages)
        if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "iu"):
            raise AllocatorError(f"free: pages must be a 1-D integer array, got {pages.dtype}")
        if pages.size == 0:
            return
        self._check_known(pages)
        lanes = pages % self.cp_size
        if owners is not None and np.any(lanes != owners):
            i = int(np.flatnonzero(lanes != owners)[0])
            raise ForeignPageError(
                f"page {int(pages[i])} belongs to lane {int(lanes[i])}, not to owner {int(owners[i])}"
            )
        if np.any(self._free[pages]):
            bad = int(pages[np.flatnonzero(self._free[pages])[0]])
            raise DoubleFreeError(f"page {bad} is already free")
        if pages.size > 1:
            # Each page writes its own index; a page listed twice keeps only its last index.
            order = np.arange(pages.size, dtype=np.int64)
            self._stamp[pages] = order
            if not np.array_equal(self._stamp[pages], order):
                raise DoubleFreeError("the same page is listed twice in one free() call")
        self._free[pages] = True
        if self.cp_size == 1:
            top = int(self._tops[0])
            self._stacks[0, top : top + pages.size] = pages
            self._tops[0] = top + pages.size
            return
        for lane in range(self.cp_size):
            mine = pages[lanes == lane]
            top = int(self._tops[lane])
            self._stacks[lane, top : top + mine.size] = mine
            self._tops[lane] = top + mine.size

    def _check_known(self, pages: IntArray) -> None:
        if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= self.num_pages):
            bad = int(pages.min()) if int(pages.min()) < 0 else int(pages.max())
            raise UnknownPageError(f"page {bad} is outside this allocator's [0, {self.num_pages})")

    # -- replication and invariants -------------------------------------------------------------

    def digest(self) -> str:
        """SHA-256 over the full allocator state: geometry and every lane's free stack in order."""
        h = hashlib.sha256()
        h.update(np.array([self.num_pages, self.cp_size], dtype=np.int64).tobytes())
        for lane in range(self.cp_size):
            top = int(self._tops[lane])
            h.update(np.int64(top).tobytes())
            h.update(self._stacks[lane, :top].tobytes())
        return h.hexdigest()

    def check(self) -> None:
        """Verify: free + used = total, every free page is in its own lane once, the mask agrees."""
        seen = np.zeros(self.num_pages, dtype=np.int64)
        for lane in range(self.cp_size):
            top = int(self._tops[lane])
            if not 0 <= top <= self._lane_sizes[lane]:
                raise AllocatorError(
                    f"lane {lane}: top {top} outside [0, {self._lane_sizes[lane]}]"
                )
            stack = self._stacks[lane, :top]
            if np.any(stack % self.cp_size != lane):
                raise AllocatorError(f"lane {lane} holds a page of another lane")
            np.add.at(seen, stack, 1)
        if np.any(seen > 1):
            raise AllocatorError(f"page {int(np.flatnonzero(seen > 1)[0])} is free twice")
        if not np.array_equal(seen.astype(np.bool_), self._free):
            raise AllocatorError("free mask disagrees with the free stacks")
        if self.num_free + self.num_used != self.num_pages:
            raise AllocatorError("free + used != total")
