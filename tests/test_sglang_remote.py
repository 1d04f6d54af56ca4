"""The SGLang backend with the shared Redis tier behind its disk (``"remote"`` in the extra
config): two backend instances with their own disk directories ("two hosts") on one real
redis-server (tests/redis_rig.py), driven in the order SGLang's cache controller calls them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from redis_rig import RedisCluster, RedisServer
from sglang_rig import (
    PAGE,
    attach,
    backup,
    expected,
    mha_pool,
    prefetch,
    read_past_a_bad_page,
    same,
    storage_config,
)

from kvstrata.cli import main
from kvstrata.errors import ConfigError
from kvstrata.integrations.sglang import KvstrataStorage
from kvstrata.integrations.sglang.pages import key_hash
from kvstrata.integrations.sglang.settings import BackendSettings
from kvstrata.tiers.disk_format import SLOT_HEADER_BYTES
from kvstrata.tiers.remote.values import page_key

KEYS = [f"{i:064x}" for i in range(150)]  # two controller batches: 128 + 22
TIMEOUT_MS = 300
#: The longest a call may take against a dead or paused store: every round trip of a fetch is
#: bounded by the socket timeout and the breaker answers the rest (RemotePages.io_timeout_s).
BOUND_S = 4 * TIMEOUT_MS / 1e3 + 1.0


def host(root: Path, url: str, **extra: Any) -> tuple[KvstrataStorage, Any]:
    """One "host": a backend over its own disk directory, with the shared tier at ``url``."""
    pool = mha_pool(pages=160)
    extra.setdefault("remote_gib", 0.25)
    config = storage_config(root, start="clear", remote=url, remote_timeout_ms=TIMEOUT_MS, **extra)
    return attach(config, pool), pool


def published(backend: KvstrataStorage) -> None:
    """Wait until every page the backend staged was sent (or skipped)."""
    assert backend.shared is not None and backend.shared.flush(30)


def stats(backend: KvstrataStorage) -> dict[str, int]:
    return backend.get_stats().kvstrata  # type: ignore[no-any-return]


def test_a_second_host_reads_what_the_first_wrote(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    a, pool_a = host(tmp_path / "a", redis_server.url)
    b, pool_b = host(tmp_path / "b", redis_server.url)
    assert b.batch_exists(KEYS) == 0
    assert all(backup(a, pool_a, KEYS, "a"))
    published(a)
    assert stats(a)["remote_pages_written"] == len(KEYS)
    assert stats(a)["remote_publish_staged"] == len(KEYS)
    # b's disk is empty: every page comes from Redis, byte for byte.
    hit, got = prefetch(b, pool_b, KEYS)
    assert hit == len(KEYS) and same(got, expected(pool_b, KEYS, "a"))
    assert b.disk_stats().used_slots == 0
    s = stats(b)
    assert s["exists_remote"] == len(KEYS) and s["get_remote_hits"] == len(KEYS)
    assert s["remote_hits"] == len(KEYS) and s["remote_verify_failures"] == 0
    # Pages b backs up itself are read from its disk; the run goes disk, Redis, disk, Redis.
    assert all(backup(b, pool_b, KEYS[20:30] + KEYS[140:], "a"))
    published(b)
    assert stats(b)["remote_pages_written"] == 0  # a had published them all already
    hit, got = prefetch(b, pool_b, KEYS)
    assert hit == len(KEYS) and same(got, expected(pool_b, KEYS, "a"))
    s = stats(b)
    assert s["get_remote_hits"] == 2 * len(KEYS) - 20 and s["disk_pages_read"] == 20
    b.shared.check()  # type: ignore[union-attr]
    a.close()
    b.close()
    for root in ("a", "b"):
        assert main(["disk", "check", str(tmp_path / root)]) == 0


def test_a_bad_value_in_redis_stops_the_run_at_that_page(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    keys = KEYS[:12]
    a, pool_a = host(tmp_path / "a", redis_server.url)
    b, pool_b = host(tmp_path / "b", redis_server.url)
    assert all(backup(a, pool_a, keys, "a"))
    published(a)
    # One flipped payload bit in page 5's V value (right length, right header: only the CRC).
    assert a.store is not None
    key = page_key(a.store.namespace, 0, key_hash(keys[5]), 1)
    client = redis.Redis.from_url(redis_server.url)
    value = bytearray(client.get(key))  # type: ignore[arg-type]
    value[SLOT_HEADER_BYTES + 100] ^= 0x04
    client.set(key, bytes(value))
    assert b.batch_exists(keys) == 12  # existence only: values are checked when read
    read_past_a_bad_page(b, pool_b, keys, "a", bad=5, untouched=False)
    want = expected(pool_b, keys, "a")
    assert stats(b)["remote_verify_failures"] == 1
    assert b.batch_exists(keys) == 5  # the bad page's keys were deleted before the call returned
    hit, got = prefetch(b, pool_b, keys)
    assert hit == 5 and same(got, want[:5])
    # The first host backs the page up again (SGLang recomputed it): whole in Redis once more.
    assert all(backup(a, pool_a, keys[5:6], "a"))
    published(a)
    hit, got = prefetch(b, pool_b, keys)
    assert hit == 12 and same(got, want)
    a.close()
    b.close()


def _quick(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_a_dead_or_paused_redis_is_a_quick_counted_miss(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    keys = KEYS[:40]
    a, pool_a = host(tmp_path / "a", redis_server.url)
    assert all(backup(a, pool_a, keys, "a"))
    published(a)
    for fault in ("paused", "killed"):
        b, pool_b = host(tmp_path / f"b-{fault}", redis_server.url)  # connects on first use
        if fault == "paused":
            redis_server.pause()
        else:
            redis_server.kill()
        try:
            # Paused: the read meets the store first (its GETs time out); killed: the query.
            if fault == "killed":
                found, took = _quick(b.batch_exists, keys)
                assert found == 0 and took < 2 * TIMEOUT_MS / 1e3 + 0.5, took
            host_pages = pool_b.alloc(len(keys) * PAGE)
            before = pool_b.get_data_page(int(host_pages[0])).view(torch.uint8).clone()
            ok, took = _quick(b.batch_get_v1, keys, host_pages)
            assert ok == [False] * len(keys) and took < BOUND_S, took
            page = pool_b.get_data_page(int(host_pages[0])).view(torch.uint8)
            assert torch.equal(page, before)  # nothing was copied into SGLang's page
            pool_b.free(host_pages)
            found, took = _quick(b.batch_exists, keys)
            assert found == 0 and took < 2 * TIMEOUT_MS / 1e3 + 0.5, took
            s = stats(b)
            assert s["remote_timeouts"] + s["remote_connection_errors"] >= 1, s
            assert s["remote_breaker_opens"] == 1 and s["get_remote_hits"] == 0
        finally:
            redis_server.resume()
        b.close()
    # The first host keeps backing up to its disk while Redis is gone: durable, not published.
    more = KEYS[40:60]
    ok, took = _quick(backup, a, pool_a, more, "a")
    assert all(ok)
    published(a)
    assert stats(a)["remote_skipped_unavailable"] == len(more)
    hit, got = prefetch(a, pool_a, keys + more)
    assert hit == len(keys + more) and same(got, expected(pool_a, keys + more, "a"))
    a.close()
    assert main(["disk", "check", str(tmp_path / "a")]) == 0


def test_two_ranks_and_two_models_stay_apart_in_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    keys = KEYS[:20]
    url = redis_server.url
    w0, p0 = host(tmp_path / "w0", url, tp_rank=0, tp_size=2)
    w1, p1 = host(tmp_path / "w1", url, tp_rank=1, tp_size=2)
    r0, q0 = host(tmp_path / "r0", url, tp_rank=0, tp_size=2)
    r1, q1 = host(tmp_path / "r1", url, tp_rank=1, tp_size=2)
    other, q2 = host(tmp_path / "m", url, model="other/model", tp_rank=0, tp_size=2)
    assert all(backup(w0, p0, keys, "tp0"))
    published(w0)
    assert r1.batch_exists(keys) == 0 and other.batch_exists(keys) == 0
    assert r0.batch_exists(keys) == len(keys)
    assert all(backup(w1, p1, keys, "tp1"))
    published(w1)
    assert stats(w1)["remote_pages_present"] == 0  # the same keys, another rank's pages
    for reader, pool, salt in ((r0, q0, "tp0"), (r1, q1, "tp1")):
        hit, got = prefetch(reader, pool, keys)
        assert hit == len(keys) and same(got, expected(pool, keys, salt))
    assert other.batch_exists(keys) == 0
    for backend in (w0, w1, r0, r1, other):
        backend.close()


def test_a_full_staging_drops_publishes_not_backups(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Publishing never waits for Redis on SGLang's thread: pages that find no free staging
    slot are durable on disk, not published, and counted."""
    a, pool_a = host(tmp_path / "a", redis_server.url, remote_staging_mib=4 * 32 / 1024)
    assert a.shared is not None and a.shared.staging.num_slots == 4
    b, pool_b = host(tmp_path / "b", redis_server.url)
    keys = KEYS[:40]
    assert all(backup(a, pool_a, keys, "a"))
    published(a)
    s = stats(a)
    assert s["remote_publish_staged"] == 4 and s["remote_publish_dropped"] == 36
    assert b.batch_exists(keys) == 4
    a.shared.check()
    a.close()
    b.close()


