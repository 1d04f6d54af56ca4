"""Tests for kvstrata.tiers.host_pool: layouts, slabs, memory refusal, pinning failures, check()."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.errors import CapacityError, ConfigError, PinnedMemoryError, PoolInvariantError
from kvstrata.tiers import host_pool as host_pool_module
from kvstrata.tiers.host_pool import HOST_LAYOUTS, HostLayout, HostPool
from kvstrata.tiers.pool import torch_dtype

PAGE = 4
LAYOUT = KVLayout(
    num_layers=3,
    payloads=(
        PayloadSpec("k", (2, 8), "bfloat16"),
        PayloadSpec("q8", (3,), "uint8"),
        PayloadSpec("scale", (5,), "float32"),
    ),
)


def _slot_bytes(host_layout: HostLayout) -> int:
    """Bytes of one slot in the largest allocation (what the cap divides)."""
    per_layer = 1 if host_layout == "layer_first" else LAYOUT.num_layers
    return max(PAGE * per_layer * p.token_bytes for p in LAYOUT.payloads)


def _pool(host_layout: HostLayout, num_slots: int = 10, **kw: Any) -> HostPool:
    return HostPool(LAYOUT, PAGE, num_slots, host_layout=host_layout, pin=False, **kw)


@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
def test_views_have_the_page_shape_and_dtype(host_layout: HostLayout) -> None:
    pool = _pool(host_layout)
    pool.check()
    assert pool.num_slabs == 1 and not pool.pinned
    for spec in LAYOUT.payloads:
        for layer in range(LAYOUT.num_layers):
            v = pool.view(spec.name, layer, 0)
            assert v.shape == (10, PAGE, *spec.token_shape)
            assert v.dtype == torch_dtype(spec.dtype)
    assert pool.total_bytes == sum(t.nbytes for t in pool.tensors()) == 10 * pool.page_bytes


@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
def test_page_geometry_locates_every_page_in_its_slab(host_layout: HostLayout) -> None:
    """The byte offsets the kernel uses address exactly the page that page() views."""
    pool = _pool(host_layout, num_slots=7, max_alloc_bytes=3 * _slot_bytes(host_layout))
    assert pool.num_slabs > 1
    for t in pool.tensors():
        t.view(torch.uint8).zero_()
    for spec in LAYOUT.payloads:
        for layer in range(LAYOUT.num_layers):
            stride, offset, page_bytes = pool.page_geometry(spec.name, layer)
            for slot in range(pool.num_slots):
                slab = slot // pool.slots_per_slab
                row = slot - pool.slab_bounds(slab)[0]
                page = pool.page(spec.name, layer, slot)
                page.view(torch.uint8).fill_(7)
                flat = pool.slab_tensor(spec.name, layer, slab).view(-1).view(torch.uint8)
                lo = row * stride + offset
                assert bool((flat[lo : lo + page_bytes] == 7).all())
                assert int((flat == 7).sum()) == page_bytes  # nothing else was touched
                page.view(torch.uint8).zero_()


@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
def test_page_first_keeps_a_pages_layers_contiguous(host_layout: HostLayout) -> None:
    pool = _pool(host_layout)
    a, b = pool.page("k", 0, 4), pool.page("k", 1, 4)
    adjacent = b.data_ptr() - a.data_ptr() == a.nbytes
    assert adjacent == (host_layout == "page_first")


@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
@pytest.mark.parametrize("cap_pages", [1, 2, 3, 9])
def test_slabs_respect_the_cap_and_partition_the_slots(
    host_layout: HostLayout, cap_pages: int
) -> None:
    cap = cap_pages * _slot_bytes(host_layout) + 1
    pool = _pool(host_layout, num_slots=10, max_alloc_bytes=cap)
    pool.check()
    assert pool.slots_per_slab == min(cap_pages, 10)
    assert all(t.nbytes <= cap for t in pool.tensors())
    bounds = [pool.slab_bounds(s) for s in range(pool.num_slabs)]
    assert [a for a, _ in bounds] == [b for _, b in [(0, 0), *bounds[:-1]]]
    assert bounds[-1][1] == 10
    # Every slab is its own allocation: no two tensors share storage.
    storages = {t.untyped_storage().data_ptr() for t in pool.tensors()}
    assert len(storages) == len(pool.tensors())


@settings(max_examples=60, deadline=None)
@given(
    slots=st.lists(st.integers(0, 22), unique=True, max_size=23),
    per_slab=st.integers(1, 23),
)
def test_split_by_slab_groups_each_slot_once_in_its_slab(slots: list[int], per_slab: int) -> None:
    pool = HostPool(
        LAYOUT,
        PAGE,
        23,
        "layer_first",
        pin=False,
        max_alloc_bytes=per_slab * _slot_bytes("layer_first"),
    )
    t = torch.tensor(slots, dtype=torch.int64)
    seen: list[int] = []
    for slab, positions, rows in pool.split_by_slab(t):
        start, stop = pool.slab_bounds(slab)
        picked = t if positions is None else t[positions]
        assert bool(((rows >= 0) & (rows < stop - start)).all())  # never past the slab's end
        assert torch.equal(picked, rows + start)
        seen += (torch.arange(len(t)) if positions is None else positions).tolist()
    assert sorted(seen) == list(range(len(slots)))


def test_refuses_a_pool_larger_than_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_pool_module, "mem_available_bytes", lambda: 2**30)
    big = 2 * 2**30 // HostPool(LAYOUT, PAGE, 1, pin=False).page_bytes
    with pytest.raises(CapacityError, match=r"2\.00 GiB .* 1\.00 GiB .*--l2-tokens"):
        HostPool(LAYOUT, PAGE, big, pin=False)
    # The caller may opt out (it then owns the risk); nothing is touched, so this is cheap.
    HostPool(LAYOUT, PAGE, big, pin=False, check_memory=False).close()


def test_mem_available_reads_the_machine() -> None:
    available = host_pool_module.mem_available_bytes()
    assert available is None or available > 0


class _FakeCudart:
    """cudaHostRegister that fails on the n-th call; records what stays registered."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls = 0
        self.registered: set[int] = set()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls += 1
        if self.calls == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        assert ptr % host_pool_module._OS_PAGE == 0 and size % host_pool_module._OS_PAGE == 0
        self.registered.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.registered.remove(ptr)
        return 0


