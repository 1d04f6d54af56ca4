"""Shared helpers of the SGLang backend tests: SGLang's own storage config and host pools on CPU,
pages of known bytes, and the calls in the order SGLang's cache controller makes them.

The controller (``sglang/srt/managers/cache_controller.py``) backs up with ``batch_set_v1`` in
batches of at most 128 full pages (``_page_backup``), and prefetches with ``batch_exists`` batch by
batch until one comes back short (``_storage_hit_query``), then allocates fresh host pages and
reads them with ``batch_get_v1`` (``_page_transfer``), counting each batch's leading run of True.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="the pinned sglang is not installed (scripts/setup.sh installs it)",
)

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    STORAGE_BATCH_SIZE,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstrata.integrations.sglang import KvstrataStorage  # noqa: E402
from kvstrata.integrations.sglang.cpu_pools import mha_host_pool, mla_host_pool  # noqa: E402

PAGE = 16
#: A small real geometry: 4 layers x 2 KV heads x 64 in bf16 (MHA), a 576-wide latent (MLA).
MHA = {"layers": 4, "heads": 2, "head_dim": 64}
MLA = {"layers": 4, "kv_lora_rank": 512, "rope_dim": 64}


def mha_pool(pages: int = 64, page_size: int = PAGE, layout: str = "page_first") -> Any:
    return mha_host_pool(page_size=page_size, pages=pages, layout=layout, **MHA)


def mla_pool(pages: int = 64, page_size: int = PAGE) -> Any:
    return mla_host_pool(page_size=page_size, pages=pages, **MLA)


def storage_config(
    root: Path,
    *,
    model: str = "test/model",
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    page_first: bool = True,
    **extra: Any,
) -> HiCacheStorageConfig:
    """SGLang's storage config as ``cache_controller._generate_storage_config`` fills it for
    ``--hicache-storage-backend dynamic`` with our extra config."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config={
            "backend_name": "kvstrata",
            "module_path": "kvstrata.integrations.sglang",
            "class_name": "KvstrataStorage",
            "interface_v1": 1,
            "dir": str(root),
            "budget_bytes": 64 << 20,
            "staging_mib": 2,  # small: a store opens in milliseconds (256 MiB by default)
            **extra,
        },
    )


def attach(config: HiCacheStorageConfig, pool: Any) -> KvstrataStorage:
    """What ``attach_storage_backend`` does: SGLang's factory, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(backend, KvstrataStorage)
    backend.register_mem_pool_host(pool)
    return backend


def content(key: str, salt: str, nbytes: int) -> torch.Tensor:
    """The bytes page ``key`` holds for writer ``salt``: any process can say what they must be."""
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += hashlib.sha256(f"{salt}|{key}|{counter}".encode()).digest()
        counter += 1
    return torch.frombuffer(out[:nbytes], dtype=torch.uint8)


def page_bytes(pool: Any, index: int) -> torch.Tensor:
    """The page at host token index ``index``, as SGLang's own accessor copies it out."""
    return pool.get_data_page(index, flat=True).view(torch.uint8).clone()


def fill(pool: Any, host: torch.Tensor, keys: list[str], salt: str) -> None:
    """Write each key's bytes into its host page through SGLang's own accessor."""
    for i, key in enumerate(keys):
        flat = pool.get_dummy_flat_data_page()
        flat.view(torch.uint8).copy_(content(key, salt, flat.numel() * flat.element_size()))
        pool.set_from_flat_data_page(int(host[i * pool.page_size]), flat)


def backup(backend: KvstrataStorage, pool: Any, keys: list[str], salt: str) -> list[bool]:
    """Host pages of known bytes, backed up batch by batch (``_page_backup``)."""
    host = pool.alloc(len(keys) * pool.page_size)
    assert host is not None
    fill(pool, host, keys, salt)
    ok: list[bool] = []
    for s in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[s : s + STORAGE_BATCH_SIZE]
        ok += backend.batch_set_v1(
            batch, host[s * pool.page_size : (s + len(batch)) * pool.page_size]
        )
    pool.free(host)
    return ok


def prefetch(
    backend: KvstrataStorage, pool: Any, keys: list[str]
) -> tuple[int, list[torch.Tensor]]:
    """``_storage_hit_query`` then ``_page_transfer``: the pages found and read, in order."""
    hit = 0
    for s in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[s : s + STORAGE_BATCH_SIZE]
        n = backend.batch_exists(batch)
        hit += n
        if n < len(batch):
            break
    host = pool.alloc(hit * pool.page_size)
    assert host is not None
    got: list[torch.Tensor] = []
    for s in range(0, hit, STORAGE_BATCH_SIZE):
        batch = keys[s : min(hit, s + STORAGE_BATCH_SIZE)]
        ok = backend.batch_get_v1(
            batch, host[s * pool.page_size : (s + len(batch)) * pool.page_size]
        )
        lead = ok.index(False) if False in ok else len(ok)
        got += [page_bytes(pool, int(host[(s + i) * pool.page_size])) for i in range(lead)]
        if lead < len(batch):
            break
    pool.free(host)
    return hit, got


def expected(pool: Any, keys: list[str], salt: str) -> list[torch.Tensor]:
    nbytes = pool.get_dummy_flat_data_page().numel() * pool.dtype.itemsize
    return [content(k, salt, nbytes) for k in keys]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def read_past_a_bad_page(
    backend: KvstrataStorage,
    pool: Any,
    keys: list[str],
    salt: str,
    bad: int,
    untouched: bool = True,
) -> list[bool]:
    """``batch_get_v1`` of ``keys`` where page ``bad`` does not verify: the pages before it
    read back as ``salt``'s bytes, the bad one reads False (and, with ``untouched``, leaves its
    host page as it was: the disk verifies in staging; Redis values are read straight into the
    host pages SGLang allocated for the read, so a bad one's bytes may be there, reported
    False), and no page reported read holds other bytes; the ``ok`` list."""
    host = pool.alloc(len(keys) * PAGE)
    before = pool.get_data_page(int(host[bad * PAGE])).view(torch.uint8).clone()
    ok = backend.batch_get_v1(keys, host)
    assert ok[:bad] == [True] * bad and ok[bad] is False
    want = expected(pool, keys, salt)
    for i, good in enumerate(ok):  # every page reported read holds its own bytes
        got = pool.get_data_page(int(host[i * PAGE])).view(torch.uint8)
        assert not good or torch.equal(got, want[i])
    if untouched:
        assert torch.equal(pool.get_data_page(int(host[bad * PAGE])).view(torch.uint8), before)
    pool.free(host)
    return ok
