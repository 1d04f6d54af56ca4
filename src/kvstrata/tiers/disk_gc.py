"""``kvstrata disk gc``: remove the groups of a disk tier directory that no store uses.

``--l3-gib`` bounds what one store (one namespace and rank) preallocates; it cannot bound the
directory, because every model, budget or cp size that ran there left its own group (its
namespace differs). This removes whole groups — slabs, half-created slabs and index — of every
namespace not named in ``keep``, each under its rank lock taken without waiting: a group a store
holds is left alone and reported in use. Only files of kvstrata's own name patterns are removed;
a group's lock file stays (a store that starts meanwhile may hold it open).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DiskStoreError
from .disk_dir import SLAB_DIR, list_groups, prepare_root, remove_group_files
from .disk_format import RankLock, lock_path


@dataclass
class GcReport:
    """Groups removed (name, bytes), kept, and in use."""

    removed: list[tuple[str, int]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    in_use: list[str] = field(default_factory=list)

    @property
    def freed_bytes(self) -> int:
        return sum(n for _, n in self.removed)


def collect(root: Path, keep: Iterable[str] | None = None, dry_run: bool = False) -> GcReport:
    """Remove every idle group under ``root`` whose namespace (16 hex digits, or a prefix of
    them) is not in ``keep``; ``dry_run`` only says what would go."""
    root = Path(root)
    prepare_root(root, create=False)
    prefixes = [k.lower() for k in keep or ()]
    report = GcReport()
    for group in list_groups(root):
        ns_hex = group.name.rsplit("-r", 1)[0]
        if any(ns_hex.startswith(p) for p in prefixes):
            report.kept.append(group.name)
            continue
        try:
            lock = RankLock(lock_path(root / SLAB_DIR, bytes.fromhex(ns_hex), group.rank))
        except DiskStoreError:
            report.in_use.append(group.name)
            continue
        try:
            current = next((g for g in list_groups(root) if g.name == group.name), group)
            if dry_run:
                report.removed.append((group.name, current.nbytes()))
            else:
                report.removed.append((group.name, remove_group_files(current)))
        finally:
            lock.release()
    return report
