"""kvstrata's disk tier as an SGLang HiCache storage backend, driven through SGLang's own storage
config, dynamic backend factory and host pool classes (MHA ``page_first`` and MLA, on CPU), in
the order SGLang's cache controller calls it (``sglang_rig``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_rig import (
    MHA,
    PAGE,
    attach,
    backup,
    expected,
    mha_pool,
    mla_pool,
    prefetch,
    read_past_a_bad_page,
    same,
    storage_config,
)

from kvstrata.cli import main
from kvstrata.errors import ConfigError
from kvstrata.integrations.sglang import KvstrataStorage
from kvstrata.integrations.sglang.pages import key_hash
from kvstrata.integrations.sglang.settings import BackendSettings
from kvstrata.tiers.disk_audit import SLAB_DIR
from kvstrata.tiers.disk_format import ALIGN, SLOT_HEADER_BYTES, SlabFile

MHA_LAYERS = MHA["layers"]
KEYS = [f"{i:064x}" for i in range(300)]  # three controller batches: 128 + 128 + 44


def test_mha_page_first_round_trip_survives_a_restart(tmp_path: Path) -> None:
    pool = mha_pool(pages=320)
    backend = attach(storage_config(tmp_path, start="clear"), pool)
    assert all(backup(backend, pool, KEYS, "a"))
    hit, got = prefetch(backend, pool, KEYS)
    assert hit == len(KEYS) and same(got, expected(pool, KEYS, "a"))
    backend.close()
    # A new process: a fresh host pool, the store reloaded from its index and slabs.
    pool2 = mha_pool(pages=320)
    again = attach(storage_config(tmp_path, start="load"), pool2)
    hit, got = prefetch(again, pool2, KEYS)
    assert hit == len(KEYS) and same(got, expected(pool2, KEYS, "a"))
    stats = again.disk_stats()
    assert stats.load_pages == len(KEYS) and stats.verify_failures == 0
    again.close()
    assert main(["disk", "check", str(tmp_path)]) == 0


def test_mla_writer_and_a_reading_tp_rank(tmp_path: Path) -> None:
    """MLA: SGLang lets TP rank 0 write; rank 1 reads rank 0's pages (same latents)."""
    pool0, pool1 = mla_pool(), mla_pool()
    writer = attach(storage_config(tmp_path, mla=True, tp_size=2, start="clear"), pool0)
    reader = attach(storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2), pool1)
    assert storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2).is_storage_writer is False
    keys = KEYS[:40]
    assert reader.batch_exists(keys) == 0  # nothing written yet; the writer's slabs exist
    assert all(backup(writer, pool0, keys, "mla"))
    for backend, pool in ((writer, pool0), (reader, pool1)):
        hit, got = prefetch(backend, pool, keys)
        assert hit == len(keys) and same(got, expected(pool, keys, "mla"))
    # A reader never writes: SGLang does not ask it to, and if asked it says no.
    host = pool1.alloc(PAGE)
    assert reader.batch_set_v1(["other"], host) == [False]
    assert reader.get_stats().kvstrata["set_not_writer"] == 1
    reader.close()
    writer.close()
    assert main(["disk", "check", str(tmp_path)]) == 0


def _flip_payload_bit(root: Path, backend: KvstrataStorage, key: str) -> None:
    """Flip one payload bit of ``key``'s slot in the first slab (kvstrata's own index names it)."""
    store = backend.store
    assert store is not None
    slot = {h: s for h, s, _ in store.pool.live()}[key_hash(key)]  # type: ignore[union-attr]
    path = next(p for p in sorted((root / SLAB_DIR).glob("*-0-k.slab")))
    geom, _ = SlabFile.read_geometry(path)
    assert not isinstance(geom, str)
    at = ALIGN + slot * geom.slot_bytes + SLOT_HEADER_BYTES + 1000
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def test_a_flipped_bit_stops_the_prefix_at_that_page(tmp_path: Path) -> None:
    pool = mha_pool()
    keys = KEYS[:12]
    backend = attach(storage_config(tmp_path, start="clear"), pool)
    assert all(backup(backend, pool, keys, "a"))
    _flip_payload_bit(tmp_path, backend, keys[5])
    backend.close()
    backend = attach(storage_config(tmp_path, start="load"), pool)
    assert backend.batch_exists(keys) == 12  # the index knows nothing yet: only reads verify
    read_past_a_bad_page(backend, pool, keys, "a", bad=5)
    want = expected(pool, keys, "a")
    assert backend.batch_exists(keys) == 5  # the bad page was dropped before the call returned
    hit, got = prefetch(backend, pool, keys)
    assert hit == 5 and same(got, want[:5])
    assert backend.get_stats().kvstrata["disk_verify_failures"] == 1
    # SGLang recomputes the page and backs it up again: whole once more.
    assert all(backup(backend, pool, keys[5:6], "a"))
    hit, got = prefetch(backend, pool, keys)
    assert hit == 12 and same(got, want)
    backend.close()
    assert main(["disk", "check", str(tmp_path)]) == 0


