"""Packed slots (``--l3-io packed``): small pages in slots of 64-byte multiples, many to a 4 KiB
block, through the page cache; the same pages, reads and refusals as 4 KiB slots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from disk_rig import LAYOUT, NS, expected_page, hashes, host_pool, open_store, read_page, spill_all

from kvstrata.config import KVLayout, PayloadSpec
from kvstrata.errors import ConfigError, DiskFormatError
from kvstrata.tiers.disk_format import ALIGN, PACK_ALIGN, SlabFile
from kvstrata.tiers.disk_store import DiskConfig, DiskStore
from kvstrata.tiers.page_hash import Namespace


def test_packed_slabs_hold_small_pages_in_small_slots(tmp_path: Path) -> None:
    src, dst = host_pool(), host_pool()
    pages = hashes(24)
    with open_store(tmp_path, pages=40, io_mode="packed") as store:
        stats = store.stats()
        assert stats.io_mode == "packed" and stats.num_slots == 40
        # k and v: 384 payload bytes + the header, in 448; the draft payload 240 + 64 in 320
        assert stats.page_bytes == 448 + 448 + 320 < 3 * ALIGN
        assert spill_all(store, src, pages, ticket=1).spilled[0].durable == tuple(pages)
        assert store.read(pages, dst, list(range(24))) == [True] * 24
        for i, h in enumerate(pages):
            assert read_page(dst, i) == expected_page(dst, h)
    slabs = sorted((tmp_path / "slabs").glob("*.slab"))
    assert len(slabs) == 3
    for path in slabs:
        geom, size = SlabFile.read_geometry(path)
        assert not isinstance(geom, str) and geom.packed
        assert geom.slot_bytes % PACK_ALIGN == 0 and geom.slot_bytes % ALIGN != 0
        assert size == geom.file_bytes == ALIGN + 40 * geom.slot_bytes
    # a restart finds them, verified, in the same mode
    with open_store(tmp_path, pages=40, io_mode="packed", start="load") as store:
        assert store.lookup(pages) == 24
        assert store.read(pages, dst, list(range(24, 48))) == [True] * 24


def test_a_packed_directory_is_not_loaded_in_another_mode(tmp_path: Path) -> None:
    with open_store(tmp_path, pages=20, io_mode="packed"):
        pass
    with pytest.raises(DiskFormatError, match=r"packed True vs False.*--l3-io"):
        DiskStore(NS, 0, DiskConfig(tmp_path, 20 * 3 * ALIGN + 3 * ALIGN, start="load"))


def test_a_flipped_byte_in_a_packed_slot_is_a_miss_not_a_neighbours_page(tmp_path: Path) -> None:
    src, dst = host_pool(), host_pool()
    pages = hashes(8)
    with open_store(tmp_path, pages=16, io_mode="packed") as store:
        spill_all(store, src, pages, ticket=1)
    path = next(p for p in sorted((tmp_path / "slabs").glob("*.slab")) if "-0-k" in p.name)
    found, _ = SlabFile.read_geometry(path)
    assert not isinstance(found, str)
    raw = bytearray(path.read_bytes())
    raw[found.slot_offset(3) + 64 + 5] ^= 0x40  # page 3's k payload (slots 3 and 4 share a block)
    path.write_bytes(bytes(raw))
    with open_store(tmp_path, pages=16, io_mode="packed", start="load") as store:
        ok = store.read(pages, dst, list(range(8)))
        assert ok[:3] == [True] * 3 and not ok[3]
        assert store.stats().counters["verify_failures"] == 1
        for i in range(3):
            assert read_page(dst, i) == expected_page(dst, pages[i])


def test_pages_too_large_to_pack_are_refused_with_the_way_out(tmp_path: Path) -> None:
    big = Namespace.for_layout("big", KVLayout(2, (PayloadSpec("k", (8, 64), "bfloat16"),)), 16)
    with pytest.raises(ConfigError, match=r"too large to pack.*--l3-io auto"):
        DiskStore(big, 0, DiskConfig(tmp_path, 1 << 24, io_mode="packed"))
    assert LAYOUT.layers(LAYOUT.payloads[0]) == 3  # the rig's pages, which do pack


def _replay(tmp_path: Path, io_mode: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "kvstrata", "replay", "--model", "none", "--json"]
    argv += ["--no-progress", "--trace", "agentic:0:60", "--kv-width", "4"]
    argv += ["--l1-tokens", "65536", "--l2-tokens", "65536", "--l3-dir", str(tmp_path / io_mode)]
    argv += ["--l3-gib", "0.02" if io_mode == "packed" else "0.125", "--l3-io", io_mode]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_packed_replay_serves_what_the_same_slots_in_4k_do(tmp_path: Path) -> None:
    """The same number of slots (0.125 GiB of 4 KiB slots, 0.02 GiB of packed ones and their
    index room: both more than the window needs) give the same hits, tier by tier."""
    packed, buffered = _replay(tmp_path, "packed"), _replay(tmp_path, "buffered")
    assert packed["tiers"]["l3"]["io_mode"] == "packed"
    assert packed["hit_tokens_by_tier"] == buffered["hit_tokens_by_tier"]
    assert packed["hit_tokens_by_tier"]["l3"] > 0
    assert packed["tiers"]["l3"]["pages_read"] == buffered["tiers"]["l3"]["pages_read"]
    assert packed["tiers"]["l3"]["bytes_read"] * 16 < buffered["tiers"]["l3"]["bytes_read"]
