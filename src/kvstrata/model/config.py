"""The shape of a decoder model: :class:`ModelConfig`, the presets and the ``config.json`` mapping.

One frozen dataclass describes the grouped-query decoders the reference engine runs (Llama, Qwen2,
Qwen3); :class:`~kvstrata.model.deepseek_config.DeepseekConfig` describes the MLA models
(DeepSeek-V2 / V3). :func:`config_from_hf` builds either from a Hugging Face ``config.json``,
:data:`PRESETS` holds both kinds, and each tells the cache what one token of KV looks like
(``kv_layout``). Options a model does not implement (sliding windows, MLP biases, other RoPE
variants) are refused by name instead of being ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..config import KVLayout, PayloadSpec
from ..errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from . import deepseek_config
from .deepseek_config import MLA_PRESETS, DeepseekConfig
from .deepseek_hf import deepseek_from_hf
from .hf_fields import HFFields, is_number, positive_float, positive_int
from .layout import model_layout

#: Hugging Face ``architectures`` entry -> our architecture name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ARCHITECTURES = tuple(HF_ARCHITECTURES.values())
_HF_NAMES = {arch: hf for hf, arch in HF_ARCHITECTURES.items()}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (``rope_type: "llama3"`` in ``config.json``).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their
    frequency, those longer than ``original_max_position_embeddings / low_freq_factor`` are divided
    by ``factor``, and the band in between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        positive_float("rope_scaling.factor", self.factor)
        positive_float("rope_scaling.low_freq_factor", self.low_freq_factor)
        positive_float("rope_scaling.high_freq_factor", self.high_freq_factor)
        positive_int(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )
        if not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                "rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor!r} <= {self.low_freq_factor!r}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Every structural parameter of a Llama / Qwen2 / Qwen3 decoder.

    qkv_bias: the q/k/v projections carry a bias (Qwen2). qk_norm: queries and keys get a per-head
    RMSNorm before RoPE (Qwen3). tie_word_embeddings: the output projection reuses the embedding
    matrix. max_position_embeddings: the longest sequence (prefix + extend) the model accepts.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture must be one of {', '.join(ARCHITECTURES)}, got {self.architecture!r}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        positive_float("rope_theta", self.rope_theta)
        positive_float("rms_norm_eps", self.rms_norm_eps)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}"
            )

    @property
    def num_kv_groups(self) -> int:
        """Query heads that share one K/V head."""
        return self.num_heads // self.num_kv_heads

    def token_payloads(
        self, dtype: str, prefix: str = "", num_layers: int | None = None
    ) -> tuple[PayloadSpec, ...]:
        """``{prefix}k`` and ``{prefix}v``, one token ``[num_kv_heads, head_dim]`` each."""
        shape = (self.num_kv_heads, self.head_dim)
        return (
            PayloadSpec(f"{prefix}k", shape, dtype, num_layers),
            PayloadSpec(f"{prefix}v", shape, dtype, num_layers),
        )

    def kv_layout(self, dtype: str, draft: DecoderConfig | None = None) -> KVLayout:
        """The cache layout of this model: payloads ``k`` and ``v``; with a speculative ``draft``
        model, also the draft's payloads (``draft_k``/``draft_v``, or ``draft_kv_latent``) on the
        same pages (see :func:`~kvstrata.model.layout.model_layout`)."""
        return model_layout(self, dtype, draft)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Map a Hugging Face ``config.json`` (transformers 4.x or 5.x spelling) to a config.

        Raises :class:`UnsupportedArchitectureError` for an architecture or option kvstrata does not
        implement, :class:`CheckpointError` for a field that is missing or of the wrong type, and
        :class:`ConfigError` for fields that describe no valid model.
        """
        declared = hf.get("architectures") or []
        if not isinstance(declared, list) or not all(isinstance(a, str) for a in declared):
            raise CheckpointError(
                f"config.json: architectures must be a list of names, got {declared!r}"
            )
        known = [HF_ARCHITECTURES[a] for a in declared if a in HF_ARCHITECTURES]
        if not known:
            raise UnsupportedArchitectureError(
                f"config.json declares architectures {declared}; kvstrata runs "
                f"{', '.join(HF_ARCHITECTURES)}"
            )
        architecture = known[0]
        fields = HFFields(hf, architecture)
        _refuse_unsupported_options(hf, architecture)
        num_heads = fields.integer("num_attention_heads")
        hidden_size = fields.integer("hidden_size")
        rope_theta, rope_scaling = _rope_from_hf(hf)
        return cls(
            architecture=architecture,
            vocab_size=fields.integer("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=fields.integer("intermediate_size"),
            num_layers=fields.integer("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=fields.integer("num_key_value_heads", num_heads),
            head_dim=fields.integer("head_dim", hidden_size // num_heads),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6),
            tie_word_embeddings=fields.flag("tie_word_embeddings", False),
            qkv_bias=architecture == "qwen2",
            qk_norm=architecture == "qwen3",
            max_position_embeddings=fields.integer("max_position_embeddings", 2048),
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` fields transformers needs to build the same model (5.x spelling).

        Raises :class:`ConfigError` when ``qkv_bias``/``qk_norm`` differ from what the architecture
        implies (transformers cannot express, say, a Llama with a q/k/v bias but no o_proj bias).
        """
        if (self.qkv_bias, self.qk_norm) != (
            self.architecture == "qwen2",
            self.architecture == "qwen3",
        ):
            raise ConfigError(
                f"a {self.architecture} model with qkv_bias={self.qkv_bias}, qk_norm={self.qk_norm} "
                "has no transformers equivalent; qwen2 implies qkv_bias, qwen3 implies qk_norm"
            )
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            s = self.rope_scaling
            rope |= {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        hf: dict[str, Any] = {
            "architectures": [_HF_NAMES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope,
        }
        return hf


def _refuse_unsupported_options(hf: Mapping[str, Any], architecture: str) -> None:
    """Raise for ``config.json`` options that would silently change the model if ignored."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(
            f"hidden_act {act!r} is not supported; kvstrata runs silu"
        )
    if hf.get("mlp_bias"):
        raise UnsupportedArchitectureError(
            "mlp_bias=true is not supported (Llama MLPs have no bias)"
        )
    if hf.get("use_sliding_window"):
        raise UnsupportedArchitectureError(
            "use_sliding_window=true is not supported; kvstrata runs full attention in every layer"
        )
    if hf.get("attention_bias"):
        raise UnsupportedArchitectureError(
            f"attention_bias=true is not supported for {architecture} (it adds an o_proj bias)"
        )


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_parameters`` (5.x) or ``rope_theta``/``rope_scaling`` (4.x)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(
            f"config.json: rope_parameters / rope_scaling must be an object, got {params!r}"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not is_number(theta) or not 0 < theta < math.inf:
        raise CheckpointError(f"config.json: rope_theta must be a finite number > 0, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedArchitectureError(
            f"rope_type {rope_type!r} is not supported; kvstrata implements default and llama3 RoPE"
        )
    fields = HFFields(params, "llama3 rope scaling")
    scaling = RopeScaling(
        factor=fields.number("factor"),
        low_freq_factor=fields.number("low_freq_factor"),
        high_freq_factor=fields.number("high_freq_factor"),
        original_max_position_embeddings=fields.integer("original_max_position_embeddings"),
    )
    return float(theta), scaling


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    """The config a Hugging Face ``config.json`` describes: the first of its ``architectures``
    kvstrata runs decides between :class:`ModelConfig` and :class:`DeepseekConfig`.

    Raises :class:`UnsupportedArchitectureError` for an architecture or option kvstrata does not
    implement, :class:`CheckpointError` for a field that is missing or of the wrong type, and
    :class:`ConfigError` for fields that describe no valid model.
    """
    declared = hf.get("architectures") or []
    if not isinstance(declared, list) or not all(isinstance(a, str) for a in declared):
        raise CheckpointError(
            f"config.json: architectures must be a list of names, got {declared!r}"
        )
    for name in declared:
        if name in HF_ARCHITECTURES:
            return ModelConfig.from_hf(hf)
        if name in deepseek_config.HF_ARCHITECTURES:
            return deepseek_from_hf(hf, deepseek_config.HF_ARCHITECTURES[name])
    raise UnsupportedArchitectureError(
        f"config.json declares architectures {declared}; kvstrata runs "
        f"{', '.join([*HF_ARCHITECTURES, *deepseek_config.HF_ARCHITECTURES])}"
    )


# Small enough for unit tests on one CPU core; the Qwen variants differ only where the
# architecture does.
_TINY = ModelConfig(
    architecture="llama",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    max_position_embeddings=131072,
)

#: Every model config kvstrata runs.
DecoderConfig = ModelConfig | DeepseekConfig

PRESETS: dict[str, DecoderConfig] = {
    "tiny": _TINY,
    "tiny-qwen2": replace(
        _TINY, architecture="qwen2", rope_theta=1000000.0, tie_word_embeddings=True, qkv_bias=True
    ),
    "tiny-qwen3": replace(_TINY, architecture="qwen3", rope_theta=1000000.0, qk_norm=True),
    # A speculative draft for ``tiny``: its first layer. Preset weights are drawn per parameter
    # name, so with the same seed it holds tiny's embedding, layer 0, norm and head (a
    # layer-skipping self-speculative draft).
    "tiny-draft": replace(_TINY, num_layers=1),
    # Big enough that a CPU prefill of 1k tokens is dominated by matmuls and attention, not Python.
    "small": ModelConfig(
        architecture="llama",
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    **MLA_PRESETS,
}
