"""The reference model against transformers as the oracle, and the loader's and batch's errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvstrata.errors import (
    CheckpointError,
    ConfigError,
    ModelError,
    RequestError,
    UnsupportedArchitectureError,
)
from kvstrata.model import PRESETS, ForwardBatch, LlamaModel, ModelConfig, RopeScaling, load_model
from kvstrata.tiers.pool import DevicePool

transformers = pytest.importorskip("transformers")

PAGE = 16
VOCAB = 256


@dataclass(frozen=True)
class Case:
    """One transformers architecture and config to check against."""

    name: str
    model_class: str
    config: dict[str, object]


_COMMON: dict[str, object] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
}
CASES = [
    Case(  # GQA, Llama-3 RoPE scaling with a short original context so every band is used
        "llama-rope-scaled",
        "LlamaForCausalLM",
        _COMMON
        | {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    Case(  # multi-query attention with tied embeddings
        "llama-tied",
        "LlamaForCausalLM",
        _COMMON | {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True},
    ),
    Case(
        "qwen2",
        "Qwen2ForCausalLM",
        _COMMON
        | {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rope_theta": 1e6,
        },
    ),
    Case(  # head_dim is not hidden_size // num_heads
        "qwen3",
        "Qwen3ForCausalLM",
        _COMMON | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    ),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    """``(directory, transformers model)``: a saved small model with non-trivial norms and biases."""
    case: Case = request.param
    model_class = getattr(transformers, case.model_class)
    config_class = getattr(transformers, case.model_class.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    hf_model = model_class(config_class(**case.config)).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    directory = tmp_path_factory.mktemp(case.name)
    hf_model.save_pretrained(directory)
    return directory, hf_model


def _pool(config: ModelConfig, num_slots: int = 64) -> DevicePool:
    return DevicePool(config.kv_layout("float32"), page_size=PAGE, num_slots=num_slots)


def _reference_logits(hf_model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0]


def _page_tables(seq_lens: Sequence[int], num_slots: int, seed: int = 0) -> list[torch.Tensor]:
    """Disjoint, shuffled page tables: no request's pages are contiguous or in order."""
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))
    tables, used = [], 0
    for n in seq_lens:
        num_pages = -(-n // PAGE)
        tables.append(slots[used : used + num_pages])
        used += num_pages
    return tables


@pytest.mark.parametrize("length", [1, 7, 37])
def test_all_logits_match_transformers(
    checkpoint: tuple[Path, torch.nn.Module], length: int
) -> None:
    directory, hf_model = checkpoint
    config, model = load_model(directory)
    ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(length))
    batch = ForwardBatch.build([0], [length], _page_tables([length], 64), PAGE)
    logits = model(ids, batch, _pool(config), logits="all")
    torch.testing.assert_close(logits, _reference_logits(hf_model, ids), atol=1e-4, rtol=0)


