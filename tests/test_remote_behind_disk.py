"""The shared tier behind the disk (``--l3-dir`` and ``--remote`` together: L1 -> L2 -> L3 disk
-> Redis): a second instance with an empty disk serves the first one's prefixes from the shared
store, pages the disk's GC dropped come back from it, a disk page that fails verification is
fetched from it instead, the same replay twice gives the same counts, and a dead store leaves
the disk serving, counted, never a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import disk_rig
import numpy as np
import pytest
import torch
from disk_rig import NS, engine_counts
from helpers import run_all
from redis_rig import RedisServer

from kvstrata.engine import Engine, EngineConfig
from kvstrata.model.compute import SyntheticCompute, synthetic_payload
from kvstrata.residency import Tier
from kvstrata.tiers.disk_format import SlabFile
from kvstrata.tiers.remote.behind_disk import RemoteBehindDisk
from kvstrata.tiers.remote.config import RemoteConfig
from kvstrata.tiers.remote.store import RemoteStore
from kvstrata.tiers.remote.tier import RemotePages
from kvstrata.workloads import Request, builtin


def config(tmp: Path, url: str, disk: str = "l3", **kw: object) -> EngineConfig:
    base = {
        "page_size": 16,
        "pool_tokens": 640,
        "chunk_size": 64,
        "max_batch_tokens": 128,
        "max_batch_requests": 4,
        "l2_tokens": 640,
        "l3_dir": str(tmp / disk),
        "l3_gib": 0.05,
        "remote_url": url,
        "remote_gib": 0.05,
        "remote_timeout_ms": 300.0,
        **kw,
    }
    return EngineConfig(**base)  # type: ignore[arg-type]


def engine(cfg: EngineConfig) -> Engine:
    return Engine(SyntheticCompute(8, 4096), cfg, model_id="none:8")


def pair(e: Engine) -> dict[str, int]:
    """What the disk + shared store pair counted."""
    store = e.cache.disk.store if e.cache.disk is not None else None
    assert isinstance(store, RemoteBehindDisk)
    return store.counters.snapshot()


def exact(out: dict[int, Any], requests: list[Request]) -> None:
    for r in requests:
        expected = synthetic_payload(torch.from_numpy(r.tokens.astype(np.int64)), 8)
        f = out[r.rid]
        assert f.error is None and torch.equal(f.payload, expected), r.rid


def one_by_one(e: Engine, requests: list[Request]) -> dict[int, Any]:
    """Each request alone (a step's reloads would otherwise compete for the small L2)."""
    out: dict[int, Any] = {}
    for r in requests:
        out |= run_all(e, [r], check=True)
    return out


def evicting(n: int, tokens: int = 160, start: int = 1) -> list[Request]:
    """``n`` prompts of ``tokens`` tokens, no two sharing a page."""
    return [
        Request(i, np.arange(start + i * tokens, start + (i + 1) * tokens, dtype=np.uint32))
        for i in range(n)
    ]


@pytest.fixture
def stores(redis_server: RedisServer, tmp_path: Path) -> Iterator[RemoteBehindDisk]:
    """A disk store of 100 pages with a shared store behind it (the disk rig's namespace)."""
    remote = RemoteStore(NS, 0, RemoteConfig(redis_server.url, 1 << 26, timeout_s=0.3))
    both = RemoteBehindDisk(disk_rig.open_store(tmp_path / "disk"), RemotePages(remote))
    try:
        yield both
    finally:
        both.close()


def _reload(both: RemoteBehindDisk, ticket: int, pages: list[bytes], pool: Any) -> tuple[bool, ...]:
    assert both.reload(ticket, pages, pool, list(range(len(pages))))
    assert both.flush(30)
    done = both.poll().reloaded
    assert [d.ticket for d in done] == [ticket]
    both.check()
    return done[0].ok


def test_the_pair_finds_and_reads_the_longest_prefix_across_both(
    stores: RemoteBehindDisk,
) -> None:
    h = disk_rig.hashes(10)
    disk_rig.spill_all(stores.disk, disk_rig.host_pool(), h[:4], ticket=1)
    pool = disk_rig.host_pool()
    for slot, page in enumerate(h):
        disk_rig.write_page(pool, slot, page)
    remote = stores.remote.remote
    assert remote.publish(2, [(page, slot, 1) for slot, page in enumerate(h[:8])], pool)
    assert remote.flush(30)
    remote.poll()
    assert stores.lookup(h) == 8 and stores.lookup(h[:3]) == 3 and stores.lookup(h[8:]) == 0
    into = disk_rig.host_pool()
    assert _reload(stores, 3, h[:8], into) == (True,) * 8
    assert all(disk_rig.read_page(into, i) == disk_rig.expected_page(into, h[i]) for i in range(8))
    c = stores.counters.snapshot()
    assert (c["disk_pages"], c["remote_pages"], c["reloads_split"]) == (4, 4, 1)
    assert (c["reloaded_from_disk"], c["reloaded_from_remote"]) == (4, 4)
    # A disk that refuses the read: every page is asked of the shared store.
    stores.disk.reload = lambda *args: False  # type: ignore[method-assign]
    assert _reload(stores, 4, h[:8], disk_rig.host_pool()) == (True,) * 8
    c = stores.counters.snapshot()
    assert c["disk_refused"] == 1 and c["reloaded_from_remote"] == 4 + 8
    # Nothing to read on this rank (under CP it may own none of the pages): the disk answers.
    del stores.disk.reload
    assert _reload(stores, 5, [], disk_rig.host_pool()) == ()


def test_a_spill_goes_to_both_and_is_released_once_neither_reads_it(
    stores: RemoteBehindDisk,
) -> None:
    h = disk_rig.hashes(6, seed=1)
    pool = disk_rig.host_pool()
    for slot, page in enumerate(h):
        disk_rig.write_page(pool, slot, page)
    assert stores.spill(1, [(page, slot, 1) for slot, page in enumerate(h[:3])], pool)
    assert stores.flush(30)
    news = stores.poll()
    assert news.released == (1,) and [d.ticket for d in news.spilled] == [1]
    assert stores.disk.lookup(h[:3]) == 3 and stores.remote.lookup(h[:3]) == 3
    # The disk refuses: the shared store still takes the pages, released once it sent them.
    stores.disk.spill = lambda *args: False  # type: ignore[method-assign]
    assert stores.spill(2, [(page, slot, 1) for slot, page in enumerate(h)][3:], pool)
    assert stores.flush(30)
    assert stores.poll().released == (2,)
    assert stores.remote.lookup(h) == 6 and stores.disk.lookup(h[3:]) == 0
    assert stores.counters.snapshot()["spills_remote_only"] == 1
    stores.check()
    # Both refuse: nothing holds the host slots.
    stores.remote.spill = lambda *args: False  # type: ignore[method-assign]
    assert not stores.spill(3, [(h[0], 0, 1)], pool)
    assert stores.poll().released == ()


def test_a_second_instance_with_an_empty_disk_hits_the_first_ones_prefix(
    store_url: str, tmp_path: Path
) -> None:
    """Two hosts, each with its own disk and L2, on one Redis or one 3-node Redis Cluster: the
    second's every page of the first one's prefix comes from the shared store, exact."""
    prompt = np.arange(1, 401, dtype=np.uint32)
    first = engine(config(tmp_path, store_url, "a"))
    try:
        run_all(first, [Request(0, prompt)], check=True)
    finally:
        first.close()
    assert first.cache.disk_store is not None
    assert first.cache.disk_store.stats().pages_written == 25
    assert first.cache.remote is not None and first.cache.remote.stats().pages_written == 25
    # Its own disk, empty, and its own L2: every page comes from the shared store.
    second = engine(config(tmp_path, store_url, "b"))
    longer = np.concatenate([prompt, [7, 8, 9]]).astype(np.uint32)
    second.keep_logits = {1}
    try:
        out = run_all(second, [Request(1, longer)], check=True)
    finally:
        second.close()
    assert out[1].cached_len == 400 and second.hit_tokens[Tier.L3] == 400
    exact(out, [Request(1, longer)])
    assert second.cache.remote is not None
    remote = second.cache.remote.stats()
    assert remote.hits == 25 and remote.misses == 0 and remote.verify_failures == 0
    counts = pair(second)
    assert counts["reloaded_from_remote"] == 25 and counts["reloaded_from_disk"] == 0
    assert second.cache.disk_store is not None
    assert second.cache.disk_store.stats().pages_read == 0


def _two_passes(cfg: EngineConfig, n: int = 16) -> tuple[Engine, dict[int, int]]:
    """``n`` prompts of 10 pages, then the same again one at a time: the engine, and every
    request's cached tokens (payloads checked)."""
    requests = evicting(n)
    again = [Request(100 + r.rid, r.tokens) for r in requests]
    e = engine(cfg)
    e.keep_logits = {r.rid for r in requests + again}
    try:
        out = run_all(e, requests, check=True)
        out |= one_by_one(e, again)
    finally:
        e.close()
    exact(out, requests + again)
    return e, {rid: f.cached_len for rid, f in out.items()}


def test_pages_the_disk_dropped_come_back_from_the_shared_store(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A disk of 25 slots under 16 prompts of 10 pages drops most of them (GC); with the shared
    store behind it, the second pass hits as a disk that kept everything does."""
    small = {"pool_tokens": 320, "l2_tokens": 320, "l3_gib": 0.0001}
    e, cached = _two_passes(config(tmp_path, redis_server.url, "a", **small))
    _, alone = _two_passes(config(tmp_path, redis_server.url, "b", **small, remote_url=None))
    _, large = _two_passes(
        config(tmp_path, redis_server.url, "c", **small | {"l3_gib": 0.05}, remote_url=None)
    )
    assert cached == large and sum(cached.values()) > sum(alone.values())
    assert e.cache.disk_store is not None and e.cache.disk_store.stats().gc_reclaimed > 0
    counts = pair(e)
    assert counts["reloaded_from_remote"] > 0
    assert e.hit_tokens[Tier.L3] > 0


def test_a_disk_page_that_fails_verification_is_fetched_from_the_shared_store(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = evicting(6)
    again = [Request(100 + r.rid, r.tokens) for r in requests[:2]]
    e = engine(config(tmp_path, redis_server.url, pool_tokens=320, l2_tokens=320))
    e.keep_logits = {r.rid for r in requests + again}
    try:
        out = run_all(e, requests, check=True)
        # From now on every slot the disk reads has a flipped payload byte (a bit rot).
        read_one, read_run = SlabFile.read_slot, SlabFile.read_slots

        def one(self: SlabFile, slot: int, buf: memoryview) -> Any:
            got = read_one(self, slot, buf)
            buf[100] ^= 0xFF
            return got

        def run(self: SlabFile, first: int, bufs: list[memoryview]) -> Any:
            got = read_run(self, first, bufs)
            for buf in bufs:
                buf[100] ^= 0xFF
            return got

        monkeypatch.setattr(SlabFile, "read_slot", one)
        monkeypatch.setattr(SlabFile, "read_slots", run)
        out |= one_by_one(e, again)
    finally:
        e.close()
    exact(out, requests + again)
    assert e.cache.disk_store is not None and e.cache.disk_store.stats().verify_failures > 0
    counts = pair(e)
    assert counts["disk_retried"] > 0 and counts["reloaded_from_remote"] > 0
    assert counts["reloaded_from_disk"] == 0
    assert sum(out[r.rid].cached_len for r in again) == sum(len(r.tokens) - 16 for r in again)


def _counts(tmp: Path, server: RedisServer, requests: list[Request]) -> dict[str, object]:
    server.cli("flushall")
    cfg = config(tmp, server.url, pool_tokens=320, l2_tokens=320, l3_gib=0.0002)
    e = engine(cfg)
    try:
        e.run(requests)
    finally:
        e.close()
    assert e.cache.remote is not None
    remote = e.cache.remote.stats()
    return engine_counts(e) | {
        "pair": pair(e),
        "remote": (remote.pages_written, remote.hits, remote.misses, remote.lookup_found),
    }


def test_the_same_replay_twice_gives_identical_counts(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    requests = builtin(1000, seed=3, n_requests=120)
    first = _counts(tmp_path / "a", redis_server, requests)
    second = _counts(tmp_path / "b", redis_server, requests)
    assert first == second
    assert first["hit_tokens"][Tier.L3] > 0  # type: ignore[index]
    assert first["pair"]["reloaded_from_remote"] > 0  # type: ignore[index]


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_a_dead_store_leaves_the_disk_serving_counted_never_a_hang(
    redis_server: RedisServer, tmp_path: Path, fault: str
) -> None:
    """The store is killed (or stopped past its timeout) after the first 6 prompts: the rest,
    and the first 4 again, finish with exact bytes and hit as with the disk alone, the faults
    counted, no hang (the breaker answers at once between its probes)."""
    requests = evicting(12)
    again = [Request(100 + r.rid, r.tokens) for r in requests[:4]]
    small = {"pool_tokens": 320, "l2_tokens": 320}
    e = engine(config(tmp_path, redis_server.url, "a", **small))
    e.keep_logits = {r.rid for r in requests + again}
    try:
        out = run_all(e, requests[:6], check=True)
        if fault == "kill":
            redis_server.kill()
        else:
            redis_server.pause()
        t0 = time.monotonic()
        out |= run_all(e, requests[6:], check=True)
        out |= one_by_one(e, again)
        elapsed = time.monotonic() - t0
    finally:
        redis_server.resume()
        e.close()
    exact(out, requests + again)
    assert elapsed < 15, elapsed
    alone = engine(config(tmp_path, redis_server.url, "b", **small, remote_url=None))
    try:
        base = run_all(alone, requests, check=True) | one_by_one(alone, again)
    finally:
        alone.close()
    assert {r: f.cached_len for r, f in out.items()} == {r: f.cached_len for r, f in base.items()}
    assert e.cache.remote is not None
    remote = e.cache.remote.stats()
    assert remote.breaker_opens >= 1 and remote.hits == 0 and remote.verify_failures == 0
    assert (remote.connection_errors if fault == "kill" else remote.timeouts) >= 1
    counts = pair(e)
    assert counts["reloaded_from_disk"] > 0 and counts["reloaded_from_remote"] == 0
    assert e.hit_tokens[Tier.L3] == alone.hit_tokens[Tier.L3] > 0


def test_a_replay_reports_the_disk_and_the_shared_store_apart(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    from test_metrics import Scraper, value

    from kvstrata.replay import ReplayConfig, run_replay

    scraper = Scraper(at_step=-1)
    cfg = ReplayConfig(
        workload="builtin",
        model="none",
        kv_width=8,
        vocab_size=1000,
        engine=config(tmp_path, redis_server.url, pool_tokens=320, l2_tokens=320, l3_gib=0.0002),
        metrics_port=0,
    )
    summary = run_replay(cfg, progress=False, observers=[scraper])
    doc = summary.to_json()
    l3, remote = doc["tiers"]["l3"], doc["tiers"]["remote"]
    assert l3["pages_written"] > 0 and l3["io_mode"] in ("direct", "buffered")
    assert remote["pages_written"] > 0 and remote["hits"] > 0
    assert remote["reloaded_pages"] == l3["engine_from_remote_pages"] > 0
    assert l3["engine_reloaded_pages"] >= l3["engine_from_disk_pages"] + remote["reloaded_pages"]
    assert doc["config"]["l3_dir"] and doc["config"]["remote"] == redis_server.url
    table = summary.table()
    assert "disk: spilled / reloaded pages" in table and "remote: published" in table
    assert "L3 reloaded pages from disk / remote" in table
    end = scraper.end
    assert value(end, "kvstrata_pages_total", tier="l3", lane="0") > 0
    assert value(end, "kvstrata_pages_total", tier="remote", lane="0") > 0
    assert value(end, "kvstrata_disk_total", event="hit_tokens") == doc["hit_tokens_by_tier"]["l3"]
    # scraped before the summary: the last spill may still be writing then
    assert (
        0 < value(end, "kvstrata_disk_store_total", counter="pages_written") <= l3["pages_written"]
    )
    assert value(end, "kvstrata_remote_store_total", counter="hits") == remote["hits"]


def _replay(url: str, l3_dir: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    argv = [sys.executable, "-m", "kvstrata", "replay", "--model", "none", "--json"]
    argv += ["--trace", "synthetic:0:30", "--l1-tokens", "8192", "--l2-tokens", "8192"]
    argv += ["--l3-dir", str(l3_dir), "--l3-gib", "0.0005"]
    argv += ["--remote", url, "--remote-gib", "1", "--remote-timeout-ms", "300", *extra]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multiproc
def test_cp2_instances_behind_their_disks_share_one_store_with_digests_checked(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two instances of two CP ranks each, each with its own small disk: the ranks agree on the
    pair's count through the frontier (digests compared every step), and the second instance
    reads from the shared store what its disk never held, with the right bytes."""
    extra = ["--cp", "2", "--check-digests", "--verify", "5"]
    rc1, first = _replay(redis_server.url, tmp_path / "a", *extra)
    rc2, second = _replay(redis_server.url, tmp_path / "b", *extra)
    assert rc1 == rc2 == 0 and first["failed"] == second["failed"] == 0
    assert second["verify"]["ok"] and second["verify"]["payload_mismatched_bytes"] == 0
    assert second["hit_tokens_by_tier"]["l3"] > first["hit_tokens_by_tier"]["l3"]
    assert second["tiers"]["remote"]["reloaded_pages"] > 0
    assert first["tiers"]["l3"]["pages_written"] > 0
