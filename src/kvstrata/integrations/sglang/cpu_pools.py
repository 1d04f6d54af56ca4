"""SGLang's own host pool classes, built over CPU tensors (the tests and ``bench sglang-backend``).

``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` take the device pool's buffer description
(``MHABufferInfo`` / ``MLABufferInfo``); on a machine without a GPU the "device" buffers are CPU
tensors and the host pool is allocated unpinned, exactly as SGLang's CPU path does.

SGLang's host pool package imports its model-config tree, which imports ``torchvision`` (for
InternVL image preprocessing) at module level. PyPI's torchvision wheels link the CUDA build of
torch, so with a CPU torch they cannot load. When torchvision is not installed at all,
:func:`import_host_pools` puts a placeholder module in its place that raises on any use: nothing
on the storage path touches it, and a use would fail loudly, never quietly.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Any

import torch

log = logging.getLogger("kvstrata.sglang")


class _NoTorchvision:
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            "torchvision is not installed (kvstrata's CPU placeholder for SGLang's imports); "
            "install a torchvision that matches your torch to use SGLang's image models"
        )


def _placeholder_torchvision() -> None:
    # transformers decides once (cached) whether torchvision exists: let it see that it does not.
    import transformers.image_utils  # noqa: F401

    def missing(name: str) -> Any:
        raise AttributeError(f"torchvision placeholder has no {name!r} (torchvision is absent)")

    mods = {}
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__getattr__ = missing  # type: ignore[method-assign]
        mods[name] = mod
    absent = _NoTorchvision()
    mods["torchvision.transforms"].InterpolationMode = absent  # type: ignore[attr-defined]
    mods["torchvision.transforms.functional"].InterpolationMode = absent  # type: ignore[attr-defined]
    mods["torchvision"].transforms = mods["torchvision.transforms"]  # type: ignore[attr-defined]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]  # type: ignore[attr-defined]
    sys.modules.update(mods)
    log.warning("torchvision is not installed: a placeholder stands in for SGLang's imports")


def import_host_pools() -> tuple[type, type]:
    """``(MHATokenToKVPoolHost, MLATokenToKVPoolHost)`` from the installed sglang."""
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        _placeholder_torchvision()
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return MHATokenToKVPoolHost, MLATokenToKVPoolHost


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_host_pool(
    *,
    layers: int,
    heads: int,
    head_dim: int,
    page_size: int,
    pages: int,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "page_first",
) -> Any:
    """SGLang's MHA host pool of ``pages`` pages (plus SGLang's own padding page) over CPU
    "device" buffers of one page."""
    mha_cls, _ = import_host_pools()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo

    k = tuple(torch.zeros(page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    buffers = KVBuffers(
        k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD
    )
    info = MHABufferInfo(
        buffers=buffers,
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return mha_cls(
        info,
        1.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=page_size,
        start_layer=0,
        end_layer=layers,
        host_token_capacity=pages * page_size,
    )


def mla_host_pool(
    *,
    layers: int,
    page_size: int,
    pages: int,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "page_first",
) -> Any:
    """SGLang's MLA host pool (one latent of ``kv_lora_rank + rope_dim`` per token and layer)."""
    _, mla_cls = import_host_pools()
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo

    width = kv_lora_rank + rope_dim
    bufs = tuple(torch.zeros(page_size, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=_ptrs(bufs),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        kv_cache_dim=width,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return mla_cls(
        info,
        1.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=page_size,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
        host_token_capacity=pages * page_size,
    )
