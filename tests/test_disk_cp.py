"""The disk tier under context parallelism: each rank spills and reloads the pages it owns, the
ranks agree on a reload's page count through the frontier collective, a page that fails
verification on one rank fails the reload on all, and replicated state never diverges."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstrata.dist.group import Group
from kvstrata.dist.launch import run_ranks
from kvstrata.engine import Engine, EngineConfig
from kvstrata.model.compute import ModelCompute, SyntheticCompute, synthetic_payload
from kvstrata.model.loader import load_model
from kvstrata.replay import recompute_uncached
from kvstrata.residency import Tier
from kvstrata.tiers.disk_format import SLOT_HEADER_BYTES
from kvstrata.workloads import Request, builtin

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

TIMEOUT_S = 120


def _config(root: str, start: str) -> EngineConfig:
    return EngineConfig(
        page_size=16,
        pool_tokens=320,  # per rank: far below the working set, so hits come back from disk
        chunk_size=64,
        max_batch_tokens=128,
        max_batch_requests=4,
        l2_tokens=320,
        l3_dir=root,
        l3_gib=0.05,
        l3_start=start,
        check_digests=True,
    )


def _corrupt_every_slot(engine: Engine) -> None:
    """Flip a payload byte of every slot of this rank's first slab."""
    assert engine.cache.disk is not None
    slab = engine.cache.disk.store._slabs[0]
    with open(slab.path, "r+b") as f:
        for slot in range(slab.geometry.num_slots):
            offset = slab.geometry.slot_offset(slot) + SLOT_HEADER_BYTES + 3
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]))


def _run(
    group: Group, kind: str, root: str, start: str, requests: list[Request], corrupt_rank: int
) -> dict[str, Any]:
    torch.set_num_threads(1)
    if kind == "none":
        compute: Any = SyntheticCompute(8, 1000)
    else:
        _, model = load_model("tiny", dtype="float32", seed=0)
        compute = ModelCompute(model, torch.float32)
    engine = Engine(compute, _config(root, start), group=group, model_id=kind)
    if group.rank == corrupt_rank:
        _corrupt_every_slot(engine)
    engine.keep_logits = {r.rid for r in requests}
    try:
        out = engine.run(requests, check=True)
    finally:
        engine.close()
    assert engine.cache.disk is not None
    return {
        "payload": {rid: f.payload for rid, f in out.items()},
        "logits": {rid: f.logits for rid, f in out.items()},
        "cached": {rid: f.cached_len for rid, f in out.items()},
        "errors": [f.error for f in out.values() if f.error],
        "l3_hits": engine.hit_tokens[Tier.L3],
        "spilled": engine.cache.disk.stats.spilled_pages,
        "reloaded": engine.cache.disk.stats.reloaded_pages,
        "verify_failures": engine.cache.disk.store.stats().verify_failures,
        "digest": (engine.cache.allocator.digest(), engine.cache.tree.digest()),
    }


def _exact(result: dict[str, Any], requests: list[Request]) -> None:
    assert not result["errors"]
    for r in requests:
        expected = synthetic_payload(torch.from_numpy(r.tokens.astype(np.int64)), 8)
        assert torch.equal(torch.as_tensor(result["payload"][r.rid]), expected), r.rid


def test_cp2_hits_from_disk_with_exact_bytes_then_reloads_after_a_restart(tmp_path: Path) -> None:
    root = str(tmp_path / "l3")
    requests = builtin(1000, seed=11, n_requests=80)
    ranks = run_ranks(2, _run, ("none", root, "clear", requests, -1), timeout_s=TIMEOUT_S)
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert ranks[0]["l3_hits"] > 0 and all(r["spilled"] > 0 for r in ranks)
    _exact(ranks[0], requests)
    # A restart with `load`: the first request's prefix comes back from both ranks' slabs.
    again = [Request(1000, requests[-1].tokens)]
    ranks = run_ranks(2, _run, ("none", root, "load", again, -1), timeout_s=TIMEOUT_S)
    assert ranks[0]["cached"][1000] == ranks[0]["l3_hits"] > 0
    assert all(r["reloaded"] > 0 for r in ranks)
    _exact(ranks[0], again)


