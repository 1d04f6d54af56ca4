"""Several disks per machine (issue 20, item 5): ranks map to directories ``rank % n``, a rank
given several stripes its slots over them, a restart must find the same directories in the same
order, ``disk check`` audits a striped group whole, and a batch's I/O reaches every drive at
once."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from disk_rig import (
    LAYOUT,
    NS,
    PAGE,
    engine_counts,
    expected_page,
    hashes,
    host_pool,
    patch_slot_io,
    read_page,
    spill_all,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_disk_cp import TIMEOUT_S, _run
from test_disk_cp import _exact as exact_cp
from test_disk_determinism import _slow_disk
from test_disk_tier import config

from kvstrata.cli import main
from kvstrata.cli.flags import replay_config
from kvstrata.dist.launch import run_ranks
from kvstrata.engine import Engine
from kvstrata.errors import ConfigError, DiskFormatError
from kvstrata.model.compute import SyntheticCompute
from kvstrata.residency import Tier
from kvstrata.tiers.disk_audit import audit_directories, audit_directory
from kvstrata.tiers.disk_config import StartMode
from kvstrata.tiers.disk_dir import index_dir, layout_path
from kvstrata.tiers.disk_format import ALIGN, SLOT_HEADER_BYTES, SlabFile, SlabGeometry, round_up
from kvstrata.tiers.disk_gc import collect
from kvstrata.tiers.disk_index import DiskIndex
from kvstrata.tiers.disk_layout import check_roots, rank_roots, stripe_runs
from kvstrata.tiers.disk_store import DiskConfig, DiskStore
from kvstrata.tiers.page_hash import Namespace
from kvstrata.workloads import Request, builtin

PAGES = hashes(10)


def _budget(pages_per_dir: int, dirs: int, ns: Namespace = NS) -> int:
    """A budget of ``pages_per_dir`` pages in each of ``dirs`` directories."""
    page = sum(round_up(64 + ns.payload_bytes(k)) for k in range(len(ns.payloads)))
    return dirs * (pages_per_dir * page + len(ns.payloads) * ALIGN)


def _store(
    dirs: list[Path], start: StartMode = "clear", rank: int = 0, ns: Namespace = NS, **kw: Any
) -> DiskStore:
    """A store of 20 pages in each of two directories' worth of budget over ``dirs``."""
    cfg = DiskConfig(dirs[0], _budget(20, 2), start=start, more_roots=tuple(dirs[1:]), **kw)
    return DiskStore(ns, rank, cfg)


def _exact(store: DiskStore, pages: list[bytes]) -> None:
    dst = host_pool()
    assert store.read(pages, dst, list(range(len(pages)))) == [True] * len(pages)
    for i, h in enumerate(pages):
        assert read_page(dst, i) == expected_page(dst, h)


# -- the mapping ---------------------------------------------------------------------------------


def test_ranks_map_to_directories_rank_mod_n_or_stripe_over_several() -> None:
    assert [rank_roots(2, r, 4) for r in range(4)] == [(0,), (1,), (0,), (1,)]
    assert [rank_roots(3, r, 3) for r in range(3)] == [(0,), (1,), (2,)]
    assert rank_roots(2, 0, 1) == (0, 1)
    assert [rank_roots(4, r, 2) for r in range(2)] == [(0, 2), (1, 3)]
    assert [rank_roots(3, r, 2) for r in range(2)] == [(0, 2), (1,)]


