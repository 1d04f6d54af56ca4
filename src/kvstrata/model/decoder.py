"""What every decoder architecture shares: the frame of embeddings, layers, final norm and output
projection over the paged pool, and the pieces its layers are built from (RMSNorm, SwiGLU, RoPE).

:class:`Decoder` runs a packed batch through its layers; an architecture (``llama``, ``deepseek``)
supplies the layers, the RoPE frequencies and its attention backend. Each layer's attention writes
the payloads of its config (``config.token_payloads``) into the pool rows ``batch.write_index`` and
reads its requests' whole sequences from the pages. The arithmetic follows transformers step for
step (RMSNorm in fp32, RoPE tables in fp32 cast to the compute dtype), so the logits match
transformers on the same weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, Self

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, RequestError
from ..tiers.pool import DevicePool, torch_dtype
from .attention import ATTENTION_BACKENDS, AttentionBackend, ExchangeBytes, PagedAttention
from .attention_kernel import AttentionKernelConfig
from .batch import ForwardBatch, LayerHooks
from .config import DecoderConfig

LogitsMode = Literal["last", "all"]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, dim]`` by the ``[T, 1, dim]`` tables (half-split layout)."""
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


class PreNormLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections; a model's layer sets the four
    parts (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``)."""

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

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


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PagedLayerAttention(nn.Module):
    """A layer's attention over the pool: ``payloads`` names the pool payloads it uses."""

    payloads: tuple[str, ...]


class Decoder(nn.Module):
    """Embeddings, the layers, final norm and output projection of one architecture.

    Parameter names are transformers' without the ``model.`` prefix. With tied embeddings there is
    no ``lm_head``: the output projection reads ``embed_tokens.weight``. A layer is called as
    ``layer(x, cos, sin, batch, pool, attention)``; its :class:`PagedLayerAttention` names the pool
    payloads it uses (:meth:`use_payloads` renames them).
    """

    def __init__(
        self,
        config: DecoderConfig,
        layers: Iterable[nn.Module],
        inv_freq: torch.Tensor,
        rope_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Plain attributes, not buffers: they stay fp32 whatever dtype the weights take, and they
        # are real (on the host) even when the module is built on the meta device.
        self.inv_freq = inv_freq
        self.rope_factor = rope_factor
        self.attention_backend: AttentionBackend = "auto"
        self.attention_kernel: AttentionKernelConfig | None = None
        self.payload_prefix = ""

    # -- what an architecture supplies ------------------------------------------------------------

    def paged_attention(self, device: torch.device) -> PagedAttention:
        """The chosen attention backend resolved for a pool on ``device`` (raises
        :class:`ConfigError` when the backend cannot run this model there)."""
        raise NotImplementedError

    def exchange_bytes(self) -> ExchangeBytes:
        """What one layer's attention exchange moves per token under context parallelism."""
        raise NotImplementedError

    # -- configuration ----------------------------------------------------------------------------

    def use_payloads(self, prefix: str) -> Self:
        """Keep this model's KV in the pool payloads ``{prefix}...`` (a speculative draft model
        shares the target's pages under ``draft_``; see
        :func:`~kvstrata.model.layout.model_layout`); returns self."""
        self.payload_prefix = prefix
        names = tuple(p.name for p in self.config.token_payloads("float32", prefix))
        for module in self.modules():
            if isinstance(module, PagedLayerAttention):
                module.payloads = names
        return self

    def use_attention(self, backend: str, kernel: AttentionKernelConfig | None = None) -> Self:
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
    def from_state_dict(cls, config: DecoderConfig, state: Mapping[str, torch.Tensor]) -> Self:
        """Adopt ``state`` (this module's parameter names) as the weights, without copying it.

        The model takes the device and dtype of the tensors in ``state``; it is returned in eval
        mode with gradients off.
        """
        with torch.device("meta"):
            model = cls(config)  # type: ignore[call-arg]
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval().requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the embeddings'; a MoE router may keep fp32 weights)."""
        return self.embed_tokens.weight.dtype

    # -- forward ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        logits: LogitsMode = "last",
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Run the packed extend tokens ``input_ids`` ``[T]`` and write their KV into ``pool``.

        ``hooks`` see each layer before it reads the pool and after it wrote its KV there.

        Returns logits in the model's dtype: ``[num_requests, vocab]`` for each request's last token
        with ``logits="last"`` (the output projection runs on those rows only), or ``[T, vocab]``
        with ``logits="all"``.
        """
        if logits not in ("last", "all"):
            raise ConfigError(f"logits must be 'last' or 'all', got {logits!r}")
        self._check_inputs(input_ids, batch, pool)
        attention = self.paged_attention(pool.device)
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
        """``[T, 1, rope_dim]`` cos and sin for ``positions``, computed in fp32 (times the RoPE
        scaling's factor, if any), cast to ``dtype``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.rope_factor != 1.0:
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        return cos.to(dtype), sin.to(dtype)

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
        expected = config.token_payloads(
            str(weight.dtype).removeprefix("torch."), self.payload_prefix
        )
        for want in expected:
            spec = pool.layout.payload(want.name)
            if pool.layout.layers(spec) < config.num_layers:
                raise ConfigError(
                    f"pool payload {want.name!r} holds {pool.layout.layers(spec)} layers, the "
                    f"model has {config.num_layers}"
                )
            if spec.token_shape != want.token_shape:
                raise ConfigError(
                    f"pool payload {want.name!r} has token shape {spec.token_shape}, the model "
                    f"needs {want.token_shape}; build it from config.kv_layout()"
                )
            if torch_dtype(spec.dtype) != weight.dtype:
                raise ConfigError(
                    f"pool payload {want.name!r} is {spec.dtype}, the model computes in "
                    f"{weight.dtype}; give the pool the model's dtype"
                )
        first = pool.buffer(expected[0].name, 0)
        if first.device != weight.device:
            raise ConfigError(f"the pool lives on {first.device}, the model on {weight.device}")
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
