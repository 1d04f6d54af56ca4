"""The repository is self-contained: what the docs and docstrings cite exists, and the README's
flags are real."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvstrata.benchmarks import prefill, radix
from kvstrata.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "src").rglob("*.py")),
    *sorted((ROOT / "scripts").glob("*")),
]
# A repository file named in prose: docs/x.md, scripts/x.sh, src/..., tests/..., or a bare DESIGN.md.
CITED = re.compile(r"(?<![\w./-])((?:docs|scripts|src|tests)/[\w./-]+\.\w+|[A-Z]+\.md)")


def _cited() -> list[tuple[Path, str]]:
    return [(path, m) for path in TEXTS for m in CITED.findall(path.read_text())]


def test_cited_files_exist() -> None:
    cited = _cited()
    assert any(name.endswith("DESIGN.md") for _, name in cited)
    missing = [
        (str(path.relative_to(ROOT)), name)
        for path, name in cited
        if not (ROOT / name).exists() and not (ROOT / "docs" / name).exists()
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


def test_readme_flags_exist() -> None:
    known = _options(build_parser()) | _options(radix.build_parser())
    known |= _options(prefill.build_parser())
    readme = (ROOT / "README.md").read_text()
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", readme))
    assert {"--threads", "--version", "--fail-on-error"} <= flags
    assert flags <= known, flags - known
