"""Ranks agree on their configuration before they run: compared field by field, at start.

Every rank must run the same configuration (same sizes, same model, same versions), or their
replicated decisions diverge. :func:`agree_on_config` gathers each rank's configuration (a nested
dict of plain values) and raises :class:`~kvstrata.errors.DivergenceError` naming the fields that
differ, as dotted paths with both values (``engine.page_size: 32 vs 16``), never two whole dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import DivergenceError
from .group import Group

#: Fields a refusal lists (the count of the others follows), and the length of a value shown.
SHOWN_FIELDS = 3
SHOWN_CHARS = 60


def flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``doc`` with nested mappings as dotted keys: ``{"engine": {"page_size": 16}}`` ->
    ``{"engine.page_size": 16}``."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def differences(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> list[str]:
    """``name: theirs vs mine`` for every dotted field that differs (or is missing on a side)."""
    a, b = flatten(theirs), flatten(mine)
    missing = object()
    out = []
    for name in sorted({*a, *b}):
        x, y = a.get(name, missing), b.get(name, missing)
        if x != y:
            out.append(f"{name}: {_show(x, missing)} vs {_show(y, missing)}")
    return out


def _show(value: Any, missing: object) -> str:
    text = "(absent)" if value is missing else repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def agree_on_config(group: Group, config: Mapping[str, Any]) -> None:
    """Raise on every rank when any rank's ``config`` differs from this one's (a collective)."""
    if group.size == 1:
        return
    for rank, other in enumerate(group.all_gather_object(dict(config), "config")):
        diff = differences(other, config)
        if diff:
            more = len(diff) - SHOWN_FIELDS
            listed = "; ".join(diff[:SHOWN_FIELDS]) + (f"; and {more} more" if more > 0 else "")
            raise DivergenceError(
                f"rank {rank} runs another configuration than rank {group.rank}: {listed} "
                f"(rank {rank}'s vs rank {group.rank}'s); start every rank with the same "
                "configuration"
            )
