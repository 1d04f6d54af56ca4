"""Tests for kvstrata.tiers.remote.config: URL forms, credentials, validation; and the key
format of kvstrata.tiers.remote.values."""

from __future__ import annotations

import pytest
from disk_rig import NS, hashes

from kvstrata.errors import ConfigError
from kvstrata.tiers.remote.config import RemoteConfig, parse_url, password_from_env
from kvstrata.tiers.remote.values import PageCodec, key_kind, page_key, rank_pattern, value_bytes


def test_url_forms() -> None:
    a = parse_url("redis://10.0.0.5:6380/3")
    assert (a.kind, a.nodes, a.db, a.password) == ("standalone", (("10.0.0.5", 6380),), 3, None)
    assert parse_url("redis://cache").nodes == (("cache", 6379),)
    c = parse_url("redis+cluster://h1:7000, h2:7001,[::1]:7002")
    assert c.kind == "cluster" and c.nodes == (("h1", 7000), ("h2", 7001), ("::1", 7002))
    assert c.shown == "redis+cluster://h1:7000,h2:7001,[::1]:7002"
    u = parse_url("redis://app:p%40ss%3Aword@h:1/0")
    assert (u.username, u.password) == ("app", "p@ss:word")
    assert u.shown == "redis://app:***@h:1/0"
    assert parse_url("redis://:pw@h:1", password="env").password == "pw"  # the URL's wins
    assert parse_url("redis://h:1", password="env").password == "env"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("http://h:1", "must look like"),
        ("h:6379", "must look like"),
        ("redis://h:0", "not in 1..65535"),
        ("redis://h:x", "not in 1..65535"),
        ("redis://h:1/db", "not a number"),
        ("redis://h1:1,h2:2", "Cluster seed nodes"),
        ("redis+cluster://h:1/2", "no databases"),
        ("redis://", "no host"),
        ("redis://:secret@:1", "host is missing"),
    ],
)
def test_bad_urls_say_what_to_write(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        parse_url(url)
    assert "secret" not in str(err.value)


def test_config_hides_the_password_and_validates() -> None:
    cfg = RemoteConfig("redis://:hunter2@h:1/0", budget_bytes=1 << 30, password="fromenv")
    assert cfg.address.password == "hunter2"
    assert "hunter2" not in repr(cfg) and "fromenv" not in repr(cfg)
    for bad in ({"budget_bytes": 0}, {"timeout_s": 0}, {"batch_pages": 0}, {"threads": 65}):
        with pytest.raises(ConfigError):
            RemoteConfig("redis://h:1", **{"budget_bytes": 1, **bad})  # type: ignore[arg-type]
    assert password_from_env({"REDISCLI_AUTH": "b"}) == "b"
    assert password_from_env({"REDIS_PASSWORD": "a", "REDISCLI_AUTH": "b"}) == "a"
    assert password_from_env({"REDIS_PASSWORD": ""}) is None


def test_keys_name_namespace_rank_page_and_payload() -> None:
    h = hashes(1)[0]
    key = page_key(NS, 1, h, 2)
    assert key == f"kvstrata:{NS.digest.hex()}:r1:{{{h.hex()}}}:2".encode()
    assert key_kind(key) == 2 and key_kind(b"other") is None
    assert rank_pattern(NS, 1) == f"kvstrata:{NS.digest.hex()}:r1:*"
    # One hash tag per page: a cluster keeps every payload of a page on one node.
    tags = {page_key(NS, 0, h, k).split(b"{")[1].split(b"}")[0] for k in range(3)}
    assert tags == {h.hex().encode()}


def test_the_stores_codec_makes_the_same_keys_and_lengths() -> None:
    codec = PageCodec(NS, 1)
    for h in hashes(3):
        assert codec.keys(h) == [page_key(NS, 1, h, k) for k in range(len(NS.payloads))]
    assert codec.value_len == [value_bytes(NS, k) for k in range(len(NS.payloads))]
