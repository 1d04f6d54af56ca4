"""Multi-head latent attention (DeepSeek-V2 / V3) over the paged pool, with the latent as the cache.

Per token, the layer caches only the latent ``[c | k_rope]`` (payload ``kv_latent``): ``c`` the
``kv_lora_rank``-dim compressed KV after its RMSNorm, ``k_rope`` the ``qk_rope_head_dim``-dim RoPE key
all heads share. transformers expands the latent into per-head keys and values through
``kv_b_proj``, whose rows are, per head ``h``, ``W_uk[h]`` (``qk_nope`` x rank) then ``W_uv[h]``
(``v_head`` x rank)::

    naive       k[t,h] = [W_uk[h] c_t | k_rope_t]     v[t,h] = W_uv[h] c_t
                score  = q_nope . W_uk[h] c_t + q_rope . k_rope_t
    absorbed    score  = (W_uk[h]^T q_nope | q_rope) . (c_t | k_rope_t)       one shared "KV head"
                out[h] = W_uv[h] (sum_t p_t c_t)

The absorbed form attends over the latent itself: the key up-projection moves into the query, the
value up-projection after the attention, and the pages are read as they are
(:meth:`~kvstrata.model.attention.PagedAttention.latent`, or the context-parallel exchange). It
costs ``2 * rank + rope`` multiply-adds per head and (query, key) pair against the naive form's
``nope + rope + v``, and saves expanding each key (``rank * (nope + v)`` per head). So, as serving
engines do, ``form="auto"`` expands (the naive form, from the cached latents: the cache still holds
nothing else) when a batch's (query, key) pairs make that cheaper -- long extends -- and attends
the latent, absorbed, otherwise (short extends over long cached prefixes, and always under context
parallelism, whose exchange moves latents). The tests hold each form to the other and both to
transformers.

RoPE: DeepSeek rotates adjacent pairs of dims (``rope_interleave``); the layer de-interleaves them
first (evens, then odds) and rotates half-split, which is transformers' arithmetic exactly and keeps
``q_rope . k_rope`` the same. YaRN frequencies and factors follow transformers' ``yarn`` RoPE.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from ..errors import ConfigError
from ..tiers.pool import DevicePool
from .attention import PagedAttention, sdpa_causal
from .batch import ForwardBatch
from .decoder import PagedLayerAttention, RMSNorm, apply_rope
from .deepseek_config import DeepseekConfig, YarnScaling

MLAForm = Literal["auto", "absorbed", "expanded"]
MLA_FORMS: tuple[MLAForm, ...] = ("auto", "absorbed", "expanded")

#: transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the
#: config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_inv_freq(config: DeepseekConfig) -> torch.Tensor:
    """``[qk_rope_head_dim // 2]`` fp32 RoPE frequencies on the host, YaRN-scaled if configured."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    if config.rope_scaling is None:
        return 1.0 / pos_freqs
    return _yarn(dim, base, pos_freqs, config.rope_scaling)


def _yarn(dim: int, base: float, pos_freqs: torch.Tensor, s: YarnScaling) -> torch.Tensor:
    """Extrapolated (unscaled) frequencies for the dims that rotate at least ``beta_fast`` times
    over the original context, interpolated (divided by ``factor``) below ``beta_slow``
    rotations, a linear ramp over the dims in between."""

    def correction_dim(rotations: float) -> float:
        context = s.original_max_position_embeddings
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, device="cpu").float() - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


class MLAttention(PagedLayerAttention):
    """One layer's multi-head latent attention; parameter names are transformers'."""

    def __init__(self, config: DeepseekConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.interleaved = config.rope_interleave
        self.scale = config.softmax_scale
        q_size = config.num_heads * config.qk_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        per_head = config.qk_nope_head_dim + config.v_head_dim
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, config.num_heads * per_head, bias=False)
        self.o_proj = nn.Linear(
            config.num_heads * config.v_head_dim, config.hidden_size, bias=False
        )
        self.payloads = ("kv_latent",)  # the pool payload its latent lives in
        self.form: MLAForm = "auto"

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
        q_nope, q_rope = self.queries(x, cos, sin)
        latent = self.latent(x, cos, sin)
        (name,) = self.payloads
        rows = pool.token_view(name, self.layer)
        rows.index_copy_(0, batch.write_index, latent)
        if self._form(batch) == "expanded":
            out = self._expanded(q_nope, q_rope, latent, rows, batch)
        else:
            w_uk, w_uv = self.up_projections()
            # [T, H, nope] x [H, nope, rank] -> [T, H, rank]: the key up-projection, absorbed.
            q = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope), dim=-1)
            if batch.cp is not None:  # other ranks hold part of the latents
                latent_out = batch.cp.attend_latent(q, latent, rows, self.rank, self.scale)
            else:
                pages = pool.buffer(name, self.layer)
                latent_out = attention.latent(q, latent, pages, batch, self.rank, self.scale)
            out = torch.einsum("thr,hvr->thv", latent_out, w_uv)  # the value up-projection
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def queries(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([T, H, nope], [T, H, rope])``: each head's query, its RoPE part rotated."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        return q_nope, self._rope(q_rope, cos, sin)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[T, rank + rope]``: what the cache stores for each token."""
        compressed, k_rope = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope_dim), dim=-1)
        k_rope = self._rope(k_rope[:, None, :], cos, sin)[:, 0]
        return torch.cat((self.kv_a_layernorm(compressed), k_rope), dim=-1)

    def _form(self, batch: ForwardBatch) -> MLAForm:
        """``form``, with ``auto`` resolved for this batch by multiply-adds (see the module)."""
        if self.form != "auto":
            return self.form
        if batch.cp is not None:
            return "absorbed"
        saved_per_pair = 2 * self.rank - self.nope_dim - self.v_dim
        cost_per_key = self.rank * (self.nope_dim + self.v_dim)
        lens = list(zip(batch.prefix_lens, batch.extend_lens, strict=True))
        pairs = sum(e * p + e * (e + 1) // 2 for p, e in lens)
        keys = sum(p + e for p, e in lens)
        return "expanded" if pairs * saved_per_pair > keys * cost_per_key else "absorbed"

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk`` ``[H, nope, rank]`` and ``W_uv`` ``[H, v, rank]``: views of ``kv_b_proj``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The expanded form's per-head keys ``[S, H, nope + rope]`` and values ``[S, H, v]``."""
        compressed, k_rope = latent.split((self.rank, self.rope_dim), dim=-1)
        kv = self.kv_b_proj(compressed).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, values = kv.split((self.nope_dim, self.v_dim), dim=-1)
        k_rope = k_rope[:, None, :].expand(-1, self.num_heads, -1)
        return torch.cat((k_nope, k_rope), dim=-1), values

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        rows: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Per request: expand its latents to keys and values, then ordinary attention."""
        if batch.cp is not None:
            raise ConfigError(
                "the expanded MLA form does not run under CP: its exchange is latents"
            )
        q = torch.cat((q_nope, q_rope), dim=-1)
        out = q.new_empty((q.shape[0], self.num_heads, self.v_dim))
        starts = batch.cu_seqlens_host
        for i, prefix in enumerate(batch.prefix_lens):
            start, end = starts[i], starts[i + 1]
            seq = latent[start:end] if prefix == 0 else rows.index_select(0, batch.read_index[i])
            keys, values = self.expand(seq)
            out[start:end] = sdpa_causal(q[start:end], keys, values, self.scale)
        return out

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # pairs (0, 1), (2, 3), ... -> evens then odds
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)
