"""A read-only view of the pages another process's :class:`~kvstrata.tiers.disk_store.DiskStore`
writes: lookups and verified reads, nothing else.

For ranks that hold the same pages as a writer but never write themselves (SGLang's MLA TP
ranks other than the storage writer). The view takes no lock, writes nothing and frees nothing:
the writer keeps its slabs, its index entries and its LRU. It opens the writer's slabs when it
first needs them (the writer may start later), with the geometry their superblocks describe
(a writer of one directory: a group striped over several reads as misses here).

The index is keyed by slot, so the view finds pages by hash in its own scan of the index (one
read transaction, registered in LMDB's lock table so that the writer keeps the pages it walks):
taken again when a lookup or read falls short of what it asks, or a read found a page gone from
its slot, and the writer has committed since, but no sooner after the last scan than
:data:`RESCAN_TIMES` its duration (scans then take at most a tenth of the time however large the
index; a small one is seen at once; a scan costs about 3 us an entry).

Reads are as safe as the writer's own (``disk_read``): a slot is verified (header, hash, CRC-32C)
and the index must still name it after the read, and the writer deletes an entry before it reuses
a slot, so a page the writer collects or rewrites meanwhile reads as a miss, never as another
page's bytes. A page that fails verification is a counted miss; dropping it is the writer's job
(its own next read of that page fails and drops it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError
from .disk_audit import SLAB_DIR
from .disk_config import DiskStats
from .disk_dir import index_dir
from .disk_events import Counters, RateLimitedLog
from .disk_format import CRC32C_HARDWARE, SlabFile, SlabGeometry
from .disk_index import DiskIndex, IndexEntry
from .disk_read import PageReader
from .host_pool import HostPool
from .page_hash import HASH_BYTES, Namespace

#: A scan of the writer's index starts no sooner after the last one than this many times the
#: last one took.
RESCAN_TIMES = 10


class DiskView:
    """Lookups and verified reads of ``(namespace, rank)``'s pages under ``root``."""

    def __init__(
        self,
        namespace: Namespace,
        rank: int,
        root: Path,
        read_threads: int = 3,
        io_timeout_s: float = 30.0,
    ) -> None:
        self.namespace, self.rank, self.root = namespace, rank, Path(root)
        self.read_threads, self.io_timeout_s = read_threads, io_timeout_s
        self.counters = Counters()
        self._warn = RateLimitedLog()
        self._num_payloads = len(namespace.payloads)
        self._lock = threading.Lock()
        self._slabs: list[SlabFile] = []
        self._reader: PageReader | None = None
        self._index: DiskIndex | None = None  # the writer's, read-only, once it exists
        self._pages: dict[bytes, IndexEntry] = {}  # its whole pages by hash, as last scanned
        self._moved = False  # a read found a page no longer in the slot the scan gave
        self._scanned: tuple[int, float, float] | None = None  # (txn id, end, seconds) of the last

    def _expected(self, kind: int, num_slots: int) -> SlabGeometry:
        ns = self.namespace
        spec = ns.payloads[kind]
        return SlabGeometry(
            ns.digest,
            self.rank,
            kind,
            self._num_payloads,
            spec.name,
            ns.payload_bytes(kind),
            num_slots,
        )

    def _open(self) -> PageReader | None:
        """The reader over the writer's slabs, once every payload's slab exists and describes
        this namespace; None until then."""
        with self._lock:
            if self._reader is not None or self._open_index() is None:
                return self._reader
            found: list[tuple[Path, SlabGeometry]] = []
            for kind in range(self._num_payloads):
                path = self.root / SLAB_DIR / self._expected(kind, 0).file_name()
                geom, _ = SlabFile.read_geometry(path)
                if isinstance(geom, str) or geom != replace(
                    self._expected(kind, geom.num_slots), packed=geom.packed
                ):
                    return None
                found.append((path, geom))
            if len({g.num_slots for _, g in found}) != 1:
                return None
            self._slabs = [SlabFile(path, geom, direct=False) for path, geom in found]
            self._reader = PageReader(
                self.namespace,
                self.rank,
                self._slabs,
                self._locate,
                self._holds,
                self.counters,
                self._warn,
                drop=lambda _h, _slot: None,  # the writer drops what fails
                read_threads=self.read_threads,
                io_timeout_s=self.io_timeout_s,
            )
            return self._reader

    def _open_index(self) -> DiskIndex | None:
        """The writer's index of this group, opened read-only once the writer has made it."""
        if self._index is None:
            path = index_dir(self.root, self.namespace.digest, self.rank)
            if (path / "data.mdb").is_file():
                self._index = DiskIndex(path, reader=True)
        return self._index

    def _locate(self, page_hashes: Sequence[bytes]) -> list[int | None]:
        """Each page's slot as last scanned (scanning again first when one is missing, or when a
        read since found a page gone from its slot)."""
        with self._lock:
            if self._moved or any(h not in self._pages for h in page_hashes):
                self._rescan()
            return [e.slot if (e := self._pages.get(h)) is not None else None for h in page_hashes]

    def _holds(self, page_hashes: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """The check after a read: the index still names each page at its slot."""
        assert self._index is not None
        pairs = list(zip(page_hashes, slots, strict=True))
        held = self._index.holds(self.namespace.digest, self.rank, pairs, self._num_payloads)
        if not all(held):
            self._moved = True  # the writer collected or moved a page: scan again
        return held

    def _rescan(self) -> None:
        """Scan the writer's index again if it committed since the last scan, and that scan
        ended RESCAN_TIMES its duration ago."""
        index = self._open_index()
        if index is None:
            return
        txn_id, start = index.env.info()["last_txnid"], time.monotonic()
        if self._scanned is not None:
            last_id, end, took = self._scanned
            if txn_id == last_id or start - end < RESCAN_TIMES * took:
                return
        self._pages = index.scan(self.namespace.digest, self.rank, self._num_payloads)
        self._moved = False
        end = time.monotonic()
        self._scanned = (txn_id, end, end - start)

    def lookup(self, page_hashes: Sequence[bytes]) -> int:
        """How many of ``page_hashes``, from the first, the writer has on disk."""
        bad = [h for h in page_hashes if not isinstance(h, bytes) or len(h) != HASH_BYTES]
        if bad:
            raise ConfigError(f"page hashes are {HASH_BYTES} bytes, got {bad[0]!r}")
        found = self._locate(page_hashes)
        return next((i for i, slot in enumerate(found) if slot is None), len(found))

    def read(
        self, page_hashes: Sequence[bytes], host_pool: HostPool, host_slots: Sequence[int]
    ) -> list[bool]:
        """``DiskStore.read`` against the writer's slabs: ``ok[i]`` when host slot ``i`` now
        holds page ``i``, verified."""
        if len(page_hashes) != len(host_slots):
            raise ConfigError(f"{len(page_hashes)} page hashes for {len(host_slots)} host slots")
        if host_pool.layout != self.namespace.layout:
            raise ConfigError("the host pool's layout differs from the disk namespace's")
        reader = self._open()
        if reader is None:
            self.counters.add(read_misses=len(page_hashes))
            return [False] * len(page_hashes)
        return reader.read(page_hashes, host_pool, host_slots)

    def stats(self) -> DiskStats:
        num_slots = self._slabs[0].geometry.num_slots if self._slabs else 0
        return DiskStats(
            io_mode="read-only",
            crc32c_hardware=CRC32C_HARDWARE,
            num_slots=num_slots,
            used_slots=0,
            high_slots=0,
            low_slots=0,
            page_bytes=sum(s.geometry.slot_bytes for s in self._slabs),
            counters=self.counters.snapshot(),
        )

    def close(self) -> None:
        """Close the slabs and the index (idempotent)."""
        with self._lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            for slab in self._slabs:
                slab.close()
            self._slabs = []
            if self._index is not None:
                self._index.close()
                self._index = None

    def __enter__(self) -> DiskView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
