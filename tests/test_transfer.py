"""Tests for kvstrata.tiers.transfer: byte-exact round trips, slab grouping, failures, contract, stats.

CPU tests run the torch path; one test runs the Triton kernel in Triton's CPU interpreter; tests
marked ``gpu`` run the CUDA path (streams, events, pinned memory) where a GPU exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.errors import ConfigError, TransferError, TransferTimeoutError
from kvstrata.tiers.host_pool import HOST_LAYOUTS, HostLayout, HostPool
from kvstrata.tiers.pool import DevicePool
from kvstrata.tiers.transfer import Completion, Transfer

PAGE = 4
LAYOUT = KVLayout(
    num_layers=3,
    payloads=(
        PayloadSpec("k", (2, 8), "bfloat16"),
        PayloadSpec("v", (2, 8), "bfloat16"),
        PayloadSpec("q8", (3,), "uint8"),  # 12-byte pages: neither 16- nor 8-byte multiples
        PayloadSpec("scale", (5,), "float32"),
        PayloadSpec("h", (1,), "float16"),  # with page size 3: 6-byte pages, 16-bit words
    ),
)
DEVICE_SLOTS, HOST_SLOTS = 24, 17


def _slot_bytes(host_layout: HostLayout, page_size: int = PAGE) -> int:
    per_layer = 1 if host_layout == "layer_first" else LAYOUT.num_layers
    return max(page_size * per_layer * p.token_bytes for p in LAYOUT.payloads)


def _pools(
    host_layout: HostLayout,
    slab_pages: int | None = None,
    device: str = "cpu",
    page_size: int = PAGE,
) -> tuple[DevicePool, HostPool]:
    dev = DevicePool(LAYOUT, page_size, DEVICE_SLOTS, device)
    for spec in LAYOUT.payloads:
        for layer in range(LAYOUT.num_layers):
            dev.buffer(spec.name, layer).view(torch.uint8).random_(0, 256)  # NaNs too: bytes
    cap = slab_pages * _slot_bytes(host_layout, page_size) if slab_pages else 2**40
    host = HostPool(LAYOUT, page_size, HOST_SLOTS, host_layout, max_alloc_bytes=cap)
    host.check()
    return dev, host


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().cpu().view(torch.uint8)


def _assert_host_holds(
    dev: DevicePool, host: HostPool, dev_slots: torch.Tensor, host_slots: torch.Tensor
) -> None:
    if not len(host_slots):
        return
    for spec in LAYOUT.payloads:
        for layer in range(LAYOUT.num_layers):
            want = _bytes(dev.buffer(spec.name, layer)[dev_slots.to(dev.device)])
            got = torch.stack([_bytes(host.page(spec.name, layer, int(s))) for s in host_slots])
            assert torch.equal(got, want), (spec.name, layer)


def _round_trip(t: Transfer, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
    """d2h ``dev_slots`` -> ``host_slots``, then h2d into fresh device slots; bytes must match."""
    dev, host = t.device_pool, t.host_pool
    for layer in range(LAYOUT.num_layers):
        t.d2h(1, layer, dev_slots, host_slots)
    t.close(1, LAYOUT.num_layers)
    t.wait(1)
    assert t.poll() == [Completion(1, True, None)]
    _assert_host_holds(dev, host, dev_slots, host_slots)
    others = torch.tensor([s for s in range(DEVICE_SLOTS) if s not in set(dev_slots.tolist())])
    back = others[torch.randperm(len(others))[: len(host_slots)]]
    for layer in range(LAYOUT.num_layers):
        t.h2d(2, layer, host_slots, back)
        t.wait_layer(2, layer)
    t.close(2, LAYOUT.num_layers)
    t.synchronize()
    assert t.poll() == [Completion(2, True, None)]
    _assert_host_holds(dev, host, back, host_slots)


@settings(max_examples=40, deadline=None)
@given(
    host_layout=st.sampled_from(HOST_LAYOUTS),
    slab_pages=st.sampled_from([None, 1, 2, 5]),
    n=st.integers(0, DEVICE_SLOTS // 2),  # the loads go to other device slots
    seed=st.integers(0, 2**31),
)
def test_round_trip_is_byte_exact(
    host_layout: HostLayout, slab_pages: int | None, n: int, seed: int
) -> None:
    torch.manual_seed(seed)
    dev, host = _pools(host_layout, slab_pages)
    t = Transfer(dev, host)
    dev_slots = torch.randperm(DEVICE_SLOTS)[:n]
    host_slots = torch.randperm(HOST_SLOTS)[:n]
    _round_trip(t, dev_slots, host_slots)
    s = t.stats()
    page_bytes = LAYOUT.page_bytes(PAGE)
    assert (s.d2h_pages, s.h2d_pages, s.d2h_bytes, s.h2d_bytes) == (
        n,
        n,
        n * page_bytes,
        n * page_bytes,
    )
    assert (s.failed_copies, s.failed_tickets, s.in_flight_tickets) == (0, 0, 0)


@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
def test_no_copy_crosses_a_slab_boundary(
    host_layout: HostLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every copy the transfer issues addresses one slab, with rows inside it, and together the
    copies of one layer and payload move each page exactly once."""
    dev, host = _pools(host_layout, slab_pages=3)
    assert host.num_slabs == 6
    t = Transfer(dev, host)
    calls: list[tuple[str, int, int, torch.Tensor, torch.Tensor]] = []
    real = t.copier.copy

    def spy(
        direction: Any, payload: str, layer: int, slab: int, d: torch.Tensor, r: torch.Tensor
    ) -> None:
        start, stop = host.slab_bounds(slab)
        assert bool(((r >= 0) & (r < stop - start)).all()), "a copy ran past its slab"
        calls.append((payload, layer, slab, d.clone(), r + start))
        real(direction, payload, layer, slab, d, r)

    monkeypatch.setattr(t.copier, "copy", spy)
    gen = torch.Generator().manual_seed(0)  # not the global RNG: other tests move it
    dev_slots = torch.randperm(DEVICE_SLOTS, generator=gen)[:12]
    host_slots = torch.randperm(HOST_SLOTS, generator=gen)[:12]
    _round_trip(t, dev_slots, host_slots)
    pairs = dict(zip(host_slots.tolist(), dev_slots.tolist(), strict=True))
    for payload in ("k", "q8"):
        got = [(h, d) for p, layer, _, ds, hs in calls[: len(calls) // 2] if (p, layer) == (payload, 0)
               for d, h in zip(ds.tolist(), hs.tolist(), strict=True)]  # fmt: skip
        assert sorted(got) == sorted(pairs.items())
    touched = {int(s) // host.slots_per_slab for s in host_slots}
    assert {slab for _, _, slab, _, _ in calls} == touched


def test_numpy_slots_and_empty_copies() -> None:
    dev, host = _pools("layer_first")
    t = Transfer(dev, host)
    t.d2h(5, 0, np.array([3, 1]), np.array([0, 16], dtype=np.int32))
    t.d2h(5, 1, np.array([3, 1]), np.array([0, 16]))
    t.d2h(5, 2, np.array([3, 1]), np.array([0, 16]))
    t.close(5, 3)
    t.d2h(6, 0, np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    t.close(6, 1)
    assert t.poll() == [Completion(5, True, None), Completion(6, True, None)]
    _assert_host_holds(dev, host, torch.tensor([3, 1]), torch.tensor([0, 16]))


def test_a_failed_copy_fails_its_ticket_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    dev, host = _pools("page_first")
    t = Transfer(dev, host)
    real = t.copier.copy
    fault = {"armed": False}

    def flaky(direction: Any, payload: str, *rest: Any) -> None:
        if fault["armed"] and payload == "v":
            fault["armed"] = False
            raise RuntimeError("CUDA error: injected fault\nmore text")
        real(direction, payload, *rest)

    monkeypatch.setattr(t.copier, "copy", flaky)
    for h in host.tensors():
        h.view(torch.uint8).zero_()
    ok_slots, bad_slots = torch.tensor([2, 7, 9]), torch.tensor([3, 4])
    for layer in range(3):
        t.d2h(1, layer, ok_slots, ok_slots)
        fault["armed"] = layer == 1
        t.d2h(2, layer, bad_slots, bad_slots)  # fails at layer 1; layer 2 is not copied
    t.close(2, 3)
    t.close(1, 3)
    assert t.poll() == [
        Completion(2, False, "d2h layer 1: CUDA error: injected fault"),
        Completion(1, True, None),
    ]
    _assert_host_holds(dev, host, ok_slots, ok_slots)
    assert host.page("k", 0, 3).view(torch.uint8).any()  # landed before the fault
    assert not host.page("k", 2, 3).view(torch.uint8).any()  # never copied
    s = t.stats()
    assert (s.failed_copies, s.failed_tickets, s.d2h_pages, s.in_flight_tickets) == (1, 1, 3, 0)
    assert s.d2h_bytes == 3 * LAYOUT.page_bytes(PAGE)

    # A failed load: wait_layer refuses, so a forward never reads pages that did not arrive.
    t.h2d(3, 0, bad_slots, bad_slots)
    fault["armed"] = True
    t.h2d(3, 1, bad_slots, bad_slots)
    t.wait_layer(3, 0)
    with pytest.raises(TransferError, match="load 3 failed, layer 1 never arrived"):
        t.wait_layer(3, 1)
    t.h2d(3, 2, bad_slots, bad_slots)
    t.close(3, 3)
    assert t.poll() == [Completion(3, False, "h2d layer 1: CUDA error: injected fault")]
    assert t.stats().failed_tickets == 2 and t.stats().h2d_pages == 0


def _contract_transfer() -> Transfer:
    dev, host = _pools("layer_first")
    return Transfer(dev, host)


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([("d2h", 1, 0, [0], [0]), ("d2h", 1, 0, [1], [1])], "submitted twice"),
        ([("d2h", 1, 3, [0], [0])], "out of range"),
        ([("d2h", 1, 0, [0], [0]), ("h2d", 1, 1, [0], [0])], "a d2h ticket"),
        ([("d2h", 1, 0, [0, 1], [0])], "2 device and 1 host"),
        ([("d2h", 1, 0, [0, 1], [0, 1]), ("d2h", 1, 1, [0], [0])], "earlier layers moved 2"),
        ([("d2h", 1, 0, [DEVICE_SLOTS], [0])], r"device slots must lie in \[0, 24\)"),
        ([("d2h", 1, 0, [0], [-1])], r"host slots must lie in \[0, 17\)"),
        ([("d2h", 1, 0, [[0]], [[0]])], "1-D integer"),
        ([("d2h", 1, 0, [0], [0]), ("close", 1, 3)], "1 of 3 layers"),
        ([("close", 4, 1)], "ticket 4 is unknown"),
        ([("wait", 4)], "ticket 4 is unknown"),
        ([("d2h", 1, 0, [0], [0]), ("wait", 1)], "not closed"),
        ([("wait_layer", 1, 0)], "no load of layer 0"),
        ([("d2h", 1, 0, [0], [0]), ("wait_layer", 1, 0)], "no load of layer 0"),
        ([("h2d", 1, 0, [0], [0]), ("close", 1, 1), ("h2d", 1, 1, [0], [0])], "closed"),
    ],
)
def test_contract_violations_raise(steps: list[tuple[Any, ...]], message: str) -> None:
    t = _contract_transfer()

    def run(step: tuple[Any, ...]) -> None:
        op, *a = step
        if op in ("d2h", "h2d"):
            getattr(t, op)(a[0], a[1], torch.tensor(a[2]), torch.tensor(a[3]))
        else:
            getattr(t, op)(*a)

    for step in steps[:-1]:
        run(step)
    with pytest.raises(TransferError, match=message):
        run(steps[-1])


def test_poll_returns_tickets_in_close_order_per_direction() -> None:
    t = _contract_transfer()
    one = torch.tensor([1])
    for ticket in (10, 11, 12):
        t.d2h(ticket, 0, one, one)
    t.h2d(20, 0, one, one)
    t.close(12, 1)
    t.close(20, 1)
    t.close(10, 1)
    assert t.stats().in_flight_tickets == 4  # 11 is still open
    assert [c.ticket for c in t.poll()] == [12, 10, 20]
    assert t.poll() == []
    t.close(11, 1)
    assert [c.ticket for c in t.poll()] == [11]
    assert t.stats().in_flight_tickets == 0


def test_bounded_waits_time_out() -> None:
    with pytest.raises(TransferTimeoutError, match="within 0.01 s"):
        Transfer._wait_until(lambda: False, "the test", 0.01)


def test_mismatched_pools_and_backends_are_refused() -> None:
    dev, host = _pools("layer_first")
    other = HostPool(LAYOUT, PAGE * 2, 4, pin=False)
    with pytest.raises(ConfigError, match="different pages"):
        Transfer(dev, other)
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
            Transfer(dev, host, backend="triton")


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    import triton_interpreter
    triton_interpreter.patch_loop_bounds()  # each program loops over its share of the steps
    import test_transfer as tt
    from kvstrata.tiers.transfer import Transfer
    from kvstrata.tiers.transfer_kernel import KernelConfig
    torch.manual_seed(0)
    cases = (
        (None, 4, KernelConfig()),
        (3, 3, KernelConfig(16, 1, 3, 2)),
        (2, 3, KernelConfig(max_programs=None)),
        (None, 2, KernelConfig(16, 1, 1, 1)),
    )
    for host_layout in ("layer_first", "page_first"):
        for slab_pages, page_size, kernel in cases:
            dev, host = tt._pools(host_layout, slab_pages, page_size=page_size)
            t = Transfer(dev, host, backend="triton", kernel=kernel)
            assert type(t.copier).__name__ == "TritonCopier"
            tt._round_trip(t, torch.randperm(tt.DEVICE_SLOTS)[:12], torch.randperm(tt.HOST_SLOTS)[:12])
    print("interpreted kernel round trips: ok")
    """
)


@pytest.mark.slow
def test_triton_kernel_round_trips_in_the_interpreter() -> None:
    """The CUDA path's kernel, run by Triton's CPU interpreter: every word size (page size 3
    gives 9-byte uint8 pages: bytes; 6-byte fp16 pages: 16-bit words; the rest 32-bit words),
    blocks smaller than a page, several items per program, programs looping over several steps
    (1 or 2 programs for many steps), slabs, both host layouts."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'kvstrata[gpu]')")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT, str(Path(__file__).parent)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout


