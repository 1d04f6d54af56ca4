"""The disk tier's fsck: slabs against the index, every inconsistency named, optionally repaired.

A directory is *clean* when every index entry belongs to a complete slab group (the slabs of one
namespace and rank, one per payload, with valid superblocks and full length), and every page the
index names checks out (``disk_audit_group.audit_group``). A group whose slots are striped over
several directories (``disk_layout.py``) is audited whole when all of them are given (its stripes
are found by their layout records, ``disk_manifest.py``, and its index is the first's); given
without some of them it is reported (``group-split``) and left alone, never repaired by halves.

Repair never invents data: it deletes the index entries of pages that do not check out (so they
read as misses), extends truncated slabs, removes slab files of kvstrata's name pattern that are
not valid slabs or belong to an incomplete group, removes an index a stripe's directory holds
besides the group's home, and rebuilds a damaged index from the slot headers (a page is entered
only where every payload's slot holds its header and an intact payload). Every group is audited
under its rank lock in each of its directories, taken without waiting: a group whose lock a
store holds is reported as in use and left alone, and a group that appears meanwhile is not
judged. Without ``fix`` nothing under the directories is written, not even a lock file.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from ..errors import DiskStoreError
from .disk_audit_group import GroupAudit, Problem, audit_group, group_where, rebuild_index
from .disk_dir import (
    INDEX_DIR,
    SLAB_DIR,
    GroupFiles,
    foreign_files,
    list_groups,
    prepare_root,
    remove_index,
)
from .disk_format import RankLock, SlabFile, SlabGeometry, lock_path
from .disk_index import DiskIndex, decode_key, decode_value
from .disk_layout import Slab, check_roots, stripe_slabs
from .disk_manifest import Layout, read_layout

__all__ = [
    "INDEX_DIR",
    "SLAB_DIR",
    "AuditReport",
    "GroupAudit",
    "Problem",
    "audit_directories",
    "audit_directory",
    "audit_group",
]

#: One slab file found: its path, the geometry its superblock describes, its size.
_Found = tuple[Path, SlabGeometry, int]


@dataclass
class AuditReport:
    """What ``kvstrata disk check`` found under its directories (``root``: the first)."""

    root: Path
    groups: list[GroupAudit] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    in_use: list[str] = field(default_factory=list)  # groups a store holds: not checked
    fixed: bool = False
    roots: tuple[Path, ...] = ()

    @property
    def all_problems(self) -> list[Problem]:
        return [*self.problems, *(p for g in self.groups for p in g.problems)]

    @property
    def clean(self) -> bool:
        return not self.all_problems


def _open_group(
    where: str,
    files: dict[int, dict[int, _Found]],
    report: AuditReport,
    fix: bool,
) -> list[Slab] | None:
    """The group's slabs in kind order (``files[kind][stripe]``), or None (with problems
    recorded) when it is unusable."""
    found = [f for per in files.values() for f in per.values()]
    counts = {g.num_payloads for _, g, _ in found}
    slots = {g.num_slots for _, g, _ in found}
    stripes = {g.stripes for _, g, _ in found}
    num_payloads, k = max(counts), max(stripes)
    if (
        len(counts) != 1
        or len(slots) != 1
        or set(files) != set(range(num_payloads))
        or any(set(per) != set(range(k)) for per in files.values())
    ):
        each = {kind: sorted(per) for kind, per in files.items()}
        report.problems.append(
            Problem(
                "group-incomplete",
                where,
                f"slabs for payload kinds {sorted(files)} of {sorted(counts)}, slot counts "
                f"{sorted(slots)}" + (f", stripes {each} of {k}" if k > 1 else ""),
            )
        )
        if fix:
            for path, _, _ in found:
                path.unlink(missing_ok=True)
        return None
    parts: list[list[SlabFile]] = [[] for _ in range(k)]  # [stripe][kind]
    for kind in range(num_payloads):
        for j in range(k):
            path, geom, size = files[kind][j]
            if size < geom.file_bytes:
                report.problems.append(
                    Problem("slab-truncated", str(path), f"{size} bytes of {geom.file_bytes}")
                )
                if fix:
                    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                    try:
                        os.posix_fallocate(fd, 0, geom.file_bytes)
                    finally:
                        os.close(fd)
            parts[j].append(SlabFile(path, geom, direct=False, readonly=not fix))
    return stripe_slabs(parts)


def _read_slabs(
    group: GroupFiles, report: AuditReport, fix: bool
) -> dict[tuple[bytes, int], dict[int, tuple[Path, SlabGeometry, int]]]:
    """The group's valid slabs by (namespace, rank) and kind; the others reported (and, with
    ``fix``, removed when they are regular files of kvstrata's pattern)."""
    found: dict[tuple[bytes, int], dict[int, tuple[Path, SlabGeometry, int]]] = defaultdict(dict)
    for path in group.slabs:
        geom, size = SlabFile.read_geometry(path)
        if isinstance(geom, str) and ("symbolic link" in geom or "not a regular" in geom):
            report.problems.append(Problem("not-regular", str(path), f"{geom}; left alone"))
            continue
        if isinstance(geom, str) or path.name != geom.file_name():
            why = geom if isinstance(geom, str) else f"its superblock names {geom.file_name()}"
            report.problems.append(Problem("slab-superblock", str(path), why))
            if fix:
                path.unlink()
            continue
        found[(geom.namespace, geom.rank)][geom.payload_kind] = (path, geom, size)
    for path in group.temps:
        report.problems.append(
            Problem("slab-temp", str(path), "a slab whose creation never finished")
        )
        if fix:
            path.unlink(missing_ok=True)
    return found


