"""Tests for kvstrata.config and the error hierarchy in kvstrata.errors."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvstrata import errors
from kvstrata.config import CacheConfig, KVLayout, PayloadSpec, PoolConfig
from kvstrata.errors import ConfigError

BAD_POSITIVE = [0, -1, True, False, 1.5, "16", None]


def test_cache_config_defaults_are_valid_and_frozen() -> None:
    cfg = CacheConfig()
    assert (cfg.page_size, cfg.cp_size, cfg.eviction) == (16, 1, "lru")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 4  # type: ignore[misc]


@pytest.mark.parametrize("bad", BAD_POSITIVE)
def test_cache_config_rejects_bad_page_size(bad: object) -> None:
    with pytest.raises(ConfigError, match="page_size"):
        CacheConfig(page_size=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", BAD_POSITIVE)
def test_cache_config_rejects_bad_cp_size(bad: object) -> None:
    with pytest.raises(ConfigError, match="cp_size"):
        CacheConfig(cp_size=bad)  # type: ignore[arg-type]


def test_cache_config_rejects_unknown_policy() -> None:
    with pytest.raises(ConfigError, match="eviction"):
        CacheConfig(eviction="fifo")


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, math.nan])
def test_cache_config_rejects_bad_protected_fraction(bad: float) -> None:
    with pytest.raises(ConfigError, match="protected_fraction"):
        CacheConfig(eviction="slru", protected_fraction=bad)


def test_payload_spec_token_bytes() -> None:
    assert PayloadSpec("k", (8, 64), "float16").token_bytes == 8 * 64 * 2
    assert PayloadSpec("latent", (512,), "bfloat16").token_bytes == 1024
    assert PayloadSpec("q", (3,), "int8").token_bytes == 3


@pytest.mark.parametrize("name", ["", "1k", "a-b", "k v"])
def test_payload_spec_rejects_bad_name(name: str) -> None:
    with pytest.raises(ConfigError, match="name"):
        PayloadSpec(name, (4,))


@pytest.mark.parametrize("shape", [(), (0,), (2, -1), (True,), (2.0,)])
def test_payload_spec_rejects_bad_shape(shape: tuple[object, ...]) -> None:
    with pytest.raises(ConfigError, match="token_shape"):
        PayloadSpec("k", shape)  # type: ignore[arg-type]


def test_payload_spec_rejects_bad_dtype() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        PayloadSpec("k", (4,), "float64")


def test_kv_layout_page_bytes_and_lookup() -> None:
    k = PayloadSpec("k", (2, 8), "float16")
    v = PayloadSpec("v", (2, 8), "float16")
    layout = KVLayout(num_layers=3, payloads=(k, v))
    assert layout.page_bytes(16) == 16 * 3 * (32 + 32)
    assert layout.payload("v") is v
    with pytest.raises(ConfigError, match="no payload named 'x'"):
        layout.payload("x")


def test_kv_layout_rejects_bad_values() -> None:
    k = PayloadSpec("k", (4,))
    with pytest.raises(ConfigError, match="num_layers"):
        KVLayout(num_layers=0, payloads=(k,))
    with pytest.raises(ConfigError, match="at least one payload"):
        KVLayout(num_layers=1)
    with pytest.raises(ConfigError, match="unique"):
        KVLayout(num_layers=1, payloads=(k, PayloadSpec("k", (8,))))


def test_pool_config_needs_one_page_per_lane() -> None:
    with pytest.raises(ConfigError, match="one page per lane"):
        PoolConfig(num_pages=2, cp_size=4)
    with pytest.raises(ConfigError):
        PoolConfig(num_pages=0)
    with pytest.raises(ConfigError, match="cp_size"):
        PoolConfig(num_pages=8, cp_size=0)
    assert PoolConfig(num_pages=4, cp_size=4).slots_per_rank == 1


@pytest.mark.parametrize(
    ("num_pages", "cp_size", "slots"), [(5, 2, 3), (8, 4, 2), (7, 1, 7), (9, 8, 2)]
)
def test_pool_config_slots_per_rank(num_pages: int, cp_size: int, slots: int) -> None:
    assert PoolConfig(num_pages=num_pages, cp_size=cp_size).slots_per_rank == slots


def test_pool_config_rejects_bool_num_pages() -> None:
    with pytest.raises(ConfigError):
        PoolConfig(num_pages=True)


def test_error_hierarchy() -> None:
    assert issubclass(errors.InvalidTokensError, errors.ConfigError)
    assert issubclass(errors.ConfigError, ValueError)
    for name in (
        "ConfigError",
        "CapacityError",
        "AllocatorError",
        "DoubleFreeError",
        "ForeignPageError",
        "UnknownPageError",
        "TreeInvariantError",
        "CheckpointError",
        "UnsupportedArchitectureError",
        "WorkloadError",
        "RequestError",
    ):
        assert issubclass(getattr(errors, name), errors.KVStrataError), name
    for name in ("DoubleFreeError", "ForeignPageError", "UnknownPageError"):
        assert issubclass(getattr(errors, name), errors.AllocatorError), name
