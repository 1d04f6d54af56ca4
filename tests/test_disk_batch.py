"""disk_batch, the disk tier's array path: ``check_slots`` gives exactly ``check_slot``'s verdict
on every slot of a run (randomly corrupted ones included), ``write_headers`` writes what
``SlotHeader.pack_into`` writes, and the indexed copies between staging rows and host pages move
the same bytes as the per-page ``memmove`` path, on both host layouts, over several host slabs,
with several payloads per staging block and blocks and host slots in any order."""

from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from disk_rig import LAYOUT, NS, PAGE, budget_for, expected_page, read_page, write_page
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.tiers import disk_batch
from kvstrata.tiers.disk_batch import check_slots, from_host, to_host, write_headers
from kvstrata.tiers.disk_buffers import HostPages, Staging
from kvstrata.tiers.disk_format import (
    _SLOT_HEAD,
    SLOT_HEADER_BYTES,
    SlotHeader,
    check_slot,
    crc32c,
    round_up,
)
from kvstrata.tiers.disk_store import DiskConfig, DiskStore
from kvstrata.tiers.host_pool import HostLayout, HostPool
from kvstrata.tiers.page_hash import page_hashes

PAYLOAD_LEN = [NS.payload_bytes(k) for k in range(len(NS.payloads))]
SLOT_BYTES = [round_up(SLOT_HEADER_BYTES + n) for n in PAYLOAD_LEN]
HASHES = page_hashes(NS, list(range(64 * PAGE)))


def _hash(i: int) -> bytes:
    return HASHES[i % len(HASHES)]


def _fill_valid(staging: Staging, block: int, kind: int, page_hash: bytes, seed: int) -> None:
    """A slot as the writer leaves it: a payload, its header, and junk padding."""
    view = staging.slot(block, kind)
    n = PAYLOAD_LEN[kind]
    body = hashlib.shake_256(page_hash + bytes([kind, seed % 256])).digest(len(view))
    view[:] = body  # padding past the payload too: neither check looks at it
    SlotHeader(
        kind, page_hash, n, crc32c(view[SLOT_HEADER_BYTES : SLOT_HEADER_BYTES + n])
    ).pack_into(view)


def _recrc(view: memoryview) -> None:
    """Make the header's own CRC right again (a corruption the CRC does not catch)."""
    view[_SLOT_HEAD.size : SLOT_HEADER_BYTES] = crc32c(view[: _SLOT_HEAD.size]).to_bytes(
        4, "little"
    )


# (offset, width) of each header field; its value is changed, then the header CRC redone or not
FIELDS = {
    "magic": (0, 8),
    "version": (8, 2),
    "kind": (10, 2),
    "flags": (12, 4),
    "hash": (16, 32),
    "length": (48, 4),
    "crc": (52, 4),
    "reserved": (56, 4),
    "head_crc": (60, 4),
}

