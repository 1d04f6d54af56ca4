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
        env={**os.environ, "PYTHONPATH": src},
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["peak_mib"] < report["out_mib"] + 200, report
