"""The planner's cost model: :class:`CostProfile`'s step formula and overlaps, its JSON and the
shipped profiles, estimates from a model's shape, the simulated clock's disk queue, and how a
replay picks its cost model (``--cost-profile``, ``--model-shape``, GiB sizes)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvstrata.clock import CostModel, SimClock, StepWork
from kvstrata.cost import (
    CostProfile,
    Provenance,
    estimate_profile,
    find_shipped,
    load_profile,
    model_shape,
    shipped_profiles,
)
from kvstrata.engine import EngineConfig
from kvstrata.errors import ConfigError
from kvstrata.replay import ReplayConfig, SimLinks, resolve_cost, resolve_sizes, run_replay

PROV = Provenance(device="test", device_kind="cuda", model="m", dtype="bfloat16", page_size=16)


def profile(**kw: object) -> CostProfile:
    base = dict(
        name="t", kind="calibrated", step_s=0.01, request_s=0.001, token_s=1e-5, pair_s=1e-9,
        prefix_s=0.0, h2d_gbps=1.0, d2h_gbps=2.0, disk_read_gbps=0.5, disk_write_gbps=0.25,
        overlap="layered", num_layers=4, kv_bytes_per_token=1000, provenance=PROV,
    )  # fmt: skip
    return CostProfile(**(base | kw))  # type: ignore[arg-type]


def test_compute_terms_add_up() -> None:
    p = profile(prefix_s=1e-7)
    # 2 requests, 300 tokens, 1e6 pairs, 500 prefix tokens read: no copies.
    seconds, load = p.step(2, 300, 1e6, 0, 0, 500)
    assert seconds == pytest.approx(0.01 + 0.002 + 300e-5 + 1e6 * 1e-9 + 500 * 1e-7)
    assert load == 0.0
    assert p.step(0, 0, 0.0, 0, 0) == (0.0, 0.0)  # a step without a forward costs nothing


def test_layered_overlap_is_a_three_stage_pipeline() -> None:
    p = profile(step_s=0.0, request_s=0.0, token_s=1e-3, pair_s=0.0)  # 4 layers
    compute = 0.4  # 400 tokens: 0.1 s a layer
    # Load-back of 0.8 s (0.2 s a layer) is the bottleneck: l + c + d + 3 x max = 0.2+0.1+3*0.2
    seconds, load = p.step(1, 400, 0.0, 0.8e9, 0)
    assert seconds == pytest.approx(0.2 + 0.1 + 3 * 0.2)
    assert load == pytest.approx(seconds - compute)
    # A small load-back hides behind the compute except its first layer.
    seconds, load = p.step(1, 400, 0.0, 0.04e9, 0)
    assert seconds == pytest.approx(0.01 + 0.1 + 3 * 0.1)
    assert load == pytest.approx(0.01)
    # Backups (2 GB/s) run behind each layer: 0.2e9 bytes = 0.025 s a layer, hidden but the last.
    seconds, _ = p.step(1, 400, 0.0, 0, 0.2e9)
    assert seconds == pytest.approx(0.1 + 0.025 + 3 * 0.1)


def test_serial_overlap_adds_the_copies() -> None:
    p = profile(overlap="serial", step_s=0.0, request_s=0.0, token_s=1e-3, pair_s=0.0)
    assert p.step(1, 100, 0.0, 1e9, 2e9) == pytest.approx((1.0 + 0.1 + 1.0, 1.0))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("token_s", -1.0, "token_s"),
        ("h2d_gbps", 0.0, "--sim-h2d-gbps"),
        ("disk_read_gbps", float("inf"), "--sim-disk-read-gbps"),
        ("overlap", "sometimes", "overlap"),
        ("num_layers", 0, "num_layers"),
    ],
)
def test_profile_refuses_bad_values(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        profile(**{field: value})


def test_json_round_trip_and_refusals(tmp_path: Path) -> None:
    p = profile()
    path = p.save(tmp_path / "p.json")
    assert load_profile(str(path)) == p
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(p.to_json() | {"format": 99}))
    with pytest.raises(ConfigError, match="format 99"):
        load_profile(str(bad))
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ConfigError, match="not a kvstrata cost profile"):
        load_profile(str(bad))
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not a JSON cost profile"):
        load_profile(str(bad))
    with pytest.raises(ConfigError, match="neither a shipped profile"):
        load_profile(str(tmp_path / "missing.json"))


def test_shipped_profiles_load_and_say_what_they_are() -> None:
    shipped = shipped_profiles()
    assert {"h200-llama-3.2-1b-bf16", "cpu-2core-tiny-fp32"} <= set(shipped)
    h200 = shipped["h200-llama-3.2-1b-bf16"]
    assert h200.overlap == "layered" and h200.kv_bytes_per_token == 32 * 1024
    assert h200.kind == "calibrated" and h200.provenance.device == "NVIDIA H200"
    assert h200.provenance.fit_error["held_back_mean"] < 0.15  # measured 5.7 % (2026-12-02)
    cpu = shipped["cpu-2core-tiny-fp32"]
    assert cpu.kind == "calibrated" and cpu.overlap == "serial"
    assert "held_back_mean" in cpu.provenance.fit_error
    assert find_shipped("cuda", "llama-3.2-1b", "bfloat16") == h200
    assert find_shipped("cpu", "tiny", "float32") == cpu
    assert find_shipped("cuda", "llama-3.2-1b", "float32") is None


def test_estimate_from_a_shape() -> None:
    shape = model_shape("llama-3.2-1b")
    assert shape.kv_bytes_per_token == 16 * 2 * 8 * 64 * 2  # layers x K,V x heads x dim x bf16
    # 2 x (about 0.97 G weights without the embedding) FLOPs a token, 4 x 32 x 64 x 16 a pair.
    assert shape.matmul_flops_per_token() == pytest.approx(2 * 0.973e9, rel=0.01)
    assert shape.attention_flops_per_pair() == 4 * 32 * 64 * 16
    est = estimate_profile(shape, "cuda")
    assert est.kind == "estimate" and "ESTIMATE" in est.provenance.note
    # A 32,768-token prefill on the H200 measured 360 ms (docs/benchmarks.md); the estimate is
    # within a factor of 1.5 of it.
    seconds, _ = est.step(1, 32768, 32768**2 / 2, 0, 0)
    assert 0.36 / 1.5 < seconds < 0.36 * 1.5
    moe = model_shape("tiny-moe")  # routed experts count by experts_per_token
    assert moe.matmul_flops_per_token() > 0
    with pytest.raises(ConfigError, match="--model-shape nope"):
        model_shape("nope")


def test_model_shape_reads_a_config_json(tmp_path: Path) -> None:
    from kvstrata.model.config import PRESETS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["small"].to_hf()))  # type: ignore[union-attr]
    shape = model_shape(str(path), "float32")
    assert shape.kv_bytes_per_token == 4 * 2 * 2 * 64 * 4


def test_sim_clock_waits_for_the_disk_at_the_next_step() -> None:
    p = profile(overlap="serial", step_s=0.0, request_s=0.0, token_s=1e-3, pair_s=0.0)
    clock = SimClock(p)
    clock.charge(StepWork(100, 0, 0, 0.0, requests=1))  # 0.1 s of compute, starts at 0
    assert clock.now() == pytest.approx(0.1)
    # The next step finds 0.25e9 bytes read (issued when the last step began, at 0): the disk
    # reads them in 0.5 s, so this step begins at 0.5, 0.4 s after the last one ended.
    clock.charge(StepWork(100, 0, 0, 0.0, requests=1, disk_read_bytes=int(0.25e9)))
    assert clock.now() == pytest.approx(0.5 + 0.1)
    assert clock.disk_wait_s == pytest.approx(0.4)
    # Bytes that the disk finishes while a step computes cost nothing more.
    clock.charge(StepWork(1000, 0, 0, 0.0, requests=1))  # 1 s, begins at 0.6
    clock.charge(StepWork(0, 0, 0, 0.0, disk_write_bytes=int(0.025e9)))  # 0.1 s from 0.6
    assert clock.now() == pytest.approx(1.6) and clock.disk_wait_s == pytest.approx(0.4)
    # byte_scale: the stored bytes stand for bigger modeled ones.
    scaled = SimClock(p, byte_scale=10.0)
    scaled.charge(StepWork(0, 0, 0, 0.0, disk_read_bytes=int(0.05e9)))
    assert scaled.now() == pytest.approx(1.0)


def test_flat_model_charges_the_disk_too() -> None:
    clock = SimClock(CostModel(1000.0, 1.0, 1.0, disk_read_gbps=1.0, disk_write_gbps=1.0))
    clock.charge(StepWork(0, 0, 0, 0.0, disk_read_bytes=10**9))
    assert clock.now() == pytest.approx(1.0)


def cfg(**kw: object) -> ReplayConfig:
    kw = {"engine": EngineConfig(pool_tokens=4096), "workload": "synthetic:0:20"} | kw
    return ReplayConfig(model="none", **kw)  # type: ignore[arg-type]


def test_resolve_cost_picks_profile_shape_or_flat() -> None:
    flat = resolve_cost(cfg(), 64)
    assert flat.profile is None and flat.byte_scale == 1.0
    links = resolve_cost(cfg(sim_links=SimLinks(disk_read_gbps=7.0)), 64)
    assert isinstance(links.coster, CostModel) and links.coster.disk_read_gbps == 7.0
    named = resolve_cost(cfg(cost_profile="h200-llama-3.2-1b-bf16"), 64)
    assert named.profile is not None and named.profile.name == "h200-llama-3.2-1b-bf16"
    assert named.byte_scale == 32768 / 64  # the profiled model's KV over the stored bytes
    shaped = resolve_cost(cfg(model_shape="small", dtype="float32"), 64)
    assert shaped.profile is not None and shaped.profile.kind == "estimate"
    assert shaped.bytes_per_token == 4 * 2 * 2 * 64 * 4
    model = resolve_cost(ReplayConfig(model="tiny", clock="sim"), 1024)
    assert model.profile is not None and model.profile.name == "cpu-2core-tiny-fp32"
    assert model.byte_scale == 1.0
    with pytest.raises(ConfigError, match="--model-shape plans"):
        ReplayConfig(model="tiny", model_shape="small")
    with pytest.raises(ConfigError, match="give one of them"):
        cfg(cost=CostModel(1.0, 1.0, 1.0), cost_profile="h200-llama-3.2-1b-bf16")


def test_sizes_in_gib_count_the_modeled_kv(tmp_path: Path) -> None:
    engine = EngineConfig(l2_gib=2.0, l3_dir=str(tmp_path), l3_gib=4.0)
    got = resolve_sizes(cfg(model_shape="llama-3.2-1b", l1_gib=1.0, engine=engine, kv_width=4))
    assert got.engine.pool_tokens == 2**30 // 32768  # 32,768 tokens of Llama-3.2-1B KV
    assert got.engine.l2_tokens == 2 * 32768 and got.engine.l2_gib == 0.0
    # 4 GiB hold 8,192 modeled pages; the slabs get room for that many stored 4 KiB slots.
    assert got.engine.l3_gib * 2**30 == pytest.approx(8192 * 4096 + 2 * 4096)
    # Striped over two directories: each holds half the pages and its own superblock room.
    two = replace(engine, l3_dir=(str(tmp_path / "a"), str(tmp_path / "b")))
    got = resolve_sizes(cfg(model_shape="llama-3.2-1b", l1_gib=1.0, engine=two, kv_width=4))
    assert got.engine.l3_gib * 2**30 == pytest.approx(2 * (4096 * 4096 + 2 * 4096))
    plain = resolve_sizes(cfg(l1_gib=1 / 1024, kv_width=64))  # the stored 64 bytes a token
    assert plain.engine.pool_tokens == 2**20 // 64
    assert resolve_sizes(cfg()) == cfg()
    with pytest.raises(ConfigError, match="holds no page"):
        resolve_sizes(cfg(model_shape="llama-3.2-1b", l1_gib=1e-6))


def test_a_replay_names_its_profile_and_plans_in_gib() -> None:
    c = cfg(model_shape="llama-3.2-1b", cost_profile="h200-llama-3.2-1b-bf16", l1_gib=4.0,
            kv_width=4, engine=EngineConfig(l2_gib=8.0))  # fmt: skip
    summary = run_replay(c, progress=False)
    doc = summary.to_json()
    assert doc["clock"]["cost"]["name"] == "h200-llama-3.2-1b-bf16"
    assert doc["clock"]["cost"]["provenance"]["device"] == "NVIDIA H200"
    assert doc["planner"]["tier_gib"] == {"l1": 4.0, "l2": 8.0, "l3": 0.0}
    assert doc["planner"]["compute_s_saved"] > 0
    table = summary.table()
    assert "h200-llama-3.2-1b-bf16: calibrated" in table
    assert "4.00 / 8.00 of llama-3.2-1b KV" in table
    # The same run on the flat model: different clock, same cache decisions.
    flat = run_replay(replace(c, cost_profile=None, model_shape=None, l1_gib=0.0,
                              engine=EngineConfig(pool_tokens=c.engine.pool_tokens, l2_tokens=262144)),
                      progress=False).to_json()  # fmt: skip
    assert flat["hit_ratio"] == doc["hit_ratio"]
    assert flat["clock"]["seconds"] != doc["clock"]["seconds"]


def test_l3_that_cannot_beat_recompute_says_so(tmp_path: Path) -> None:
    """A 1B model's KV (32 KiB a token) from a 0.01 GB/s disk: slower than recomputing it (32 GiB
    of its KV: 1 M tokens, in 4 KiB slots of the stored 64-byte pages)."""
    engine = EngineConfig(pool_tokens=32768, l2_tokens=65536, l3_dir=str(tmp_path), l3_gib=32.0)
    c = cfg(cost_profile="h200-llama-3.2-1b-bf16", kv_width=4, engine=engine,
            sim_links=SimLinks(disk_read_gbps=0.01), workload="synthetic:0:200")  # fmt: skip
    summary = run_replay(c, progress=False)
    block = summary.to_json()["planner"]
    assert block["l3_beats_recompute"] is False
    assert block["break_even_disk_read_gbps"] > 0.01
    assert "L3 HITS CANNOT BEAT RECOMPUTE" in summary.table()
    assert summary.to_json()["hit_tokens_by_tier"]["l3"] > 0
    slow_clock = summary.to_json()["clock"]
    assert slow_clock["disk_busy_s"] > 0 and slow_clock["disk_wait_s"] > 0
    fast = run_replay(replace(c, sim_links=SimLinks(disk_read_gbps=1000.0)), progress=False)
    assert fast.to_json()["planner"]["l3_beats_recompute"] is True
    assert fast.to_json()["clock"]["disk_wait_s"] < slow_clock["disk_wait_s"]


def test_pairs_over_a_prefix_have_their_own_term() -> None:
    """A request over a prefix attends in another kernel than a fresh prefill (the paged one on
    CUDA; gather and masked SDPA on the CPU): its pairs cost ``prefix_pair_s``. A profile made
    before the term charges them at ``pair_s``, as it always did, and
    says the term is missing."""
    p = profile(overlap="serial", step_s=0.0, request_s=0.0, token_s=0.0, pair_s=1e-9,
                prefix_pair_s=3e-9)  # fmt: skip
    # 1e6 pairs of a fresh request and 2e6 of one over a prefix: 1 ms + 6 ms.
    assert p.step(2, 10, 3e6, 0, 0, prefix_pairs=2e6)[0] == pytest.approx(7e-3)
    assert p.step(1, 10, 3e6, 0, 0)[0] == pytest.approx(3e-3)  # no prefix: pair_s alone
    old = replace(p, prefix_pair_s=None)
    assert old.step(2, 10, 3e6, 0, 0, prefix_pairs=2e6)[0] == pytest.approx(3e-3)
    assert "no prefix_pair_s" in old.describe() and "no prefix_pair_s" not in p.describe()
    # JSON: a profile without the field loads (None); one with it round-trips.
    data = old.to_json()
    del data["prefix_pair_s"]
    assert CostProfile.from_json(data).prefix_pair_s is None
    assert CostProfile.from_json(p.to_json()) == p
    with pytest.raises(ConfigError, match="prefix_pair_s must be a finite number"):
        replace(p, prefix_pair_s=-1.0)
    h200 = shipped_profiles()["h200-llama-3.2-1b-bf16"]  # recalibrated with the term
    assert h200.prefix_pair_s is not None and "recalibrate" not in h200.describe()
    assert shipped_profiles()["cpu-2core-tiny-fp32"].prefix_pair_s is not None
    # The simulated clock charges what the engine reports of the step.
    clock = SimClock(p)
    clock.charge(StepWork(10, 0, 0, 0.0, requests=2, attention_pairs=3e6, prefix_pairs=2e6))
    assert clock.now() == pytest.approx(7e-3)


def test_a_replay_on_a_profile_without_the_term_says_it_is_missing(tmp_path: Path) -> None:
    data = shipped_profiles()["h200-llama-3.2-1b-bf16"].to_json()
    del data["prefix_pair_s"]  # a profile calibrated before the term existed
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    summary = run_replay(
        cfg(cost_profile=str(old), model_shape="llama-3.2-1b", clock="sim"), progress=False
    )
    assert "MISSING prefix_pair_s" in summary.table()
    assert summary.to_json()["clock"]["cost"]["prefix_pair_s"] is None
