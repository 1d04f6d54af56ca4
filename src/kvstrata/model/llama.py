"""A Llama / Qwen2 / Qwen3 decoder in plain PyTorch whose attention reads and writes a paged pool.

The layers of the :class:`~kvstrata.model.decoder.Decoder` frame. The arithmetic follows
transformers step for step (q/k RMSNorm before RoPE for Qwen3), so its logits match transformers on
the same weights. The one difference is where K/V live: in a :class:`~kvstrata.tiers.pool.DevicePool` instead of
a per-request cache. (Fusing q/k/v or gate/up into one matmul was measured: on CPU it is slower,
because the split outputs are strided; on GPU it gains nothing at prefill sizes.)

Per layer, the K/V of the packed extend tokens are written into the pool rows
``batch.write_index``; then :class:`~kvstrata.model.attention.PagedAttention` attends each request's
queries over its whole sequence, read from the pages (in place with the Triton kernel on CUDA,
gathered per request with torch SDPA on the CPU; ``--attention`` chooses).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..tiers.pool import DevicePool
from .attention import ExchangeBytes, PagedAttention
from .batch import ForwardBatch
from .config import ModelConfig
from .decoder import MLP, Decoder, PagedLayerAttention, PreNormLayer, RMSNorm, apply_rope


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 RoPE frequencies on the host, with Llama-3 scaling if configured."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama-3 scaling by wavelength (2 pi / frequency), with context = original max positions:
    #   wavelen < context / high_freq_factor    kept
    #   wavelen > context / low_freq_factor     divided by factor
    #   in between                              interpolated smoothly between the two
    context = scaling.original_max_position_embeddings
    low_freq_wavelen = context / scaling.low_freq_factor
    high_freq_wavelen = context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


class Attention(PagedLayerAttention):
    """Grouped-query self-attention of one layer over the paged pool."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm: nn.Module = nn.Identity()
        self.k_norm: nn.Module = nn.Identity()
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.payloads = ("k", "v")  # the pool payloads its K and V live in

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        attention: PagedAttention,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)

        k_name, v_name = self.payloads
        k_rows = pool.token_view(k_name, self.layer)
        v_rows = pool.token_view(v_name, self.layer)
        k_rows.index_copy_(0, batch.write_index, k)
        v_rows.index_copy_(0, batch.write_index, v)
        if batch.cp is not None:  # other ranks hold part of the keys: they exchange them
            out = batch.cp.attend(q, k, v, k_rows, v_rows)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        k_pages, v_pages = pool.buffer(k_name, self.layer), pool.buffer(v_name, self.layer)
        out = attention(q, k, v, k_pages, v_pages, batch)
        return self.o_proj(out.view(num_tokens, self.q_size))


class DecoderLayer(PreNormLayer):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)


class LlamaModel(Decoder):
    """The Llama / Qwen2 / Qwen3 decoder: ``num_layers`` :class:`DecoderLayer` in the frame."""

    config: ModelConfig

    def __init__(self, config: ModelConfig) -> None:
        layers = (DecoderLayer(config, i) for i in range(config.num_layers))
        super().__init__(config, layers, rope_inv_freq(config))

    def paged_attention(self, device: torch.device) -> PagedAttention:
        return PagedAttention.for_device(
            self.attention_backend, device, self.config.head_dim, self.attention_kernel
        )

    def exchange_bytes(self) -> ExchangeBytes:
        """move_kv moves K and V of every sequence token; move_queries the queries in the model's
        dtype, then the fp32 partial outputs with their weights and log-sum-exps."""
        c, itemsize = self.config, self.dtype.itemsize
        return ExchangeBytes(
            kv=2 * c.num_kv_heads * c.head_dim * itemsize,
            queries=c.num_heads * c.head_dim * itemsize,
            partials=c.num_heads * (c.head_dim + 2) * 4,
        )
