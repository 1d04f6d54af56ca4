"""The engine's sizes and switches: one frozen dataclass, validated on construction (every CLI
default reads its field)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import DEFAULT_HOST_LAYOUT, HOST_LAYOUTS, WRITE_POLICIES, CacheConfig, HostLayout
from ..dist.attention import check_strategy
from ..errors import ConfigError
from ..tiers.disk_config import IO_MODES
from ..tiers.disk_layout import check_roots
from ..tiers.remote.config import parse_url

GIB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes. ``pool_tokens`` is the L1 device pool, in tokens (whole pages); the L2 host
    pool is ``l2_tokens`` tokens or ``l2_gib`` GiB (at most one of them; neither: no L2)."""

    page_size: int = 16
    pool_tokens: int = 262_144
    chunk_size: int = 2_048
    max_batch_tokens: int = 8_192
    max_batch_requests: int = 64
    eviction: str = "lru"
    device: str = "cpu"
    check_every_step: bool = False
    l2_tokens: int = 0
    l2_gib: float = 0.0
    host_layout: HostLayout = DEFAULT_HOST_LAYOUT
    write_policy: str = "write_through"
    write_through_hits: int = 2
    max_host_alloc_gib: float = 480.0
    # the disk tier's directory (needs an L2: it spills host pages), or one per drive: ranks
    # take directory rank % n, or stripe over several when there are more directories than ranks
    l3_dir: str | tuple[str, ...] | None = None
    l3_gib: float = 0.0  # disk bytes each rank's slabs take, all its directories together
    l3_start: str = "clear"  # "clear" (start empty) or "load" (keep what the directory holds)
    l3_min_hits: int = 1  # spill only pages used at least this often
    # how the disk tier reads and writes its slabs: auto (O_DIRECT where the filesystem has it),
    # direct (refuse to start without it) or buffered (through the page cache; still fsynced)
    l3_io: str = "auto"
    # the shared tier (Redis) behind the disk, or in its place without --l3-dir:
    # tiers/remote/config.py; the URL may carry a password
    remote_url: str | None = field(default=None, repr=False)
    remote_gib: float = 0.0  # this namespace's share of the store, all ranks together
    remote_timeout_ms: float = 500.0  # socket timeout of every round trip to the store
    remote_min_hits: int = 1  # publish only pages used at least this often
    remote_connections: int = 3  # round trips in flight to the store (a connection and thread each)
    remote_publish_window: int = 1  # SET pipelines a publish has in flight per connection
    remote_password: str | None = field(default=None, repr=False)  # when the URL has none
    cp_attention: str = "auto"  # under CP: move_kv, move_queries, or auto (cheaper per step)
    check_digests: bool = False  # under CP: compare replicated digests across ranks every step

    def __post_init__(self) -> None:
        CacheConfig(page_size=self.page_size, eviction=self.eviction)  # validates both
        for name in ("pool_tokens", "chunk_size", "max_batch_tokens", "max_batch_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ConfigError(
                f"device {self.device!r} is not a torch device; use cpu or cuda"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device {self.device!r} asked for, but this machine has no CUDA device"
            )
        if self.pool_tokens < self.page_size:
            raise ConfigError(
                f"pool_tokens ({self.pool_tokens}) must hold at least one page of {self.page_size} tokens"
            )
        if not isinstance(self.l2_tokens, int) or self.l2_tokens < 0:
            raise ConfigError(f"--l2-tokens must be an integer >= 0, got {self.l2_tokens!r}")
        if not 0 <= self.l2_gib <= 2**20:
            raise ConfigError(
                f"--l2-gib must be a number in [0, 1048576] (1 PiB), got {self.l2_gib!r}"
            )
        if self.l2_tokens and self.l2_gib:
            raise ConfigError("give the L2 size once: --l2-tokens or --l2-gib, not both")
        if 0 < self.l2_tokens < self.page_size:
            raise ConfigError(
                f"--l2-tokens ({self.l2_tokens}) must hold at least one page of {self.page_size}"
            )
        if self.host_layout not in HOST_LAYOUTS:
            raise ConfigError(
                f"--host-layout must be one of {', '.join(HOST_LAYOUTS)}, got {self.host_layout!r}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"--write-policy must be one of {', '.join(WRITE_POLICIES)}, "
                f"got {self.write_policy!r}"
            )
        if not isinstance(self.write_through_hits, int) or self.write_through_hits < 1:
            raise ConfigError(
                f"--write-through-hits must be an integer >= 1, got {self.write_through_hits!r}"
            )
        check_strategy(self.cp_attention)
        if self.l3_dir is not None:
            dirs = (self.l3_dir,) if isinstance(self.l3_dir, str) else tuple(self.l3_dir)
            check_roots(dirs)  # none, one given twice, one inside another: refused
            # one directory stays a string (as before several were possible), several a tuple
            object.__setattr__(self, "l3_dir", dirs[0] if len(dirs) == 1 else dirs)
            if not self.has_l2:
                raise ConfigError(
                    "the disk tier (--l3-dir) spills host pages: give an L2 too (--l2-tokens)"
                )
            if not 0 < self.l3_gib <= 2**20:
                raise ConfigError(f"--l3-gib must lie in (0, 1048576], got {self.l3_gib!r}")
            if self.l3_start not in ("clear", "load"):
                raise ConfigError(f"--l3-start must be clear or load, got {self.l3_start!r}")
            if self.l3_io not in IO_MODES:
                raise ConfigError(
                    f"--l3-io must be one of {', '.join(IO_MODES)}, got {self.l3_io!r}"
                )
            if not isinstance(self.l3_min_hits, int) or self.l3_min_hits < 0:
                raise ConfigError(f"--l3-min-hits must be >= 0, got {self.l3_min_hits!r}")
            if self.write_policy != "write_through":
                raise ConfigError(
                    f"the disk tier spills the pages each write-through backup commits; with "
                    f"--write-policy {self.write_policy} nothing would reach the disk: use "
                    "--write-policy write_through with --l3-dir"
                )
        if self.remote_url is not None:
            self._check_remote()
        if not 0 < self.max_host_alloc_gib <= 2**20:
            raise ConfigError(
                f"the per-allocation cap must be > 0 GiB, got {self.max_host_alloc_gib!r}"
            )

    def _check_remote(self) -> None:
        assert self.remote_url is not None
        parse_url(self.remote_url)  # a URL that names no store is refused here, before any I/O
        if not self.has_l2:
            raise ConfigError(
                "the shared tier (--remote) publishes host pages: give an L2 too (--l2-tokens)"
            )
        if not 0 < self.remote_gib <= 2**20:
            raise ConfigError(f"--remote-gib must lie in (0, 1048576], got {self.remote_gib!r}")
        if not 0 < self.remote_timeout_ms <= 3_600_000:
            raise ConfigError(
                f"--remote-timeout-ms must lie in (0, 3600000], got {self.remote_timeout_ms!r}"
            )
        if not isinstance(self.remote_min_hits, int) or self.remote_min_hits < 0:
            raise ConfigError(f"--remote-min-hits must be >= 0, got {self.remote_min_hits!r}")
        if not isinstance(self.remote_connections, int) or not 1 <= self.remote_connections <= 64:
            raise ConfigError(
                f"--remote-connections must lie in [1, 64], got {self.remote_connections!r}"
            )
        window = self.remote_publish_window
        if not isinstance(window, int) or not 1 <= window <= 8:
            raise ConfigError(f"--remote-publish-window must lie in [1, 8], got {window!r}")
        if self.write_policy != "write_through":
            raise ConfigError(
                f"the shared tier publishes the pages each write-through backup commits; with "
                f"--write-policy {self.write_policy} nothing would reach it: use "
                "--write-policy write_through with --remote"
            )

    @property
    def pool_pages(self) -> int:
        return self.pool_tokens // self.page_size

    @property
    def l3_dirs(self) -> tuple[str, ...]:
        """The disk tier's directories (none without one)."""
        if self.l3_dir is None:
            return ()
        return (self.l3_dir,) if isinstance(self.l3_dir, str) else self.l3_dir

    @property
    def has_l2(self) -> bool:
        return bool(self.l2_tokens or self.l2_gib)
