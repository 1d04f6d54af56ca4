"""The cache names a model by its weights: another seed, another checkpoint behind the same
relative path, or a checkpoint rewritten in place never shares a disk namespace or a handoff
fingerprint with the first (issue 19, 1a)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstrata.engine import EngineConfig
from kvstrata.errors import CheckpointError, ConfigError
from kvstrata.model import identity
from kvstrata.model.config import PRESETS
from kvstrata.model.identity import checkpoint_digest, weights_id
from kvstrata.replay import ReplayConfig, model_id, run_replay


def _checkpoint(path: Path, seed: int, rows: int = 64) -> Path:
    """A checkpoint-shaped directory: config.json and a model.safetensors of seeded tensors."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf()))
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": torch.randn(rows, 256, generator=gen),
        "model.norm.weight": torch.ones(256),
    }
    save_file(tensors, path / "model.safetensors")
    return path


def test_a_preset_is_named_by_its_seed_and_device_type() -> None:
    assert weights_id("tiny", 0, "cpu") == weights_id("tiny", 0, "cpu")
    assert weights_id("tiny", 0, "cpu") != weights_id("tiny", 1, "cpu")
    assert weights_id("tiny", 0, "cpu") != weights_id("tiny", 0, "cuda")
    assert weights_id("tiny", 0, "cpu", "tiny-draft") != weights_id("tiny", 0, "cpu")
    with pytest.raises(ConfigError):
        weights_id("no-such-preset", 0, "cpu")


def test_the_same_relative_path_in_two_directories_names_two_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _checkpoint(tmp_path / "a" / "ckpt", seed=0)
    _checkpoint(tmp_path / "b" / "ckpt", seed=1)
    monkeypatch.chdir(tmp_path / "a")
    in_a = weights_id("ckpt", 0, "cpu")
    monkeypatch.chdir(tmp_path / "b")
    in_b = weights_id("ckpt", 0, "cpu")
    assert in_a != in_b
    # The seed does not change a checkpoint's weights.
    assert weights_id("ckpt", 0, "cpu") == weights_id("ckpt", 5, "cpu")


def test_a_checkpoint_rewritten_in_place_gets_a_new_id(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "ckpt", seed=0, rows=2048)  # 2 MiB: sampled, not whole
    before = weights_id(path, 0, "cpu")
    _checkpoint(path, seed=1, rows=2048)  # a fine-tune saved over it: same names and shapes
    assert weights_id(path, 0, "cpu") != before
    identity._DIGESTS.clear()  # a fresh process computes it from the files alone
    assert weights_id(path, 0, "cpu") != before


def test_one_retrained_tensor_changes_the_digest(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _checkpoint(tmp_path / "ckpt", seed=0, rows=2048)
    before = checkpoint_digest(path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5
    save_file(tensors, path / "model.safetensors")
    identity._DIGESTS.clear()
    assert checkpoint_digest(path) != before


def test_the_handoff_fingerprint_carries_the_weights(tmp_path: Path) -> None:
    from kvstrata.handoff import layout_fingerprint

    layout = PRESETS["tiny"].kv_layout("float32")
    ids = [model_id(_replay(tmp_path, seed, "clear")) for seed in (0, 1)]
    assert layout_fingerprint(ids[0], layout, 16) != layout_fingerprint(ids[1], layout, 16)


def test_a_file_that_is_not_safetensors_is_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "ckpt", seed=0)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        checkpoint_digest(path)


def _replay(root: Path, seed: int, start: str) -> ReplayConfig:
    return ReplayConfig(
        model="tiny",
        seed=seed,
        verify=8,
        engine=EngineConfig(
            page_size=16,
            pool_tokens=1024,
            l2_tokens=2048,
            l3_dir=str(root),
            l3_gib=0.05,
            l3_start=start,  # type: ignore[arg-type]
        ),
    )


@pytest.mark.slow
def test_another_seed_never_hits_the_first_seeds_disk_pages(tmp_path: Path) -> None:
    """The issue's repro: seed 0 fills L3; seed 1 started with ``load`` must find none of those
    pages (its L3 hits are only the pages it spilled itself), while seed 0 again does."""
    root = tmp_path / "l3"
    assert model_id(_replay(root, 0, "clear")) != model_id(_replay(root, 1, "clear"))
    first = run_replay(_replay(root, 0, "clear"), progress=False).to_json()
    assert first["tiers"]["l3"]["pages_written"] > 0
    other = run_replay(_replay(root, 1, "load"), progress=False)
    disk = other.to_json()["tiers"]["l3"]
    assert disk["load_pages"] == 0 and disk["pages_present"] == 0
    assert other.to_json()["hit_tokens_by_tier"] == first["hit_tokens_by_tier"]
    assert other.verify.ok
    same = run_replay(_replay(root, 0, "load"), progress=False).to_json()
    assert same["tiers"]["l3"]["load_pages"] > 0
    assert same["hit_tokens_by_tier"]["l3"] > first["hit_tokens_by_tier"]["l3"]
