"""Tests for kvstrata.tiers.remote.store against real Redis servers (tests/redis_rig.py):
round trips on one server and on a 3-node cluster, bad values, a killed, restarted and paused
store, LRU eviction under maxmemory, the budget, TTL, admission and credentials."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import redis
import torch
from disk_rig import NS, PAGE, expected_page, hashes, host_pool, read_page, wait_until, write_page
from redis_rig import RedisCluster, RedisServer

from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.errors import ConfigError
from kvstrata.tiers.host_pool import HostPool
from kvstrata.tiers.page_hash import Namespace
from kvstrata.tiers.remote import RemoteConfig, RemotePoll, RemoteStore
from kvstrata.tiers.remote.client import Breaker
from kvstrata.tiers.remote.values import page_key, value_bytes

#: Socket timeout of the fault tests: short, so that they stay quick.
TIMEOUT_S = 0.3
BREAKER_S = 0.5
PAGE_BYTES = sum(value_bytes(NS, k) for k in range(len(NS.payloads)))
SENTINEL = 0xA5


def open_store(url: str, ns: Namespace = NS, rank: int = 0, **kw: Any) -> RemoteStore:
    kw.setdefault("budget_bytes", 1 << 30)
    kw.setdefault("timeout_s", TIMEOUT_S)
    kw.setdefault("breaker_s", BREAKER_S)
    return RemoteStore(ns, rank, RemoteConfig(url, **kw))


def publish_all(store: RemoteStore, pool: HostPool, pages: list[bytes], ticket: int) -> RemotePoll:
    for slot, h in enumerate(pages):
        write_page(pool, slot, h)
    assert store.publish(ticket, [(h, slot, 1) for slot, h in enumerate(pages)], pool)
    assert store.flush(30)
    return store.poll()


def fetch_all(
    store: RemoteStore, pool: HostPool, pages: list[bytes], ticket: int, first_slot: int = 0
) -> tuple[bool, ...]:
    slots = list(range(first_slot, first_slot + len(pages)))
    assert store.fetch(ticket, pages, pool, slots)
    assert store.flush(30)
    done = store.poll().fetched
    assert [d.ticket for d in done] == [ticket]
    return done[0].ok


def fill(pool: HostPool) -> None:
    for t in pool.tensors():
        t.view(torch.uint8).fill_(SENTINEL)


def untouched(pool: HostPool, slot: int) -> bool:
    return set(read_page(pool, slot)) == {SENTINEL}


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2])
def test_round_trip_every_payload_byte(store_url: str, window: int) -> None:
    """40 pages in 6 batches of 7 over 3 connections: 2 batches a connection, sent one at a
    time or (standalone) both at once (``publish_window``; the test below shows they are)."""
    src, dst = host_pool(), host_pool()
    pages = hashes(40)
    with open_store(store_url, batch_pages=7, publish_window=window) as store:
        done = publish_all(store, src, pages, ticket=3)
        assert done.released == (3,) and len(done.published) == 1
        pub = done.published[0]
        assert pub.written == tuple(pages) and not pub.failed and not pub.present
        assert store.lookup(pages) == 40
        assert store.lookup([*pages[:5], hashes(1, seed=9)[0], *pages[5:]]) == 5
        fill(dst)
        assert fetch_all(store, dst, pages, ticket=4, first_slot=10) == (True,) * 40
        for i, h in enumerate(pages):
            assert read_page(dst, 10 + i) == expected_page(dst, h)
        stats = store.stats()
        assert stats.hits == stats.pages_written == 40 and stats.misses == 0
        assert stats.bytes_written == stats.bytes_read == 40 * PAGE_BYTES == stats.used_bytes
        assert stats.kind == ("cluster" if "cluster" in store_url else "standalone")
        store.check()
        # Publishing again writes nothing: every page is there (another instance's, say).
        again = publish_all(store, src, pages, ticket=5).published[0]
        assert again.present == tuple(pages) and not again.written
        assert store.stats().pages_present == 40 and store.stats().used_bytes == 40 * PAGE_BYTES


def test_two_instances_share_pages(store_url: str) -> None:
    """What a fleet relies on: instance B serves what instance A published, and a store of
    another rank or namespace does not see it."""
    pages = hashes(12)
    with open_store(store_url) as a:
        publish_all(a, host_pool(), pages, ticket=1)
    dst = host_pool()
    with open_store(store_url) as b:
        assert b.lookup(pages) == 12
        assert fetch_all(b, dst, pages, ticket=1) == (True,) * 12
        assert all(read_page(dst, i) == expected_page(dst, h) for i, h in enumerate(pages))
    ns2 = Namespace.for_layout("another-model", NS.layout, PAGE)
    cp2 = Namespace.for_layout(NS.model_id, NS.layout, PAGE, cp_size=2)
    for ns, rank in ((ns2, 0), (cp2, 0), (cp2, 1)):
        with open_store(store_url, ns=ns, rank=rank) as other:
            assert other.lookup(pages) == 0


def test_mla_geometry_and_layer_first_pool(redis_server: RedisServer) -> None:
    layout = KVLayout(2, (PayloadSpec("kv_latent", (576,), "bfloat16"),))
    ns = Namespace.for_layout("mla", layout, PAGE)
    src = host_pool(layout=layout, host_layout="layer_first")
    dst = host_pool(layout=layout)
    pages = hashes(5, ns=ns)
    layered = host_pool(layout=layout, host_layout="layer_first")  # copied in one part a layer
    with open_store(redis_server.url, ns=ns) as store:
        publish_all(store, src, pages, ticket=1)
        assert fetch_all(store, dst, pages, ticket=2) == (True,) * 5
        assert all(read_page(dst, i) == expected_page(dst, h) for i, h in enumerate(pages))
        assert fetch_all(store, layered, pages, ticket=3, first_slot=2) == (True,) * 5
        assert all(
            read_page(layered, 2 + i) == expected_page(layered, h) for i, h in enumerate(pages)
        )


def test_admission_ttl_and_refusals(redis_server: RedisServer) -> None:
    pool, pages = host_pool(), hashes(4)
    for slot, h in enumerate(pages):
        write_page(pool, slot, h)
    with open_store(redis_server.url, min_hits=2, ttl_s=100, max_tickets=1) as store:
        hits = [1, 2, 3, 0]
        assert store.publish(
            1, [(h, s, n) for s, (h, n) in enumerate(zip(pages, hits, strict=True))], pool
        )
        assert not store.publish(2, [(pages[0], 0, 5)], pool)  # one ticket open at most
        assert not store.fetch(3, pages[:1], pool, [9])
        assert store.flush(30)
        done = store.poll().published[0]
        assert done.written == (pages[1], pages[2]) and done.skipped == (pages[0], pages[3])
        ttl = client(redis_server.url).ttl(page_key(NS, 0, pages[1], 0))
        assert 90 < ttl <= 100
        stats = store.stats()
        assert stats.skipped_admission == 2
        assert stats.publishes_refused == 1 and stats.fetches_refused == 1
    with pytest.raises(ConfigError, match="holds no page"):
        open_store(redis_server.url, budget_bytes=PAGE_BYTES - 1)
    with pytest.raises(ConfigError, match="host slots"):
        open_store(redis_server.url).publish(1, [(pages[0], 10_000, 1)], pool)
    with open_store(redis_server.url) as store:
        # a reply no GET gets (a proxy's +OK, an integer): a miss, never a crash nor a delete
        assert not store._take_page(pages[0], [True, memoryview(b"x")])
        assert not store._take_page(pages[0], [7, None])
        assert store.stats().verify_failures == 0
    with open_store(redis_server.url) as store, pytest.raises(ConfigError, match="distinct"):
        # a value lands in its slot before it is checked: a later bad page would overwrite
        # an earlier one already reported read
        store.fetch(4, pages[:2], pool, [5, 5])


# -- bad values --------------------------------------------------------------------------------


def test_bad_values_are_misses_never_bytes(redis_server: RedisServer) -> None:
    """Garbage, a flipped payload bit, another page's value, another namespace's value and a
    value of another geometry: each is a counted miss, its keys deleted, never reported read;
    the good pages around them still come back."""
    src, dst = host_pool(), host_pool()
    pages = hashes(6)
    r = client(redis_server.url)
    ns_other = Namespace.for_layout("another-model", NS.layout, PAGE)
    small = KVLayout(NS.num_layers, (PayloadSpec("k", (1, 8), "bfloat16"), *NS.payloads[1:]))
    ns_small = Namespace.for_layout(NS.model_id, small, PAGE)
    with open_store(redis_server.url) as store:
        publish_all(store, src, pages, ticket=1)
        # Values as another namespace and another geometry would have written them.
        for ns, layout in ((ns_other, NS.layout), (ns_small, small)):
            pool = host_pool(layout=layout)
            with open_store(redis_server.url, ns=ns) as other:
                foreign = hashes(6, ns=ns)
                publish_all(other, pool, foreign, ticket=1)
            if ns is ns_other:
                r.set(page_key(NS, 0, pages[3], 1), r.get(page_key(ns, 0, foreign[3], 1)))
            else:  # same page hash on purpose: only the length and header give it away
                r.set(page_key(NS, 0, pages[4], 0), r.get(page_key(ns, 0, foreign[4], 0))[:-16])
        k0 = page_key(NS, 0, pages[0], 0)
        r.set(k0, b"garbage")
        flipped = bytearray(r.get(page_key(NS, 0, pages[1], 2)))
        flipped[-1] ^= 1
        r.set(page_key(NS, 0, pages[1], 2), bytes(flipped))
        r.set(page_key(NS, 0, pages[2], 0), r.get(page_key(NS, 0, pages[5], 0)))  # another page
        fill(dst)
        ok = fetch_all(store, dst, pages, ticket=2)
        assert ok == (False, False, False, False, False, True)
        # A value is read straight into its host slot (the fetch's own, reserved for it): a bad
        # page's slot may hold its bytes, but the page is a miss and nothing uses that slot.
        assert read_page(dst, 5) == expected_page(dst, pages[5])
        stats = store.stats()
        assert stats.verify_failures == 5 and stats.misses == 5 and stats.hits == 1
        assert not r.exists(k0), "a bad value's keys are deleted"
        assert store.lookup(pages) == 0
        # ... so the next publish writes them again, whole.
        again = publish_all(store, src, pages, ticket=3).published[0]
        assert set(again.written) == set(pages[:5]) and again.present == (pages[5],)
        assert fetch_all(store, dst, pages, ticket=4) == (True,) * 6


# -- a store that dies, comes back, or stops answering -----------------------------------------


def test_killed_and_restarted_store(redis_server: RedisServer) -> None:
    pool, dst, pages = host_pool(), host_pool(), hashes(8)
    with open_store(redis_server.url) as store:
        publish_all(store, pool, pages[:4], ticket=1)
        redis_server.kill()
        t0 = time.monotonic()
        assert store.lookup(pages) == 0
        assert fetch_all(store, dst, pages[:4], ticket=2) == (False,) * 4
        done = publish_all(store, pool, pages[4:], ticket=3)
        assert done.released == (3,) and done.published[0].failed == tuple(pages[4:])
        for _ in range(20):  # within the breaker's interval: answered at once
            assert store.lookup(pages) == 0
        assert time.monotonic() - t0 < BREAKER_S
        stats = store.stats()
        assert stats.breaker_opens == 1 and stats.connection_errors == 1
        assert stats.breaker_open and stats.breaker_skips >= 20
        assert stats.read_unavailable == 4 and stats.skipped_unavailable == 4
        redis_server.start()  # empty: nothing was persisted
        time.sleep(BREAKER_S)
        assert store.lookup(pages) == 0 and not store.stats().breaker_open
        done = publish_all(store, pool, pages, ticket=4).published[0]
        assert done.written == tuple(pages)
        assert fetch_all(store, dst, pages, ticket=5) == (True,) * 8
        assert all(read_page(dst, i) == expected_page(dst, h) for i, h in enumerate(pages))
        store.check()


def test_paused_store_costs_one_timeout_per_interval(redis_server: RedisServer) -> None:
    pool, dst, pages = host_pool(), host_pool(), hashes(6)
    with open_store(redis_server.url) as store:
        publish_all(store, pool, pages, ticket=1)
        with redis_server.paused():
            t0 = time.monotonic()
            assert store.lookup(pages) == 0  # waits at most twice the timeout
            first = time.monotonic() - t0
            assert first < 2 * TIMEOUT_S + 0.3
            t1 = time.monotonic()
            for ticket in range(2, 6):
                assert fetch_all(store, dst, pages, ticket) == (False,) * 6
                assert store.lookup(pages) == 0
            done = publish_all(store, pool, hashes(3, seed=5), ticket=9)
            assert done.published[0].failed and not done.published[0].written
            assert time.monotonic() - t1 < 0.2, "calls inside the interval wait for nothing"
            stats = store.stats()
            assert stats.breaker_opens == 1 and stats.timeouts >= 1
        time.sleep(BREAKER_S + TIMEOUT_S)  # the lookup's own round trip has timed out by now
        assert store.lookup(pages) == 6
        assert fetch_all(store, dst, pages, ticket=10) == (True,) * 6
        assert all(read_page(dst, i) == expected_page(dst, h) for i, h in enumerate(pages))


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_fault_mid_transfer_ends_every_ticket(redis_server: RedisServer, fault: str) -> None:
    """The server dies (or stops) while publishes and fetches are in flight: every ticket still
    ends, within the timeout's bound, with its pages counted as written, failed or missed, and
    no fetched page holds a wrong byte."""
    layout = KVLayout(
        4, (PayloadSpec("k", (8, 64), "bfloat16"), PayloadSpec("v", (8, 64), "bfloat16"))
    )
    ns = Namespace.for_layout("mid-run", layout, PAGE)
    pool, dst = host_pool(300, layout=layout), host_pool(300, layout=layout)
    pages = hashes(300, ns=ns)
    for slot, h in enumerate(pages):
        write_page(pool, slot, h)
    with open_store(redis_server.url, ns=ns, batch_pages=2) as store:
        assert store.publish(1, [(h, i, 1) for i, h in enumerate(pages[:150])], pool)
        assert store.flush(30)
        store.poll()
        fill(dst)
        assert store.publish(2, [(h, i, 1) for i, h in enumerate(pages[150:], 150)], pool)
        assert store.fetch(3, pages[:150], dst, list(range(150)))
        t0 = time.monotonic()
        redis_server.kill() if fault == "kill" else redis_server.pause()
        try:
            assert store.flush(10 * TIMEOUT_S + 5), "a ticket never ended"
            assert time.monotonic() - t0 < 10 * TIMEOUT_S + 5
            done = store.poll()
        finally:
            redis_server.resume()
        (pub,), (got,) = done.published, done.fetched
        assert done.released == (2,)
        assert len(pub.written) + len(pub.present) + len(pub.failed) == 150
        for i, good in enumerate(got.ok):
            assert not good or read_page(dst, i) == expected_page(dst, pages[i])
        stats = store.stats()
        assert stats.hits + stats.misses == 150 and stats.verify_failures == 0
        assert pub.failed, "the fault came after the transfer: nothing was tested"
        assert stats.breaker_opens >= 1 and stats.timeouts + stats.connection_errors >= 1
        store.check()


def test_breaker_probes_once_per_interval() -> None:
    now = [0.0]
    b = Breaker(5.0, clock=lambda: now[0])
    assert b.allow() and not b.blocked()
    assert b.failure() and not b.failure()  # opened once; a second failure extends it
    assert b.blocked() and not b.allow()
    now[0] = 5.1
    assert not b.blocked() and b.allow()  # the probe
    assert not b.allow() and b.blocked()  # only one at a time
    assert b.failure()  # the probe failed: open again (counted)
    now[0] = 10.2
    assert b.allow()
    b.success()
    assert b.allow() and b.allow() and not b.is_open


def test_cluster_node_killed_is_bounded(redis_cluster: RedisCluster) -> None:
    """One node of three dies: calls fail within a bounded time and are counted; the pages on
    the surviving nodes come back once the breaker closes, verified."""
    redis_cluster.flush()
    pool, dst, pages = host_pool(), host_pool(), hashes(30)
    store = open_store(redis_cluster.url)
    try:
        publish_all(store, pool, pages, ticket=1)
        redis_cluster.nodes[1].kill()
        t0 = time.monotonic()
        ok = fetch_all(store, dst, pages, ticket=2)
        assert time.monotonic() - t0 < 10 * TIMEOUT_S + 2
        assert store.stats().breaker_opens >= 1 and not all(ok)
        time.sleep(BREAKER_S)
        ok = fetch_all(store, dst, pages, ticket=3)
        for i, good in enumerate(ok):
            assert not good or read_page(dst, i) == expected_page(dst, pages[i])
    finally:
        store.close()
        redis_cluster.nodes[1].start()  # it keeps its nodes.conf: it rejoins with its slots
        wait_until(
            lambda: all("cluster_state:ok" in n.cli("cluster", "info") for n in redis_cluster.nodes)
        )


# -- the store's memory and this namespace's share ---------------------------------------------


def test_lru_eviction_under_load_is_misses_never_wrong_bytes(tmp_path: Any) -> None:
    try:
        server = RedisServer(
            tmp_path / "lru", None, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"
        )
    except Exception as why:  # noqa: BLE001 - the rig's own reason
        pytest.skip(str(why))
    layout = KVLayout(
        4, (PayloadSpec("k", (8, 64), "bfloat16"), PayloadSpec("v", (8, 64), "bfloat16"))
    )
    ns = Namespace.for_layout("lru", layout, PAGE)
    try:
        pool, dst = host_pool(400, layout=layout), host_pool(400, layout=layout)
        pages = hashes(400, ns=ns)  # 400 pages x 32 KiB: three times maxmemory
        with open_store(server.url, ns=ns, batch_pages=16) as store:
            done = publish_all(store, pool, pages, ticket=1).published[0]
            assert len(done.written) == 400
            fill(dst)
            ok = fetch_all(store, dst, pages, ticket=2)
            hits = sum(ok)
            assert 0 < hits < 400, "maxmemory evicted some pages and kept others"
            for i, good in enumerate(ok):
                assert not good or read_page(dst, i) == expected_page(dst, pages[i])
            stats = store.stats()
            assert stats.verify_failures == 0 and stats.misses == 400 - hits
            assert store.lookup(pages) <= hits
    finally:
        server.kill()


def test_budget_is_this_namespaces_share(redis_server: RedisServer) -> None:
    pool, pages = host_pool(), hashes(8)
    with open_store(redis_server.url, budget_bytes=3 * PAGE_BYTES) as store:
        done = publish_all(store, pool, pages[:5], ticket=1).published[0]
        assert done.written == tuple(pages[:3]) and done.failed == tuple(pages[3:5])
        assert store.stats().skipped_budget == 2 and store.stats().writes_skipped == 2
        assert store.stats().used_bytes == 3 * PAGE_BYTES
    # A new instance counts what the namespace holds before it writes.
    with open_store(redis_server.url, budget_bytes=4 * PAGE_BYTES) as store:
        done = publish_all(store, pool, pages, ticket=1).published[0]
        assert done.present == tuple(pages[:3]) and done.written == (pages[3],)
        stats = store.stats()
        assert stats.recounts == 1 and stats.skipped_budget == 4
    # Redis evicting keys frees the share again (counted at the next write that would not fit).
    client(redis_server.url).delete(*[page_key(NS, 0, pages[0], k) for k in range(3)])
    with open_store(redis_server.url, budget_bytes=4 * PAGE_BYTES) as store:
        done = publish_all(store, pool, pages[4:5], ticket=1).published[0]
        assert done.written == (pages[4],)
    # Another namespace has a share of its own.
    ns2 = Namespace.for_layout("another-model", NS.layout, PAGE)
    with open_store(redis_server.url, ns=ns2, budget_bytes=3 * PAGE_BYTES) as store:
        other = hashes(3, ns=ns2)
        assert publish_all(store, pool, other, ticket=1).published[0].written == tuple(other)


# -- credentials -------------------------------------------------------------------------------


def test_password_from_url_or_config_never_shown(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "s3cr3t-Pa55"
    try:
        server = RedisServer(tmp_path / "auth", None, "--requirepass", secret)
    except Exception as why:  # noqa: BLE001 - the rig's own reason
        pytest.skip(str(why))
    pool, pages = host_pool(), hashes(3)
    url = f"redis://127.0.0.1:{server.port}/0"
    try:
        caplog.set_level(logging.DEBUG)
        for store in (
            open_store(f"redis://:{secret}@127.0.0.1:{server.port}/0"),
            open_store(url, password=secret),
        ):
            with store:
                publish_all(store, pool, pages, ticket=1)
                assert store.lookup(pages) == 3
                shown = " ".join(
                    [repr(store.config), repr(store.address), store.stats().url, str(store.stats())]
                )
                assert secret not in shown and "***" in store.stats().url
        with open_store(url, password="Wr0ng-Pa55") as store:
            assert store.lookup(pages) == 0
            assert store.stats().connection_errors == 1
        assert secret not in caplog.text and "Wr0ng-Pa55" not in caplog.text
    finally:
        server.kill()


def test_a_write_lost_after_the_budget_check_is_counted_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store goes away between a batch's EXISTS and its SETs: the pages the budget already
    refused count as skipped for the budget only, the rest as unavailable."""
    from kvstrata.tiers.remote.client import RedisClient, StoreUnavailable

    def lost(self: RedisClient, batches: object, ttl_s: int, done: object, window: int) -> None:
        raise StoreUnavailable("connection lost", timeout=False)

    monkeypatch.setattr(RedisClient, "set_new_stream", lost)
    pool, pages = host_pool(), hashes(3)
    with open_store(redis_server.url, budget_bytes=PAGE_BYTES) as store:
        done = publish_all(store, pool, pages, ticket=1).published[0]
        assert done.failed == tuple(pages)
        stats = store.stats()
        assert stats.skipped_budget == 2 and stats.skipped_unavailable == 1
        assert stats.writes_skipped == 3 and stats.used_bytes == 0
        store.check()


