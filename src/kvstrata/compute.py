"""What fills the cache's pages: a real model, or deterministic synthetic payloads.

The engine schedules, matches, allocates and inserts identically for both; only the forward
differs. :class:`ModelCompute` runs the reference decoder and returns last-token logits.
:class:`SyntheticCompute` (``--model none``) writes ``kv_width`` bytes per token that are a pure
function of the token id and its position, so whole traces replay without a model while the pool
sees realistic traffic, and any page served from the cache can be checked byte for byte.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from .config import KVLayout, PayloadSpec
from .errors import ConfigError
from .model.batch import ForwardBatch
from .model.llama import LlamaModel
from .pool import DevicePool


class Compute(Protocol):
    """One forward over a packed batch that writes every extend token's KV into the pool."""

    layout: KVLayout
    vocab_size: int
    max_seq_len: int  # the longest sequence it can compute (the model's positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        all_logits: bool = False,
    ) -> torch.Tensor | None:
        """Write the batch's KV; return ``[num_requests, vocab]`` last-token logits (``[T, vocab]``
        for every packed token with ``all_logits``), or None without a model."""
        ...

    def snapshot(
        self, pool: DevicePool, pages: npt.NDArray[np.int64], num_tokens: int
    ) -> torch.Tensor | None:
        """A CPU copy of a sequence's cached payload, where it is small enough to keep for
        verification (synthetic payloads); None where verification recomputes logits instead."""
        ...


class ModelCompute:
    """The reference decoder: K and V per layer, last-token logits."""

    def __init__(self, model: LlamaModel, dtype: torch.dtype) -> None:
        self.model = model
        self.layout = model.config.kv_layout(str(dtype).removeprefix("torch."))
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = model.config.max_position_embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        all_logits: bool = False,
    ) -> torch.Tensor:
        return self.model(input_ids, batch, pool, logits="all" if all_logits else "last")

    def snapshot(self, pool: DevicePool, pages: npt.NDArray[np.int64], num_tokens: int) -> None:
        return None


#: Odd multipliers that spread (token id, position) over the payload bytes.
_TOKEN_MULT = 0x9E3779B1
_POS_MULT = 0x85EBCA77


def synthetic_payload(tokens: torch.Tensor, positions: torch.Tensor, kv_width: int) -> torch.Tensor:
    """``[T, kv_width]`` uint8: the bytes ``--model none`` stores for each (token, position)."""
    mixed = (
        tokens.to(torch.int64) * _TOKEN_MULT + positions.to(torch.int64) * _POS_MULT
    ) & 0xFFFFFFFF
    lanes = torch.arange(kv_width, device=tokens.device, dtype=torch.int64)
    shifted = (mixed[:, None] >> ((lanes % 4) * 8)[None, :]) ^ lanes[None, :]
    return (shifted & 0xFF).to(torch.uint8)


class SyntheticCompute:
    """``--model none``: one payload ``kv`` of ``kv_width`` bytes per token, no logits."""

    def __init__(self, kv_width: int, vocab_size: int) -> None:
        if kv_width < 1:
            raise ConfigError(f"kv_width (bytes per token) must be >= 1, got {kv_width}")
        self.kv_width = kv_width
        self.vocab_size = vocab_size
        self.max_seq_len = 1 << 31
        self.layout = KVLayout(num_layers=1, payloads=(PayloadSpec("kv", (kv_width,), "uint8"),))

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        all_logits: bool = False,
    ) -> None:
        rows = pool.token_view("kv", 0)
        rows.index_copy_(
            0, batch.write_index, synthetic_payload(input_ids, batch.positions, self.kv_width)
        )
        return None

    def snapshot(
        self, pool: DevicePool, pages: npt.NDArray[np.int64], num_tokens: int
    ) -> torch.Tensor:
        P = pool.page_size
        slots = torch.from_numpy(pages).to(pool.device)
        rows = (slots[:, None] * P + torch.arange(P, device=pool.device)).flatten()[:num_tokens]
        return pool.token_view("kv", 0).index_select(0, rows).cpu()
