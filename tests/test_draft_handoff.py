"""Speculative draft KV in lockstep with the target's, and the prefill -> decode handoff."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstrata.decode import greedy_decode
from kvstrata.dist.group import Group
from kvstrata.dist.launch import run_ranks
from kvstrata.engine import Engine, EngineConfig, Finished
from kvstrata.errors import ConfigError, HandoffError
from kvstrata.handoff import DirectoryTransport, LoopbackTransport, assemble
from kvstrata.model.compute import ModelCompute, PairCompute, SyntheticCompute
from kvstrata.model.config import PRESETS
from kvstrata.model.loader import load_model
from kvstrata.replay import prefill_uncached
from kvstrata.residency import Tier
from kvstrata.tiers.pool import DevicePool
from kvstrata.workloads import Request, builtin


def pair(target: str = "tiny", draft: str = "tiny-draft") -> PairCompute:
    _, t = load_model(target, dtype="float32", seed=0)
    _, d = load_model(draft, dtype="float32", seed=0)
    return PairCompute(t, d, torch.float32)


def run(engine: Engine, requests: list[Request]) -> dict[int, Finished]:
    engine.keep_logits = {r.rid for r in requests}
    engine.keep_handoff = {r.rid for r in requests}
    try:
        return engine.run(requests, check=True)
    finally:
        engine.close()


def max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    assert a is not None and b is not None
    return float((a - b).abs().max())


CONFIG = EngineConfig(
    page_size=16,
    pool_tokens=640,
    chunk_size=64,
    max_batch_tokens=256,
    l2_tokens=4096,
    check_every_step=True,
)


def test_tiny_draft_shares_tinys_first_layer() -> None:
    _, t = load_model("tiny", dtype="float32", seed=3)
    _, d = load_model("tiny-draft", dtype="float32", seed=3)
    td, dd = t.state_dict(), d.state_dict()
    assert set(dd) < set(td)
    assert all(torch.equal(dd[k], td[k]) for k in dd)


@pytest.mark.parametrize("tier", ["l1_l2", "l3"])
def test_draft_logits_with_cache_hits_equal_uncached(tier: str, tmp_path: Path) -> None:
    """fp32 CPU: with L1, L2 (and a disk round trip) hits, both models' last-token logits equal
    a prefill of the same request with an empty cache within 1e-5."""
    compute = pair()
    config = CONFIG
    if tier == "l3":  # L1 and L2 far smaller than the working set: hits come back from disk
        config = replace(CONFIG, pool_tokens=320, l2_tokens=640, l3_dir=str(tmp_path), l3_gib=0.05)
    requests = builtin(compute.vocab_size, seed=5, n_requests=40)
    engine = Engine(compute, config)
    out = run(engine, requests)
    hit = Tier.L3 if tier == "l3" else Tier.L2
    assert engine.hit_tokens[hit] > 0 and engine.hit_tokens[Tier.L1] > 0
    cached = [r for r in requests if out[r.rid].cached_len > 0]
    assert len(cached) >= 10
    for r in cached:
        fresh = prefill_uncached(compute, CONFIG, r)
        assert max_diff(fresh.logits, out[r.rid].logits) <= 1e-5, r.rid
        assert max_diff(fresh.draft_logits, out[r.rid].draft_logits) <= 1e-5, r.rid


def test_acceptance_rate_and_tokens_equal_with_and_without_cache_hits() -> None:
    """Greedy decoding from each request's handoff gives the same tokens, and the draft the same
    acceptance, whether the prefill hit the cache or recomputed everything."""
    compute = pair()
    requests = builtin(compute.vocab_size, seed=9, n_requests=30)
    engine = Engine(compute, CONFIG)
    out = run(engine, requests)
    transport = LoopbackTransport()
    with_hits, without = [], []
    for r in requests:
        f = out[r.rid]
        if not f.cached_len:
            continue
        assert f.handoff is not None
        transport.send(f.handoff)
        kv = assemble(transport.receive(r.rid), engine.fingerprint)
        assert f.logits is not None and f.draft_logits is not None
        cached = greedy_decode(kv, compute.target, f.logits, 6, compute.draft, f.draft_logits)
        fresh = prefill_uncached(compute, CONFIG, r, handoff=True)
        assert fresh.handoff is not None and fresh.logits is not None
        kv0 = assemble([fresh.handoff], engine.fingerprint)
        uncached = greedy_decode(
            kv0, compute.target, fresh.logits, 6, compute.draft, fresh.draft_logits
        )
        assert cached.tokens == uncached.tokens, r.rid
        assert cached.draft_agreed == uncached.draft_agreed, r.rid
        with_hits.append(cached.acceptance)
        without.append(uncached.acceptance)
    assert len(with_hits) >= 10
    assert with_hits == without
    assert 0.0 < float(np.mean(with_hits)) < 1.0  # a real draft: it agrees often, not always


def test_mismatched_draft_fails_fast_with_a_clear_message() -> None:
    _, t = load_model("tiny", dtype="float32", seed=0)
    _, small = load_model("small", dtype="float32", seed=0)
    with pytest.raises(ConfigError, match=r"draft model's vocabulary \(4096.*\(512\)"):
        PairCompute(t, small, torch.float32)
    with pytest.raises(ConfigError, match="3 layers, more than the target's 2"):
        PRESETS["tiny"].kv_layout("float32", draft=replace(PRESETS["tiny"], num_layers=3))
    # A pool laid out for the target alone: the draft's forward names the payload it lacks.
    compute = pair()
    pool = DevicePool(PRESETS["tiny"].kv_layout("float32"), 16, 8)
    engine = Engine(compute, EngineConfig(page_size=16, pool_tokens=128))
    engine.cache.pool = pool
    engine.add(Request(0, np.arange(20, dtype=np.uint32)))
    with pytest.raises(ConfigError, match="no payload named 'draft_k'"):
        engine.step()


def _part(engine: Engine, f: Finished) -> Any:
    assert f.handoff is not None
    return f.handoff


def test_assemble_refuses_what_it_cannot_read() -> None:
    compute = pair()
    engine = Engine(compute, CONFIG)
    request = builtin(compute.vocab_size, seed=1, n_requests=1)[0]
    (f,) = run(engine, [request]).values()
    part = _part(engine, f)
    with pytest.raises(HandoffError, match="rank 0 has layout fingerprint .* expects"):
        assemble([part], "0" * 64)
    with pytest.raises(HandoffError, match=r"ranks \[0, 0\]"):
        assemble([part, part], engine.fingerprint)
    two = replace(part, cp_size=2)
    with pytest.raises(HandoffError, match=r"ranks \[0\], a cp_size 2 handoff"):
        assemble([two], engine.fingerprint)
    other = replace(two, rank=1, pages=part.pages[:1])
    with pytest.raises(HandoffError, match="page 0 came from rank 1 and from rank 0"):
        assemble([two, other], engine.fingerprint)
    with pytest.raises(HandoffError, match="no handoff was sent"):
        LoopbackTransport().receive(99)


def test_directory_transport_round_trips_bytes(tmp_path: Path) -> None:
    compute = SyntheticCompute(8, 1000)
    engine = Engine(compute, EngineConfig(page_size=4, pool_tokens=256))
    request = builtin(1000, seed=2, n_requests=1)[0]
    (f,) = run(engine, [request]).values()
    transport = DirectoryTransport(tmp_path)
    transport.send(_part(engine, f))
    (back,) = transport.receive(request.rid, timeout_s=5)
    kv = assemble([back], engine.fingerprint)
    assert f.payload is not None and torch.equal(kv.payloads["kv"][0], f.payload)
    assert not list(tmp_path.iterdir())  # received parts are removed
    with pytest.raises(HandoffError, match="before the timeout"):
        transport.receive(request.rid, timeout_s=0.05)


# -- context parallelism: each rank hands over its own pages --------------------------------------


def _cp_prefill(group: Group, kind: str, model: str, outdir: str, n: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    if kind == "none":
        compute: Any = SyntheticCompute(8, 1000)
        vocab = 1000
    else:
        _, m = load_model(model, dtype="float32", seed=0)
        compute = ModelCompute(m, torch.float32)
        vocab = compute.vocab_size
    config = EngineConfig(page_size=16, pool_tokens=1024, chunk_size=64, l2_tokens=4096)
    engine = Engine(compute, config, group=group, model_id=model)
    requests = builtin(vocab, seed=7, n_requests=n)
    out = run(engine, requests)
    Path(outdir).mkdir(exist_ok=True)
    transport = DirectoryTransport(outdir)
    for f in out.values():
        assert f.handoff is not None and f.error is None
        transport.send(f.handoff)
    return {
        "fingerprint": engine.fingerprint,
        "logits": {rid: f.logits for rid, f in out.items()},
        "cached": {rid: f.cached_len for rid, f in out.items()},
    }


@pytest.mark.multiproc
@pytest.mark.slow
def test_cp2_handoff_assembles_the_single_rank_kv_and_decodes_like_transformers(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    n = 8
    # Synthetic payloads are a function of the tokens: cp = 2 must assemble the same bytes.
    cp_dir, solo_dir = tmp_path / "cp2", tmp_path / "cp1"
    (cp,) = run_ranks(2, _cp_prefill, ("none", "none", str(cp_dir), n), timeout_s=120)[:1]
    (solo,) = run_ranks(1, _cp_prefill, ("none", "none", str(solo_dir), n), timeout_s=120)
    assert cp["fingerprint"] == solo["fingerprint"]
    assert any(cp["cached"].values())
    for rid in range(n):
        a = assemble(DirectoryTransport(cp_dir).receive(rid, 5), cp["fingerprint"])
        b = assemble(DirectoryTransport(solo_dir).receive(rid, 5), solo["fingerprint"])
        assert torch.equal(a.payloads["kv"], b.payloads["kv"]), rid

    # A real model: the cp = 2 handoff decodes to transformers' greedy tokens on the same weights.
    # Its K/V equal one rank's within fp32 rounding (CP attention sums in another order), not
    # byte for byte.
    import transformers

    model_dir, solo_model_dir = tmp_path / "tiny", tmp_path / "tiny1"
    args = ("tiny", str(tiny_checkpoint))
    ranks = run_ranks(2, _cp_prefill, (*args, str(model_dir), n), timeout_s=120)
    run_ranks(1, _cp_prefill, (*args, str(solo_model_dir), n), timeout_s=120)
    _, target = load_model(tiny_checkpoint, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    requests = builtin(target.config.vocab_size, seed=7, n_requests=n)
    transport = DirectoryTransport(model_dir)
    for r in requests:
        kv = assemble(transport.receive(r.rid, 5), ranks[0]["fingerprint"])
        one = assemble(DirectoryTransport(solo_model_dir).receive(r.rid, 5), kv.fingerprint)
        for name in ("k", "v"):
            assert max_diff(kv.payloads[name], one.payloads[name]) <= 1e-5, (r.rid, name)
        ours = greedy_decode(kv, target, torch.as_tensor(ranks[0]["logits"][r.rid]), 8)
        ids = torch.from_numpy(r.tokens.astype(np.int64))[None]
        theirs = hf.generate(ids, max_new_tokens=8, do_sample=False)
        assert list(ours.tokens) == theirs[0, ids.shape[1] :].tolist(), r.rid


# -- kvstrata replay ------------------------------------------------------------------------------


def _replay_cfg(**kw: Any) -> Any:
    from kvstrata.replay import ReplayConfig

    engine = EngineConfig(page_size=16, pool_tokens=1024, chunk_size=128, l2_tokens=4096)
    fields = {"model": "tiny", "draft_model": "tiny-draft", "verify": 6, "decode_tokens": 5}
    return ReplayConfig(engine=engine, **(fields | kw))


def test_replay_reports_draft_logits_and_equal_acceptance() -> None:
    from kvstrata.replay import run_replay

    summary = run_replay(_replay_cfg(), progress=False)
    verify = summary.verify
    assert verify.ok and verify.requests == 6
    assert verify.draft_max_abs_logit_diff is not None and verify.draft_max_abs_logit_diff <= 1e-5
    decode = verify.decode
    assert decode is not None and decode.tokens_equal == decode.requests == 6
    assert decode.hit_requests > 0
    assert decode.acceptance_cached == decode.acceptance_uncached
    assert decode.acceptance_cached is not None and 0 < decode.acceptance_cached < 1
    doc = summary.to_json()
    assert doc["verify"]["decode"]["acceptance_cached"] == decode.acceptance_cached
    assert doc["config"]["draft_model"] == "tiny-draft"


@pytest.mark.multiproc
@pytest.mark.slow
def test_replay_with_cp2_decodes_from_every_ranks_part(tmp_path: Path) -> None:
    """Through --handoff-dir, beside files of the user's that look like parts: they stay."""
    from kvstrata.replay import run_replay

    users = ["lora.rank16.safetensors", "model.ranker.safetensors", "x.rank1.tmp"]
    for name in users:
        (tmp_path / name).write_bytes(b"user data")
    summary = run_replay(_replay_cfg(cp=2, handoff_dir=str(tmp_path)), progress=False)
    decode = summary.verify.decode
    assert decode is not None and decode.tokens_equal == decode.requests == 6
    assert decode.acceptance_cached == decode.acceptance_uncached
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(users)
    assert all((tmp_path / name).read_bytes() == b"user data" for name in users)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": "none", "draft_model": "tiny-draft"}, "--draft-model runs beside a model"),
        ({"decode_tokens": 4}, "give --verify N too"),
        ({"decode_tokens": -1, "verify": 1}, r"--decode-tokens must lie in \[0, 65536\]"),
        ({"model": "none", "decode_tokens": 2, "verify": 1}, "decodes with a model"),
    ],
)
def test_replay_refuses_draft_and_decode_misuse(fields: dict[str, Any], message: str) -> None:
    from kvstrata.replay import ReplayConfig

    with pytest.raises(ConfigError, match=message):
        ReplayConfig(**fields)


