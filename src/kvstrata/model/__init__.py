"""The reference decoder model (Llama / Qwen2 / Qwen3) that computes KV into the paged pool.

``config`` describes a model, ``batch`` turns a batch of requests into pool indices once per forward,
``llama`` is the model itself and ``loader`` builds it from a checkpoint directory or a preset.
"""

from __future__ import annotations

from .batch import ForwardBatch
from .config import PRESETS, ModelConfig, RopeScaling
from .llama import LlamaModel
from .loader import convert_hf_state, hf_weight_shapes, load_model

__all__ = [
    "PRESETS",
    "ForwardBatch",
    "LlamaModel",
    "ModelConfig",
    "RopeScaling",
    "convert_hf_state",
    "hf_weight_shapes",
    "load_model",
]
