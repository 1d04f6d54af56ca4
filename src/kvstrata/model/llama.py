"""A Llama / Qwen2 / Qwen3 decoder in plain PyTorch whose attention reads and writes a paged pool.

The arithmetic follows transformers step for step (RMSNorm in fp32, RoPE tables in fp32 cast to the
compute dtype, q/k RMSNorm before RoPE for Qwen3), so its logits match transformers on the same
weights. The one difference is where K/V live: in a :class:`~kvstrata.tiers.pool.DevicePool` instead of
a per-request cache. (Fusing q/k/v or gate/up into one matmul was measured: on CPU it is slower,
because the split outputs are strided; on GPU it gains nothing at prefill sizes.)

Per layer, the K/V of the packed extend tokens are written into the pool rows
``batch.write_index``; then :class:`~kvstrata.model.attention.PagedAttention` attends each request's
queries over its whole sequence, read from the pages (in place with the Triton kernel on CUDA,
gathered per request with torch SDPA on the CPU; ``--attention`` chooses).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, RequestError
from ..tiers.pool import DevicePool, torch_dtype
from .attention import ATTENTION_BACKENDS, AttentionBackend, PagedAttention
from .attention_kernel import AttentionKernelConfig
from .batch import ForwardBatch, LayerHooks
from .config import ModelConfig

LogitsMode = Literal["last", "all"]


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the ``[T, 1, head_dim]`` tables (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32 as transformers does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
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


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        attention: PagedAttention,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, pool, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder: embeddings, ``num_layers`` decoder layers, final norm and output projection.

    Parameter names are transformers' without the ``model.`` prefix. With tied embeddings there is
    no ``lm_head``: the output projection reads ``embed_tokens.weight``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # A plain attribute, not a buffer: it stays fp32 whatever dtype the weights take, and it is
        # real (on the host) even when the module is built on the meta device.
        self.inv_freq = rope_inv_freq(config)
        self.attention_backend: AttentionBackend = "auto"
        self.attention_kernel: AttentionKernelConfig | None = None
        self.payload_prefix = ""

    def use_payloads(self, prefix: str) -> LlamaModel:
        """Keep K and V in the pool payloads ``{prefix}k`` / ``{prefix}v`` (a speculative draft
        model shares the target's pages under ``draft_``; see :meth:`ModelConfig.kv_layout`);
        returns self."""
        self.payload_prefix = prefix
        for module in self.modules():
            if isinstance(module, Attention):
                module.payloads = (f"{prefix}k", f"{prefix}v")
        return self

    def use_attention(
        self, backend: str, kernel: AttentionKernelConfig | None = None
    ) -> LlamaModel:
        """Choose the attention backend (``auto``, ``triton`` or ``sdpa``; see
        :mod:`kvstrata.model.attention`) and the Triton kernel's launch shape; returns self.
        The choice is checked against the pool's device at every forward."""
        if backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"--attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}"
            )
        self.attention_backend = backend
        self.attention_kernel = kernel
        return self

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: Mapping[str, torch.Tensor]) -> LlamaModel:
        """Adopt ``state`` (this module's parameter names) as the weights, without copying it.

        The model takes the device and dtype of the tensors in ``state``; it is returned in eval
        mode with gradients off.
        """
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval().requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        logits: LogitsMode = "last",
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Run the packed extend tokens ``input_ids`` ``[T]`` and write their K/V into ``pool``.

        ``hooks`` see each layer before it reads the pool and after it wrote its K/V there.

        Returns logits in the model's dtype: ``[num_requests, vocab]`` for each request's last token
        with ``logits="last"`` (the output projection runs on those rows only), or ``[T, vocab]``
        with ``logits="all"``.
        """
        if logits not in ("last", "all"):
            raise ConfigError(f"logits must be 'last' or 'all', got {logits!r}")
        self._check_inputs(input_ids, batch, pool)
        attention = PagedAttention.for_device(
            self.attention_backend, pool.device, self.config.head_dim, self.attention_kernel
        )
        x = self.embed_tokens(input_ids)
        cos, sin = self._rope_tables(batch.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            if hooks is not None:
                hooks.before_layer(i)
            x = layer(x, cos, sin, batch, pool, attention)
            if hooks is not None:
                hooks.after_layer(i)
        if logits == "last":
            x = x[batch.last_index]
        elif batch.cp is not None:
            raise ConfigError("all-token logits are not gathered under context parallelism")
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        out = F.linear(self.norm(x), weight)
        return out if batch.cp is None else batch.cp.gather_last(out)

    def _rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, head_dim]`` cos and sin for ``positions``, computed in fp32, cast to ``dtype``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _check_inputs(self, input_ids: torch.Tensor, batch: ForwardBatch, pool: DevicePool) -> None:
        """Raise a typed error for inputs that would otherwise fail deep inside a kernel."""
        config = self.config
        weight = self.embed_tokens.weight
        if input_ids.dim() != 1 or input_ids.numel() != batch.num_tokens:
            raise ConfigError(
                f"input_ids must be 1-D with the batch's {batch.num_tokens} packed tokens, "
                f"got shape {tuple(input_ids.shape)}"
            )
        if pool.page_size != batch.page_size:
            raise ConfigError(
                f"the batch was built for page_size {batch.page_size}, the pool has {pool.page_size}"
            )
        for name in (f"{self.payload_prefix}k", f"{self.payload_prefix}v"):
            spec = pool.layout.payload(name)
            if pool.layout.layers(spec) < config.num_layers:
                raise ConfigError(
                    f"pool payload {name!r} holds {pool.layout.layers(spec)} layers, the model "
                    f"has {config.num_layers}"
                )
            if spec.token_shape != (config.num_kv_heads, config.head_dim):
                raise ConfigError(
                    f"pool payload {name!r} has token shape {spec.token_shape}, the model needs "
                    f"{(config.num_kv_heads, config.head_dim)}; build it from config.kv_layout()"
                )
            if torch_dtype(spec.dtype) != weight.dtype:
                raise ConfigError(
                    f"pool payload {name!r} is {spec.dtype}, the model computes in {weight.dtype}; "
                    "give the pool the model's dtype"
                )
        if pool.buffer("k", 0).device != weight.device:
            raise ConfigError(
                f"the pool lives on {pool.buffer('k', 0).device}, the model on {weight.device}"
            )
        for i, (prefix, extend) in enumerate(
            zip(batch.prefix_lens, batch.extend_lens, strict=True)
        ):
            if prefix + extend > config.max_position_embeddings:
                raise RequestError(
                    f"request {i}: {prefix + extend} tokens exceed the model's "
                    f"max_position_embeddings ({config.max_position_embeddings})"
                )
        bad = (input_ids < 0) | (input_ids >= config.vocab_size)
        if bool(bad.any()):
            token = int(bad.nonzero()[0, 0])
            i = next(r for r in range(batch.num_requests) if batch.cu_seqlens_host[r + 1] > token)
            raise RequestError(
                f"request {i}: token id {int(input_ids[token])} is outside the vocabulary "
                f"[0, {config.vocab_size})"
            )
