"""Opening one group's slab files when a :class:`~kvstrata.tiers.disk_store.DiskStore` starts.

Run under the group's lock (nobody else creates or removes this group's files): the I/O mode
(O_DIRECT where the filesystem takes it), leftovers of a killed creation, the room the slabs
need (naming what other namespaces take, for ``disk gc``), and the slabs themselves, reused
where their geometry matches (``clear``) or opened as they are (``load``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import DiskStoreError
from .disk_dir import TEMP_NAME, group_name, list_groups
from .disk_events import log
from .disk_format import NO_SUPERBLOCK, SlabFile, SlabGeometry, probe_direct_io


def choose_io(io_mode: str, slab_dir: Path) -> str:
    """``direct`` or ``buffered``: what ``io_mode`` asks for and the filesystem allows (``auto``
    falls back to buffered I/O with a warning; ``direct`` refuses)."""
    if io_mode == "buffered":
        return "buffered"
    why = probe_direct_io(slab_dir)
    if why is None:
        return "direct"
    if io_mode == "direct":
        raise DiskStoreError(
            f"O_DIRECT is unavailable in {slab_dir} ({why}); use a filesystem that supports "
            "it or the buffered I/O mode"
        )
    log.warning(
        "disk tier: O_DIRECT unavailable in %s (%s); using buffered I/O + fdatasync",
        slab_dir,
        why,
    )
    return "buffered"


def remove_temps(slab_dir: Path, geoms: Sequence[SlabGeometry]) -> None:
    """Slabs whose creation a killed process of this group left half-made."""
    ours = {g.file_name() for g in geoms}
    for name in os.listdir(slab_dir):
        m = TEMP_NAME.match(name)
        if m is not None and m["final"] in ours:
            (slab_dir / name).unlink(missing_ok=True)


def check_room(
    root: Path, slab_dir: Path, geoms: Sequence[SlabGeometry], reuse: Sequence[bool]
) -> None:
    """Refuse, naming what to free, when the slabs not reused do not fit on the filesystem."""
    need = sum(g.file_bytes for g, kept in zip(geoms, reuse, strict=True) if not kept)
    st = os.statvfs(slab_dir)
    have = st.f_bavail * st.f_frsize
    for g, kept in zip(geoms, reuse, strict=True):
        if not kept and os.path.lexists(slab_dir / g.file_name()):
            have += os.lstat(slab_dir / g.file_name()).st_blocks * 512
    if need > have:
        mine = group_name(geoms[0].namespace, geoms[0].rank)
        others = [(g.nbytes(), g.name) for g in list_groups(root) if g.name != mine]
        stale = ""
        if others:
            listed = ", ".join(f"{n} {b / 2**30:.2f} GiB" for b, n in sorted(others)[::-1][:4])
            stale = (
                f"; other namespaces and ranks take {sum(b for b, _ in others) / 2**30:.2f} "
                f"GiB there ({listed}): 'kvstrata disk gc {root}' removes those not in use"
            )
        raise DiskStoreError(
            f"the disk tier needs {need / 2**30:.2f} GiB in {slab_dir}, which has "
            f"{have / 2**30:.2f} GiB free{stale}; lower the disk budget or free space"
        )


def open_clear(
    root: Path, slab_dir: Path, geoms: Sequence[SlabGeometry], direct: bool, out: list[SlabFile]
) -> None:
    """``start="clear"``: reuse each slab whose geometry matches and is whole, create the others;
    appended to ``out`` as they open (the caller closes them on failure)."""
    reuse = []
    for g in geoms:
        found, size = SlabFile.read_geometry(slab_dir / g.file_name())
        reuse.append(found == g and size >= g.file_bytes)
    check_room(root, slab_dir, geoms, reuse)
    for g, kept in zip(geoms, reuse, strict=True):
        path = slab_dir / g.file_name()
        out.append(SlabFile(path, g, direct) if kept else SlabFile.create(path, g, direct))


def open_load(
    root: Path, slab_dir: Path, geoms: Sequence[SlabGeometry], direct: bool, out: list[SlabFile]
) -> int:
    """``start="load"``: open each slab as it is (extending a truncated one), create the missing;
    appended to ``out`` as they open. Returns how many were truncated."""
    # A slab without a superblock (an older kvstrata killed while creating it) holds nothing:
    # it counts as absent and is created again.
    exists = [
        os.path.lexists(slab_dir / g.file_name())
        and SlabFile.read_geometry(slab_dir / g.file_name())[0] != NO_SUPERBLOCK
        for g in geoms
    ]
    check_room(root, slab_dir, geoms, exists)
    truncated = 0
    for g, found in zip(geoms, exists, strict=True):
        path = slab_dir / g.file_name()
        if found:
            slab, cut = SlabFile.open_existing(path, g, direct)
            truncated += int(cut)
        else:
            slab = SlabFile.create(path, g, direct)
        out.append(slab)
    return truncated