def test_packed_batch_matches_transformers(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    directory, hf_model = checkpoint
    config, model = load_model(directory)
    lengths = [37, 1, 16, 7]
    prompts = [
        torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths
    ]
    pool = _pool(config)
    batch = ForwardBatch.build([0] * 4, lengths, _page_tables(lengths, 64), PAGE, num_slots=64)
    all_logits = model(torch.cat(prompts), batch, pool, logits="all")
    last_logits = model(torch.cat(prompts), batch, pool, logits="last")

    assert all_logits.shape == (sum(lengths), VOCAB)
    assert last_logits.shape == (len(lengths), VOCAB)
    for i, ids in enumerate(prompts):
        start, end = batch.cu_seqlens_host[i], batch.cu_seqlens_host[i + 1]
        reference = _reference_logits(hf_model, ids)
        torch.testing.assert_close(all_logits[start:end], reference, atol=1e-4, rtol=0)
        torch.testing.assert_close(last_logits[i], reference[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("prefix", [32, 20], ids=["page-aligned", "mid-page"])
def test_prefix_reuse_matches_one_shot(
    checkpoint: tuple[Path, torch.nn.Module], prefix: int
) -> None:
    """The rest of a prompt, computed over a prefix read back from the pool, equals one forward."""
    directory, _ = checkpoint
    config, model = load_model(directory)
    length = 53
    ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(1))
    (table,) = _page_tables([length], 64)

    one_shot_pool = _pool(config)
    one_shot = model(
        ids, ForwardBatch.build([0], [length], [table], PAGE), one_shot_pool, logits="all"
    )

    pool = _pool(config)
    model(ids[:prefix], ForwardBatch.build([0], [prefix], [table], PAGE), pool)
    # A second, uncached request in the same batch must not disturb the cached one.
    other = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(2))
    batch = ForwardBatch.build([prefix, 0], [length - prefix, 9], [table, torch.tensor([60])], PAGE)
    rest = model(torch.cat([ids[prefix:], other]), batch, pool, logits="all")

    torch.testing.assert_close(rest[: length - prefix], one_shot[prefix:], atol=1e-5, rtol=0)
    rows = batch.read_index[0]
    for name in ("k", "v"):
        for layer in range(config.num_layers):
            torch.testing.assert_close(
                pool.token_view(name, layer)[rows],
                one_shot_pool.token_view(name, layer)[rows],
                atol=1e-5,
                rtol=0,
            )


def test_sharded_checkpoint_loads_like_single_file(
    checkpoint: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    directory, _ = checkpoint
    tensors = load_file(directory / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(directory / "config.json", tmp_path / "config.json")

    _, single = load_model(directory)
    _, sharded = load_model(tmp_path)
    single_state, sharded_state = single.state_dict(), sharded.state_dict()
    assert single_state.keys() == sharded_state.keys()
    for name, tensor in single_state.items():
        assert torch.equal(tensor, sharded_state[name]), name


def test_bfloat16_load_writes_bfloat16_pool(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    directory, hf_model = checkpoint
    config, model = load_model(directory, dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    pool = DevicePool(config.kv_layout("bfloat16"), page_size=PAGE, num_slots=4)
    ids = torch.arange(20)
    logits = model(ids, ForwardBatch.build([0], [20], [torch.arange(2)], PAGE), pool, logits="all")
    reference = _reference_logits(hf_model, ids)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - reference).abs().max() < 0.05


# --- presets and configs ------------------------------------------------------------------------

LLAMA_3_2_1B_CONFIG_JSON = {  # as published, in the transformers 4.x spelling
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_llama_3_2_1b_preset_matches_published_config() -> None:
    assert ModelConfig.from_hf(LLAMA_3_2_1B_CONFIG_JSON) == PRESETS["llama-3.2-1b"]


@pytest.mark.parametrize(
    "name", sorted(n for n, c in PRESETS.items() if isinstance(c, ModelConfig))
)
def test_preset_round_trips_through_config_json(name: str) -> None:
    config = PRESETS[name]
    assert isinstance(config, ModelConfig)  # the MLA presets' are in test_mla.py
    assert ModelConfig.from_hf(config.to_hf()) == config
    layout = config.kv_layout("bfloat16")
    assert layout.num_layers == config.num_layers
    assert [(p.name, p.token_shape) for p in layout.payloads] == [
        ("k", (config.num_kv_heads, config.head_dim)),
        ("v", (config.num_kv_heads, config.head_dim)),
    ]


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-qwen3"])
def test_preset_init_is_seeded_and_sane(name: str) -> None:
    config, model = load_model(name, seed=0)
    _, same = load_model(name, seed=0)
    _, other = load_model(name, seed=1)
    assert isinstance(model, LlamaModel) and config == PRESETS[name]
    weight = model.state_dict()["layers.0.self_attn.q_proj.weight"]
    assert torch.equal(weight, same.state_dict()["layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(weight, other.state_dict()["layers.0.self_attn.q_proj.weight"])
    ids = torch.arange(40) % config.vocab_size
    logits = model(ids, ForwardBatch.build([0], [40], [torch.arange(3)], PAGE), _pool(config))
    assert logits.shape == (1, config.vocab_size)
    assert torch.isfinite(logits).all() and logits.abs().max() < 10


def test_rope_scaling_changes_the_model() -> None:
    base = PRESETS["tiny"]
    scaled = ModelConfig(
        **{**base.__dict__, "rope_scaling": RopeScaling(8.0, 1.0, 4.0, 64)},
    )
    _, model = load_model("tiny")
    scaled_model = LlamaModel.from_state_dict(scaled, model.state_dict())
    ids = torch.arange(40)
    batch = ForwardBatch.build([0], [40], [torch.arange(3)], PAGE)
    assert not torch.allclose(model(ids, batch, _pool(base)), scaled_model(ids, batch, _pool(base)))


# --- forward batch ------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
    page_size=st.integers(1, 8),
    requests=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 20)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_batch_indices_match_reference(
    page_size: int, requests: list[tuple[int, int]], seed: int
) -> None:
    seq_lens = [p + e for p, e in requests]
    num_slots = sum(-(-n // page_size) for n in seq_lens) + 3
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in seq_lens:
        pages = -(-n // page_size) + (seed % 2)  # tables may be longer than needed
        tables.append(slots[used : used + pages])
        used += pages
    batch = ForwardBatch.build(
        [p for p, _ in requests], [e for _, e in requests], tables, page_size, num_slots=num_slots
    )

    def row(table: list[int], t: int) -> int:
        return table[t // page_size] * page_size + t % page_size

    positions = [t for p, e in requests for t in range(p, p + e)]
    write = [
        row(tab, t) for (p, e), tab in zip(requests, tables, strict=True) for t in range(p, p + e)
    ]
    assert batch.positions.tolist() == positions
    assert batch.write_index.tolist() == write
    assert batch.num_tokens == len(positions)
    for i, ((p, e), tab) in enumerate(zip(requests, tables, strict=True)):
        assert batch.read_index[i].tolist() == [row(tab, t) for t in range(p + e)]
        assert (
            batch.last_index[i]
            == batch.cu_seqlens[i + 1] - 1
            == sum(x for _, x in requests[: i + 1]) - 1
        )


def test_batch_rejects_short_page_table_naming_the_request() -> None:
    with pytest.raises(RequestError, match=r"request 1: .*need 3 pages of 16.*holds 2"):
        ForwardBatch.build([0, 16], [5, 20], [[0], [1, 2]], PAGE)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([0], [0], [[0]], PAGE), RequestError, "extend length must be >= 1"),
        (([-1], [3], [[0]], PAGE), RequestError, "prefix length must be >= 0"),
        (([0, 0], [3], [[0]], PAGE), ConfigError, "one prefix length"),
        (([], [], [], PAGE), ConfigError, "at least one request"),
        (([0], [3], [[0]], 0), ConfigError, "page_size"),
        (([0], [3], [[[0]]], PAGE), RequestError, "1-D"),
    ],
)
def test_batch_rejects_bad_input(args: tuple, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ForwardBatch.build(*args)


def test_batch_rejects_slot_outside_pool() -> None:
    with pytest.raises(RequestError, match=r"request 0: .*\[0, 4\)"):
        ForwardBatch.build([0], [3], [[4]], PAGE, num_slots=4)


# --- forward errors -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, LlamaModel]:
    return load_model("tiny")


def test_forward_rejects_token_outside_vocab(tiny: tuple[ModelConfig, LlamaModel]) -> None:
    config, model = tiny
    batch = ForwardBatch.build([0, 0], [2, 2], [[0], [1]], PAGE)
    ids = torch.tensor([1, 2, 3, config.vocab_size])
    with pytest.raises(RequestError, match="request 1: token id 512"):
        model(ids, batch, _pool(config))


def test_forward_rejects_sequence_past_max_positions(tiny: tuple[ModelConfig, LlamaModel]) -> None:
    config, model = tiny
    n = config.max_position_embeddings + 1
    batch = ForwardBatch.build([n - 1], [1], [torch.arange(-(-n // PAGE))], PAGE)
    with pytest.raises(RequestError, match="max_position_embeddings"):
        model(torch.tensor([1]), batch, _pool(config, num_slots=-(-n // PAGE)))


@pytest.mark.parametrize(
    ("pool_fn", "match"),
    [
        (lambda c: DevicePool(c.kv_layout("bfloat16"), PAGE, 4), "give the pool the model's dtype"),
        (lambda c: DevicePool(PRESETS["tiny-qwen3"].kv_layout("float32"), 8, 4), "page_size"),
        (
            lambda c: DevicePool(
                ModelConfig(**{**c.__dict__, "num_kv_heads": 4}).kv_layout("float32"), PAGE, 4
            ),
            "token shape",
        ),
    ],
)
def test_forward_rejects_mismatched_pool(
    tiny: tuple[ModelConfig, LlamaModel], pool_fn: Callable[[ModelConfig], DevicePool], match: str
) -> None:
    config, model = tiny
    batch = ForwardBatch.build([0], [3], [[0]], PAGE)
    with pytest.raises(ConfigError, match=match):
        model(torch.tensor([1, 2, 3]), batch, pool_fn(config))


def test_forward_rejects_wrong_token_count(tiny: tuple[ModelConfig, LlamaModel]) -> None:
    config, model = tiny
    batch = ForwardBatch.build([0], [3], [[0]], PAGE)
    with pytest.raises(ConfigError, match="3 packed tokens"):
        model(torch.tensor([1, 2]), batch, _pool(config))


# --- config errors ------------------------------------------------------------------------------


def test_config_rejects_heads_not_divisible_by_kv_heads() -> None:
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        ModelConfig(**{**PRESETS["tiny"].__dict__, "num_kv_heads": 3})


def test_config_rejects_unknown_architecture() -> None:
    with pytest.raises(ConfigError, match="llama, qwen2, qwen3"):
        ModelConfig(**{**PRESETS["tiny"].__dict__, "architecture": "mistral"})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"architectures": ["MistralForCausalLM"]},
            "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_from_hf_refuses_unsupported_options(change: dict, match: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=match):
        ModelConfig.from_hf(LLAMA_3_2_1B_CONFIG_JSON | change)


def test_from_hf_names_a_missing_field() -> None:
    hf = {k: v for k, v in LLAMA_3_2_1B_CONFIG_JSON.items() if k != "hidden_size"}
    with pytest.raises(CheckpointError, match="hidden_size"):
        ModelConfig.from_hf(hf)


# --- loader errors ------------------------------------------------------------------------------


def _edit_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    case = CASES[0]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**case.config))
    directory = tmp_path_factory.mktemp("llama-errors")
    model.save_pretrained(directory)
    return directory


def test_load_rejects_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model(tmp_path)


def test_load_rejects_directory_without_weights(llama_checkpoint: Path, tmp_path: Path) -> None:
    shutil.copy(llama_checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_model(tmp_path)


def test_load_rejects_unsupported_architecture(llama_checkpoint: Path, tmp_path: Path) -> None:
    hf = json.loads((llama_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path)


def test_load_rejects_weight_of_wrong_shape(llama_checkpoint: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"

    def widen(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = torch.zeros(64, 64)

    _edit_checkpoint(llama_checkpoint, tmp_path, widen)
    with pytest.raises(CheckpointError, match=rf"{name} .* shape \(64, 64\).*implies \(32, 64\)"):
        load_model(tmp_path)


def test_load_rejects_missing_weight(llama_checkpoint: Path, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    _edit_checkpoint(llama_checkpoint, tmp_path, lambda t: t.__delitem__(name))
    with pytest.raises(CheckpointError, match=rf"lacks 1 weight.*{name}"):
        load_model(tmp_path)


def test_load_rejects_unexpected_weight(llama_checkpoint: Path, tmp_path: Path) -> None:
    def add_bias(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    _edit_checkpoint(llama_checkpoint, tmp_path, add_bias)
    with pytest.raises(CheckpointError, match=r"does not use, first .*q_proj\.bias"):
        load_model(tmp_path)


def test_load_rejects_index_naming_a_missing_shard(llama_checkpoint: Path, tmp_path: Path) -> None:
    shutil.copy(llama_checkpoint / "config.json", tmp_path / "config.json")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00001-of-00001.safetensors"):
        load_model(tmp_path)


def test_load_rejects_corrupt_weights(llama_checkpoint: Path, tmp_path: Path) -> None:
    shutil.copy(llama_checkpoint / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read weights"):
        load_model(tmp_path)


def test_load_rejects_unknown_preset() -> None:
    with pytest.raises(
        ConfigError, match="neither a checkpoint directory nor a preset; presets: tiny"
    ):
        load_model("tiny-mistral")


def test_load_rejects_unknown_dtype() -> None:
    with pytest.raises(ConfigError, match="dtype must be one of float32, bfloat16, float16"):
        load_model("tiny", dtype="float8")


# --- hostile config.json and index files ------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
CONFIG_KEYS = sorted(
    set(LLAMA_3_2_1B_CONFIG_JSON)
    | {"head_dim", "num_key_value_heads", "rope_parameters", "rope_theta", "rms_norm_eps"}
)


@given(key=st.sampled_from(CONFIG_KEYS), value=JSON_VALUES)
@settings(max_examples=300, deadline=None)
def test_from_hf_any_field_value_is_a_config_or_a_typed_error(key: str, value: object) -> None:
    """Whatever JSON a field holds, reading config.json gives a config or a kvstrata error
    (never a TypeError, ValueError or ZeroDivisionError from deep inside)."""
    hf = LLAMA_3_2_1B_CONFIG_JSON | {key: value}
    try:
        config = ModelConfig.from_hf(hf)
    except (ModelError, ConfigError):
        return
    assert isinstance(config, ModelConfig)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_attention_heads": "32"}, "num_attention_heads must be an integer >= 1, got '32'"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a finite number > 0"),
        ({"rope_theta": [1]}, "rope_theta must be a finite number > 0"),
        ({"rope_scaling": 5}, "rope_parameters / rope_scaling must be an object"),
        ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of names"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be an integer >= 1"),
    ],
)
def test_from_hf_names_the_field_of_the_wrong_type(change: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        ModelConfig.from_hf(LLAMA_3_2_1B_CONFIG_JSON | change)


def test_loader_names_config_json_for_an_invalid_model(
    llama_checkpoint: Path, tmp_path: Path
) -> None:
    hf = json.loads((llama_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"num_key_value_heads": 3}))
    with pytest.raises(CheckpointError, match=r"config\.json: num_heads \(4\) must be a multiple"):
        load_model(tmp_path)


def _index_checkpoint(src: Path, dst: Path, index: object) -> Path:
    shutil.copy(src / "config.json", dst / "config.json")
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    text = index if isinstance(index, str) else json.dumps(index)
    (dst / "model.safetensors.index.json").write_text(text)
    return dst


@pytest.mark.parametrize(
    "index",
    [
        "{not json",
        "[" * 100_000 + "]" * 100_000,
        [1, 2],
        {"weight_map": ["model.safetensors"]},
        {"weight_map": {"model.norm.weight": 5}},
        {"weight_map": {"model.norm.weight": None}},
        {"metadata": {}},
    ],
    ids=["not-json", "nested", "list", "map-list", "int-file", "null-file", "no-map"],
)
def test_loader_refuses_malformed_index(
    llama_checkpoint: Path, tmp_path: Path, index: object
) -> None:
    _index_checkpoint(llama_checkpoint, tmp_path, index)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "shard",
    ["../model.safetensors", "sub/../../model.safetensors", "/etc/passwd", "C:\\x.safetensors", ""],
)
def test_loader_refuses_shards_outside_the_checkpoint(
    llama_checkpoint: Path, tmp_path: Path, shard: str
) -> None:
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(llama_checkpoint / "model.safetensors", tmp_path / "model.safetensors")
    _index_checkpoint(llama_checkpoint, inner, {"weight_map": {"model.norm.weight": shard}})
    with pytest.raises(CheckpointError, match="not a file inside the checkpoint directory"):
        load_model(inner)


def test_loader_accepts_shards_in_a_subdirectory(llama_checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    shutil.copy(llama_checkpoint / "config.json", tmp_path / "config.json")
    shutil.copy(llama_checkpoint / "model.safetensors", tmp_path / "shards" / "all.safetensors")
    names = load_file(llama_checkpoint / "model.safetensors")
    index = {"weight_map": dict.fromkeys(names, "shards/all.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    config, _ = load_model(tmp_path)
    assert config.architecture == "llama"


def test_empty_model_name_is_not_the_working_directory() -> None:
    with pytest.raises(ConfigError, match="'' is neither a checkpoint directory nor a preset"):
        load_model("")


def test_read_index_is_built_only_when_a_forward_reads_the_prefix() -> None:
    """The synthetic forward reads one row per request, so a step's index work grows with the
    tokens it computes, not with the requests' contexts: a 100,000-token prefix costs nothing
    until something asks for its rows."""
    from kvstrata.model.batch import ReadRows
    from kvstrata.model.compute import SyntheticCompute

    P = 16
    prefix, extend = 100_000, 7
    table = np.arange(-(-(prefix + extend) // P), dtype=np.int64)
    batch = ForwardBatch.build([prefix, 0], [extend, 5], [table, np.array([7000])], P)
    compute = SyntheticCompute(4, 100)
    pool = DevicePool(compute.layout, P, 7001, "cpu")
    compute.forward(torch.arange(extend + 5) % 100, batch, pool)
    assert isinstance(batch.read_index, ReadRows) and not batch.read_index.built
    assert batch.prefix_last_row is not None
    assert batch.prefix_last_row.tolist() == [prefix - 1, -1]
    rows = batch.read_index
    assert rows[0].tolist() == list(range(prefix + extend))
    assert rows[1].tolist() == list(range(7000 * P, 7000 * P + 5))
    assert batch.read_index.built and len(rows) == 2  # built on first use
