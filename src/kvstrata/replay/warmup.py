"""Warming a model's compute up before a measured replay's clock starts.

A device's first forward of each kind pays one-time costs: kernel compilation and autotuning
(Triton's attention and page-copy kernels), library handles (cuBLAS), the allocator's first
blocks. A deployed server pays them once at start-up; a replay that meets them in its first
steps counts them as service time, and every request queued behind those steps waits for them.
:func:`warm_up` runs the step kinds a replay will run (a fresh chunk, a chunk over a prefix, a
batch of several requests, a hit on the cache, and with an L2 the backups and a load-back) on a
small engine of its own over the same compute, so the replay's own engine, cache and clock are
untouched: the measured replay then starts warm, as ``kvstrata calibrate`` times its steps.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ..engine import Engine, EngineConfig
from ..model.compute import Compute
from ..workloads import Request
from .steps import step_kind


class WarmUp(NamedTuple):
    seconds: float  # wall time it took
    kinds: frozenset[str]  # the step kinds it ran (replay/steps.py)


def warm_up(compute: Compute, config: EngineConfig, seed: int = 0) -> WarmUp:
    """Run the step kinds of ``config``'s engine on ``compute`` (see the module docstring), on
    an engine of its own with a small L1 (and L2, when ``config`` has one) and no disk or shared
    tier."""
    began = time.perf_counter()
    P = config.page_size
    chunk = max(P, min(config.chunk_size, config.max_batch_tokens, compute.max_seq_len // 2))
    long = min(2 * chunk, compute.max_seq_len)  # a fresh chunk, then one over its prefix
    short = max(P + 1, chunk // 8)
    # L1 holds the long request and its batch; a request of L1's size then evicts them all.
    pool = -(-(long + 4 * short + 2 * P) // P) * P
    evictor = min(pool - 2 * P, compute.max_seq_len)
    small = replace(
        config,
        pool_tokens=pool,
        l2_tokens=4 * pool if config.has_l2 else 0,
        l2_gib=0.0,
        l3_dir=None,
        l3_gib=0.0,
        remote_url=None,
        remote_gib=0.0,
        remote_password=None,
        check_every_step=False,
        check_digests=False,
    )
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, compute.vocab_size, n, dtype=np.int64).astype(np.uint32)

    engine = Engine(compute, small, model_id="warm-up")
    kinds: set[str] = set()
    rid = iter(range(1 << 30))

    def run(requests: list[np.ndarray]) -> None:
        for t in requests:
            engine.add(Request(next(rid), t))
        while engine.has_work():
            engine.step()
            kinds.add(step_kind(engine.last_work))
        engine.drain()

    try:
        first = tokens(long)
        run([first] + [tokens(short) for _ in range(3)])  # fresh, then a batch over a prefix
        run([np.concatenate([first, tokens(short)])])  # a hit in L1
        if small.has_l2:  # evict the long one from L1 to L2, then hit it: a load-back
            run([tokens(evictor)])
            run([np.concatenate([first, tokens(short)])])
    finally:
        engine.close()
    return WarmUp(time.perf_counter() - began, frozenset(kinds))
