"""The shape of a multi-head latent attention model (DeepSeek-V2 / V3 architecture).

:class:`DeepseekConfig` is built from a Hugging Face ``config.json`` of ``DeepseekV2ForCausalLM`` or
``DeepseekV3ForCausalLM`` (:func:`~kvstrata.model.deepseek_hf.deepseek_from_hf`, read the way
transformers reads it, defaults included) or taken from the MLA presets. Per layer, attention caches one payload per token::

    kv_latent   [kv_lora_rank | qk_rope_head_dim]    the compressed KV (after its RMSNorm), then the
                                                     decoupled RoPE key shared by every head

The first ``first_dense_layers`` layers have a dense SwiGLU MLP, the rest a mixture of experts
(:class:`MoEConfig`). Options that would change the model if ignored (other activations, biases,
quantised weights, other RoPE or gating variants) are refused there, by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..config import KVLayout, PayloadSpec
from ..errors import ConfigError
from .hf_fields import is_number, positive_float, positive_int
from .layout import HasPayloads, model_layout

#: Hugging Face ``architectures`` entry -> our architecture name.
HF_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
_HF_NAMES = {arch: hf for hf, arch in HF_ARCHITECTURES.items()}

#: How a token picks its routed experts. V2: softmax scores, top-k over all experts (``greedy``)
#: or over the best ``topk_groups`` groups by their best expert (``group_limited_greedy``). V3:
#: sigmoid scores plus a per-expert bias for the choice only, groups ranked by their two best
#: experts (``noaux_tc``).
GATINGS = ("greedy", "group_limited_greedy", "noaux_tc")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (``rope_type: "yarn"``), as transformers computes it for DeepSeek.

    Frequencies whose wavelength fits ``beta_fast`` times into the original context keep their
    value, those fitting fewer than ``beta_slow`` times are divided by ``factor``, with a linear
    ramp in between. cos and sin are multiplied by :attr:`rope_factor`; the softmax scale by
    :attr:`softmax_factor`.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        positive_float("rope_scaling.factor", self.factor)
        positive_int(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )
        positive_float("rope_scaling.beta_fast", self.beta_fast)
        positive_float("rope_scaling.beta_slow", self.beta_slow)
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or not 0 <= value < math.inf):
                raise ConfigError(f"rope_scaling.{name} must be a number >= 0, got {value!r}")

    @property
    def rope_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' ``attention_factor``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What the softmax scale ``qk_head_dim ** -0.5`` is multiplied by."""
        if not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclass(frozen=True)
class MoEConfig:
    """The mixture of experts of the layers after the dense ones.

    Each token's output is ``sum_k w_k expert_k(x) + shared(x)``: ``experts_per_token`` of
    ``num_experts`` routed experts (SwiGLU, ``intermediate_size`` wide) chosen by ``gating`` (see
    :data:`GATINGS`) among the best ``topk_groups`` of ``num_groups`` expert groups, their weights
    ``w_k`` (normalised to sum 1 with ``norm_topk_prob``) times ``routed_scaling_factor``; and
    ``num_shared_experts`` shared experts, one SwiGLU ``num_shared_experts`` times as wide.
    """

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    num_shared_experts: int = 1
    gating: str = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "experts_per_token", "intermediate_size"):
            positive_int(f"moe.{name}", getattr(self, name))
        for name in ("num_groups", "topk_groups", "num_shared_experts"):
            positive_int(f"moe.{name}", getattr(self, name))
        if self.gating not in GATINGS:
            raise ConfigError(
                f"moe.gating must be one of {', '.join(GATINGS)}, got {self.gating!r}"
            )
        positive_float("moe.routed_scaling_factor", self.routed_scaling_factor)
        if self.num_experts % self.num_groups:
            raise ConfigError(
                f"{self.num_experts} experts cannot form {self.num_groups} equal groups (n_group)"
            )
        if self.topk_groups > self.num_groups:
            raise ConfigError(
                f"topk_group ({self.topk_groups}) exceeds the number of groups ({self.num_groups})"
            )
        if self.gating == "greedy" and (self.num_groups, self.topk_groups) != (1, 1):
            raise ConfigError("greedy gating uses no expert groups: n_group and topk_group are 1")
        per_group = self.num_experts // self.num_groups
        if self.topk_groups * per_group < self.experts_per_token:
            raise ConfigError(
                f"num_experts_per_tok ({self.experts_per_token}) exceeds the experts of the "
                f"{self.topk_groups} groups a token may use ({self.topk_groups * per_group})"
            )
        if self.gating == "noaux_tc" and per_group < 2:
            raise ConfigError(
                "noaux_tc gating ranks groups by their two best experts: give each group at "
                f"least 2 experts, not {per_group}"
            )
        if self.norm_topk_prob and self.gating != "noaux_tc":
            raise ConfigError(
                "norm_topk_prob applies to noaux_tc gating only (transformers ignores it for "
                "DeepSeek-V2's softmax gating, DeepSeek's own code does not): set it to false"
            )