corruption = st.one_of(
    st.just(("none",)),
    st.tuples(
        st.just("field"),
        st.sampled_from(sorted(FIELDS)),
        st.integers(0, 63),
        st.integers(1, 255),
        st.booleans(),
    ),  # fmt: skip
    st.tuples(st.just("byte"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("payload"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.just(("zero",)),
    st.tuples(st.just("other_page"), st.integers(1, 40)),
    st.tuples(st.just("other_kind"), st.integers(0, 2)),
    st.tuples(
        st.just("value"), st.sampled_from(["version", "kind", "length"]), st.integers(0, 65535)
    ),  # fmt: skip
)


def _corrupt(staging: Staging, block: int, kind: int, i: int, how: tuple[object, ...]) -> None:
    view = staging.slot(block, kind)
    n = PAYLOAD_LEN[kind]
    tag = how[0]
    if tag == "field":
        _, name, pos, xor, recrc = how
        off, width = FIELDS[str(name)]
        at = off + int(pos) % width  # type: ignore[call-overload]
        view[at] ^= int(xor)  # type: ignore[call-overload]
        if recrc and name != "head_crc":
            _recrc(view)
    elif tag == "byte":  # anywhere in the slot, padding included
        view[int(how[1]) % len(view)] ^= int(how[2])  # type: ignore[call-overload]
    elif tag == "payload":  # the header still vouches for the old payload
        view[SLOT_HEADER_BYTES + int(how[1]) % n] ^= int(how[2])  # type: ignore[call-overload]
    elif tag == "zero":  # never written (a hole in the slab)
        view[:] = bytes(len(view))
    elif tag == "other_page":  # a stale slot: another page, intact
        _fill_valid(staging, block, kind, _hash(i + int(how[1])), i)  # type: ignore[call-overload]
    elif tag == "other_kind":  # another payload's slot of the same page, intact
        other = int(how[1])  # type: ignore[call-overload]
        if other != kind:
            view[8 + 2 : 8 + 4] = other.to_bytes(2, "little")
            _recrc(view)
    elif tag == "value":
        _, name, value = how
        off, width = FIELDS[str(name)]
        view[off : off + width] = int(value).to_bytes(width, "little")  # type: ignore[call-overload]
        _recrc(view)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(corruption, min_size=1, max_size=12),
    st.integers(0, 2**32 - 1),
)
def test_check_slots_gives_check_slots_verdict_on_every_slot(
    hows: list[tuple[object, ...]], seed: int
) -> None:
    n = len(hows)
    staging = Staging(SLOT_BYTES, n + 3)
    # any blocks, in any order
    blocks = [int(x) for x in np.random.default_rng(seed).permutation(n + 3)[:n]]
    hashes = [_hash(i) for i in range(n)]
    for kind in range(len(SLOT_BYTES)):
        for i, (b, how) in enumerate(zip(blocks, hows, strict=True)):
            _fill_valid(staging, b, kind, hashes[i], i)
            if (i + kind) % 2 == 0:  # every payload's slots are checked apart: not all corrupt
                _corrupt(staging, b, kind, i, how)
    for kind in range(len(SLOT_BYTES)):
        want = [
            check_slot(staging.slot(b, kind), kind, hashes[i], PAYLOAD_LEN[kind])
            for i, b in enumerate(blocks)
        ]
        assert check_slots(staging, kind, blocks, hashes, PAYLOAD_LEN[kind]) == want
        # and the staging block is left as it was (the check copies, never writes)
        again = [
            check_slot(staging.slot(b, kind), kind, hashes[i], PAYLOAD_LEN[kind])
            for i, b in enumerate(blocks)
        ]
        assert again == want


def test_check_slots_accepts_what_check_slot_accepts_flags_and_reserved_included() -> None:
    staging = Staging(SLOT_BYTES, 4)
    hashes = [_hash(i) for i in range(4)]
    for b in range(4):
        _fill_valid(staging, b, 0, hashes[b], b)
    staging.slot(1, 0)[12] = 7  # flags: not checked by check_slot
    _recrc(staging.slot(1, 0))
    staging.slot(2, 0)[56] = 9  # reserved
    _recrc(staging.slot(2, 0))
    assert [check_slot(staging.slot(b, 0), 0, hashes[b], PAYLOAD_LEN[0]) for b in range(4)] == [
        None
    ] * 4
    assert check_slots(staging, 0, range(4), hashes, PAYLOAD_LEN[0]) == [None] * 4


def test_check_slots_with_a_wrong_expected_length_refuses_as_check_slot() -> None:
    staging = Staging(SLOT_BYTES, 2)
    hashes = [_hash(0), _hash(1)]
    for b in range(2):
        _fill_valid(staging, b, 1, hashes[b], b)
    want = [check_slot(staging.slot(b, 1), 1, hashes[b], PAYLOAD_LEN[1] + 1) for b in range(2)]
    assert want[0] is not None
    assert check_slots(staging, 1, [0, 1], hashes, PAYLOAD_LEN[1] + 1) == want


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_write_headers_writes_what_pack_into_writes(n: int, seed: int) -> None:
    rnd = np.random.default_rng(seed)
    a, b = Staging(SLOT_BYTES, 10), Staging(SLOT_BYTES, 10)
    junk = rnd.integers(0, 256, len(a.view), dtype=np.uint8).tobytes()
    a.view[:] = junk
    b.view[:] = junk
    blocks = [int(x) for x in rnd.permutation(10)[:n]]
    hashes = [_hash(i + 3) for i in range(n)]
    for kind, length in enumerate(PAYLOAD_LEN):
        write_headers(a, kind, blocks, hashes, length)
        for blk, h in zip(blocks, hashes, strict=True):
            view = b.slot(blk, kind)
            body = view[SLOT_HEADER_BYTES : SLOT_HEADER_BYTES + length]
            SlotHeader(kind, h, length, crc32c(body)).pack_into(view)
    assert bytes(a.view) == bytes(b.view)
    assert all(
        check_slot(a.slot(blk, k), k, h, PAYLOAD_LEN[k]) is None
        for k in range(len(PAYLOAD_LEN))
        for blk, h in zip(blocks, hashes, strict=True)
    )


# -- indexed copies vs memmove -----------------------------------------------------------------


def _pool(
    host_layout: HostLayout, slots: int, per_slab: int, layout: KVLayout = LAYOUT
) -> HostPool:
    page = max(
        PAGE * (1 if host_layout == "layer_first" else layout.layers(p)) * p.token_bytes
        for p in layout.payloads
    )
    pool = HostPool(
        layout, PAGE, slots, host_layout=host_layout, pin=False, check_memory=False,
        max_alloc_bytes=per_slab * page,
    )  # fmt: skip
    assert pool.num_slabs == -(-slots // per_slab)
    return pool


def _randomize(pool: HostPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors():
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))


def _same(a: HostPool, b: HostPool) -> bool:
    return all(
        torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        for x, y in zip(a.tensors(), b.tensors(), strict=True)
    )


def _staging_for(pool: HostPool, blocks: int) -> Staging:
    slot_bytes = [
        round_up(SLOT_HEADER_BYTES + PAGE * pool.layout.layers(p) * p.token_bytes)
        for p in pool.layout.payloads
    ]
    return Staging(slot_bytes, blocks)


LAYOUTS = {
    "kvd": LAYOUT,  # K and V and a draft payload of another shape, 3 layers
    "mla": KVLayout(5, (PayloadSpec("kv", (1, 24), "float16"),)),
    "one_layer": KVLayout(
        1, (PayloadSpec("k", (2, 4), "float32"), PayloadSpec("v", (2, 4), "float32"))
    ),
}


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("per_slab", [1, 3, 7, 40])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_indexed_copies_move_the_bytes_memmove_moves(
    host_layout: HostLayout, layout: str, per_slab: int, seed: int
) -> None:
    rnd = np.random.default_rng(seed + 17 * per_slab)
    kv = LAYOUTS[layout]
    slots, blocks_n = 23, 16
    pools = [_pool(host_layout, slots, per_slab, kv) for _ in range(2)]
    for p in pools:
        _randomize(p, seed)
    a_pages, b_pages = HostPages(pools[0]), HostPages(pools[1])
    sa, sb = _staging_for(pools[0], blocks_n), _staging_for(pools[0], blocks_n)
    junk = rnd.integers(0, 256, len(sa.view), dtype=np.uint8).tobytes()
    sa.view[:] = junk
    sb.view[:] = junk
    n = int(rnd.integers(1, blocks_n + 1))
    blocks = [int(x) for x in rnd.permutation(blocks_n)[:n]]
    host_slots = [int(x) for x in rnd.permutation(slots)[:n]]  # across slabs, in any order
    for kind in range(len(kv.payloads)):
        assert a_pages.payload_bytes(kind) <= disk_batch.SMALL_PAYLOAD  # the indexed path
        # host -> staging (the gatherer)
        from_host(sa, kind, blocks, a_pages, host_slots)
        for blk, hs in zip(blocks, host_slots, strict=True):
            sb.gather(blk, kind, b_pages.extents(kind, hs))
    assert bytes(sa.view) == bytes(sb.view)
    # staging -> host (the reader), into other slots
    sa.view[:] = rnd.integers(0, 256, len(sa.view), dtype=np.uint8).tobytes()
    sb.view[:] = sa.view
    targets = [int(x) for x in rnd.permutation(slots)[:n]]
    for kind in range(len(kv.payloads)):
        to_host(sa, kind, blocks, a_pages, targets)
        for blk, hs in zip(blocks, targets, strict=True):
            sb.scatter(blk, kind, b_pages.extents(kind, hs))
    assert _same(pools[0], pools[1])
    assert bytes(sa.view) == bytes(sb.view)  # the staging is only read


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_a_page_lands_in_its_host_slot_layers_in_order(host_layout: HostLayout) -> None:
    """The slot payload is layer 0's bytes, then layer 1's, ...: the same layout the disk
    keeps, whichever host layout: read back with the pool's own page views."""
    pool = _pool(host_layout, 11, 4)
    pages = HostPages(pool)
    staging = _staging_for(pool, 6)
    hs = [_hash(i) for i in range(6)]
    src = [10, 0, 3, 4, 7, 8]  # every slab, out of order
    for s, h in zip(src, hs, strict=True):
        write_page(pool, s, h)
    for kind in range(len(LAYOUT.payloads)):
        from_host(staging, kind, range(6), pages, src)
    dst = [1, 9, 2, 5, 6, 3]
    other = _pool(host_layout, 11, 4)
    other_pages = HostPages(other)
    for kind in range(len(LAYOUT.payloads)):
        to_host(staging, kind, list(range(6)), other_pages, dst)
    for d, h in zip(dst, hs, strict=True):
        assert read_page(other, d) == expected_page(other, h)


def test_large_pages_keep_one_memmove_per_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages over SMALL_PAYLOAD go through Staging.gather / scatter (memmove releases the GIL),
    never through a numpy indexed copy."""
    big = KVLayout(2, (PayloadSpec("k", (8, 128), "float32"),))  # 4 tokens: 32 KiB a page
    pool = _pool("page_first", 6, 2, big)
    pages = HostPages(pool)
    assert pages.payload_bytes(0) > disk_batch.SMALL_PAYLOAD
    staging = _staging_for(pool, 4)
    calls: list[str] = []
    gather, scatter = Staging.gather, Staging.scatter

    def g(self: Staging, *a: object) -> None:
        calls.append("gather")
        gather(self, *a)  # type: ignore[arg-type]

    def s(self: Staging, *a: object) -> None:
        calls.append("scatter")
        scatter(self, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(Staging, "gather", g)
    monkeypatch.setattr(Staging, "scatter", s)
    monkeypatch.setattr(HostPages, "rows", lambda *a: pytest.fail("indexed copy of a big page"))
    _randomize(pool, 3)
    from_host(staging, 0, [2, 0, 3], pages, [5, 1, 2])
    to_host(staging, 0, [2, 0, 3], pages, [0, 3, 4])
    assert calls == ["gather"] * 3 + ["scatter"] * 3
    raw = [t.view(torch.uint8) for t in (pool.slab_tensor("k", 0, s) for s in range(3))]
    for a, b in ((5, 0), (1, 3), (2, 4)):  # bytes, not floats (random bytes hold NaNs)
        assert torch.equal(raw[a // 2][a % 2], raw[b // 2][b % 2])


def test_check_slots_copies_headers_only() -> None:
    """Checking a run of large slots must not copy their payloads (a run is up to 4 MiB per
    payload: copying it whole doubles the reader's memory traffic)."""
    payload = 1 << 20
    staging = Staging([round_up(SLOT_HEADER_BYTES + payload)], 4)
    hashes = [_hash(i) for i in range(4)]
    for b in range(4):
        view = staging.slot(b, 0)
        SlotHeader(0, hashes[b], payload, crc32c(view[64 : 64 + payload])).pack_into(view)
    tracemalloc.start()
    try:
        assert check_slots(staging, 0, range(4), hashes, payload) == [None] * 4
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < payload // 4, f"checking 4 headers allocated {peak} bytes"


# -- the reader end to end on several host slabs -------------------------------------------------


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_a_store_reads_pages_back_into_a_pool_of_several_slabs(
    tmp_path: Path, host_layout: HostLayout
) -> None:
    src, dst = _pool(host_layout, 30, 4), _pool(host_layout, 30, 7)
    hs = [_hash(i) for i in range(24)]
    src_slots = [(i * 7) % 30 for i in range(24)]
    for s, h in zip(src_slots, hs, strict=True):
        write_page(src, s, h)
    with DiskStore(NS, 0, DiskConfig(tmp_path, budget_for(40))) as store:
        assert store.spill(1, [(h, s, 1) for h, s in zip(hs, src_slots, strict=True)], src)
        assert store.flush(20.0)
        store.poll()
        targets = [(i * 11 + 3) % 30 for i in range(24)]
        ok = store.read(hs, dst, targets)
        assert ok == [True] * 24
        for t, h in zip(targets, hs, strict=True):
            assert read_page(dst, t) == expected_page(dst, h)
