"""What lives in a disk tier directory, and the rules for touching it.

::

    ROOT/                       mode 0700 when kvstrata creates it
      KVSTRATA-L3               the marker: kvstrata made (or adopted an empty) ROOT
      slabs/                    0700
        <ns>-r<rank>-<kind>-<payload>.slab      one per (namespace, rank, payload)
        <ns>-r<rank>.lock                       the group's flock (``disk_format.RankLock``)
        <ns>-r<rank>.layout                     where the group's slabs live (``disk_manifest``)
      index/                    0700
        <ns>-r<rank>/           one LMDB environment per (namespace, rank): data.mdb, lock.mdb

A group striped over several directories (``disk_layout.py``) has its slabs, lock and layout in
each, and its index in the first (its home) only.

``<ns>`` is the first 16 hex digits of the namespace digest. A *group* is one (namespace, rank):
its slabs, its lock and its index. Each group has an index of its own, so one process that stops
(SIGSTOP, a hung disk) while it holds its LMDB write lock never blocks another rank's or another
model's store: no lock in the tier is shared between processes except the group's flock, which
is only ever taken without blocking.

kvstrata never follows a symbolic link and never writes into a directory it did not create or
adopt: a ROOT that holds anything but kvstrata's own names and carries no marker (``/``, a home
directory, a disk tier of an older layout) is refused. Inside, it deletes only names of its own
patterns (:data:`SLAB_NAME`, :data:`LAYOUT_NAME`, :data:`TEMP_NAME`, a group's index directory).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import DiskStoreError

MARKER = "KVSTRATA-L3"
INDEX_DIR = "index"
SLAB_DIR = "slabs"
#: 2: one index per group (1: one index per directory, ``index/data.mdb``).
LAYOUT_VERSION = 2
_MARKER_DOC = {"kvstrata": "disk tier", "layout": LAYOUT_VERSION}
DIR_MODE = 0o700
FILE_MODE = 0o600

SLAB_NAME = re.compile(
    r"^(?P<ns>[0-9a-f]{16})-r(?P<rank>\d+)-(?P<kind>\d+)-(?P<payload>\w{1,32})\.slab$"
)
LOCK_NAME = re.compile(r"^(?P<ns>[0-9a-f]{16})-r(?P<rank>\d+)\.lock$")
LAYOUT_NAME = re.compile(r"^(?P<ns>[0-9a-f]{16})-r(?P<rank>\d+)\.layout$")
GROUP_NAME = re.compile(r"^(?P<ns>[0-9a-f]{16})-r(?P<rank>\d+)$")
#: A file being created (written whole under this name, then renamed into place).
TEMP_NAME = re.compile(r"^(?P<final>[\w.-]+)\.tmp-(?P<pid>\d+)$")


def group_name(namespace: bytes, rank: int) -> str:
    return f"{namespace.hex()[:16]}-r{rank}"


def index_dir(root: Path, namespace: bytes, rank: int) -> Path:
    """The LMDB environment directory of one group."""
    return Path(root) / INDEX_DIR / group_name(namespace, rank)


def layout_path(root: Path, namespace: bytes, rank: int) -> Path:
    """The layout record of one group in one directory."""
    return Path(root) / SLAB_DIR / f"{group_name(namespace, rank)}.layout"


def temp_name(final: str) -> str:
    return f"{final}.tmp-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class GroupFiles:
    """What one group has on disk (names only; nothing here was opened)."""

    name: str  # <ns>-r<rank>
    slabs: tuple[Path, ...]
    lock: Path | None
    index: Path | None
    temps: tuple[Path, ...]
    layout: Path | None = None

    @property
    def rank(self) -> int:
        return int(self.name.rsplit("-r", 1)[1])

    def nbytes(self) -> int:
        """Disk bytes the group's files take (allocated blocks)."""
        paths = [*self.slabs, *self.temps, *([self.layout] if self.layout else [])]
        if self.index is not None:
            paths += [self.index / "data.mdb", self.index / "lock.mdb"]
        return sum(_allocated(p) for p in paths)


