"""Prometheus metrics of one engine, on a registry the caller owns (``kvstrata replay --metrics-port``).

:class:`CacheMetrics` is a custom collector: it holds no metric objects and costs the engine
nothing per step. A scrape takes the lock the replay loop holds around each engine step, reads the
engine's own counters between two steps (so one scrape is a consistent snapshot) and builds the
families below. Nothing is registered on ``prometheus_client``'s global registry.

=====================================================  ========================================
metric                                                 labels
=====================================================  ========================================
``kvstrata_pages_used``, ``kvstrata_pages_total``      ``tier`` (l1, l2), ``lane``
``kvstrata_hit_tokens_total``                          ``tier``: prompt tokens served by the tier
``kvstrata_moved_pages_total``, ``_moved_bytes_total``  ``direction`` (d2h, h2d): landed copies
``kvstrata_copies_in_flight``                          ``kind`` (backup, load)
``kvstrata_queue_depth``                               ``queue`` (waiting, running)
``kvstrata_backups_total``                             ``outcome`` (done, skipped, failed)
``kvstrata_load_backs_total``                          ``outcome`` (done, failed)
``kvstrata_load_back_wait_seconds_total``              (engine clock)
``kvstrata_requests_total``                            ``outcome`` (ok, failed): finished requests
``kvstrata_prompt_tokens_total``, ``_cached_tokens_total``, ``_computed_tokens_total``  of ok requests
``kvstrata_steps_total``, ``kvstrata_clock_seconds``   engine steps; the engine clock now
=====================================================  ========================================

With a disk tier, ``tier="l3"`` joins the page and hit families (its slots, one lane), and
``kvstrata_disk_total{event}`` (spills, reloads, reload misses, ...) and
``kvstrata_disk_store_total{counter}`` (the store's I/O, verification and GC counters) appear.
:func:`serve` exposes a registry over HTTP on one address (127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import ConfigError
from .tiers.tickets import TicketKind

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from .cache.allocator import PageAllocator
    from .engine import Engine

NAMESPACE = "kvstrata"


class RequestTotals(NamedTuple):
    """Finished requests so far, as the replay's summary counts them."""

    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int


def _require() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(
            "metrics need prometheus_client: pip install 'kvstrata[metrics]'"
        ) from None
    return prometheus_client