def _audit_index(
    group: GroupFiles,
    slabs: list[Slab] | None,
    ns: bytes | None,
    report: AuditReport,
    fix: bool,
    payload: bool,
) -> None:
    """Audit (and with ``fix`` repair) the group's index against its slabs."""
    assert group.index is not None
    try:
        index = DiskIndex(group.index, readonly=not fix)
    except DiskStoreError as err:
        _damaged(group, slabs, report, fix, str(err))
        return
    try:
        if slabs is not None and ns is not None:
            report.groups.append(
                audit_group(index, ns, group.rank, slabs, payload=payload, fix=fix)
            )
        stray = []
        for key, value in index.items():
            decoded, found = decode_key(key), decode_value(value)
            if decoded is None or found is None:
                report.problems.append(
                    Problem(
                        "entry-malformed",
                        f"key {key.hex()[:32]}",
                        f"{len(key)}-byte key, {len(value)}-byte value",
                    )
                )
                stray.append(key)
            elif slabs is None or decoded[0] != ns or found[1] != group.rank:
                report.problems.append(
                    Problem(
                        "entry-orphan",
                        group_where(decoded[0], found[1], found[0]),
                        "no complete slab group for this namespace and rank",
                    )
                )
                stray.append(key)
        if fix and stray:
            index.delete_keys(stray)
    except lmdb.Error as err:
        index.close()
        _damaged(group, slabs, report, fix, f"{group.index}: {str(err).strip()[:200]}")
        return
    index.close()


def _damaged(
    group: GroupFiles, slabs: list[Slab] | None, report: AuditReport, fix: bool, why: str
) -> None:
    """A group's index that LMDB cannot read: reported; with ``fix``, rebuilt from the slabs
    (or removed when the group has none: no page of it can be served anyway)."""
    assert group.index is not None
    detail = why.split("; run 'kvstrata")[0].removeprefix(f"the disk index {group.index} is ")
    if not fix:
        report.problems.append(Problem("index-damaged", str(group.index), detail))
        return
    remove_index(group.index)
    rebuilt = 0
    if slabs is not None:
        index = DiskIndex(group.index)
        try:
            rebuilt = rebuild_index(index, slabs)
        finally:
            index.close()
    report.problems.append(
        Problem(
            "index-damaged",
            str(group.index),
            f"{detail}; rebuilt from the slot headers ({rebuilt} pages)",
        )
    )