def _allocated(path: Path) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0


def is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def refuse_link(path: Path, what: str = "") -> None:
    """Raise unless ``path`` is absent or a regular file (or directory, when ``what`` says so)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    ok = stat.S_ISDIR(mode) if what == "dir" else stat.S_ISREG(mode)
    if not ok:
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular " + (what or "file")
        raise DiskStoreError(
            f"{path} is {kind}; kvstrata never follows or replaces links in its directories: "
            "remove it"
        )


def _make_dir(path: Path) -> None:
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except OSError as err:
        raise DiskStoreError(
            f"cannot create {path}: {err.strerror}; give the disk tier a writable directory"
        ) from None
    refuse_link(path, "dir")


def read_own_file(path: Path, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of one of kvstrata's small files (None when there is none); a link
    or anything but a regular file is refused, any other failure is a DiskStoreError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_link(path)
        raise DiskStoreError(f"cannot read {path}: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            refuse_link(path)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _read_marker(root: Path) -> dict[str, object] | None:
    path = root / MARKER
    raw = read_own_file(path, 4096)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("kvstrata") != "disk tier":
        raise DiskStoreError(f"{path} is not a kvstrata marker; give another directory")
    return doc


def _write_marker(root: Path) -> None:
    """Create the marker whole or not at all (a hard link of a finished temp file)."""
    tmp = root / temp_name(MARKER)
    try:
        fd = os.open(
            tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE
        )
    except OSError as err:
        raise DiskStoreError(
            f"cannot write in {root}: {err.strerror}; give the disk tier a writable directory"
        ) from None
    try:
        os.write(fd, json.dumps(_MARKER_DOC).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, root / MARKER)
    except FileExistsError:
        pass  # another rank marked it meanwhile
    finally:
        os.unlink(tmp)


def _foreign_entries(root: Path) -> list[str]:
    """Names in ``root`` that are not kvstrata's (a marker being written by a peer is ours)."""
    names = []
    for name in os.listdir(root):
        m = TEMP_NAME.match(name)
        if name in (MARKER, INDEX_DIR, SLAB_DIR) or (m is not None and m["final"] == MARKER):
            continue
        names.append(name)
    return sorted(names)


def prepare_root(root: Path, create: bool = True) -> None:
    """Check that ``root`` is a disk tier directory kvstrata may write in, creating and marking
    it (and its ``slabs/`` and ``index/``) when ``create`` and it is new or empty."""
    root = Path(root)
    # ROOT itself is the user's choice and may be a link to a directory (``/nvme`` often is);
    # everything below it is kvstrata's and is never reached through one.
    if not root.is_dir():
        if not os.path.lexists(root):
            if not create:
                raise DiskStoreError(f"{root} is not a kvstrata disk directory (it does not exist)")
            try:
                os.makedirs(root.parent, exist_ok=True)
            except OSError as err:
                raise DiskStoreError(f"cannot create {root.parent}: {err.strerror}") from None
            _make_dir(root)
        # Asked again: the ranks of a CP group prepare one root at once, and a peer may have
        # made it between the first look and the second.
        if not root.is_dir():
            raise DiskStoreError(f"{root} is not a directory; give the disk tier a directory")
    marker = _read_marker(root)
    if marker is None:
        foreign = _foreign_entries(root)
        if not create:
            raise DiskStoreError(f"{root} is not a kvstrata disk directory (no {MARKER} marker)")
        if is_real_dir(root / INDEX_DIR) and (root / INDEX_DIR / "data.mdb").exists():
            raise DiskStoreError(
                f"{root} holds a disk tier of an older kvstrata (one shared index/data.mdb), "
                "whose pages this version never reads: remove that directory or give another"
            )
        if foreign:
            shown = ", ".join(foreign[:3]) + (
                f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            )
            raise DiskStoreError(
                f"{root} holds files kvstrata did not create ({shown}) and no {MARKER} marker; "
                "give the disk tier a new or empty directory"
            )
        _write_marker(root)
    elif marker.get("layout") != LAYOUT_VERSION:
        raise DiskStoreError(
            f"{root} holds a disk tier of layout {marker.get('layout')!r}, this kvstrata "
            f"writes layout {LAYOUT_VERSION}: remove that directory or give another"
        )
    for sub in (SLAB_DIR, INDEX_DIR):
        if create:
            _make_dir(root / sub)
        else:
            refuse_link(root / sub, "dir")


