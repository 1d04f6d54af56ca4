"""Tests for kvstrata.tiers.disk_format and disk_slots: headers, superblocks, slab I/O, slots."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstrata.errors import DiskFormatError, PoolInvariantError
from kvstrata.tiers.disk_format import (
    ALIGN,
    SLOT_HEADER_BYTES,
    SlabFile,
    SlabGeometry,
    SlotHeader,
    aligned_buffer,
    check_slot,
    crc32c,
    crc32c_many,
    probe_direct_io,
)
from kvstrata.tiers.disk_slots import SlotPool

GEOM = SlabGeometry(b"N" * 32, 1, 0, 2, "k", 5000, 6)
HASH = bytes(range(32))


def _slot(payload: bytes, page_hash: bytes = HASH, kind: int = 0) -> bytearray:
    buf = bytearray(GEOM.slot_bytes)
    buf[SLOT_HEADER_BYTES : SLOT_HEADER_BYTES + len(payload)] = payload
    SlotHeader(kind, page_hash, len(payload), crc32c(payload)).pack_into(memoryview(buf))
    return buf


def test_crc32c_is_castagnoli() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value (RFC 3720)
    assert crc32c(b"6789", crc32c(b"12345")) == crc32c(b"123456789")


def test_slot_round_trip_and_every_header_bit_flip_is_caught() -> None:
    payload = random.Random(0).randbytes(GEOM.payload_len)
    buf = _slot(payload)
    assert GEOM.slot_bytes % ALIGN == 0 and GEOM.slot_bytes >= SLOT_HEADER_BYTES + 5000
    assert check_slot(memoryview(buf), 0, HASH, 5000) is None
    assert check_slot(memoryview(buf), 1, HASH, 5000) == "payload kind 0, not 1"
    assert check_slot(memoryview(buf), 0, bytes(32), 5000) == "the slot holds another page"
    assert check_slot(memoryview(buf), 0, HASH, 4999) == "payload length 5000, not 4999"
    for bit in range(SLOT_HEADER_BYTES * 8):
        bad = bytearray(buf)
        bad[bit // 8] ^= 1 << (bit % 8)
        assert check_slot(memoryview(bad), 0, HASH, 5000) is not None, bit
    assert check_slot(memoryview(bytearray(GEOM.slot_bytes)), 0, HASH, 5000) is not None
    assert "short read" in str(check_slot(memoryview(buf)[:100], 0, HASH, 5000))


@settings(max_examples=200, deadline=None)
@given(bit=st.integers(0, 5000 * 8 - 1))
def test_every_payload_bit_flip_is_caught(bit: int) -> None:
    payload = bytearray(random.Random(1).randbytes(5000))
    buf = _slot(bytes(payload))
    buf[SLOT_HEADER_BYTES + bit // 8] ^= 1 << (bit % 8)
    assert check_slot(memoryview(buf), 0, HASH, 5000) == "payload CRC mismatch"
    assert check_slot(memoryview(buf), 0, HASH, 5000, payload=False) is None
    # The same payload in pieces after a separate header (a value read into a host page's views).
    head, body = memoryview(buf)[:SLOT_HEADER_BYTES], memoryview(buf)[SLOT_HEADER_BYTES:]
    pieces = [body[:1000], body[1000:1000], body[1000:5000]]
    assert check_slot(head, 0, HASH, 5000, body=pieces) == "payload CRC mismatch"
    buf[SLOT_HEADER_BYTES + bit // 8] ^= 1 << (bit % 8)
    assert check_slot(head, 0, HASH, 5000, body=pieces) is None
    assert "short read" in str(check_slot(head, 0, HASH, 5000, body=pieces[:2]))


def test_superblock_round_trip_and_corruption() -> None:
    raw = GEOM.encode()
    assert len(raw) == ALIGN and SlabGeometry.decode(raw) == GEOM
    for at in (0, 9, 12, 60, 100):  # magic, version, rank, namespace, geometry
        bad = bytearray(raw)
        bad[at] ^= 0x10
        assert isinstance(SlabGeometry.decode(bytes(bad)), str), at
    assert GEOM.file_name() == f"{(b'N' * 32).hex()[:16]}-r1-0-k.slab"


@pytest.mark.parametrize("direct", [True, False])
def test_slab_file_writes_and_reads_slots(tmp_path: Path, direct: bool) -> None:
    if direct and probe_direct_io(tmp_path) is not None:
        pytest.skip(f"no O_DIRECT in {tmp_path}")
    path = tmp_path / GEOM.file_name()
    slab = SlabFile.create(path, GEOM, direct)
    assert path.stat().st_size == GEOM.file_bytes
    buf = aligned_buffer(GEOM.slot_bytes)
    for slot in (0, 5, 2):
        buf[:] = _slot(bytes([slot]) * 5000)
        slab.write_slot(slot, memoryview(buf))
    slab.sync()
    out = aligned_buffer(GEOM.slot_bytes)
    for slot in (5, 2, 0):
        assert slab.read_slot(slot, memoryview(out)) == GEOM.slot_bytes
        assert check_slot(memoryview(out), 0, HASH, 5000) is None
        assert out[SLOT_HEADER_BYTES] == slot
    slab.close()
    reopened, truncated = SlabFile.open_existing(path, GEOM, direct)
    assert not truncated
    reopened.close()
    os.truncate(path, GEOM.slot_offset(3) + 100)  # cut inside slot 3
    reopened, truncated = SlabFile.open_existing(path, GEOM, direct)
    assert truncated and path.stat().st_size == GEOM.file_bytes
    reopened.close()
    other = SlabGeometry(GEOM.namespace, 1, 0, 2, "k", 5000, 7)
    with pytest.raises(DiskFormatError, match="num_slots 6 vs 7"):
        SlabFile.open_existing(path, other, direct)


def test_slot_pool_states_and_lru() -> None:
    pool = SlotPool(4)
    a = pool.alloc(b"a")
    b = pool.alloc(b"b")
    assert (a, b) == (0, 1) and pool.num_used == 2 and pool.num_live == 0
    assert pool.writing_slot(b"a") == 0 and pool.slot_of(b"a") is None
    assert pool.coldest(2) == []  # a page being written is never GC's victim
    pool.publish(b"b")
    pool.publish(b"a")
    assert pool.coldest(2) == [(b"a", 0), (b"b", 1)]  # in the order they were planned
    pool.alloc(b"c")
    assert pool.release(b"c") == 2
    pool.touch(b"a")
    assert pool.coldest(1) == [(b"b", 1)] and pool.slot_of(b"a") == 0
    assert pool.remove(b"b") == 1 and pool.num_free == 3
    pool.check()
    assert pool.take_back(b"b", 1, 1) and pool.coldest(2) == [(b"b", 1), (b"a", 0)]
    assert not pool.take_back(b"z", 1, 1)  # slot 1 is live again
    pool.check()
    pool._free.append(0)  # the slot live page a holds, also on the free list
    with pytest.raises(PoolInvariantError, match="handed out twice"):
        pool.check()


def test_slot_pool_ties_in_the_lru_go_by_slot() -> None:
    """Only a page taken back can share a clock with another: GC then takes the lower slot
    first, whichever of the tied pages a partial sort meets first."""
    pool = SlotPool(6)
    for h in (b"c", b"a", b"b", b"d"):
        pool.alloc(h)
        pool.publish(h)
    assert pool.remove(b"c") == 0
    assert pool.take_back(b"c", 0, pool.last_access(b"b"))  # slot 0 ties with b (slot 2)
    assert pool.coldest(1) == [(b"a", 1)]
    assert pool.coldest(2) == [(b"a", 1), (b"c", 0)]
    assert pool.coldest(3) == [(b"a", 1), (b"c", 0), (b"b", 2)]
    assert [h for h, _, _ in pool.remove_coldest(2)] == [b"a", b"c"]
    pool.check()


def test_slot_pool_pages_loaded_with_one_clock_go_by_slot() -> None:
    """An index ``disk check --fix`` rebuilt gives every page clock 0: GC takes them by slot,
    and a partial sort cut inside the tie takes only the lowest slots it needs."""
    pool = SlotPool(8)
    pool.rebuild([(bytes([s]) * 32, s, 0) for s in (6, 2, 4, 0, 5)] + [(b"\x09" * 32, 7, 3)])
    assert [s for _, s in pool.coldest(2)] == [0, 2]
    assert [s for _, s in pool.coldest(6)] == [0, 2, 4, 5, 6, 7]
    pool.touch(bytes([0]) * 32)
    assert [s for _, s in pool.coldest(3)] == [2, 4, 5]
    assert [s for _, s, _ in pool.remove_coldest(4)] == [2, 4, 5, 6]
    pool.check()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("aptmrx"), st.integers(0, 9)), max_size=80))
@example(ops=[("a", 0), ("p", 0), ("a", 1), ("p", 1), ("a", 2), ("p", 2), ("m", 1), ("m", 2)])
def test_slot_pool_against_a_reference(ops: list[tuple[str, int]]) -> None:
    """Random alloc / publish / touch / remove / release against a list-based LRU: a page takes
    its place when allocated; only live pages are touched or picked. Touches by slot with a
    slot given twice (``m``) put it at its later place; ``held_slots``, ``leading`` and ``holds``
    agree with the reference after every step."""
    pool = SlotPool(5)
    order: list[bytes] = []  # every used slot's page, least recently used first
    live: set[bytes] = set()
    slots: dict[bytes, int] = {}
    for op, n in ops:
        h = bytes([n])
        if op == "a" and h not in slots:
            slot = pool.alloc(h)
            assert (slot is None) == (len(slots) == 5)
            if slot is not None:
                slots[h] = slot
                order.append(h)
        elif op == "p" and h in slots and h not in live:
            pool.publish(h)
            live.add(h)
        elif op == "t" and h in live:
            pool.touch(h)
            order.remove(h)
            order.append(h)
        elif op == "m" and h in live and (h2 := min(live - {h}, default=None)) is not None:
            pool.touch_slots([slots[h], slots[h2], slots[h]])
            for page in (h2, h):
                order.remove(page)
                order.append(page)
        elif op == "r" and h in live:
            assert pool.remove(h) == slots.pop(h)
            live.remove(h)
            order.remove(h)
        elif op == "x" and h in slots and h not in live:
            assert pool.release(h) == slots.pop(h)
            order.remove(h)
        pool.check()
        assert [h for h, _ in pool.coldest(10)] == [h for h in order if h in live]
        assert pool.num_writing == len(slots) - len(live)
        every = [bytes([i]) for i in range(10)]
        assert pool.held_slots(every) == [slots.get(p) for p in every]
        lead = next((i for i, p in enumerate(every) if p not in slots), len(every))
        assert pool.leading(every) == [slots[p] for p in every[:lead]]
        assert pool.leading(sorted(slots)) == [slots[p] for p in sorted(slots)]
        held = sorted(slots)
        assert pool.holds(held, [slots[p] for p in held]) == [p in live for p in held]
        if len(held) > 1:  # each page against another's slot
            shifted = [slots[p] for p in held[1:] + held[:1]]
            assert pool.holds(held, shifted) == [False] * len(held)
    pool2 = SlotPool(5)
    pool2.rebuild(pool.live())
    pool2.check()
    assert pool2.coldest(10) == pool.coldest(10) and pool2.num_used == len(live)


@given(
    data=st.binary(min_size=1, max_size=600),
    regions=st.lists(st.tuples(st.integers(0, 599), st.integers(0, 64)), max_size=40),
)
def test_crc32c_many_is_a_crc32c_per_region(data: bytes, regions: list[tuple[int, int]]) -> None:
    """The batched CRC equals one call per region (empty and clipped regions included)."""
    view = memoryview(data)
    for size in {n for _, n in regions} or {0}:
        starts = [s for s, _ in regions]
        got = crc32c_many(view, starts, size).tolist()
        assert got == [crc32c(view[s : s + size]) for s in starts]
