"""The CLI's defaults are its dataclasses' defaults: every flag of every subcommand is either a
config field (its default must equal the field's) or named here as not one, and no flag writes a
number or a string again as a literal default."""

from __future__ import annotations

import argparse
import ast
import inspect
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, fields, replace
from pathlib import Path
from typing import Any

import pytest

import kvstrata.cli
from kvstrata.arrivals import ArrivalSpec
from kvstrata.calibrate import calibrate
from kvstrata.check_model import check_model
from kvstrata.cli import DEFAULT_THREADS, build_parser
from kvstrata.cli.flags import replay_config
from kvstrata.cli.replay import SWEEP_MODEL
from kvstrata.engine import EngineConfig
from kvstrata.replay import ReplayConfig, SimLinks
from kvstrata.tiers.disk_audit import audit_directory
from kvstrata.tiers.disk_gc import collect


def field_default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    assert f.default_factory is not MISSING, f.name
    return f.default_factory()


def dataclass_defaults(cls: type) -> dict[str, Any]:
    return {f.name: field_default(f) for f in fields(cls)}


def keyword_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not p.empty
    }


ENGINE = dataclass_defaults(EngineConfig)
REPLAY = dataclass_defaults(ReplayConfig)
ARRIVALS = dataclass_defaults(ArrivalSpec)
LINKS = dataclass_defaults(SimLinks)
#: What a replay flag fills: (the defaults of the dataclass, the field) where the names differ.
RENAMED = {
    "l1_tokens": (ENGINE, "pool_tokens"),
    "remote": (ENGINE, "remote_url"),
    "check": (ENGINE, "check_every_step"),
    "cp_timeout": (REPLAY, "cp_timeout_s"),
    "arrivals": (ARRIVALS, "kind"),
    "time_scale": (ARRIVALS, "time_scale"),
    "sim_h2d_gbps": (LINKS, "h2d_gbps"),
    "sim_d2h_gbps": (LINKS, "d2h_gbps"),
    "sim_disk_read_gbps": (LINKS, "disk_read_gbps"),
    "sim_disk_write_gbps": (LINKS, "disk_write_gbps"),
}
#: It fills ReplayConfig.cost (the flat model): not given, it stays None (replay/cost.py picks).
COST_FLAGS = ("sim_tokens_per_s",)
#: Flags that choose what a command prints or does with its result, not what it configures.
NOT_CONFIG = {
    "replay": {"json", "no_progress", "report", "fail_on_error"},
    "sweep": {"json", "no_progress", "report"},
    "compare": {"a", "b", "json"},
    "check-model": {"model", "json"},
    "bench": {"name", "rest"},
    "disk": {"disk_command"},
    "disk check": {"dir", "json", "quick"},
    "disk gc": {"dir"},
    "calibrate": {"out", "json", "from_steps", "base_profile"},
}
#: A command's own default where it differs from the field on purpose.
OWN_DEFAULTS = {
    ("replay", "threads"): DEFAULT_THREADS,  # the field's None leaves torch's: a library default
    ("sweep", "threads"): DEFAULT_THREADS,
    ("sweep", "model"): SWEEP_MODEL,  # a sweep is cache-only unless told otherwise
}


def field_of(command: str, dest: str) -> tuple[dict[str, Any], str] | None:
    """The defaults and field name that ``command``'s flag ``dest`` fills."""
    if command in ("replay", "sweep"):
        if dest in RENAMED:
            return RENAMED[dest]
        for defaults in (ENGINE, REPLAY):
            if dest in defaults and dest not in ("engine", "arrivals", "cost"):
                return defaults, dest
    if command == "check-model":
        defaults = keyword_defaults(check_model)
        return (defaults, dest) if dest in defaults else None
    if command == "disk gc":
        defaults = keyword_defaults(collect)
        return (defaults, dest) if dest in defaults else None
    if command == "calibrate":
        defaults = keyword_defaults(calibrate)
        return (defaults, dest) if dest in defaults else None
    if command == "disk check":
        defaults = keyword_defaults(audit_directory)
        return (defaults, dest) if dest in defaults else None
    return None


def commands(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every (sub)command's name and parser, nested ones as ``disk check``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{path} {name}".strip()
                yield full, sub
                yield from commands(sub, full)


def flags(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield action


def cli_default(action: argparse.Action) -> Any:
    """The default as the config receives it: a grid flag's one value, parsed."""
    if action.nargs == "+":
        (value,) = action.default
        return int(value) if action.type is str and value.isdigit() else value
    return action.default


def test_the_walk_reaches_every_subcommand() -> None:
    names = {name for name, _ in commands(build_parser())}
    assert names == {
        "replay", "sweep", "compare", "check-model", "bench", "disk", "disk check", "disk gc",
        "calibrate",
    }  # fmt: skip


@pytest.mark.parametrize("command", sorted(NOT_CONFIG))
def test_every_default_is_its_fields(command: str) -> None:
    parser = dict(commands(build_parser()))[command]
    for action in flags(parser):
        dest = action.dest
        if dest in NOT_CONFIG[command]:
            continue
        if (command, dest) in OWN_DEFAULTS:
            assert action.default == OWN_DEFAULTS[command, dest], dest
            continue
        if command in ("replay", "sweep") and dest in COST_FLAGS:
            assert action.default is None and REPLAY["cost"] is None, dest
            continue
        target = field_of(command, dest)
        assert target is not None, (
            f"kvstrata {command} {action.option_strings}: fills no config field; map it to its "
            "field here, or list it in NOT_CONFIG"
        )
        defaults, name = target
        assert cli_default(action) == defaults[name], (
            f"kvstrata {command} {action.option_strings} defaults to {action.default!r}, its "
            f"field {name} to {defaults[name]!r}"
        )


def test_disk_check_quick_is_audit_payload_negated() -> None:
    parser = dict(commands(build_parser()))["disk check"]
    (quick,) = [a for a in flags(parser) if a.dest == "quick"]
    assert quick.default is (not keyword_defaults(audit_directory)["payload"])


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("replay", replace(ReplayConfig(), threads=DEFAULT_THREADS)),
        ("sweep", replace(ReplayConfig(model=SWEEP_MODEL), threads=DEFAULT_THREADS)),
    ],
)
def test_no_flags_give_the_dataclass_defaults(command: str, expected: ReplayConfig) -> None:
    extra = ["--report", "unused"] if command == "sweep" else []
    args = build_parser().parse_args([command, *extra])
    assert replay_config(args) == expected


def literal_defaults(path: Path) -> list[str]:
    """``add_argument(..., default=<a number or string, or a list of them>)`` calls in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        for kw in node.keywords:
            values = kw.value.elts if isinstance(kw.value, (ast.List, ast.Tuple)) else [kw.value]
            if kw.arg == "default" and any(
                isinstance(v, ast.Constant) and isinstance(v.value, (int, float, str))
                and not isinstance(v.value, bool)
                for v in values
            ):  # fmt: skip
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_flag_writes_a_default_again_as_a_literal() -> None:
    package = Path(kvstrata.cli.__file__).parent
    assert [hit for path in sorted(package.glob("*.py")) for hit in literal_defaults(path)] == []
