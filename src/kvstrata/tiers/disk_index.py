"""The disk tier's index: an LMDB map that is the one durable truth that a page exists.

::

    key    namespace digest 32s | page hash 32s | payload kind u16            66 bytes
    value  rank u32 | slot u64 | last_access u64                             20 bytes
    (struct, little-endian; a ``meta`` table holds the index format version)

A page of a store with ``P`` payloads is present when all ``P`` keys exist, name the same rank
and slot. The store writes data, ``fdatasync``-s it, and only then commits the keys (LMDB commits
are atomic and, with ``sync``, durable), and deletes the keys before it reuses a slot: a slot no
key names is free, whatever bytes it holds, so a crash at any point leaves nothing half-visible.

Each (namespace, rank) has an index of its own (``disk_dir.index_dir``), used by one process at a
time (the group's ``RankLock``): a process stopped while it holds LMDB's write lock blocks nobody
else. LMDB allows one environment per path per process, so environments are shared and
reference-counted here.

A damaged index never reaches LMDB's reader: :func:`check_map_file` compares ``data.mdb``'s size
with what its meta pages say before it is mapped (a truncated map is a SIGBUS on first touch), and
every ``lmdb.Error`` at open becomes a :class:`DiskStoreError` naming the directory and the way
out (``kvstrata disk check --fix``, which rebuilds it from the slot headers, or a ``clear`` start).
"""

from __future__ import annotations

import os
import stat
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb

from ..errors import DiskFormatError, DiskStoreError
from .disk_dir import DIR_MODE, refuse_link
from .page_hash import HASH_BYTES

KEY = struct.Struct("<32s32sH")
VALUE = struct.Struct("<IQQ")
INDEX_FORMAT = 1
_FORMAT_KEY = b"format"
#: Virtual size of the LMDB map when the store asks for less (address space, not disk).
MIN_MAP_BYTES = 1 << 30
#: Disk bytes reserved per index entry: a 66-byte key and 20-byte value (94 bytes with LMDB's
#: node header) in B-tree pages at least half full, twice over for copy-on-write commits.
RESERVE_BYTES_PER_ENTRY = 512
#: Map (address space) bytes per entry: twice the reservation.
MAP_BYTES_PER_ENTRY = 2 * RESERVE_BYTES_PER_ENTRY

_ENVS: dict[str, tuple[lmdb.Environment, int]] = {}
_ENVS_LOCK = threading.Lock()
#: LMDB's meta pages (pages 0 and 1): the magic and data version, the page size (the free DB's
#: md_pad), the last page in use and the transaction id, at these offsets into each page.
_META = struct.Struct("<II")  # at 16: mm_magic, mm_version
_META_PSIZE = struct.Struct("<I")  # at 40
_META_TAIL = struct.Struct("<QQ")  # at 136: mm_last_pg, mm_txnid
_LMDB_MAGIC, _LMDB_VERSION = 0xBEEFC0DE, 1
WAY_OUT = (
    "run 'kvstrata disk check --fix' on the directory (rebuilds the index from the slabs) or "
    "start the disk tier with 'clear' (drops its contents)"
)


