"""The disk tier's bytes on disk: slab files of fixed 4 KiB-aligned slots, and their I/O.

One preallocated slab file per (namespace, rank, payload) in each directory the rank's slots are
striped over (``disk_layout.py``). Its first 4 KiB are a *superblock* that says what the file
holds (the stripe included); slot ``s`` follows at ``ALIGN + s * slot_bytes``::

    offset 0            ALIGN               ALIGN + slot_bytes
    | superblock | pad  | header | payload | pad | header | payload | pad | ...
                        |<------ slot 0 -------->|<------ slot 1 -------->|

    slot header (64 bytes, little-endian):
      magic "KVSTRPG\\0" | format u16 | payload kind u16 | flags u32 | page hash 32s
      | payload length u32 | payload CRC-32C u32 | reserved u32 | header CRC-32C u32

``slot_bytes`` is header + payload rounded up to 4 KiB, so every slot starts and ends on an
O_DIRECT boundary and a page of one payload is one write and one read. Small pages (header +
payload at most :data:`PACK_MAX_SLOT` bytes: a tiny model's, ``--model none``'s) may be *packed*
instead (the ``packed`` I/O mode): rounded up to :data:`PACK_ALIGN` bytes, many slots to a 4 KiB
block, read and written through the page cache (O_DIRECT cannot write part of a block); a
64-byte page then moves 128 bytes, not 4,096. The superblock's slot size says which (a packed
one is never a multiple of 4 KiB). The payload is the page's layers in order (layer 0's
``page_size`` tokens, then layer 1's, ...), as the ``page_first`` host layout keeps them. A slot is only *believed* through the index (``disk_index.py``); its header is
checked on every read (magic, format, kind, hash, length, both CRCs), so a torn, stale or foreign
slot reads as a miss, never as someone else's bytes.

I/O is ``O_DIRECT`` from page-aligned anonymous ``mmap`` buffers where the filesystem supports it
(:func:`probe_direct_io`), else buffered ``pwrite`` / ``pread``; both make data durable with
``fdatasync`` before the index may name it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import crc32c as _crc32c
import numpy as np
import numpy.typing as npt

from ..errors import DiskFormatError, DiskStoreError
from .disk_dir import FILE_MODE, refuse_link, temp_name
from .page_hash import FORMAT_VERSION

#: O_DIRECT offset, length and buffer alignment (one filesystem block on every disk we target).
ALIGN = 4096
#: The most slots one vectored read or write covers (Linux's IOV_MAX).
MAX_RUN_SLOTS = 1024
#: The most directories one rank's slots are striped over (the superblock keeps it in a byte).
MAX_STRIPES = 256
SLOT_HEADER_BYTES = 64
#: Packed slots: sizes rounded to this, for slots of at most PACK_MAX_SLOT bytes (module docs).
PACK_ALIGN = 64
PACK_MAX_SLOT = ALIGN // 2
PAGE_MAGIC = b"KVSTRPG\0"
SLAB_MAGIC = b"KVSTRSB\0"
#: The slot header before its own CRC (60 bytes) and the superblock before its CRC.
_SLOT_HEAD = struct.Struct("<8sHHI32sIII")
_SUPER_HEAD = struct.Struct("<8sHHHHI32s32sQQQ")
_CRC = struct.Struct("<I")
assert _SLOT_HEAD.size + _CRC.size == SLOT_HEADER_BYTES
#: Why a slab whose superblock was never written (creation killed before it) does not count.
NO_SUPERBLOCK = "no superblock (its creation never finished)"
#: Every open below ``slabs/``: never through a symbolic link.
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def open_regular(path: Path, flags: int, mode: int = FILE_MODE) -> int:
    """``os.open`` that refuses a symbolic link (``O_NOFOLLOW``) and anything but a regular file,
    with a :class:`DiskStoreError` that says so; other OSErrors propagate."""
    try:
        fd = os.open(path, flags | _NOFOLLOW, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_link(path)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        refuse_link(path)
    return fd


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing ``value``; hardware-accelerated (SSE 4.2 /
    ARMv8 CRC) and releasing the GIL on large buffers."""
    return int(_crc32c.crc32c(data, value))


def crc32c_many(
    view: memoryview, starts: Sequence[int] | npt.NDArray[np.int64], size: int
) -> npt.NDArray[np.uint32]:
    """:func:`crc32c` of ``view[s : s + size]`` for each of ``starts``, with no Python step a
    region (the library has no batched call: the slices and calls are made by ``map``, about half
    the time of a generator calling :func:`crc32c`, which a run of small slots pays per slot)."""
    lo = np.asarray(starts, dtype=np.int64)
    cuts = map(slice, lo.tolist(), (lo + size).tolist())
    return np.fromiter(
        map(_crc32c.crc32c, map(view.__getitem__, cuts)), dtype=np.uint32, count=lo.size
    )


