"""A model's shape, without its weights: what the planner needs to count its KV bytes and to
estimate its cost (``--model-shape NAME|config.json``).

:class:`ModelShape` reads a preset or a Hugging Face ``config.json`` (a file, or the checkpoint
directory holding it) and answers: KV bytes per token in a dtype, layers, the matmul FLOPs of
one token (every weight it multiplies by, the embedding excluded; a mixture of experts counts
the experts a token uses), the attention FLOPs of one (query, key) pair, and the last-token
logits' FLOPs per request. :func:`estimate_profile` turns those and a device's measured rates
into a :class:`~kvstrata.cost.CostProfile` labelled an estimate.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from .. import __version__
from ..errors import CheckpointError, ConfigError, ModelError
from ..model.config import DecoderConfig, ModelConfig, config_from_hf
from ..model.deepseek_config import DeepseekConfig
from ..model.loader import hf_weight_shapes, read_model_config
from .profile import DISK_DEFAULTS, CostProfile, Provenance

#: KV dtypes a shape can be planned in.
SHAPE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class DeviceRates:
    """What a device sustains, measured, for the estimate: dense matmul and paged attention
    TFLOP/s at prefill sizes, a step's fixed cost, and its copy links."""

    name: str
    matmul_tflops: float
    attention_tflops: float
    step_s: float
    request_s: float
    memory_gbps: float  # reading a cached prefix's KV once per chunk
    h2d_gbps: float
    d2h_gbps: float
    source: str


#: Measured rates per device kind (docs/benchmarks.md, "Cost profiles"). CUDA: the H200 rows of
#: "GPU end to end": one 8,192-token chunk of Llama-3.2-1B over an 88K prefix spent 21 ms in its
#: matmuls (2 x 0.97 G weights x 8,192 tokens: 755 TFLOP/s) and 296 ms in attention
#: (7.55e8 pairs x 131,072 FLOPs: 334 TFLOP/s); pinned page copies 51.3 / 52.6 GB/s. CPU: the
#: 2-core development machine's fp32 matmul and SDPA at prefill sizes (``kvstrata calibrate
#: --device cpu`` on the tiny preset fits the per-step and per-request terms).
DEVICE_RATES: dict[str, DeviceRates] = {
    "cuda": DeviceRates(
        "NVIDIA H200 (measured rates)", 755.0, 334.0, 2.0e-3, 1.0e-4, 3_500.0, 51.29, 52.56,
        "docs/benchmarks.md: GPU end to end, profile of an 8,192-token chunk over an 88K prefix",
    ),
    "cpu": DeviceRates(
        "cpu (2-core development machine)", 0.045, 0.012, 6.0e-4, 2.5e-4, 2.0, 1.89, 1.83,
        "docs/benchmarks.md: Cost profiles, fp32 on the 2-core machine",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """A decoder's structure in a KV dtype, as the planner models it."""

    name: str
    config: DecoderConfig
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in SHAPE_DTYPES:
            raise ConfigError(
                f"--dtype for --model-shape must be one of {', '.join(SHAPE_DTYPES)}, "
                f"got {self.dtype!r}"
            )

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's KV takes, every layer and payload (K and V, or the MLA latent)."""
        return self.config.kv_layout(self.dtype).page_bytes(1)

    def matmul_flops_per_token(self) -> float:
        """2 x the weights one token is multiplied by: every layer's projections and MLP (a
        MoE layer: its shared experts and ``experts_per_token`` of its routed ones)."""
        total = 0.0
        moe = self.config.moe if isinstance(self.config, DeepseekConfig) else None
        for name, shape in hf_weight_shapes(self.config).items():
            if len(shape) < 2 or "embed_tokens" in name or "lm_head" in name or "gate.w" in name:
                continue
            n = float(math.prod(shape))
            if moe is not None and ".experts." in name and "shared" not in name:
                n = n * moe.experts_per_token / moe.num_experts
            total += 2.0 * n
        return total

    def attention_flops_per_pair(self) -> float:
        """Scores and values of one (query, key) pair, every layer and head: GQA
        ``4 x heads x head_dim``; MLA ``2 x heads x (qk head dim + v head dim)``."""
        c = self.config
        if isinstance(c, ModelConfig):
            per_layer = 4.0 * c.num_heads * c.head_dim
        else:
            per_layer = 2.0 * c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
        return per_layer * c.num_layers

    def logits_flops_per_request(self) -> float:
        """The last token's logits (one per request and step)."""
        return 2.0 * self.config.hidden_size * self.config.vocab_size


def model_shape(name_or_path: str, dtype: str | None = None) -> ModelShape:
    """The shape of a preset, a ``config.json`` file, or a checkpoint directory holding one."""
    path = Path(name_or_path)
    try:
        if path.is_file():
            try:
                hf = json.loads(path.read_bytes())
            except (OSError, ValueError) as err:
                raise CheckpointError(f"cannot read {path}: {err}") from None
            if not isinstance(hf, dict):
                raise CheckpointError(f"{path} must hold a JSON object")
            config = config_from_hf(hf)
        else:
            config = read_model_config(name_or_path)
    except (ModelError, ConfigError) as err:
        raise ConfigError(f"--model-shape {name_or_path}: {err}") from None
    return ModelShape(name_or_path, config, dtype or "bfloat16")


def estimate_profile(shape: ModelShape, device_kind: str, page_size: int = 16) -> CostProfile:
    """A profile for ``shape`` on a ``device_kind`` device from its FLOPs and the device's
    measured rates (:data:`DEVICE_RATES`): an estimate, never fitted to this model."""
    if device_kind not in DEVICE_RATES:
        raise ConfigError(
            f"no measured rates for device kind {device_kind!r} ({', '.join(DEVICE_RATES)}): "
            "calibrate a profile (kvstrata calibrate) and give --cost-profile"
        )
    rates = DEVICE_RATES[device_kind]
    read, write = DISK_DEFAULTS[device_kind]
    return CostProfile(
        name=f"estimate:{device_kind}:{Path(shape.name).name}:{shape.dtype}",
        kind="estimate",
        step_s=rates.step_s,
        request_s=rates.request_s + shape.logits_flops_per_request() / (rates.matmul_tflops * 1e12),
        token_s=shape.matmul_flops_per_token() / (rates.matmul_tflops * 1e12),
        pair_s=shape.attention_flops_per_pair() / (rates.attention_tflops * 1e12),
        # one attention rate for both kernels: an estimate knows no better
        prefix_pair_s=shape.attention_flops_per_pair() / (rates.attention_tflops * 1e12),
        prefix_s=shape.kv_bytes_per_token / (rates.memory_gbps * 1e9),
        h2d_gbps=rates.h2d_gbps,
        d2h_gbps=rates.d2h_gbps,
        disk_read_gbps=read,
        disk_write_gbps=write,
        overlap="serial" if device_kind == "cpu" else "layered",
        num_layers=shape.num_layers,
        kv_bytes_per_token=shape.kv_bytes_per_token,
        provenance=Provenance(
            device=rates.name,
            device_kind=device_kind,
            model=shape.name,
            dtype=shape.dtype,
            page_size=page_size,
            versions={"kvstrata": __version__, "python": platform.python_version()},
            date=date.today().isoformat(),
            command="estimate from the model's config and the device's measured rates",
            note=f"ESTIMATE, not calibrated on this model: {rates.source}",
        ),
    )
