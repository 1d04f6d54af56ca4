"""Every flag of every command, given generated bad values: one error line and exit 2, or a run.

The flags are not listed here: they are read from the parsers themselves (``kvstrata`` and its
subcommands, and each ``bench`` script's own parser), so a flag added tomorrow is fuzzed too. Each
example sets one flag to a value drawn from the classes of bad input (negative, zero, huge,
non-numeric, NaN/inf, empty, nonexistent paths) on top of cheap base arguments and runs the real
command in-process. The outcome must be either exit 2 with exactly one stderr line
``kvstrata <command>: error: ...``, or — where the value happens to be valid — a normal run (exit 0
or 1) whose last stdout line is its JSON summary. An exception escaping ``main`` fails the test.

The machine's available memory is an input of the memory checks; it is pinned to 256 MiB here, so
which huge values are refused does not depend on the machine and a valid run stays small.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import shutil
import tempfile
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.cli import BENCHMARKS, bench_module, build_parser, main

AVAILABLE_BYTES = 256 * 2**20
OUT = tempfile.mkdtemp(prefix="kvstrata-fuzz-")  # the commands' working directory

# Cheap base arguments per command; the fuzzed flag comes last, so it wins over a base value.
BASE = {
    "replay": ["replay", "--model", "none", "--limit", "2", "--no-progress", "--json"],
    "sweep": [
        "sweep",
        "--trace",
        "builtin",
        "--limit",
        "3",
        "--l1-tokens",
        "16k",
        "--report",
        OUT,
        "--no-progress",
        "--json",
    ],
    "compare": ["compare", "a.json", "b.json"],
    "check-model": ["check-model", "tiny", "--json"],
    "bench radix": ["bench", "radix", "--requests", "4", "--page-sizes", "16"],
    "bench prefill": [
        "bench",
        "prefill",
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--lengths",
        "8",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ],
    "bench planner": ["bench", "planner", "--leaves", "20", "--pages", "4", "--deficit", "10"],
    "bench workload": ["bench", "workload", "--trace", "builtin"],
    "bench replay": [
        "bench",
        "replay",
        "--trace",
        "builtin",
        "--repeats",
        "1",
        "--scrape-interval",
        "10",
    ],
    "bench memory": ["bench", "memory", "--sizes", "2", "--l1-tokens", "300000"],
    # CUDA-only benchmarks: on a machine without CUDA every value ends in one error line.
    "bench attention": ["bench", "attention", "--device", "cpu"],
    "bench gpu": ["bench", "gpu", "--device", "cpu", "--trace", "README.md"],
    "bench cp": [
        "bench",
        "cp",
        "--cp",
        "1",
        "--prefixes",
        "16",
        "--extend",
        "4",
        "--replay-trace",
        "builtin",
    ],
    "bench multi-gpu": [
        "bench",
        "multi-gpu",
        "--device",
        "cpu",
        "--cp",
        "1",
        "--prompt",
        "32",
        "--prefix",
        "32",
        "--suffix",
        "8",
        "--pool-tokens",
        "64",
        "--requests",
        "2",
        "--repeats",
        "1",
    ],
    "bench disk": [
        "bench",
        "disk",
        "--dir",
        "/tmp",
        "--gib",
        "0.0001",
        "--layers",
        "1",
        "--kv-heads",
        "1",
        "--head-dim",
        "8",
        "--page-size",
        "4",
        "--repeat",
        "1",
        "--io-mode",
        "buffered",
    ],
    "bench sglang-backend": [
        "bench",
        "sglang-backend",
        "--dir",
        "/tmp",
        "--gib",
        "0.0001",
        "--layers",
        "1",
        "--kv-heads",
        "1",
        "--head-dim",
        "8",
        "--page-size",
        "4",
        "--repeat",
        "1",
        "--io-mode",
        "buffered",
        "--staging-mib",
        "1",
    ],
    "bench tiers": [
        "bench",
        "tiers",
        "--device",
        "cpu",
        "--prefix",
        "32",
        "--suffix",
        "8",
        "--repeats",
        "1",
        "--dir",
        OUT,
    ],
    "bench remote": [
        "bench",
        "remote",
        "--gib",
        "0.0001",
        "--layers",
        "1",
        "--kv-heads",
        "1",
        "--head-dim",
        "8",
        "--page-size",
        "4",
        "--repeat",
        "1",
    ],
    "disk": ["disk", "check"],  # its value: the directory (test_disk_check_positional)
    "bench transfer": [
        "bench",
        "transfer",
        "--device",
        "cpu",
        "--pages",
        "4",
        "--page-size",
        "4",
        "--layers",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--geometry",
        "gqa",
    ],
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    commands = _subparsers(build_parser())
    parsers = {name: commands[name] for name in commands if name != "bench"}
    for name in BENCHMARKS:
        module = importlib.import_module(f"kvstrata.benchmarks.{bench_module(name)}")
        parsers[f"bench {name}"] = module.build_parser()
    return parsers


def _value_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The first option string of every optional that takes a value."""
    return [a.option_strings[0] for a in parser._actions if a.option_strings and a.nargs != 0]


FLAGS = {command: _value_flags(parser) for command, parser in _parsers().items()}

