"""Build a decoder (:class:`LlamaModel` or :class:`DeepseekModel`) from a Hugging Face checkpoint
directory or from a preset.

A checkpoint directory holds ``config.json`` and the weights as ``model.safetensors`` or as shards
listed by ``model.safetensors.index.json``; it is read with ``safetensors`` alone (no transformers).
Our parameter names are transformers' without the ``model.`` prefix (:func:`convert_hf_state`); a
MoE layer's routed experts, stored per expert in checkpoints, are stacked as transformers holds
them in memory (``experts.gate_up_proj``, ``experts.down_proj``). A MoE router stays in fp32.

A preset is initialised randomly from a seeded generator, so the same seed gives the same weights on
the same device.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from ..errors import CheckpointError, ConfigError, ModelError
from .config import PRESETS, DecoderConfig, ModelConfig, config_from_hf
from .decoder import Decoder
from .deepseek import DeepseekModel
from .deepseek_config import DeepseekConfig
from .llama import LlamaModel
from .moe import keeps_fp32

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Checkpoint entries that are not weights of the model (old Llama checkpoints store RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

#: Standard deviation of the random init of presets; keeps the logits of a random model small.
INIT_STD = 0.02


def load_model(
    path_or_preset: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    seed: int = 0,
) -> tuple[DecoderConfig, Decoder]:
    """Load a checkpoint directory, or build a preset (see :data:`PRESETS`) with random weights.

    ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA; ``seed`` matters for presets only.
    Raises :class:`CheckpointError` for a directory without config or weights or with weights that
    disagree with its config, :class:`UnsupportedArchitectureError` for a model kvstrata does not
    implement, and :class:`ConfigError` for an unknown preset or dtype.
    """
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    if _is_checkpoint(path_or_preset):
        config, hf_state = read_checkpoint(Path(path_or_preset), device, dtype)
        state = convert_hf_state(config, hf_state)
    else:
        config = read_model_config(path_or_preset)
        state = random_state(config, device, dtype, seed)
    return config, build_model(config, state)


def new_model(config: DecoderConfig) -> Decoder:
    """The decoder that runs ``config``, with uninitialised weights (on the current device)."""
    return LlamaModel(config) if isinstance(config, ModelConfig) else DeepseekModel(config)


def build_model(config: DecoderConfig, state: Mapping[str, torch.Tensor]) -> Decoder:
    """The decoder of ``config`` holding ``state`` (our parameter names), not copied."""
    if isinstance(config, ModelConfig):
        return LlamaModel.from_state_dict(config, state)
    return DeepseekModel.from_state_dict(config, state)


def read_model_config(path_or_preset: str | os.PathLike[str]) -> DecoderConfig:
    """The config of a checkpoint directory (its ``config.json`` only, no weights)
    or of a preset: what a caller needs to size pools and workloads before loading weights."""
    if _is_checkpoint(path_or_preset):
        return _read_config(Path(path_or_preset))
    if str(path_or_preset) in PRESETS:
        return PRESETS[str(path_or_preset)]
    raise ConfigError(
        f"{str(path_or_preset)!r} is neither a checkpoint directory nor a preset; "
        f"presets: {', '.join(PRESETS)}"
    )


def weight_bytes(config: DecoderConfig, dtype: torch.dtype) -> int:
    """Bytes the weights of ``config`` take in ``dtype`` (a MoE router's in fp32)."""
    return sum(
        math.prod(shape) * (4 if keeps_fp32(name) else dtype.itemsize)
        for name, shape in hf_weight_shapes(config).items()
    )


def _is_checkpoint(path_or_preset: str | os.PathLike[str]) -> bool:
    # An empty string is Path("."), which exists: never take the working directory by accident.
    return str(path_or_preset) != "" and Path(path_or_preset).exists()


def hf_weight_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a transformers checkpoint of ``config`` holds, by name, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (config.hidden_size,),
            layer + "post_attention_layernorm.weight": (config.hidden_size,),
        }
        if isinstance(config, ModelConfig):
            shapes |= _llama_layer_shapes(config, layer)
        else:
            shapes |= _deepseek_layer_shapes(config, i, layer)
    return shapes


