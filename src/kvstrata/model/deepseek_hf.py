"""Reading a DeepSeek-V2 / V3 ``config.json`` the way transformers reads it.

:func:`deepseek_from_hf` maps transformers 4.x or 5.x spelling to a
:class:`~kvstrata.model.deepseek_config.DeepseekConfig`, with transformers' defaults for absent
fields (an absent ``q_lora_rank`` is 1536, a null one means full-rank queries), YaRN's parameters
as transformers fills them in, the gating each architecture runs, and a refusal by name of every
option that would change the model if it were ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, UnsupportedArchitectureError
from .deepseek_config import DeepseekConfig, MoEConfig, YarnScaling
from .hf_fields import REQUIRED, HFFields, is_number


def deepseek_from_hf(hf: Mapping[str, Any], architecture: str) -> DeepseekConfig:
    """The config a ``config.json`` of ``architecture`` (``deepseek_v2`` or ``deepseek_v3``)
    describes."""
    v3 = architecture == "deepseek_v3"
    fields = HFFields(hf, architecture)
    _refuse_unsupported_options(hf, architecture)
    num_layers = fields.integer("num_hidden_layers", 61 if v3 else 32)
    first_dense = min(fields.count("first_k_dense_replace", 3 if v3 else 0), num_layers)
    rope_theta, rope_scaling = _rope_from_hf(hf, fields)
    # null means full-rank queries; an absent q_lora_rank takes transformers' default.
    full_rank_queries = "q_lora_rank" in hf and hf["q_lora_rank"] is None
    q_lora_rank = None if full_rank_queries else fields.integer("q_lora_rank", 1536)
    return DeepseekConfig(
        architecture=architecture,
        vocab_size=fields.integer("vocab_size", 129280 if v3 else 102400),
        hidden_size=fields.integer("hidden_size", 7168 if v3 else 4096),
        intermediate_size=fields.integer("intermediate_size", 18432 if v3 else 11008),
        num_layers=num_layers,
        num_heads=fields.integer("num_attention_heads", 128 if v3 else 32),
        kv_lora_rank=fields.integer("kv_lora_rank", 512),
        qk_nope_head_dim=fields.integer("qk_nope_head_dim", 128),
        qk_rope_head_dim=fields.integer("qk_rope_head_dim", 64),
        v_head_dim=fields.integer("v_head_dim", 128),
        q_lora_rank=q_lora_rank,
        first_dense_layers=first_dense,
        moe=_moe_from_hf(fields, v3) if first_dense < num_layers else None,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rope_interleave=fields.flag("rope_interleave", True) if v3 else True,
        rms_norm_eps=fields.number("rms_norm_eps", 1e-6),
        tie_word_embeddings=fields.flag("tie_word_embeddings", False),
        max_position_embeddings=fields.integer("max_position_embeddings", 4096 if v3 else 2048),
        mtp_layers=fields.count("num_nextn_predict_layers", 0) if v3 else 0,
    )


def _moe_from_hf(fields: HFFields, v3: bool) -> MoEConfig:
    hf = fields.hf
    if v3:
        method = fields.text("topk_method", "noaux_tc")
        scoring = fields.text("scoring_func", "sigmoid")
        if (method, scoring) != ("noaux_tc", "sigmoid"):
            raise UnsupportedArchitectureError(
                f"topk_method {method!r} with scoring_func {scoring!r} is not supported for "
                "deepseek_v3; kvstrata (as transformers) runs noaux_tc gating over sigmoid scores"
            )
    else:
        method = fields.text("topk_method", "greedy")
        scoring = fields.text("scoring_func", "softmax")
        if method not in ("greedy", "group_limited_greedy") or scoring != "softmax":
            raise UnsupportedArchitectureError(
                f"topk_method {method!r} with scoring_func {scoring!r} is not supported for "
                "deepseek_v2; kvstrata runs greedy or group_limited_greedy over softmax scores"
            )
        if hf.get("norm_topk_prob"):
            raise UnsupportedArchitectureError(
                "norm_topk_prob=true is not supported for deepseek_v2: transformers ignores it, "
                "DeepSeek's own code normalises, so the model would be ambiguous"
            )
    grouped = method != "greedy"
    return MoEConfig(
        num_experts=fields.integer("n_routed_experts", 256 if v3 else 64),
        experts_per_token=fields.integer("num_experts_per_tok", 8 if v3 else REQUIRED),
        intermediate_size=fields.integer("moe_intermediate_size", 2048 if v3 else 1407),
        num_shared_experts=fields.integer("n_shared_experts", 1 if v3 else 2),
        gating=method,
        num_groups=fields.integer("n_group", 8 if v3 else REQUIRED) if grouped else 1,
        topk_groups=fields.integer("topk_group", 4 if v3 else REQUIRED) if grouped else 1,
        routed_scaling_factor=fields.number("routed_scaling_factor", 2.5 if v3 else 1.0),
        norm_topk_prob=fields.flag("norm_topk_prob", True) if v3 else False,
    )


def _refuse_unsupported_options(hf: Mapping[str, Any], architecture: str) -> None:
    """Raise for ``config.json`` options that would silently change the model if ignored."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(
            f"hidden_act {act!r} is not supported; kvstrata runs silu"
        )
    for option, what in (
        ("attention_bias", "q_a_proj, kv_a_proj_with_mqa and o_proj biases"),
        ("mlp_bias", "MLP biases"),
    ):
        if hf.get(option):
            raise UnsupportedArchitectureError(
                f"{option}=true is not supported for {architecture} (it adds {what})"
            )
    if hf.get("quantization_config") is not None:
        raise UnsupportedArchitectureError(
            "quantised checkpoints (quantization_config) are not supported; kvstrata loads "
            "float32 / bfloat16 / float16 weights (dequantise the checkpoint first)"
        )
    freq = hf.get("moe_layer_freq", 1)
    if freq != 1:
        raise UnsupportedArchitectureError(
            f"moe_layer_freq {freq!r} is not supported; every layer after first_k_dense_replace "
            "is a MoE layer (as transformers builds it)"
        )


