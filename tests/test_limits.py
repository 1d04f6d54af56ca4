"""Machine checks made before allocating: devices that exist, memory that fits."""

from __future__ import annotations

import pytest
import torch

from kvstrata import limits
from kvstrata.errors import CapacityError, ConfigError


def test_cpu_is_a_device() -> None:
    assert limits.check_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("", "not a torch device"),
        ("nonsense", "not a torch device"),
        ("cuda:x", "not a torch device"),
        ("meta", "runs on cpu or cuda, not meta"),
        ("mps", "runs on cpu or cuda, not mps"),
    ],
)
def test_bad_devices_are_named(name: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        limits.check_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_cuda_on_a_cpu_machine() -> None:
    with pytest.raises(ConfigError, match="has no CUDA device"):
        limits.check_device("cuda:1")


def test_available_bytes_of_this_machine() -> None:
    available = limits.available_bytes(torch.device("cpu"))
    assert available is None or available > 0


def test_check_fits_lists_the_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "available_bytes", lambda device: 3 * 2**30)
    limits.check_fits([("a", 2**30), ("b", 2 * 2**30)], torch.device("cpu"), "hint")  # fits
    with pytest.raises(CapacityError) as info:
        limits.check_fits([("pool", 3 * 2**30), ("weights", 2**29)], torch.device("cpu"), "lower X")
    assert str(info.value) == (
        "pool 3.00 GiB + weights 0.50 GiB = 3.50 GiB needed on cpu, but only 3.00 GiB is "
        "available; lower X"
    )


def test_check_fits_is_silent_where_memory_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "available_bytes", lambda device: None)
    limits.check_fits([("pool", 2**60)], torch.device("cpu"), "hint")
