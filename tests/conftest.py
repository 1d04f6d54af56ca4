"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from redis_rig import RedisCluster, RedisServer, RedisUnavailable

from kvstrata.check_model import _write_preset_checkpoint
from kvstrata.model.config import PRESETS


def pytest_configure(config: pytest.Config) -> None:
    # One intra-op thread, as `kvstrata replay` defaults to: the tests' ops are small, and with
    # torch's default of one thread per core a test runs 4-20x slower as soon as another process
    # uses a core (docs/benchmarks.md, "CPU threads"), e.g. 7 s -> 27 s or 155 s for the engine's
    # 200-request logits test on the shared 2-core machine.
    torch.set_num_threads(1)


#: The weight a poisoned checkpoint carries a NaN in (every forward reads it).
POISONED_WEIGHT = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset saved as a Hugging Face checkpoint (config.json + model.safetensors)."""
    path = tmp_path_factory.mktemp("tiny") / "checkpoint"
    _write_preset_checkpoint(PRESETS["tiny"], path, seed=0)
    return path


@pytest.fixture(scope="session")
def nan_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_checkpoint`` with one NaN in :data:`POISONED_WEIGHT`."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("nan") / "checkpoint"
    path.mkdir()
    (path / "config.json").write_bytes((tiny_checkpoint / "config.json").read_bytes())
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    tensors[POISONED_WEIGHT][0, 0] = torch.nan
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh ``redis-server`` on a free loopback port (skips the test where none starts)."""
    try:
        server = RedisServer(tmp_path / "redis")
    except RedisUnavailable as why:
        pytest.skip(str(why))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A 3-node Redis Cluster (no replicas), shared by the session's tests: flush it first."""
    try:
        cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    except RedisUnavailable as why:
        pytest.skip(str(why))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["standalone", "cluster"])
def store_url(request: pytest.FixtureRequest) -> str:
    """A shared-tier URL: a fresh standalone ``redis-server``, then the session's 3-node
    cluster, flushed (each test that takes it runs once on each)."""
    if request.param == "standalone":
        server: RedisServer = request.getfixturevalue("redis_server")
        return server.url
    cluster: RedisCluster = request.getfixturevalue("redis_cluster")
    cluster.flush()
    return cluster.url
