"""The commit frontier across ranks: one collective per engine step (docs/design.md,
"Replicated state").

Each rank's :class:`~kvstrata.tiers.tickets.Progress` says how far its copies have landed. The
frontier is the MIN of ``done_upto`` over ranks and the union of failed tickets, computed with a
single MAX all-reduce over ``[-done_upto, failed(applied+1), ..., failed(issued), -agree...]``:
the bitmap's length comes from replicated counters and ``agree``'s (the disk tier's pending
lookups) from replicated decisions, so every rank contributes a tensor of the same shape. The
same collective returns the MIN of each ``agree`` value.
"""

from __future__ import annotations

import torch

from ..tiers.tickets import FrontierFn, Progress
from .group import Group


def group_frontier(group: Group) -> FrontierFn:
    """A frontier function for :class:`~kvstrata.engine.Engine` over ``group``."""

    def frontier(progress: Progress) -> Progress:
        if group.size == 1:
            return progress
        lo, hi = progress.applied_upto, progress.issued_upto
        n = 1 + hi - lo
        flags = torch.zeros(n + len(progress.agree), dtype=torch.int64)
        flags[0] = -progress.done_upto
        for t in progress.failed:
            flags[t - lo] = 1
        if progress.agree:
            flags[n:] = -torch.tensor(progress.agree, dtype=torch.int64)
        group.all_reduce(flags, "max", "frontier")
        done = -int(flags[0])
        # flags[i] (1 <= i < n) is ticket lo + i; only tickets every rank finished take effect now.
        failed = frozenset(
            lo + 1 + j
            for j in torch.nonzero(flags[1:n]).flatten().tolist()
            if lo + 1 + j <= done
        )
        agree = tuple(-int(v) for v in flags[n:].tolist())
        return Progress(done, failed, lo, hi, agree)

    return frontier
