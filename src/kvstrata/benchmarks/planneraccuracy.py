"""The planner's measured error (``kvstrata bench planner-accuracy``): one trace window replayed
on the device with the model, and predicted by ``--model none`` with the cost profile.

For each window of the trace (``--windows START:COUNT ...``: its lines START to START+COUNT,
arrivals counted from the window's first) and each ``--time-scales`` value, two replays with the
same sizes, chunking, batch limits, vocabulary and arrivals:

* **measured**: the model on ``--device`` (``cuda``: the wall clock; ``cpu``: the CPU clock, the
  replay thread's CPU time, which is what ``kvstrata calibrate`` times there);
* **predicted**: ``--model none --model-shape MODEL --cost-profile PROFILE`` on the simulated
  clock (the profile: ``--cost-profile``, or the one a replay picks for the model and device).

It prints, per window and scale, measured and predicted TTFT mean / p50 / p90 / p99, queue wait
(mean and p90), computed tokens per second of engine time, and hit ratio, with the relative error
of each (hit ratio: the absolute difference), then one JSON line. The targets (issue 21): TTFT
mean and p90 within 15 %, tokens/s within 10 %, hit ratio within 0.01.

Both replays' clocks start when their loop begins (building the engine is start-up), and the
model is warmed up first on a small engine of its own (``--warmup``, on by default: kernel
compilation is start-up too). With ``--steps-out DIR`` every engine step of both replays is
written as JSONL (``replay/steps.py``), and a table says where each run's clock time went: steps
measured and predicted, busy, idle and the loop's other time, the first step, the largest gaps,
and per step kind the profile's prediction for the measured run's own steps
(``benchmarks/planner_steps.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..arrivals import ArrivalSpec
from ..command import CommandParser, HelpFormatter, run_command
from ..cost import CostProfile, load_profile
from ..engine import EngineConfig
from ..errors import ConfigError
from ..limits import check_device
from ..model.compute import Compute
from ..model.loader import read_model_config
from ..replay import ReplayConfig, resolve_cost, run_replay
from ..replay.build import build_compute
from ..replay.steps import StepLog, write_steps
from ..replay.warmup import warm_up
from .planner_steps import format_steps, profile_seconds, summarize_steps

PROG = "kvstrata bench planner-accuracy"
DEFAULT_TRACE = "../shared/traces/mooncake/conversation_trace.jsonl"


@dataclass(frozen=True)
class Window:
    start: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Window:
        start, sep, count = text.partition(":")
        if not sep or not start.isdigit() or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--windows takes START:COUNT (e.g. 0:300), got {text!r}")
        return cls(int(start), int(count))

    def write(self, trace: Path, out: Path, max_input: int | None = None) -> tuple[Path, int]:
        """The window's lines of ``trace`` as a trace of its own, and how many were left out:
        with ``max_input``, lines whose ``input_length`` exceeds it (the model cannot take them,
        and both replays must see the same requests)."""
        lines, left_out = [], 0
        with trace.open() as f:
            for i, line in enumerate(f):
                if i >= self.start + self.count:
                    break
                if i >= self.start:
                    lines.append(line)
        if len(lines) < self.count:
            raise ConfigError(
                f"{trace} has {self.start + len(lines)} lines; window "
                f"{self.start}:{self.count} runs past its end"
            )
        if max_input is not None:
            kept = [line for line in lines if _input_length(line) <= max_input]
            lines, left_out = kept, len(lines) - len(kept)
        path = out / f"window-{self.start}-{self.count}.jsonl"
        path.write_text("".join(lines))
        return path, left_out


def _input_length(line: str) -> int:
    try:
        return int(json.loads(line).get("input_length", 0))
    except (ValueError, TypeError, AttributeError):
        return 0  # a malformed line: the replays' --on-error decides


#: (label, path in the summary's JSON, how the error is taken: relative or absolute)
FIGURES = (
    ("TTFT mean ms", "ttft_ms.mean", "rel"),
    ("TTFT p50 ms", "ttft_ms.p50", "rel"),
    ("TTFT p90 ms", "ttft_ms.p90", "rel"),
    ("TTFT p99 ms", "ttft_ms.p99", "rel"),
    ("queue mean ms", "ttft_parts_ms.queue.mean", "rel"),
    ("queue p90 ms", "ttft_parts_ms.queue.p90", "rel"),
    ("computed tokens/s", "tokens_per_s", "rel"),
    ("hit ratio", "hit_ratio", "abs"),
)


def _get(doc: dict[str, Any], path: str) -> float:
    if path == "tokens_per_s":
        busy = doc["clock"]["busy_s"]
        return doc["computed_tokens"] / busy if busy > 0 else 0.0
    value: Any = doc
    for key in path.split("."):
        value = value[key]
    return float(value)


def _error(measured: float, predicted: float, how: str) -> float:
    """The prediction's error: absolute (a ratio's difference) or relative to the measurement."""
    if how == "abs":
        return predicted - measured
    if measured:
        return (predicted - measured) / measured
    return 0.0 if predicted == 0 else float("inf")


def compare(measured: dict[str, Any], predicted: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, path, how in FIGURES:
        m, p = _get(measured, path), _get(predicted, path)
        err = _error(m, p, how)
        rows.append({"figure": label, "measured": m, "predicted": p, "error": err, "kind": how})
    return rows


def build_parser() -> CommandParser:
    p = CommandParser(
        prog=PROG,
        description="The planner's error against the device: trace windows replayed with the "
        "model (measured) and with --model none and the cost profile (predicted), same sizes "
        "and arrivals. Prints a table per window and time scale, then one JSON line.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--trace", default=DEFAULT_TRACE, help="a Mooncake JSONL trace")
    p.add_argument(
        "--windows", nargs="+", default=["0:300"], metavar="START:COUNT", help="trace windows"
    )
    p.add_argument("--time-scales", nargs="+", type=float, default=[1.0], metavar="X")
    p.add_argument("--model", default=None, help="default: llama-3.2-1b on cuda, tiny on cpu")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--cost-profile",
        default=None,
        metavar="NAME|FILE",
        help="the profile the prediction runs on (default: what replay picks for the model and "
        "device: the shipped one, else an estimate)",
    )
    p.add_argument("--l1-tokens", type=int, default=262_144)
    p.add_argument("--l2-tokens", type=int, default=1_048_576)
    p.add_argument("--page-size", type=int, default=EngineConfig.page_size)
    p.add_argument("--chunk-size", type=int, default=EngineConfig.chunk_size)
    p.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    p.add_argument("--max-batch-requests", type=int, default=EngineConfig.max_batch_requests)
    p.add_argument("--attention", default=ReplayConfig.attention, help="as kvstrata replay's")
    p.add_argument("--seed", type=int, default=ReplayConfig.seed)
    p.add_argument(
        "--on-error",
        choices=["stop", "skip"],
        default=ReplayConfig.on_error,
        help="a trace line the measured replay cannot take (malformed, or longer than the "
        "model's positions and --l1-tokens): stop, or leave it out of both replays (counted)",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each step kind once on a small engine of its own over the model before the "
        "measured replays (kernel compilation and autotuning are start-up, as kvstrata "
        "calibrate's warm-up has them)",
    )
    p.add_argument(
        "--steps-out",
        default=None,
        metavar="DIR",
        help="also record every engine step of both replays (start on the clock, duration, "
        "requests, tokens, prefix tokens, attention pairs, bytes copied, the loop's idle and "
        "add time before it, the profile's prediction for it) as JSONL in DIR, one file per "
        "window, scale and replay, and print where each run's time went",
    )
    return p


def configs(args: Any, trace: str, scale: float) -> tuple[ReplayConfig, ReplayConfig]:
    """The measured and the predicted replay of one window at one time scale."""
    model = args.model or ("llama-3.2-1b" if args.device.startswith("cuda") else "tiny")
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    engine = EngineConfig(
        page_size=args.page_size,
        pool_tokens=args.l1_tokens,
        l2_tokens=args.l2_tokens,
        chunk_size=args.chunk_size,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_requests=args.max_batch_requests,
        device=args.device,
    )
    arrivals = ArrivalSpec("trace", None, scale)
    measured = ReplayConfig(
        workload=trace,
        model=model,
        dtype=dtype,
        engine=engine,
        arrivals=arrivals,
        clock="cpu" if args.device == "cpu" else "wall",
        attention=args.attention,
        seed=args.seed,
        threads=1,
        on_error=args.on_error,
    )
    profile = args.cost_profile
    if profile is None:  # what a replay of the model on the simulated clock would pick
        sim = resolve_cost(ReplayConfig(model=model, dtype=dtype, engine=engine, clock="sim"), 1)
        assert sim.profile is not None
        profile = sim.profile.name
    predicted = ReplayConfig(
        workload=trace,
        model="none",
        model_shape=model,
        dtype=dtype,
        cost_profile=profile,
        kv_width=4,
        vocab_size=read_model_config(model).vocab_size,
        engine=EngineConfig(
            page_size=engine.page_size,
            pool_tokens=engine.pool_tokens,
            l2_tokens=engine.l2_tokens,
            chunk_size=engine.chunk_size,
            max_batch_tokens=engine.max_batch_tokens,
            max_batch_requests=engine.max_batch_requests,
        ),
        arrivals=arrivals,
        clock="sim",
        seed=args.seed,
        threads=1,
        on_error=args.on_error,
    )
    return measured, predicted


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    windows = [Window.parse(w) for w in args.windows]
    check_device(args.device)
    for scale in args.time_scales:
        ArrivalSpec.parse("trace", scale)  # refuses a scale that is not finite and > 0
    if args.model is not None:
        read_model_config(args.model)  # a preset or checkpoint, before anything runs
    trace = Path(args.trace)
    if not trace.is_file():
        raise ConfigError(f"trace {trace} not found; give one with --trace")
    if args.steps_out is not None and not args.steps_out.strip():
        raise ConfigError("--steps-out takes a directory, got an empty path")
    steps_out = Path(args.steps_out) if args.steps_out is not None else None
    if steps_out is not None:
        try:
            steps_out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"--steps-out {steps_out}: {err.strerror}") from None
        there = [
            str(path)
            for w in windows
            for scale in args.time_scales
            for path in _steps_paths(steps_out, w, scale).values()
            if path.exists()
        ]
        if there:
            raise ConfigError(
                f"--steps-out {steps_out} already holds {', '.join(there)}; give another "
                "directory (step logs never overwrite a file)"
            )
    results = []
    compute: Compute | None = None
    with tempfile.TemporaryDirectory(prefix="kvstrata-accuracy-") as tmp:
        for window in windows:
            limit = None
            if args.on_error == "skip":
                model = args.model or ("llama-3.2-1b" if args.device.startswith("cuda") else "tiny")
                limit = min(args.l1_tokens, read_model_config(model).max_position_embeddings)
            written, left_out = window.write(trace, Path(tmp), limit)
            path = str(written)
            if left_out:
                print(
                    f"window {window.start}:{window.count}: {left_out} line(s) over {limit:,} "
                    "input tokens left out of both replays"
                )
            for scale in args.time_scales:
                measured_cfg, predicted_cfg = configs(args, path, scale)
                logs = (StepLog(), StepLog()) if steps_out is not None else None
                if compute is None:  # one model for every measured replay, warmed up once
                    compute = build_compute(measured_cfg)
                    if args.warmup:
                        warm = warm_up(compute, measured_cfg.engine, args.seed)
                        print(
                            f"warm-up: {warm.seconds:.2f} s before the measured replays "
                            f"({', '.join(sorted(warm.kinds))} steps)"
                        )
                measured = run_replay(
                    measured_cfg,
                    progress=False,
                    compute=compute,
                    observers=logs[:1] if logs else (),
                ).to_json()
                predicted = run_replay(
                    predicted_cfg, progress=False, observers=logs[1:] if logs else ()
                ).to_json()
                rows = compare(measured, predicted)
                results.append(
                    {
                        "window": f"{window.start}:{window.count}",
                        "left_out": left_out,
                        "time_scale": scale,
                        "rows": rows,
                        "profile": predicted["clock"]["cost"]["name"],
                        "profile_kind": predicted["clock"]["cost"]["kind"],
                        "measured_clock": measured["clock"]["kind"],
                    }
                )
                step_lines: list[str] = []
                if logs is not None and steps_out is not None:
                    assert predicted_cfg.cost_profile is not None
                    results[-1]["steps"], step_lines = _write_steps(
                        logs, load_profile(predicted_cfg.cost_profile), steps_out, window, scale
                    )
                print(
                    f"window {window.start}:{window.count}, time scale {scale:g}: measured "
                    f"({measured_cfg.model} on {args.device}, {measured['clock']['kind']} clock) "
                    f"vs predicted (profile {results[-1]['profile']}, "
                    f"{results[-1]['profile_kind']})"
                )
                print(f"  {'figure':<18} {'measured':>12} {'predicted':>12} {'error':>8}")
                for r in rows:
                    shown = f"{r['error']:+.4f}" if r["kind"] == "abs" else f"{r['error']:+.1%}"
                    print(
                        f"  {r['figure']:<18} {r['measured']:>12,.3f} {r['predicted']:>12,.3f} "
                        f"{shown:>8}"
                    )
                for line in step_lines:
                    print(line)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        json.dumps(
            {
                "bench": "planner-accuracy",
                "trace": str(trace),
                "device": device,
                "results": results,
                "load_average_1m": load,
            }
        )
    )
    return 0


def _steps_paths(out: Path, window: Window, scale: float) -> dict[str, Path]:
    stem = f"window-{window.start}-{window.count}-scale-{scale:g}"
    return {name: out / f"{stem}-{name}.jsonl" for name in ("measured", "predicted")}


def _write_steps(
    logs: tuple[StepLog, StepLog], profile: CostProfile, out: Path, window: Window, scale: float
) -> tuple[dict[str, Any], list[str]]:
    """Both replays' steps as JSONL in ``out`` (each record with the profile's prediction for
    its composition, ``profile_s``), their summaries, and the lines that print them."""
    summaries, files = {}, {}
    paths = _steps_paths(out, window, scale)
    for name, log in zip(("measured", "predicted"), logs, strict=True):
        path = paths[name]
        write_steps(log.records, path, lambda r: {"profile_s": profile_seconds(profile, r)})
        summaries[name] = summarize_steps(log, profile)
        files[name] = str(path)
    lines = format_steps(summaries["measured"], summaries["predicted"])
    lines.append(f"  steps written to {files['measured']} and {files['predicted']}")
    return summaries | {"files": files}, lines


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors (``kvstrata bench planner-accuracy``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
