"""This rank's share of one forward under context parallelism.

The step packs one chunk of several requests, as on one rank. Under CP, rank ``r`` computes the
extend tokens of the pages it owns (page ``p`` is owned by ``p % cp_size``) and writes their K/V
into its own slots (logical page ``L`` lives in slot ``L // cp_size`` of rank ``L % cp_size``)::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13      page size 4, cp 2
    page owner     r0   |   r1    |    r0     |  r1
    prefix 6, extend 8: rank 0 computes 8 9 10 11, rank 1 computes 6 7 12 13

:func:`build_cp_batch` returns a :class:`~kvstrata.model.batch.ForwardBatch` over this rank's tokens
whose ``cp`` is the :class:`~kvstrata.dist.attention.CPStep` that exchanges what the other ranks hold.
Everything here is a pure function of replicated inputs (positions, pages, cp_size, rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import numpy.typing as npt
import torch

from ..model.batch import ForwardBatch
from .attention import CPStep
from .group import Group

IntArray = npt.NDArray[np.int64]


def build_cp_batch(
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    page_tables: Sequence[IntArray],
    extend_tokens: Sequence[npt.NDArray[np.integer]],
    page_size: int,
    group: Group,
    strategy: str,
    need_logits: bool,
    device: torch.device,
) -> tuple[ForwardBatch, torch.Tensor]:
    """This rank's ForwardBatch and input ids. ``page_tables`` hold logical pages."""
    P, cp, rank = page_size, group.size, group.rank
    all_pos, all_tok, mine_parts, write_rows, last = [], [], [], [], []
    pre_rows, pre_dense, pre_pos, pre_req, ext_dense, ext_req = [], [], [], [], [], []
    prefix_last: list[int] = []
    seq_lens = (p + e for p, e in zip(prefix_lens, extend_lens, strict=True))
    seq_offsets = list(accumulate(seq_lens, initial=0))
    my_count = 0
    for i, (prefix, extend, table, ext_tokens) in enumerate(
        zip(prefix_lens, extend_lens, page_tables, extend_tokens, strict=True)
    ):
        pos = np.arange(prefix, prefix + extend, dtype=np.int64)
        pages = np.asarray(table, dtype=np.int64)
        mine = (pos // P) % cp == rank
        all_pos.append(pos)
        all_tok.append(np.asarray(ext_tokens, dtype=np.int64))
        mine_parts.append(mine)
        my_pos = pos[mine]
        write_rows.append(pages[my_pos // P] // cp * P + my_pos % P)
        ext_dense.append(seq_offsets[i] + my_pos)
        ext_req.append(np.full(my_pos.size, i, dtype=np.int64))
        prefix_pos = np.arange(prefix, dtype=np.int64)
        owned = prefix_pos[(prefix_pos // P) % cp == rank]
        pre_rows.append(pages[owned // P] // cp * P + owned % P)
        pre_dense.append(seq_offsets[i] + owned)
        pre_pos.append(owned)
        pre_req.append(np.full(owned.size, i, dtype=np.int64))
        my_count += int(my_pos.size)
        last.append(my_count - 1 if mine[-1] else -1)
        q = prefix - 1  # the last prefix position: its row carries state some computes need
        prefix_last.append(
            int(pages[q // P] // cp * P + q % P) if prefix and (q // P) % cp == rank else -1
        )

    def cat(parts: list[np.ndarray]) -> torch.Tensor:
        arr = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return torch.from_numpy(arr.astype(np.int64)).to(device)

    mine = torch.from_numpy(np.concatenate(mine_parts)).to(device)
    positions = cat(all_pos)
    tokens = cat(all_tok)
    my_counts = [int(m.sum()) for m in mine_parts]
    cu = tuple(accumulate(my_counts, initial=0))
    last_t = torch.tensor(last, dtype=torch.int64, device=device)
    step = CPStep(
        group=group,
        strategy=strategy,
        prefix_lens=tuple(int(p) for p in prefix_lens),
        extend_lens=tuple(int(e) for e in extend_lens),
        all_tokens=tokens,
        all_positions=positions,
        mine=mine,
        seq_offsets=tuple(seq_offsets),
        ext_offsets=tuple(accumulate((int(e) for e in extend_lens), initial=0)),
        my_prefix_rows=cat(pre_rows),
        my_prefix_dense=cat(pre_dense),
        my_prefix_positions=cat(pre_pos),
        my_prefix_request=cat(pre_req),
        my_ext_dense=cat(ext_dense),
        my_ext_request=cat(ext_req),
        my_last=last_t,
        prefix_last_rows=torch.tensor(prefix_last, dtype=torch.int64, device=device),
        need_logits=need_logits,
    )
    batch = ForwardBatch(
        prefix_lens=tuple(int(p) for p in prefix_lens),
        extend_lens=tuple(my_counts),
        page_size=P,
        cu_seqlens_host=cu,
        cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=device),
        positions=positions[mine],
        write_index=cat(write_rows),
        read_index=(),
        last_index=last_t[last_t >= 0],
        cp=step,
    )
    return batch, tokens[mine]
