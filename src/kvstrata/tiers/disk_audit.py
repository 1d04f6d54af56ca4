"""The disk tier's fsck: slabs against the index, every inconsistency named, optionally repaired.

A directory is *clean* when every index entry belongs to a complete slab group (the slabs of one
namespace and rank, one per payload, with valid superblocks and full length), and every page the
index names has all its payloads in one slot inside the slab, no other page in that slot, and a
slot header (and, unless ``payload=False``, a payload CRC) that checks out. Free slots holding
stale bytes are not a problem: a slot no entry names is free by definition.

Repair never invents data: it deletes the index entries of pages that do not check out (so they
read as misses), extends truncated slabs, and removes slab files that are not valid slabs or
belong to an incomplete group. The same group audit serves ``load`` cold starts (headers only,
repairing) and ``DiskStore.check``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DiskStoreError
from .disk_format import (
    ALIGN,
    RankLock,
    SlabFile,
    SlabGeometry,
    aligned_buffer,
    check_slot,
    lock_path,
)
from .disk_index import DiskIndex, IndexEntry, decode_key, decode_value

INDEX_DIR = "index"
SLAB_DIR = "slabs"


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
    by_page: dict[bytes, dict[int, IndexEntry]] = defaultdict(dict)
    for key, value in index.items(namespace):
        decoded, entry = decode_key(key), decode_value(value)
        if decoded is not None and entry is not None and entry.rank == rank:
            by_page[decoded[1]][decoded[2]] = entry
    bad: list[bytes] = []

    def fail(page_hash: bytes, kind: str, detail: str) -> None:
        audit.problems.append(Problem(kind, _where(namespace, rank, page_hash), detail))
        bad.append(page_hash)

    by_slot: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
    for page_hash, entries in by_page.items():
        slots = {e.slot for e in entries.values()}
        if set(entries) != set(range(num_payloads)):
            fail(
                page_hash, "page-incomplete", f"payload entries {sorted(entries)} of {num_payloads}"
            )
        elif len(slots) != 1:
            fail(page_hash, "slot-mismatch", f"payloads name slots {sorted(slots)}")
        elif (slot := slots.pop()) >= num_slots:
            fail(page_hash, "past-slab", f"slot {slot} past the slab's {num_slots} slots")
        else:
            last = max(e.last_access for e in entries.values())
            by_slot[slot].append((page_hash, last))

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
            elif len(claims) > 1:  # the header names at most one of them
                fail(page_hash, "slot-shared", f"{len(claims)} pages claim the slot; {reason}")
            else:
                fail(page_hash, "bad-slot", reason)
    del view
    buf.close()
    if fix and bad:
        index.delete_pages(namespace, sorted(set(bad)), num_payloads, rank=rank)
    return audit


def _open_group(
    ns: bytes,
    rank: int,
    files: dict[int, tuple[Path, SlabGeometry, int]],
    report: AuditReport,
    fix: bool,
) -> list[SlabFile] | None:
    """The group's slabs in kind order, or None (with problems recorded) when it is unusable."""
    where = _where(ns, rank)
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
                with open(path, "r+b") as f:
                    os.posix_fallocate(f.fileno(), 0, geom.file_bytes)
        slabs.append(SlabFile(path, geom, direct=False))
    return slabs


def audit_directory(root: Path, *, fix: bool = False, payload: bool = True) -> AuditReport:
    """Audit every slab group and index entry under ``root`` (a disk tier directory)."""
    root = Path(root)
    if not (root / INDEX_DIR / "data.mdb").is_file():
        raise DiskStoreError(f"{root} is not a kvstrata disk directory (no {INDEX_DIR}/data.mdb)")
    report = AuditReport(root)
    groups: dict[tuple[bytes, int], dict[int, tuple[Path, SlabGeometry, int]]] = defaultdict(dict)
    for path in sorted((root / SLAB_DIR).glob("*.slab")):
        geom, size = SlabFile.read_geometry(path)
        if isinstance(geom, str) or path.name != geom.file_name():
            why = geom if isinstance(geom, str) else f"its superblock names {geom.file_name()}"
            report.problems.append(Problem("slab-superblock", str(path), why))
            if fix:
                path.unlink()
            continue
        groups[(geom.namespace, geom.rank)][geom.payload_kind] = (path, geom, size)

    index = DiskIndex(root / INDEX_DIR)
    locks: list[RankLock] = []
    valid: set[tuple[bytes, int]] = set()
    try:
        for (ns, rank), files in sorted(groups.items()):
            locks.append(RankLock(lock_path(root / SLAB_DIR, ns, rank)))
            slabs = _open_group(ns, rank, files, report, fix)
            if slabs is None:
                continue
            try:
                report.groups.append(audit_group(index, ns, rank, slabs, payload=payload, fix=fix))
                valid.add((ns, rank))
            finally:
                for slab in slabs:
                    slab.close()
        stray = []
        for key, value in index.items():
            decoded, entry = decode_key(key), decode_value(value)
            if decoded is None or entry is None:
                report.problems.append(
                    Problem(
                        "entry-malformed",
                        f"key {key.hex()[:32]}",
                        f"{len(key)}-byte key, {len(value)}-byte value",
                    )
                )
                stray.append(key)
            elif (decoded[0], entry.rank) not in valid:
                report.problems.append(
                    Problem(
                        "entry-orphan",
                        _where(decoded[0], entry.rank, decoded[1]),
                        "no complete slab group for this namespace and rank",
                    )
                )
                stray.append(key)
        if fix and stray:
            index.delete_keys(stray)
        report.fixed = fix
    finally:
        for lock in locks:
            lock.release()
        index.close()
    return report
