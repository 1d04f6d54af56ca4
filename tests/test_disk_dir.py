"""The disk tier's directory (kvstrata.tiers.disk_dir): kvstrata never follows a link, never
writes into a directory it did not create, and deletes only its own names (issue 19: 4, LOW)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from disk_rig import NS, hashes, host_pool, open_store, spill_all

from kvstrata.cli import main
from kvstrata.errors import DiskStoreError
from kvstrata.tiers.disk_dir import MARKER, index_dir
from kvstrata.tiers.disk_format import SlabFile, lock_path

VICTIM = b"a file outside the disk directory, owned by someone else\n" * 1700  # 95 KB


def _victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_bytes(VICTIM)
    return path


def _slab(root: Path, kind: int = 0) -> Path:
    (path,) = (root / "slabs").glob(f"*-r0-{kind}-*.slab")
    return path


def test_directories_are_private_and_marked(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with open_store(root, pages=20):
        pass
    for path in (root, root / "slabs", root / "index", index_dir(root, NS.digest, 0)):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700, path
    assert (root / MARKER).is_file()
    assert sorted(os.listdir(root)) == [MARKER, "index", "slabs"]


def test_a_lock_file_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    root, victim = tmp_path / "l3", _victim(tmp_path)
    with open_store(root, pages=20):
        pass
    lock = lock_path(root / "slabs", NS.digest, 0)
    lock.unlink()
    lock.symlink_to(victim)
    for start in ("clear", "load"):
        with pytest.raises(DiskStoreError, match="is a symbolic link"):
            open_store(root, pages=20, start=start)
    assert victim.read_bytes() == VICTIM


@pytest.mark.parametrize("start", ["clear", "load"])
def test_a_slab_link_is_refused_and_its_target_untouched(tmp_path: Path, start: str) -> None:
    root, victim = tmp_path / "l3", _victim(tmp_path)
    with open_store(root, pages=20):
        pass
    slab = _slab(root)
    slab.unlink()
    slab.symlink_to(victim)
    with pytest.raises(DiskStoreError, match="is a symbolic link"):
        open_store(root, pages=20, start=start)
    assert victim.read_bytes() == VICTIM
    # disk check reports it and --fix leaves it (and its target) alone
    assert main(["disk", "check", str(root), "--fix"]) == 1
    assert slab.is_symlink() and victim.read_bytes() == VICTIM


def test_index_links_are_refused(tmp_path: Path) -> None:
    root, victim = tmp_path / "l3", _victim(tmp_path)
    with open_store(root, pages=20):
        pass
    data = index_dir(root, NS.digest, 0) / "data.mdb"
    data.unlink()
    data.symlink_to(victim)
    with pytest.raises(DiskStoreError, match="is a symbolic link"):
        open_store(root, pages=20, start="load")
    assert victim.read_bytes() == VICTIM
    group = index_dir(root, NS.digest, 0)
    for name in os.listdir(group):
        (group / name).unlink()
    group.rmdir()
    (tmp_path / "elsewhere").mkdir()
    group.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DiskStoreError, match="is a symbolic link"):
        open_store(root, pages=20, start="load")
    assert not os.listdir(tmp_path / "elsewhere")


def test_a_slab_is_created_whole_or_not_at_all(tmp_path: Path) -> None:
    """Slabs are written under a temporary name (O_EXCL) and renamed: a creation killed midway
    leaves only the temporary file, which the group's next store removes."""
    root = tmp_path / "l3"
    with open_store(root, pages=20):
        pass
    slab = _slab(root)
    leftover = slab.with_name(slab.name + ".tmp-999999")
    leftover.write_bytes(bytes(4096))  # a creation killed before its superblock
    with open_store(root, pages=20, start="load") as store:
        assert store.stats().load_pages == 0
    assert not leftover.exists()


def test_a_slab_without_a_superblock_counts_as_absent(tmp_path: Path) -> None:
    """An older kvstrata killed while creating a slab (O_CREAT | O_TRUNC, superblock not yet
    written) left a file of zeros: load recreates it instead of refusing forever."""
    root = tmp_path / "l3"
    pages = hashes(4)
    with open_store(root, pages=20) as store:
        spill_all(store, host_pool(), pages, ticket=1)
    slab = _slab(root, kind=1)
    with open(slab, "r+b") as f:
        f.write(bytes(4096))
    with open_store(root, pages=20, start="load") as store:
        assert store.lookup(pages) == 0  # the pages lost a payload: dropped
        assert store.stats().load_dropped == len(pages)
        geom, _ = SlabFile.read_geometry(slab)
        assert not isinstance(geom, str)


def test_a_directory_kvstrata_did_not_create_is_refused(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(DiskStoreError, match=r"holds files kvstrata did not create \(notes.txt\)"):
        open_store(tmp_path / "home")
    assert sorted(os.listdir(tmp_path / "home")) == ["notes.txt"]
    with pytest.raises(DiskStoreError, match="holds files kvstrata did not create"):
        open_store(Path("/"))
    legacy = tmp_path / "old"
    (legacy / "index").mkdir(parents=True)
    (legacy / "index" / "data.mdb").write_bytes(b"")
    (legacy / "slabs").mkdir()
    with pytest.raises(DiskStoreError, match="older kvstrata"):
        open_store(legacy)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskStoreError, match="is not a directory"):
        open_store(tmp_path / "file")