def test_ranks_models_and_page_sizes_stay_apart(tmp_path: Path) -> None:
    """Same keys, one directory: every writer reads back only its own bytes."""
    keys = KEYS[:20]
    writers = {
        "tp0": (storage_config(tmp_path, tp_rank=0, tp_size=2), mha_pool()),
        "tp1": (storage_config(tmp_path, tp_rank=1, tp_size=2), mha_pool()),
        "model-b": (storage_config(tmp_path, model="other/model"), mha_pool()),
        "page-32": (storage_config(tmp_path), mha_pool(page_size=32)),
    }
    backends = {name: attach(cfg, pool) for name, (cfg, pool) in writers.items()}
    for name, backend in backends.items():
        pool = writers[name][1]
        assert backend.batch_exists(keys) == 0  # the others' pages are not ours
        assert all(backup(backend, pool, keys, name))
    for name, backend in backends.items():
        pool = writers[name][1]
        hit, got = prefetch(backend, pool, keys)
        assert hit == len(keys) and same(got, expected(pool, keys, name))
    namespaces = {b.store.namespace.digest for b in backends.values()}  # type: ignore[union-attr]
    assert len(namespaces) == len(backends)
    for backend in backends.values():
        backend.close()
    assert main(["disk", "check", str(tmp_path)]) == 0


def test_the_older_interface_moves_flat_data_pages(tmp_path: Path) -> None:
    """Without interface_v1 SGLang calls batch_set/batch_get with flat data pages."""
    pool = mha_pool()
    backend = attach(storage_config(tmp_path, interface_v1=0), pool)
    keys = KEYS[:6]
    host = pool.alloc(len(keys) * PAGE)
    from sglang_rig import fill

    fill(pool, host, keys, "flat")
    data = [pool.get_data_page(int(host[i * PAGE])) for i in range(len(keys))]
    assert backend.batch_set(keys, data)
    assert backend.exists(keys[0]) and not backend.exists("absent")
    assert backend.batch_exists(keys) == len(keys)
    got = backend.batch_get(keys + ["absent"], [pool.get_dummy_flat_data_page() for _ in range(7)])
    assert got[-1] is None
    want = expected(pool, keys, "flat")
    assert all(torch.equal(g.view(torch.uint8), w) for g, w in zip(got[:-1], want, strict=False))
    assert backend.get("absent") is None
    backend.close()
    # The v1 interface is a namespace of its own: its store does not see flat pages.
    v1 = attach(storage_config(tmp_path), pool)
    assert v1.batch_exists(keys) == 0
    v1.close()


def test_get_stats_has_sglangs_storage_metrics_shape(tmp_path: Path) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = mha_pool()
    backend = attach(storage_config(tmp_path), pool)
    backup(backend, pool, KEYS[:10], "a")
    prefetch(backend, pool, KEYS[:10])
    metrics = backend.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [10] and metrics.prefetch_pgs == [10]
    assert len(metrics.backup_bandwidth) == 1 and metrics.backup_bandwidth[0] > 0
    assert metrics.kvstrata["set_durable"] == 10 and metrics.kvstrata["disk_pages_read"] == 10
    assert backend.get_stats().backup_pgs == []  # per call since the last get_stats
    backend.close()


def test_min_hits_writes_a_page_on_its_second_offer(tmp_path: Path) -> None:
    pool = mha_pool()
    backend = attach(storage_config(tmp_path, min_hits=2), pool)
    keys = KEYS[:4]
    assert backup(backend, pool, keys, "a") == [False] * 4
    assert backend.batch_exists(keys) == 0
    assert backup(backend, pool, keys, "a") == [True] * 4
    assert prefetch(backend, pool, keys)[0] == 4
    backend.close()


