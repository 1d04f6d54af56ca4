"""A DeepSeek-V2 / V3 decoder in plain PyTorch: MLA attention over the cached latent, dense MLP
layers first, mixture-of-experts layers after (:mod:`kvstrata.model.mla`,
:mod:`kvstrata.model.moe`), in the :class:`~kvstrata.model.decoder.Decoder` frame."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from .attention import ExchangeBytes, PagedAttention
from .decoder import MLP, Decoder, PreNormLayer, RMSNorm
from .deepseek_config import DeepseekConfig
from .mla import MLA_FORMS, MLAttention, mla_inv_freq
from .moe import MoE


class DeepseekLayer(PreNormLayer):
    """Pre-norm MLA and MLP (dense or MoE) blocks with residual connections."""

    def __init__(self, config: DeepseekConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if config.moe is not None and config.is_moe_layer(layer):
            self.mlp = MoE(config.moe, config.hidden_size)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)


class DeepseekModel(Decoder):
    """The DeepSeek-V2 / V3 decoder; its cache payload is ``kv_latent`` (no K, no V)."""

    config: DeepseekConfig

    def __init__(self, config: DeepseekConfig) -> None:
        layers = (DeepseekLayer(config, i) for i in range(config.num_layers))
        factor = 1.0 if config.rope_scaling is None else config.rope_scaling.rope_factor
        super().__init__(config, layers, mla_inv_freq(config), factor)

    def use_mla_form(self, form: str) -> DeepseekModel:
        """``absorbed``: attend over the latent with the up-projections absorbed; ``expanded``:
        expand it into per-head keys and values first; ``auto`` (the default): per batch, the
        cheaper (see :mod:`kvstrata.model.mla`); returns self."""
        if form not in MLA_FORMS:
            raise ConfigError(f"the MLA form must be one of {', '.join(MLA_FORMS)}, got {form!r}")
        for module in self.modules():
            if isinstance(module, MLAttention):
                module.form = form
        return self

    def paged_attention(self, device: torch.device) -> PagedAttention:
        c = self.config
        return PagedAttention.for_device(
            self.attention_backend,
            device,
            c.kv_lora_rank,
            self.attention_kernel,
            c.qk_rope_head_dim,
        )

    def exchange_bytes(self) -> ExchangeBytes:
        """move_kv moves the latent of every sequence token; move_queries the absorbed queries
        (a latent's width per head) in the model's dtype, then fp32 partial outputs in latent
        space (``kv_lora_rank`` per head) with their weights and log-sum-exps."""
        c, itemsize = self.config, self.dtype.itemsize
        return ExchangeBytes(
            kv=c.latent_dim * itemsize,
            queries=c.num_heads * c.latent_dim * itemsize,
            partials=c.num_heads * (c.kv_lora_rank + 2) * 4,
        )