def test_an_empty_directory_and_a_link_to_one_are_adopted(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    with open_store(tmp_path / "link", pages=20):
        pass
    assert (tmp_path / "empty" / MARKER).is_file()


def test_check_without_fix_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with open_store(root, pages=20) as store:
        spill_all(store, host_pool(), hashes(5), ticket=1)

    def snapshot() -> dict[str, tuple[int, int, bytes]]:
        out = {}
        for dirpath, _, files in os.walk(root):
            for name in files:
                path = Path(dirpath) / name
                st = os.lstat(path)
                out[str(path)] = (st.st_size, st.st_mtime_ns, path.read_bytes())
        return out

    before = snapshot()
    os.chmod(index_dir(root, NS.digest, 0) / "lock.mdb", 0o400)  # a write would fail loudly
    assert main(["disk", "check", str(root)]) == 0
    os.chmod(index_dir(root, NS.digest, 0) / "lock.mdb", 0o600)
    assert snapshot() == before


def test_fix_deletes_only_its_own_name_pattern(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with open_store(root, pages=20):
        pass
    foreign = root / "slabs" / "backup.slab"
    foreign.write_bytes(b"not a slab, and not kvstrata's")
    ours = root / "slabs" / f"{NS.short}-r5-0-k.slab"
    ours.write_bytes(b"garbage under kvstrata's own name")
    assert main(["disk", "check", str(root), "--fix"]) == 1  # the foreign file stays: dirty
    assert foreign.read_bytes() == b"not a slab, and not kvstrata's"
    assert not ours.exists()


def test_the_lock_holders_pid_is_never_read_half_written(tmp_path: Path) -> None:
    import fcntl
    import threading

    root = tmp_path / "l3"
    with open_store(root, pages=20):
        lock = lock_path(root / "slabs", NS.digest, 0)
        assert lock.read_bytes().strip() == str(os.getpid()).encode()
    # A holder that took the lock and has not written its pid yet (a store starting).
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        threading.Timer(0.05, lambda: os.pwrite(fd, b"4242\n", 0)).start()
        with pytest.raises(DiskStoreError, match="in use by another process \\(pid 4242\\)"):
            open_store(root, pages=20, start="load")
    finally:
        os.close(fd)


def test_disk_gc_removes_idle_namespaces_and_the_no_space_refusal_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvstrata.config import KVLayout, PayloadSpec
    from kvstrata.tiers.disk_store import DiskConfig, DiskStore
    from kvstrata.tiers.page_hash import Namespace

    root = tmp_path / "l3"
    stale = Namespace.for_layout("an-older-model", KVLayout(1, (PayloadSpec("kv", (8,)),)), 4)
    with open_store(root, pages=20, ns=stale) as store:  # a model that ran here once
        spill_all(store, host_pool(layout=stale.layout), hashes(3, ns=stale), ticket=1)
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(DiskStoreError) as err:
        DiskStore(NS, 0, DiskConfig(root, free * 2))
    assert f"{stale.short}-r0" in str(err.value) and "kvstrata disk gc" in str(err.value)
    with open_store(root, pages=20) as live:  # in use: gc leaves it
        assert main(["disk", "gc", str(root), "--dry-run"]) == 0
        assert os.path.exists(index_dir(root, stale.digest, 0))
        assert main(["disk", "gc", str(root)]) == 0
        out = capsys.readouterr().out
        assert f"removed      {stale.short}-r0" in out and f"in use       {NS.short}-r0" in out
        assert live.lookup(hashes(1)) == 0
    assert not list((root / "slabs").glob(f"{stale.short}-*.slab"))
    assert not os.path.exists(index_dir(root, stale.digest, 0))
    assert list((root / "slabs").glob(f"{NS.short}-*.slab"))  # the live one's files stay
    assert main(["disk", "gc", str(root), "--keep", NS.short[:6]]) == 0
    assert list((root / "slabs").glob(f"{NS.short}-*.slab"))
    assert main(["disk", "check", str(root)]) == 0


def test_a_root_a_peer_creates_meanwhile_is_adopted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks of a CP group prepare one new root at once: when a peer makes it between this
    rank's first look and its second, it is a directory like any other (this was "is not a
    directory" on rank 1, now and then)."""
    from kvstrata.tiers import disk_dir

    root = tmp_path / "l3"
    real_lexists = os.path.lexists
    peer = [True]

    def peer_made_it(path: object) -> bool:
        if Path(str(path)) == root and peer:
            peer.clear()
            disk_dir.prepare_root(root)  # the peer, done first
        return real_lexists(str(path))

    monkeypatch.setattr(disk_dir.os.path, "lexists", peer_made_it)
    disk_dir.prepare_root(root)
    assert (root / MARKER).is_file() and (root / "slabs").is_dir()