# -- CUDA path ---------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
@pytest.mark.parametrize(("slab_pages", "page_size"), [(None, 4), (2, 3), (None, 64)])
def test_cuda_round_trip_is_byte_exact(
    host_layout: HostLayout, slab_pages: int | None, page_size: int
) -> None:
    dev, host = _pools(host_layout, slab_pages, device="cuda", page_size=page_size)
    assert host.pinned
    t = Transfer(dev, host)
    assert t.backend == "triton"
    for _ in range(3):
        _round_trip(t, torch.randperm(DEVICE_SLOTS)[:11], torch.randperm(HOST_SLOTS)[:11])


@pytest.mark.gpu
@gpu
def test_cuda_copies_never_sync_the_host_and_respect_stream_order() -> None:
    """d2h reads what the current stream wrote just before (even when a long kernel precedes
    the write); h2d's wait_layer orders the consumer after the load; no call syncs the host."""
    dev, host = _pools("layer_first", device="cuda")
    t = Transfer(dev, host)
    big = torch.randn(4096, 4096, device="cuda")
    slots = torch.arange(8)
    buf = dev.buffer("k", 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for value in (1.0, 2.0, 3.0):
            for _ in range(8):  # keep the compute stream busy
                big = big @ big / 4096
            buf[:8].fill_(value)  # the freshly written KV
            for layer in range(3):
                t.d2h(int(value), layer, slots, slots)
            t.close(int(value), 3)
        t.wait(3)  # a backup is loaded back only after it landed (bounded, polls the event)
        for layer in range(3):
            t.h2d(7, layer, slots, slots + 8)
            t.wait_layer(7, layer)
        got = buf[8:16].float().sum()  # ordered after the load on the current stream
        t.close(7, 3)
        done = t.poll()  # non-blocking: whatever finished
    finally:
        torch.cuda.set_sync_debug_mode("default")
    t.synchronize()
    done += t.poll()
    assert sorted(c.ticket for c in done) == [1, 2, 3, 7] and all(c.ok for c in done)
    assert float(host.page("k", 0, 5).float().mean()) == 3.0
    assert float(got) == 3.0 * 8 * PAGE * 16
