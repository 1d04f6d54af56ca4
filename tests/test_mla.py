"""MLA models (DeepSeek-V2 / V3) against transformers as the oracle; the latent as the payload; the
absorbed attention against the naive form; configs, loader and attention backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvstrata.cli import main
from kvstrata.errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from kvstrata.model import (
    PRESETS,
    DeepseekConfig,
    DeepseekModel,
    ForwardBatch,
    MoEConfig,
    config_from_hf,
    convert_hf_state,
    load_model,
)
from kvstrata.model.attention import PagedAttention
from kvstrata.model.loader import build_model
from kvstrata.model.moe import grouped_matmul, per_expert_matmul
from kvstrata.tiers.pool import DevicePool

transformers = pytest.importorskip("transformers")

PAGE = 16
VOCAB = 256

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 24,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}


def _yarn(factor: float, original: int, **extra: float) -> dict[str, Any]:
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": factor,
        "original_max_position_embeddings": original,
        **extra,
    }


#: (name, transformers class, config): dense and MoE layers, with and without low-rank queries,
#: every gating, YaRN with and without a cos/sin factor, both RoPE layouts of V3.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("v2-dense", "DeepseekV2", _COMMON | {"q_lora_rank": None, "first_k_dense_replace": 3}),
    ("v2-greedy", "DeepseekV2", _COMMON | {"q_lora_rank": None}),
    (
        "v2-group-limited-yarn-qlora",
        "DeepseekV2",
        _COMMON
        | {
            "q_lora_rank": 24,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "rope_parameters": _yarn(8.0, 32, mscale=0.707, mscale_all_dim=0.707),
        },
    ),
    (
        "v3-noaux-qlora",
        "DeepseekV3",
        _COMMON | {"q_lora_rank": 24, "n_group": 4, "topk_group": 2, "tie_word_embeddings": True},
    ),
    (
        "v3-yarn-not-interleaved",
        "DeepseekV3",
        _COMMON
        | {
            "q_lora_rank": None,
            "n_group": 2,
            "topk_group": 1,
            "rope_interleave": False,
            # mscale without mscale_all_dim: cos and sin carry a factor of 1.208
            "rope_parameters": _yarn(8.0, 32, mscale=1.0),
            "routed_scaling_factor": 2.5,
        },
    ),
]


def _hf_model(kind: str, config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """A random transformers model whose norms, router biases and routers are far from their
    init (so a mix-up of any of them shows in the logits)."""
    model_class = getattr(transformers, f"{kind}ForCausalLM")
    config_class = getattr(transformers, f"{kind}Config")
    torch.manual_seed(seed)
    model = model_class(config_class(**config)).eval()
    model.set_experts_implementation("eager")  # its reference loop: grouped_mm needs aligned rows
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    name, kind, config = request.param
    hf_model = _hf_model(kind, config)
    directory = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(directory)
    return directory, hf_model


def _pool(config: DeepseekConfig | Any, num_slots: int = 64) -> DevicePool:
    return DevicePool(config.kv_layout("float32"), page_size=PAGE, num_slots=num_slots)


def _reference(hf_model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0]


def _tables(lengths: list[int], num_slots: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """Disjoint, shuffled page tables."""
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))
    out, used = [], 0
    for n in lengths:
        pages = -(-n // PAGE)
        out.append(slots[used : used + pages])
        used += pages
    return out


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# -- the oracle ----------------------------------------------------------------------------------


def test_checkpoint_logits_match_transformers(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    """A packed batch of four prompts, then one of them continued over its prefix read back from
    shuffled pages: every token's fp32 logits within 1e-4 of transformers'."""
    directory, hf_model = checkpoint
    config, model = load_model(directory)
    assert isinstance(model, DeepseekModel) and isinstance(config, DeepseekConfig)
    lengths = [37, 1, 16, 7]
    prompts = [_ids(n, n) for n in lengths]
    tables = _tables(lengths)
    pool = _pool(config)
    batch = ForwardBatch.build([0] * 4, lengths, tables, PAGE, num_slots=64)
    logits = model(torch.cat(prompts), batch, pool, logits="all")
    for i, ids in enumerate(prompts):
        lo, hi = batch.cu_seqlens_host[i], batch.cu_seqlens_host[i + 1]
        torch.testing.assert_close(logits[lo:hi], _reference(hf_model, ids), atol=1e-4, rtol=0)
    # The 37-token prompt, extended by 29 tokens over its 37 cached ones (a partial last page).
    more = torch.cat([prompts[0], _ids(29, 99)])
    extend = ForwardBatch.build([37], [29], [torch.cat([tables[0], torch.tensor([60, 61])])], PAGE)
    rest = model(more[37:], extend, pool, logits="all")
    torch.testing.assert_close(rest, _reference(hf_model, more)[37:], atol=1e-4, rtol=0)


def test_check_model_says_ok_on_the_checkpoint(
    checkpoint: tuple[Path, torch.nn.Module], capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _ = checkpoint
    assert main(["check-model", str(directory), "--json", "--atol", "1e-4"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] and report["architecture"].startswith("deepseek_v")


@st.composite
def _held_out_config(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A small DeepSeek config of shapes no oracle case names."""
    kind = draw(st.sampled_from(["DeepseekV2", "DeepseekV3"]))
    heads = draw(st.integers(1, 5))
    groups = draw(st.sampled_from([1, 2, 4]))
    experts = groups * draw(st.integers(2, 3))
    topk_group = draw(st.integers(1, groups))
    config: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": heads * draw(st.sampled_from([8, 12, 16])),
        "intermediate_size": draw(st.integers(8, 48)),
        "moe_intermediate_size": draw(st.integers(3, 24)),  # odd widths: no grouped_mm
        "num_hidden_layers": draw(st.integers(1, 3)),
        "num_attention_heads": heads,
        # transformers' V2 RoPE views pairs as complex numbers: it needs even strides there.
        "kv_lora_rank": draw(st.integers(2, 20)) * (2 if kind == "DeepseekV2" else 1) + 2,
        "qk_nope_head_dim": draw(st.integers(1, 12)) * (2 if kind == "DeepseekV2" else 1),
        "qk_rope_head_dim": 2 * draw(st.integers(1, 10)),
        "v_head_dim": draw(st.integers(1, 24)),
        "q_lora_rank": draw(st.one_of(st.none(), st.integers(4, 32))),
        "n_routed_experts": experts,
        "n_shared_experts": draw(st.integers(1, 2)),
        "num_experts_per_tok": draw(st.integers(1, topk_group * (experts // groups))),
        "first_k_dense_replace": draw(st.integers(0, 2)),
        "max_position_embeddings": 256,
    }
    if draw(st.booleans()):
        config["rope_parameters"] = _yarn(
            draw(st.sampled_from([2.0, 16.0])), 32, mscale=1.0, mscale_all_dim=0.707
        )
    if kind == "DeepseekV3":
        config |= {"n_group": groups, "topk_group": topk_group}
        config["rope_interleave"] = draw(st.booleans())
    elif groups > 1:
        config |= {"topk_method": "group_limited_greedy", "n_group": groups}
        config["topk_group"] = topk_group
    if kind == "DeepseekV3" and experts // groups < 2:
        config |= {"n_group": 1, "topk_group": 1}
    return kind, config


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_held_out_config(), seed=st.integers(0, 2**16))
def test_held_out_shapes_match_transformers(case: tuple[str, dict[str, Any]], seed: int) -> None:
    """Random small shapes (odd head sizes, one head, every layer MoE or none, V2 and V3):
    transformers' in-memory weights (its stacked experts) in kvstrata give its logits, over a
    cached prefix too."""
    kind, hf_config = case
    hf_model = _hf_model(kind, hf_config, seed)
    config = config_from_hf(hf_model.config.to_dict() | {"architectures": [f"{kind}ForCausalLM"]})
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    model = build_model(config, convert_hf_state(config, state))
    ids = _ids(45, seed)
    (table,) = _tables([45], seed=seed)
    pool = _pool(config)
    first = model(ids[:21], ForwardBatch.build([0], [21], [table], PAGE), pool, logits="all")
    rest = model(ids[21:], ForwardBatch.build([21], [24], [table], PAGE), pool, logits="all")
    reference = _reference(hf_model, ids)
    torch.testing.assert_close(torch.cat([first, rest]), reference, atol=1e-4, rtol=0)


# -- the latent and the absorbed form ------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-moe", "deepseek-v2-lite"])
def test_the_cache_holds_one_latent_per_token_and_layer(name: str) -> None:
    config = PRESETS[name]
    assert isinstance(config, DeepseekConfig)
    layout = config.kv_layout("bfloat16")
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert [(p.name, p.token_shape) for p in layout.payloads] == [("kv_latent", (width,))]
    assert layout.page_bytes(1) == config.num_layers * width * 2
    if name == "deepseek-v2-lite":
        assert width == 576 and layout.page_bytes(1) == 31_104  # 30.4 KiB a token


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-moe"])
def test_absorbed_attention_equals_the_expanded_form(name: str) -> None:
    """Over a cached prefix and a fresh request in one batch: the same logits and the same
    latent bytes in the pool, whether the up-projections are absorbed or K/V expanded."""
    config, model = load_model(name)
    assert isinstance(model, DeepseekModel)
    ids, other = _ids(53, 1), _ids(9, 2)
    table, fresh = _tables([53, 9])
    out, pools = {}, {}
    for form in ("absorbed", "expanded"):
        model.use_mla_form(form)
        pool = pools[form] = _pool(config)
        model(ids[:20], ForwardBatch.build([0], [20], [table], PAGE), pool)
        batch = ForwardBatch.build([20, 0], [33, 9], [table, fresh], PAGE)
        out[form] = model(torch.cat([ids[20:], other]), batch, pool, logits="all")
    model.use_mla_form("auto")
    torch.testing.assert_close(out["absorbed"], out["expanded"], atol=1e-5, rtol=0)
    # Layer 0's latents are computed before any attention: bit for bit the same.
    a, b = pools["absorbed"], pools["expanded"]
    assert torch.equal(a.buffer("kv_latent", 0), b.buffer("kv_latent", 0))
    for layer in range(1, config.num_layers):
        torch.testing.assert_close(
            a.buffer("kv_latent", layer), b.buffer("kv_latent", layer), atol=1e-5, rtol=0
        )


def test_auto_form_expands_long_extends_and_absorbs_short_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tiny-mla (rank 64, nope 32, v 32): expanding a key costs 4096 multiply-adds per head,
    absorbing costs 64 more per (query, key) pair, so a fresh 200-token prefill expands and 8
    tokens over a 1000-token prefix attend the latent."""
    from kvstrata.model.mla import MLAttention

    config, model = load_model("tiny-mla")
    seen: list[str] = []
    real = MLAttention._form

    def recorded(self: MLAttention, batch: ForwardBatch) -> str:
        seen.append(real(self, batch))
        return seen[-1]

    monkeypatch.setattr(MLAttention, "_form", recorded)
    pool = _pool(config)
    model(_ids(200, 0) % 512, ForwardBatch.build([0], [200], [torch.arange(13)], PAGE), pool)
    model(_ids(8, 1), ForwardBatch.build([1000], [8], [torch.arange(64)], PAGE), pool)
    assert seen == ["expanded"] * 2 + ["absorbed"] * 2


def test_absorbed_attention_differs_when_a_latent_is_wrong() -> None:
    """The oracle can fail: one cached latent row changed changes the logits."""
    config, model = load_model("tiny-mla")
    ids = _ids(40, 3)
    (table,) = _tables([40])
    pool = _pool(config)
    model(ids[:32], ForwardBatch.build([0], [32], [table], PAGE), pool)
    batch = ForwardBatch.build([32], [8], [table], PAGE)
    good = model(ids[32:], batch, pool, logits="all")
    pool.token_view("kv_latent", 1)[batch.read_index[0][5]] += 1.0
    assert not torch.allclose(model(ids[32:], batch, pool, logits="all"), good, atol=1e-3)


def test_sdpa_latent_path_gathers_the_latent_not_kv() -> None:
    """The paged SDPA path reads one latent buffer per layer and returns value-width outputs."""
    gen = torch.Generator().manual_seed(0)
    batch = ForwardBatch.build([5, 0], [3, 4], [[2, 0], [1]], 4)
    pages = torch.randn(3, 4, 24, generator=gen)
    latent = torch.randn(batch.num_tokens, 24, generator=gen)
    pages.view(-1, 24).index_copy_(0, batch.write_index, latent)
    q = torch.randn(batch.num_tokens, 3, 24, generator=gen)
    out = PagedAttention("sdpa").latent(q, latent, pages, batch, value_dim=16, scale=0.3)
    assert out.shape == (batch.num_tokens, 3, 16)
    # Request 0: its 8 keys, in float64 by hand.
    keys = pages.view(-1, 24)[batch.read_index[0]].double()
    scores = torch.einsum("qhd,kd->hqk", q[:3].double(), keys) * 0.3
    visible = torch.arange(8)[None, :] <= (5 + torch.arange(3))[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    expected = torch.einsum("hqk,kd->qhd", probs, keys[:, :16])
    torch.testing.assert_close(out[:3].double(), expected, atol=1e-6, rtol=0)


def test_grouped_and_per_expert_matmuls_agree() -> None:
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    rows = torch.randn(9, 12, generator=gen)
    weight = torch.randn(4, 7, 12, generator=gen)
    grouped = grouped_matmul(rows, weight, counts)
    torch.testing.assert_close(grouped, per_expert_matmul(rows, weight, counts))
    torch.testing.assert_close(grouped[3:8], rows[3:8] @ weight[2].T)
    # Rows of 7 fp32 values (28 bytes): grouped_mm refuses them, the experts run one by one.
    from kvstrata.model.moe import Experts

    torch.testing.assert_close(Experts._grouped(rows, weight, counts), grouped)
    odd = torch.randn(4, 12, 7, generator=gen)
    torch.testing.assert_close(
        Experts._grouped(grouped, odd, counts), per_expert_matmul(grouped, odd, counts)
    )


def test_router_and_its_bias_stay_fp32_in_bfloat16(tmp_path: Path) -> None:
    _, model = load_model("tiny-moe", dtype="bfloat16")
    state = model.state_dict()
    assert state["layers.1.mlp.gate.weight"].dtype == torch.float32
    assert state["layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert state["layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert model.dtype == torch.bfloat16


# -- configs -------------------------------------------------------------------------------------

#: deepseek-ai/DeepSeek-V2-Lite's config.json (transformers 4.x spelling).
V2_LITE_CONFIG_JSON: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 102400,
}


def test_deepseek_v2_lite_preset_matches_its_config_json() -> None:
    assert config_from_hf(V2_LITE_CONFIG_JSON) == PRESETS["deepseek-v2-lite"]


@pytest.mark.parametrize(
    "name", sorted(n for n, c in PRESETS.items() if isinstance(c, DeepseekConfig))
)
def test_mla_preset_round_trips_through_config_json(name: str) -> None:
    config = PRESETS[name]
    assert config_from_hf(config.to_hf()) == config
    # ... and transformers reads the same fields: its config builds the same model shapes.
    hf = config.to_hf()
    hf_config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    assert hf_config.kv_lora_rank + hf_config.qk_rope_head_dim == config.latent_dim


def test_mla_preset_weights_are_seeded_and_the_draft_is_the_first_layer() -> None:
    _, model = load_model("tiny-mla", seed=3)
    _, draft = load_model("tiny-mla-draft", seed=3)
    _, other = load_model("tiny-mla", seed=4)
    ours, theirs = model.state_dict(), draft.state_dict()
    assert set(theirs) < set(ours) and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    name = "layers.0.self_attn.kv_b_proj.weight"
    assert not torch.equal(ours[name], other.state_dict()[name])


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"hidden_act": "gelu"}, UnsupportedArchitectureError, "hidden_act"),
        ({"norm_topk_prob": True}, UnsupportedArchitectureError, "norm_topk_prob"),
        ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedArchitectureError, "quantis"),
        ({"moe_layer_freq": 2}, UnsupportedArchitectureError, "moe_layer_freq"),
        ({"topk_method": "noaux_tc"}, UnsupportedArchitectureError, "topk_method"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, UnsupportedArchitectureError, "rope"),
        ({"attention_bias": True}, UnsupportedArchitectureError, "attention_bias"),
        ({"num_experts_per_tok": None}, CheckpointError, "num_experts_per_tok"),
        ({"kv_lora_rank": "512"}, CheckpointError, "kv_lora_rank"),
        ({"num_experts_per_tok": 65}, ConfigError, "num_experts_per_tok"),
        ({"n_routed_experts": 0}, CheckpointError, "n_routed_experts"),
    ],
)
def test_from_hf_refuses_what_it_cannot_run(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        config_from_hf(V2_LITE_CONFIG_JSON | change)


def test_from_hf_reads_null_q_lora_rank_as_none_and_absent_as_the_default() -> None:
    assert config_from_hf(V2_LITE_CONFIG_JSON).q_lora_rank is None
    absent = {k: v for k, v in V2_LITE_CONFIG_JSON.items() if k != "q_lora_rank"}
    assert config_from_hf(absent).q_lora_rank == 1536  # transformers' default


def test_a_model_with_only_dense_layers_has_no_moe() -> None:
    config = config_from_hf(V2_LITE_CONFIG_JSON | {"first_k_dense_replace": 99})
    assert isinstance(config, DeepseekConfig)
    assert config.moe is None and config.first_dense_layers == config.num_layers
    with pytest.raises(ConfigError, match="moe must be given"):
        replace(config, first_dense_layers=1)


def test_moe_config_refuses_groups_that_cannot_hold_the_experts() -> None:
    with pytest.raises(ConfigError, match="equal groups"):
        MoEConfig(
            num_experts=6, experts_per_token=2, intermediate_size=8, gating="noaux_tc", num_groups=4
        )
    with pytest.raises(ConfigError, match="two best"):
        MoEConfig(8, 1, 8, gating="noaux_tc", num_groups=8, topk_groups=2)


# -- the loader ----------------------------------------------------------------------------------


def test_loader_skips_multi_token_prediction_layers(tmp_path: Path) -> None:
    """A DeepSeek-V3 checkpoint holds an MTP layer after the decoder's (model.layers.N.*): not
    part of the prefill model; any other unknown weight is still refused."""
    _, kind, config = CASES[3]
    hf_model = _hf_model(kind, config)
    hf_model.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(meta | {"num_nextn_predict_layers": 1}))
    tensors = load_file(tmp_path / "model.safetensors")
    mtp = "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
    tensors[mtp] = torch.zeros(48, 64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_model(tmp_path)
    tensors["model.layers.4.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(48, 64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"does not use, first model\.layers\.4"):
        load_model(tmp_path)


def test_loader_refuses_a_missing_expert(tmp_path: Path) -> None:
    _, kind, config = CASES[1]
    _hf_model(kind, config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks 1 weight.*experts\.5\.up_proj"):
        load_model(tmp_path)


# -- attention backends --------------------------------------------------------------------------


def test_triton_refuses_a_latent_it_cannot_tile() -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'kvstrata[gpu]')")
    config = replace(PRESETS["tiny-mla"], qk_rope_head_dim=24)
    assert isinstance(config, DeepseekConfig)
    with torch.device("meta"):
        model = DeepseekModel(config).use_attention("triton")
    with pytest.raises(ConfigError, match=r"64 \+ 24 latent; use --attention sdpa"):
        model.paged_attention(torch.device("cuda"))


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    import triton_interpreter
    triton_interpreter.patch_loop_bounds()
    from kvstrata.model.attention import PagedAttention
    from kvstrata.model.attention_kernel import AttentionKernelConfig
    from kvstrata.model.batch import ForwardBatch
    from kvstrata.model.loader import load_model
    from kvstrata.tiers.pool import DevicePool
    worst = 0.0
    for seed, kernel in enumerate([AttentionKernelConfig(16, 16, 1, 1, True),
                                   AttentionKernelConfig(32, 16, 2, 2, False)]):
        gen = torch.Generator().manual_seed(seed)
        page = [3, 16][seed]
        lens = [(0, 9), (21, 5), (5, 18)]
        tables, used = [], 0
        slots = torch.randperm(40, generator=gen)
        for p, e in lens:
            n = -(-(p + e) // page)
            tables.append(slots[used:used + n]); used += n
        batch = ForwardBatch.build([p for p, _ in lens], [e for _, e in lens], tables, page)
        pages = torch.randn(40, page, 48, generator=gen)
        latent = torch.randn(batch.num_tokens, 48, generator=gen)
        pages.view(-1, 48).index_copy_(0, batch.write_index, latent)
        q = torch.randn(batch.num_tokens, 4, 48, generator=gen)
        want = PagedAttention("sdpa").latent(q, latent, pages, batch, 32, 0.2)
        got = PagedAttention("triton", kernel).latent(q, latent, pages, batch, 32, 0.2)
        worst = max(worst, float((got - want).abs().max()))
    assert worst < 1e-5, worst
    _, model = load_model("tiny-moe", dtype="float32", seed=0)
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(0))
    table = torch.tensor([3, 0, 2])
    out = {}
    for backend in ("sdpa", "triton"):
        model.use_attention(backend)
        pool = DevicePool(model.config.kv_layout("float32"), 16, 4)
        model(ids[:20], ForwardBatch.build([0], [20], [table], 16), pool)
        out[backend] = model(ids[20:], ForwardBatch.build([20], [17], [table], 16), pool, logits="all")
    diff = float((out["sdpa"] - out["triton"]).abs().max())
    assert diff < 1e-4, diff
    print("interpreted latent kernel: ok", worst, diff)
    """
)


