"""The repository is self-contained: what the docs and docstrings cite exists, and the README's
flags are real."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from pathlib import Path

from kvstrata.cli import BENCHMARKS, bench_module, build_parser

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "src").rglob("*.py")),
    *sorted((ROOT / "scripts").glob("*")),
]
# A repository file named by its path (docs/x.md, scripts/x.sh, src/..., tests/...), which must
# exist as written, or a document named bare ("design.md", "DESIGN.md"), which must be one of the
# repository's documents whatever its case.
PATH = re.compile(r"(?<![\w./-])((?:docs|scripts|src|tests)/[\w./-]+\.\w+)")
BARE = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
DOCUMENTS = {p.name.lower() for p in [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")]}


def test_cited_files_exist() -> None:
    paths = [(path, m) for path in TEXTS for m in PATH.findall(path.read_text())]
    bare = [(path, m) for path in TEXTS for m in BARE.findall(path.read_text())]
    assert any(name == "docs/design.md" for _, name in paths)
    missing = [(str(p.relative_to(ROOT)), name) for p, name in paths if not (ROOT / name).exists()]
    missing += [
        (str(p.relative_to(ROOT)), name) for p, name in bare if name.lower() not in DOCUMENTS
    ]
    assert not missing


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found: set[str] = set()
    for action in parser._actions:
        found |= set(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


#: ``sglang.launch_server`` flags in the README's SGLang section (not kvstrata's), each a field of
#: SGLang's server arguments (checked against the installed sglang where there is one).
SGLANG_FLAGS = {
    "--model-path",
    "--enable-hierarchical-cache",
    "--hicache-mem-layout",
    "--hicache-storage-backend",
    "--hicache-storage-backend-extra-config",
    "--kv-cache-dtype",
    "--enable-metrics",
}

#: Flags the README announces for work in progress, each only in a paragraph that says they come
#: with it. When one exists, drop it here and the README's note with it.
PLANNED: set[str] = set()  # flags the README announces before they exist


def test_readme_flags_exist() -> None:
    known = _options(build_parser()) | {"--nproc-per-node"}  # torchrun's, in the CP example
    known |= SGLANG_FLAGS
    for name in BENCHMARKS:
        known |= _options(
            importlib.import_module(f"kvstrata.benchmarks.{bench_module(name)}").build_parser()
        )
    readme = (ROOT / "README.md").read_text()
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", readme))
    assert {"--threads", "--version", "--fail-on-error"} <= flags
    assert flags <= known | PLANNED, flags - known - PLANNED
    assert not PLANNED & known, f"{PLANNED & known} exist now: drop them from PLANNED"
    for paragraph in readme.split("\n\n"):
        if any(flag in paragraph for flag in PLANNED):
            assert "coming with" in paragraph, paragraph


def test_readme_sglang_flags_are_sglangs() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return  # without sglang installed there is nothing to check them against
    fields = "".join(
        p.read_text() for p in (Path(spec.origin).parent / "srt" / "arg_groups").rglob("*.py")
    )
    for flag in SGLANG_FLAGS:
        assert re.search(rf"\b{flag[2:].replace('-', '_')}\b", fields), flag


def _architecture_rows() -> list[str]:
    """The module column of docs/architecture.md's table: each cell's backticked names."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    names: list[str] = []
    for line in text.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([\w/.]+)`", line.split("|")[1])
    return names


def test_architecture_names_every_module_and_only_real_ones() -> None:
    """The module table names files that exist, and every module outside the packages it names
    whole (benchmarks/, workloads/, integrations/sglang/, model/ rows aside) has a row."""
    src = ROOT / "src" / "kvstrata"
    rows = _architecture_rows()
    assert rows
    missing = [name for name in rows if not (src / name).exists()]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    whole = tuple(name for name in rows if name.endswith("/"))
    modules = [
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    ]
    unnamed = [m for m in modules if m not in rows and not m.startswith(whole)]
    assert not unnamed, f"docs/architecture.md has no row for {sorted(unnamed)}"