def check_map_file(path: Path) -> str | None:
    """None when ``path/data.mdb`` is absent or whole; else what is wrong with it (a file shorter
    than the pages its newest meta page says it holds, meta pages that are not LMDB's, a link)."""
    data = path / "data.mdb"
    try:
        st = os.lstat(data)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return f"{data} is not a regular file"
    try:
        fd = os.open(data, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            head = os.pread(fd, 2 * 65536, 0)
        finally:
            os.close(fd)
    except OSError as err:
        return f"cannot read {data}: {err.strerror}"
    if len(head) < 152:
        return f"{data} is truncated ({st.st_size} bytes, no meta page)"
    (psize,) = _META_PSIZE.unpack_from(head, 40)
    if psize not in {1 << k for k in range(9, 17)}:
        return f"{data} has no LMDB meta page (page size field {psize})"
    metas = []
    for page in (0, 1):
        if len(head) < page * psize + 152:
            return f"{data} is truncated ({st.st_size} bytes, one meta page of two)"
        magic, version = _META.unpack_from(head, page * psize + 16)
        if (magic, version) != (_LMDB_MAGIC, _LMDB_VERSION):
            return f"{data} meta page {page} is damaged (magic {magic:#x}, version {version})"
        metas.append(_META_TAIL.unpack_from(head, page * psize + 136))
    last_page, _ = max(metas, key=lambda m: m[1])
    need = (last_page + 1) * psize
    if st.st_size < need:
        return f"{data} is truncated: {st.st_size:,} bytes, its meta page names {need:,}"
    return None


@dataclass(frozen=True, slots=True)
class IndexEntry:
    rank: int
    slot: int
    last_access: int


def encode_key(namespace: bytes, page_hash: bytes, kind: int) -> bytes:
    return KEY.pack(namespace, page_hash, kind)


def decode_key(key: bytes) -> tuple[bytes, bytes, int] | None:
    """``(namespace, page hash, payload kind)``, or None for a key of another length."""
    if len(key) != KEY.size:
        return None
    ns, page_hash, kind = KEY.unpack(key)
    return ns, page_hash, kind


def decode_value(value: bytes | memoryview) -> IndexEntry | None:
    if len(value) != VALUE.size:
        return None
    return IndexEntry(*VALUE.unpack(value))


def _acquire_env(path: Path, map_size: int, readonly: bool) -> lmdb.Environment:
    key = str(path.resolve())
    with _ENVS_LOCK:
        if key in _ENVS:
            env, refs = _ENVS[key]
            if env.info()["map_size"] < map_size and not readonly:
                env.set_mapsize(map_size)
            _ENVS[key] = (env, refs + 1)
            return env
        refuse_link(path, "dir")
        for name in ("data.mdb", "lock.mdb"):
            refuse_link(path / name)
        damage = check_map_file(path)
        if damage is not None:
            raise DiskStoreError(f"the disk index {path} is damaged: {damage}; {WAY_OUT}")
        try:
            if not readonly:
                os.makedirs(path, mode=DIR_MODE, exist_ok=True)
            env = lmdb.open(
                key,
                map_size=map_size,
                subdir=True,
                max_dbs=2,
                readahead=False,
                sync=True,
                metasync=True,
                # An audit that writes nothing holds the group's flock: no writer can run, so it
                # needs no LMDB lock file (which it would have to write).
                lock=not readonly,
                readonly=readonly,
                create=not readonly,
            )
        except lmdb.Error as err:
            raise DiskStoreError(
                f"cannot open the disk index {path}: {_first_line(err)}; {WAY_OUT}"
            ) from None
        except OSError as err:
            raise DiskStoreError(
                f"cannot create the disk index {path}: {err.strerror}; give the disk tier a "
                "writable directory on a local filesystem"
            ) from None
        if not readonly:
            env.reader_check()  # readers left behind by killed processes
        _ENVS[key] = (env, 1)
        return env


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _release_env(env: lmdb.Environment) -> None:
    with _ENVS_LOCK:
        for key, (e, refs) in list(_ENVS.items()):
            if e is env:
                if refs > 1:
                    _ENVS[key] = (e, refs - 1)
                else:
                    del _ENVS[key]
                    e.close()
                return


class DiskIndex:
    """The page entries of one group (one namespace and rank), in one LMDB environment at
    ``path``. ``readonly`` opens an existing index without writing a byte (an audit)."""

    def __init__(self, path: Path, map_size: int = MIN_MAP_BYTES, readonly: bool = False) -> None:
        self.path = path
        self._closed = False
        self.env = _acquire_env(path, max(map_size, MIN_MAP_BYTES), readonly)
        try:
            if readonly:
                self._pages = self.env.open_db(b"pages", create=False)
                with self.env.begin(db=self.env.open_db(b"meta", create=False)) as txn:
                    found = txn.get(_FORMAT_KEY)
            else:
                self._pages = self.env.open_db(b"pages")
                meta = self.env.open_db(b"meta")
                with self.env.begin(write=True, db=meta) as txn:
                    found = txn.get(_FORMAT_KEY)
                    if found is None:
                        txn.put(_FORMAT_KEY, struct.pack("<I", INDEX_FORMAT))
                        found = struct.pack("<I", INDEX_FORMAT)
            if found != struct.pack("<I", INDEX_FORMAT):
                raise DiskFormatError(
                    f"the disk index {path} has another format "
                    f"({found.hex() if found else 'none'}, this kvstrata writes "
                    f"{INDEX_FORMAT}); {WAY_OUT}"
                )
        except lmdb.Error as err:
            _release_env(self.env)
            raise DiskStoreError(
                f"the disk index {path} is damaged: {_first_line(err)}; {WAY_OUT}"
            ) from None
        except DiskFormatError:
            _release_env(self.env)
            raise

    def reserve(self, nbytes: int) -> None:
        """Preallocate the index file to ``nbytes`` so that commits never meet a full disk
        (LMDB reuses freed pages and grows its file only past its last page)."""
        path = self.path / "data.mdb"
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            raise DiskStoreError(f"cannot open {path}: {err.strerror}") from None
        try:
            if os.fstat(fd).st_size < nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as err:
            raise DiskStoreError(
                f"cannot reserve {nbytes / 2**20:.1f} MiB for the disk index at {path}: "
                f"{err.strerror}; lower the disk budget or free space"
            ) from None
        finally:
            os.close(fd)

    # -- reads -----------------------------------------------------------------------------------

    def page(
        self, txn: lmdb.Transaction, ns: bytes, rank: int, page_hash: bytes, num_payloads: int
    ) -> IndexEntry | None:
        """The page's entry (its slot; the largest last_access of its payloads) when every
        payload names the same slot of ``rank``; else None."""
        slot, last = -1, 0
        for kind in range(num_payloads):
            raw = txn.get(encode_key(ns, page_hash, kind), db=self._pages)
            entry = decode_value(raw) if raw is not None else None
            if entry is None or entry.rank != rank or slot not in (-1, entry.slot):
                return None
            slot, last = entry.slot, max(last, entry.last_access)
        return IndexEntry(rank, slot, last)

    def read(self) -> lmdb.Transaction:
        """A read transaction (use as a context manager)."""
        return self.env.begin(db=self._pages)

    def slots(
        self,
        txn: lmdb.Transaction,
        ns: bytes,
        rank: int,
        hashes: Sequence[bytes],
        num_payloads: int,
    ) -> list[int | None]:
        """:meth:`page`'s slot for each of ``hashes`` (None where it has no entry), without
        building entries: the read path asks this for every page it reads."""
        get, db, key, size = txn.get, self._pages, KEY.pack, VALUE.size
        out: list[int | None] = []
        for h in hashes:
            slot: int | None = -1
            for kind in range(num_payloads):
                raw = get(key(ns, h, kind), db=db)
                if raw is None or len(raw) != size:
                    slot = None
                    break
                got_rank, got_slot, _ = VALUE.unpack(raw)
                if got_rank != rank or slot not in (-1, got_slot):
                    slot = None
                    break
                slot = got_slot
            out.append(slot)
        return out

    def leading(self, ns: bytes, rank: int, hashes: Sequence[bytes], num_payloads: int) -> int:
        """How many of ``hashes``, from the first, are present."""
        with self.read() as txn:
            for i, h in enumerate(hashes):
                if self.page(txn, ns, rank, h, num_payloads) is None:
                    return i
        return len(hashes)

    def items(self, ns: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Every raw ``(key, value)`` (of namespace ``ns`` only, when given), in key order."""
        with self.read() as txn:
            cursor = txn.cursor()
            found = cursor.set_range(ns) if ns is not None else cursor.first()
            while found:
                key, value = (bytes(x) for x in cursor.item())
                if ns is not None and not key.startswith(ns):
                    return
                yield key, value
                found = cursor.next()

    # -- writes (each one durable LMDB transaction) ----------------------------------------------

    def put_pages(
        self,
        ns: bytes,
        rank: int,
        pages: Sequence[tuple[bytes, int, int]],
        num_payloads: int,
    ) -> None:
        """Publish ``(page hash, slot, last_access)`` entries for every payload, atomically."""
        with self.env.begin(write=True, db=self._pages) as txn:
            for page_hash, slot, last in pages:
                value = VALUE.pack(rank, slot, last)
                for kind in range(num_payloads):
                    txn.put(encode_key(ns, page_hash, kind), value)

    def touch_pages(
        self, ns: bytes, rank: int, pages: Sequence[tuple[bytes, int, int]], num_payloads: int
    ) -> None:
        """Set ``last_access`` of ``(page hash, slot, last_access)`` pages whose entries still
        name that slot (a page dropped meanwhile is left dropped)."""
        with self.env.begin(write=True, db=self._pages) as txn:
            for page_hash, slot, last in pages:
                value = VALUE.pack(rank, slot, last)
                for kind in range(num_payloads):
                    key = encode_key(ns, page_hash, kind)
                    raw = txn.get(key)
                    entry = decode_value(raw) if raw is not None else None
                    if entry is not None and entry.rank == rank and entry.slot == slot:
                        txn.put(key, value)

    def delete_pages(
        self,
        ns: bytes,
        hashes: Sequence[bytes],
        num_payloads: int,
        rank: int | None = None,
        slot: int | None = None,
    ) -> None:
        """Delete every payload entry of ``hashes`` (only those of ``rank`` and naming ``slot``,
        when given)."""
        with self.env.begin(write=True, db=self._pages) as txn:
            for page_hash in hashes:
                for kind in range(num_payloads):
                    key = encode_key(ns, page_hash, kind)
                    if rank is not None or slot is not None:
                        raw = txn.get(key)
                        entry = decode_value(raw) if raw is not None else None
                        if entry is None or rank not in (None, entry.rank):
                            continue
                        if slot not in (None, entry.slot):
                            continue
                    txn.delete(key)

    def delete_keys(self, keys: Sequence[bytes]) -> None:
        with self.env.begin(write=True, db=self._pages) as txn:
            for key in keys:
                txn.delete(key)

    def clear(self, ns: bytes, rank: int) -> int:
        """Delete every entry of ``rank`` in namespace ``ns``; returns how many."""
        doomed = [
            key
            for key, value in self.items(ns)
            if (entry := decode_value(value)) is None or entry.rank == rank
        ]
        self.delete_keys(doomed)
        return len(doomed)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release_env(self.env)


assert KEY.size == 2 * HASH_BYTES + 2
