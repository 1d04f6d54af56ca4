"""Opening one group's files when a :class:`~kvstrata.tiers.disk_store.DiskStore` starts.

:func:`size_group` turns the budget into slots per stripe; :class:`OpenGroup` opens the group
over its directories (``disk_layout.py``), each under the group's lock there (nobody else creates
or removes this group's files): the layout record (``disk_manifest.py``, checked on ``load``), the
I/O mode (O_DIRECT where every directory's filesystem takes it), leftovers of a killed creation,
the room the slabs need (naming what other namespaces take, for ``disk gc``), the index in the
home directory, and the slabs themselves, reused where their geometry matches (``clear``) or
opened as they are (``load``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError, DiskStoreError
from .disk_config import DiskConfig, watermark_slots
from .disk_dir import (
    SLAB_DIR,
    TEMP_NAME,
    group_name,
    index_dir,
    layout_path,
    list_groups,
    prepare_root,
    remove_index,
)
from .disk_events import log
from .disk_format import (
    ALIGN,
    NO_SUPERBLOCK,
    PACK_MAX_SLOT,
    SLOT_HEADER_BYTES,
    RankLock,
    SlabFile,
    SlabGeometry,
    lock_path,
    packable,
    probe_direct_io,
    slot_size,
)
from .disk_index import MAP_BYTES_PER_ENTRY, RESERVE_BYTES_PER_ENTRY, DiskIndex
from .disk_layout import Slab, stripe_slabs
from .disk_manifest import settle_layout
from .page_hash import Namespace


@dataclass(frozen=True)
class GroupSize:
    """One rank's slabs: ``geoms[stripe][kind]``, and its slots (all stripes) and watermarks."""

    geoms: list[list[SlabGeometry]]
    num_slots: int
    page_bytes: int  # disk bytes of one page, all payloads, headers and padding included
    high_slots: int
    low_slots: int


def size_group(namespace: Namespace, rank: int, config: DiskConfig, stripes: int) -> GroupSize:
    """The geometry ``config.budget_bytes`` buys over ``stripes`` directories (an even split:
    every stripe holds as many slots); refuses a budget too small for the watermarks."""
    num_payloads = len(namespace.payloads)
    sizes = [namespace.payload_bytes(k) for k in range(num_payloads)]
    packed = config.io_mode == "packed"
    if packed and not all(packable(n) for n in sizes):
        raise ConfigError(
            f"pages of {max(sizes):,} payload bytes are too large to pack (at most "
            f"{PACK_MAX_SLOT - SLOT_HEADER_BYTES:,} with the header); use --l3-io auto"
        )
    base = [
        SlabGeometry(namespace.digest, rank, k, num_payloads, p.name, sizes[k], 1, packed=packed)
        for k, p in enumerate(namespace.payloads)
    ]
    page_bytes = sum(g.slot_bytes for g in base)
    cost = sum(page_cost(n, config.io_mode) for n in sizes)
    per_stripe = max(0, (config.budget_bytes // stripes - num_payloads * ALIGN) // cost)
    num_slots = per_stripe * stripes
    high, low = watermark_slots(config, num_slots)
    if low < 1 or high <= low:
        least = stripes
        while not 1 <= watermark_slots(config, least)[1] < watermark_slots(config, least)[0]:
            least += stripes
        over = f" over {stripes} directories" if stripes > 1 else ""
        raise ConfigError(
            f"a disk budget of {config.budget_bytes:,} bytes holds {num_slots} pages of "
            f"{page_bytes:,} bytes{over}, too few for the watermarks; give it at least "
            f"{least * cost + stripes * num_payloads * ALIGN:,} bytes ({least} pages)"
        )
    geoms = [
        [replace(g, num_slots=per_stripe, stripe=j, stripes=stripes) for g in base]
        for j in range(stripes)
    ]
    return GroupSize(geoms, num_slots, page_bytes, high, low)


def page_cost(payload_len: int, io_mode: str) -> int:
    """Disk bytes of one payload's page under ``io_mode``: its slot, and with packed slots (which
    are smaller than the index's room for their entries) that room too."""
    if io_mode != "packed":
        return slot_size(payload_len)
    return slot_size(payload_len, packed=True) + RESERVE_BYTES_PER_ENTRY


class OpenGroup:
    """One rank's files over its directories ``dirs`` (home first): the locks, the layout
    record, the index (in the home), one slab per payload (``disk_layout.Slab``). :meth:`close`
    releases whatever was opened, also after a start that failed part way."""

    def __init__(
        self,
        namespace: Namespace,
        rank: int,
        config: DiskConfig,
        dirs: Sequence[Path],
        size: GroupSize,
    ) -> None:
        self.namespace, self.rank, self.config = namespace, rank, config
        self.dirs, self.size = tuple(dirs), size
        self.locks: list[RankLock] = []
        self.files: list[list[SlabFile]] = [[] for _ in dirs]  # [stripe][kind]
        self.slabs: list[Slab] = []
        self.index: DiskIndex | None = None
        self.io_mode = ""
        self.truncated = 0  # slabs a load start found short and extended

    def open(self) -> None:
        ns, rank, cfg, dirs = self.namespace.digest, self.rank, self.config, self.dirs
        for d in dirs:
            prepare_root(d)  # a marked directory of kvstrata's (or refused), 0700
        # The locks first: also the check that each directory is writable at all. Nothing of
        # this group is read or written before they are held.
        for d in dirs:
            self.locks.append(RankLock(lock_path(d / SLAB_DIR, ns, rank)))
        for d, geoms in zip(dirs, self.size.geoms, strict=True):
            remove_temps(
                d / SLAB_DIR, [g.file_name() for g in geoms] + [layout_path(d, ns, rank).name]
            )
        settle_layout(dirs, cfg.roots, ns, rank, cfg.start)  # a load given other dirs: refused
        if self.size.geoms[0][0].packed:  # packed slots share 4 KiB blocks: the page cache
            self.io_mode = "packed"
        else:
            modes = {choose_io(cfg.io_mode, d / SLAB_DIR) for d in dirs}
            self.io_mode = "direct" if modes == {"direct"} else "buffered"
        path = index_dir(dirs[0], ns, rank)
        if cfg.start == "clear":  # whatever state it was in: clear always starts
            for d in dirs:  # a stripe's directory was the home of an earlier layout: its index
                if index_dir(d, ns, rank).exists():
                    remove_index(index_dir(d, ns, rank))
        entries = self.size.num_slots * len(self.namespace.payloads)
        self.index = DiskIndex(path, map_size=entries * MAP_BYTES_PER_ENTRY)
        self.index.reserve(max(entries * RESERVE_BYTES_PER_ENTRY, 1 << 20))
        direct = self.io_mode == "direct"
        for d, geoms, out in zip(dirs, self.size.geoms, self.files, strict=True):
            if cfg.start == "clear":
                open_clear(d, d / SLAB_DIR, geoms, direct, out)
            else:
                self.truncated += open_load(d, d / SLAB_DIR, geoms, direct, out)
        self.slabs = stripe_slabs(self.files)
        if cfg.start == "clear":
            self.index.clear(ns, rank)

    def close(self) -> None:
        for files in self.files:
            for slab in files:
                slab.close()
        self.files = [[] for _ in self.dirs]
        self.slabs = []
        if self.index is not None:
            self.index.close()
            self.index = None
        for lock in self.locks:
            lock.release()
        self.locks = []


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


def remove_temps(slab_dir: Path, finals: Sequence[str]) -> None:
    """Files of this group (named ``finals``) whose creation a killed process left half-made."""
    ours = set(finals)
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