def test_cp2_a_corrupt_rank_fails_the_reload_on_every_rank(tmp_path: Path) -> None:
    root = str(tmp_path / "l3")
    requests = builtin(1000, seed=11, n_requests=60)
    run_ranks(2, _run, ("none", root, "clear", requests, -1), timeout_s=TIMEOUT_S)
    again = [Request(1000, requests[-1].tokens)]
    ranks = run_ranks(2, _run, ("none", root, "load", again, 1), timeout_s=TIMEOUT_S)
    assert ranks[1]["verify_failures"] > 0 and ranks[0]["verify_failures"] == 0
    assert ranks[0]["l3_hits"] == 0 and ranks[0]["reloaded"] == ranks[1]["reloaded"] == 0
    _exact(ranks[0], again)  # computed instead, every byte right


def test_cp2_model_logits_after_a_disk_round_trip_equal_uncached(tmp_path: Path) -> None:
    requests = builtin(512, seed=12, n_requests=40)
    ranks = run_ranks(
        2, _run, ("tiny", str(tmp_path / "l3"), "clear", requests, -1), timeout_s=TIMEOUT_S
    )
    assert ranks[0]["l3_hits"] > 0
    _, model = load_model("tiny", dtype="float32", seed=0)
    compute = ModelCompute(model, torch.float32)
    solo = EngineConfig(page_size=16, pool_tokens=640, chunk_size=64, max_batch_tokens=128)
    hit = [r for r in requests if ranks[0]["cached"][r.rid] > 0][-10:]
    assert hit
    for r in hit:
        fresh = recompute_uncached(compute, solo, r)
        got = torch.as_tensor(ranks[0]["logits"][r.rid])
        assert float((fresh - got).abs().max()) <= 1e-4, r.rid


def _drain_mid_lookup(group: Group, root: str, request: Request) -> dict[str, Any]:
    torch.set_num_threads(1)
    engine = Engine(SyntheticCompute(8, 1000), _config(root, "load"), group=group, model_id="none")
    engine.keep_logits = {request.rid}
    try:
        engine.add(request)
        engine.step()  # the lookup waits for the next frontier
        engine.drain()  # gives it up: nothing reserved, nothing in flight
        held = engine.cache.disk.held_pages if engine.cache.disk else -1
        engine.check()
        out = engine.run([], check=True)
    finally:
        engine.close()
    return {"held": held, "payload": {rid: f.payload for rid, f in out.items()}, "errors": []}


def test_cp2_drain_gives_up_a_pending_lookup(tmp_path: Path) -> None:
    root = str(tmp_path / "l3")
    requests = builtin(1000, seed=11, n_requests=40)
    run_ranks(2, _run, ("none", root, "clear", requests, -1), timeout_s=TIMEOUT_S)
    again = Request(1000, requests[-1].tokens)
    ranks = run_ranks(2, _drain_mid_lookup, (root, again), timeout_s=TIMEOUT_S)
    assert [r["held"] for r in ranks] == [0, 0]
    _exact(ranks[0], [again])


def test_cp2_the_same_l3_replay_twice_gives_identical_counts(tmp_path: Path) -> None:
    requests = builtin(1000, seed=5, n_requests=60)
    runs = [
        run_ranks(2, _run, ("none", str(tmp_path / d), "clear", requests, -1), timeout_s=TIMEOUT_S)
        for d in ("a", "b")
    ]
    keys = ("l3_hits", "spilled", "reloaded", "digest", "cached")
    for rank in (0, 1):
        assert {k: runs[0][rank][k] for k in keys} == {k: runs[1][rank][k] for k in keys}
    assert runs[0][0]["l3_hits"] > 0
