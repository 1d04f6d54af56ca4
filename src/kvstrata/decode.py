"""A minimal greedy decode that continues from a handed-off KV: proof that the handoff is usable.

The decoder is a single, non-CP instance. It copies the assembled KV (:mod:`kvstrata.handoff`)
into a pool of its own, takes the first token from the prefill's last-token logits, and then
runs one token per forward over the paged pool, as a decode server would. With a speculative
draft it also scores the draft: at every position of the target's greedy path, does the draft's
greedy token equal the target's? The share of positions where it does is the draft's greedy
acceptance rate (what a one-token speculation accepts; longer speculation accepts runs of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import KVLayout, PayloadSpec
from .errors import ConfigError, HandoffError
from .handoff import AssembledKV
from .model.batch import ForwardBatch
from .model.decoder import Decoder
from .ownership import page_span
from .tiers.pool import DevicePool


@dataclass(frozen=True)
class Decoded:
    """The greedy tokens after the prompt; with a draft, whether the draft's greedy token agreed
    with each of them."""

    tokens: tuple[int, ...]
    draft_agreed: tuple[bool, ...] = ()

    @property
    def acceptance(self) -> float | None:
        """The draft's greedy acceptance rate on these tokens (None without a draft)."""
        if not self.draft_agreed:
            return None
        return sum(self.draft_agreed) / len(self.draft_agreed)


def greedy_decode(
    kv: AssembledKV,
    target: Decoder,
    first_logits: torch.Tensor,
    num_tokens: int,
    draft: Decoder | None = None,
    draft_first_logits: torch.Tensor | None = None,
) -> Decoded:
    """Decode ``num_tokens`` greedy tokens after the prompt whose KV is ``kv``.

    ``first_logits`` are the prefill's last-token logits (they give the first token); with a
    ``draft`` (its KV under the ``draft_`` payloads, :meth:`Decoder.use_payloads`), also the
    draft's, ``draft_first_logits``.
    """
    if num_tokens < 1:
        raise ConfigError(f"decode needs at least one token, got {num_tokens}")
    if (draft is None) != (draft_first_logits is None):
        raise ConfigError("a draft model and its first logits come together")
    weight = target.embed_tokens.weight
    pool = _pool_for(kv, num_tokens, weight.device)
    n, P = kv.num_tokens, kv.page_size
    for name, rows in kv.payloads.items():
        for layer in range(rows.shape[0]):
            pool.token_view(name, layer)[:n] = rows[layer].to(weight.device)
    table = np.arange(pool.num_slots, dtype=np.int64)

    token = int(first_logits.argmax())
    tokens, agreed = [token], []
    if draft_first_logits is not None:
        agreed.append(int(draft_first_logits.argmax()) == token)
    for position in range(n, n + num_tokens - 1):
        batch = ForwardBatch.build(
            [position], [1], [table], P, weight.device, input_ids=np.array([token])
        )
        assert batch.input_ids is not None
        logits = target(batch.input_ids, batch, pool)
        token = int(logits[0].argmax())
        if draft is not None:
            proposal = int(draft(batch.input_ids, batch, pool)[0].argmax())
            agreed.append(proposal == token)
        tokens.append(token)
    return Decoded(tuple(tokens), tuple(agreed))


def _pool_for(kv: AssembledKV, num_tokens: int, device: torch.device) -> DevicePool:
    """A pool of the handoff's payloads with room for the prompt and ``num_tokens`` more."""
    if not kv.payloads:
        raise HandoffError(f"request {kv.rid}: the handoff holds no payloads")
    top = max(rows.shape[0] for rows in kv.payloads.values())
    specs = [
        PayloadSpec(
            name,
            tuple(rows.shape[2:]),
            str(rows.dtype).removeprefix("torch."),
            None if rows.shape[0] == top else rows.shape[0],
        )
        for name, rows in kv.payloads.items()
    ]
    layout = KVLayout(num_layers=top, payloads=tuple(specs))
    slots = page_span(kv.num_tokens + num_tokens, kv.page_size)
    return DevicePool(layout, kv.page_size, slots, device)
