"""The disk tier's fsck: slabs against the index, every inconsistency named, optionally repaired.

A directory is *clean* when every index entry belongs to a complete slab group (the slabs of one
namespace and rank, one per payload, with valid superblocks and full length), and every page the
index names has all its payloads in one slot inside the slab, no other page in that slot, and a
slot header (and, unless ``payload=False``, a payload CRC) that checks out. Free slots holding
stale bytes are not a problem: a slot no entry names is free by definition.

Repair never invents data: it deletes the index entries of pages that do not check out (so they
read as misses), extends truncated slabs, removes slab files of kvstrata's name pattern that are
not valid slabs or belong to an incomplete group, and rebuilds a damaged index from the slot
headers (a page is entered only where every payload's slot holds its header and an intact
payload). Every group is audited under its rank lock, taken without waiting: a group whose lock
a store holds is reported as in use and left alone, and a group that appears meanwhile is not
judged. Without ``fix`` nothing under the directory is written, not even a lock file. The same
group audit serves ``load`` cold starts (headers only, repairing) and ``DiskStore.check``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from ..errors import DiskStoreError
from .disk_dir import (
    INDEX_DIR,
    SLAB_DIR,
    GroupFiles,
    foreign_files,
    list_groups,
    prepare_root,
    remove_index,
)
from .disk_format import (
    ALIGN,
    RankLock,
    SlabFile,
    SlabGeometry,
    aligned_buffer,
    check_slot,
    decode_slot_header,
    lock_path,
)
from .disk_index import DiskIndex, decode_key, decode_value

__all__ = ["INDEX_DIR", "SLAB_DIR", "AuditReport", "GroupAudit", "Problem", "audit_directory"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One inconsistency: a short ``kind`` code, where it is, and what is wrong."""

    kind: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind:<17} {self.where}: {self.detail}"


@dataclass
class GroupAudit:
    """The audit of one (namespace, rank): its valid pages and what was wrong."""

    namespace: bytes
    rank: int
    num_payloads: int
    num_slots: int
    pages: list[tuple[bytes, int, int]] = field(default_factory=list)  # (hash, slot, last_access)
    problems: list[Problem] = field(default_factory=list)


@dataclass
class AuditReport:
    """What ``kvstrata disk check`` found under one directory."""

    root: Path
    groups: list[GroupAudit] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    in_use: list[str] = field(default_factory=list)  # groups a store holds: not checked
    fixed: bool = False

    @property
    def all_problems(self) -> list[Problem]:
        return [*self.problems, *(p for g in self.groups for p in g.problems)]

    @property
    def clean(self) -> bool:
        return not self.all_problems


def _where(ns: bytes, rank: int, page_hash: bytes | None = None) -> str:
    out = f"ns {ns.hex()[:16]} rank {rank}"
    return out + (f" page {page_hash.hex()[:16]}" if page_hash is not None else "")


def audit_group(
    index: DiskIndex,
    namespace: bytes,
    rank: int,
    slabs: Sequence[SlabFile],
    *,
    payload: bool,
    fix: bool,
) -> GroupAudit:
    """Check every index entry of ``(namespace, rank)`` against its slabs (one per payload, in
    kind order); with ``fix``, delete the entries of every page that fails."""
    num_payloads, num_slots = len(slabs), slabs[0].geometry.num_slots
    audit = GroupAudit(namespace, rank, num_payloads, num_slots)
    # slot -> kind -> (page hash, last_access), with each entry's key (the index is by slot)
    at_slot: dict[int, dict[int, tuple[bytes, int]]] = defaultdict(dict)
    keys: dict[int, list[bytes]] = defaultdict(list)
    for key, value in index.items(namespace):
        decoded, found = decode_key(key), decode_value(value)
        if decoded is not None and found is not None and found[1] == rank:
            at_slot[decoded[1]][decoded[2]] = (found[0], found[2])
            keys[decoded[1]].append(key)
    bad: list[bytes] = []  # the keys --fix deletes

    def fail(slot: int, page_hash: bytes, kind: str, detail: str) -> None:
        audit.problems.append(Problem(kind, _where(namespace, rank, page_hash), detail))
        bad.extend(keys[slot])

    slots_of: dict[bytes, list[int]] = defaultdict(list)  # whole pages: the slots naming them
    for slot, entries in sorted(at_slot.items()):
        named = sorted({h for h, _ in entries.values()})
        if len(named) > 1:
            fail(slot, named[0], "slot-shared", f"{len(named)} pages claim slot {slot}")
        elif set(entries) != set(range(num_payloads)):
            fail(
                slot,
                named[0],
                "page-incomplete",
                f"payload entries {sorted(entries)} of {num_payloads} at slot {slot}",
            )
        elif slot >= num_slots:
            fail(slot, named[0], "past-slab", f"slot {slot} past the slab's {num_slots} slots")
        else:
            slots_of[named[0]].append(slot)
    by_slot: dict[int, list[tuple[bytes, int]]] = {}
    for page_hash, slots in slots_of.items():
        if len(slots) > 1:  # a page is in one slot; which copy is right is not known
            for slot in slots:
                fail(slot, page_hash, "slot-mismatch", f"the page is named at slots {slots}")
            continue
        slot = slots[0]
        by_slot[slot] = [(page_hash, max(last for _, last in at_slot[slot].values()))]

    buf = aligned_buffer(max(s.geometry.slot_bytes for s in slabs))
    view = memoryview(buf)
    for slot, claims in sorted(by_slot.items()):
        for page_hash, last in sorted(claims):
            reason = None
            for kind, slab in enumerate(slabs):
                geom = slab.geometry
                n = geom.slot_bytes if payload else ALIGN
                try:
                    got = slab.read_slot(slot, view[:n])
                except OSError as err:
                    reason = f"slot {slot} payload {geom.payload_name}: read error: {err.strerror}"
                    break
                reason = check_slot(view[:got], kind, page_hash, geom.payload_len, payload=payload)
                if reason is not None:
                    reason = f"slot {slot} payload {geom.payload_name}: {reason}"
                    break
            if reason is None:
                audit.pages.append((page_hash, slot, last))
            else:
                fail(slot, page_hash, "bad-slot", reason)
    del view
    buf.close()
    if fix and bad:
        index.delete_keys(sorted(set(bad)))
    return audit


