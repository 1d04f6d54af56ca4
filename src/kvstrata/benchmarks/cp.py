"""``kvstrata bench cp``: what context parallelism moves and costs, on local ranks over gloo.

Two parts, each for cp = 1, 2, 4 (informational on CPU; GPU scaling is the multi-GPU issue):

* **Attention exchange.** A cached prefix of 1K, 8K and 32K tokens, then a short extend (64
  tokens) that hits it, with each attention strategy forced: bytes each rank puts into the
  attention collectives per layer, and the time of that step. Move KV grows with the prefix,
  move queries with the extend.
* **Replay.** ``--model none`` over the shared synthetic workload: prompt tokens/s and bytes
  exchanged per rank.

Prints a table, then one JSON line (``{"bench": "cp", ...}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np
import torch

from ..command import CommandParser, run_command
from ..dist.group import Group, SoloGroup
from ..dist.launch import run_ranks
from ..engine import Engine, EngineConfig
from ..errors import ConfigError
from ..model.compute import ModelCompute
from ..model.loader import load_model
from ..replay import ReplayConfig, run_replay
from ..workloads import Request

PROG = "kvstrata bench cp"


def exchange(group: Group, prefix: int, extend: int, strategy: str, model: str) -> dict[str, Any]:
    """Cache ``prefix`` tokens, then time one step of a request that extends them."""
    torch.set_num_threads(1)
    _, m = load_model(model, device="cpu", dtype="float32", seed=0)
    compute = ModelCompute(m, torch.float32)
    per_rank = -(-(prefix + extend + 64) // group.size)
    config = EngineConfig(
        page_size=16,
        pool_tokens=max(per_rank // 16 * 16 + 64, 64),
        chunk_size=max(prefix + extend, 1),
        max_batch_tokens=max(prefix + extend, 1),
    )
    engine = Engine(compute, config, group=group)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, compute.vocab_size, prefix + extend, dtype=np.uint32)
    engine.add(Request(0, tokens[: prefix + 1].copy()))  # fills the cache (strategy: auto)
    while engine.has_work():
        engine.step()
    engine.config = dataclasses.replace(config, cp_attention=strategy)  # the measured step
    engine.add(Request(1, tokens.copy()))
    before = group.traffic.bytes.get("attention", 0)
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - t0
    moved = group.traffic.bytes.get("attention", 0) - before
    return {
        "attention_bytes_per_layer": moved // compute.layout.num_layers,
        "step_ms": round(seconds * 1e3, 2),
    }


def build_parser() -> CommandParser:
    ap = CommandParser(
        prog=PROG,
        description="Context parallelism on local ranks over gloo: attention bytes per layer and "
        "step time by strategy as the cached prefix grows, and replay throughput at cp 1, 2, 4. "
        "A table, then one JSON line.",
    )
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="rank counts")
    ap.add_argument(
        "--prefixes", type=int, nargs="+", default=[1024, 8192, 32768], help="cached tokens"
    )
    ap.add_argument("--extend", type=int, default=64, help="new tokens after the prefix")
    ap.add_argument("--model", default="tiny", help="model preset for the attention part")
    ap.add_argument("--replay-trace", default="synthetic:0:300", help="workload of the replay part")
    return ap


def check_args(args: argparse.Namespace) -> None:
    if any(not 1 <= c <= 8 for c in args.cp):
        raise ConfigError(f"--cp values must lie in [1, 8], got {args.cp}")
    if any(not 1 <= p <= 1 << 17 for p in args.prefixes):
        raise ConfigError(f"--prefixes must lie in [1, 131072], got {args.prefixes}")
    if not 1 <= args.extend <= 4096:
        raise ConfigError(f"--extend must lie in [1, 4096], got {args.extend}")


def _on(cp: int, fn: Any, args: tuple[Any, ...]) -> Any:
    return fn(SoloGroup(), *args) if cp == 1 else run_ranks(cp, fn, args)[0]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    rows: list[dict[str, Any]] = []
    print(f"{'cp':>3} {'prefix':>7} {'strategy':>13} {'attn bytes/layer':>17} {'step ms':>9}")
    for cp in args.cp:
        for prefix in args.prefixes:
            for strategy in ("move_kv", "move_queries") if cp > 1 else ("move_kv",):
                r = _on(cp, exchange, (prefix, args.extend, strategy, args.model))
                rows.append({"cp": cp, "prefix": prefix, "strategy": strategy, **r})
                print(
                    f"{cp:>3} {prefix:>7,} {strategy:>13} "
                    f"{r['attention_bytes_per_layer']:>17,} {r['step_ms']:>9.1f}"
                )
    replays = []
    print(f"\n{'cp':>3} {'prompt tok/s':>13} {'hit ratio':>9} {'MiB exchanged/rank':>19}")
    for cp in args.cp:
        summary = run_replay(
            ReplayConfig(workload=args.replay_trace, model="none", cp=cp, threads=1),
            progress=False,
        )
        moved = sum(summary.config.get("cp_bytes_per_rank", {}).values())
        tok_s = summary.prompt_tokens / summary.seconds if summary.seconds else 0.0
        replays.append(
            {
                "cp": cp,
                "prompt_tokens_per_s": round(tok_s),
                "hit_ratio": round(summary.hit_ratio, 6),
                "bytes_per_rank": moved,
            }  # fmt: skip
        )
        print(f"{cp:>3} {tok_s:>13,.0f} {summary.hit_ratio:>9.4f} {moved / 2**20:>19.1f}")
    print(json.dumps({"bench": "cp", "extend": args.extend, "model": args.model,
                      "exchange": rows, "replay": replays}))  # fmt: skip
    return 0


def run_main(argv: list[str] | None = None) -> int:
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
