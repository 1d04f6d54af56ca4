"""Several disks per machine: which directories hold one rank's slabs, and its slots striped over
them.

A disk tier is given directories ``roots``, one per drive (``--l3-dir`` repeated), and ranks map
to them as DESIGN says (:func:`rank_roots`)::

    cp_size >= n (n = len(roots)):  rank r uses roots[r % n]                  (ranks share a drive)
    cp_size <  n:                   rank r uses roots[r], roots[r + cp_size], ...   (striped)

A rank given k > 1 directories stripes its slots over them one slot at a time: global slot ``s``
is slot ``s // k`` of the slab file in its ``s % k``-th directory (:class:`StripedSlab`). The
slot pool hands out runs of consecutive global slots, so the pages of one spill batch or one read
are k runs of consecutive slots, one per drive (:func:`stripe_runs`), written and read at once on
``k`` times the threads: a batch keeps every drive busy, and throughput is bounded by the number
of drives. The rank's budget is split evenly (every stripe holds as many slots). The first
directory is the rank's *home*: its index lives there (the one truth for every stripe); each
directory holds the rank's lock and a layout record (``disk_manifest.py``), so that a restart
given other directories, or the same in another order, is refused instead of reading nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .disk_format import MAX_STRIPES, SlabFile


def check_roots(roots: Sequence[Path | str]) -> tuple[Path, ...]:
    """The directories as paths; refuses none, more than :data:`MAX_STRIPES`, one given twice,
    and one inside another (their names would clash, and one drive's pages would land on the
    other's), comparing them with links resolved."""
    paths = tuple(Path(r) for r in roots)
    if not paths:
        raise ConfigError("the disk tier needs a directory (--l3-dir)")
    if len(paths) > MAX_STRIPES:
        raise ConfigError(
            f"the disk tier takes at most {MAX_STRIPES} directories, got {len(paths)}"
        )
    real = [Path(os.path.realpath(p)) for p in paths]
    for i, a in enumerate(real):
        for j in range(i + 1, len(real)):
            b = real[j]
            if a == b:
                raise ConfigError(
                    f"disk tier directories {paths[i]} and {paths[j]} are the same directory; "
                    "give each drive's directory once (--l3-dir DIR per drive)"
                )
            if a.is_relative_to(b) or b.is_relative_to(a):
                inner, outer = (paths[i], paths[j]) if a.is_relative_to(b) else (paths[j], paths[i])
                raise ConfigError(
                    f"disk tier directory {inner} lies inside {outer}; give directories side "
                    "by side (one per drive), not one inside another"
                )
    return paths


def rank_roots(num_roots: int, rank: int, cp_size: int) -> tuple[int, ...]:
    """The positions in ``roots`` of rank ``rank``'s directories, its home first."""
    assert num_roots >= 1 and 0 <= rank < cp_size
    if cp_size >= num_roots:
        return (rank % num_roots,)
    return tuple(range(rank, num_roots, cp_size))


def stripe_runs(slots: Sequence[int], stripes: int, max_pages: int) -> list[Sequence[int]]:
    """Positions in ``slots`` grouped into *runs*: pages whose slots follow each other within one
    stripe (``s``, ``s + stripes``, ...: one vectored call on one file), at most ``max_pages``
    each; each run in page order, and the runs of different stripes interleaved (the i-th run of
    every stripe before the (i+1)-th of any), so that the runs in flight keep every drive busy.
    With one stripe: the runs of consecutive slots, in page order, as ``range``s (found with one
    array pass: a reload's thousands of pages cost no Python step each)."""
    if stripes == 1:
        if not slots:
            return []
        cuts = (np.flatnonzero(np.diff(np.asarray(slots, dtype=np.int64)) != 1) + 1).tolist()
        runs: list[Sequence[int]] = []
        start = 0
        for end in [*cuts, len(slots)]:
            runs += [range(s, min(s + max_pages, end)) for s in range(start, end, max_pages)]
            start = end
        return runs
    by_stripe: dict[int, list[list[int]]] = {}
    for i, slot in enumerate(slots):
        found = by_stripe.setdefault(slot % stripes, [])
        if found and slot == slots[found[-1][-1]] + stripes and len(found[-1]) < max_pages:
            found[-1].append(i)
        else:
            found.append([i])
    order = sorted(
        ((n, run[0], run) for found in by_stripe.values() for n, run in enumerate(found)),
        key=lambda t: (t[0], t[1]),
    )
    return [run for _, _, run in order]


def stripe_slabs(files: Sequence[Sequence[SlabFile]]) -> list[Slab]:
    """One slab per payload from ``files[stripe][kind]``: the file itself with one stripe."""
    if len(files) == 1:
        return list(files[0])
    return [StripedSlab([per[k] for per in files]) for k in range(len(files[0]))]


class StripedSlab:
    """One payload's slab over the files of a rank's directories, in global slots.

    ``geometry`` is the first file's with ``num_slots`` counting every stripe's (its slot size,
    payload and name are every file's). :meth:`read_run` / :meth:`write_run` move the slots
    ``first, first + stripes, ...``: consecutive slots of one file, one vectored call. With one
    file it is that file, slot for slot.
    """

    def __init__(self, files: Sequence[SlabFile]) -> None:
        assert files
        self.files = list(files)
        self.stripes = k = len(files)
        first = files[0].geometry
        for j, f in enumerate(files):
            assert f.geometry == replace(first, stripe=j, stripes=k), "stripes of one slab differ"
        self.geometry = replace(first, num_slots=first.num_slots * k)
        self.path = files[0].path

    def _at(self, slot: int) -> tuple[SlabFile, int]:
        assert 0 <= slot < self.geometry.num_slots, f"slot {slot} outside the slab"
        return self.files[slot % self.stripes], slot // self.stripes

    def read_slot(self, slot: int, buf: memoryview) -> int:
        file, local = self._at(slot)
        return file.read_slot(local, buf)

    def write_slot(self, slot: int, buf: memoryview) -> None:
        file, local = self._at(slot)
        file.write_slot(local, buf)

    def read_run(self, first: int, bufs: list[memoryview]) -> int:
        """``SlabFile.read_slots`` of slots ``first, first + stripes, ...`` (one file)."""
        file, local = self._at(first)
        return file.read_slots(local, bufs)

    def write_run(self, first: int, bufs: list[memoryview]) -> None:
        """``SlabFile.write_slots`` of slots ``first, first + stripes, ...`` (one file)."""
        file, local = self._at(first)
        file.write_slots(local, bufs)

    def sync(self) -> None:
        for file in self.files:
            file.sync()

    def close(self) -> None:
        for file in self.files:
            file.close()


#: One payload's slab: its file, or its files over several directories.
Slab = SlabFile | StripedSlab
