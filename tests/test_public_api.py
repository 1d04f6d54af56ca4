"""The public API: what ``kvstrata`` exports (pinned), that each name is the object of its home
module, that ``import kvstrata`` loads none of it, and that the README's library section imports
only these names (and runs)."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvstrata
import kvstrata.errors

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = [
    # the cache core
    "CacheConfig", "PoolConfig", "KVLayout", "PayloadSpec", "RadixTree", "MatchResult",
    "InsertResult", "TreeStats", "TokenKey", "PageAllocator", "Residency", "Tier",
    # the tiers
    "DevicePool", "HostPool", "Transfer", "TransferStats", "WriteThrough", "LoadBack",
    "DiskStore", "DiskConfig", "Namespace",
    # the engine
    "Engine", "EngineConfig", "Finished", "Request", "load_workload",
    # models
    "Compute", "ModelCompute", "PairCompute", "SyntheticCompute", "LlamaModel", "ModelConfig",
    "load_model",
    # prefill -> decode, context parallelism, replay
    "Handoff", "assemble", "Group", "SoloGroup", "ReplayConfig", "ReplaySummary", "run_replay",
    # errors
    "KVStrataError", "ConfigError", "InvalidTokensError", "CapacityError", "PinnedMemoryError",
    "AllocatorError", "DoubleFreeError", "ForeignPageError", "UnknownPageError",
    "TreeInvariantError", "TreeUsageError", "PoolInvariantError", "TransferError",
    "TransferTimeoutError", "ModelError", "CheckpointError", "UnsupportedArchitectureError",
    "DiskStoreError", "DiskFormatError", "WorkloadError", "PeerError", "CollectiveError",
    "DivergenceError",
    "RequestError", "HandoffError",
]  # fmt: skip


def test_all_is_pinned() -> None:
    assert sorted(kvstrata.__all__) == sorted(PUBLIC)
    assert len(set(kvstrata.__all__)) == len(kvstrata.__all__)
    assert set(kvstrata._LAZY) == set(kvstrata.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_each_name_is_its_home_modules(name: str) -> None:
    home = importlib.import_module(f"kvstrata.{kvstrata._LAZY[name]}")
    assert getattr(kvstrata, name) is getattr(home, name)
    assert name in dir(kvstrata)


def test_every_error_type_is_exported() -> None:
    errors = {
        name
        for name, obj in inspect.getmembers(kvstrata.errors, inspect.isclass)
        if issubclass(obj, kvstrata.errors.KVStrataError)
    }
    assert errors <= set(kvstrata.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        _ = kvstrata.NoSuchThing  # type: ignore[attr-defined]
    assert not hasattr(kvstrata, "_NoSuchThing")


def test_import_kvstrata_loads_nothing_heavy() -> None:
    code = (
        "import sys, kvstrata; print(sorted(m for m in ('torch', 'numpy', 'kvstrata.engine', "
        "'kvstrata.errors') if m in sys.modules)); kvstrata.ConfigError; "
        "print('kvstrata.errors' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True False"]


def library_section() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Library\n")
    return readme[start : readme.index("\n## ", start + 1)]


def test_readme_library_section_imports_only_public_names() -> None:
    blocks = re.findall(r"```python\n(.*?)```", library_section(), re.S)
    assert len(blocks) >= 2
    imports = [line for b in blocks for line in b.splitlines() if "kvstrata" in line]
    for line in imports:
        m = re.fullmatch(r"from kvstrata import (.+)", line.strip())
        assert m is not None, f"the README's library section imports a deep path: {line!r}"
        assert set(m.group(1).replace(" ", "").split(",")) <= set(kvstrata.__all__), line
    named = set(re.findall(r"`([A-Za-z_]+)`", library_section().split("```")[0]))
    unnamed = {n for n in set(kvstrata.__all__) - named if not n.endswith("Error")}
    assert not unnamed, "the section's opening paragraph names every public name but the errors"


def test_readme_library_examples_run() -> None:
    for block in re.findall(r"```python\n(.*?)```", library_section(), re.S):
        exec(compile(block, "README.md (library)", "exec"), {})