@dataclass(frozen=True)
class DeepseekConfig:
    """Every structural parameter of a DeepSeek-V2 / V3 decoder.

    Attention: queries through ``q_proj`` (``q_lora_rank`` None) or the low-rank
    ``q_a_proj -> RMSNorm -> q_b_proj``; per head ``qk_nope_head_dim`` dims without position and
    ``qk_rope_head_dim`` with RoPE. Keys and values come from the ``kv_lora_rank`` latent through
    ``kv_b_proj`` (``qk_nope_head_dim`` key and ``v_head_dim`` value dims per head); the RoPE key
    is shared by all heads. ``rope_interleave``: the RoPE dims are rotated in adjacent pairs
    (DeepSeek's layout; V2 always). Layers ``[0, first_dense_layers)`` are dense, the rest MoE
    (``moe`` is None exactly when no layer is). ``mtp_layers``: multi-token-prediction layers a
    checkpoint may hold after the decoder's; they are not part of the prefill model.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    first_dense_layers: int = 0
    moe: MoEConfig | None = None
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in HF_ARCHITECTURES.values():
            raise ConfigError(
                f"architecture must be one of {', '.join(HF_ARCHITECTURES.values())}, got "
                f"{self.architecture!r}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        ):
            positive_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            positive_int("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}"
            )
        for name in ("first_dense_layers", "mtp_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if self.first_dense_layers > self.num_layers:
            raise ConfigError(
                f"first_dense_layers ({self.first_dense_layers}) exceeds num_layers "
                f"({self.num_layers})"
            )
        if (self.moe is None) != (self.first_dense_layers == self.num_layers):
            raise ConfigError(
                "moe must be given exactly when some layer is a MoE layer (first_dense_layers < "
                f"num_layers); got first_dense_layers={self.first_dense_layers} of "
                f"{self.num_layers} layers and moe={self.moe!r}"
            )
        positive_float("rope_theta", self.rope_theta)
        positive_float("rms_norm_eps", self.rms_norm_eps)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ConfigError(
                f"rope_scaling must be a YarnScaling or None, got {type(self.rope_scaling).__name__}"
            )

    @property
    def latent_dim(self) -> int:
        """Values per token and layer of the cached latent: the compressed KV, then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """The attention scores' scale: ``qk_head_dim ** -0.5``, times YaRN's mscale squared."""
        factor = 1.0 if self.rope_scaling is None else self.rope_scaling.softmax_factor
        return self.qk_head_dim**-0.5 * factor

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense_layers

    def token_payloads(
        self, dtype: str, prefix: str = "", num_layers: int | None = None
    ) -> tuple[PayloadSpec, ...]:
        """One payload, ``{prefix}kv_latent`` of :attr:`latent_dim` values: no separate K and V."""
        return (PayloadSpec(f"{prefix}kv_latent", (self.latent_dim,), dtype, num_layers),)

    def kv_layout(self, dtype: str, draft: HasPayloads | None = None) -> KVLayout:
        """The cache layout of this model: the payload ``kv_latent``; with a speculative
        ``draft``, also the draft's payloads on the same pages (see
        :func:`~kvstrata.model.layout.model_layout`)."""
        return model_layout(self, dtype, draft)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` fields transformers needs to build the same model (5.x spelling)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            s = self.rope_scaling
            rope |= {
                "rope_type": "yarn",
                "factor": s.factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
                "beta_fast": s.beta_fast,
                "beta_slow": s.beta_slow,
                "truncate": s.truncate,
            }
            rope |= {
                name: getattr(s, name)
                for name in ("mscale", "mscale_all_dim", "attention_factor")
                if getattr(s, name) is not None
            }
        # A model without MoE layers still names experts: transformers reads the fields.
        moe = self.moe or MoEConfig(1, 1, self.intermediate_size)
        hf: dict[str, Any] = {
            "architectures": [_HF_NAMES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "first_k_dense_replace": self.first_dense_layers,
            "n_routed_experts": moe.num_experts,
            "n_shared_experts": moe.num_shared_experts,
            "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.intermediate_size,
            "n_group": moe.num_groups,
            "topk_group": moe.topk_groups,
            "routed_scaling_factor": moe.routed_scaling_factor,
            "norm_topk_prob": moe.norm_topk_prob,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope,
        }
        if self.architecture == "deepseek_v3":
            hf |= {"rope_interleave": self.rope_interleave, "num_nextn_predict_layers": 0}
        else:
            hf["topk_method"] = moe.gating
        return hf


# Small enough for unit tests on one CPU core. Both parts of the latent (64 + 16) are powers of two
# >= 16, so the Triton kernel can tile them.
_TINY_MLA = DeepseekConfig(
    architecture="deepseek_v2",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    first_dense_layers=2,
    max_position_embeddings=131072,
)

MLA_PRESETS: dict[str, DeepseekConfig] = {
    "tiny-mla": _TINY_MLA,
    # A self-speculative draft for tiny-mla: its first layer (preset weights are drawn per name).
    "tiny-mla-draft": replace(_TINY_MLA, num_layers=1, first_dense_layers=1),
    # DeepSeek-V3's structure in miniature: low-rank queries, one dense layer then a MoE layer
    # with grouped noaux_tc gating and a shared expert, YaRN RoPE.
    "tiny-moe": replace(
        _TINY_MLA,
        architecture="deepseek_v3",
        q_lora_rank=64,
        first_dense_layers=1,
        moe=MoEConfig(
            num_experts=8,
            experts_per_token=2,
            intermediate_size=64,
            num_shared_experts=1,
            gating="noaux_tc",
            num_groups=4,
            topk_groups=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        rope_scaling=YarnScaling(
            factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
        ),
        max_position_embeddings=163840,
    ),
    # deepseek-ai/DeepSeek-V2-Lite's shapes (random weights): 15.7 B parameters, 2.4 B active.
    "deepseek-v2-lite": DeepseekConfig(
        architecture="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        num_layers=27,
        num_heads=16,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_dense_layers=1,
        moe=MoEConfig(
            num_experts=64,
            experts_per_token=6,
            intermediate_size=1408,
            num_shared_experts=2,
            gating="greedy",
        ),
        rope_scaling=YarnScaling(
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        max_position_embeddings=163840,
    ),
}