def _llama_layer_shapes(config: ModelConfig, layer: str) -> dict[str, tuple[int, ...]]:
    hidden, q_size = config.hidden_size, config.num_heads * config.head_dim
    kv_size, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        layer + "self_attn.q_proj.weight": (q_size, hidden),
        layer + "self_attn.k_proj.weight": (kv_size, hidden),
        layer + "self_attn.v_proj.weight": (kv_size, hidden),
        layer + "self_attn.o_proj.weight": (hidden, q_size),
        **_mlp_shapes(layer + "mlp.", hidden, inter),
    }
    if config.qkv_bias:
        shapes |= {
            layer + "self_attn.q_proj.bias": (q_size,),
            layer + "self_attn.k_proj.bias": (kv_size,),
            layer + "self_attn.v_proj.bias": (kv_size,),
        }
    if config.qk_norm:
        shapes |= {
            layer + "self_attn.q_norm.weight": (config.head_dim,),
            layer + "self_attn.k_norm.weight": (config.head_dim,),
        }
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def _deepseek_layer_shapes(
    config: DeepseekConfig, index: int, layer: str
) -> dict[str, tuple[int, ...]]:
    hidden, heads, attn = config.hidden_size, config.num_heads, layer + "self_attn."
    q_size = heads * config.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if config.q_lora_rank is None:
        shapes[attn + "q_proj.weight"] = (q_size, hidden)
    else:
        shapes |= {
            attn + "q_a_proj.weight": (config.q_lora_rank, hidden),
            attn + "q_a_layernorm.weight": (config.q_lora_rank,),
            attn + "q_b_proj.weight": (q_size, config.q_lora_rank),
        }
    per_head = config.qk_nope_head_dim + config.v_head_dim
    shapes |= {
        attn + "kv_a_proj_with_mqa.weight": (config.latent_dim, hidden),
        attn + "kv_a_layernorm.weight": (config.kv_lora_rank,),
        attn + "kv_b_proj.weight": (heads * per_head, config.kv_lora_rank),
        attn + "o_proj.weight": (hidden, heads * config.v_head_dim),
    }
    moe, mlp = config.moe, layer + "mlp."
    if moe is None or not config.is_moe_layer(index):
        return shapes | _mlp_shapes(mlp, hidden, config.intermediate_size)
    shapes[mlp + "gate.weight"] = (moe.num_experts, hidden)
    if moe.gating == "noaux_tc":
        shapes[mlp + "gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes |= _mlp_shapes(f"{mlp}experts.{e}.", hidden, moe.intermediate_size)
    shared = moe.intermediate_size * moe.num_shared_experts
    return shapes | _mlp_shapes(mlp + "shared_experts.", hidden, shared)


def convert_hf_state(
    config: DecoderConfig, hf_state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rename transformers weights to our names (``model.`` prefix dropped), stacking each MoE
    layer's per-expert weights (or taking transformers' in-memory stacked ones).

    Only the weights ``config`` implies are taken: ``lm_head.weight`` of a tied model is skipped.
    """
    state = {
        name.removeprefix("model."): hf_state[name]
        for name in hf_weight_shapes(config)
        if ".mlp.experts." not in name
    }
    if isinstance(config, DeepseekConfig) and config.moe is not None:
        for i in range(config.first_dense_layers, config.num_layers):
            prefix = f"model.layers.{i}.mlp.experts."
            state |= _stacked_experts(hf_state, prefix, config.moe.num_experts)
    return state


def _stacked_experts(
    hf_state: Mapping[str, torch.Tensor], prefix: str, num_experts: int
) -> dict[str, torch.Tensor]:
    """One MoE layer's ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj``
    ``[E, H, I]``."""
    ours = prefix.removeprefix("model.")
    if prefix + "gate_up_proj" in hf_state:  # a transformers model's own state dict
        return {ours + name: hf_state[prefix + name] for name in ("gate_up_proj", "down_proj")}
    gate_up = [
        torch.cat(
            (hf_state[f"{prefix}{e}.gate_proj.weight"], hf_state[f"{prefix}{e}.up_proj.weight"])
        )
        for e in range(num_experts)
    ]
    down = [hf_state[f"{prefix}{e}.down_proj.weight"] for e in range(num_experts)]
    return {ours + "gate_up_proj": torch.stack(gate_up), ours + "down_proj": torch.stack(down)}


def read_checkpoint(
    directory: Path, device: torch.device, dtype: torch.dtype
) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """Read ``config.json`` and every weight (transformers names) of a checkpoint directory.

    Shapes are checked against the config before any tensor is read; weights land on ``device``
    in ``dtype`` (a MoE router's in fp32).
    """
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise CheckpointError(
            "reading checkpoints needs safetensors: pip install 'kvstrata[hf]'"
        ) from None

    config = _read_config(directory)
    expected = hf_weight_shapes(config)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in _weight_files(directory):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[name]:
                        raise CheckpointError(
                            f"weight {name} in {file.name} has shape {shape}, but config.json "
                            f"implies {expected[name]}; the weights and config.json disagree"
                        )
                    as_dtype = torch.float32 if keeps_fp32(name) else dtype
                    state[name] = f.get_tensor(name).to(device=device, dtype=as_dtype)
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"cannot read weights from {file}: {err}") from err

    missing = [name for name in expected if name not in state]
    if missing:
        raise CheckpointError(
            f"{directory} lacks {len(missing)} weight(s) that config.json implies, first "
            f"{missing[0]} (shape {expected[missing[0]]})"
        )
    unexpected = [
        name
        for name in unexpected
        if not name.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_word_embeddings and name == "lm_head.weight")
        and not _is_mtp_weight(config, name)
    ]
    if unexpected:
        raise CheckpointError(
            f"{directory} holds {len(unexpected)} weight(s) this {config.architecture} config "
            f"does not use, first {unexpected[0]}; the weights and config.json disagree"
        )
    return config, state


def _is_mtp_weight(config: DecoderConfig, name: str) -> bool:
    """A DeepSeek-V3 multi-token-prediction layer's weight (after the decoder's layers): not part
    of the prefill model, as transformers skips it too."""
    if not isinstance(config, DeepseekConfig) or not name.startswith("model.layers."):
        return False
    index = name.removeprefix("model.layers.").split(".", 1)[0]
    return index.isdigit() and 0 <= int(index) - config.num_layers < config.mtp_layers


def _read_config(directory: Path) -> DecoderConfig:
    """The model ``directory/config.json`` describes; any defect is a :class:`ModelError` naming
    the file."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; pass a checkpoint directory")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{directory} has no config.json; pass a Hugging Face checkpoint directory "
            "(config.json + *.safetensors)"
        )
    hf_config = _read_json(config_path)
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object")
    try:
        return config_from_hf(hf_config)
    except ModelError as err:
        raise type(err)(f"{config_path}: {err}") from None
    except ConfigError as err:  # the fields have the right types but describe no valid model
        raise CheckpointError(f"{config_path}: {err}") from None


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(f"cannot read {path}: {err}") from None