def test_replay_refuses_a_draft_with_another_vocabulary() -> None:
    from kvstrata.replay import run_replay

    with pytest.raises(ConfigError, match="vocabulary"):
        run_replay(_replay_cfg(draft_model="small"), progress=False)


def test_a_runs_handoff_directory_removes_only_its_own_parts(tmp_path: Path) -> None:
    """A run hands over in a subdirectory it creates; closing it removes the parts it never
    received and its temporary files, and nothing the user keeps beside or inside it."""
    compute = SyntheticCompute(8, 1000)
    engine = Engine(compute, EngineConfig(page_size=4, pool_tokens=256))
    request = builtin(1000, seed=2, n_requests=1)[0]
    (f,) = run(engine, [request]).values()
    users = ["lora.rank16.safetensors", "model.ranker.safetensors", "7.rank0.tmp.bak"]
    for name in users:
        (tmp_path / name).write_bytes(b"user data")
    transport = DirectoryTransport.create(tmp_path)
    assert transport.directory.parent == tmp_path
    transport.send(_part(engine, f))  # never received
    (transport.directory / "3.rank1.tmp").write_bytes(b"half a part")
    (transport.directory / "4.rank0.safetensors").write_bytes(b"not a part of ours")
    transport.close()
    assert sorted(p.name for p in transport.directory.iterdir()) == ["4.rank0.safetensors"]
    assert all((tmp_path / name).read_bytes() == b"user data" for name in users)
    (transport.directory / "4.rank0.safetensors").unlink()
    transport.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(users)


