"""The layout record of one rank's disk tier: which directories hold its slabs, checked at start.

Each directory of a group (one namespace and rank) holds ``slabs/<ns>-r<rank>.layout``::

    {"kvstrata": "disk layout", "version": 1, "store": "<16 hex digits>",
     "stripe": j, "stripes": k, "dirs": [this rank's directories], "roots": [the tier's]}

``store`` is drawn when a ``clear`` start lays the group out, and every stripe of that store
carries it; ``dirs`` and ``roots`` (absolute, in the order given) are what the start was given,
kept for messages. A ``load`` start keeps the group only when each of its directories holds
stripe ``j`` of ``k`` of one store, in the order given now (:func:`settle_layout`); anything else
(another order, a directory missing or new, the pages of this rank found in a directory that
now maps to another rank) is refused with what was written and the flags that reopen it, never
started empty over pages that would then be lost or, worse, read against the wrong stripe. A
group of an older kvstrata (one directory, no record) is adopted as one stripe.

A record is written whole (a temporary file, fsync-ed, renamed into place) under the group's
locks, before the slabs are opened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ..errors import DiskFormatError, DiskStoreError
from .disk_dir import FILE_MODE, index_dir, layout_path, read_own_file, refuse_link, temp_name

_KIND = "disk layout"
_VERSION = 1
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Layout:
    """One directory's record of the store it holds a stripe of."""

    store: str
    stripe: int
    stripes: int
    dirs: tuple[str, ...]
    roots: tuple[str, ...]

    def describe(self) -> str:
        """Where the rank's slabs were written, for messages."""
        if self.stripes == 1:
            return f"in {self.dirs[0]}"
        return f"striped over {', '.join(self.dirs)}"

    def flags(self) -> str:
        """The ``--l3-dir`` flags of the start that wrote it."""
        return " ".join(f"--l3-dir {r}" for r in self.roots)


def read_layout(path: Path) -> Layout | None:
    """The record at ``path``, None when there is none; a record that is not one of kvstrata's
    (or not whole) is a :class:`DiskFormatError` naming the way out."""
    raw = read_own_file(path, 1 << 16)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        assert isinstance(doc, dict) and doc["kvstrata"] == _KIND and doc["version"] == _VERSION
        out = Layout(
            str(doc["store"]),
            int(doc["stripe"]),
            int(doc["stripes"]),
            tuple(str(d) for d in doc["dirs"]),
            tuple(str(r) for r in doc["roots"]),
        )
        assert 0 <= out.stripe < out.stripes == len(out.dirs) >= 1
    except (ValueError, KeyError, TypeError, AssertionError):
        raise DiskFormatError(
            f"{path} is not a layout record this kvstrata reads; start the disk tier with "
            "'clear' (drops what it holds), or remove the group with 'kvstrata disk gc'"
        ) from None
    return out


