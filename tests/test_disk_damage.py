"""A damaged disk index has a way out (issue 19, item 5): one line that names it and says what to
do, never a traceback or a SIGBUS; ``clear`` always starts; ``disk check --fix`` rebuilds the
index from the slot headers, so the pages come back."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from disk_rig import NS, hashes, host_pool, open_store, spill_all

from kvstrata.errors import DiskStoreError
from kvstrata.tiers.disk_dir import index_dir

PAGES = hashes(30)
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "l3"
    with open_store(root, pages=40) as store:
        spill_all(store, host_pool(), PAGES, ticket=1)
    return root


def _data(root: Path) -> Path:
    return index_dir(root, NS.digest, 0) / "data.mdb"


def _zero_page_flags(root: Path) -> None:
    raw = bytearray(_data(root).read_bytes())
    last = max(struct.unpack_from("<QQ", raw, p * 4096 + 136) for p in (0, 1))[0]
    for page in range(2, last + 1):
        struct.pack_into("<H", raw, page * 4096 + 10, 0)  # mp_flags
    _data(root).write_bytes(raw)


def _truncate(root: Path) -> None:
    os.truncate(_data(root), 12 * 1024)


def _random(root: Path) -> None:
    size = _data(root).stat().st_size
    _data(root).write_bytes(os.urandom(size))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "zeroed-page-flags": _zero_page_flags,
    "truncated": _truncate,
    "random-bytes": _random,
}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process: a SIGBUS there is an exit status here, not a dead suite."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + str(Path(__file__).parent)}
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _check(*args: str, isolated: bool) -> subprocess.CompletedProcess[str]:
    """``kvstrata disk check`` in a child process (where it could SIGBUS: a truncated map) or in
    this one (the others, faster)."""
    if isolated:
        return _cli("disk", "check", *args)
    import contextlib
    import io

    from kvstrata.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["disk", "check", *args])
    return subprocess.CompletedProcess([], code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_index_is_refused_in_one_line_and_repaired(root: Path, damage: str) -> None:
    DAMAGE[damage](root)
    with pytest.raises(DiskStoreError) as err:
        open_store(root, pages=40, start="load")
    message = str(err.value)
    assert "index/" in message and "disk check --fix" in message and "'clear'" in message
    assert "local filesystem" not in message  # the filesystem is not to blame
    check = _check(str(root), isolated=damage == "truncated")
    assert check.returncode == 1, check.stderr  # dirty, reported; not a crash or SIGBUS
    assert "index-damaged" in check.stdout and not check.stderr
    fixed = _check(str(root), "--fix", isolated=damage == "truncated")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "rebuilt from the slot headers (30 pages)" in fixed.stdout
    with open_store(root, pages=40, start="load") as store:  # every page came back, verified
        assert store.lookup(PAGES) == len(PAGES)
        assert store.read(PAGES[:8], host_pool(), list(range(8))) == [True] * 8
        assert store.check() == []


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_clear_always_starts(root: Path, damage: str) -> None:
    DAMAGE[damage](root)
    with open_store(root, pages=40, start="clear") as store:
        assert store.lookup(PAGES) == 0
        spill_all(store, host_pool(), PAGES[:5], ticket=2)
        assert store.lookup(PAGES[:5]) == 5
    with open_store(root, pages=40, start="load") as store:
        assert store.lookup(PAGES[:5]) == 5


@pytest.mark.slow
def test_replay_on_a_damaged_index_is_one_line(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    args = ["replay", "--model", "none", "--l1-tokens", "1024", "--l2-tokens", "2048", "--l3-dir", str(root), "--l3-gib", "0.05", "--no-progress"]  # fmt: skip
    from kvstrata.cli import main

    assert main(args) == 0
    (group,) = (root / "index").iterdir()
    os.truncate(group / "data.mdb", 12 * 1024)
    done = _cli(*args, "--l3-start", "load")  # a child: on a truncated map LMDB can SIGBUS
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstrata replay: error: the disk index")
    assert "truncated" in lines[0] and "disk check --fix" in lines[0]
    assert main([*args, "--l3-start", "clear"]) == 0


def test_a_load_takes_a_clock_past_its_range(tmp_path: Path) -> None:
    """The index keeps ``last_access`` as a u64 (a damaged value or another writer's can be
    anything): a ``load`` start still takes every page, such a page as the most recent."""
    pages = hashes(4)
    with open_store(tmp_path, pages=8) as store:
        spill_all(store, host_pool(), pages, ticket=1)
        assert store._index is not None
        slot = store.pool.slot_of(pages[0])
        assert slot is not None
        store._index.put_pages(NS.digest, 0, [(pages[0], slot, 2**64 - 1)], len(NS.payloads))
    with open_store(tmp_path, pages=8, start="load") as store:
        assert store.lookup(pages) == 4
        assert [h for h, _ in store.pool.coldest(4)] == [*pages[1:], pages[0]]
        store.pool.check()
