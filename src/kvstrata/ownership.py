"""Page ownership under context parallelism, as pure functions (docs/design.md, "Ownership").

::

    sequence pages   p0  p1  p2  p3  p4  p5  p6      owner(p) = p % cp_size
    cp_size = 3      r0  r1  r2  r0  r1  r2  r0

    logical pages    L0  L1  L2  L3  L4  L5  ...     lane(L) = L % cp_size
    rank-local slot   0   0   0   1   1   1  ...     slot(L) = L // cp_size

A page at sequence position ``p`` must be stored in a logical page whose lane equals
``owner(p)``; its bytes live in slot ``slot(L)`` of rank ``owner(p)``. None of this depends on
chunking, on the request that computed the page, or on the tier.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .errors import ConfigError

IntArray = npt.NDArray[np.int64]


def _check_cp(cp_size: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ConfigError(f"cp_size must be >= 1, got {cp_size}")


def owner(position: int, cp_size: int) -> int:
    """The rank that computes and stores the page at sequence position ``position``."""
    _check_cp(cp_size)
    if position < 0:
        raise ConfigError(f"page position must be >= 0, got {position}")
    return position % cp_size


def owners(start_position: int, num_pages: int, cp_size: int) -> IntArray:
    """Owners of ``num_pages`` consecutive sequence pages starting at ``start_position``."""
    _check_cp(cp_size)
    if start_position < 0 or num_pages < 0:
        raise ConfigError(
            f"page positions must be >= 0, got start {start_position} and count {num_pages}"
        )
    return np.arange(start_position, start_position + num_pages, dtype=np.int64) % cp_size


def lane(logical_page: int | IntArray, cp_size: int) -> int | IntArray:
    """The owner rank (lane) of a logical page: pages are striped round-robin over lanes."""
    _check_cp(cp_size)
    return logical_page % cp_size


def slot(logical_page: int | IntArray, cp_size: int) -> int | IntArray:
    """The rank-local slot that stores a logical page on its owner."""
    _check_cp(cp_size)
    return logical_page // cp_size


def logical_page(rank: int | IntArray, local_slot: int | IntArray, cp_size: int) -> int | IntArray:
    """Inverse of (lane, slot): the logical page stored in ``local_slot`` of ``rank``."""
    _check_cp(cp_size)
    return local_slot * cp_size + rank


def page_span(valid_len: int, page_size: int) -> int:
    """Pages covering ``valid_len`` tokens (the padded span, in pages)."""
    return -(-valid_len // page_size)
