"""The context-parallel group: every collective kvstrata issues goes through here.

A :class:`Group` is what the engine step, the CP attention and the replay loop call; nothing else
touches ``torch.distributed``. :class:`SoloGroup` is one rank (no communication, used when
cp_size is 1); :class:`TorchGroup` wraps an initialised ``torch.distributed`` process group (gloo
on CPU, NCCL on GPU) and counts the bytes each rank contributes, so benchmarks can report what an
attention strategy moves. Every collective runs under the group's timeout: a peer that died or
hangs turns into :class:`~kvstrata.errors.CollectiveError` naming the operation and the step,
never a hang.
"""

from __future__ import annotations

import pickle  # only for broadcast_object over torch.distributed (in memory, never on disk)
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..errors import CollectiveError


@dataclass
class Traffic:
    """Bytes this rank put into collectives, by purpose (``attention``, ``frontier``, ...)."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, purpose: str, num_bytes: int) -> None:
        self.bytes[purpose] = self.bytes.get(purpose, 0) + num_bytes
        self.calls[purpose] = self.calls.get(purpose, 0) + 1


class Group(Protocol):
    rank: int
    size: int
    traffic: Traffic
    step: int  # the engine step in progress (for error messages)

    def all_reduce(self, tensor: torch.Tensor, op: str, purpose: str) -> None:
        """In place: ``op`` is ``"sum"``, ``"max"`` or ``"min"``."""
        ...

    def broadcast_object(self, obj: Any, purpose: str) -> Any:
        """Rank 0's ``obj`` on every rank (in-memory serialisation only)."""
        ...

    def all_gather_object(self, obj: Any, purpose: str) -> list[Any]:
        ...

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor, purpose: str) -> None:
        """Every rank's ``tensor`` into ``out`` (``size`` times as many elements), rank order."""
        ...


class SoloGroup:
    """One rank: every collective is the identity."""

    rank = 0
    size = 1

    def __init__(self) -> None:
        self.traffic = Traffic()
        self.step = 0

    def all_reduce(self, tensor: torch.Tensor, op: str, purpose: str) -> None:
        return None

    def broadcast_object(self, obj: Any, purpose: str) -> Any:
        return obj

    def all_gather_object(self, obj: Any, purpose: str) -> list[Any]:
        return [obj]

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor, purpose: str) -> None:
        out.copy_(tensor)


# torch 2.13 renamed all_gather_into_tensor (kept, with a deprecation warning); older ones lack the name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchGroup:
    """The default ``torch.distributed`` process group, already initialised by the launcher."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise CollectiveError("torch.distributed is not initialised; start ranks with the launcher")
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.traffic = Traffic()
        self.step = 0
        self._cpu = dist.get_backend() == "gloo"

    def _fail(self, what: str, purpose: str, err: Exception) -> CollectiveError:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return CollectiveError(
            f"rank {self.rank}: {what} ({purpose}) at engine step {self.step} failed: {first}; a "
            "peer rank died, hung past the timeout, or runs a different configuration"
        )

    def all_reduce(self, tensor: torch.Tensor, op: str, purpose: str) -> None:
        self.traffic.add(purpose, tensor.numel() * tensor.element_size())
        try:
            dist.all_reduce(tensor, op=_OPS[op])
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail(f"all_reduce {op}", purpose, err) from None

    def broadcast_object(self, obj: Any, purpose: str) -> Any:
        box = [obj if self.rank == 0 else None]
        if self.rank == 0:
            self.traffic.add(purpose, len(pickle.dumps(obj)))
        try:
            dist.broadcast_object_list(box, src=0)
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("broadcast", purpose, err) from None
        return box[0]

    def all_gather_object(self, obj: Any, purpose: str) -> list[Any]:
        out: list[Any] = [None] * self.size
        self.traffic.add(purpose, len(pickle.dumps(obj)))
        try:
            dist.all_gather_object(out, obj)
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("all_gather", purpose, err) from None
        return out

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor, purpose: str) -> None:
        self.traffic.add(purpose, tensor.numel() * tensor.element_size())
        try:
            _all_gather_single(out, tensor)
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("all_gather", purpose, err) from None