def test_stripe_runs_give_every_drive_a_run_at_once() -> None:
    # One stripe: runs of consecutive slots, in page order (what a single directory did).
    assert [list(r) for r in stripe_runs([4, 5, 6, 9, 10], 1, 8)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in stripe_runs([0, 1, 2, 3], 1, 3)] == [[0, 1, 2], [3]]
    # Two stripes: slots 10.. alternate drives; each drive's pages are one run, both first.
    assert stripe_runs([10, 11, 12, 13, 14, 15], 2, 8) == [[0, 2, 4], [1, 3, 5]]
    # Capped runs interleave: the first run of each drive before the second of either.
    assert stripe_runs(list(range(8)), 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert stripe_runs([10, 11, 13, 12], 2, 8) == [[0, 3], [1, 2]]
    assert stripe_runs([10, 11, 50, 12], 2, 8) == [[0], [1], [2], [3]]


def test_bad_directory_lists_are_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (tmp_path / "link").symlink_to(a)
    with pytest.raises(ConfigError, match="same directory"):
        check_roots([a, tmp_path / "link"])
    with pytest.raises(ConfigError, match="same directory"):
        check_roots([a, b, a])
    with pytest.raises(ConfigError, match="lies inside"):
        check_roots([a, a / "inner"])
    with pytest.raises(ConfigError, match="lies inside"):
        check_roots([b / "x", b])
    with pytest.raises(ConfigError, match="needs a directory"):
        check_roots([])
    with pytest.raises(ConfigError, match="lies inside"):
        DiskConfig(a, 1 << 20, more_roots=(a / "x",))
    with pytest.raises(ConfigError, match="same directory"):
        config(tmp_path, l3_dir=(str(a), str(a)))


def test_the_flag_repeats_and_one_directory_stays_a_string(tmp_path: Path) -> None:
    from kvstrata.cli import build_parser

    base = ["replay", "--model", "none", "--l2-tokens", "640", "--l3-gib", "0.01"]
    args = build_parser().parse_args([*base, "--l3-dir", "A", "--l3-dir", "B"])
    cfg = replay_config(args).engine
    assert cfg.l3_dir == ("A", "B") and cfg.l3_dirs == ("A", "B")
    args = build_parser().parse_args([*base, "--l3-dir", "A"])
    assert replay_config(args).engine.l3_dir == "A"
    args = build_parser().parse_args([*base, "--l3-dir", "A", "--l3-dir", "A/B"])
    with pytest.raises(ConfigError, match="lies inside"):
        replay_config(args)


# -- the store over two directories --------------------------------------------------------------


def test_a_store_over_two_directories_round_trips_through_a_restart(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with _store([a, b]) as store:
        assert store.dirs == (a, b) and store.num_slots == 40
        spill_all(store, host_pool(), PAGES, ticket=1)
        _exact(store, PAGES)
        slots = [store.pool.slot_of(h) for h in PAGES]
        assert store.check() == []
    # Half of the slots (and so of the pages) are in each directory: slot s is in s % 2.
    assert sorted(s % 2 for s in slots if s is not None) == [0] * 5 + [1] * 5
    for j, root in enumerate((a, b)):
        for kind in range(3):
            (path,) = (root / "slabs").glob(f"*-r0-{kind}-*.slab")
            geom, _ = SlabFile.read_geometry(path)
            assert isinstance(geom, SlabGeometry)
            assert (geom.stripe, geom.stripes, geom.num_slots) == (j, 2, 20)
        assert layout_path(root, NS.digest, 0).is_file()
    assert index_dir(a, NS.digest, 0).is_dir() and not index_dir(b, NS.digest, 0).exists()
    with _store([a, b], start="load") as store:
        assert store.stats().load_pages == 10 and store.lookup(PAGES) == 10
        _exact(store, PAGES)


def test_a_restart_given_other_directories_is_refused_with_the_flags(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    with _store([a, b]) as store:
        spill_all(store, host_pool(), PAGES, ticket=1)
    for dirs in ([b, a], [a], [a, c], [c, b]):
        with pytest.raises(DiskFormatError) as err:
            _store(dirs, start="load")
        msg = str(err.value)
        assert f"striped over {a}, {b}" in msg and f"--l3-dir {a} --l3-dir {b}" in msg
        assert "clear" in msg
    # Nothing was touched: the right directories still load every page.
    with _store([a, b], start="load") as store:
        _exact(store, PAGES)
    # clear takes any directories (and drops what they held).
    with _store([b, a]) as store:
        assert store.lookup(PAGES) == 0
    assert not index_dir(a, NS.digest, 0).exists()  # the old home's index went with it


def test_a_stripe_removed_by_disk_gc_refuses_a_load_and_clear_starts_over(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with _store([a, b]) as store:
        spill_all(store, host_pool(), PAGES, ticket=1)
        assert collect(b).in_use == [f"{NS.digest.hex()[:16]}-r0"]  # held in every directory
    assert [name for name, _ in collect(b).removed] == [f"{NS.digest.hex()[:16]}-r0"]
    assert not list((b / "slabs").glob("*.slab")) and not layout_path(b, NS.digest, 0).exists()
    with pytest.raises(DiskFormatError, match=f"{b} holds no part of it.*'clear'"):
        _store([a, b], start="load")
    with _store([a, b]) as store:
        assert store.lookup(PAGES) == 0
        spill_all(store, host_pool(), PAGES, ticket=2)
    with _store([a, b], start="load") as store:
        _exact(store, PAGES)


def test_ranks_sharing_drives_find_their_own_pages_after_a_restart(tmp_path: Path) -> None:
    """cp 2 over two directories: rank r in directory r. Given in the other order, a load
    start of either rank is refused (its pages are in the other directory)."""
    ns = Namespace.for_layout("test-model", LAYOUT, PAGE, 2)
    a, b = tmp_path / "a", tmp_path / "b"
    for rank in (0, 1):
        with _store([a, b], rank=rank, ns=ns) as store:
            assert store.dirs == ((a,) if rank == 0 else (b,))
            spill_all(store, host_pool(), PAGES, ticket=1)
    for rank in (0, 1):
        with pytest.raises(DiskFormatError, match="give the directories as they were"):
            _store([b, a], start="load", rank=rank, ns=ns)
        with _store([a, b], start="load", rank=rank, ns=ns) as store:
            _exact(store, PAGES)


def test_a_single_directory_store_without_a_layout_record_is_adopted(tmp_path: Path) -> None:
    """A disk tier written before layout records existed: one directory, no record."""
    with _store([tmp_path]) as store:
        spill_all(store, host_pool(), PAGES, ticket=1)
    layout_path(tmp_path, NS.digest, 0).unlink()
    with _store([tmp_path], start="load") as store:
        _exact(store, PAGES)
    assert layout_path(tmp_path, NS.digest, 0).is_file()
    layout_path(tmp_path, NS.digest, 0).unlink()
    with pytest.raises(DiskFormatError, match=f"written in {tmp_path}"):
        _store([tmp_path, tmp_path.parent / "other"], start="load")


def test_a_damaged_layout_record_refuses_a_load(tmp_path: Path) -> None:
    with _store([tmp_path / "a", tmp_path / "b"]) as store:
        spill_all(store, host_pool(), PAGES, ticket=1)
    layout_path(tmp_path / "b", NS.digest, 0).write_text("{")
    with pytest.raises(DiskFormatError, match="not a layout record"):
        _store([tmp_path / "a", tmp_path / "b"], start="load")


def test_a_batch_reads_and_writes_every_drive_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first slot I/O on each drive waits for the other drive's: it passes only when the
    two are in flight together (a store that went drive after drive would time out)."""
    a, b = tmp_path / "a", tmp_path / "b"
    together: dict[str, bool] = {}

    def meet(op: str) -> Callable[[SlabFile, int], None]:
        barrier, lock = threading.Barrier(2, timeout=5), threading.Lock()
        seen: set[Path] = set()

        def before(slab: SlabFile, slot: int) -> None:
            with lock:
                first = slab.path.parent not in seen
                seen.add(slab.path.parent)
            if first:
                try:
                    barrier.wait()
                    together[op] = together.get(op, True)
                except threading.BrokenBarrierError:
                    together[op] = False

        return before

    with _store([a, b]) as store:
        patch_slot_io(monkeypatch, "write", meet("write"))
        spill_all(store, host_pool(), PAGES, ticket=1)
        patch_slot_io(monkeypatch, "read", meet("read"))
        _exact(store, PAGES)
    assert together == {"write": True, "read": True}


# -- disk check ----------------------------------------------------------------------------------


def test_disk_check_audits_a_striped_group_whole_and_never_by_halves(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with _store([a, b]) as store:
        spill_all(store, host_pool(), PAGES, ticket=1)
        slot = store.pool.slot_of(PAGES[1])
    assert slot is not None and slot % 2 == 1  # a page in b
    report = audit_directories([a, b])
    assert report.clean and [(g.stripes, len(g.pages)) for g in report.groups] == [(2, 10)]
    # Given one of its directories only: reported, and --fix leaves every entry alone.
    for alone in (a, b):
        report = audit_directory(alone, fix=True)
        assert [p.kind for p in report.all_problems] == ["group-split"]
    # A flipped payload bit in b's slab is found and its page dropped by --fix.
    (path,) = (b / "slabs").glob("*-r0-1-*.slab")
    geom, _ = SlabFile.read_geometry(path)
    assert isinstance(geom, SlabGeometry)
    with open(path, "r+b") as f:
        f.seek(geom.slot_offset(slot // 2) + SLOT_HEADER_BYTES + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    assert main(["disk", "check", str(b), str(a)]) == 1  # any order
    assert main(["disk", "check", str(a), str(b), "--fix", "--json"]) == 0
    assert main(["disk", "check", str(a), str(b)]) == 0
    index = DiskIndex(index_dir(a, NS.digest, 0))
    left = index.scan(NS.digest, 0, 3)
    assert PAGES[0] in left and PAGES[1] not in left  # page 1 went, the others stayed
    assert all(h in left for h in PAGES[2:10])
    index.close()


def test_disk_check_reports_and_fixes_a_stray_index_in_a_stripe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with _store([a, b]) as store:
        spill_all(store, host_pool(), PAGES, ticket=1)
    DiskIndex(index_dir(b, NS.digest, 0)).close()  # an index where only a stripe should be
    capsys.readouterr()
    assert main(["disk", "check", str(a), str(b), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["kind"] for p in doc["problems"]] == ["index-stray"]
    assert doc["dirs"] == [str(a), str(b)] and doc["groups"][0]["stripes"] == 2
    assert main(["disk", "check", str(a), str(b), "--fix"]) == 0
    assert not index_dir(b, NS.digest, 0).exists()


# -- through the engine --------------------------------------------------------------------------


def _engine_counts(tmp: Path) -> dict[str, object]:
    """A small cache-only run over two directories with a disk tier that collects garbage."""
    requests = builtin(1000, seed=3, n_requests=120)
    dirs = (str(tmp / "a"), str(tmp / "b"))
    engine = Engine(
        SyntheticCompute(8, 1000),
        config(tmp, pool_tokens=320, l2_tokens=320, l3_gib=0.0005, l3_dir=dirs),
        model_id="none:8",
    )
    try:
        engine.run(requests)
    finally:
        engine.close()
    disk = engine.cache.disk
    assert disk is not None and isinstance(disk.store, DiskStore)
    assert disk.store.dirs == (tmp / "a", tmp / "b")
    return engine_counts(engine)


def test_two_directories_give_the_same_counts_every_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _engine_counts(tmp_path / "first")
    again = _engine_counts(tmp_path / "again")
    assert again == first
    _slow_disk(monkeypatch, write_s=0.001, sync_s=0.005, read_s=0.001)
    assert _engine_counts(tmp_path / "slow") == first
    assert first["hit_tokens"][Tier.L3] > 0  # type: ignore[index]
    assert first["store"][2] > 0 and first["store"][3] == 0  # type: ignore[index]


@pytest.mark.multiproc
@pytest.mark.slow
def test_cp2_over_four_directories_each_rank_striped_over_two(tmp_path: Path) -> None:
    """cp 2, four directories: rank 0 stripes over the first and third, rank 1 over the second
    and fourth; exact bytes, then a restart with ``load`` hits from both ranks' stripes."""
    roots = tuple(str(tmp_path / d) for d in "abcd")
    requests = builtin(1000, seed=11, n_requests=60)
    ranks = run_ranks(2, _run, ("none", roots, "clear", requests, -1), timeout_s=TIMEOUT_S)
    assert ranks[0]["digest"] == ranks[1]["digest"] and ranks[0]["l3_hits"] > 0
    exact_cp(ranks[0], requests)
    for d, rank in zip("abcd", (0, 1, 0, 1), strict=True):
        (slab,) = (tmp_path / d / "slabs").glob(f"*-r{rank}-0-*.slab")
        geom, _ = SlabFile.read_geometry(slab)
        assert isinstance(geom, SlabGeometry) and geom.stripes == 2
    again = [Request(1000, requests[-1].tokens)]
    ranks = run_ranks(2, _run, ("none", roots, "load", again, -1), timeout_s=TIMEOUT_S)
    assert ranks[0]["cached"][1000] == ranks[0]["l3_hits"] > 0
    assert all(r["reloaded"] > 0 for r in ranks)
    exact_cp(ranks[0], again)


@settings(max_examples=200, deadline=None)
@given(slots=st.lists(st.integers(0, 30), unique=True, max_size=40), max_pages=st.integers(1, 6))
def test_one_stripe_runs_are_the_consecutive_slots(slots: list[int], max_pages: int) -> None:
    """The array pass of one stripe against the page-by-page grouping it replaced."""
    expected: list[list[int]] = []
    for i, slot in enumerate(slots):
        if expected and slot == slots[expected[-1][-1]] + 1 and len(expected[-1]) < max_pages:
            expected[-1].append(i)
        else:
            expected.append([i])
    assert [list(r) for r in stripe_runs(slots, 1, max_pages)] == expected