def _rope_from_hf(hf: Mapping[str, Any], fields: HFFields) -> tuple[float, YarnScaling | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_parameters`` (5.x) or
    ``rope_theta``/``rope_scaling`` (4.x)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(
            f"config.json: rope_parameters / rope_scaling must be an object, got {params!r}"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not is_number(theta) or not 0 < theta < math.inf:
        raise CheckpointError(f"config.json: rope_theta must be a finite number > 0, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitectureError("partial_rotary_factor is not supported for MLA models")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "yarn":
        raise UnsupportedArchitectureError(
            f"rope_type {rope_type!r} is not supported for {fields.architecture}; kvstrata "
            "implements default and yarn RoPE for MLA models"
        )
    yarn = HFFields(params, "yarn rope scaling")
    max_positions = fields.integer("max_position_embeddings", 2048)
    original = yarn.integer("original_max_position_embeddings", max_positions)
    factor = params.get("factor")
    scaling = YarnScaling(
        factor=yarn.number("factor") if factor is not None else max_positions / original,
        original_max_position_embeddings=original,
        # transformers reads these with ``or``: 0 means the default too.
        beta_fast=_optional_number(params, "beta_fast") or 32.0,
        beta_slow=_optional_number(params, "beta_slow") or 1.0,
        mscale=_optional_number(params, "mscale"),
        mscale_all_dim=_optional_number(params, "mscale_all_dim"),
        attention_factor=_optional_number(params, "attention_factor"),
        truncate=yarn.flag("truncate", True),
    )
    return float(theta), scaling


def _optional_number(params: Mapping[str, Any], key: str) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    if not is_number(value) or not 0 <= value < math.inf:
        raise CheckpointError(
            f"config.json: rope {key} must be a finite number >= 0, got {value!r}"
        )
    return float(value)
