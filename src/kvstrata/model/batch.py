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

:class:`ForwardBatch` computes all of this once per forward, so the per-layer code only indexes:
the host sends the page tables and per-request lengths (and the tokens) in one host-to-device copy,
and the device derives every token's position and pool row from them. Nothing on the per-layer path
reads a device value back to the host.
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

    def attend_latent(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        latent_rows: torch.Tensor,
        value_dim: int,
        scale: float,
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

    Host fields (Python ints, for shapes and slicing without a device sync):
    prefix_lens / extend_lens: per request, tokens already cached / computed in this forward.
    cu_seqlens_host: ``[R + 1]`` start of each request's extend tokens in the packed batch.

    Device fields:
    cu_seqlens: ``cu_seqlens_host`` on the device.
    positions: ``[T]`` absolute position of every packed token.
    write_index: ``[T]`` pool token row that receives each packed token's K/V.
    read_index: per request, ``[prefix + extend]`` pool rows of its whole sequence so far, for
        paths that gather a sequence (the CPU attention path, synthetic KV); :meth:`build` makes
        it lazily, on the device, on first use.
    last_index: ``[R]`` packed index of each request's last token (whose logits a prefill returns).
    prefix_last_row: ``[R]`` pool row of each request's last cached token (-1 without a prefix);
        set by :meth:`build` (the synthetic forward reads only this row of the prefix).
    cp: set under context parallelism: this rank's share (``kvstrata.dist``).

    What :meth:`build` adds for the paged attention kernel (a batch made otherwise, as the CP path
    makes its own, leaves them empty and never reaches the kernel):
    max_extend: the longest extend of a request with a cached prefix (the kernel's grid).
    cached_requests_host / cached_requests: indices of the requests with a cached prefix.
    prefix_lens_device: ``[R]`` ``prefix_lens`` on the device.
    page_table: every request's pool slots, concatenated; request ``i``'s start at
        ``table_starts[i]`` (its ``ceil((prefix + extend) / P)`` pages, no padding).
    input_ids: ``[T]`` the packed tokens, when the builder was given them.
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
    cp: ContextParallel | None = None
    max_extend: int = 0
    cached_requests_host: tuple[int, ...] = ()
    cached_requests: torch.Tensor | None = None
    prefix_lens_device: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    table_starts: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
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
        input_ids: npt.NDArray[np.integer] | torch.Tensor | None = None,
    ) -> ForwardBatch:
        """Validate one batch of requests and precompute its indices on ``device``.

        ``page_tables[i]`` lists the rank-local pool slots of request ``i``'s pages and must cover
        its ``prefix_lens[i] + extend_lens[i]`` tokens. With ``num_slots`` (the pool's slot count),
        slots are range-checked on the host, so a bad table raises here instead of as a device
        assertion mid-forward. ``input_ids`` (host, ``[T]``), if given, travel in the same copy.
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
        tables = [
            _check_request(i, prefix, extend, table, page_size, num_slots)
            for i, (prefix, extend, table) in enumerate(
                zip(prefix_lens, extend_lens, page_tables, strict=True)
            )
        ]
        cu_seqlens_host = tuple(accumulate(extend_lens, initial=0))
        num_tokens = cu_seqlens_host[-1]
        ids: list[npt.NDArray[np.int64]] = []
        if input_ids is not None:
            if isinstance(input_ids, torch.Tensor):
                input_ids = input_ids.detach().cpu().numpy()
            ids = [np.asarray(input_ids).astype(np.int64, copy=False).reshape(-1)]
            if ids[0].size != num_tokens:
                raise ConfigError(
                    f"input_ids hold {ids[0].size} tokens, the batch packs {num_tokens}"
                )
        table_starts = list(accumulate((t.size for t in tables), initial=0))[:-1]
        cached = tuple(i for i, prefix in enumerate(prefix_lens) if prefix)
        R = len(extend_lens)
        small = np.array([*table_starts, *prefix_lens, *cu_seqlens_host, *cached], dtype=np.int64)
        sizes = [sum(t.size for t in tables), R, R, R + 1, len(cached), num_tokens if ids else 0]
        # One host-to-device copy for every index tensor, then views into it:
        #   [ page tables of r0 | r1 | ... | table starts (R) | prefix lens (R) | cu_seqlens (R+1)
        #     | cached requests (C) | input ids (T, if given) ]
        staged = torch.from_numpy(np.concatenate([*tables, small, *ids]))
        if device.type == "cuda":  # staged in pinned memory: the copy does not block the host
            staged = staged.pin_memory()
        packed = staged.to(device, non_blocking=True)  # on the CPU: the same tensor
        page_table, starts, prefix_device, cu_seqlens, cached_device, packed_ids = packed.split(
            sizes
        )
        if device.type == "cpu":  # numpy indexes a host batch with a third of torch's overhead
            positions, write_index, prefix_last_row = _host_indices(
                tables, prefix_lens, extend_lens, cu_seqlens_host, page_size
            )
        else:  # on the device: each packed token's request, position and pool row
            request = torch.repeat_interleave(
                torch.arange(R, device=device), cu_seqlens.diff(), output_size=num_tokens
            )
            positions = (
                torch.arange(num_tokens, device=device)
                - cu_seqlens[request]
                + prefix_device[request]
            )
            write_index = _pool_rows(page_table, starts[request], positions, page_size)
            last_prefix_row = _pool_rows(
                page_table, starts, (prefix_device - 1).clamp(min=0), page_size
            )
            prefix_last_row = torch.where(prefix_device > 0, last_prefix_row, -1)
        return cls(
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            page_size=page_size,
            cu_seqlens_host=cu_seqlens_host,
            cu_seqlens=cu_seqlens,
            positions=positions,
            write_index=write_index,
            read_index=ReadRows(
                page_table,
                starts,
                cu_seqlens,
                prefix_device,
                [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)],
                page_size,
            ),
            last_index=cu_seqlens[1:] - 1,
            max_extend=max((extend_lens[i] for i in cached), default=0),
            cached_requests_host=cached,
            cached_requests=cached_device,
            prefix_lens_device=prefix_device,
            page_table=page_table,
            table_starts=starts,
            input_ids=packed_ids if ids else None,
            prefix_last_row=prefix_last_row,
        )


def _host_indices(
    tables: list[npt.NDArray[np.int64]],
    prefix_lens: tuple[int, ...],
    extend_lens: tuple[int, ...],
    cu_seqlens_host: tuple[int, ...],
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, write rows and prefix-last rows of a CPU batch, made in numpy: the pages the
    extends touch, end to end, expanded to rows; request i's extend is the run of rows that starts
    at its prefix's offset inside its first touched page::

        rows   [ r0: pages prefix//P .. end | r1: pages ... | ... ]  (P rows per page)
        write  rows[at_i : at_i + extend_i],  at_i = P * (pages before r0..i-1) + prefix % P
    """
    P = page_size
    touched = [t[p // P :] for t, p in zip(tables, prefix_lens, strict=True)]
    rows = (np.concatenate(touched)[:, None] * P + _offsets(P)).ravel()
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    extend = np.asarray(extend_lens, dtype=np.int64)
    cu = np.asarray(cu_seqlens_host[:-1], dtype=np.int64)
    at = np.cumsum([0, *(t.size * P for t in touched[:-1])]) + prefix % P  # r_i's first row
    token = np.arange(cu_seqlens_host[-1], dtype=np.int64)
    writes = rows[token + np.repeat(at - cu, extend)]
    positions = token + np.repeat(prefix - cu, extend)
    last_rows = np.array(
        [
            t[(p - 1) // P] * P + (p - 1) % P if p else -1
            for t, p in zip(tables, prefix_lens, strict=True)
        ],
        dtype=np.int64,
    )
    return torch.from_numpy(positions), torch.from_numpy(writes), torch.from_numpy(last_rows)


@cache
def _offsets(page_size: int) -> npt.NDArray[np.int64]:
    return np.arange(page_size, dtype=np.int64)


class ReadRows(Sequence[torch.Tensor]):
    """Per request, the pool rows of its whole sequence: built on the device on first use, by
    index arithmetic over the page tables. The Triton attention path and the synthetic forward
    (``--model none``) never ask, so their index work grows with the tokens they compute, not with
    the contexts."""

    def __init__(
        self,
        page_table: torch.Tensor,
        table_starts: torch.Tensor,
        cu_seqlens: torch.Tensor,
        prefix_lens: torch.Tensor,
        seq_lens: list[int],
        page_size: int,
    ) -> None:
        self._args = (page_table, table_starts, cu_seqlens, prefix_lens, page_size)
        self._seq_lens = seq_lens
        self._rows: tuple[torch.Tensor, ...] | None = None

    @property
    def built(self) -> bool:
        return self._rows is not None

    def _all(self) -> tuple[torch.Tensor, ...]:
        if self._rows is None:
            page_table, table_starts, cu_seqlens, prefix_lens, page_size = self._args
            seq_device = cu_seqlens.diff() + prefix_lens  # extend + prefix, per request
            total, device = sum(self._seq_lens), page_table.device
            request = torch.repeat_interleave(
                torch.arange(len(self._seq_lens), device=device), seq_device, output_size=total
            )
            positions = (
                torch.arange(total, device=device) - (seq_device.cumsum(0) - seq_device)[request]
            )
            rows = _pool_rows(page_table, table_starts[request], positions, page_size)
            self._rows = rows.split(self._seq_lens)
        return self._rows

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._seq_lens)


def _pool_rows(
    page_table: torch.Tensor, table_start: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Pool row of each token at ``positions`` of the request whose table starts at
    ``table_start`` (both per token)."""
    slots = page_table[table_start + torch.div(positions, page_size, rounding_mode="floor")]
    return slots * page_size + positions % page_size


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
