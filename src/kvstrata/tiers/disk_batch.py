"""Many slots at once: the headers of a run of slots checked or written in a few array
operations, and their payloads moved to and from the host pool in one indexed copy.

The disk threads handle a page per slot. Done page by page in Python, a run of small pages
(``--model none``'s 64-byte pages, a tiny model's) costs far more in interpreter work, each
holding the GIL the engine's step needs, than in I/O. Here a run of ``n`` slots of one payload is
an ``(n, slot bytes)`` array view of a :class:`~kvstrata.tiers.disk_buffers.Staging`; the fields
of its headers are compared (or filled) as arrays, and only the two CRC-32C values of each slot
are computed one call per slot (the library has no batched call). A slot that fails any test is
checked again by :func:`~kvstrata.tiers.disk_format.check_slot`, so the reason reported, and what
is accepted, is exactly that function's: this module is a faster path to the same verdicts.

Payloads move between staging rows and host pool pages with one numpy fancy-indexed copy per
host slab and extent (``HostPages.rows``) when pages are small; large pages keep one
``memmove`` per page (it releases the GIL while it copies, so copies on several threads overlap).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .disk_buffers import HostPages, Staging
from .disk_format import (
    _SLOT_HEAD,
    PAGE_MAGIC,
    SLOT_HEADER_BYTES,
    check_slot,
    crc32c_many,
)
from .page_hash import FORMAT_VERSION

#: The slot header as an array record (``disk_format``'s layout, little-endian).
HEAD_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u2"),
        ("kind", "<u2"),
        ("flags", "<u4"),
        ("hash", "V32"),
        ("length", "<u4"),
        ("crc", "<u4"),
        ("reserved", "<u4"),
        ("head_crc", "<u4"),
    ]
)
assert HEAD_DTYPE.itemsize == SLOT_HEADER_BYTES and _SLOT_HEAD.size == SLOT_HEADER_BYTES - 4
#: Pages up to this many payload bytes move by indexed copies; larger ones one memmove each.
SMALL_PAYLOAD = 16 << 10

Blocks = Sequence[int] | npt.NDArray[np.int64]


def _index(blocks: Blocks) -> npt.NDArray[np.int64]:
    """``blocks`` as an index array (a range without a Python step per block)."""
    if isinstance(blocks, range):
        return np.arange(blocks.start, blocks.stop, blocks.step, dtype=np.int64)
    return np.asarray(blocks, dtype=np.int64)


def _hashes(page_hashes: Sequence[bytes]) -> npt.NDArray[np.void]:
    return np.frombuffer(b"".join(page_hashes), dtype="V32")


def check_slots(
    staging: Staging, kind: int, blocks: Blocks, page_hashes: Sequence[bytes], payload_len: int
) -> list[str | None]:
    """For each of ``blocks`` (its slot of payload ``kind`` read from disk): None when it holds
    that payload of the page ``page_hashes[i]``, intact; else why not (``check_slot``'s words)."""
    n = len(page_hashes)
    if n == 0:
        return []
    # the headers only (one indexed copy of 64 bytes a slot, never the payloads)
    idx = _index(blocks)
    raw = staging.rows(kind)[idx, :SLOT_HEADER_BYTES]
    heads = np.ascontiguousarray(raw).view(HEAD_DTYPE)[:, 0]
    ok = (
        (heads["magic"] == PAGE_MAGIC)
        & (heads["version"] == FORMAT_VERSION)
        & (heads["kind"] == kind)
        & (heads["length"] == payload_len)
        & (heads["hash"] == _hashes(page_hashes))
    )
    view = staging.view
    starts = staging.slot_starts(idx, kind)
    ok &= crc32c_many(view, starts, _SLOT_HEAD.size) == heads["head_crc"]
    whole = np.flatnonzero(ok)  # the payloads of slots whose headers hold
    if whole.size:
        payload_crc = crc32c_many(view, starts[whole] + SLOT_HEADER_BYTES, payload_len)
        ok[whole] = payload_crc == heads["crc"][whole]
    if ok.all():
        return [None] * n
    out: list[str | None] = [None] * n
    for i in np.flatnonzero(~ok).tolist():
        slot = staging.slot(int(blocks[i]), kind)
        out[i] = check_slot(slot, kind, page_hashes[i], payload_len) or "slot check failed"
    return out


def write_headers(
    staging: Staging, kind: int, blocks: Blocks, page_hashes: Sequence[bytes], payload_len: int
) -> None:
    """Write the header of each of ``blocks``' slot of payload ``kind``, whose payload is in
    place: page ``page_hashes[i]``, its payload CRC, and the header's own CRC."""
    n = len(page_hashes)
    if n == 0:
        return
    idx = _index(blocks)
    starts = staging.slot_starts(idx, kind)
    heads = np.zeros(n, dtype=HEAD_DTYPE)
    heads["magic"] = PAGE_MAGIC
    heads["version"] = FORMAT_VERSION
    heads["kind"] = kind
    heads["hash"] = _hashes(page_hashes)
    heads["length"] = payload_len
    heads["crc"] = crc32c_many(staging.view, starts + SLOT_HEADER_BYTES, payload_len)
    raw = heads.view(np.uint8).reshape(n, SLOT_HEADER_BYTES)
    head = memoryview(raw.tobytes())
    at = np.arange(n, dtype=np.int64) * SLOT_HEADER_BYTES
    heads["head_crc"] = crc32c_many(head, at, _SLOT_HEAD.size)
    staging.rows(kind)[idx, :SLOT_HEADER_BYTES] = raw


def to_host(
    staging: Staging, kind: int, blocks: Blocks, pages: HostPages, host_slots: Sequence[int]
) -> None:
    """Copy the payload of each of ``blocks``' slots of ``kind`` into host slot
    ``host_slots[i]``."""
    if pages.payload_bytes(kind) > SMALL_PAYLOAD:
        for b, slot in zip(blocks, host_slots, strict=True):
            staging.scatter(int(b), kind, pages.extents(kind, slot))
        return
    # the payloads only (a small page's slot is mostly padding: 4 KiB for a 64-byte page)
    payload = slice(SLOT_HEADER_BYTES, SLOT_HEADER_BYTES + pages.payload_bytes(kind))
    src = staging.rows(kind)[_index(blocks), payload]
    for sel, host, extents in pages.rows(kind, host_slots):
        at = 0
        for dst, nbytes in extents:
            dst[host] = src[sel, at : at + nbytes] if sel is not None else src[:, at : at + nbytes]
            at += nbytes


def from_host(
    staging: Staging, kind: int, blocks: Blocks, pages: HostPages, host_slots: Sequence[int]
) -> None:
    """Copy host slot ``host_slots[i]``'s payload of ``kind`` into each of ``blocks``' slots."""
    if pages.payload_bytes(kind) > SMALL_PAYLOAD:
        for b, slot in zip(blocks, host_slots, strict=True):
            staging.gather(int(b), kind, pages.extents(kind, slot))
        return
    rows = staging.rows(kind)
    idx = _index(blocks)
    for sel, host, extents in pages.rows(kind, host_slots):
        at = SLOT_HEADER_BYTES
        dst_blocks = idx if sel is None else idx[sel]
        for src, nbytes in extents:
            rows[dst_blocks, at : at + nbytes] = src[host]
            at += nbytes
