"""kvstrata: a page-granular, tiered, context-parallel prefix KV cache for LLM prefill.

The library surface a serving engine uses, importable from here (``from kvstrata import
RadixTree``); the deep paths keep working. Each name is imported on first use, so
``import kvstrata`` stays as cheap as it was (no torch) until a name is asked for:

==================  =================================================================================
the cache core      ``CacheConfig``, ``PoolConfig``, ``KVLayout``, ``PayloadSpec``, ``RadixTree`` (with
                    ``MatchResult``, ``InsertResult``, ``TreeStats``), ``TokenKey``, ``PageAllocator``,
                    ``Residency``, ``Tier``
the tiers           ``DevicePool`` (L1), ``HostPool`` (L2), ``Transfer`` (``TransferStats``), the
                    residency drivers ``WriteThrough`` and ``LoadBack``, ``DiskStore`` and
                    ``DiskConfig`` (L3), ``Namespace`` (what disk pages are addressed under)
the engine          ``Engine``, ``EngineConfig``, ``Finished``, ``Request``, ``load_workload``
models              ``Compute``, ``ModelCompute``, ``PairCompute``, ``SyntheticCompute``,
                    ``LlamaModel``, ``ModelConfig``, ``load_model``
prefill -> decode   ``Handoff``, ``assemble``
context parallel    ``Group``, ``SoloGroup``
replay              ``ReplayConfig``, ``ReplaySummary``, ``run_replay``
errors              ``KVStrataError`` and every type below it (:mod:`kvstrata.errors` draws the tree)
==================  =================================================================================
"""

from __future__ import annotations

__version__ = "0.1.0"

#: Each lazily imported name and the module it lives in.
_LAZY = {
    "CacheConfig": "config",
    "PoolConfig": "config",
    "KVLayout": "config",
    "PayloadSpec": "config",
    "RadixTree": "cache.radix",
    "MatchResult": "cache.node",
    "InsertResult": "cache.node",
    "TreeStats": "cache.node",
    "TokenKey": "cache.keys",
    "PageAllocator": "cache.allocator",
    "Residency": "residency",
    "Tier": "residency",
    "DevicePool": "tiers.pool",
    "HostPool": "tiers.host_pool",
    "Transfer": "tiers.transfer",
    "TransferStats": "tiers.transfer",
    "WriteThrough": "tiers.writethrough",
    "LoadBack": "tiers.loadback",
    "DiskStore": "tiers.disk_store",
    "DiskConfig": "tiers.disk_config",
    "Namespace": "tiers.page_hash",
    "Engine": "engine",
    "EngineConfig": "engine",
    "Finished": "engine",
    "Request": "workloads",
    "load_workload": "workloads",
    "Compute": "model.compute",
    "ModelCompute": "model.compute",
    "PairCompute": "model.compute",
    "SyntheticCompute": "model.compute",
    "LlamaModel": "model.llama",
    "ModelConfig": "model.config",
    "load_model": "model.loader",
    "Handoff": "handoff",
    "assemble": "handoff",
    "Group": "dist.group",
    "SoloGroup": "dist.group",
    "ReplayConfig": "replay",
    "ReplaySummary": "replay",
    "run_replay": "replay",
    "AllocatorError": "errors",
    "CapacityError": "errors",
    "CheckpointError": "errors",
    "CollectiveError": "errors",
    "ConfigError": "errors",
    "DiskFormatError": "errors",
    "DiskStoreError": "errors",
    "DivergenceError": "errors",
    "DoubleFreeError": "errors",
    "ForeignPageError": "errors",
    "HandoffError": "errors",
    "InvalidTokensError": "errors",
    "KVStrataError": "errors",
    "ModelError": "errors",
    "PeerError": "errors",
    "PinnedMemoryError": "errors",
    "PoolInvariantError": "errors",
    "RequestError": "errors",
    "TransferError": "errors",
    "TransferTimeoutError": "errors",
    "TreeInvariantError": "errors",
    "TreeUsageError": "errors",
    "UnknownPageError": "errors",
    "UnsupportedArchitectureError": "errors",
    "WorkloadError": "errors",
}

__all__ = [
    "CacheConfig",
    "PoolConfig",
    "KVLayout",
    "PayloadSpec",
    "RadixTree",
    "MatchResult",
    "InsertResult",
    "TreeStats",
    "TokenKey",
    "PageAllocator",
    "Residency",
    "Tier",
    "DevicePool",
    "HostPool",
    "Transfer",
    "TransferStats",
    "WriteThrough",
    "LoadBack",
    "DiskStore",
    "DiskConfig",
    "Namespace",
    "Engine",
    "EngineConfig",
    "Finished",
    "Request",
    "load_workload",
    "Compute",
    "ModelCompute",
    "PairCompute",
    "SyntheticCompute",
    "LlamaModel",
    "ModelConfig",
    "load_model",
    "Handoff",
    "assemble",
    "Group",
    "SoloGroup",
    "ReplayConfig",
    "ReplaySummary",
    "run_replay",
    "KVStrataError",
    "ConfigError",
    "InvalidTokensError",
    "CapacityError",
    "PinnedMemoryError",
    "AllocatorError",
    "DoubleFreeError",
    "ForeignPageError",
    "UnknownPageError",
    "TreeInvariantError",
    "TreeUsageError",
    "PoolInvariantError",
    "TransferError",
    "TransferTimeoutError",
    "ModelError",
    "CheckpointError",
    "UnsupportedArchitectureError",
    "DiskStoreError",
    "DiskFormatError",
    "WorkloadError",
    "PeerError",
    "CollectiveError",
    "DivergenceError",
    "RequestError",
    "HandoffError",
]


def __getattr__(name: str) -> object:
    """Import a public name's module on first use (PEP 562) and keep the name here."""
    import importlib

    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# What type checkers and editors see: the same names, imported eagerly. (Not typing.TYPE_CHECKING:
# importing typing would double the cost of `import kvstrata`; mypy reads this name the same.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .cache.allocator import PageAllocator
    from .cache.keys import TokenKey
    from .cache.node import InsertResult, MatchResult, TreeStats
    from .cache.radix import RadixTree
    from .config import CacheConfig, KVLayout, PayloadSpec, PoolConfig
    from .dist.group import Group, SoloGroup
    from .engine import Engine, EngineConfig, Finished
    from .errors import (
        AllocatorError,
        CapacityError,
        CheckpointError,
        CollectiveError,
        ConfigError,
        DiskFormatError,
        DiskStoreError,
        DivergenceError,
        DoubleFreeError,
        ForeignPageError,
        HandoffError,
        InvalidTokensError,
        KVStrataError,
        ModelError,
        PeerError,
        PinnedMemoryError,
        PoolInvariantError,
        RequestError,
        TransferError,
        TransferTimeoutError,
        TreeInvariantError,
        TreeUsageError,
        UnknownPageError,
        UnsupportedArchitectureError,
        WorkloadError,
    )
    from .handoff import Handoff, assemble
    from .model.compute import Compute, ModelCompute, PairCompute, SyntheticCompute
    from .model.config import ModelConfig
    from .model.llama import LlamaModel
    from .model.loader import load_model
    from .replay import ReplayConfig, ReplaySummary, run_replay
    from .residency import Residency, Tier
    from .tiers.disk_config import DiskConfig
    from .tiers.disk_store import DiskStore
    from .tiers.host_pool import HostPool
    from .tiers.loadback import LoadBack
    from .tiers.page_hash import Namespace
    from .tiers.pool import DevicePool
    from .tiers.transfer import Transfer, TransferStats
    from .tiers.writethrough import WriteThrough
    from .workloads import Request, load_workload
