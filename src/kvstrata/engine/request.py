"""A request's records inside the engine: waiting, running, finished, and the length rules every
part of the engine shares (whole pages only, and never a request's last token)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from ..cache.keys import TokenKey
from ..cache.node import Node
from ..handoff import Handoff
from ..workloads import Request

IntArray = npt.NDArray[np.int64]


@dataclass
class Finished:
    """The outcome of one request."""

    rid: int
    prompt_len: int
    cached_len: int  # tokens served from the cache (every tier)
    logits: torch.Tensor | None  # last-token logits on the CPU (None without a model or on error)
    ttft_s: float  # clock time from its arrival to its last-token logits
    error: str | None = None
    payload: torch.Tensor | None = None  # the sequence's cached payload rows, when kept (no model)
    all_logits: torch.Tensor | None = None  # logits of every computed token, when asked for
    host_len: int = 0  # of cached_len, tokens loaded back from the host tier (L2, or L3 via L2)
    disk_len: int = 0  # of host_len, tokens a reload brought from the disk tier (L3)
    queue_s: float = 0.0  # of ttft_s, from its arrival to the step it entered
    load_wait_s: float = 0.0  # of ttft_s, steps it ran in spent waiting for load-back copies
    draft_logits: torch.Tensor | None = None  # the speculative draft's last-token logits, if any
    handoff: Handoff | None = None  # this rank's part of its KV, when asked for (keep_handoff)

    @property
    def computed_len(self) -> int:
        return 0 if self.error else self.prompt_len - self.cached_len


class Waiting(NamedTuple):
    """A request in the queue (or parked behind a disk read)."""

    request: Request
    key: TokenKey  # hashed once, when the request is added
    arrived_at: float


@dataclass
class Running:
    """A request admitted into the running batch: its pages and how far it got."""

    request: Request
    key: TokenKey
    node: Node  # locked while the request runs: the end of what the tree holds of it
    pages: IntArray  # one logical page per page of the whole sequence
    cached_len: int
    host_len: int  # of cached_len, loaded back from L2
    done_len: int
    inserted_len: int  # tokens of it the tree holds (matched or inserted chunk by chunk)
    arrived_at: float
    entered_at: float
    load_wait_at_entry: float  # the engine's load-back wait total when it entered
    keep_logits: bool
    keep_all_logits: bool
    disk_len: int = 0  # of host_len, brought from L3 by a reload
    # Pages the tree did not keep that it still reads (only after a key collision): freed at
    # the end. Ordinary duplicates are swapped for the tree's pages and freed at once.
    duplicates: list[IntArray] = field(default_factory=list)
    # A key collision stopped its inserts: the tree holds its first inserted_len tokens; the
    # pages past them stay its own (never inserted, no backups) and are freed at the end.
    collided: bool = False
    logits: torch.Tensor | None = field(default=None)
    logit_chunks: list[torch.Tensor] = field(default_factory=list)

    @property
    def rid(self) -> int:
        return self.request.rid

    @property
    def left(self) -> int:
        """Tokens still to compute."""
        return len(self.key) - self.done_len

    def own_pages(self) -> IntArray:
        """Every device page it references (its page table and the duplicates it keeps)."""
        return np.unique(np.concatenate([self.pages, *self.duplicates]))


def reusable_len(n: int, page_size: int) -> int:
    """The longest cached prefix a request of ``n`` tokens may use: whole pages, and never its
    last token (a prefill needs that token's logits)."""
    return (n - 1) // page_size * page_size


def insertable_len(run: Running, extend: int, page_size: int) -> int:
    """Tokens of ``run`` the tree can hold once ``extend`` more are computed: whole pages, or
    everything when the request completes."""
    done = run.done_len + extend
    return done if done == len(run.key) else done // page_size * page_size


def split_draft(
    logits: torch.Tensor | None, has_draft: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Target and draft logits of a :class:`~kvstrata.model.compute.PairCompute` (``[..., 2, V]``);
    a single model's pass through with no draft."""
    if logits is None or not has_draft:
        return logits, None
    return logits[..., 0, :], logits[..., 1, :]
