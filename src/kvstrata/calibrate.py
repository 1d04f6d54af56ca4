"""``kvstrata calibrate``: fit a :class:`~kvstrata.cost.CostProfile` to the real engine.

Drives the engine with a model through a designed set of steps and times each one (wall clock
around :meth:`Engine.step`, which on CUDA ends with a device synchronize, so the time is the
step's whole cost as a replay pays it):

* fresh prefills of several lengths, one request a step;
* chunks over cached prefixes (a prefix computed first, then an extend that hits it);
* batches of several requests in one step;
* with an L2 (``l2_tokens``): prefills whose chunks are backed up device -> host as each layer
  finishes, and hits whose prefix is loaded back host -> device after L1 evicted it.

Each design point runs ``repeats`` times with fresh token ids (nothing hits by accident) and
the fastest run counts (noise only adds time). On the CPU a step's time is the engine thread's
CPU time (``time.thread_time``; the engine runs on that one thread), which other processes on a
shared machine disturb far less than the wall clock; on CUDA it is the wall time. The compute terms (per step, per request, per token, per attention pair) are
fitted by least squares on the steps without copies, weighted so each step counts by its
relative error (a 2 ms step matters as much as a 2 s one), with no term allowed below zero; the
link rates are then fitted on the steps that copy, holding the compute terms. A held-back set
of other shapes (lengths, prefixes and batch mixes the fit never saw) is timed the same way and
predicted by the profile: the table shows every step's measured and predicted time, and the
profile's provenance records both sets' errors. Disk rates stay at the device's measured ``dd``
defaults (``cost.DISK_DEFAULTS``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

import numpy as np
import torch

from . import __version__
from .clock import StepWork
from .cost import DISK_DEFAULTS, CostProfile, Provenance
from .engine import Engine, EngineConfig
from .errors import ConfigError
from .limits import check_device
from .model.compute import ModelCompute
from .model.loader import load_model, read_model_config
from .workloads import Request

#: Scenario kinds, in the order the table prints them.
KINDS = ("fresh", "prefix", "batch", "backup", "load-back")


@dataclass(frozen=True)
class Point:
    """One design point: ``batch`` requests with ``prefix`` cached tokens each (computed in an
    unmeasured step first) and ``extend`` new ones, in one measured step."""

    kind: str
    extend: tuple[int, ...]
    prefix: tuple[int, ...] = ()
    held_back: bool = False

    @property
    def prefixes(self) -> tuple[int, ...]:
        return self.prefix or (0,) * len(self.extend)


@dataclass(frozen=True)
class Sample:
    """A design point's measured step: what it did and its fastest seconds."""

    point: Point
    work: StepWork
    seconds: float  # the fastest of the repeats
    spread: float  # (slowest - fastest) / fastest over the repeats


