"""The disk tier's index: an LMDB map that is the one durable truth that a page exists.

::

    key    namespace digest 32s | slot u64 (big-endian) | payload kind u16 (big-endian)  42 bytes
    value  page hash 32s | rank u32 | last_access u64 (little-endian)                   44 bytes
    (a ``meta`` table holds the index format version)

Keys are in slot order (LMDB sorts keys as bytes): a spill writes its pages into ascending runs
of slots, so one commit of a batch touches a few neighbouring B-tree pages, not one page per
entry. Keyed by page hash, a commit of 224 entries of 4 KiB slots wrote about 9 MB (40 KiB per
entry: 10x the slot bytes); keyed by slot it writes about 80 KB. Lookups by page hash come from
the store's slot pool (rebuilt from a scan of this map at a ``load`` start) or, for a read-only
view, from its own scan.

A page of a store with ``P`` payloads is present at a slot when all ``P`` keys of that slot
exist and name the same page and rank. The store writes data, ``fdatasync``-s it, and only then
commits the keys (LMDB commits are atomic and, with ``sync``, durable), and deletes the keys
before it reuses a slot: a slot no key names is free, whatever bytes it holds, so a crash at any
point leaves nothing half-visible.

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
from operator import itemgetter
from pathlib import Path

import lmdb

from ..errors import DiskFormatError, DiskStoreError
from .disk_dir import DIR_MODE, refuse_link
from .page_hash import HASH_BYTES

KEY = struct.Struct(">32sQH")
VALUE = struct.Struct("<32sIQ")
_RANK = struct.Struct("<I")  # the value's rank field, after the page hash
#: 1: keyed by page hash (a commit wrote one B-tree page per entry); 2: keyed by slot.
INDEX_FORMAT = 2
_FORMAT_KEY = b"format"
#: Virtual size of the LMDB map when the store asks for less (address space, not disk).
MIN_MAP_BYTES = 1 << 30
#: Disk bytes reserved per index entry: a 42-byte key and 44-byte value (94 bytes with LMDB's
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
    page_hash: bytes
    rank: int
    slot: int
    last_access: int


def encode_key(namespace: bytes, slot: int, kind: int) -> bytes:
    return KEY.pack(namespace, slot, kind)


def decode_key(key: bytes) -> tuple[bytes, int, int] | None:
    """``(namespace, slot, payload kind)``, or None for a key of another length."""
    if len(key) != KEY.size:
        return None
    ns, slot, kind = KEY.unpack(key)
    return ns, slot, kind


def encode_value(page_hash: bytes, rank: int, last_access: int) -> bytes:
    return VALUE.pack(page_hash, rank, last_access)


def decode_value(value: bytes | memoryview) -> tuple[bytes, int, int] | None:
    """``(page hash, rank, last_access)``, or None for a value of another length."""
    if len(value) != VALUE.size:
        return None
    page_hash, rank, last = VALUE.unpack(value)
    return page_hash, rank, last


def _names(raw: bytes | None, page_hash: bytes, rank: bytes | None) -> bool:
    """Whether an index value names ``page_hash`` (and ``rank``, packed as in the value, when
    given), compared as bytes: GC and the touches at close test 100,000s of entries."""
    return (
        raw is not None
        and len(raw) == VALUE.size
        and raw[:HASH_BYTES] == page_hash
        and (rank is None or raw[HASH_BYTES : HASH_BYTES + _RANK.size] == rank)
    )


def _acquire_env(path: Path, map_size: int, readonly: bool, locked: bool) -> lmdb.Environment:
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
                lock=locked,
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
    ``path``. ``readonly`` opens an existing index without writing a byte (an audit, which holds
    the group's lock: no writer runs); ``reader`` opens it read-only beside a running writer,
    registered in LMDB's lock table, so the writer never reuses the pages a read is walking."""

    def __init__(
        self,
        path: Path,
        map_size: int = MIN_MAP_BYTES,
        readonly: bool = False,
        reader: bool = False,
    ) -> None:
        self.path = path
        self._closed = False
        readonly = readonly or reader
        self.env = _acquire_env(
            path, max(map_size, MIN_MAP_BYTES), readonly, not readonly or reader
        )
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

    def read(self) -> lmdb.Transaction:
        return self.env.begin(db=self._pages)

    def entry(
        self, txn: lmdb.Transaction, ns: bytes, rank: int, slot: int, num_payloads: int
    ) -> IndexEntry | None:
        """The page at ``slot`` (the largest last_access of its payloads) when every payload's
        entry exists and names the same page of ``rank``; else None."""
        get, db, key = txn.get, self._pages, KEY.pack
        page_hash, last = b"", 0
        for kind in range(num_payloads):
            raw = get(key(ns, slot, kind), db=db)
            value = decode_value(raw) if raw is not None else None
            if value is None or value[1] != rank or page_hash not in (b"", value[0]):
                return None
            page_hash, last = value[0], max(last, value[2])
        return IndexEntry(page_hash, rank, slot, last)

    def holds(
        self, ns: bytes, rank: int, pages: Sequence[tuple[bytes, int]], num_payloads: int
    ) -> list[bool]:
        """Whether each ``(page hash, slot)`` is still that slot's page (one read transaction)."""
        with self.read() as txn:
            return [
                (e := self.entry(txn, ns, rank, slot, num_payloads)) is not None
                and e.page_hash == h
                for h, slot in pages
            ]

    def scan(self, ns: bytes, rank: int, num_payloads: int) -> dict[bytes, IndexEntry]:
        """Every whole page of ``(ns, rank)`` by page hash (the lowest slot of a page that two
        slots claim), in one pass over the map in slot order."""
        out: dict[bytes, IndexEntry] = {}
        slot, kinds, page_hash, last, rank_ok = -1, 0, b"", 0, True

        def close() -> None:
            if slot >= 0 and kinds == num_payloads and rank_ok and page_hash not in out:
                out[page_hash] = IndexEntry(page_hash, rank, slot, last)

        for key, value in self.items(ns):
            k, v = decode_key(key), decode_value(value)
            if k is None or v is None:
                continue
            if k[1] != slot:
                close()
                slot, kinds, page_hash, last, rank_ok = k[1], 0, v[0], 0, True
            if v[0] != page_hash or v[1] != rank or k[2] != kinds:
                rank_ok = False
            kinds, last = kinds + 1, max(last, v[2])
        close()
        return out

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
        """Publish ``(page hash, slot, last_access)`` entries for every payload, atomically (in
        slot order: neighbouring keys share B-tree pages)."""
        key, value, kinds = KEY.pack, VALUE.pack, range(num_payloads)
        items = [
            (key(ns, slot, kind), value(page_hash, rank, last))
            for page_hash, slot, last in sorted(pages, key=itemgetter(1))
            for kind in kinds
        ]
        with self.env.begin(write=True, db=self._pages) as txn:
            consumed, _ = txn.cursor().putmulti(items)  # one call: half a put per key's time
            if consumed != len(items):  # the transaction aborts: nothing is published
                raise lmdb.Error(f"the index took {consumed} of {len(items)} entries")

    def touch_pages(
        self, ns: bytes, rank: int, pages: Sequence[tuple[bytes, int, int]], num_payloads: int
    ) -> None:
        """Set ``last_access`` of ``(page hash, slot, last_access)`` pages whose entries still
        name that slot (a page dropped meanwhile is left dropped)."""
        ranked = _RANK.pack(rank)
        with self.env.begin(write=True, db=self._pages) as txn:
            for page_hash, slot, last in sorted(pages, key=itemgetter(1)):
                value = VALUE.pack(page_hash, rank, last)
                for kind in range(num_payloads):
                    key = KEY.pack(ns, slot, kind)
                    if _names(txn.get(key), page_hash, ranked):
                        txn.put(key, value)

    def delete_pages(
        self,
        ns: bytes,
        pages: Sequence[tuple[bytes, int]],
        num_payloads: int,
        rank: int | None = None,
    ) -> None:
        """Delete the payload entries of each ``(page hash, slot)`` that still name that page
        (and ``rank``, when given): another page's entries at the slot stay."""
        pack, kinds = KEY.pack, range(num_payloads)
        ranked = None if rank is None else _RANK.pack(rank)
        with self.env.begin(write=True, db=self._pages) as txn:
            pop, put = txn.pop, txn.put
            for page_hash, slot in sorted(pages, key=itemgetter(1)):
                for kind in kinds:
                    key = pack(ns, slot, kind)
                    raw = pop(key)  # one call: the entry found and deleted
                    if raw is not None and not _names(raw, page_hash, ranked):
                        put(key, raw)  # another page's (or an unreadable) entry: it stays

    def delete_keys(self, keys: Sequence[bytes]) -> None:
        with self.env.begin(write=True, db=self._pages) as txn:
            for key in keys:
                txn.delete(key)

    def clear(self, ns: bytes, rank: int) -> int:
        """Delete every entry of ``rank`` in namespace ``ns``; returns how many."""
        doomed = [
            key
            for key, value in self.items(ns)
            if (found := decode_value(value)) is None or found[1] == rank
        ]
        self.delete_keys(doomed)
        return len(doomed)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release_env(self.env)


assert KEY.size == HASH_BYTES + 10 and VALUE.size == HASH_BYTES + 12
