"""What the SGLang backend reads from ``--hicache-storage-backend-extra-config``.

::

    {"backend_name": "kvstrata", "module_path": "kvstrata.integrations.sglang",
     "class_name": "KvstrataStorage", "interface_v1": 1,
     "dir": "/nvme/kvstrata", "budget_gib": 200, "start": "load"}

``dir`` and one of ``budget_gib`` / ``budget_bytes`` are required; the budget is per rank (every
TP/PP/CP rank of the server preallocates its own slabs of that size under ``dir``). The other keys
are the disk tier's (:class:`~kvstrata.tiers.disk_config.DiskConfig`): ``start`` (``load``, the
default here, keeps what an earlier run wrote, verified; ``clear`` starts empty), ``min_hits``,
``read_threads``, ``write_threads``, ``io_mode``, ``staging_mib``, ``io_timeout_s``,
``high_watermark``, ``low_watermark``. A key that is neither SGLang's nor one of these is refused,
so a typo cannot silently fall back to a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...tiers.disk_config import DiskConfig

#: Keys SGLang itself reads from the same dict (the dynamic loader, the controller).
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
)
#: Keys passed through to DiskConfig under the same name, with their type.
_DISK_KEYS: dict[str, type] = {
    "start": str,
    "min_hits": int,
    "read_threads": int,
    "write_threads": int,
    "io_mode": str,
    "io_timeout_s": float,
    "high_watermark": float,
    "low_watermark": float,
}
OWN_KEYS = frozenset({"dir", "budget_gib", "budget_bytes", "staging_mib", *_DISK_KEYS})


@dataclass(frozen=True)
class BackendSettings:
    """The backend's configuration: the disk tier's, and which SGLang interface it serves."""

    disk: DiskConfig
    interface_v1: bool

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> BackendSettings:
        """Parse SGLang's extra config dict; raises ``ConfigError`` naming the key to change."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - SGLANG_KEYS - OWN_KEYS)
        if unknown:
            raise ConfigError(
                f"kvstrata storage backend: unknown extra config keys {unknown}; known: "
                f"{sorted(OWN_KEYS)} (and SGLang's {sorted(SGLANG_KEYS)})"
            )
        if not extra.get("dir"):
            raise ConfigError(
                'kvstrata storage backend: the extra config needs "dir", the directory of the '
                'disk tier (for example "dir": "/nvme/kvstrata")'
            )
        budget = _budget_bytes(extra)
        kw: dict[str, Any] = {"start": "load"}
        for key, kind in _DISK_KEYS.items():
            if key in extra:
                kw[key] = _typed(key, extra[key], kind)
        if "staging_mib" in extra:
            kw["staging_bytes"] = int(_typed("staging_mib", extra["staging_mib"], float) * 2**20)
        disk = DiskConfig(Path(str(extra["dir"])), budget, **kw)
        return cls(disk, bool(extra.get("interface_v1", 0)))


def _budget_bytes(extra: dict[str, Any]) -> int:
    if ("budget_gib" in extra) == ("budget_bytes" in extra):
        raise ConfigError(
            'kvstrata storage backend: give exactly one of "budget_gib" and "budget_bytes", the '
            "disk space each rank preallocates"
        )
    if "budget_bytes" in extra:
        return int(_typed("budget_bytes", extra["budget_bytes"], int))
    gib = float(_typed("budget_gib", extra["budget_gib"], float))
    if not gib > 0:
        raise ConfigError(f'kvstrata storage backend: "budget_gib" must be > 0, got {gib!r}')
    return int(gib * 2**30)


def _typed(key: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind`` (an int for a float key is fine; a bool or a string for a number is
    not: JSON configs are typed, and "4" for 4 is a mistake worth a message)."""
    if kind is str:
        ok = isinstance(value, str)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(
            f'kvstrata storage backend: "{key}" must be a {kind.__name__}, got {value!r}'
        )
    return value
