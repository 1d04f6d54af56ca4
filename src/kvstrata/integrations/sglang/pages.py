"""SGLang's host pool pages as a kvstrata host pool, and SGLang's page keys as page hashes.

SGLang's host pools say where a page's bytes are through ``get_page_buffer_meta(indices)``: a
pointer and a size per page and per *component* (K and V of an MHA pool, the latent of an MLA
pool; one per layer and K/V in ``layer_first``). Every component of every page is one contiguous
extent, and page ``p``'s extent of component ``c`` starts ``p * size_c`` bytes after page 0's::

    kv_buffer bytes   [ K page 0 | K page 1 | ... | K page N-1 ][ V page 0 | ... | V page N-1 ]
                        ^ ptr(0, K)  (+size_K per page)            ^ ptr(0, V)

So each component is a ``[pages, size_c]`` byte slab inside ``kv_buffer``, and
:meth:`~kvstrata.tiers.host_pool.HostPool.borrow` turns them into a ``page_first`` host pool
whose slot ``p`` is SGLang's page ``p`` and whose payload ``c`` is component ``c``: the disk tier
gathers from and scatters into SGLang's memory directly, with no copy of its own. Each call's
host pages are located through ``get_page_buffer_meta`` itself (a pointer that is not a page
start of that slab is refused), so what is read and written is exactly what SGLang names.

A page key is a string; its page hash is ``SHA-256("kvstrata-sglang-key" ‖ key)``. The
namespace (:func:`namespace_for`) fingerprints the model, the pool's class, layout, dtype,
layers and page size, the interface and the rank that stores the page, so two of any of those
never share a page.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from ...config import KVLayout, PayloadSpec
from ...errors import ConfigError
from ...tiers.host_pool import HostPool
from ...tiers.page_hash import Namespace

_KEY_DOMAIN = b"kvstrata-sglang-key\x00"
#: Bumped when the mapping of SGLang pages to kvstrata pages changes (part of every namespace).
MAPPING_VERSION = 1


def key_hash(key: str) -> bytes:
    """The kvstrata page hash of SGLang page key ``key`` (its namespace is the store's)."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"an SGLang page key is a non-empty string, got {key!r}")
    return hashlib.sha256(_KEY_DOMAIN + key.encode()).digest()


def _meta(pool: Any, page: int, page_size: int) -> tuple[list[int], list[int]]:
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page * page_size, (page + 1) * page_size))
    return [int(p) for p in ptrs], [int(s) for s in sizes]