#: Whether the CRC-32C package runs on the CPU's CRC instructions (reported by the store).
CRC32C_HARDWARE: bool = bool(_crc32c.hardware_based)


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def slot_size(payload_len: int, packed: bool = False) -> int:
    """Bytes of one slot of a ``payload_len``-byte payload: header and payload rounded up to
    :data:`ALIGN`, or to :data:`PACK_ALIGN` when ``packed``."""
    return round_up(SLOT_HEADER_BYTES + payload_len, PACK_ALIGN if packed else ALIGN)


def packable(payload_len: int) -> bool:
    """Whether a payload's slots may be packed (:data:`PACK_MAX_SLOT`)."""
    return slot_size(payload_len, packed=True) <= PACK_MAX_SLOT


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned anonymous buffer of ``nbytes`` rounded up to :data:`ALIGN`,
    populated up front (its page faults are paid once here, not on the first pages spilled)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, round_up(max(nbytes, 1)), flags=flags)


@dataclass(frozen=True, slots=True)
class SlotHeader:
    """The 64-byte header at the start of every written slot."""

    payload_kind: int
    page_hash: bytes
    payload_len: int
    payload_crc: int
    flags: int = 0
    format_version: int = FORMAT_VERSION

    def pack_into(self, buf: memoryview | mmap.mmap, offset: int = 0) -> None:
        _SLOT_HEAD.pack_into(
            buf,
            offset,
            PAGE_MAGIC,
            self.format_version,
            self.payload_kind,
            self.flags,
            self.page_hash,
            self.payload_len,
            self.payload_crc,
            0,
        )
        head = memoryview(buf)[offset : offset + _SLOT_HEAD.size]
        _CRC.pack_into(buf, offset + _SLOT_HEAD.size, crc32c(head))


def decode_slot_header(buf: memoryview) -> SlotHeader | str:
    """The header at the start of ``buf``, or why it is not a valid one."""
    if len(buf) < SLOT_HEADER_BYTES:
        return f"short read ({len(buf)} bytes)"
    magic, version, kind, flags, page_hash, length, crc, _ = _SLOT_HEAD.unpack_from(buf)
    if magic != PAGE_MAGIC:
        return "no page header (bad magic)"
    if _CRC.unpack_from(buf, _SLOT_HEAD.size)[0] != crc32c(buf[: _SLOT_HEAD.size]):
        return "header CRC mismatch"
    if version != FORMAT_VERSION:
        return f"format version {version}, not {FORMAT_VERSION}"
    return SlotHeader(kind, page_hash, length, crc, flags, version)


def check_slot(
    buf: memoryview,
    payload_kind: int,
    page_hash: bytes,
    payload_len: int,
    payload: bool = True,
    body: Sequence[memoryview] | None = None,
) -> str | None:
    """None when ``buf`` (a slot read from disk) holds payload ``payload_kind`` of ``page_hash``,
    intact; else the reason. ``payload=False`` checks the header only; ``body`` holds the
    payload's bytes in these pieces, in order, instead of after the header in ``buf`` (a value
    read straight into a host page's views)."""
    head = decode_slot_header(buf)
    if isinstance(head, str):
        return head
    if head.page_hash != page_hash:
        return "the slot holds another page"
    if head.payload_kind != payload_kind:
        return f"payload kind {head.payload_kind}, not {payload_kind}"
    if head.payload_len != payload_len:
        return f"payload length {head.payload_len}, not {payload_len}"
    if payload and body is not None:
        got = sum(len(b) for b in body)
        if got != payload_len:
            return f"short read ({got} of {payload_len} payload bytes)"
        crc = 0
        for piece in body:
            crc = crc32c(piece, crc)
        if crc != head.payload_crc:
            return "payload CRC mismatch"
    elif payload:
        end = SLOT_HEADER_BYTES + payload_len
        if len(buf) < end:
            return f"short read ({len(buf)} of {end} bytes)"
        if crc32c(buf[SLOT_HEADER_BYTES:end]) != head.payload_crc:
            return "payload CRC mismatch"
    return None


