"""Where a radix node's pages live: one state per node, never a bag of flags (docs/design.md).

Only ``DEVICE`` is used until the host and disk tiers land; the pending states mark a copy in flight,
which ``match_prefix`` never reports as a hit until the commit frontier covers it.
"""

from __future__ import annotations

import enum


class Residency(enum.Enum):
    DEVICE = "device"
    DEVICE_HOST = "device+host"
    HOST = "host"
    HOST_DISK = "host+disk"
    DISK = "disk"
    DEVICE_HOST_PENDING = "device+host(pending)"
    HOST_DISK_PENDING = "host+disk(pending)"

    @property
    def on_device(self) -> bool:
        return self in (Residency.DEVICE, Residency.DEVICE_HOST, Residency.DEVICE_HOST_PENDING)


class Tier(enum.IntEnum):
    """The three cache tiers, in the order a hit is served from."""

    # Hash as the int it is (Enum hashes its name in Python code): tiers key dicts on hot paths.
    __hash__ = int.__hash__

    L1 = 1  # device pool
    L2 = 2  # pinned host pool
    L3 = 3  # local disk
