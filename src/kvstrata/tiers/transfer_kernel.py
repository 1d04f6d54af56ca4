"""The Triton kernel behind the CUDA transfer path (used by :mod:`kvstrata.tiers.transfer` only).

One launch copies ``n`` pages of one payload in one layer between two flat arrays of machine words,
whatever tiers they live in: a pinned host slab is mapped into the device's unified address space
(``cudaHostRegister``), so the kernel's loads and stores cross PCIe directly, with no staging
buffer and no per-page launch::

    page i:  dst[dst_slots[i] * dst_stride + dst_offset + j] = src[src_slots[i] * src_stride
                                                                 + src_offset + j],  0 <= j < chunk

Work items are (page, block of ``block_words``) pairs; a program copies ``items_per_program``
consecutive items per step, and at most ``max_programs`` programs loop over the steps, so the copy
leaves most SMs to the forward it overlaps. Pages are whole, so every access is contiguous and
16-byte aligned when the chunk is (Triton specialises arguments divisible by 16).

Triton is optional (the ``gpu`` extra). Without it :func:`require_triton` fails with the fix; with
``TRITON_INTERPRET=1`` (read by Triton itself) the same kernel runs on CPU tensors, which is how the
tests exercise it on machines without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # the CUDA path then refuses to start (require_triton)
    triton = None


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the page-copy kernel.

    block_words: 32-bit words one program copies per work item (a power of two). The defaults
        come from the sweep of ``kvstrata bench transfer --sweep`` on the H200 (1024 words also
        divides an MLA page, 18,432 words, so no block is partly masked).
    num_warps: warps per program.
    items_per_program: work items (page, block) one program copies per step, unrolled.
    max_programs: at most this many programs, each looping over its share of the steps (None:
        one program per step). The copy is bound by PCIe, not by SMs, and a grid of thousands of
        long-lived copy programs takes every SM from the forward it should overlap (measured on
        the H200: an L2 hit's layer-wise load-back then added most of the copy to TTFT, and a
        write-through prefill ran 5.7% slower); a few dozen programs still fill the link.
    """

    block_words: int = 1024
    num_warps: int = 4
    items_per_program: int = 4
    max_programs: int | None = 32

    def __post_init__(self) -> None:
        bw = self.block_words
        if bw < 16 or bw & (bw - 1):
            raise ConfigError(f"block_words must be a power of two >= 16, got {bw}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ConfigError(f"num_warps must be a power of two <= 32, got {self.num_warps}")
        if not 1 <= self.items_per_program <= 64:
            raise ConfigError(
                f"items_per_program must lie in [1, 64], got {self.items_per_program}"
            )
        if self.max_programs is not None and self.max_programs < 1:
            raise ConfigError(f"max_programs must be >= 1 or None, got {self.max_programs}")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton() -> None:
    """Raise a :class:`ConfigError` saying how to get Triton, if it is missing."""
    if triton is None:
        raise ConfigError(
            "the CUDA transfer path needs Triton, which is not installed; "
            "pip install 'kvstrata[gpu]' (or triton matching your torch)"
        )


def word_dtype(chunk_bytes: int) -> torch.dtype:
    """The widest word that divides a page chunk: every offset is a multiple of the chunk."""
    for dtype in (torch.int32, torch.int16):
        if chunk_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def as_words(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor's storage as a flat array of ``dtype`` words (no copy)."""
    assert tensor.is_contiguous()
    return tensor.view(-1).view(torch.uint8).view(dtype)


if triton is not None:
    # Triton reads parameter annotations as specialisation hints, so the kernel has none. It also
    # compiles a variant per value class (== 1, % 16 == 0, other) of every integer argument:
    # the item and step counts change with every batch, and each new class cost a compile of
    # about a second in the middle of a replay (the H200's step log: two 1.9 s steps at its
    # start), so they are left unspecialised; the strides, offsets and chunk are the layout's.
    # The slot lists are often slices at any offset, so their alignment is not specialised either.
    @triton.jit(
        do_not_specialize=["num_items", "steps"],
        do_not_specialize_on_alignment=["src_slots", "dst_slots"],
    )
    def _copy_pages_kernel(  # type: ignore[no-untyped-def]
        src,
        dst,
        src_slots,
        dst_slots,
        num_items,
        parts,
        src_stride,
        dst_stride,
        src_offset,
        dst_offset,
        chunk,
        steps,
        BLOCK: tl.constexpr,
        ITEMS: tl.constexpr,
    ) -> None:
        # Step j of program p copies items (j * programs + p) * ITEMS + 0 .. ITEMS - 1; an item
        # is (page, block). The ITEMS loads of a step are unrolled so they are in flight at once.
        cols = tl.arange(0, BLOCK)
        for j in range(0, steps):
            first = (j * tl.num_programs(0) + tl.program_id(0)) * ITEMS
            for k in tl.static_range(ITEMS):
                item = first + k
                page = tl.minimum(item, num_items - 1) // parts  # past the end: masked below
                col = (item % parts) * BLOCK + cols
                mask = (col < chunk) & (item < num_items)
                s = tl.load(src_slots + page).to(tl.int64)
                d = tl.load(dst_slots + page).to(tl.int64)
                words = tl.load(src + (s * src_stride + src_offset) + col, mask=mask)
                tl.store(dst + (d * dst_stride + dst_offset) + col, words, mask=mask)


def copy_pages(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    src_stride: int,
    dst_stride: int,
    src_offset: int,
    dst_offset: int,
    chunk: int,
    config: KernelConfig,
) -> None:
    """Launch one batched copy of ``len(src_slots)`` chunks on the current stream.

    ``src``/``dst``: flat word arrays (:func:`as_words`); strides, offsets and ``chunk`` in words;
    ``src_slots``/``dst_slots``: int64 on the device the kernel runs on. Nothing is checked here:
    the caller validated the slots against both arrays.
    """
    require_triton()
    n = src_slots.numel()
    if n == 0:
        return
    block = min(config.block_words, triton.next_power_of_2(chunk))
    parts = triton.cdiv(chunk, block)
    items = n * parts
    steps = triton.cdiv(items, config.items_per_program)
    grid = steps if config.max_programs is None else min(steps, config.max_programs)
    kernel: Any = _copy_pages_kernel
    kernel[(grid,)](
        src,
        dst,
        src_slots,
        dst_slots,
        items,
        parts,
        src_stride,
        dst_stride,
        src_offset,
        dst_offset,
        chunk,
        triton.cdiv(steps, grid),
        BLOCK=block,
        ITEMS=config.items_per_program,
        num_warps=config.num_warps,
    )
