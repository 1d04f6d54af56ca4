"""The replay's run loop: one rank's replay (:func:`_run`), the loop that feeds the engine
(:func:`_drive`), and :func:`run_replay`, which starts one rank or several."""

from __future__ import annotations

import contextlib
import ctypes
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace

import torch

from .. import __version__
from ..clock import CpuClock, WallClock, make_clock
from ..dist.agree import agree_on_config
from ..dist.group import Group, SoloGroup
from ..dist.launch import run_ranks, run_torchrun, under_torchrun
from ..engine import Engine
from ..errors import ConfigError
from ..handoff import DirectoryTransport
from ..metrics import CacheMetrics, MetricsServer
from ..model.compute import Compute
from ..progress import Progress
from .build import build_compute, check_memory, compute_shape
from .config import ReplayConfig, model_id, uses_sim_clock
from .cost import resolve_cost, resolve_sizes
from .feed import Feed, open_workload
from .reports import VerifyReport
from .state import Driven, EngineTimer, ReplayObserver, ReplayRun, _Tally
from .summary import ReplaySummary, shown_url, summarize
from .verify import VerifySample, handoff_transport, send_handoffs, verify_sample

#: Engine steps between returns of freed heap memory to the OS (see :func:`release_free_heap`).
TRIM_EVERY_STEPS = 256


def run_replay(
    cfg: ReplayConfig,
    progress: bool = True,
    compute: Compute | None = None,
    observers: Sequence[ReplayObserver] = (),
) -> ReplaySummary:
    """Replay ``cfg.workload`` and return the summary (also used by tests and benchmarks).

    Requests enter the engine at their arrival time on the engine's clock (``cfg.arrivals``), and
    at most ``cfg.lookahead`` requests (default twice ``max_batch_requests``) are read ahead of
    the engine, counting those waiting and running; a finished request is folded into the
    summary's totals and dropped. Memory therefore holds the cache plus the requests in flight,
    whatever the workload's length. With ``cfg.metrics_port`` the engine's Prometheus metrics are
    served meanwhile.

    Runs with ``cfg.threads`` torch intra-op threads (restored afterwards). A KeyboardInterrupt
    while requests run ends the replay early: the summary covers the requests finished so far
    and says ``interrupted``.
    """
    cfg = resolve_sizes(cfg)  # sizes in GiB into tokens, before any rank starts
    if cfg.handoff_dir is not None and cfg.cp == 1 and not under_torchrun():
        raise ConfigError(
            "--handoff-dir is where context-parallel ranks hand their parts over; one rank "
            "hands over in memory: drop it or give --cp N"
        )
    if cfg.cp > 1 or under_torchrun():
        if compute is not None:
            raise ConfigError("a compute object cannot be shared by context-parallel ranks")
        if observers or cfg.metrics_port is not None:
            raise ConfigError(
                "--report and --metrics-port watch one engine; run them without context "
                "parallelism (--cp 1)"
            )
        if under_torchrun():  # this process is one rank of torchrun's world
            summary: ReplaySummary = run_torchrun(
                _rank_main, (cfg, progress), cfg.engine.device, cfg.cp_timeout_s
            )
            return summary
        with tempfile.TemporaryDirectory(prefix="kvstrata-handoff-") as tmp:
            if cfg.decode_tokens and cfg.handoff_dir is None:  # local ranks share this machine
                cfg = replace(cfg, handoff_dir=tmp)
            ranks = run_ranks(
                cfg.cp, _rank_main, (cfg, progress), cfg.engine.device, cfg.cp_timeout_s
            )
        summary = ranks[0]
        return summary
    return _rank_main(SoloGroup(), cfg, progress, compute, observers)


def _rank_main(
    group: Group,
    cfg: ReplayConfig,
    progress: bool,
    compute: Compute | None = None,
    observers: Sequence[ReplayObserver] = (),
) -> ReplaySummary:
    """One rank's replay (the only one without CP)."""
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, progress and group.rank == 0, compute, group, observers)
    finally:
        torch.set_num_threads(threads_before)


def _agree_on_config(group: Group, cfg: ReplayConfig) -> None:
    """Every rank must run the same configuration: compare them, naming a field that differs."""
    mine = {**asdict(cfg), "kvstrata": __version__, "torch": torch.__version__}
    # A store password is each rank's own business, and a mismatch message must not print it.
    url = shown_url(cfg.engine.remote_url)
    mine["engine"] = {**mine["engine"], "remote_url": url, "remote_password": None}
    agree_on_config(group, mine)