class CacheMetrics:
    """Collects ``engine``'s metrics (and the finished-request ``totals``) under ``lock``.

    Registers itself on ``registry``. ``lock`` must be held by whoever steps the engine.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        engine: Engine,
        lock: threading.Lock,
        totals: Callable[[], RequestTotals],
    ) -> None:
        _require()
        self.engine = engine
        self.lock = lock
        self.totals = totals
        self.cpu_s = 0.0  # CPU of every scrape so far: reading, and the exposition between yields
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        start = time.thread_time()
        try:
            with self.lock:
                families = self._read(CounterMetricFamily, GaugeMetricFamily)
            yield from families  # the exporter formats each family in this thread as it comes
        finally:
            self.cpu_s += time.thread_time() - start

    def _read(self, counter: Any, gauge: Any) -> list[Metric]:
        e = self.engine

        def fam(kind: Any, name: str, doc: str, labels: list[str] | None = None) -> Any:
            return kind(f"{NAMESPACE}_{name}", doc, labels=labels)

        used = fam(
            gauge, "pages_used", "Pages in use (cached, running or reserved).", ["tier", "lane"]
        )
        total = fam(gauge, "pages_total", "Pages of the tier's pool.", ["tier", "lane"])
        _lanes(used, total, "l1", e.cache.allocator)
        if e.cache.host_allocator is not None:
            _lanes(used, total, "l2", e.cache.host_allocator)
        hits = fam(counter, "hit_tokens", "Prompt tokens served from each tier.", ["tier"])
        for tier, tokens in e.hit_tokens.items():
            hits.add_metric([tier.name.lower()], tokens)
        pages = fam(counter, "moved_pages", "Pages copied between tiers (landed).", ["direction"])
        moved = fam(counter, "moved_bytes", "Bytes copied between tiers (landed).", ["direction"])
        stats = e.cache.transfer_stats()
        for direction in ("d2h", "h2d"):
            pages.add_metric([direction], getattr(stats, f"{direction}_pages") if stats else 0)
            moved.add_metric([direction], getattr(stats, f"{direction}_bytes") if stats else 0)
        flight = fam(gauge, "copies_in_flight", "Copy tickets not yet settled.", ["kind"])
        flight.add_metric(["backup"], e.cache.ledger.in_flight(TicketKind.BACKUP))
        flight.add_metric(["load"], e.cache.ledger.in_flight(TicketKind.LOAD))
        queue = fam(gauge, "queue_depth", "Requests waiting for admission / running.", ["queue"])
        queue.add_metric(["waiting"], len(e.waiting))
        queue.add_metric(["running"], len(e.running))
        backups = fam(counter, "backups", "L1 -> L2 backups by outcome.", ["outcome"])
        loads = fam(counter, "load_backs", "L2 -> L1 load-backs by outcome.", ["outcome"])
        b = e.cache.backups.stats if e.cache.backups is not None else None
        ld = e.cache.loads.stats if e.cache.loads is not None else None
        for outcome in ("done", "skipped", "failed"):
            backups.add_metric([outcome], getattr(b, outcome) if b else 0)
        loads.add_metric(["done"], ld.loads if ld else 0)
        loads.add_metric(["failed"], ld.failed if ld else 0)
        wait = fam(counter, "load_back_wait_seconds", "Engine clock spent waiting for load-back.")
        wait.add_metric([], e.load_wait_s)
        disk = self._disk(counter, used, total)
        t = self.totals()
        requests = fam(counter, "requests", "Finished requests by outcome.", ["outcome"])
        requests.add_metric(["ok"], t.requests - t.failed)
        requests.add_metric(["failed"], t.failed)
        out = [used, total, hits, pages, moved, flight, queue, backups, loads, wait, requests]
        for name, value in (
            ("prompt_tokens", t.prompt_tokens),
            ("cached_tokens", t.cached_tokens),
            ("computed_tokens", t.computed_tokens),
        ):
            c = fam(counter, name, f"{name.replace('_', ' ').capitalize()} of finished requests.")
            c.add_metric([], value)
            out.append(c)
        steps = fam(counter, "steps", "Engine steps.")
        steps.add_metric([], e.steps)
        clock = fam(gauge, "clock_seconds", f"The engine's {e.clock.kind} clock.")
        clock.add_metric([], e.clock.now())
        return [*out, steps, clock, *disk]

    def _disk(self, counter: Any, used: Any, total: Any) -> list[Metric]:
        """The tiers behind L2, when the engine has them: the disk's slots and the shared
        store's budget as tiers' pages, what the engine did with L3 (under the disk's name, or
        the shared store's in its place), and each store's own counters."""
        cache = self.engine.cache
        if cache.disk is None:
            return []
        tier = "disk" if cache.disk_store is not None else "remote"
        engine = counter(
            f"{NAMESPACE}_{tier}", f"What the engine did with the {tier} tier.", labels=["event"]
        )
        for name, value in asdict(cache.disk.stats).items():
            engine.add_metric([name], value)
        out = [engine]
        if cache.disk_store is not None:
            disk = cache.disk_store.stats()
            used.add_metric(["l3", "0"], disk.used_slots)
            total.add_metric(["l3", "0"], disk.num_slots)
            out.append(
                _store_counters(
                    counter, "disk", "The disk store's counters: I/O, verification failures, GC.",
                    disk.counters,
                )
            )  # fmt: skip
        if cache.remote is not None:  # its pages of this rank's budget
            remote = cache.remote.stats()
            used.add_metric(["remote", "0"], remote.used_bytes // remote.page_bytes)
            total.add_metric(["remote", "0"], remote.budget_bytes // remote.page_bytes)
            out.append(
                _store_counters(
                    counter, "remote", "The shared store's counters: hits, misses, verification "
                    "failures, timeouts, breaker opens, writes skipped.", remote.counters,
                )
            )  # fmt: skip
        return out


def _store_counters(counter: Any, tier: str, doc: str, counts: dict[str, int]) -> Any:
    own = counter(f"{NAMESPACE}_{tier}_store", doc, labels=["counter"])
    for name, value in sorted(counts.items()):
        own.add_metric([name], value)
    return own


def _lanes(used: Any, total: Any, tier: str, allocator: PageAllocator) -> None:
    cp, n = allocator.cp_size, allocator.num_pages
    free = allocator.free_per_lane()
    for lane in range(cp):
        size = (n - lane + cp - 1) // cp  # the allocator stripes page p into lane p % cp
        used.add_metric([tier, str(lane)], size - int(free[lane]))
        total.add_metric([tier, str(lane)], size)


def exposure_warning(host: str) -> str | None:
    """What to tell a user whose ``--metrics-host`` is not a loopback address (None when it is):
    the endpoint has no authentication, so every host that reaches this one reads it."""
    import ipaddress

    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:  # a host name: it resolves to whatever it resolves to
        pass
    return (
        f"--metrics-host {host} serves the metrics, without authentication, to every host that "
        "can reach this one; 127.0.0.1 (the default) keeps them on this machine"
    )


class MetricsServer:
    """A registry served over HTTP on ``host:port`` (0: a free port) until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        prometheus_client = _require()
        if not 0 <= port <= 65535:
            raise ConfigError(f"--metrics-port must lie in [0, 65535], got {port}")
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                port, addr=host, registry=registry
            )
        except OSError as err:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {err.strerror}; pick another "
                "--metrics-port (0: any free one)"
            ) from None
        self.host = host
        self.port = int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
