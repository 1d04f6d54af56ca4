"""Aligned page buffers of the disk tier, and the host pool pages they copy to and from.

A :class:`Staging` holds whole slots (header, payload, padding) for every payload of a page, at
4 KiB-aligned addresses, as O_DIRECT needs; :class:`HostPages` names a host pool page's bytes in
the order a slot's payload holds them (layer 0 first), as raw extents; :func:`host_page_bytes`
names them as tensor views (the shared tier's values).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt
import torch

from .disk_events import POLL_S
from .disk_format import SLOT_HEADER_BYTES, aligned_buffer
from .host_pool import HostPool

_memmove = ctypes.memmove


class Staging:
    """``num_blocks`` aligned blocks, each one page's slots for every payload, back to back.

    Bytes are copied in and out with ``ctypes.memmove``: one plain memcpy that releases the GIL
    and, unlike a torch copy, never fans out to the intra-op thread pool (which on a loaded
    machine made a 1 MiB copy 100x slower, 0.07 GB/s against 6 GB/s).
    """

    def __init__(self, slot_bytes: list[int], num_blocks: int) -> None:
        self.slot_bytes = slot_bytes
        self.offsets = [sum(slot_bytes[:k]) for k in range(len(slot_bytes))]
        self.block_bytes = sum(slot_bytes)
        self.num_blocks = num_blocks
        self._buf = aligned_buffer(self.block_bytes * num_blocks)
        self.view = memoryview(self._buf)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        whole = np.frombuffer(self._buf, dtype=np.uint8)
        #: per payload, every block's slot as a memoryview (``slot``; a vectored read's buffers)
        self._views = [
            [
                self.view[s : s + size]
                for s in range(off, num_blocks * self.block_bytes, self.block_bytes)
            ]
            for off, size in zip(self.offsets, slot_bytes, strict=True)
        ]
        #: per payload, every block's slot as one row of an array view (``disk_batch.py``)
        self._rows = [
            np.lib.stride_tricks.as_strided(
                whole[off:], shape=(num_blocks, size), strides=(self.block_bytes, 1)
            )
            for off, size in zip(self.offsets, slot_bytes, strict=True)
        ]
        self._free: deque[int] = deque(range(num_blocks))  # FIFO, under _cond
        self._cond = threading.Condition()

    def slot_start(self, block: int, kind: int) -> int:
        """Where the slot of ``kind`` in ``block`` starts in :attr:`view`."""
        return block * self.block_bytes + self.offsets[kind]

    def slot_starts(self, blocks: npt.NDArray[np.int64], kind: int) -> npt.NDArray[np.int64]:
        """:meth:`slot_start` of each of ``blocks`` (one array operation)."""
        return blocks * self.block_bytes + self.offsets[kind]

    def slot(self, block: int, kind: int) -> memoryview:
        return self._views[kind][block]

    def slot_views(self, kind: int) -> list[memoryview]:
        """Every block's slot of ``kind`` (block ``b`` at ``[b]``; do not modify the list)."""
        return self._views[kind]

    def rows(self, kind: int) -> npt.NDArray[np.uint8]:
        """``[num_blocks, slot bytes]``: every block's slot of ``kind``, a view (writable)."""
        return self._rows[kind]

    def payload_address(self, block: int, kind: int) -> int:
        """Where the payload of ``kind`` starts in ``block`` (past its slot header)."""
        return self._base + self.slot_start(block, kind) + SLOT_HEADER_BYTES

    def gather(self, block: int, kind: int, extents: list[tuple[int, int]]) -> None:
        """Copy host ``extents`` (address, bytes), in order, into the payload of a slot."""
        at = self.payload_address(block, kind)
        for src, n in extents:
            _memmove(at, src, n)
            at += n

    def scatter(self, block: int, kind: int, extents: list[tuple[int, int]]) -> None:
        """Copy a slot's payload out into host ``extents`` (address, bytes), in order."""
        at = self.payload_address(block, kind)
        for dst, n in extents:
            _memmove(dst, at, n)
            at += n

    def acquire(self, stop: threading.Event) -> int | None:
        """A free block, waiting for the writer to return one; None once ``stop`` is set."""
        got = self.acquire_many(1, stop)
        return got[0] if got else None

    def acquire_many(self, n: int, stop: threading.Event) -> list[int]:
        """Up to ``n`` free blocks (at least one), waiting for the writer to return one; none
        once ``stop`` is set. One lock for all of them: a block each cost a queue's lock and
        condition, a tenth of the gather thread's GIL time on small pages."""
        with self._cond:
            while not self._free:
                if stop.is_set():
                    return []
                self._cond.wait(POLL_S)
            if stop.is_set():
                return []
            free = self._free
            return [free.popleft() for _ in range(min(n, len(free)))]

    def release(self, block: int) -> None:
        self.release_many((block,))

    def release_many(self, blocks: Sequence[int]) -> None:
        if blocks:
            with self._cond:
                self._free.extend(blocks)
                self._cond.notify()


