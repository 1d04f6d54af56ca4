"""Helpers shared by several test modules: running an engine to the end, writing traces, and a
hasher whose page keys collide."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvstrata.cache.keys import PrefixHasher
from kvstrata.engine import Engine, EngineConfig, Finished
from kvstrata.workloads import Request

#: Steps after which :func:`run_all` calls an engine stuck: no test workload needs nearly so many.
MAX_STEPS = 10_000


def run_all(
    engine: Engine, requests: Iterable[Request], check: bool = False
) -> dict[int, Finished]:
    """What :meth:`Engine.run` does, bounded: add ``requests``, step until nothing is left
    (failing if that takes more than :data:`MAX_STEPS` steps), drain the copies in flight, and
    return every outcome by request id; ``check``: every invariant after each step and at the
    end."""
    for r in requests:
        engine.add(r)
    out: dict[int, Finished] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        for f in engine.step():
            out[f.rid] = f
        if check:
            engine.check()
    assert not engine.has_work(), "the engine stopped making progress"
    engine.drain()
    if check:
        engine.check()
    return out


def trace_line(input_length: int, hash_ids: list[int], timestamp: int = 0, **fields: object) -> str:
    """One Mooncake trace line (each hash id a 512-token block)."""
    row = {"timestamp": timestamp, "input_length": input_length, "hash_ids": hash_ids}
    return json.dumps(row | fields)


def write_trace(path: Path, lines: Iterable[str]) -> Path:
    """A trace file of ``lines``, one per line, as given (malformed ones too)."""
    path.write_text("\n".join(lines) + "\n")
    return path


class OrderBlindHasher(PrefixHasher):
    """Every weight is 1: a key is the token sum plus the length term, so any two prefixes of
    equal length and equal token multiset collide."""

    def weights(self, n: int) -> np.ndarray:
        return np.ones(n, dtype=np.uint64)


def small_disk_config(tmp: Path, start: str) -> EngineConfig:
    """An engine of 16-token pages with room for a few requests in L1 and L2 and a small disk
    tier under ``tmp / "l3"``, started ``"clear"`` or ``"load"``."""
    return EngineConfig(
        page_size=16,
        pool_tokens=1280,
        chunk_size=64,
        max_batch_tokens=512,
        max_batch_requests=8,
        l2_tokens=1280,
        l3_dir=str(tmp / "l3"),
        l3_gib=0.05,
        l3_start=start,
    )
