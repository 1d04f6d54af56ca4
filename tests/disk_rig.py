"""Shared helpers of the disk tier tests: a layout, host pools with known bytes, waits."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.tiers.disk_format import SlabFile
from kvstrata.tiers.disk_store import DiskConfig, DiskPoll, DiskStore
from kvstrata.tiers.host_pool import HostLayout, HostPool
from kvstrata.tiers.page_hash import Namespace, page_hashes

PAGE = 4
#: K and V in bf16 plus a draft payload of another dtype and shape.
LAYOUT = KVLayout(
    3,
    (
        PayloadSpec("k", (2, 8), "bfloat16"),
        PayloadSpec("v", (2, 8), "bfloat16"),
        PayloadSpec("draft", (5,), "float32"),
    ),
)
NS = Namespace.for_layout("test-model", LAYOUT, PAGE)


def host_pool(
    slots: int = 64, host_layout: HostLayout = "page_first", layout: KVLayout = LAYOUT
) -> HostPool:
    return HostPool(layout, PAGE, slots, host_layout=host_layout, pin=False, check_memory=False)


def page_content(page_hash: bytes, nbytes: int) -> bytes:
    """Bytes derived from the page hash only, so any process can say what a page must hold."""
    out = b""
    counter = 0
    while len(out) < nbytes:
        out += hashlib.sha256(page_hash + counter.to_bytes(4, "little")).digest()
        counter += 1
    return out[:nbytes]


def write_page(pool: HostPool, slot: int, page_hash: bytes) -> None:
    """Fill every payload and layer of host ``slot`` with ``page_hash``'s content."""
    for spec in pool.layout.payloads:
        for layer in range(pool.layout.num_layers):
            dst = pool.page(spec.name, layer, slot).reshape(-1).view(torch.uint8)
            seed = page_hash + spec.name.encode() + bytes([layer])
            dst.copy_(
                torch.frombuffer(bytearray(page_content(seed, dst.numel())), dtype=torch.uint8)
            )


def read_page(pool: HostPool, slot: int) -> bytes:
    return b"".join(
        pool.page(spec.name, layer, slot).reshape(-1).view(torch.uint8).numpy().tobytes()
        for spec in pool.layout.payloads
        for layer in range(pool.layout.num_layers)
    )


def expected_page(pool: HostPool, page_hash: bytes) -> bytes:
    return b"".join(
        page_content(
            page_hash + spec.name.encode() + bytes([layer]),
            PAGE * spec.token_bytes,
        )
        for spec in pool.layout.payloads
        for layer in range(pool.layout.num_layers)
    )


def hashes(n: int, seed: int = 0, ns: Namespace = NS) -> list[bytes]:
    """``n`` chained page hashes of one sequence."""
    tokens = [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(n * ns.page_size)]
    return page_hashes(ns, tokens)


def budget_for(pages: int, ns: Namespace = NS, io_mode: str = "auto") -> int:
    """A budget of exactly ``pages`` pages (``io_mode``'s slots)."""
    from kvstrata.tiers.disk_format import ALIGN
    from kvstrata.tiers.disk_open import page_cost

    page = sum(page_cost(ns.payload_bytes(k), io_mode) for k in range(len(ns.payloads)))
    return pages * page + len(ns.payloads) * ALIGN


def open_store(
    root: Path, pages: int = 100, ns: Namespace = NS, rank: int = 0, **kw: Any
) -> DiskStore:
    budget = budget_for(pages, ns, kw.get("io_mode", "auto"))
    return DiskStore(ns, rank, DiskConfig(root, budget, **kw))


def wait_until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def spill_all(
    store: DiskStore, pool: HostPool, page_hashes_: list[bytes], ticket: int, hits: int = 1
) -> DiskPoll:
    """Write the pages into host slots 0.., spill them as one ticket, wait, and poll."""
    for slot, h in enumerate(page_hashes_):
        write_page(pool, slot, h)
    assert store.spill(ticket, [(h, slot, hits) for slot, h in enumerate(page_hashes_)], pool)
    assert store.flush(30)
    return store.poll()


def patch_slot_io(monkeypatch: Any, op: str, before: Callable[[SlabFile, int], None]) -> None:
    """Call ``before(slab, slot)`` ahead of every slot ``op`` ("read" or "write") of every slab,
    those of a vectored call slot by slot included (fault injection: ``before`` may raise
    OSError, which fails the whole vectored call, as a device would, and then that slot alone
    when the store retries slot by slot)."""
    one, run = getattr(SlabFile, f"{op}_slot"), getattr(SlabFile, f"{op}_slots")

    def single(self: SlabFile, slot: int, buf: memoryview) -> Any:
        before(self, slot)
        return one(self, slot, buf)

    def vectored(self: SlabFile, first: int, bufs: list[memoryview]) -> Any:
        for slot in range(first, first + len(bufs)):
            before(self, slot)
        return run(self, first, bufs)

    monkeypatch.setattr(SlabFile, f"{op}_slot", single)
    monkeypatch.setattr(SlabFile, f"{op}_slots", vectored)


def engine_counts(engine: Any) -> dict[str, object]:
    """What a replay through an engine with a disk tier must give alike every run: hit tokens
    per tier, the engine's and the store's disk counts, the tree."""
    disk = engine.cache.disk
    assert disk is not None
    store = disk.store.stats()
    return {
        "hit_tokens": dict(engine.hit_tokens),
        "engine": vars(disk.stats).copy(),
        "store": (store.pages_written, store.pages_read, store.gc_reclaimed, store.spills_refused),
        "tree": engine.cache.tree.digest(),
    }
