"""A small cache hierarchy (L1 + L2, optionally L3) on the CPU, and the steps the engine would
take around it, so the tier movers (WriteThrough, LoadBack, DiskTier) can be driven one call at a
time without an engine."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.cache.keys import TokenKey
from kvstrata.cache.radix import Node
from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.engine import CacheHierarchy, EngineConfig
from kvstrata.ownership import page_span
from kvstrata.tiers.pool import DevicePool

IntArray = npt.NDArray[np.int64]
PAGE = 4
LAYOUT = KVLayout(
    num_layers=3,
    payloads=(PayloadSpec("k", (2, 4), "float32"), PayloadSpec("v", (2, 4), "float32")),
)


def hierarchy(**kw: object) -> CacheHierarchy:
    base: dict[str, object] = {"page_size": PAGE, "pool_tokens": 64, "l2_tokens": 64}
    return CacheHierarchy(EngineConfig(**(base | kw)), LAYOUT)  # type: ignore[arg-type]


def fill(pool: DevicePool, pages: IntArray, seed: int) -> None:
    """Random bytes in every payload and layer of device ``pages``."""
    g = torch.Generator().manual_seed(seed)
    for spec in LAYOUT.payloads:
        for layer in range(LAYOUT.num_layers):
            buf = pool.buffer(spec.name, layer)
            rows = torch.from_numpy(pages)
            buf[rows] = torch.randn(buf[rows].shape, generator=g)


def device_bytes(pool: DevicePool, pages: IntArray) -> list[torch.Tensor]:
    rows = torch.from_numpy(pages)
    return [
        pool.buffer(s.name, layer)[rows].clone()
        for s in LAYOUT.payloads
        for layer in range(LAYOUT.num_layers)
    ]


def host_bytes(h: CacheHierarchy, host_pages: IntArray) -> list[torch.Tensor]:
    assert h.host_pool is not None
    return [
        torch.stack([h.host_pool.page(s.name, layer, int(p)) for p in host_pages])
        for s in LAYOUT.payloads
        for layer in range(LAYOUT.num_layers)
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def cached_sequence(
    h: CacheHierarchy, tokens: npt.NDArray[np.uint32], seed: int = 0
) -> tuple[TokenKey, Node, IntArray]:
    """Compute-free 'prefill': fresh device pages with random KV, inserted (device only)."""
    key = h.tree.key(tokens)
    pages = h.allocator.alloc(0, page_span(len(key), PAGE))
    assert pages is not None
    fill(h.pool, pages, seed)
    result = h.tree.insert(key, pages, 0)
    assert result.free_pages.size == 0
    return key, result.node, pages


def settle_copies(h: CacheHierarchy) -> list[tuple[int, object, bool]]:
    """Land every copy in flight, record it on the ledger and advance this rank's frontier:
    the covered tickets, for the test to hand to the mover that owns them."""
    assert h.transfer is not None
    h.transfer.synchronize()
    for done in h.transfer.poll():
        h.ledger.finish(done.ticket, done.ok, done.error)
    return [(t, kind, ok) for t, kind, ok in h.ledger.advance(h.ledger.progress())]