@dataclass(frozen=True, slots=True)
class SlabGeometry:
    """What one slab file holds: ``num_slots`` slots of payload ``kind`` of ``num_payloads``;
    stripe ``stripe`` of ``stripes`` when the rank's slots are striped over several directories
    (``disk_layout.py``: its global slot ``s * stripes + stripe`` is this file's slot ``s``)."""

    namespace: bytes
    rank: int
    payload_kind: int
    num_payloads: int
    payload_name: str
    payload_len: int
    num_slots: int
    stripe: int = 0
    stripes: int = 1
    packed: bool = False  # slots of PACK_ALIGN bytes, buffered I/O (module docstring)

    def __post_init__(self) -> None:
        assert 1 <= self.stripes <= MAX_STRIPES and 0 <= self.stripe < self.stripes
        assert not self.packed or packable(self.payload_len), "a packed slot of a large page"

    @property
    def slot_bytes(self) -> int:
        return slot_size(self.payload_len, self.packed)

    @property
    def file_bytes(self) -> int:
        return ALIGN + self.num_slots * self.slot_bytes

    def differences(self, other: SlabGeometry) -> str:
        """The fields in which ``other`` differs, as ``name: mine vs other``."""
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                if isinstance(a, bytes) and isinstance(b, bytes):
                    a, b = a.hex()[:16], b.hex()[:16]
                out.append(f"{f.name} {a} vs {b}")
        return ", ".join(out)

    def slot_offset(self, slot: int) -> int:
        assert 0 <= slot < self.num_slots, f"slot {slot} outside [0, {self.num_slots})"
        return ALIGN + slot * self.slot_bytes

    def file_name(self) -> str:
        return (
            f"{self.namespace.hex()[:16]}-r{self.rank}-{self.payload_kind}-{self.payload_name}.slab"
        )

    def encode(self) -> bytes:
        """The superblock: this geometry, the format version and a CRC, padded to ALIGN."""
        name = self.payload_name.encode()
        assert len(name) <= 32, "payload names are identifiers of at most 32 bytes"
        head = _SUPER_HEAD.pack(
            SLAB_MAGIC,
            FORMAT_VERSION,
            self.payload_kind,
            self.num_payloads,
            (self.stripes - 1) << 8 | self.stripe,  # 0 (one stripe) in slabs before striping
            self.rank,
            self.namespace,
            name,
            self.payload_len,
            self.slot_bytes,
            self.num_slots,
        )
        return (head + _CRC.pack(crc32c(head))).ljust(ALIGN, b"\0")

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> SlabGeometry | str:
        """The geometry a superblock describes, or why ``buf`` is not a valid superblock."""
        size = _SUPER_HEAD.size + _CRC.size
        if len(buf) < size or not any(buf[:size]):
            return NO_SUPERBLOCK
        fields = _SUPER_HEAD.unpack_from(buf)
        (
            magic,
            version,
            kind,
            num_payloads,
            striping,
            rank,
            ns,
            name,
            length,
            slot_bytes,
            num_slots,
        ) = fields
        if magic != SLAB_MAGIC:
            return "not a kvstrata slab (bad magic)"
        if _CRC.unpack_from(buf, _SUPER_HEAD.size)[0] != crc32c(
            memoryview(buf)[: _SUPER_HEAD.size]
        ):
            return "superblock CRC mismatch"
        if version != FORMAT_VERSION:
            return f"slab format version {version}; this kvstrata reads {FORMAT_VERSION}"
        stripe, stripes = striping & 0xFF, (striping >> 8) + 1
        if stripe >= stripes:
            return f"inconsistent superblock (stripe {stripe} of {stripes})"
        geom = cls(
            ns,
            rank,
            kind,
            num_payloads,
            name.rstrip(b"\0").decode(),
            length,
            num_slots,
            stripe,
            stripes,
            packed=slot_bytes % ALIGN != 0 and packable(length),
        )
        if geom.slot_bytes != slot_bytes or not 0 <= kind < num_payloads:
            return f"inconsistent superblock (slot bytes {slot_bytes}, kind {kind}/{num_payloads})"
        return geom


