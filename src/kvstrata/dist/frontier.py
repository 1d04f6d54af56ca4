"""The commit frontier across ranks: one collective per engine step (docs/design.md,
"Replicated state").

Each rank's :class:`~kvstrata.tiers.tickets.Progress` says how far its copies have landed. The
frontier is the MIN of ``done_upto`` over ranks and the union of failed tickets, computed with a
single MAX all-reduce over ``[-done_upto, failed(applied+1), ..., failed(issued)]``: the bitmap's
length comes from replicated counters, so every rank contributes a tensor of the same shape.
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
        flags = torch.zeros(1 + hi - lo, dtype=torch.int64)
        flags[0] = -progress.done_upto
        for t in progress.failed:
            flags[t - lo] = 1
        group.all_reduce(flags, "max", "frontier")
        done = -int(flags[0])
        # flags[i] (i >= 1) is ticket lo + i; only tickets every rank finished take effect now.
        failed = frozenset(
            lo + 1 + j for j in torch.nonzero(flags[1:]).flatten().tolist() if lo + 1 + j <= done
        )
        return Progress(done, failed, lo, hi)

    return frontier