def test_remote_keys_are_checked_before_any_io(tmp_path: Path) -> None:
    base = {"dir": str(tmp_path), "budget_gib": 1}
    url = "redis://127.0.0.1:1/0"
    for extra, match in (
        ({**base, "remote": url}, '"remote_gib"'),
        ({**base, "remote_gib": 1}, "needs"),
        ({**base, "remote": "http://x", "remote_gib": 1}, "remote store URL"),
        ({**base, "remote": url, "remote_gib": 1, "remote_timeout_ms": 0}, "remote_timeout_ms"),
        ({**base, "remote": url, "remote_gib": 1, "remote_min_hits": "2"}, "must be a int"),
        ({**base, "remote": url, "remote_gib": -1}, "remote_gib"),
    ):
        with pytest.raises(ConfigError, match=match):
            BackendSettings.from_extra_config(extra)
    settings = BackendSettings.from_extra_config(
        {**base, "remote": "redis://127.0.0.1:7000/2", "remote_gib": 2, "remote_min_hits": 2},
        {"REDIS_PASSWORD": "s3cret"},
    )
    remote = settings.remote
    assert remote is not None and remote.address.db == 2 and remote.min_hits == 2
    assert remote.password == "s3cret" and "s3cret" not in repr(settings)
    assert remote.budget_bytes == 2 << 30 and remote.timeout_s == 0.5
    assert remote.tune_malloc is False  # SGLang's process keeps its own allocator settings
    assert BackendSettings.from_extra_config(base).remote is None


def test_a_redis_cluster_serves_the_same(tmp_path: Path, redis_cluster: RedisCluster) -> None:
    redis_cluster.flush()
    keys = KEYS[:30]
    a, pool_a = host(tmp_path / "a", redis_cluster.url)
    b, pool_b = host(tmp_path / "b", redis_cluster.url)
    assert all(backup(a, pool_a, keys, "a"))
    published(a)
    hit, got = prefetch(b, pool_b, keys)
    assert hit == len(keys) and same(got, expected(pool_b, keys, "a"))
    assert stats(b)["get_remote_hits"] == len(keys)
    a.close()
    b.close()
