"""``kvstrata compare A B``: two replay results side by side, with B / A for every number.

A result is a ``--json`` summary: a ``summary.json`` file (or the directory ``--report`` wrote it
into), or the saved output of ``kvstrata replay --json`` (its last line). The rows are the
numbers people compare first (hit ratio, hit tokens by tier, TTFT and its parts, throughput, bytes
moved), then every configuration field that differs. A field one side lacks (an older schema, no
L2) shows as a dash. Whatever a file holds, it is printed escaped: control characters (an ESC
that would drive the terminal) appear as ``\x1b``.
"""

from __future__ import annotations

import json
import math
import unicodedata
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .report_html import format_value, lookup

#: (label, path in the summary): the rows, in order.
ROWS = (
    ("requests", "requests"),
    ("failed", "failed"),
    ("prompt tokens", "prompt_tokens"),
    ("cached tokens", "cached_tokens"),
    ("hit ratio", "hit_ratio"),
    ("hit tokens L1", "hit_tokens_by_tier.l1"),
    ("hit tokens L2", "hit_tokens_by_tier.l2"),
    ("hit tokens L3", "hit_tokens_by_tier.l3"),
    ("computed tokens", "computed_tokens"),
    ("prefill tokens/s", "prefill_tokens_per_s"),
    ("TTFT mean ms", "ttft_ms.mean"),
    ("TTFT p50 ms", "ttft_ms.p50"),
    ("TTFT p90 ms", "ttft_ms.p90"),
    ("TTFT p99 ms", "ttft_ms.p99"),
    ("queue wait mean ms", "ttft_parts_ms.queue.mean"),
    ("load-back wait mean ms", "ttft_parts_ms.load_back.mean"),
    ("compute mean ms", "ttft_parts_ms.compute.mean"),
    ("TTFT p50 ms, cached", "ttft_by_hit_ms.cached.p50"),
    ("TTFT p50 ms, recomputed", "ttft_by_hit_ms.recomputed.p50"),
    ("clock seconds", "clock.seconds"),
    ("engine seconds", "seconds"),
    ("engine steps", "steps"),
    ("pool pages used peak", "pool.pages_used_peak"),
    ("moved d2h bytes", "tiers.d2h_bytes"),
    ("moved h2d bytes", "tiers.h2d_bytes"),
    ("backups skipped", "tiers.backups_skipped"),
    ("load-backs", "tiers.loads"),
    ("tree bytes per token", "tree.bytes_per_token"),
)


def load_summary(path: str | Path) -> dict[str, Any]:
    """A replay summary from a JSON file, a report directory, or saved ``--json`` output."""
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    try:
        text = p.read_bytes().decode()
    except OSError as err:
        raise ConfigError(f"cannot read {p}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"{p} is not a text file (not UTF-8): give a summary.json, a --report directory, or "
            "the saved output of kvstrata replay --json"
        ) from None
    candidates = [text] + [line for line in reversed(text.splitlines()) if line.strip()][:1]
    for candidate in candidates:
        try:
            data = json.loads(candidate)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
            continue
        if isinstance(data, dict) and "hit_ratio" in data and "schema" in data:
            if not isinstance(data.get("config", {}), dict):
                raise ConfigError(
                    f"{p}: its 'config' is a {type(data['config']).__name__}, not an object; "
                    "not a replay summary"
                )
            return data
    raise ConfigError(
        f"{p} holds no replay summary: give a summary.json, a --report directory, or the saved "
        "output of kvstrata replay --json"
    )


def ratio(a: Any, b: Any) -> str:
    """``b / a`` for two numbers, else a dash."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if not numbers:
        return "—"
    if a == 0:
        return "—" if b == 0 else "inf"
    value = b / a
    return f"{value:.3f}" if math.isfinite(value) else "—"


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The rows: (label, A, B, B / A), then configuration fields that differ."""
    rows = [
        (
            label,
            format_value(lookup(a, key)),
            format_value(lookup(b, key)),
            ratio(lookup(a, key), lookup(b, key)),
        )
        for label, key in ROWS
        if lookup(a, key) is not None or lookup(b, key) is not None
    ]
    ca, cb = a.get("config", {}), b.get("config", {})
    for key in sorted(set(ca) | set(cb)):
        if ca.get(key) != cb.get(key):
            rows.append(
                (f"config: {key}", format_value(ca.get(key)), format_value(cb.get(key)), "")
            )
    return rows


def printable(text: str) -> str:
    """``text`` with control and format characters escaped (``\x1b``), safe on a terminal."""
    return "".join(
        c.encode("unicode_escape").decode() if unicodedata.category(c)[0] == "C" else c
        for c in text
    )


def render(rows: list[tuple[str, str, str, str]], name_a: str, name_b: str) -> str:
    header = ("", name_a, name_b, "B / A")
    rows = [(printable(a), printable(b), printable(c), printable(d)) for a, b, c, d in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = []
    for r in [header, *rows]:
        lines.append(
            f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}".rstrip()
        )
    return "\n".join(lines)