def write_layout(path: Path, layout: Layout) -> None:
    """Put ``layout`` at ``path`` whole (a temp file, fsync-ed, renamed over the old record)."""
    refuse_link(path)
    doc = {
        "kvstrata": _KIND,
        "version": _VERSION,
        "store": layout.store,
        "stripe": layout.stripe,
        "stripes": layout.stripes,
        "dirs": list(layout.dirs),
        "roots": list(layout.roots),
    }
    tmp = path.with_name(temp_name(path.name))
    tmp.unlink(missing_ok=True)  # ours: left by a killed process that had our pid
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, FILE_MODE)
        try:
            os.write(fd, json.dumps(doc).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise DiskStoreError(
            f"cannot write {path}: {err.strerror}; give the disk tier a writable directory"
        ) from None


def _absolute(paths: Sequence[Path]) -> tuple[str, ...]:
    return tuple(os.path.abspath(p) for p in paths)


def settle_layout(
    dirs: Sequence[Path],
    roots: Sequence[Path],
    namespace: bytes,
    rank: int,
    start: str,
) -> Layout:
    """Check where rank ``rank``'s slabs were written against ``dirs`` (its directories, home
    first, out of the tier's ``roots``), then record the layout in each: on ``load`` the same
    store's (raises :class:`DiskFormatError` saying what to give instead when it differs), on
    ``clear`` a new one. Called under the group's locks in ``dirs``; returns this start's record
    of the home directory."""
    k = len(dirs)
    found: list[Layout | None] = [None] * k  # clear: whatever was there is replaced
    if start == "clear":
        store = os.urandom(8).hex()
    else:
        found = [read_layout(layout_path(d, namespace, rank)) for d in dirs]
        store = _loaded(dirs, roots, namespace, rank, found)
    mine, all_roots = _absolute(dirs), _absolute(roots)
    records = [Layout(store, j, k, mine, all_roots) for j in range(k)]
    for d, old, new in zip(dirs, found, records, strict=True):
        if old != new:
            write_layout(layout_path(d, namespace, rank), new)
    return records[0]


def _loaded(
    dirs: Sequence[Path],
    roots: Sequence[Path],
    namespace: bytes,
    rank: int,
    found: list[Layout | None],
) -> str:
    """The store id a ``load`` start keeps (a new one where nothing was written yet)."""
    k = len(dirs)
    if all(f is not None for f in found):
        ids = {f.store for f in found if f is not None}
        if len(ids) == 1 and all(
            f is not None and (f.stripe, f.stripes) == (j, k) for j, f in enumerate(found)
        ):
            return ids.pop()
    elif all(f is None for f in found):
        for r in roots:
            if r not in dirs and (rec := _look(layout_path(r, namespace, rank))) is not None:
                _refuse(dirs, roots, namespace, rank, rec)  # the rank's pages are elsewhere
        legacy = (index_dir(dirs[0], namespace, rank) / "data.mdb").exists()
        if not legacy or k == 1:  # nothing written yet, or an older kvstrata's one directory
            return os.urandom(8).hex()
        old = Layout("", 0, 1, _absolute(dirs[:1]), _absolute(dirs[:1]))
        _refuse(dirs, roots, namespace, rank, old)
    then = next(f for f in found if f is not None)
    _refuse(dirs, roots, namespace, rank, then, _differences(dirs, found, then))


def _differences(dirs: Sequence[Path], found: list[Layout | None], then: Layout) -> str:
    """What each directory holds that is not its part of the store ``then`` describes."""
    out = []
    for j, (d, f) in enumerate(zip(dirs, found, strict=True)):
        if f is None:
            out.append(f"{d} holds no part of it")
        elif f.store != then.store:
            out.append(f"{d} holds a part of another store")
        elif (f.stripe, f.stripes) != (j, len(dirs)):
            out.append(f"{d} holds what was its directory {f.stripe + 1} of {f.stripes}")
    return "; ".join(out)


def _look(path: Path) -> Layout | None:
    """Another directory's record (of another rank's mapping now): None also when unreadable,
    which is for that directory's own start to refuse."""
    try:
        return read_layout(path)
    except DiskStoreError:
        return None


def _refuse(
    dirs: Sequence[Path],
    roots: Sequence[Path],
    namespace: bytes,
    rank: int,
    then: Layout,
    detail: str = "",
) -> NoReturn:
    now = Layout("", 0, len(dirs), _absolute(dirs), _absolute(roots))
    clear = "start it with 'clear' (--l3-start clear; drops what they hold)"
    head = f"the disk tier of namespace {namespace.hex()[:16]} rank {rank} was written"
    if then.dirs == now.dirs:  # the same directories, but a part is missing or another's
        raise DiskFormatError(
            f"{head} {then.describe()}, but {detail}: its pages cannot be read back whole; {clear}"
        )
    raise DiskFormatError(
        f"{head} {then.describe()} ({then.flags()}); this start gives that rank "
        f"{now.describe()} ({now.flags()}){f' ({detail})' if detail else ''}: give the "
        "directories as they were, in that order (rank r of n takes directory r % n; with "
        f"more directories than ranks, it stripes over several), or {clear}"
    )
