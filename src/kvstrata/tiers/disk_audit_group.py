"""The audit of one slab group: its index entries against its slabs, and a rebuild from them.

A group (one namespace and rank) is *clean* when every page the index names has all its
payloads in one slot inside the slabs, no other page in that slot, and a slot header (and,
unless ``payload=False``, a payload CRC) that checks out. Free slots holding stale bytes are not
a problem: a slot no entry names is free by definition. The slabs are the group's
:class:`~kvstrata.tiers.disk_layout.StripedSlab` (or plain files), in global slots. The same
audit serves ``load`` cold starts (headers only, repairing), ``DiskStore.check`` and
``kvstrata disk check`` (``disk_audit.py``, which finds the groups and their files).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .disk_format import ALIGN, aligned_buffer, check_slot, decode_slot_header
from .disk_index import DiskIndex, decode_key, decode_value
from .disk_layout import Slab


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
    stripes: int = 1  # directories its slots are striped over


def group_where(ns: bytes, rank: int, page_hash: bytes | None = None) -> str:
    out = f"ns {ns.hex()[:16]} rank {rank}"
    return out + (f" page {page_hash.hex()[:16]}" if page_hash is not None else "")


def audit_group(
    index: DiskIndex,
    namespace: bytes,
    rank: int,
    slabs: Sequence[Slab],
    *,
    payload: bool,
    fix: bool,
) -> GroupAudit:
    """Check every index entry of ``(namespace, rank)`` against its slabs (one per payload, in
    kind order); with ``fix``, delete the entries of every page that fails."""
    num_payloads, num_slots = len(slabs), slabs[0].geometry.num_slots
    audit = GroupAudit(namespace, rank, num_payloads, num_slots, stripes=slabs[0].stripes)
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
        audit.problems.append(Problem(kind, group_where(namespace, rank, page_hash), detail))
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


def rebuild_index(index: DiskIndex, slabs: Sequence[Slab]) -> int:
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
