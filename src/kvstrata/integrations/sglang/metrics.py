"""The SGLang backend's counters, and the ``StorageMetrics`` shape SGLang's collector logs.

SGLang's ``StorageMetricsCollector.log_storage_metrics`` takes a ``StorageMetrics`` with four
lists since its last call: pages per prefetch and per backup call, and each call's GB/s (bytes of
the pages moved over the call's wall time; wall time is only measured here, never decides
anything). The cumulative counters ride along as ``.kvstrata`` for anyone who reads them.
"""

from __future__ import annotations

import threading
from typing import Any

COUNTERS = (
    "exists_calls",
    "exists_pages",  # keys asked about
    "exists_hits",  # keys found (the leading run)
    "exists_remote",  # keys of that run found in the shared tier, not on disk
    "get_calls",
    "get_pages",  # pages asked for
    "get_hits",  # pages read, verified and copied into host memory
    "get_remote_hits",  # those of them read from the shared tier (the rest: from disk)
    "set_calls",
    "set_pages",  # pages offered for backup
    "set_durable",  # pages durable on disk when the call returned (written now or before)
    "set_refused",  # pages of a call the store refused (closing, or too many in flight)
    "set_timeouts",  # pages of a call that did not finish within io_timeout_s
    "set_not_writer",  # pages offered to a rank that only reads (MLA, not the writer)
)


class BackendCounters:
    """Cumulative counts and per-call figures since the last :meth:`drain`, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(COUNTERS, 0)
        self._calls: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "prefetch_bandwidth": [],
            "backup_pgs": [],
            "backup_bandwidth": [],
        }

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._n[name] += n

    def _call(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._calls[f"{kind}_pgs"].append(pages)
            self._calls[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def prefetched(self, pages: int, nbytes: int, seconds: float) -> None:
        self._call("prefetch", pages, nbytes, seconds)

    def backed_up(self, pages: int, nbytes: int, seconds: float) -> None:
        self._call("backup", pages, nbytes, seconds)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)

    def drain(self) -> dict[str, list[float]]:
        """The per-call figures since the last drain (and forget them)."""
        with self._lock:
            out = {k: list(v) for k, v in self._calls.items()}
            for v in self._calls.values():
                v.clear()
        return out


def storage_metrics(calls: dict[str, list[float]], counters: dict[str, int]) -> Any:
    """SGLang's ``StorageMetrics`` of ``calls`` (from :meth:`BackendCounters.drain`), with
    ``counters`` attached as ``.kvstrata``."""
    # SGLang's collector module imports its whole config tree; the server has it loaded anyway.
    from sglang.srt.observability.metrics_collector import StorageMetrics

    metrics = StorageMetrics(
        prefetch_pgs=[int(x) for x in calls["prefetch_pgs"]],
        backup_pgs=[int(x) for x in calls["backup_pgs"]],
        prefetch_bandwidth=calls["prefetch_bandwidth"],
        backup_bandwidth=calls["backup_bandwidth"],
    )
    metrics.kvstrata = counters
    return metrics