BAD_VALUES = st.one_of(
    st.integers(max_value=-1).map(str),  # negative
    st.sampled_from(["0", "-0", "0.0"]),  # zero
    st.integers(min_value=2**31, max_value=2**80).map(str),  # huge
    st.floats(min_value=1e15, allow_infinity=False).map(repr),  # huge, as a float
    st.sampled_from(["nan", "NaN", "inf", "-inf", "1e400"]),  # not finite
    st.text(alphabet="abcxyz_é. ", min_size=1, max_size=6),  # not a number
    st.sampled_from(["", " "]),  # empty
    st.sampled_from(["/nonexistent/x", "/nonexistent/trace.jsonl", "../nope"]),  # no such path
)


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch("kvstrata.limits.available_bytes", return_value=AVAILABLE_BYTES),
        contextlib.chdir(OUT),  # a valid relative --report path lands here, not in the repo
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own exits (usage errors, --help, --version)
            code = exit_.code if isinstance(exit_.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def check_outcome(command: str, argv: list[str]) -> None:
    code, out, err = run(argv)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith(f"kvstrata {command}: error: "), (argv, err)
    else:
        assert code in (0, 1), (argv, code, err)
        assert "Traceback" not in err
        json.loads(out.strip().splitlines()[-1])  # the run's JSON summary is the last line


def fuzz(command: str, max_examples: int) -> None:
    @settings(
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(flag=st.sampled_from(FLAGS[command]), value=BAD_VALUES)
    def one(flag: str, value: str) -> None:
        check_outcome(command, [*BASE[command], f"{flag}={value}"])

    one()


def test_every_command_has_flags_to_fuzz() -> None:
    assert set(FLAGS) == set(BASE)
    assert {"--l1-tokens", "--threads", "--trace", "--kv-width"} <= set(FLAGS["replay"])
    assert {"--device", "--atol", "--page-size"} <= set(FLAGS["check-model"])
    assert {"--requests", "--budget"} <= set(FLAGS["bench radix"])
    assert {"--lengths", "--repeats"} <= set(FLAGS["bench prefill"])


def test_replay_flags() -> None:
    fuzz("replay", 80)


def test_sweep_flags() -> None:
    fuzz("sweep", 40)


@pytest.mark.slow
def test_bench_replay_flags() -> None:
    fuzz("bench replay", 15)  # a valid value runs three replays


@given(value=BAD_VALUES)
@settings(max_examples=20, derandomize=True, deadline=None)
def test_compare_positionals(value: str) -> None:
    check_outcome("compare", ["compare", value, value, "--json"])


@pytest.mark.slow
def test_check_model_flags() -> None:
    fuzz("check-model", 20)


def test_bench_radix_flags() -> None:
    fuzz("bench radix", 30)


@pytest.mark.slow
def test_bench_prefill_flags() -> None:
    fuzz("bench prefill", 20)


def test_bench_planner_flags() -> None:
    fuzz("bench planner", 20)


@pytest.mark.slow
def test_bench_transfer_flags() -> None:
    fuzz("bench transfer", 20)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a valid value would run on the GPU")
def test_bench_attention_and_gpu_flags() -> None:
    fuzz("bench attention", 15)
    fuzz("bench gpu", 30)


def test_bench_workload_flags() -> None:
    fuzz("bench workload", 30)


@pytest.mark.slow
def test_bench_cp_flags() -> None:
    fuzz("bench cp", 12)  # a valid --cp starts rank processes


@pytest.mark.slow
def test_bench_multi_gpu_flags() -> None:
    fuzz("bench multi-gpu", 12)  # a valid value starts a rank process


@pytest.mark.slow
def test_bench_memory_flags() -> None:
    fuzz("bench memory", 12)  # a valid value runs two child processes


@pytest.mark.slow
def test_bench_disk_flags() -> None:
    fuzz("bench disk", 20)  # a valid value runs dd


@pytest.mark.slow
def test_bench_sglang_backend_flags() -> None:
    pytest.importorskip("sglang", reason="the pinned sglang is not installed (scripts/setup.sh)")
    fuzz("bench sglang-backend", 20)  # a valid value runs dd and SGLang's host pool


@pytest.mark.slow
def test_bench_tiers_flags() -> None:
    fuzz("bench tiers", 12)  # a valid value runs the tiny model through every tier and dd


@pytest.mark.slow
def test_bench_remote_flags() -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
        pytest.skip("redis-server / redis-benchmark are not installed (scripts/setup.sh)")
    fuzz("bench remote", 15)  # a valid value starts a redis-server and runs redis-benchmark


@given(value=BAD_VALUES)
@settings(max_examples=30, derandomize=True, deadline=None)
def test_disk_check_positional(value: str) -> None:
    assert FLAGS["disk"] == []  # `disk` has actions, not flags; `disk check` only switches
    code, _, err = run(["disk", "check", value])
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("kvstrata disk: error: "), err


@given(value=BAD_VALUES)
@settings(max_examples=30, derandomize=True, deadline=None)
def test_disk_gc_positional(value: str) -> None:
    code, _, err = run(["disk", "gc", value, "--keep", value])
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("kvstrata disk: error: "), err


@given(value=BAD_VALUES)
@settings(max_examples=30, derandomize=True, deadline=None)
def test_check_model_positional(value: str) -> None:
    check_outcome("check-model", ["check-model", value])
