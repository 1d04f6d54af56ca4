"""Review of the SGLang backend's shared tier (branch review24): defects found, each as a test
that failed before its fix (or documents what is left, marked)."""

from __future__ import annotations

import time
from pathlib import Path

from redis_rig import RedisServer
from sglang_rig import backup, expected, prefetch, same
from test_sglang_remote import KEYS, host, published, stats


def test_pages_under_remote_min_hits_take_no_staging(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A page the store's admission will skip (fewer backups than remote_min_hits) is not
    copied into staging: the copy is wasted work on SGLang's backup thread, it holds staging
    slots that admissible pages then miss, and publish_staged counted pages never published."""
    a, pool_a = host(tmp_path / "a", redis_server.url, remote_min_hits=2)
    keys = KEYS[:8]
    assert all(backup(a, pool_a, keys, "a"))
    published(a)
    s = stats(a)
    assert s["remote_publish_staged"] == 0, s
    assert s["remote_skipped_admission"] == len(keys), s
    assert all(backup(a, pool_a, keys, "a"))  # the second backup: admitted
    published(a)
    s = stats(a)
    assert s["remote_publish_staged"] == len(keys) and s["remote_pages_written"] == len(keys)
    assert s["remote_skipped_admission"] == len(keys), s
    assert a.shared is not None
    a.shared.check()
    a.close()


def test_clear_empties_the_shared_tier_too(tmp_path: Path, redis_server: RedisServer) -> None:
    """SGLang's /clear_hicache_storage_backend calls clear(): the disk is emptied and so are
    this rank's pages in Redis, so the next prefetch serves nothing from either."""
    a, pool_a = host(tmp_path / "a", redis_server.url)
    keys = KEYS[:8]
    assert all(backup(a, pool_a, keys, "a"))
    published(a)
    assert a.clear()
    assert a.disk_stats().used_slots == 0
    found = a.batch_exists(keys)
    a.close()
    assert found == 0, f"clear() emptied the disk; {found} pages still come from Redis"


def test_a_fetch_does_not_wait_behind_a_budget_recount(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The budget's SCAN walks the whole keyspace (every namespace, every host); it runs on a
    thread of its own, so SGLang's prefetch never waits for it (it did on the store threads:
    2.6 s at 3 M keys, against a 2.2 s bound)."""
    keys = KEYS[:8]
    b, pool_b = host(tmp_path / "b", redis_server.url)
    assert all(backup(b, pool_b, keys, "a"))
    published(b)
    # Another tenant's keys (3 M: the SCAN takes about 3 s on loopback).
    script = "for i=1,3000000 do redis.call('SET','other:'..i,'x') end return 1"
    assert redis_server.cli("EVAL", script, "0").strip() == "1"
    a, pool_a = host(tmp_path / "a", redis_server.url)
    # Two first publishes: each store thread is now in the budget's first count (one SCANs,
    # the other waits for its lock).
    assert all(backup(a, pool_a, KEYS[100:101], "a"))
    assert all(backup(a, pool_a, KEYS[101:102], "a"))
    t0 = time.monotonic()
    hit, got = prefetch(a, pool_a, keys)
    took = time.monotonic() - t0
    assert hit == len(keys) and same(got, expected(pool_a, keys, "a"))
    s = stats(a)
    a.close()
    b.close()
    bound = 4 * 0.3 + 1.0
    assert took < bound, (took, s["remote_recounts"], s["remote_fetch_slow"])