def _run(
    cfg: ReplayConfig,
    progress: bool,
    compute: Compute | None,
    group: Group,
    observers: Sequence[ReplayObserver] = (),
) -> ReplaySummary:
    """Check what can be checked, build the engine, replay, verify, summarise."""
    _agree_on_config(group, cfg)
    transport = handoff_transport(cfg, group) if cfg.decode_tokens else None
    shape = compute_shape(cfg, compute)
    # Under CP a request spreads over every rank's pool, so cp pools bound its length.
    pool_tokens = cfg.engine.pool_pages * cfg.engine.page_size * group.size
    source = open_workload(cfg, group, shape.vocab_size, min(shape.max_seq_len, pool_tokens))
    cost = resolve_cost(cfg, shape.layout.page_bytes(1)) if uses_sim_clock(cfg) else None
    check_memory(cfg, shape)
    compute = compute or build_compute(cfg)
    clock = (
        make_clock("sim", cfg.model, cost.coster, cost.byte_scale)
        if cost is not None
        else CpuClock()
        if cfg.clock == "cpu"
        else WallClock()
    )
    engine = Engine(compute, cfg.engine, group=group, clock=clock, model_id=model_id(cfg))
    sample = VerifySample(
        cfg.verify, cfg.seed, engine.keep_logits, engine.keep_handoff if cfg.decode_tokens else None
    )
    run = ReplayRun(cfg, engine, _Tally(), clock, threading.Lock(), cost=cost)
    try:
        with _serve_metrics(run):
            feed = Feed(group, source, cfg.seed, clock)
            total = source.workload.num_requests if source.workload is not None else None
            driven = _drive(cfg, run, feed, sample, observers, progress, total)
            for observer in observers:
                observer.on_end(run)
    finally:
        engine.close()  # the disk tier's threads and files
    verify = VerifyReport()
    if not driven.interrupted:
        send_handoffs(transport, sample)  # every rank hands its part of each sample
        if group.rank == 0:  # recomputing without the cache needs no peers
            try:
                verify = verify_sample(cfg, compute, sample, progress, transport)
            except KeyboardInterrupt:
                driven = driven._replace(interrupted=True)
    if group.rank == 0 and isinstance(transport, DirectoryTransport):
        transport.close()  # this run's subdirectory, and only its own parts
    return summarize(run, group, source, compute, driven, verify)


@contextlib.contextmanager
def _serve_metrics(run: ReplayRun) -> Iterator[None]:
    """With ``--metrics-port``: serve the engine's Prometheus metrics while the block runs."""
    cfg = run.config
    if cfg.metrics_port is None:
        yield
        return
    from prometheus_client import CollectorRegistry  # an extra: imported when asked for

    registry = CollectorRegistry()
    run.metrics = CacheMetrics(registry, run.engine, run.lock, run.tally.totals)
    server = MetricsServer(registry, cfg.metrics_host, cfg.metrics_port)
    run.metrics_url = server.url
    try:
        yield
    finally:
        server.close()


def _drive(
    cfg: ReplayConfig,
    run: ReplayRun,
    feed: Feed,
    sample: VerifySample,
    observers: Sequence[ReplayObserver],
    progress: bool,
    total: int | None,
) -> Driven:
    """The replay loop: how it ended, the time spent in the engine, the requests read.

    Each turn adds the requests that have arrived by now (the window permitting), then runs one
    engine step; with nothing to run it lets the clock pass to the next arrival. Engine time is
    spent in the engine (adding requests hashes them; stepping), not in reading or generating the
    workload, nor idling between arrivals.
    """
    engine, tally, clock, lock = run.engine, run.tally, run.clock, run.lock
    lookahead = cfg.lookahead or 2 * cfg.engine.max_batch_requests
    read = 0  # requests added to the engine
    timer = EngineTimer()
    interrupted = False
    # Arrivals count from here, when the engine can take requests: building it (the pools; a
    # pinned L2 of tens of GiB takes seconds on CUDA) is start-up, not queueing.
    run.startup_s = clock.start()
    for observer in observers:
        observer.on_start(run)
    try:
        with Progress("replay", total, enabled=progress) as bar:
            while True:
                with lock:
                    want = lookahead - (read - tally.requests)
                    wake = None
                    if feed.more and want > 0:
                        batch, wake = feed.take(want, idle=not engine.has_work())
                        read += len(batch)
                        added = clock.now()
                        timer.start()
                        while batch:  # hand each request over and drop it: none outlives it
                            request, arrived_at = batch.pop(0)
                            sample.offer(request)
                            engine.add(request, arrived_at)
                            del request
                        timer.stop()
                        run.add_s += clock.now() - added
                    if not engine.has_work():
                        if wake is None and not feed.more:
                            break
                        if wake is not None:
                            idle = clock.now()
                            clock.wait_until(wake)  # idle: let time pass to the next arrival
                            run.idle_s += clock.now() - idle
                        continue
                    began = clock.now()
                    timer.start()
                    done = engine.step()
                    timer.stop()
                    run.step_span = (began, clock.now())
                if engine.steps % TRIM_EVERY_STEPS == 0:
                    release_free_heap()
                for f in done:
                    tally.add(f)
                    sample.collect(f)
                for observer in observers:
                    observer.on_step(run)
                bar.update(len(done), sum(f.computed_len for f in done))
    except KeyboardInterrupt:
        interrupted = True
    if not interrupted:
        with lock:
            timer.start()
            engine.drain()  # settle the copies still in flight, so the tiers report final state
            timer.stop()
    return Driven(interrupted, timer, read)


def release_free_heap() -> None:
    """Hand memory that glibc's allocator keeps after frees back to the OS (``malloc_trim``).

    A long replay allocates and frees token, key and page arrays of every size; glibc keeps the
    freed blocks and peak RSS creeps up with the trace's length although live data stays flat
    (docs/benchmarks.md, "Streamed replay memory"). No-op where the C library has no
    ``malloc_trim``.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()
