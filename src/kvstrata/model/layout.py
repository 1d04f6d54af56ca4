"""What a model's tokens occupy in the cache: its payloads, alone or with a speculative draft's.

Every model config (:class:`~kvstrata.model.config.ModelConfig` for Llama / Qwen,
:class:`~kvstrata.model.deepseek_config.DeepseekConfig` for MLA models) names its per-token payloads;
:func:`model_layout` turns one config, or a target and its draft, into the
:class:`~kvstrata.config.KVLayout` the pools, the transfers and the disk tier are built from::

    llama target                     k, v                    [kv_heads, head_dim] each
    MLA target                       kv_latent               [kv_lora_rank + qk_rope_head_dim]
    target + draft                   target's, then draft_*  (the draft's, on the same pages)
"""

from __future__ import annotations

from typing import Protocol

from ..config import KVLayout, PayloadSpec
from ..errors import ConfigError

DRAFT_PREFIX = "draft_"


class HasPayloads(Protocol):
    """A model config, as far as the cache layout needs it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    def token_payloads(
        self, dtype: str, prefix: str = "", num_layers: int | None = None
    ) -> tuple[PayloadSpec, ...]:
        """The payloads one token of this model fills in each layer, named ``{prefix}...``;
        ``num_layers`` is the payloads' layer count when it is fewer than the layout's."""
        ...


def model_layout(target: HasPayloads, dtype: str, draft: HasPayloads | None = None) -> KVLayout:
    """The cache layout of ``target``; with a speculative ``draft``, also the draft's payloads
    (prefixed ``draft_``) on the same pages, in the target's first layer slots
    (:func:`check_draft` first)."""
    payloads = list(target.token_payloads(dtype))
    if draft is not None:
        check_draft(target, draft)
        layers = draft.num_layers if draft.num_layers < target.num_layers else None
        payloads += draft.token_payloads(dtype, DRAFT_PREFIX, layers)
    return KVLayout(num_layers=target.num_layers, payloads=tuple(payloads))


def check_draft(target: HasPayloads, draft: HasPayloads) -> None:
    """Refuse a draft model that cannot share the target's pages and vocabulary.

    The draft's payloads are further payloads of the target's pages, in the target's layer
    slots, so it may have at most the target's layers; it proposes tokens the target scores, so
    the vocabularies must be equal.
    """
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}): a speculative draft must share the target's tokenizer"
        )
    if draft.num_layers > target.num_layers:
        raise ConfigError(
            f"the draft model has {draft.num_layers} layers, more than the target's "
            f"{target.num_layers}: its payloads live in the target's layer slots of each page; "
            "pick a smaller draft"
        )
