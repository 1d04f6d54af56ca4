"""The peer of ``kvstrata bench radix``: SGLang's Rust token tree, run as a separate binary.

``peers/sglang-tree`` builds ``sglang-tree-bench``, which replays a dumped workload through
SGLang's ``TokenTree`` (the ``kv_index`` crate the SGLang router grew into) the way
:func:`kvstrata.benchmarks.radix.replay` replays it through kvstrata's tree: match, insert the
whole request, and evict LRU through the tree's own size-based eviction down to 90 % whenever it
holds more than the budget; one tenant; only the tree calls timed. It prints one JSON line, read
here into :class:`PeerStats`.

This module finds the binary, writes the dump it reads, and runs it; :mod:`.radix` alternates its
rounds with kvstrata's.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, PeerError

_CRATE = Path(__file__).resolve().parents[3] / "peers" / "sglang-tree"
#: Where ``cargo build --release`` in ``peers/sglang-tree`` puts the peer.
DEFAULT_PEER = _CRATE / "target" / "release" / "sglang-tree-bench"
#: How to build it from the repository root (``scripts/setup.sh`` runs the same).
BUILD_COMMAND = "cd peers/sglang-tree && python fetch_source.py && cargo build --release"
#: A replay of the default workload takes well under a second; a hung peer must not hang the bench.
_TIMEOUT_S = 600


@dataclass(frozen=True)
class PeerStats:
    """One peer run at one page size: the budgeted replay, and the no-eviction replay's checksum."""

    tree: str
    page_size: int
    requests: int
    requests_per_s: float
    match_us: float
    insert_us: float
    evictions: int
    matched_checksum: str
    noevict_requests_per_s: float
    noevict_matched_checksum: str


def find_peer(path: str | None) -> tuple[Path | None, str | None]:
    """``(binary, None)``, or ``(None, why there is none)`` when the default binary is not built.

    An explicit ``path`` that is not an executable file is a :class:`ConfigError`: the user asked
    for that peer.
    """
    if path is None:
        if os.access(DEFAULT_PEER, os.X_OK):
            return DEFAULT_PEER, None
        return None, f"the peer is not built ({DEFAULT_PEER}); build it with: {BUILD_COMMAND}"
    binary = Path(path)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise ConfigError(
            f"--peer {path!r} is not an executable file; give the sglang-tree-bench binary "
            f"(built by: {BUILD_COMMAND}) or leave --peer out"
        )
    return binary, None


def write_dump(requests: list[npt.NDArray[np.uint32]], path: Path) -> None:
    """The peer's input: per request a uint32 LE length, then its uint32 LE tokens."""
    with path.open("wb") as f:
        for r in requests:
            f.write(np.uint32(r.size).astype("<u4").tobytes())
            f.write(r.astype("<u4", copy=False).tobytes())


def run_peer(binary: Path, dump: Path, page_size: int, budget_tokens: int) -> PeerStats:
    """Run the peer once on ``dump``; a failed run or an unreadable result is a :class:`PeerError`."""
    argv = [str(binary), "--dump", str(dump), "--page-size", str(page_size)]
    argv += ["--budget", str(budget_tokens)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PeerError(f"peer {binary} did not run: {err}") from err
    if done.returncode != 0:
        raise PeerError(
            f"peer {binary} exited with status {done.returncode}: "
            f"{done.stderr.strip() or done.stdout.strip()}"
        )
    lines = done.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
        stats = PeerStats(**{k: out[k] for k in PeerStats.__dataclass_fields__})
    except (IndexError, ValueError, KeyError, TypeError) as err:
        raise PeerError(f"peer {binary} printed no result line: {done.stdout[-300:]!r}") from err
    if stats.page_size != page_size:
        raise PeerError(f"peer {binary} ran page size {stats.page_size}, asked for {page_size}")
    return stats
