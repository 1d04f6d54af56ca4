"""Tests for kvstrata.tiers.pool: the device pool's shapes, dtypes, aliasing and errors (CPU)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.errors import ConfigError
from kvstrata.tiers.pool import DevicePool, torch_dtype

PAGE_SIZE = 4
NUM_SLOTS = 5


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(
        num_layers=3,
        payloads=(
            PayloadSpec("k", (2, 8), "float16"),
            PayloadSpec("v", (2, 8), "float16"),
            PayloadSpec("draft_kv", (16,), "bfloat16"),
            PayloadSpec("scale", (1,), "float32"),
            PayloadSpec("q8", (3,), "int8"),
        ),
    )


@pytest.fixture
def pool(layout: KVLayout) -> DevicePool:
    return DevicePool(layout, PAGE_SIZE, NUM_SLOTS)


def test_buffer_shapes_and_dtypes(pool: DevicePool, layout: KVLayout) -> None:
    for spec in layout.payloads:
        for layer in range(layout.num_layers):
            buf = pool.buffer(spec.name, layer)
            assert buf.shape == (NUM_SLOTS, PAGE_SIZE, *spec.token_shape)
            assert buf.dtype == torch_dtype(spec.dtype)
            assert buf.device == torch.device("cpu")
            assert buf.is_contiguous()
            assert not buf.any()


def test_page_bytes_match_the_real_tensors(pool: DevicePool, layout: KVLayout) -> None:
    per_slot = sum(
        pool.buffer(spec.name, layer)[0].numel() * pool.buffer(spec.name, layer).element_size()
        for spec in layout.payloads
        for layer in range(layout.num_layers)
    )
    assert pool.page_bytes == per_slot == layout.page_bytes(PAGE_SIZE)
    assert pool.total_bytes == per_slot * NUM_SLOTS


def test_token_view_aliases_the_page_buffer(pool: DevicePool) -> None:
    buf = pool.buffer("k", 1)
    view = pool.token_view("k", 1)
    assert view.shape == (NUM_SLOTS * PAGE_SIZE, 2, 8)
    assert view.data_ptr() == buf.data_ptr()
    slot, token = 3, 2
    view[slot * PAGE_SIZE + token] = 7.0
    assert torch.all(buf[slot, token] == 7.0)
    assert int((buf != 0).sum()) == 2 * 8  # nothing else changed
    buf[0, 0, 1, 5] = -1.0
    assert view[0, 1, 5].item() == -1.0


def test_layers_and_payloads_do_not_share_storage(pool: DevicePool, layout: KVLayout) -> None:
    pool.buffer("v", 0).fill_(1.0)
    for spec in layout.payloads:
        for layer in range(layout.num_layers):
            if (spec.name, layer) != ("v", 0):
                assert not pool.buffer(spec.name, layer).any(), (spec.name, layer)


def test_bad_payload_name_is_a_config_error(pool: DevicePool) -> None:
    with pytest.raises(ConfigError, match="no payload 'nope'"):
        pool.buffer("nope", 0)
    with pytest.raises(ConfigError, match="no payload"):
        pool.token_view("K", 0)


@pytest.mark.parametrize(("page_size", "num_slots"), [(0, 4), (-1, 4), (4, 0), (4, -2)])
def test_bad_geometry_is_a_config_error(layout: KVLayout, page_size: int, num_slots: int) -> None:
    with pytest.raises(ConfigError):
        DevicePool(layout, page_size, num_slots)


def test_torch_dtype() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("uint8") is torch.uint8
    with pytest.raises(ConfigError, match="unknown dtype"):
        torch_dtype("float64")