def _open_group(
    where: str,
    files: dict[int, tuple[Path, SlabGeometry, int]],
    report: AuditReport,
    fix: bool,
) -> list[SlabFile] | None:
    """The group's slabs in kind order, or None (with problems recorded) when it is unusable."""
    counts = {g.num_payloads for _, g, _ in files.values()}
    slots = {g.num_slots for _, g, _ in files.values()}
    num_payloads = max(counts)
    if len(counts) != 1 or len(slots) != 1 or set(files) != set(range(num_payloads)):
        report.problems.append(
            Problem(
                "group-incomplete",
                where,
                f"slabs for payload kinds {sorted(files)} of {sorted(counts)}, slot counts "
                f"{sorted(slots)}",
            )
        )
        if fix:
            for path, _, _ in files.values():
                path.unlink(missing_ok=True)
        return None
    slabs = []
    for kind in range(num_payloads):
        path, geom, size = files[kind]
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
        slabs.append(SlabFile(path, geom, direct=False, readonly=not fix))
    return slabs


def rebuild_index(index: DiskIndex, slabs: Sequence[SlabFile]) -> int:
    """Enter every page whose slots all hold its header and an intact payload (a slot of a
    dropped page may come back: its bytes are still that page's, verified); returns how many."""
    geom0 = slabs[0].geometry
    buf = aligned_buffer(max(s.geometry.slot_bytes for s in slabs))
    view = memoryview(buf)
    pages: list[tuple[bytes, int, int]] = []
    seen: set[bytes] = set()
    try:
        for slot in range(geom0.num_slots):
            page_hash: bytes | None = None
            for kind, slab in enumerate(slabs):
                try:
                    got = slab.read_slot(slot, view[: slab.geometry.slot_bytes])
                except OSError:
                    page_hash = None
                    break
                if page_hash is None:
                    head = decode_slot_header(view[:got])
                    if isinstance(head, str):
                        break
                    page_hash = head.page_hash
                if check_slot(view[:got], kind, page_hash, slab.geometry.payload_len) is not None:
                    page_hash = None
                    break
            if page_hash is not None and page_hash not in seen:
                seen.add(page_hash)
                pages.append((page_hash, slot, 0))
    finally:
        del view
        buf.close()
    index.put_pages(geom0.namespace, geom0.rank, pages, len(slabs))
    return len(pages)


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
    slabs: list[SlabFile] | None,
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
                        _where(decoded[0], found[1], found[0]),
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
    group: GroupFiles, slabs: list[SlabFile] | None, report: AuditReport, fix: bool, why: str
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
    root: Path, name: str, report: AuditReport, *, fix: bool, payload: bool
) -> None:
    """One group, under its rank lock (tried, never waited for)."""
    ns_hex, rank = name.rsplit("-r", 1)
    try:
        lock = RankLock(lock_path(root / SLAB_DIR, bytes.fromhex(ns_hex), int(rank)), not fix)
    except DiskStoreError:
        report.in_use.append(name)
        return
    try:
        # Listed again under the lock: what a store did before it let go counts, nothing after.
        group = next((g for g in list_groups(root) if g.name == name), None)
        if group is None:
            return
        found = _read_slabs(group, report, fix)
        slabs: list[SlabFile] | None = None
        ns: bytes | None = None
        for (group_ns, group_rank), files in sorted(found.items()):
            where = _where(group_ns, group_rank)
            opened = _open_group(where, files, report, fix)
            if opened is not None and slabs is None:
                slabs, ns = opened, group_ns
            elif opened is not None:  # two namespaces behind one 64-bit prefix: not ours to judge
                report.problems.append(Problem("group-ambiguous", where, "a second namespace"))
                for slab in opened:
                    slab.close()
        try:
            if group.index is not None:
                _audit_index(group, slabs, ns, report, fix, payload)
        finally:
            for slab in slabs or []:
                slab.close()
    finally:
        lock.release()


def audit_directory(root: Path, *, fix: bool = False, payload: bool = True) -> AuditReport:
    """Audit every slab group and index entry under ``root`` (a disk tier directory). Without
    ``fix`` nothing is written; a group in use by a store is listed in ``in_use``, unchecked."""
    root = Path(root)
    prepare_root(root, create=False)
    report = AuditReport(root)
    for path in foreign_files(root):
        report.problems.append(
            Problem("foreign-file", str(path), "not a name kvstrata writes; left alone")
        )
    for group in list_groups(root):
        _audit_group_files(root, group.name, report, fix=fix, payload=payload)
    report.fixed = fix
    return report
