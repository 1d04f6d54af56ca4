"""The disk tier's configuration and what it reports: ``DiskConfig``, ``DiskPoll``, ``DiskStats``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import ConfigError
from .disk_events import ReloadDone, SpillDone
from .disk_layout import check_roots

#: More I/O threads than this buy nothing on any disk and cost a read buffer pair each.
MAX_IO_THREADS = 64
StartMode = Literal["clear", "load"]
START_MODES: tuple[StartMode, ...] = ("clear", "load")
IOMode = Literal["auto", "direct", "buffered", "packed"]
IO_MODES: tuple[IOMode, ...] = ("auto", "direct", "buffered", "packed")


@dataclass(frozen=True)
class DiskConfig:
    """How one rank's disk tier is set up.

    root: the directory (created if missing); several ranks and namespaces may share it.
    more_roots: more directories, one per drive (``disk_layout.py``): with ``n`` in all, rank
        ``r`` of ``cp_size`` takes ``(root, *more_roots)[r % n]`` when ``cp_size >= n``, else
        every ``cp_size``-th from the ``r``-th and stripes its slots over them.
    budget_bytes: disk bytes this rank's slabs take, all payloads and directories together,
        preallocated (split evenly over its directories).
    start: ``"clear"`` (start empty) or ``"load"`` (keep what the index holds, verified).
    high_watermark / low_watermark: GC runs when a write would fill more than ``high`` of the
        slots and frees the least recently used pages down to ``low``.
    min_hits: pages spilled with fewer hits are skipped (frequency-gated admission, SSD wear).
    io_mode: ``"direct"`` (O_DIRECT, refuse to start without it), ``"buffered"`` (page cache +
        fdatasync), ``"auto"`` (O_DIRECT where the filesystem takes it, else buffered, reported
        by ``stats().io_mode`` and a warning), ``"packed"`` (small pages only: slots of 64-byte
        multiples, many to a 4 KiB block, through the page cache; ``disk_format.py``).
    staging_bytes: aligned memory for pages between gather and write (at least 2 pages).
    max_tickets: spill and reload jobs running at once; one more waits for one to finish (at
        most ``io_timeout_s``, then it is refused: the disk stopped answering).
    io_timeout_s: the longest a read waits for one slot read or for another read to finish, and
        a spill or reload for room among ``max_tickets``.
    read_threads: pages a read has in flight, each on a thread that reads, verifies and copies
        it (so reads overlap each other's CRC and copy, and the disk sees that queue depth;
        3 read fastest on the development machine, against 1, 2 and 4: docs/benchmarks.md);
        per directory of the rank.
    write_threads: slot writes a spill batch has in flight (the writer thread still allocates
        slots, collects garbage, syncs and commits alone); per directory of the rank.
    """

    root: Path
    budget_bytes: int
    start: StartMode = "clear"
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    min_hits: int = 1
    io_mode: IOMode = "auto"
    staging_bytes: int = 256 << 20
    max_tickets: int = 64
    io_timeout_s: float = 30.0
    read_threads: int = 3
    write_threads: int = 2
    more_roots: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        object.__setattr__(self, "more_roots", check_roots([self.root, *self.more_roots])[1:])
        if self.start not in START_MODES:
            raise ConfigError(f"disk start must be one of {START_MODES}, got {self.start!r}")
        if self.io_mode not in IO_MODES:
            raise ConfigError(f"disk io_mode must be one of {IO_MODES}, got {self.io_mode!r}")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ConfigError(
                "disk watermarks must satisfy 0 < low < high <= 1, got low "
                f"{self.low_watermark!r}, high {self.high_watermark!r}"
            )
        for name, least in (
            ("budget_bytes", 1),
            ("min_hits", 0),
            ("staging_bytes", 1),
            ("max_tickets", 1),
            ("read_threads", 1),
            ("write_threads", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"disk {name} must be an integer >= {least}, got {value!r}")
        for name in ("read_threads", "write_threads"):
            if getattr(self, name) > MAX_IO_THREADS:
                raise ConfigError(
                    f"disk {name} must be at most {MAX_IO_THREADS}, got {getattr(self, name)}"
                )
        if not self.io_timeout_s > 0:
            raise ConfigError(f"disk io_timeout_s must be > 0, got {self.io_timeout_s!r}")

    @property
    def roots(self) -> tuple[Path, ...]:
        """Every directory of the tier, ``root`` first."""
        return (self.root, *self.more_roots)


def watermark_slots(config: DiskConfig, num_slots: int) -> tuple[int, int]:
    """``(high, low)`` watermarks in slots."""
    return int(config.high_watermark * num_slots), int(config.low_watermark * num_slots)


@dataclass(frozen=True, slots=True)
class DiskPoll:
    """What finished since the last ``poll()``.

    released: spill tickets whose host slots the store no longer reads (unpin them).
    spilled: spill tickets whose every page is durable, failed or skipped (after ``released``).
    reloaded: reload tickets done.
    dropped: pages no longer on disk (GC, or a read that failed verification). A page can be
        in ``dropped`` and in a ``spilled`` ticket's ``durable`` of one poll (dropped and spilled
        again, or the other way round): ``lookup`` says which holds now.
    """

    released: tuple[int, ...] = ()
    spilled: tuple[SpillDone, ...] = ()
    reloaded: tuple[ReloadDone, ...] = ()
    dropped: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class DiskStats:
    """Counters (``disk_spill.COUNTERS``) and the store's state."""

    io_mode: str
    crc32c_hardware: bool
    num_slots: int
    used_slots: int
    high_slots: int
    low_slots: int
    page_bytes: int  # disk bytes of one page, all payloads, headers and padding included
    counters: dict[str, int] = field(default_factory=dict)

    def __getattr__(self, name: str) -> int:
        try:
            return self.counters[name]
        except KeyError:
            raise AttributeError(name) from None