def test_a_pinning_failure_is_a_typed_error_and_unpins_what_was_pinned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gc.collect()  # real pinned pools of earlier tests unpin through the real cudart
    fake = _FakeCudart(fail_at=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with pytest.raises(PinnedMemoryError, match="cannot pin .* GiB of host memory"):
        HostPool(LAYOUT, PAGE, 5, host_layout="layer_first", pin=True)
    assert fake.calls == 4
    gc.collect()
    assert fake.registered == set()  # the three slabs pinned before the failure were released


def test_pinned_pool_registers_page_aligned_slabs_and_close_unpins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gc.collect()
    fake = _FakeCudart(fail_at=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    pool = HostPool(LAYOUT, PAGE, 5, host_layout="page_first", pin=None)
    assert pool.pinned and len(fake.registered) == len(pool.tensors()) == len(LAYOUT.payloads)
    assert {t.data_ptr() for t in pool.tensors()} == fake.registered
    pool.check()
    pool._slabs["k"][0][0] = torch.empty_like(pool._slabs["k"][0][0])  # an unpinned slab
    with pytest.raises(PoolInvariantError, match="not pinned"):
        pool.check()
    pool.close()
    assert fake.registered == set() and pool.tensors() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's refusal")
def test_pin_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pin=True needs CUDA"):
        HostPool(LAYOUT, PAGE, 4, pin=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"page_size": 0}, "page_size"),
        ({"num_slots": 0}, "at least one slot"),
        ({"host_layout": "rows"}, "host layout"),
        ({"max_alloc_bytes": 0}, "max_alloc_bytes"),
        ({"max_alloc_bytes": 100}, "per-allocation cap"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"page_size": PAGE, "num_slots": 4, "pin": False, **kwargs}
    with pytest.raises(ConfigError, match=message):
        HostPool(LAYOUT, **args)


def test_bad_payload_layer_or_slot_is_a_config_error() -> None:
    pool = _pool("layer_first")
    with pytest.raises(ConfigError, match="no payload"):
        pool.view("v", 0, 0)
    with pytest.raises(ConfigError, match="layer 3"):
        pool.view("k", 3, 0)
    with pytest.raises(ConfigError, match="host slot 10"):
        pool.page("k", 0, 10)


def test_slots_for_bytes() -> None:
    pb = LAYOUT.page_bytes(PAGE)
    assert HostPool.slots_for_bytes(LAYOUT, PAGE, 10 * pb + pb - 1) == 10


def test_check_finds_a_broken_slab() -> None:
    pool = _pool("page_first", max_alloc_bytes=3 * _slot_bytes("page_first"))
    pool._slabs["k"][0][1] = torch.empty(2, 3)
    with pytest.raises(PoolInvariantError):
        pool.check()
    pool = _pool("layer_first")
    pool._slabs["q8"][2][0] = pool._slabs["q8"][1][0]  # two layers share memory
    with pytest.raises(PoolInvariantError, match="share memory"):
        pool.check()


def test_borrow_serves_the_callers_memory_and_refuses_other_shapes() -> None:
    layout = KVLayout(2, (PayloadSpec("k", (3,), "bfloat16"), PayloadSpec("v", (5,), "uint8")))
    k = [
        torch.zeros(4, 2, 4, 3, dtype=torch.bfloat16),
        torch.zeros(2, 2, 4, 3, dtype=torch.bfloat16),
    ]
    v = [torch.zeros(4, 2, 4, 5, dtype=torch.uint8), torch.zeros(2, 2, 4, 5, dtype=torch.uint8)]
    pool = HostPool.borrow(layout, 4, {"k": k, "v": v})
    assert pool.num_slots == 6 and pool.slots_per_slab == 4 and not pool.pinned
    pool.page("v", 1, 5).fill_(7)  # slot 5 is row 1 of the second slab
    assert int(v[1][1, 1].sum()) == 7 * 20 and int(v[0].sum()) == 0
    pool.close()
    assert int(v[1][1, 1].sum()) == 7 * 20  # nothing freed: the memory stays the caller's
    with pytest.raises(ConfigError, match="rows"):
        HostPool.borrow(layout, 4, {"k": k[::-1], "v": v[::-1]})
    with pytest.raises(ConfigError, match="name payloads"):
        HostPool.borrow(layout, 4, {"k": k})
    with pytest.raises(ConfigError, match="do not form a host pool"):
        HostPool.borrow(layout, 4, {"k": k, "v": [t[:, :, :, :4] for t in v]})
