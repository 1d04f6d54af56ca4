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
from functools import cache
from itertools import accumulate
from typing import Protocol, overload

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


class ReadRows(Sequence[torch.Tensor]):
    """Each request's pool rows of its whole sequence, built on first use (one host -> device
    copy for all of them). A forward that never reads the prefix (``--model none``) never builds
    them, so its index work grows with the tokens it computes, not with the contexts."""

    def __init__(
        self,
        page_tables: list[npt.NDArray[np.int64]],
        seq_lens: list[int],
        page_size: int,
        device: torch.device,
    ) -> None:
        self._tables = page_tables
        self._seq_lens = seq_lens
        self._page_size = page_size
        self._device = device
        self._rows: tuple[torch.Tensor, ...] | None = None

    @property
    def built(self) -> bool:
        return self._rows is not None

    def _build(self) -> tuple[torch.Tensor, ...]:
        if self._rows is None:
            P = self._page_size
            rows = [
                (table[:, None] * P + _offsets(P)).ravel()[:n]
                for table, n in zip(self._tables, self._seq_lens, strict=True)
            ]
            packed = torch.from_numpy(np.concatenate(rows)).to(self._device)
            self._rows = packed.split(self._seq_lens)
        return self._rows

    def __len__(self) -> int:
        return len(self._seq_lens)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        return self._build()[i]


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Where the packed tokens of one forward read and write their K/V.

    prefix_lens / extend_lens: per request, tokens already cached / computed in this forward.
    cu_seqlens_host: ``[R + 1]`` start of each request's extend tokens in the packed batch (Python
        ints, for slicing without a device sync); ``cu_seqlens`` is the same on the device.
    positions: ``[T]`` absolute position of every packed token.
    write_index: ``[T]`` pool token row that receives each packed token's K/V.
    read_index: per request, ``[prefix + extend]`` pool rows of its whole sequence so far
        (:meth:`build` makes it a :class:`ReadRows`, built on first use).
    last_index: ``[R]`` packed index of each request's last token (whose logits a prefill returns).
    prefix_last_row: ``[R]`` pool row of each request's last cached token (-1 without a prefix);
        set by :meth:`build`.
    """

    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    page_size: int
    cu_seqlens_host: tuple[int, ...]
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    write_index: torch.Tensor
    read_index: Sequence[torch.Tensor]
    last_index: torch.Tensor
    cp: ContextParallel | None = None  # set under context parallelism: this rank's share
    prefix_last_row: torch.Tensor | None = None

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
        assertion mid-forward. The work is proportional to the extend tokens and the pages they
        touch (plus the page tables' range check with ``num_slots``).
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
        P = page_size
        prefix_lens = tuple(int(n) for n in prefix_lens)
        extend_lens = tuple(int(n) for n in extend_lens)
        tables = [
            _check_request(i, prefix, extend, table, P, num_slots)
            for i, (prefix, extend, table) in enumerate(
                zip(prefix_lens, extend_lens, page_tables, strict=True)
            )
        ]
        cu_seqlens_host = tuple(accumulate(extend_lens, initial=0))
        num_tokens = cu_seqlens_host[-1]
        # The pages the extends touch, end to end, expanded to rows; request i's extend is the
        # run of rows that starts at its prefix's offset inside its first touched page:
        #   rows   [ r0: pages prefix//P .. end | r1: pages ... | ... ]  (P rows per page)
        #   write  rows[at_i : at_i + extend_i],  at_i = P * (pages before r0..i-1) + prefix % P
        touched = [t[p // P :] for t, p in zip(tables, prefix_lens, strict=True)]
        rows = (np.concatenate(touched)[:, None] * P + _offsets(P)).ravel()
        writes, at = [], 0
        for t, prefix, extend in zip(touched, prefix_lens, extend_lens, strict=True):
            writes.append(rows[at + prefix % P : at + prefix % P + extend])
            at += t.size * P
        positions = [
            np.arange(prefix, prefix + extend, dtype=np.int64)
            for prefix, extend in zip(prefix_lens, extend_lens, strict=True)
        ]
        last_rows = [
            t[(p - 1) // P] * P + (p - 1) % P if p else -1
            for t, p in zip(tables, prefix_lens, strict=True)
        ]

        # One host-to-device copy for every index tensor, then views into it:
        #   [ write rows (T) | positions (T) | cu_seqlens (R + 1) | prefix last rows (R) ]
        packed = torch.from_numpy(
            np.concatenate(
                [
                    *writes,
                    *positions,
                    np.asarray(cu_seqlens_host, dtype=np.int64),
                    np.asarray(last_rows, dtype=np.int64),
                ]
            )
        ).to(device)
        write_index, packed_positions, cu_seqlens, prefix_last_row = packed.split(
            [num_tokens, num_tokens, len(cu_seqlens_host), len(last_rows)]
        )
        return cls(
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            page_size=P,
            cu_seqlens_host=cu_seqlens_host,
            cu_seqlens=cu_seqlens,
            positions=packed_positions,
            write_index=write_index,
            read_index=ReadRows(
                tables, [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)], P, device
            ),
            last_index=cu_seqlens[1:] - 1,
            prefix_last_row=prefix_last_row,
        )


@cache
def _offsets(page_size: int) -> npt.NDArray[np.int64]:
    return np.arange(page_size, dtype=np.int64)


def _check_request(
    i: int, prefix: int, extend: int, table: PageTable, page_size: int, num_slots: int | None
) -> npt.NDArray[np.int64]:
    """Request ``i``'s page table as a host int64 array cut to the pages its sequence covers,
    after checking it covers the sequence."""
    if prefix < 0:
        raise RequestError(f"request {i}: prefix length must be >= 0, got {prefix}")
    if extend < 1:
        raise RequestError(
            f"request {i}: extend length must be >= 1 (a prefill computes at least the last "
            f"token, for its logits), got {extend}"
        )
    if isinstance(table, torch.Tensor):
        table = table.detach().cpu().numpy()
    slots = np.asarray(table)
    if slots.ndim != 1:
        raise RequestError(f"request {i}: a page table must be 1-D, got shape {slots.shape}")
    if slots.size and slots.dtype.kind not in "iu":
        raise RequestError(f"request {i}: page table slots must be integers, got {slots.dtype}")
    num_pages = page_span(prefix + extend, page_size)
    if slots.size < num_pages:
        raise RequestError(
            f"request {i}: {prefix} cached + {extend} new tokens need {num_pages} pages of "
            f"{page_size}, but its page table holds {slots.size}"
        )
    slots = slots[:num_pages].astype(np.int64, copy=False)
    if num_slots is not None and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise RequestError(
            f"request {i}: page table slots must lie in [0, {num_slots}), got "
            f"min {int(slots.min())}, max {int(slots.max())}"
        )
    return slots
