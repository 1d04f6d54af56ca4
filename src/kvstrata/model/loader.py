"""Build a :class:`LlamaModel` from a Hugging Face checkpoint directory or from a preset.

A checkpoint directory holds ``config.json`` and the weights as ``model.safetensors`` or as shards
listed by ``model.safetensors.index.json``; it is read with ``safetensors`` alone (no transformers).
Our parameter names are transformers' without the ``model.`` prefix (:func:`convert_hf_state`).

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
from .config import PRESETS, ModelConfig
from .llama import LlamaModel

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
) -> tuple[ModelConfig, LlamaModel]:
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
    return config, LlamaModel.from_state_dict(config, state)


def read_model_config(path_or_preset: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint directory (its ``config.json`` only, no weights)
    or of a preset: what a caller needs to size pools and workloads before loading weights."""
    if _is_checkpoint(path_or_preset):
        return _read_config(Path(path_or_preset))
    if str(path_or_preset) in PRESETS:
        return PRESETS[str(path_or_preset)]
    raise ConfigError(
        f"{str(path_or_preset)!r} is neither a checkpoint directory nor a preset; "
        f"presets: {', '.join(PRESETS)}"
    )


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the weights of ``config`` take in ``dtype``."""
    numel = sum(math.prod(shape) for shape in hf_weight_shapes(config).values())
    return numel * dtype.itemsize


def _is_checkpoint(path_or_preset: str | os.PathLike[str]) -> bool:
    # An empty string is Path("."), which exists: never take the working directory by accident.
    return str(path_or_preset) != "" and Path(path_or_preset).exists()


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a transformers checkpoint of ``config`` holds, by name, with its shape."""
    hidden, q_size = config.hidden_size, config.num_heads * config.head_dim
    kv_size, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q_size, hidden),
            layer + "self_attn.k_proj.weight": (kv_size, hidden),
            layer + "self_attn.v_proj.weight": (kv_size, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_size),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
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


def convert_hf_state(
    config: ModelConfig, hf_state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rename transformers weights to :class:`LlamaModel` names (``model.`` prefix dropped).

    Only the weights ``config`` implies are taken: ``lm_head.weight`` of a tied model is skipped.
    """
    return {name.removeprefix("model."): hf_state[name] for name in hf_weight_shapes(config)}


def read_checkpoint(
    directory: Path, device: torch.device, dtype: torch.dtype
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read ``config.json`` and every weight (transformers names) of a checkpoint directory.

    Shapes are checked against the config before any tensor is read; weights land on ``device``
    in ``dtype``.
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
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
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
    ]
    if unexpected:
        raise CheckpointError(
            f"{directory} holds {len(unexpected)} weight(s) this {config.architecture} config "
            f"does not use, first {unexpected[0]}; the weights and config.json disagree"
        )
    return config, state


def _read_config(directory: Path) -> ModelConfig:
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
        return ModelConfig.from_hf(hf_config)
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
    config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Seeded random weights (:class:`LlamaModel` names): norms one, everything else N(0, 0.02²).

    Drawn in fp32 and then cast, so one seed gives the same weights in every dtype of a device.
    Each parameter is drawn from its own stream (the seed and a CRC-32 of its name), so models that
    differ only in depth share the weights they have in common (``tiny-draft`` is ``tiny``'s
    first layer).
    """
    generator = torch.Generator(device=device)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in LlamaModel(config).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weight = torch.ones(shape, device=device)
        else:
            generator.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
            weight = torch.empty(shape, device=device).normal_(0.0, INIT_STD, generator=generator)
        state[name] = weight.to(dtype)
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
