"""Per-forward index metadata: where each packed token lives in the paged device pool.

A forward packs the extend tokens of every request back to back, without padding::

    packed tokens   | r0 extend (3) | r1 extend (5)       |        T = 8
    cu_seqlens      0               3                     8

Request ``i`` owns tokens ``[0, prefix_lens[i] + extend_lens[i])`` of its sequence; the first
``prefix_lens[i]`` are already in the pool, the rest are computed now. Its page table lists the pool
slot of every page, and token ``t`` lives in pool row ``page_table[t // P] * P + t % P``::

    page table   [7, 2, 9], P = 4: slot 7 holds tokens 0-3, slot 2 tokens 4-7, slot 9 tokens 8-11
    token t       0  1  2  3  4  5 |  6  7  8  9 10
    pool row     28 29 30 31  8  9 | 10 11 36 37 38
                 prefix 6: read    | extend 5: written now, then read

:class:`ForwardBatch` computes all of this once per forward, so the per-layer code only indexes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from ..errors import ConfigError, RequestError
from ..ownership import page_span

PageTable = torch.Tensor | npt.NDArray[np.integer] | Sequence[int]


class ContextParallel(Protocol):
    """What a forward under context parallelism needs from the rank group (implemented by
    ``kvstrata.dist.attention.CPStep``): attention whose keys other ranks hold, the last-token
    rows other ranks computed, and per-request values summed over ranks."""

    all_tokens: torch.Tensor  # [T] every extend token of the step, on every rank
    all_positions: torch.Tensor  # [T]
    mine: torch.Tensor  # [T] bool: the tokens this rank computes
    ext_offsets: tuple[int, ...]  # where each request's extend starts in ``all_tokens``
    prefix_last_rows: torch.Tensor  # per request: this rank's pool row of its last prefix token

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
    ) -> torch.Tensor: ...

    def gather_last(self, rows: torch.Tensor) -> torch.Tensor: ...

    def share(self, values: torch.Tensor) -> torch.Tensor: ...


class LayerHooks(Protocol):
    """Called by a forward around each layer: the tier movers' way in (load-back waits for a
    layer's copy before it reads the pool; write-through copies a layer out once it is written)."""

    def before_layer(self, layer: int) -> None: ...

    def after_layer(self, layer: int) -> None: ...


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Where the packed tokens of one forward read and write their K/V.

    prefix_lens / extend_lens: per request, tokens already cached / computed in this forward.
    cu_seqlens_host: ``[R + 1]`` start of each request's extend tokens in the packed batch (Python
        ints, for slicing without a device sync); ``cu_seqlens`` is the same on the device.
    positions: ``[T]`` absolute position of every packed token.
    write_index: ``[T]`` pool token row that receives each packed token's K/V.
    read_index: per request, ``[prefix + extend]`` pool rows of its whole sequence so far.
    last_index: ``[R]`` packed index of each request's last token (whose logits a prefill returns).
    """

    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    page_size: int
    cu_seqlens_host: tuple[int, ...]
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    write_index: torch.Tensor
    read_index: tuple[torch.Tensor, ...]
    last_index: torch.Tensor
    cp: ContextParallel | None = None  # set under context parallelism: this rank's share

    @property
    def num_requests(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        """Packed tokens computed by this forward (the sum of the extend lengths)."""
        return self.cu_seqlens_host[-1]

    @classmethod
    def build(
        cls,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        page_tables: Sequence[PageTable],
        page_size: int,
        device: str | torch.device = "cpu",
        num_slots: int | None = None,
    ) -> ForwardBatch:
        """Validate one batch of requests and precompute its indices on ``device``.

        ``page_tables[i]`` lists the rank-local pool slots of request ``i``'s pages and must cover
        its ``prefix_lens[i] + extend_lens[i]`` tokens. With ``num_slots`` (the pool's slot count),
        slots are range-checked on the host, so a bad table raises here instead of as a device
        assertion mid-forward.
        """
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ConfigError(f"page_size must be an integer >= 1, got {page_size!r}")
        if not len(prefix_lens) == len(extend_lens) == len(page_tables):
            raise ConfigError(
                f"a batch needs one prefix length, extend length and page table per request; got "
                f"{len(prefix_lens)}, {len(extend_lens)} and {len(page_tables)}"
            )
        if not extend_lens:
            raise ConfigError("a batch needs at least one request")
        device = torch.device(device)
        prefix_lens = tuple(int(n) for n in prefix_lens)
        extend_lens = tuple(int(n) for n in extend_lens)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        offsets = torch.arange(page_size, dtype=torch.int64)

        rows, positions = [], []
        for i, (prefix, extend, table) in enumerate(
            zip(prefix_lens, extend_lens, page_tables, strict=True)
        ):
            slots = _check_request(i, prefix, extend, table, page_size, num_slots)
            rows.append((slots[:, None] * page_size + offsets).flatten()[: prefix + extend])
            positions.append(torch.arange(prefix, prefix + extend, dtype=torch.int64))
        cu_seqlens_host = tuple(accumulate(extend_lens, initial=0))
        write_rows = [r[prefix:] for r, prefix in zip(rows, prefix_lens, strict=True)]

        # One host-to-device copy for every index tensor, then views into it:
        #   [ read rows of r0 | r1 | ... | write rows (T) | positions (T) | cu_seqlens (R + 1) ]
        num_tokens = cu_seqlens_host[-1]
        packed = torch.cat(
            [*rows, *write_rows, *positions, torch.tensor(cu_seqlens_host, dtype=torch.int64)]
        ).to(device)
        read_index, write_index, packed_positions, cu_seqlens = packed.split(
            [sum(seq_lens), num_tokens, num_tokens, len(cu_seqlens_host)]
        )
        return cls(
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            page_size=page_size,
            cu_seqlens_host=cu_seqlens_host,
            cu_seqlens=cu_seqlens,
            positions=packed_positions,
            write_index=write_index,
            read_index=read_index.split(seq_lens),
            last_index=cu_seqlens[1:] - 1,
        )


def _check_request(
    i: int, prefix: int, extend: int, table: PageTable, page_size: int, num_slots: int | None
) -> torch.Tensor:
    """Request ``i``'s page table as a host int64 tensor, after checking it covers the sequence."""
    if prefix < 0:
        raise RequestError(f"request {i}: prefix length must be >= 0, got {prefix}")
    if extend < 1:
        raise RequestError(
            f"request {i}: extend length must be >= 1 (a prefill computes at least the last "
            f"token, for its logits), got {extend}"
        )
    slots = torch.as_tensor(table).to(device="cpu", dtype=torch.int64)
    if slots.dim() != 1:
        raise RequestError(f"request {i}: a page table must be 1-D, got shape {tuple(slots.shape)}")
    num_pages = page_span(prefix + extend, page_size)
    if slots.numel() < num_pages:
        raise RequestError(
            f"request {i}: {prefix} cached + {extend} new tokens need {num_pages} pages of "
            f"{page_size}, but its page table holds {slots.numel()}"
        )
    slots = slots[:num_pages]
    if num_slots is not None and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise RequestError(
            f"request {i}: page table slots must lie in [0, {num_slots}), got "
            f"min {int(slots.min())}, max {int(slots.max())}"
        )
    return slots