def test_handoff_dir_at_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot create a directory there"):
        DirectoryTransport.create(tmp_path / "file")
    with pytest.raises(ConfigError, match="cannot create a directory there"):
        DirectoryTransport.create(tmp_path / "file" / "below")
    with pytest.raises(HandoffError, match="not a directory"):
        DirectoryTransport(tmp_path / "file")


def test_a_full_disk_while_handing_over_is_a_handoff_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import safetensors.torch

    compute = SyntheticCompute(8, 1000)
    engine = Engine(compute, EngineConfig(page_size=4, pool_tokens=256))
    (f,) = run(engine, builtin(1000, seed=2, n_requests=1)).values()

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    transport = DirectoryTransport.create(tmp_path)
    with pytest.raises(HandoffError, match="No space left on device"):
        transport.send(_part(engine, f))
    assert not list(transport.directory.iterdir())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"handoff_dir": "x", "decode_tokens": 0}, "give --decode-tokens N"),
        ({"handoff_dir": "x", "decode_tokens": 2, "verify": 1, "draft_model": None}, "drop it"),
    ],
)
def test_handoff_dir_where_it_is_unused_is_refused(fields: dict[str, Any], message: str) -> None:
    from kvstrata.replay import run_replay

    with pytest.raises(ConfigError, match=message):
        run_replay(_replay_cfg(**fields), progress=False)


