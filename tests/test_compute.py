"""Synthetic payloads (``--model none``): chunked construction, same bytes, bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.errors import ConfigError
from kvstrata.model.compute import synthetic_payload

M = 1 << 31


def whole_sequence_payload(tokens: torch.Tensor, kv_width: int) -> torch.Tensor:
    """The formula written out in one pass over the whole sequence (what synthetic_payload
    computed before it was chunked and before the forward's fast path): the reference every
    implementation must reproduce byte for byte."""
    tokens = tokens.to(torch.int64)
    positions = torch.arange(tokens.numel())
    weights = ((positions * 0x9E3779B1 + 0x7F4A7C15) % M) | 1
    state = torch.cumsum(((tokens + 1) * weights) % M, 0) % M
    lanes = torch.arange(kv_width, dtype=torch.int64)
    shift = ((lanes % 4) * 8)[None, :]
    mixed = state[:, None] ^ ((tokens[:, None] * 0x85EBCA77 + lanes[None, :] * 0x27D4EB2F) % M)
    mixed = torch.where(lanes[None, :] < 4, state[:, None], mixed)
    return ((mixed >> shift) & 0xFF).to(torch.uint8)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300),
    kv_width=st.integers(4, 24),
    chunk_tokens=st.integers(1, 64),
)
@settings(max_examples=150, deadline=None)
def test_chunked_payload_equals_the_whole_sequence_formula(
    tokens: list[int], kv_width: int, chunk_tokens: int
) -> None:
    t = torch.tensor(tokens, dtype=torch.int64)
    expected = whole_sequence_payload(t, kv_width)
    assert torch.equal(synthetic_payload(t, kv_width, chunk_tokens=chunk_tokens), expected)


def test_chunk_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        synthetic_payload(torch.arange(4), 8, chunk_tokens=0)


_PEAK_SCRIPT = """
import json, resource, torch
torch.set_num_threads(1)
from kvstrata.model.compute import synthetic_payload
n, width = 2_000_000, 64
tokens = torch.randint(0, 128_256, (n,), dtype=torch.int64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = synthetic_payload(tokens, width)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mib": (after - before) / 1024, "out_mib": out.numel() / 2**20}))
"""


@pytest.mark.slow
def test_payload_memory_does_not_grow_with_the_sequence() -> None:
    """2 M tokens x 64 bytes: the result is 122 MiB; the whole-sequence formula peaked at several
    GiB of int64 temporaries (8 bytes per byte of payload), the chunked one stays near the result."""
    src = str(Path(__file__).parents[1] / "src")
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        # One thread: two OpenMP threads on two busy cores spin at their barriers (a CI run
        # of this once passed its 300 s, where it takes 5 s).
        env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"},
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["peak_mib"] < report["out_mib"] + 200, report


@pytest.mark.parametrize("kv_width", [4, 5, 8, 13])
@pytest.mark.parametrize("path", ["pages", "batch", "device"])
def test_forward_writes_the_payload_of_each_whole_sequence(kv_width: int, path: str) -> None:
    """Every forward (numpy from the page tables on a CPU pool, the same through a
    ForwardBatch, torch ops elsewhere) writes, chunk by chunk over several batches, exactly the
    bytes ``synthetic_payload`` gives for each whole sequence, whatever page offsets the chunks
    start and end at."""
    import numpy as np

    from kvstrata.model.batch import ForwardBatch
    from kvstrata.model.compute import SyntheticCompute
    from kvstrata.tiers.pool import DevicePool

    P, rng = 4, np.random.default_rng(kv_width)
    compute = SyntheticCompute(kv_width, 1000)
    pool = DevicePool(compute.layout, P, 256, "cpu")
    lengths = [37, 9, 64, 1]
    slots = rng.permutation(256).astype(np.int64)
    tables, used = [], 0
    for n in lengths:
        tables.append(slots[used : used + -(-n // P)])
        used += -(-n // P)
    seqs = [torch.from_numpy(rng.integers(0, 2**32 - 1, n, dtype=np.int64)) for n in lengths]
    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        live = [i for i, n in enumerate(lengths) if done[i] < n]
        extends = [min(int(rng.integers(1, 20)), lengths[i] - done[i]) for i in live]
        batch = ForwardBatch.build([done[i] for i in live], extends, [tables[i] for i in live], P)
        ids = torch.cat(
            [seqs[i][done[i] : done[i] + e] for i, e in zip(live, extends, strict=True)]
        )
        if path == "pages":
            prefix = [done[i] for i in live]
            tabs = [tables[i] for i in live]
            assert compute.forward_pages(prefix, extends, tabs, ids.numpy().astype(np.uint32), pool)
        elif path == "batch":
            compute.forward(ids, batch, pool)
        else:
            compute._forward_device(ids, batch, pool, compute._weights(max(lengths), pool.device))
        for i, e in zip(live, extends, strict=True):
            done[i] += e
    for i, n in enumerate(lengths):
        got = compute.snapshot(pool, tables[i], n)
        assert torch.equal(got, whole_sequence_payload(seqs[i], kv_width)), i


def test_weight_table_grows_only_with_the_positions_asked_for() -> None:
    """The table is rebuilt for a new device, never doubled step after step (on CUDA, a pool on
    "cuda" holds tensors on "cuda:0": comparing the two as devices said they differ, and the
    table doubled every step until the GPU ran out of memory)."""
    from kvstrata.model.compute import SyntheticCompute

    compute = SyntheticCompute(4, 100)
    cpu = torch.device("cpu")
    first = compute._weights(1000, cpu)
    for _ in range(10):
        assert compute._weights(1000, cpu) is first
    assert first.numel() == 1 << 16
    bigger = compute._weights(200_000, cpu)
    assert bigger.numel() == 200_000 and torch.equal(bigger[: first.numel()], first)
