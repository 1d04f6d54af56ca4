"""The reference decoder models that compute KV into the paged pool.

``config`` / ``deepseek_config`` describe a model (Llama / Qwen2 / Qwen3, or DeepSeek-V2 / V3 with
multi-head latent attention), ``batch`` turns a batch of requests into pool indices once per
forward, ``decoder`` is the frame every architecture shares, ``llama`` and ``deepseek`` (with
``mla`` and ``moe``) the models, and ``loader`` builds one from a checkpoint directory or a preset.
"""

from __future__ import annotations

from .batch import ForwardBatch
from .config import PRESETS, DecoderConfig, ModelConfig, RopeScaling, config_from_hf
from .decoder import Decoder
from .deepseek import DeepseekModel
from .deepseek_config import DeepseekConfig, MoEConfig, YarnScaling
from .llama import LlamaModel
from .loader import convert_hf_state, hf_weight_shapes, load_model

__all__ = [
    "PRESETS",
    "Decoder",
    "DecoderConfig",
    "DeepseekConfig",
    "DeepseekModel",
    "ForwardBatch",
    "LlamaModel",
    "ModelConfig",
    "MoEConfig",
    "RopeScaling",
    "YarnScaling",
    "config_from_hf",
    "convert_hf_state",
    "hf_weight_shapes",
    "load_model",
]