def random_state(
    config: DecoderConfig, device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Seeded random weights (our names): norms one, everything else N(0, 0.02²); a MoE router
    in fp32.

    Drawn in fp32 and then cast, so one seed gives the same weights in every dtype of a device.
    Each parameter is drawn from its own stream (the seed and a CRC-32 of its name), so models that
    differ only in depth share the weights they have in common (``tiny-draft`` is ``tiny``'s
    first layer).
    """
    generator = torch.Generator(device=device)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in new_model(config).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weight = torch.ones(shape, device=device)
        else:
            generator.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
            weight = torch.empty(shape, device=device).normal_(0.0, INIT_STD, generator=generator)
        state[name] = weight if keeps_fp32(name) else weight.to(dtype)
    return state


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of its index, or ``model.safetensors``."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(
                f"{index_path} is not a safetensors index: it needs a 'weight_map' object "
                "mapping weight names to shard file names"
            )
        files = [
            directory / _confined(name, index_path) for name in dict.fromkeys(weight_map.values())
        ]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(
                f"{index_path.name} lists shard(s) missing from {directory}: {absent}"
            )
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(
        f"{directory} has no model.safetensors or model.safetensors.index.json; kvstrata reads "
        "safetensors only (re-save the model with save_pretrained(..., safe_serialization=True))"
    )


def _confined(name: str, index_path: Path) -> str:
    """``name`` if it names a file inside the checkpoint directory, else :class:`CheckpointError`.

    Checked on the name, not on the resolved path: a Hugging Face cache links its shards to blobs
    elsewhere, which is the owner's choice; an index pointing outside is not.
    """
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if (
        not name
        or posix.is_absolute()
        or windows.is_absolute()
        or windows.drive
        or ".." in posix.parts
        or ".." in windows.parts
    ):
        raise CheckpointError(
            f"{index_path.name} names shard {name!r}, which is not a file inside the checkpoint "
            "directory; shard names must be relative paths without '..'"
        )
    return name


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype; None means float32 on CPU and bfloat16 on CUDA."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype}")
    return dtype