def test_draft_payloads_take_only_the_drafts_layers() -> None:
    """tiny-draft has one of tiny's two layers: its K/V add half the target's bytes per page, not
    as much again, in every tier (device pool, host pool, disk slots, handoff)."""
    compute = pair()
    target = PRESETS["tiny"].kv_layout("float32")
    layout = compute.layout
    assert layout.layers("draft_k") == 1 and layout.layers("k") == 2
    assert layout.page_bytes(16) * 2 == target.page_bytes(16) * 3
    pool = DevicePool(layout, 16, 4)
    assert pool.total_bytes == layout.page_bytes(16) * 4
    with pytest.raises(ConfigError, match="outside"):
        pool.buffer("draft_k", 1)
    engine = Engine(compute, CONFIG)
    request = builtin(compute.vocab_size, seed=3, n_requests=1)[0]
    (f,) = run(engine, [request]).values()
    assert f.handoff is not None
    assert f.handoff.payloads["draft_k"].shape[0] == 1 and f.handoff.payloads["k"].shape[0] == 2


def test_payload_layer_counts_are_validated() -> None:
    from kvstrata.config import KVLayout, PayloadSpec

    with pytest.raises(ConfigError, match="num_layers must be an integer >= 1"):
        PayloadSpec("k", (2,), num_layers=0)
    with pytest.raises(ConfigError, match="has 3 layers, the layout 2"):
        KVLayout(2, (PayloadSpec("k", (2,), num_layers=3),))