def list_groups(root: Path) -> list[GroupFiles]:
    """Every group with a file of kvstrata's name patterns under ``root`` (sorted by name)."""
    slabs: dict[str, list[Path]] = {}
    temps: dict[str, list[Path]] = {}
    locks: dict[str, Path] = {}
    layouts: dict[str, Path] = {}
    indexes: dict[str, Path] = {}
    slab_dir, idx_dir = Path(root) / SLAB_DIR, Path(root) / INDEX_DIR
    for name in sorted(os.listdir(slab_dir)) if is_real_dir(slab_dir) else []:
        if (m := SLAB_NAME.match(name)) is not None:
            slabs.setdefault(f"{m['ns']}-r{int(m['rank'])}", []).append(slab_dir / name)
        elif (m := LOCK_NAME.match(name)) is not None:
            locks[f"{m['ns']}-r{int(m['rank'])}"] = slab_dir / name
        elif (m := LAYOUT_NAME.match(name)) is not None:
            layouts[f"{m['ns']}-r{int(m['rank'])}"] = slab_dir / name
        elif (t := TEMP_NAME.match(name)) is not None and (
            m := SLAB_NAME.match(t["final"]) or LAYOUT_NAME.match(t["final"])
        ) is not None:
            temps.setdefault(f"{m['ns']}-r{int(m['rank'])}", []).append(slab_dir / name)
    for name in sorted(os.listdir(idx_dir)) if is_real_dir(idx_dir) else []:
        if GROUP_NAME.match(name) is not None:
            indexes[name] = idx_dir / name
    names = sorted({*slabs, *locks, *indexes, *temps, *layouts})
    return [
        GroupFiles(
            n,
            tuple(slabs.get(n, ())),
            locks.get(n),
            indexes.get(n),
            tuple(temps.get(n, ())),
            layouts.get(n),
        )
        for n in names
    ]


def foreign_files(root: Path) -> list[Path]:
    """Files under ``slabs/`` and ``index/`` that match none of kvstrata's name patterns."""
    out = []
    slab_dir, idx_dir = Path(root) / SLAB_DIR, Path(root) / INDEX_DIR
    for name in sorted(os.listdir(slab_dir)) if is_real_dir(slab_dir) else []:
        t = TEMP_NAME.match(name)
        if not (
            SLAB_NAME.match(name)
            or LOCK_NAME.match(name)
            or LAYOUT_NAME.match(name)
            or (t is not None and (SLAB_NAME.match(t["final"]) or LAYOUT_NAME.match(t["final"])))
            or name.startswith(".odirect-probe-")
        ):
            out.append(slab_dir / name)
    for name in sorted(os.listdir(idx_dir)) if is_real_dir(idx_dir) else []:
        if GROUP_NAME.match(name) is None:
            out.append(idx_dir / name)
    return out


def remove_group_files(group: GroupFiles) -> int:
    """Delete a group's slabs, temp files and index (never its lock file: a store that waits for
    it holds an open descriptor to it). The caller holds the group's lock. Returns bytes freed."""
    freed = group.nbytes()
    for path in (*group.slabs, *group.temps, *([group.layout] if group.layout else [])):
        refuse_link(path)
        path.unlink(missing_ok=True)
    if group.index is not None:
        remove_index(group.index)
    return freed


def remove_index(path: Path) -> None:
    """Delete one group's LMDB directory (its own two files, then the directory)."""
    refuse_link(path, "dir")
    for name in os.listdir(path):
        if name not in ("data.mdb", "lock.mdb") and TEMP_NAME.match(name) is None:
            raise DiskStoreError(
                f"{path} holds {name!r}, which kvstrata did not write; remove it by hand"
            )
    shutil.rmtree(path)
