"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.check_model import _write_preset_checkpoint
from kvstrata.model.config import PRESETS

#: The weight a poisoned checkpoint carries a NaN in (every forward reads it).
POISONED_WEIGHT = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset saved as a Hugging Face checkpoint (config.json + model.safetensors)."""
    path = tmp_path_factory.mktemp("tiny") / "checkpoint"
    _write_preset_checkpoint(PRESETS["tiny"], path, seed=0)
    return path


@pytest.fixture(scope="session")
def nan_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_checkpoint`` with one NaN in :data:`POISONED_WEIGHT`."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("nan") / "checkpoint"
    path.mkdir()
    (path / "config.json").write_bytes((tiny_checkpoint / "config.json").read_bytes())
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    tensors[POISONED_WEIGHT][0, 0] = torch.nan
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path