def probe_direct_io(directory: Path) -> str | None:
    """None when ``directory``'s filesystem takes an aligned O_DIRECT write, fdatasync and read;
    else why not (what the store reports when it falls back to buffered I/O)."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = directory / f".odirect-probe-{os.getpid()}"
    buf = aligned_buffer(ALIGN)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT | _NOFOLLOW, 0o600)
    except OSError as err:
        return f"O_DIRECT open failed: {err.strerror}"
    try:
        os.pwrite(fd, buf, 0)
        os.fdatasync(fd)
        if os.preadv(fd, [buf], 0) != ALIGN:
            return "O_DIRECT read came back short"
        return None
    except OSError as err:
        return f"O_DIRECT I/O failed: {err.strerror}"
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


class SlabFile:
    """One open slab file: slot writes and reads at fixed offsets, and ``fdatasync``.

    Buffers handed to :meth:`write_slot` / :meth:`read_slot` must be page-aligned (slices at
    :data:`ALIGN` offsets of :func:`aligned_buffer`) and ``slot_bytes`` long; that is what
    O_DIRECT requires and what the buffered mode accepts as well.
    """

    def __init__(
        self, path: Path, geometry: SlabGeometry, direct: bool, readonly: bool = False
    ) -> None:
        self.path = path
        self.geometry = geometry
        self.direct = direct
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | (os.O_DIRECT if direct else 0)
        try:
            self._fd = open_regular(path, flags)
        except OSError as err:
            raise DiskStoreError(f"cannot open slab {path}: {err.strerror}") from None

    # -- creation and opening --------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, geometry: SlabGeometry, direct: bool) -> SlabFile:
        """Create (or replace) ``path`` as an empty slab: a new file (``O_EXCL``) under a temporary
        name, preallocated whole, its superblock written and durable, then renamed over ``path``
        (which replaces a directory entry, never a link's target). A killed creation leaves only
        the temporary file; a full disk is refused here, not met mid-spill."""
        refuse_link(path)
        tmp = path.with_name(temp_name(path.name))
        try:
            fd = open_regular(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        except FileExistsError:  # left by a killed process that had our pid
            tmp.unlink()
            return cls.create(path, geometry, direct)
        except OSError as err:
            raise DiskStoreError(
                f"cannot create slab {tmp}: {err.strerror}; give the disk tier a writable directory"
            ) from None
        try:
            os.posix_fallocate(fd, 0, geometry.file_bytes)
            os.pwrite(fd, geometry.encode(), 0)
            os.fdatasync(fd)
            os.rename(tmp, path)
        except OSError as err:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskStoreError(
                    f"no room for a slab of {geometry.file_bytes / 2**30:.2f} GiB at {path}: "
                    "the disk is full; lower the disk budget or free space"
                ) from None
            raise DiskStoreError(f"cannot preallocate slab {path}: {err.strerror}") from None
        os.close(fd)
        _fsync_dir(path.parent)
        return cls(path, geometry, direct)

    @staticmethod
    def read_geometry(path: Path) -> tuple[SlabGeometry | str, int]:
        """``(geometry or why the superblock is bad, file size)`` without opening for writes."""
        try:
            fd = open_regular(path, os.O_RDONLY)
        except DiskStoreError as err:
            return str(err).split(";")[0].removeprefix(f"{path} is "), 0
        except OSError as err:
            return f"unreadable: {err.strerror}", 0
        try:
            head = os.pread(fd, ALIGN, 0)
            size = os.fstat(fd).st_size
        except OSError as err:
            return f"unreadable: {err.strerror}", 0
        finally:
            os.close(fd)
        return SlabGeometry.decode(head), size

    @classmethod
    def open_existing(
        cls, path: Path, geometry: SlabGeometry, direct: bool
    ) -> tuple[SlabFile, bool]:
        """Open a slab whose superblock must describe ``geometry``; returns the file and whether
        it was shorter than its geometry (a truncated slab, extended again here)."""
        refuse_link(path)
        found, size = cls.read_geometry(path)
        if isinstance(found, str):
            raise DiskFormatError(
                f"slab {path}: {found}; start the disk tier with 'clear' to recreate it, or run "
                "'kvstrata disk check --fix'"
            )
        if found != geometry:
            raise DiskFormatError(
                f"slab {path} differs from what this store needs in {found.differences(geometry)} "
                "(the slab's vs this store's); start with 'clear' (drops the disk contents) or "
                "the same budget, model and I/O mode (--l3-io)"
            )
        slab = cls(path, geometry, direct)
        truncated = size < geometry.file_bytes
        if truncated:
            try:
                os.posix_fallocate(slab._fd, 0, geometry.file_bytes)
            except OSError as err:
                slab.close()
                raise DiskStoreError(
                    f"slab {path} is truncated and cannot be extended: {err.strerror}"
                ) from None
        return slab, truncated

    # -- I/O -------------------------------------------------------------------------------------

    def write_slot(self, slot: int, buf: memoryview) -> None:
        """Write one whole slot (header + payload + padding); raises OSError on failure."""
        assert len(buf) == self.geometry.slot_bytes
        offset = self.geometry.slot_offset(slot)
        done = 0
        while done < len(buf):  # a short write at a regular file is rare but legal
            n = os.pwrite(self._fd, buf[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite returned {n}")
            done += n

    def read_slot(self, slot: int, buf: memoryview) -> int:
        """Read ``len(buf)`` bytes from the start of ``slot``; returns the bytes read (short past
        the end of a truncated file). Raises OSError on an I/O error."""
        offset = self.geometry.slot_offset(slot)
        done = 0
        # A short read happens only at the end of the file; O_DIRECT cannot go on from an
        # unaligned offset, and there is nothing more to read anyway.
        while done < len(buf) and (done % ALIGN == 0 or not self.direct):
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def write_slots(self, first_slot: int, bufs: list[memoryview]) -> None:
        """Write whole consecutive slots from ``first_slot`` (one buffer each) in one vectored
        call; raises OSError on failure (which slots landed is then unknown)."""
        assert 1 <= len(bufs) <= MAX_RUN_SLOTS
        assert all(len(b) == self.geometry.slot_bytes for b in bufs)
        offset = self.geometry.slot_offset(first_slot)
        self.geometry.slot_offset(first_slot + len(bufs) - 1)  # inside the slab
        total = len(bufs) * self.geometry.slot_bytes
        n = os.pwritev(self._fd, bufs, offset)
        if n != total:  # a short write at a regular file is rare: finish it slot by slot
            for i, buf in enumerate(bufs):
                if (i + 1) * len(buf) > n:
                    self.write_slot(first_slot + i, buf)

    def read_slots(self, first_slot: int, bufs: list[memoryview]) -> int:
        """Read consecutive slots from ``first_slot`` into ``bufs`` (one each) in one vectored
        call; returns the bytes read (short past the end of a truncated file). Raises OSError
        on an I/O error."""
        assert 1 <= len(bufs) <= MAX_RUN_SLOTS
        offset = self.geometry.slot_offset(first_slot)
        self.geometry.slot_offset(first_slot + len(bufs) - 1)  # inside the slab
        size = self.geometry.slot_bytes
        done = i = 0
        while i < len(bufs):  # a short read happens only at the end of the file
            n = os.preadv(self._fd, bufs[i:], offset + done)
            if n <= 0:
                break
            done += n
            if done % size:  # a partial slot: nothing more to read (and O_DIRECT cannot go on)
                break
            i = done // size
        return done

    # What :class:`~kvstrata.tiers.disk_layout.StripedSlab` offers over several files: a rank
    # with one directory has one file per payload, a slab of one stripe.
    stripes = 1

    @property
    def files(self) -> list[SlabFile]:
        return [self]

    def read_run(self, first_slot: int, bufs: list[memoryview]) -> int:
        return self.read_slots(first_slot, bufs)

    def write_run(self, first_slot: int, bufs: list[memoryview]) -> None:
        self.write_slots(first_slot, bufs)

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _fsync_dir(directory: Path) -> None:
    """Make a file's creation durable (its directory entry)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_path(slab_dir: Path, namespace: bytes, rank: int) -> Path:
    return slab_dir / f"{namespace.hex()[:16]}-r{rank}.lock"


class RankLock:
    """An exclusive ``flock`` on one (namespace, rank)'s slabs, held while a store or an audit
    uses them; the kernel drops it when its process dies, so a killed store never blocks. It is
    only ever tried, never waited for. ``readonly`` (an audit that writes nothing) opens an
    existing lock file read-only and does not record its pid; without a lock file it holds
    nothing (``held`` is False)."""

    #: The holder's pid, fixed width: written in one pwrite over the previous one, never
    #: truncated first, so a contender never reads half of it.
    _PID_WIDTH = 20

    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = path
        self._fd = -1
        flags = os.O_RDONLY if readonly else os.O_CREAT | os.O_RDWR
        try:
            self._fd = open_regular(path, flags)
        except FileNotFoundError:
            if readonly:
                return
            raise
        except OSError as err:
            raise DiskStoreError(
                f"cannot create {path}: {err.strerror}; give the disk tier a writable directory"
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self._holder()
            os.close(self._fd)
            self._fd = -1
            raise DiskStoreError(
                f"{path.parent} is in use by another process ({holder}) for this namespace "
                "and rank; stop it first or give this one another directory"
            ) from None
        if not readonly:
            os.pwrite(self._fd, f"{os.getpid():>{self._PID_WIDTH}}\n".encode(), 0)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def _holder(self) -> str:
        """``pid N`` of the holder; it may be about to write it, so look a few times."""
        for _ in range(20):
            raw = os.pread(self._fd, self._PID_WIDTH + 1, 0).decode(errors="replace").strip()
            if raw.isdigit():
                return f"pid {int(raw)}"
            time.sleep(0.01)
        return "its pid is not recorded yet"

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1