def _audit_group_files(
    dirs: Sequence[Path], name: str, report: AuditReport, *, fix: bool, payload: bool
) -> None:
    """One group over its directories ``dirs`` (its home first), under its rank lock in each
    (tried, never waited for)."""
    ns_hex, rank = name.rsplit("-r", 1)
    locks: list[RankLock] = []
    try:
        for d in dirs:
            try:
                locks.append(
                    RankLock(lock_path(d / SLAB_DIR, bytes.fromhex(ns_hex), int(rank)), not fix)
                )
            except DiskStoreError:
                report.in_use.append(name)
                return
        # Listed again under the locks: what a store did before it let go counts, nothing after.
        groups = [next((g for g in list_groups(d) if g.name == name), None) for d in dirs]
        home = groups[0]
        if home is None:
            return
        merged: dict[tuple[bytes, int], dict[int, dict[int, _Found]]] = defaultdict(
            lambda: defaultdict(dict)
        )
        for j, group in enumerate(groups):
            for key, per_kind in _read_slabs(group, report, fix).items() if group else ():
                for kind, (path, geom, size) in per_kind.items():
                    if (geom.stripe, geom.stripes) != (j, len(dirs)):
                        report.problems.append(
                            Problem(
                                "group-split",
                                str(path),
                                f"stripe {geom.stripe} of {geom.stripes}, checked as the "
                                f"{j}-th of {len(dirs)} directories: give the group's "
                                "directories together, in its order; left alone",
                            )
                        )
                        return
                    merged[key][kind][j] = (path, geom, size)
        for j, group in enumerate(groups[1:], start=1):
            if group is not None and group.index is not None:
                report.problems.append(
                    Problem(
                        "index-stray",
                        str(group.index),
                        f"an index in stripe {j}'s directory; the group's is in {dirs[0]}",
                    )
                )
                if fix:
                    remove_index(group.index)
        slabs: list[Slab] | None = None
        ns: bytes | None = None
        for (group_ns, group_rank), files in sorted(merged.items()):
            where = group_where(group_ns, group_rank)
            opened = _open_group(where, files, report, fix)
            if opened is not None and slabs is None:
                slabs, ns = opened, group_ns
            elif opened is not None:  # two namespaces behind one 64-bit prefix: not ours to judge
                report.problems.append(Problem("group-ambiguous", where, "a second namespace"))
                for slab in opened:
                    slab.close()
        try:
            if home.index is not None:
                _audit_index(home, slabs, ns, report, fix, payload)
        finally:
            for slab in slabs or []:
                slab.close()
    finally:
        for lock in locks:
            lock.release()


def _units(roots: Sequence[Path], report: AuditReport) -> list[tuple[tuple[Path, ...], str]]:
    """``(directories, group name)`` to audit: a group alone in each directory that holds it,
    except the stripes of one store (their layout records name the same store), audited
    together, home first, when every stripe is among ``roots`` (else reported, left alone)."""
    listed = {r: {g.name: g for g in list_groups(r)} for r in roots}
    units: list[tuple[tuple[Path, ...], str]] = []
    for name in sorted({n for groups in listed.values() for n in groups}):
        holders = [r for r in roots if name in listed[r]]
        records: dict[Path, Layout | None] = {}
        for r in holders:
            path = listed[r][name].layout
            try:
                records[r] = read_layout(path) if path is not None else None
            except DiskStoreError as err:
                detail = str(err).split("; ")[0].removeprefix(f"{path} is ")
                report.problems.append(Problem("layout-malformed", str(path), detail))
                records[r] = None
        placed: set[Path] = set()
        for r in holders:
            rec = records[r]
            if r in placed:
                continue
            if rec is None or rec.stripes == 1:
                units.append(((r,), name))
                continue
            members = {
                q_rec.stripe: q
                for q in holders
                if (q_rec := records[q]) is not None
                and (q_rec.store, q_rec.stripes)
                == (
                    rec.store,
                    rec.stripes,
                )
            }
            placed |= set(members.values())
            if set(members) == set(range(rec.stripes)):
                units.append((tuple(members[j] for j in range(rec.stripes)), name))
                continue
            missing = ", ".join(rec.dirs[j] for j in range(rec.stripes) if j not in members)
            report.problems.append(
                Problem(
                    "group-split",
                    f"{name} in {r}",
                    f"its slots are striped over {', '.join(rec.dirs)}; {missing} not given: "
                    f"check them together (kvstrata disk check {' '.join(rec.dirs)}); left alone",
                )
            )
    return units


def audit_directories(
    roots: Sequence[Path], *, fix: bool = False, payload: bool = True
) -> AuditReport:
    """Audit every slab group and index entry under ``roots`` (disk tier directories; a group
    striped over several is audited whole). Without ``fix`` nothing is written; a group in use
    by a store is listed in ``in_use``, unchecked."""
    paths = check_roots(roots)
    for root in paths:
        prepare_root(root, create=False)
    report = AuditReport(paths[0], roots=paths)
    for root in paths:
        for path in foreign_files(root):
            report.problems.append(
                Problem("foreign-file", str(path), "not a name kvstrata writes; left alone")
            )
    for dirs, name in _units(paths, report):
        _audit_group_files(dirs, name, report, fix=fix, payload=payload)
    report.fixed = fix
    return report


def audit_directory(root: Path, *, fix: bool = False, payload: bool = True) -> AuditReport:
    """:func:`audit_directories` of one directory."""
    return audit_directories([root], fix=fix, payload=payload)