class HostPages:
    """The raw extents ``(address, bytes)`` of a host pool's pages, one list per payload in the
    order a slot's payload holds them: one extent of all layers in ``page_first``, one per layer
    in ``layer_first``. Addresses are worked out once per slab, so a page costs arithmetic only
    (no tensor views on the disk threads' hot path)."""

    def __init__(self, host_pool: HostPool) -> None:
        self.slots_per_slab = host_pool.slots_per_slab
        self.num_slots = host_pool.num_slots
        self._keep = host_pool.tensors()  # the memory the addresses name outlives the pool's use
        # per payload: [(slab base addresses, stride, offset, bytes) per extent]
        self._parts: list[list[tuple[list[int], int, int, int]]] = []
        # per payload, per slab: each extent's pages as rows of an array view (``rows``)
        self._arrays: list[list[list[npt.NDArray[np.uint8]]]] = []
        page_first = host_pool.host_layout == "page_first"
        for spec in host_pool.layout.payloads:
            layers = host_pool.layout.layers(spec)
            parts = []
            arrays: list[list[npt.NDArray[np.uint8]]] = [[] for _ in range(host_pool.num_slabs)]
            for layer in range(1 if page_first else layers):
                stride, offset, nbytes = host_pool.page_geometry(spec.name, layer)
                if page_first:
                    nbytes *= layers
                bases = []
                for slab, views in enumerate(arrays):
                    tensor = host_pool.slab_tensor(spec.name, layer, slab)
                    bases.append(tensor.data_ptr())
                    start, stop = host_pool.slab_bounds(slab)
                    flat = tensor.view(-1).view(torch.uint8).numpy()
                    views.append(
                        np.lib.stride_tricks.as_strided(
                            flat[offset:], shape=(stop - start, nbytes), strides=(stride, 1)
                        )
                    )
                parts.append((bases, stride, offset, nbytes))
            assert sum(p[3] for p in parts) == layers * host_pool.page_geometry(spec.name, 0)[2]
            self._parts.append(parts)
            self._arrays.append(arrays)

    def payload_bytes(self, kind: int) -> int:
        return sum(p[3] for p in self._parts[kind])

    def rows(
        self, kind: int, host_slots: Sequence[int]
    ) -> Iterator[tuple[npt.NDArray[np.int64] | None, npt.NDArray[np.int64], list[HostRows]]]:
        """``host_slots`` by host slab: ``(which of them, None for all; their rows in the slab;
        the slab's extents as ``(array view [rows, bytes], bytes)`` in payload order)``."""
        slots = np.asarray(host_slots, dtype=np.int64)
        assert slots.size == 0 or (slots.min() >= 0 and slots.max() < self.num_slots)
        slabs, rows = np.divmod(slots, self.slots_per_slab)
        arrays = self._arrays[kind]
        if slabs.size and slabs.min() == slabs.max():
            views = arrays[int(slabs[0])]
            yield None, rows, [(v, v.shape[1]) for v in views]
            return
        for slab in np.unique(slabs):
            sel = np.flatnonzero(slabs == slab)
            views = arrays[int(slab)]
            yield sel, rows[sel], [(v, v.shape[1]) for v in views]

    def extents(self, kind: int, host_slot: int) -> list[tuple[int, int]]:
        assert 0 <= host_slot < self.num_slots
        slab, row = divmod(int(host_slot), self.slots_per_slab)
        return [
            (bases[slab] + row * stride + offset, nbytes)
            for bases, stride, offset, nbytes in self._parts[kind]
        ]


#: One extent of a host slab's pages: an array view ``[rows, bytes]`` and its bytes per row.
HostRows = tuple[npt.NDArray[np.uint8], int]

_HOST_PAGES: weakref.WeakKeyDictionary[HostPool, HostPages] = weakref.WeakKeyDictionary()
_HOST_PAGES_LOCK = threading.Lock()


def host_pages(host_pool: HostPool) -> HostPages:
    """The :class:`HostPages` of ``host_pool`` (made once per pool)."""
    with _HOST_PAGES_LOCK:
        found = _HOST_PAGES.get(host_pool)
        if found is None:
            found = _HOST_PAGES[host_pool] = HostPages(host_pool)
        return found


def host_page_bytes(host_pool: HostPool, payload: str, host_slot: int) -> list[torch.Tensor]:
    """The page's bytes of ``payload`` in layer order, as uint8 views into the host pool: one
    view of all layers in ``page_first``, one per layer in ``layer_first``."""
    if host_pool.host_layout == "page_first":
        slab = host_slot // host_pool.slots_per_slab
        row = host_slot - slab * host_pool.slots_per_slab
        return [host_pool.slab_tensor(payload, 0, slab)[row].reshape(-1).view(torch.uint8)]
    return [
        host_pool.page(payload, layer, host_slot).reshape(-1).view(torch.uint8)
        for layer in range(host_pool.layout.layers(payload))
    ]
