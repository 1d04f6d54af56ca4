"""``kvstrata bench multi-gpu`` on CPU ranks over gloo: cp 2 reproduces cp 1's logits in fp32, move
queries sends fewer bytes than move KV on a hit, the group caches twice the tokens at the same pool
per rank; and on CUDA, more ranks than visible GPUs is refused before anything starts."""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.cli import main

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ARGS = ["bench", "multi-gpu", "--device", "cpu", "--model", "tiny", "--cp", "1", "2"]
SIZES = ["--prompt", "256", "--prefix", "256", "--suffix", "32", "--pool-tokens", "512"]


def test_cpu_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, *SIZES, "--requests", "4", "--repeats", "1", "--chunk-size", "128"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["bench"] == "multi-gpu" and summary["dtype"] == "float32"
    assert summary["targets"] == {
        "argmax_agree_ge_0.99": True,
        "digests_equal": True,
        "every_page_once": True,
    }
    solo, pair = summary["runs"]
    assert (solo["cp"], pair["cp"]) == (1, 2)
    assert pair["argmax_agree"] == 1.0 and pair["max_abs_logit_diff"] < 1e-4
    assert solo["cold_tokens_per_s"] > 0 and pair["cold_tokens_per_s"] > 0
    assert set(solo["hit"]) == {"local"} and set(pair["hit"]) == {"move_kv", "move_queries"}
    kv, queries = (pair["hit"][s]["attention_bytes"] for s in ("move_kv", "move_queries"))
    assert 0 < queries < kv and pair["move_queries_bytes_saved"] == kv - queries
    exchange = pair["exchange"]
    assert exchange["calls"] == 2 and exchange["busbw_gbps"] > 0  # tiny: one all-reduce a layer
    assert exchange["all_gather_busbw_gbps"] > 0 and exchange["all_reduce_busbw_gbps"] > 0
    one, two = solo["capacity"], pair["capacity"]
    assert one["stored_tokens_per_rank"] == [512] and two["stored_tokens_per_rank"] == [512, 512]
    assert two["cached_tokens"] == 2 * one["cached_tokens"] and two["over_cp1"] == 2.0
    assert any(line.lstrip().startswith("2  move-KV all-reduce") for line in lines)


def test_more_ranks_than_gpus_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["bench", "multi-gpu", "--cp", "1", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvstrata bench multi-gpu: error: --cp 2 needs 2 GPUs (one per rank), but 1 CUDA "
        "device(s) are visible; drop the larger --cp values"
    ]
