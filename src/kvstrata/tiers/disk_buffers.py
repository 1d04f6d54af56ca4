"""Aligned page buffers of the disk tier, and the host pool pages they copy to and from.

A :class:`Staging` holds whole slots (header, payload, padding) for every payload of a page, at
4 KiB-aligned addresses, as O_DIRECT needs; :func:`host_page_bytes` names a host pool page's bytes
in the order a slot's payload holds them (layer 0 first).
"""

from __future__ import annotations

import ctypes
import queue
import threading

import torch

from .disk_events import POLL_S
from .disk_format import SLOT_HEADER_BYTES, aligned_buffer
from .host_pool import HostPool


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
        self._free: queue.Queue[int] = queue.Queue(maxsize=num_blocks)
        for b in range(num_blocks):
            self._free.put_nowait(b)

    def slot(self, block: int, kind: int) -> memoryview:
        start = block * self.block_bytes + self.offsets[kind]
        return self.view[start : start + self.slot_bytes[kind]]

    def _payload_at(self, block: int, kind: int, pages: list[torch.Tensor]) -> int:
        # Raw copies: the tensors must be what the slot's payload holds, byte for byte.
        assert all(t.dtype == torch.uint8 and t.is_contiguous() for t in pages)
        assert sum(t.numel() for t in pages) <= self.slot_bytes[kind] - SLOT_HEADER_BYTES
        return self._base + block * self.block_bytes + self.offsets[kind] + SLOT_HEADER_BYTES

    def gather(self, block: int, kind: int, pages: list[torch.Tensor]) -> None:
        """Copy ``pages`` (contiguous uint8 tensors, in order) into the payload of a slot."""
        at = self._payload_at(block, kind, pages)
        for src in pages:
            ctypes.memmove(at, src.data_ptr(), src.numel())
            at += src.numel()

    def scatter(self, block: int, kind: int, pages: list[torch.Tensor]) -> None:
        """Copy a slot's payload out into ``pages`` (contiguous uint8 tensors, in order)."""
        at = self._payload_at(block, kind, pages)
        for dst in pages:
            ctypes.memmove(dst.data_ptr(), at, dst.numel())
            at += dst.numel()

    def acquire(self, stop: threading.Event) -> int | None:
        """A free block, waiting for the writer to return one; None once ``stop`` is set."""
        while not stop.is_set():
            try:
                return self._free.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None

    def release(self, block: int) -> None:
        self._free.put_nowait(block)


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
