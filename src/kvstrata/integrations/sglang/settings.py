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

The shared Redis tier behind the disk (``shared.SharedPages``) takes ``remote``
(``redis://HOST:PORT[/DB]`` or ``redis+cluster://HOST:PORT[,HOST:PORT...]``; a password in the URL
or in ``REDIS_PASSWORD`` / ``REDISCLI_AUTH``) with ``remote_gib`` (this rank's share of the
store, required with it), and optionally ``remote_timeout_ms`` (socket timeout of every round
trip, 500), ``remote_min_hits`` (publish a page only on its N-th backup, 1) and
``remote_staging_mib`` (host memory a rank copies durable pages into for publishing, 1024).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...tiers.disk_config import DiskConfig
from ...tiers.remote.config import RemoteConfig, password_from_env

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
#: The shared tier's keys (``remote`` turns it on; the others need it).
REMOTE_KEYS = frozenset(
    {"remote", "remote_gib", "remote_timeout_ms", "remote_min_hits", "remote_staging_mib"}
)
OWN_KEYS = frozenset(
    {"dir", "budget_gib", "budget_bytes", "staging_mib", *_DISK_KEYS, *REMOTE_KEYS}
)
#: Host memory a rank stages durable pages in for publishing, unless ``remote_staging_mib``.
DEFAULT_REMOTE_STAGING_MIB = 1024.0


@dataclass(frozen=True)
class BackendSettings:
    """The backend's configuration: the disk tier's, which SGLang interface it serves, and the
    shared tier behind the disk (None: none) with the bytes of its publish staging."""

    disk: DiskConfig
    interface_v1: bool
    remote: RemoteConfig | None = None
    remote_staging_bytes: int = 0

    @classmethod
    def from_extra_config(
        cls, extra: dict[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> BackendSettings:
        """Parse SGLang's extra config dict (``environ``: where a Redis password the URL lacks
        comes from); raises ``ConfigError`` naming the key to change."""
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
        remote, staging = _remote(extra, environ or {})
        return cls(disk, bool(extra.get("interface_v1", 0)), remote, staging)


def _remote(extra: dict[str, Any], environ: Mapping[str, str]) -> tuple[RemoteConfig | None, int]:
    """The shared tier's configuration and staging bytes (None, 0 without ``remote``)."""
    if "remote" not in extra:
        stray = sorted(REMOTE_KEYS & set(extra))
        if stray:
            raise ConfigError(
                f"kvstrata storage backend: {stray} configure the shared tier, which needs "
                '"remote": "redis://HOST:PORT[/DB]"'
            )
        return None, 0
    url = _typed("remote", extra["remote"], str)
    if "remote_gib" not in extra:
        raise ConfigError(
            'kvstrata storage backend: "remote" needs "remote_gib", this rank\'s share of the '
            'store in GiB (for example "remote_gib": 64)'
        )
    gib = float(_typed("remote_gib", extra["remote_gib"], float))
    timeout_ms = float(_typed("remote_timeout_ms", extra.get("remote_timeout_ms", 500.0), float))
    min_hits = int(_typed("remote_min_hits", extra.get("remote_min_hits", 1), int))
    mib = extra.get("remote_staging_mib", DEFAULT_REMOTE_STAGING_MIB)
    staging = int(float(_typed("remote_staging_mib", mib, float)) * 2**20)
    for key, value, ok in (
        ("remote_gib", gib, 0 < gib <= 2**20),
        ("remote_timeout_ms", timeout_ms, 0 < timeout_ms <= 3_600_000),
        ("remote_staging_mib", mib, staging > 0),
    ):
        if not ok:
            raise ConfigError(f'kvstrata storage backend: "{key}" out of range: {value!r}')
    config = RemoteConfig(
        url,
        budget_bytes=int(gib * 2**30),
        timeout_s=timeout_ms / 1e3,
        min_hits=min_hits,
        password=password_from_env(environ),
        # SGLang's process owns its allocator: no mallopt there (values land in reused buffers,
        # so it no longer changes the fetch rate: RemoteConfig.tune_malloc).
        tune_malloc=False,
    )
    return config, staging


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
