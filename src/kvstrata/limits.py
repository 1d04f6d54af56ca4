"""What this machine can hold: checks made once, before anything large is allocated.

The commands check here that a torch device exists and that the bytes a pool or a model would take
fit in the memory that device has available, so a flag that asks for more than the machine has is
refused with the numbers instead of ending in an allocator error, a swap storm or the OOM killer.
None of this feeds a structural decision of the cache (free memory differs between ranks); it only
decides whether to start at all.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import CapacityError, ConfigError

DEVICE_TYPES = ("cpu", "cuda")
#: Host bytes a PageAllocator holds per logical page: an int64 free stack, a bool free map and an
#: int64 scratch (25 bytes), rounded up for the temporaries of its construction.
ALLOCATOR_BYTES_PER_PAGE = 32
_MEMINFO = Path("/proc/meminfo")


def check_device(name: str) -> torch.device:
    """The torch device ``name`` names, or :class:`ConfigError` saying why it cannot be used."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {name!r} is not a torch device; use cpu or cuda") from None
    if device.type not in DEVICE_TYPES:
        raise ConfigError(f"device {name!r}: kvstrata runs on cpu or cuda, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but this machine has no CUDA device")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"device {name!r} asked for, but this machine has {count} CUDA device(s): "
                f"cuda:0 to cuda:{count - 1}"
            )
    return device


def available_bytes(device: torch.device) -> int | None:
    """Memory that ``device`` can still give out now, or None where the platform does not say."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: ask the C library below
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def gib(num_bytes: float) -> str:
    """``num_bytes`` as a short human figure in GiB."""
    return f"{num_bytes / 2**30:,.2f} GiB"


def check_fits(parts: Sequence[tuple[str, int]], device: torch.device, hint: str) -> None:
    """Raise :class:`CapacityError` when the ``(what, bytes)`` parts together exceed the memory
    ``device`` has available; the message lists every part and ends with ``hint``."""
    need = sum(num_bytes for _, num_bytes in parts)
    have = available_bytes(device)
    if have is None or need <= have:
        return
    nonzero = [(what, num_bytes) for what, num_bytes in parts if num_bytes]
    listed = " + ".join(f"{what} {gib(num_bytes)}" for what, num_bytes in nonzero)
    if len(nonzero) > 1:
        listed += f" = {gib(need)}"
    raise CapacityError(
        f"{listed} needed on {device.type}, but only {gib(have)} is available; {hint}"
    )