@pytest.mark.slow
def test_latent_kernel_matches_sdpa_in_the_interpreter() -> None:
    """The Triton kernel reading keys and values from the same latent pages (page sizes 3 and
    16, prefixes mid-page, a fresh request) equals the SDPA latent path; tiny-moe with the
    kernel equals tiny-moe with SDPA over a cached prefix."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'kvstrata[gpu]')")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT, str(Path(__file__).parent)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout


def test_bench_prefill_runs_an_mla_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstrata.benchmarks.prefill import main as bench_main

    argv = ["--device", "cpu", "--preset", "tiny-moe", "--lengths", "64", "--repeats", "1"]
    assert bench_main([*argv, "--warmup", "0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["preset"] == "tiny-moe" and summary["results"][0]["ours_tok_s"] > 0


def test_a_moe_layer_takes_no_tokens() -> None:
    """Under CP a rank may compute no token of a step: the layer returns no rows, no error."""
    _, model = load_model("tiny-moe")
    moe = model.layers[1].mlp
    assert moe(torch.zeros(0, 128)).shape == (0, 128)


# -- CUDA ----------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _latent_case(
    seed: int, dtype: torch.dtype, rank: int, rope: int, heads: int
) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Requests with long prefixes over shuffled page-16 slots on CUDA; the extend tokens'
    latents written into the pages. Returns ``(batch, q, latent, pages)``."""
    gen = torch.Generator().manual_seed(seed)
    lens = [(0, 300), (1000, 77), (517, 260)]
    pages_per = [-(-(p + e) // PAGE) for p, e in lens]
    slots = torch.randperm(sum(pages_per) + 3, generator=gen)
    tables = list(slots[: sum(pages_per)].split(pages_per))
    batch = ForwardBatch.build([p for p, _ in lens], [e for _, e in lens], tables, PAGE, "cuda")
    width = rank + rope
    pages = torch.randn(slots.numel(), PAGE, width, generator=gen).to("cuda", dtype)
    latent = torch.randn(batch.num_tokens, width, generator=gen).to("cuda", dtype)
    pages.view(-1, width).index_copy_(0, batch.write_index, latent)
    q = torch.randn(batch.num_tokens, heads, width, generator=gen).to("cuda", dtype)
    return batch, q, latent, pages


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("dtype", "rank", "rope"), [(torch.bfloat16, 512, 64), (torch.float32, 64, 16)]
)
def test_latent_kernel_matches_sdpa_on_cuda(dtype: torch.dtype, rank: int, rope: int) -> None:
    """The compiled kernel on latent pages (DeepSeek-V2-Lite's 512 + 64 in bf16, 16 heads)
    against the SDPA latent path, relative error within the dtype's tolerance."""
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    for seed in range(2):
        batch, q, latent, pages = _latent_case(seed, dtype, rank, rope, heads=16)
        scale = (128 + 64) ** -0.5
        want = PagedAttention("sdpa").latent(q, latent, pages, batch, rank, scale).float()
        got = PagedAttention("triton").latent(q, latent, pages, batch, rank, scale).float()
        assert torch.isfinite(got).all()
        err = float((got - want).norm() / want.norm())
        assert err < tol, (seed, err)


@pytest.mark.gpu
@gpu
def test_mla_engine_on_cuda_equals_uncached_recompute() -> None:
    """tiny-moe in fp32 on CUDA (kernel for short extends, expanded K/V for long ones) through
    the engine with L1 and L2 hits: the logits of a no-cache recompute within 1e-4."""
    from kvstrata.engine import Engine, EngineConfig
    from kvstrata.model.compute import ModelCompute
    from kvstrata.replay import recompute_uncached
    from kvstrata.workloads import builtin

    _, model = load_model("tiny-moe", device="cuda", dtype="float32", seed=0)
    assert model.paged_attention(torch.device("cuda")).backend == "triton"
    compute = ModelCompute(model, torch.float32)
    config = EngineConfig(
        page_size=16, pool_tokens=1024, chunk_size=64, max_batch_tokens=256, device="cuda",
        l2_tokens=8192,
    )  # fmt: skip
    engine = Engine(compute, config)
    requests = builtin(compute.vocab_size, seed=3, n_requests=40)
    engine.keep_logits = {r.rid for r in requests}
    out = engine.run(requests)
    hits = [r for r in requests if out[r.rid].cached_len > 0]
    assert len(hits) >= 10 and any(out[r.rid].host_len for r in requests)
    for r in hits:
        fresh = recompute_uncached(compute, config, r)
        got = out[r.rid].logits
        assert got is not None and float((fresh - got).abs().max()) <= 1e-4, r.rid


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("extend", [8, 400], ids=["absorbed", "expanded"])
def test_mla_forward_never_syncs_the_host_per_layer(
    monkeypatch: pytest.MonkeyPatch, extend: int
) -> None:
    """With CUDA's sync debug mode set to error, a tiny-moe forward (bf16: the MoE layer's
    grouped matmuls) over a cached prefix, in either MLA form, raises on any synchronising call;
    only the input check is left out."""
    _, model = load_model("tiny-moe", device="cuda", dtype="bfloat16", seed=0)
    pool = DevicePool(model.config.kv_layout("bfloat16"), PAGE, 64, "cuda")
    ids = torch.randint(0, 512, (200 + extend,), generator=torch.Generator().manual_seed(0))
    table = torch.randperm(64, generator=torch.Generator().manual_seed(1))[
        : -(-(200 + extend) // PAGE)
    ]
    first = ForwardBatch.build([0], [200], [table], PAGE, "cuda", input_ids=ids[:200])
    assert first.input_ids is not None
    model(first.input_ids, first, pool)
    monkeypatch.setattr(model, "_check_inputs", lambda *args: None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = ForwardBatch.build([200], [extend], [table], PAGE, "cuda", input_ids=ids[200:])
        assert batch.input_ids is not None
        logits = model(batch.input_ids, batch, pool)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(logits.float()).all()