# -- round trips per ticket and a cluster's slot map -------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 3])
def test_a_publish_keeps_its_window_of_batches_in_flight(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """One connection, a batch of one page per round trip: each send is followed by the replies
    of the batch ``window`` sends back, so ``window`` batches are in flight at once."""
    from kvstrata.tiers.remote import wire

    events: list[str] = []
    send, read = wire._send, wire.Call.read

    def logged_send(sock: Any, chunks: Any) -> None:
        events.append("send")
        send(sock, chunks)

    def logged_read(call: Any, reader: Any) -> None:
        read(call, reader)
        events.append("read")

    monkeypatch.setattr(wire, "_send", logged_send)
    monkeypatch.setattr(wire.Call, "read", logged_read)
    pool, pages = host_pool(), hashes(5)
    with open_store(redis_server.url, batch_pages=1, threads=1, publish_window=window) as store:
        done = publish_all(store, pool, pages, ticket=1).published[0]
        assert done.written == tuple(pages)
    sets = events[events.index("read") + 1 :]  # after the ticket's EXISTS round trip
    want = ["send"] * min(window, 5)
    for b in range(5):
        want += ["read"] + (["send"] if b + window < 5 else [])
    assert sets == want


def test_a_bug_while_publishing_is_raised_not_counted_as_an_outage(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault of ours while making the values (here: the codec) reaches ``poll()`` as itself;
    the store is not reported down and the breaker stays closed, also when that call was the
    breaker's probe."""
    from kvstrata.tiers.remote.values import PageCodec

    made = 0
    encode = PageCodec.encode

    def broken(self: PageCodec, *args: Any) -> Any:
        nonlocal made
        made += 1
        if made > 2:  # past the first batch
            raise ValueError("a bug in the codec")
        return encode(self, *args)

    monkeypatch.setattr(PageCodec, "encode", broken)
    pool, pages = host_pool(), hashes(3)
    for slot, h in enumerate(pages):
        write_page(pool, slot, h)
    with open_store(redis_server.url, batch_pages=1, threads=1) as store:
        store.breaker.failure()  # open; the publish below is the probe once the interval ends
        time.sleep(BREAKER_S * 1.5)
        assert store.publish(1, [(h, slot, 1) for slot, h in enumerate(pages)], pool)
        store.flush(30)
        with pytest.raises(ValueError, match="a bug in the codec"):
            store.poll()
        stats = store.stats()
        assert stats.connection_errors == 0 and stats.timeouts == 0
        assert not store.breaker.blocked(), "the probe was never given back"


@pytest.mark.parametrize("window", [1, 2])
def test_a_connection_lost_mid_stream_keeps_the_acknowledged_batches(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """The real reader loses the connection right after the first batch's replies: that batch
    counts as written, the rest as unavailable (the ``window`` batches sent after it reached the
    server, which stored them: in the store, not counted), and no budget stays reserved."""
    from kvstrata.tiers.remote import wire

    replies = 0
    reply = wire._Reader.reply
    values = len(NS.payloads)

    def cut(self: Any, into: Any) -> Any:
        nonlocal replies
        replies += 1
        if replies > 6 * values:  # the EXISTS pipeline's (a key each), then batch 0's values
            raise redis.exceptions.ConnectionError("connection lost")
        return reply(self, into)

    monkeypatch.setattr(wire._Reader, "reply", cut)
    pool, pages = host_pool(), hashes(5)
    with open_store(redis_server.url, batch_pages=1, threads=1, publish_window=window) as store:
        done = publish_all(store, pool, pages, ticket=1).published[0]
        assert done.written == tuple(pages[:1]) and done.failed == tuple(pages[1:])
        stats = store.stats()
        assert stats.pages_written == 1 and stats.skipped_unavailable == 4
        assert stats.used_bytes == PAGE_BYTES and stats.connection_errors == 1
        store.check()
    monkeypatch.undo()
    with open_store(redis_server.url) as store:
        assert store.lookup(pages) == 1 + window


def test_a_publish_asks_which_pages_exist_once_per_ticket(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One EXISTS pipeline for a ticket's 40 pages, not one per batch of 4: the round trips a
    publish waits on before its first SET."""
    from kvstrata.tiers.remote.client import RedisClient

    calls: list[int] = []
    exists = RedisClient.exists

    def counted(self: RedisClient, keys: list[bytes]) -> list[bool | object]:
        calls.append(len(keys))
        return exists(self, keys)  # type: ignore[return-value]

    monkeypatch.setattr(RedisClient, "exists", counted)
    pool, pages = host_pool(), hashes(40)
    with open_store(redis_server.url, batch_pages=4) as store:
        done = publish_all(store, pool, pages, ticket=1).published[0]
        assert done.written == tuple(pages)
        assert calls == [40 * len(NS.payloads)]
        again = publish_all(store, pool, pages[:10], ticket=2).published[0]
        assert again.present == tuple(pages[:10]) and calls[1:] == [10 * len(NS.payloads)]


def test_a_moved_slot_is_a_miss_then_the_map_is_read_again(redis_cluster: RedisCluster) -> None:
    """The client's slot map sends a page's GETs to the wrong node (as after a resharding):
    that page is a miss this once, not an error and never wrong bytes, and the map is read
    again, so the next fetch finds it."""
    redis_cluster.flush()
    src, dst, pages = host_pool(), host_pool(), hashes(6)
    with open_store(redis_cluster.url) as store:
        publish_all(store, src, pages, ticket=1)
        assert store._client is not None
        r = store._client._redis
        slot = r.keyslot(page_key(NS, 0, pages[2], 0))
        right = r.nodes_manager.slots_cache[slot][0]
        wrong = next(n for n in r.get_primaries() if n.name != right.name)
        r.nodes_manager.slots_cache[slot] = [wrong]
        fill(dst)
        ok = fetch_all(store, dst, pages, ticket=2)
        assert ok == (True, True, False, True, True, True) and untouched(dst, 2)
        assert store.stats().verify_failures == 0 and store.stats().breaker_opens == 0
        assert r.nodes_manager.slots_cache[slot][0].name == right.name
        assert fetch_all(store, dst, pages, ticket=3) == (True,) * 6
        assert read_page(dst, 2) == expected_page(dst, pages[2])
