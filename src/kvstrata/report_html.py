"""The HTML of a report page (``replay --report`` and ``kvstrata sweep``), and its cells.

A page reads top to bottom as a person wants it: the title and one line on what ran, the
headline block (the answer: :mod:`kvstrata.headline`), the plots at a readable size (two to a row
on a laptop's window, one on a narrow one; never thumbnails), then the configuration, versions
and machine, then every number. Tables sit in wrapping flex rows, so a long value (a trace path)
widens or wraps its own table and pushes its neighbour down instead of running over it; a table
wider than the page (a sweep's runs) scrolls inside its own box.

Every number on the page names its JSON path: a cell showing a value carries ``data-key`` (its
dotted path in summary.json or sweep.json, shown as :func:`format_value` writes it, or as a
percentage), and a cell showing a share computed from two values carries ``data-num`` and
``data-den``. ``tests/test_report.py`` reads every such cell back against the JSON.
"""

from __future__ import annotations

import html
import json
import os
import platform
from collections.abc import Iterator
from importlib import metadata
from typing import Any

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 110em; padding: 0 2em;
  color: #222; }}
h1 {{ font-size: 1.5em; margin-bottom: 0.2em; }} h2 {{ font-size: 1.2em; margin: 1.6em 0 0.4em; }}
h3 {{ font-size: 1em; margin: 0.6em 0 0.3em; }}
table {{ border-collapse: collapse; margin: 0.3em 0; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 0.2em 0.8em; text-align: left;
  vertical-align: top; }}
#setup td {{ overflow-wrap: anywhere; }} #setup th {{ white-space: nowrap; }}
td.num, th.num {{ text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }}
.row {{ display: flex; flex-wrap: wrap; gap: 0.5em 3em; align-items: flex-start; }}
.row > div {{ max-width: 100%; }}
#setup .row > div:first-child {{ flex: 1 1 0; min-width: min(100%, 32em); }}
#headline {{ background: #f6f8fa; border: 1px solid #d8dee4; border-radius: 6px;
  padding: 0.2em 1.2em 0.8em; }}
#headline h2 {{ margin-top: 0.6em; }} #headline td.num {{ font-size: 1.1em; }}
.plots {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(min(100%, 38em), 1fr));
  gap: 1em 2em; }}
figure {{ margin: 0; }} img {{ display: block; width: 100%; height: auto; border: 1px solid #eee; }}
figcaption, .note {{ color: #555; font-size: 0.9em; }}
.scroll {{ overflow-x: auto; max-width: 100%; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p>{lead}</p>
<section id="headline">
<h2>At a glance</h2>
<div class="row">
{headline}
</div>
</section>
<section id="plots">
<h2>Plots</h2>
<div class="plots">
{figures}
</div>
</section>
<section id="setup">
<div class="row">
<div><h2>Configuration</h2>{config}</div>
<div><h2>Versions</h2>{versions}<h2>Machine</h2>{machine}</div>
</div>
</section>
<section id="numbers">
<h2>Numbers</h2>
<div class="scroll">
{numbers}
</div>
</section>
</body>
</html>
"""


def machine_info() -> dict[str, str]:
    """The machine a result was measured on."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu cores": str(os.cpu_count()),
    }
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory"] = f"{pages * page_size / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):
        info["memory"] = "unknown"
    import torch

    if torch.cuda.is_available():
        info["gpu"] = ", ".join(
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        )
    return info


def package_versions() -> dict[str, str]:
    """Versions of the optional packages that shaped a report."""
    out = {}
    for name in ("matplotlib", "prometheus_client"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every scalar leaf of a JSON value, with its dotted path (list items by index)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from flatten(item, f"{prefix}.{i}")
    else:
        yield prefix, value


def lookup(data: Any, path: str) -> Any:
    """The value at a dotted path (list items by index); None where the path leads nowhere."""
    value = data
    for key in path.split("."):
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


def format_value(value: Any) -> str:
    """How a JSON scalar reads in a table: ints with thousands separators, floats as JSON
    writes them, None as a dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return json.dumps(value)
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def table(rows: list[tuple[str, Any]], keyed: bool = False) -> str:
    """An HTML table of (name, value) rows; with ``keyed``, each value cell names its path."""
    out = ["<table>"]
    for key, value in rows:
        cls = ' class="num"' if _is_number(value) else ""
        attr = f' data-key="{html.escape(key)}"' if keyed else ""
        out.append(
            f"<tr><th>{html.escape(key)}</th><td{cls}{attr}>{html.escape(format_value(value))}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def value_cell(data: Any, path: str, prefix: str = "", percent: bool = False) -> str:
    """A cell showing the value at ``path`` of ``data``, named ``prefix + path``; ``percent``
    writes a number as a percentage (one decimal)."""
    value = lookup(data, path)
    text = f"{value:.1%}" if percent and _is_number(value) else format_value(value)
    cls = ' class="num"' if _is_number(value) else ""
    return f'<td{cls} data-key="{html.escape(prefix + path)}">{html.escape(text)}</td>'


def share_cell(data: Any, num: str, den: str, prefix: str = "") -> str:
    """A cell showing ``num / den`` (two paths of ``data``) as a percentage, naming both."""
    a, b = lookup(data, num), lookup(data, den)
    text = f"{a / b:.1%}" if _is_number(a) and _is_number(b) and b else "—"
    return (
        f'<td class="num" data-num="{html.escape(prefix + num)}" '
        f'data-den="{html.escape(prefix + den)}">{text}</td>'
    )


def grid(title: str, head: list[str], rows: list[list[str]], note: str = "") -> str:
    """A titled table: ``head`` are the column labels (plain text), ``rows`` the rows' cells (a
    plain-text label first, then cells from :func:`value_cell` / :func:`share_cell`)."""
    out = [f"<div><h3>{html.escape(title)}</h3><table>"]
    out.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>")
    for label, *cells in rows:
        out.append(f"<tr><th>{html.escape(label)}</th>{''.join(cells)}</tr>")
    out.append("</table>")
    if note:
        out.append(f'<p class="note">{html.escape(note)}</p>')
    out.append("</div>")
    return "\n".join(out)


def figure(src: str, caption: str) -> str:
    return (
        f'<figure><img src="{html.escape(src)}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def page(
    title: str, lead: str, data: dict[str, Any], headline: str, figures: list[str], numbers: str
) -> str:
    """The whole HTML page: the headline block, the figures, then header tables from ``data``'s
    config and versions, then ``numbers``."""
    versions = dict(data.get("versions", {})) | package_versions()
    return PAGE.format(
        title=html.escape(title),
        lead=html.escape(lead),
        headline=headline,
        figures="\n".join(figures),
        config=table(list(data.get("config", {}).items())),
        versions=table(list(versions.items())),
        machine=table(list(machine_info().items())),
        numbers=numbers,
    )