def test_clear_drops_this_ranks_pages(tmp_path: Path) -> None:
    pool = mha_pool()
    backend = attach(storage_config(tmp_path), pool)
    other = attach(storage_config(tmp_path, tp_rank=1, tp_size=2), mha_pool())
    backup(backend, pool, KEYS[:4], "a")
    backup(other, other.pages.pool, KEYS[:4], "b")  # type: ignore[union-attr]
    assert backend.clear() is True
    assert backend.batch_exists(KEYS[:4]) == 0 and other.batch_exists(KEYS[:4]) == 4
    backend.close()
    other.close()


def test_bad_calls_and_configs_are_refused(tmp_path: Path) -> None:
    pool = mha_pool(pages=200)
    backend = attach(storage_config(tmp_path), pool)
    host = pool.alloc(129 * PAGE)
    with pytest.raises(ConfigError, match="at most 128"):
        backend.batch_set_v1(KEYS[:129], host)
    with pytest.raises(ConfigError, match="host indices"):
        backend.batch_get_v1(KEYS[:2], host[: PAGE + 1])
    with pytest.raises(ConfigError, match="whole host page"):
        backend.batch_get_v1(KEYS[:1], host[1 : PAGE + 1])
    backend.close()
    base = {"dir": str(tmp_path), "budget_gib": 1}
    for extra, match in (
        ({"budget_gib": 1}, '"dir"'),
        ({"dir": str(tmp_path)}, "exactly one"),
        ({**base, "budget_bytes": 5}, "exactly one"),
        ({**base, "budjet": 2}, "unknown extra config keys"),
        ({**base, "read_threads": "4"}, "must be a int"),
        ({**base, "start": "warm"}, "start must be one of"),
    ):
        with pytest.raises(ConfigError, match=match):
            BackendSettings.from_extra_config(extra)
    settings = BackendSettings.from_extra_config({**base, "staging_mib": 16, "interface_v1": 1})
    assert settings.disk.start == "load" and settings.disk.staging_bytes == 16 << 20
    assert settings.interface_v1


def test_a_backup_past_its_timeout_returns_only_after_its_pages_were_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang reuses the host pages once batch_set_v1 returns: a slow backup must not return
    while the store still reads them, or a later page's bytes would land under these keys."""
    from kvstrata.tiers import disk_gather

    pool = mha_pool()
    backend = attach(storage_config(tmp_path, io_timeout_s=0.3), pool)
    real_copy = disk_gather.from_host
    gathered: list[float] = []

    def slow_copy(*args: Any) -> None:  # one call per payload (K, V) of the one chunk
        time.sleep(0.3)
        real_copy(*args)
        gathered.append(time.monotonic())

    monkeypatch.setattr(disk_gather, "from_host", slow_copy)
    keys = KEYS[:4]
    host = pool.alloc(len(keys) * PAGE)
    from sglang_rig import fill

    fill(pool, host, keys, "slow")
    ok = backend.batch_set_v1(keys, host)
    returned = time.monotonic()
    assert len(gathered) == 2 and returned >= gathered[-1]
    assert ok == [False] * 4 and backend.get_stats().kvstrata["set_timeouts"] == 4
    monkeypatch.undo()
    deadline = time.monotonic() + 10  # the pages were copied whole: they land, and read back right
    while backend.batch_exists(keys) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    hit, got = prefetch(backend, pool, keys)
    assert hit == 4 and same(got, expected(pool, keys, "slow"))
    backend.close()


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first", "page_head"])
def test_other_host_layouts_round_trip(tmp_path: Path, layout: str) -> None:
    """Every layout whose pages get_page_buffer_meta names as whole extents: page_first_direct
    and page_head (one K and one V extent a page), layer_first (one per layer)."""
    pool = mha_pool(layout=layout)
    backend = attach(storage_config(tmp_path, page_first=False), pool)
    keys = KEYS[:10]
    assert all(backup(backend, pool, keys, layout))
    hit, got = prefetch(backend, pool, keys)
    assert hit == len(keys) and same(got, expected(pool, keys, layout))
    assert backend.pages is not None and len(backend.pages.names) == (
        2 * MHA_LAYERS if layout == "layer_first" else 2
    )
    backend.close()