def prefix_lengths(max_tokens: int, max_prefix: int) -> tuple[int, ...]:
    """The cached prefixes the design's chunks extend: a quarter of ``max_tokens``, then
    ``max_tokens`` times 4, 16, ... below ``max_prefix``, then ``max_prefix`` (by default twice
    ``max_tokens``: m/4, m, 2m)."""
    out, p = [max_tokens // 4], max_tokens
    while p < max_prefix:
        out.append(p)
        p *= 4
    return (*out, max_prefix)


def design(max_tokens: int, with_l2: bool, max_prefix: int | None = None) -> list[Point]:
    """The design set, scaled to ``max_tokens`` (the longest fresh prefill) and ``max_prefix``
    (the longest cached prefix; default twice ``max_tokens``), and the held-back points (other
    shapes, never fitted)."""
    m = max_tokens
    longest = 2 * m if max_prefix is None else max_prefix
    pts = [Point("fresh", (n,)) for n in (m // 32, m // 16, m // 8, m // 4, m // 2, m)]
    pts += [
        Point("prefix", (e,), (p,))
        for p in prefix_lengths(m, longest)
        for e in (m // 64, m // 8, m // 2)
    ]
    pts += [Point("batch", (n,) * k) for k in (2, 8, 32) for n in (m // 64, m // 16)]
    # What a replay's steps mostly are: several requests' chunks, each over its own prefix.
    spread = prefix_lengths(m, longest)[1:]
    pts += [Point("batch", (m // 4,) * 4, (p // 8, p // 4, p // 2, p)) for p in spread]
    pts += [Point("batch", (m // 4,) * 2, (p // 2, p)) for p in spread]
    pts += [
        Point("fresh", (3 * m // 8,), held_back=True),
        Point("fresh", (3 * m // 4,), held_back=True),
        Point("prefix", (m // 16,), (3 * m // 2,), held_back=True),
        Point("prefix", (m // 4,), (m // 2,), held_back=True),
        Point("batch", (m // 32,) * 4, held_back=True),
        Point("batch", (m // 32,) * 16, held_back=True),
        Point("batch", (m // 32,) * 3, (m // 4, m // 2, m), held_back=True),
        Point("batch", (m // 8, m // 64, m // 16), held_back=True),
    ]
    if longest > 2 * m:  # chunks over prefixes longer than the default design's
        pts += [
            Point("prefix", (m // 4,), (3 * longest // 4,), held_back=True),
            Point("batch", (m // 8,) * 3, (longest // 8, longest // 4, longest // 2),
                  held_back=True),
        ]  # fmt: skip
    if with_l2:
        pts += [Point("backup", (n,)) for n in (m // 8, m // 2, m)]
        pts += [Point("load-back", (m // 64,), (p,)) for p in (m // 2, m, 2 * m)]
        pts += [
            Point("backup", (m // 4,), held_back=True),
            Point("load-back", (m // 16,), (3 * m // 2,), held_back=True),
        ]
    return pts


class _Rig:
    """An engine over the model, and fresh token ids for every request."""

    def __init__(self, compute: ModelCompute, config: EngineConfig, seed: int) -> None:
        self.engine = Engine(compute, config, model_id="calibrate")
        self.vocab = compute.vocab_size
        self.rng = np.random.default_rng(seed)
        self.rid = 0
        cuda = torch.device(config.device).type == "cuda"
        self.sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        # On CUDA the step's wall time (it ends with a device synchronize); on the CPU, where the
        # engine runs on this one thread, its CPU time: what the step costs, without the waits
        # for a core that other processes add on a shared machine.
        self.clock = time.perf_counter if cuda else time.thread_time

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab, n, dtype=np.int64).astype(np.uint32)

    def run(self, requests: list[np.ndarray]) -> list[tuple[StepWork, float]]:
        """Add ``requests`` and step until they finish; each forward step's work and seconds."""
        for tokens in requests:
            self.engine.add(Request(self.rid, tokens), arrived_at=0.0)
            self.rid += 1
        out = []
        while self.engine.has_work():
            self.sync()
            t0 = self.clock()
            self.engine.step()
            seconds = self.clock() - t0
            if self.engine.last_work.requests:
                out.append((self.engine.last_work, seconds))
        self.engine.drain()
        return out

    def measure(self, point: Point) -> tuple[StepWork, float]:
        """One run of ``point``: its prefixes computed (unmeasured), then the measured step."""
        prefixes = [self.tokens(p) for p in point.prefixes]
        if point.kind == "load-back":
            self.run([prefixes[0]])
            self.run([self.tokens(self.engine.config.pool_tokens - 2 * 16)])  # evicts it from L1
        elif any(point.prefix):
            self.run([p for p in prefixes if p.size])
        steps = self.run(
            [
                np.concatenate([p, self.tokens(e)])
                for p, e in zip(prefixes, point.extend, strict=True)
            ]
        )
        if len(steps) != 1:
            raise AssertionError(f"{point}: ran in {len(steps)} steps, not one")
        return steps[0]


def fit_compute(
    works: list[StepWork], seconds: list[float]
) -> tuple[float, float, float, float, float, float]:
    """Least squares on relative error with every term >= 0: drop a negative term, refit.
    The terms: per step, request, token, pair of a request without a prefix, pair of one over a
    prefix, cached prefix token."""
    x = np.array(
        [
            [
                1.0,
                w.requests,
                w.computed_tokens,
                w.attention_pairs - w.prefix_pairs,
                w.prefix_pairs,
                w.prefix_tokens,
            ]
            for w in works
        ]
    )
    y = np.array(seconds)
    w = x / y[:, None]
    active = [0, 1, 2, 3, 4, 5]
    while True:
        coef, *_ = np.linalg.lstsq(w[:, active], np.ones(len(y)), rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(6)
    full[active] = np.maximum(coef, 0.0)
    return tuple(float(v) for v in full)  # type: ignore[return-value]


def _fit_rate(
    profile: CostProfile, samples: list[Sample], name: str
) -> tuple[CostProfile, list[Sample]]:
    """``profile`` with the link rate ``name`` that best predicts ``samples`` (relative error),
    searched over 0.01-1,000 GB/s on a log grid, then refined."""
    if not samples:
        return profile, samples

    def loss(rate: float) -> float:
        p = replace(profile, **{name: rate})  # type: ignore[arg-type]
        return sum(((predict(p, s.work) - s.seconds) / s.seconds) ** 2 for s in samples)

    grid = np.logspace(-2, 3, 101)
    best = float(grid[int(np.argmin([loss(float(g)) for g in grid]))])
    fine = best * np.logspace(-0.05, 0.05, 41)
    best = float(fine[int(np.argmin([loss(float(g)) for g in fine]))])
    return replace(profile, **{name: round(best, 4)}), samples  # type: ignore[arg-type]


def predict(profile: CostProfile, work: StepWork) -> float:
    """What ``profile`` charges a step that did ``work`` (compute and links; a wait for the disk
    depends on the steps before, and is not included)."""
    return profile.step(
        work.requests,
        work.computed_tokens,
        work.attention_pairs,
        work.h2d_bytes,
        work.d2h_bytes,
        work.prefix_tokens,
        work.prefix_pairs,
    )[0]


@dataclass(frozen=True)
class Calibration:
    profile: CostProfile
    samples: list[Sample]

    def errors(self, held_back: bool) -> list[float]:
        return [
            abs(predict(self.profile, s.work) - s.seconds) / s.seconds
            for s in self.samples
            if s.point.held_back == held_back
        ]

    def table(self) -> str:
        head = (
            f"{'set':<5} {'kind':<9} {'req':>4} {'tokens':>7} {'pairs M':>9} {'h2d MB':>8} "
            f"{'d2h MB':>8} {'measured ms':>11} {'predicted ms':>12} {'error':>7} {'spread':>6}"
        )
        lines = [head, "-" * len(head)]
        order = sorted(self.samples, key=lambda s: (s.point.held_back, KINDS.index(s.point.kind)))
        for s in order:
            w, pred = s.work, predict(self.profile, s.work)
            lines.append(
                f"{'held' if s.point.held_back else 'fit':<5} {s.point.kind:<9} {w.requests:>4} "
                f"{w.computed_tokens:>7,} {w.attention_pairs / 1e6:>9.2f} {w.h2d_bytes / 1e6:>8.2f} "
                f"{w.d2h_bytes / 1e6:>8.2f} {s.seconds * 1e3:>11.2f} {pred * 1e3:>12.2f} "
                f"{(pred - s.seconds) / s.seconds:>+7.1%} {s.spread:>6.0%}"
            )
        return "\n".join(lines)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {os.cpu_count()} cores, {platform.processor() or platform.machine()}"


def calibrate(
    model: str = "tiny",
    device: str = "cpu",
    dtype: str | None = None,
    page_size: int = 16,
    max_tokens: int | None = None,
    l2_tokens: int | None = None,
    repeats: int = 5,
    max_prefix: int | None = None,
    seed: int = 0,
    name: str | None = None,
    threads: int = 1,
    progress: Callable[[str], None] | None = None,
    command: str = "",
) -> Calibration:
    """Time the design set on ``model`` and fit a profile (see the module docstring).
    ``max_tokens``: the longest fresh prefill (default 2,048 on CPU, 16,384 on CUDA);
    ``max_prefix``: the longest cached prefix a designed chunk extends (default 2 x
    ``max_tokens``; a replay's chunks reach its longest prompts);
    ``l2_tokens``: the L2 of the link steps (default: enough for them; 0: no link steps);
    ``threads``: torch's intra-op threads meanwhile (1, as ``kvstrata replay`` runs)."""
    cores = os.cpu_count() or 1
    if not 1 <= threads <= cores:
        raise ConfigError(
            f"--threads must lie in [1, {cores}] (this machine's cores), got {threads}"
        )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _calibrate(
            model, device, dtype, page_size, max_tokens, l2_tokens, repeats, seed, name,
            threads, progress, command, max_prefix,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)


def _calibrate(
    model: str,
    device: str,
    dtype: str | None,
    page_size: int,
    max_tokens: int | None,
    l2_tokens: int | None,
    repeats: int,
    seed: int,
    name: str | None,
    threads: int,
    progress: Callable[[str], None] | None,
    command: str,
    max_prefix: int | None = None,
) -> Calibration:
    dev = check_device(device)
    if not 1 <= repeats <= 1000:
        raise ConfigError(f"--repeats must lie in [1, 1000], got {repeats}")
    if not 0 <= seed < 2**63:
        raise ConfigError(f"--seed must lie in [0, 2**63), got {seed}")
    if not 1 <= page_size <= 4096:
        raise ConfigError(f"--page-size must lie in [1, 4096], got {page_size}")
    m = max_tokens or (16_384 if dev.type == "cuda" else 2_048)
    if not 64 * page_size <= m <= 1 << 20 or m % 64:
        raise ConfigError(
            f"--max-tokens must be a multiple of 64 in [{64 * page_size} (64 pages), 1048576], "
            f"got {m}"
        )
    if max_prefix is not None and not 2 * m <= max_prefix <= 1 << 22:
        raise ConfigError(
            f"--max-prefix must lie in [{2 * m} (2 x --max-tokens), 4194304], got {max_prefix}"
        )
    if l2_tokens is not None and not 0 <= l2_tokens <= 1 << 26:
        raise ConfigError(f"--l2-tokens must lie in [0, 67108864], got {l2_tokens}")
    with_l2 = l2_tokens != 0
    points = design(m, with_l2, max_prefix)
    sequence = max(q + e for p in points for q, e in zip(p.prefixes, p.extend, strict=True))
    positions = read_model_config(model).max_position_embeddings
    if sequence > positions:
        raise ConfigError(
            f"the design's longest sequence ({sequence:,} tokens: --max-prefix plus a chunk) "
            f"exceeds {model}'s {positions:,} positions; lower --max-prefix"
        )
    _, net = load_model(model, device=device, dtype=dtype, seed=seed)
    torch_dtype = next(net.parameters()).dtype
    compute = ModelCompute(net, torch_dtype)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    batch_tokens = max(sum(p.extend) for p in points)
    longest = max(sum(p.prefixes) + sum(p.extend) for p in points)
    base = EngineConfig(
        page_size=page_size,
        pool_tokens=max(8 * m, -(-2 * longest // page_size) * page_size),
        chunk_size=m,
        max_batch_tokens=batch_tokens,
        max_batch_requests=64,
        device=device,
    )
    # The link steps: an L1 that holds one long request, so the next one evicts it to L2.
    link = replace(base, pool_tokens=3 * m, l2_tokens=l2_tokens or 16 * m)
    rigs = {
        False: _Rig(compute, base, seed),
        True: _Rig(compute, link, seed + 1) if with_l2 else None,
    }
    for rig in rigs.values():  # warm up: allocator, kernels, autotuning
        if rig is not None:
            for _ in range(2):
                rig.run([rig.tokens(m // 4)] * 1 + [rig.tokens(m // 64)] * 4)
    # Measured in a seeded shuffle of the design, so that a change of the machine's load during
    # the run falls on fitted and held-back steps alike (in design order the held-back ones come
    # last, and a busier end read as a 30 % error); the samples keep the design's order.
    order = [int(i) for i in np.random.default_rng(seed).permutation(len(points))]
    measured: dict[int, Sample] = {}
    for n, i in enumerate(order):
        point = points[i]
        rig = rigs[point.kind in ("backup", "load-back")]
        assert rig is not None
        runs = [rig.measure(point) for _ in range(repeats)]
        times = [t for _, t in runs]
        best = min(times)  # noise only ever adds time
        measured[i] = Sample(point, runs[0][0], best, (max(times) - best) / best)
        if progress is not None:
            progress(f"calibrate: step {n + 1} of {len(points)}: {point.kind} {best * 1e3:.1f} ms")
    samples = [measured[i] for i in range(len(points))]
    fit = [s for s in samples if not s.point.held_back]
    plain = [s for s in fit if s.point.kind in ("fresh", "prefix", "batch")]
    step_s, request_s, token_s, pair_s, prefix_pair_s, prefix_s = fit_compute(
        [s.work for s in plain], [s.seconds for s in plain]
    )
    read, write = DISK_DEFAULTS[dev.type]
    profile = CostProfile(
        name=name or f"{dev.type}-{os.path.basename(model)}-{dtype_name}",
        kind="calibrated",
        step_s=step_s,
        request_s=request_s,
        token_s=token_s,
        pair_s=pair_s,
        prefix_s=prefix_s,
        prefix_pair_s=prefix_pair_s,
        h2d_gbps=1.0,
        d2h_gbps=1.0,
        disk_read_gbps=read,
        disk_write_gbps=write,
        overlap="serial" if dev.type == "cpu" else "layered",
        num_layers=net.config.num_layers,
        kv_bytes_per_token=compute.layout.page_bytes(1),
        provenance=Provenance(device="", device_kind=dev.type, model=model, dtype=dtype_name,
                              page_size=page_size),
    )  # fmt: skip
    profile, _ = _fit_rate(profile, [s for s in fit if s.point.kind == "backup"], "d2h_gbps")
    profile, _ = _fit_rate(profile, [s for s in fit if s.point.kind == "load-back"], "h2d_gbps")
    cal = Calibration(profile, samples)
    fitted, held = cal.errors(False), cal.errors(True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0
    provenance = Provenance(
        device=_device_name(dev),
        device_kind=dev.type,
        model=model,
        dtype=dtype_name,
        page_size=page_size,
        versions={
            "kvstrata": __version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        date=datetime.now().isoformat(timespec="seconds"),
        fit_error={
            "mean": round(statistics.fmean(fitted), 4),
            "max": round(max(fitted), 4),
            "held_back_mean": round(statistics.fmean(held), 4),
            "held_back_max": round(max(held), 4),
        },
        steps=len(samples),
        command=command,
        note=(
            f"max_tokens {m}, max_prefix {max_prefix or 2 * m}, repeats {repeats}, threads {threads}, load average {load:.1f} at the "
            "end; disk rates: "
            f"dd defaults for {dev.type}"
        ),
    )
    return Calibration(replace(profile, provenance=provenance), samples)