class SGLangPages:
    """One SGLang host pool seen as a borrowed kvstrata :class:`HostPool` (module docstring)."""

    def __init__(self, pool: Any, *, is_mla: bool) -> None:
        if int(getattr(pool, "dcp_size", 1)) != 1:
            raise ConfigError(
                "the kvstrata storage backend does not support decode context parallel "
                "(dcp_size > 1) host pools; run without DCP or use SGLang's file backend"
            )
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
            raise ConfigError(
                f"the host pool {type(pool).__name__} keeps no contiguous kv_buffer in CPU memory "
                "(an allocator-only or split-buffer pool); the kvstrata backend cannot serve it"
            )
        self.pool, self.is_mla = pool, is_mla
        self.page_size = int(pool.page_size)
        self.num_pages = int(pool.size) // self.page_size
        if self.num_pages < 2:
            raise ConfigError(f"the host pool holds {self.num_pages} pages; it needs at least 2")
        base = buf.data_ptr()
        ptr0, sizes = _meta(pool, 0, self.page_size)
        ptr1, sizes1 = _meta(pool, 1, self.page_size)
        last = self.num_pages - 1
        ptr_last, sizes_last = _meta(pool, last, self.page_size)
        if not ptr0 or sizes != sizes1 or sizes != sizes_last or len(ptr1) != len(ptr0):
            raise ConfigError(f"{type(pool).__name__}: pages report different component sizes")
        byte_view = buf.view(-1).view(torch.uint8)
        self.names = self._names(len(ptr0))
        self._starts: list[int] = []
        slabs: dict[str, list[torch.Tensor]] = {}
        specs = []
        for c, (name, size) in enumerate(zip(self.names, sizes, strict=True)):
            offset = ptr0[c] - base
            # Pages of one component must be back to back: page p at offset + p * size.
            if (
                ptr1[c] - ptr0[c] != size
                or ptr_last[c] - ptr0[c] != last * size
                or offset < 0
                or offset + self.num_pages * size > buf.nbytes
                or size % self.page_size
            ):
                raise ConfigError(
                    f"{type(pool).__name__} in layout {pool.layout!r}: component {c} is not one "
                    "contiguous extent per page inside kv_buffer; the kvstrata backend cannot "
                    "address it"
                )
            specs.append(PayloadSpec(name, (size // self.page_size,), "uint8"))
            slab = byte_view[offset : offset + self.num_pages * size]
            slabs[name] = [slab.view(self.num_pages, 1, self.page_size, size // self.page_size)]
            self._starts.append(ptr0[c])
        self.sizes = sizes
        self.layout = KVLayout(1, tuple(specs))
        self.host_pool = HostPool.borrow(self.layout, self.page_size, slabs)

    def _names(self, n: int) -> list[str]:
        if self.is_mla and n == 1:
            return ["latent"]
        if not self.is_mla and n == 2:
            return ["k", "v"]
        return [f"part{c}" for c in range(n)]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, every component."""
        return sum(self.sizes)

    def slots(self, host_indices: torch.Tensor, num_pages: int) -> list[int]:
        """The host pool page of each of ``num_pages`` pages in ``host_indices`` (token indices,
        ``page_size`` per page), located through the pool's ``get_page_buffer_meta``."""
        if host_indices.numel() != num_pages * self.page_size:
            raise ConfigError(
                f"{num_pages} page keys for {host_indices.numel()} host indices; SGLang passes "
                f"page_size ({self.page_size}) indices per key"
            )
        if num_pages == 0:
            return []
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        n = len(self.sizes)
        if len(ptrs) != n * num_pages or list(sizes[:n]) != self.sizes:
            raise ConfigError(
                f"get_page_buffer_meta gave {len(ptrs)} extents for {num_pages} pages of {n}"
            )
        out = []
        for i in range(num_pages):
            slot = -1
            for c in range(n):
                at, rest = divmod(int(ptrs[i * n + c]) - self._starts[c], self.sizes[c])
                if rest or not 0 <= at < self.num_pages or slot not in (-1, at):
                    raise ConfigError(
                        f"host indices of page {i} (from {int(host_indices[i * self.page_size])}) "
                        "do not name one whole host page"
                    )
                slot = at
            out.append(slot)
        return out

    def flat_pool(self, pages: Sequence[torch.Tensor]) -> HostPool:
        """A host pool over flat data pages (``get_data_page(flat=True)`` tensors), one slot
        each, the components back to back in order: the legacy ``get``/``set`` interface."""
        slabs: dict[str, list[torch.Tensor]] = {name: [] for name in self.names}
        for t in pages:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                raise ConfigError("a flat data page must be a contiguous CPU tensor")
            flat = t.view(-1).view(torch.uint8)
            if flat.numel() != self.page_bytes:
                raise ConfigError(
                    f"a flat data page of {flat.numel()} bytes, not {self.page_bytes}"
                )
            at = 0
            for name, size in zip(self.names, self.sizes, strict=True):
                part = flat[at : at + size].view(1, 1, self.page_size, size // self.page_size)
                slabs[name].append(part)
                at += size
        return HostPool.borrow(self.layout, self.page_size, slabs)

    def describe(self) -> dict[str, Any]:
        """What the pages' bytes depend on, beyond their sizes (for the namespace)."""
        pool = self.pool
        return {
            "pool": type(pool).__name__,
            "layout": str(pool.layout),
            "dtype": str(pool.dtype),
            "layers": int(getattr(pool, "layer_num", 0)),
            "page_size": self.page_size,
            "format_tag": getattr(pool, "storage_format_tag", None),
        }


def namespace_for(
    model_name: str | None, pages: SGLangPages, shard: dict[str, int], interface: str
) -> Namespace:
    """The store's namespace: SGLang's rank ``shard`` and the page geometry folded into the
    model id, so two ranks, models, layouts or page sizes never see each other's pages."""
    doc = {
        "engine": "sglang",
        "mapping": MAPPING_VERSION,
        "model": model_name or "",
        "interface": interface,
        "shard": shard,
        **pages.describe(),
    }
    model_id = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return Namespace(model_id, 1, pages.layout.payloads, pages.page_size)
