"""Tier-to-tier copy benchmark (``kvstrata bench transfer``).

One layer's batched copy of ``--pages`` pages at random, non-contiguous slots, device pool to host
pool (d2h) and back (h2d), through :class:`~kvstrata.tiers.transfer.Transfer`, for a GQA geometry (K and
V, 8 KV heads x 128, bf16) and an MLA geometry (one 576-wide bf16 latent), in both host layouts.
Each timed copy is set against a contiguous copy of the same bytes between a device tensor and a
pinned host tensor, measured alternately in the same run: ``ratio`` is how close the batched
gather/scatter comes to the copy engine's straight line.

Before timing, every case checks its copies byte for byte (d2h, then h2d into other slots).
``ms``, ``GB/s`` and ``ratio`` are device time (CUDA events; both copies timed the same way);
``wall GB/s`` is host wall clock from submit to ``torch.cuda.synchronize``, so launch and index
upload are included; ``submit us`` is the submitting call alone (the copy itself is async and,
in the engine, overlaps the forward). ``--sweep`` also times a grid of kernel launch shapes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..command import CommandParser, HelpFormatter, run_command
from ..config import KVLayout, PayloadSpec
from ..errors import ConfigError
from ..limits import check_device, check_fits
from ..tiers.host_pool import HOST_LAYOUTS, HostLayout, HostPool
from ..tiers.pool import DevicePool
from ..tiers.transfer import Direction, Transfer
from ..tiers.transfer_kernel import KernelConfig

DIRECTIONS: tuple[Direction, ...] = ("d2h", "h2d")
_SPIN_CYCLES = 20_000_000  # about 10 ms at H200 clocks, far longer than one submission
SWEEP = [
    KernelConfig(b, w, i, p)
    for b in (1024, 2048, 4096)
    for w in (4, 8)
    for i in (1, 4)
    for p in (32, None)
]
GEOMETRIES = {
    "gqa": (PayloadSpec("k", (8, 128), "bfloat16"), PayloadSpec("v", (8, 128), "bfloat16")),
    "mla": (PayloadSpec("kv_latent", (576,), "bfloat16"),),
}


@dataclass
class Row:
    geometry: str
    layout: str
    direction: str
    pages: int
    bytes: int
    ms: float
    gbps: float
    contiguous_gbps: float
    ratio: float
    wall_gbps: float
    submit_us: float
    verified: bool
    kernel: str


class _Case:
    """Pools, slots and a Transfer for one geometry and host layout."""

    def __init__(
        self, args: argparse.Namespace, device: torch.device, dev: DevicePool, host: HostPool
    ) -> None:
        self.args, self.device, self.dev, self.host = args, device, dev, host
        gen = torch.Generator().manual_seed(args.seed)
        n = args.pages
        perm = torch.randperm(dev.num_slots, generator=gen)
        self.src_slots, self.dst_slots = perm[:n], perm[n : 2 * n]  # disjoint device slot sets
        self.host_slots = torch.randperm(host.num_slots, generator=gen)[:n]
        self.tickets = itertools.count()
        self.layer = args.layer
        self.layer_bytes = n * dev.page_size * sum(p.token_bytes for p in dev.layout.payloads)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def copy(self, t: Transfer, direction: Direction) -> float:
        """Submit one layer's copy and close it; returns the submit time in seconds."""
        ticket = next(self.tickets)
        t0 = time.perf_counter()
        if direction == "d2h":
            t.d2h(ticket, self.layer, self.src_slots, self.host_slots)
        else:
            t.h2d(ticket, self.layer, self.host_slots, self.dst_slots)
        t.close(ticket, 1)
        return time.perf_counter() - t0

    def reap(self, t: Transfer) -> None:
        """Collect the completions of copies already synchronised; a failed one stops the run."""
        for done in t.poll():
            if not done.ok:
                raise RuntimeError(f"copy failed: {done.error}")
        assert t.stats().in_flight_tickets == 0, "a synchronised copy must have completed"

    def verify(self, t: Transfer) -> bool:
        """d2h then h2d into other device slots; every byte must arrive."""
        for spec in self.dev.layout.payloads:
            self.dev.buffer(spec.name, self.layer).view(torch.uint8).random_(0, 256)
        self.copy(t, "d2h")
        self.sync()
        self.reap(t)
        ok = True
        for spec in self.dev.layout.payloads:
            want = self.dev.buffer(spec.name, self.layer).index_select(
                0, self.src_slots.to(self.device)
            )
            got = torch.stack(
                [self.host.page(spec.name, self.layer, int(s)) for s in self.host_slots]
            )
            ok &= torch.equal(got.view(torch.uint8), want.cpu().view(torch.uint8))
        self.copy(t, "h2d")
        self.sync()
        self.reap(t)
        for spec in self.dev.layout.payloads:
            buf = self.dev.buffer(spec.name, self.layer)
            a = buf.index_select(0, self.src_slots.to(self.device)).view(torch.uint8)
            b = buf.index_select(0, self.dst_slots.to(self.device)).view(torch.uint8)
            ok &= torch.equal(a, b)
        return bool(ok)

    def baseline(self) -> dict[Direction, Callable[[], None]]:
        """Contiguous copies of the same bytes: one device tensor <-> one pinned host tensor per
        payload."""
        n, pin = self.args.pages, self.device.type == "cuda"
        pairs = []
        for spec in self.dev.layout.payloads:
            src = self.dev.buffer(spec.name, self.layer)[:n]
            pairs.append((src, torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)))

        def d2h() -> None:
            for d, h in pairs:
                h.copy_(d, non_blocking=True)

        def h2d() -> None:
            for d, h in pairs:
                d.copy_(h, non_blocking=True)

        return {"d2h": d2h, "h2d": h2d}

    def _device_s(self, submit: Callable[[], torch.cuda.Stream | None]) -> float:
        """Device seconds of the work ``submit`` enqueues (it returns the stream the work ends
        on). The current stream first spins, so that the whole submission is queued before the
        copy may start: host submission cost stays out, queueing gaps cannot get in."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            submit()
            return time.perf_counter() - t0
        self.sync()
        torch.cuda._sleep(_SPIN_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record(submit())
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def measure(
        self, t: Transfer, direction: Direction, base: Callable[[], None], repeats: int
    ) -> dict[str, float]:
        """Medians, in seconds: the batched copy and the contiguous copy on the device, the
        batched copy from submit to synchronize on the host, and the submit call alone."""
        stream = t.stream(direction)
        samples: dict[str, list[float]] = {"ours": [], "theirs": [], "wall": [], "submit": []}

        def contiguous() -> torch.cuda.Stream | None:
            base()
            return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def batched() -> torch.cuda.Stream | None:
            self.copy(t, direction)
            return stream

        for i in range(self.args.warmup + repeats):
            theirs = self._device_s(contiguous)
            ours = self._device_s(batched)
            self.reap(t)
            self.sync()
            t0 = time.perf_counter()
            submit = self.copy(t, direction)
            self.sync()
            wall = time.perf_counter() - t0
            self.reap(t)
            if i >= self.args.warmup:
                for key, value in zip(samples, (ours, theirs, wall, submit), strict=True):
                    samples[key].append(value)
        return {key: statistics.median(values) for key, values in samples.items()}


def _kernel_name(k: KernelConfig) -> str:
    return (
        f"block={k.block_words} warps={k.num_warps} items={k.items_per_program} "
        f"programs={k.max_programs or 'all'}"
    )


PROG = "kvstrata bench transfer"
#: More timed or warm-up repeats than this is a typo, not a measurement.
_MAX_REPEATS = 10_000


def build_parser() -> CommandParser:
    """The benchmark's flags."""
    ap = CommandParser(
        prog=PROG,
        description="Batched page copies between the device pool and the host pool (one layer, "
        "random slots) against a contiguous pinned copy of the same bytes. Prints a table, then "
        "one JSON line.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pages", type=int, default=4096, help="pages copied per layer")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page")
    ap.add_argument("--layers", type=int, default=4, help="layers in the pools")
    ap.add_argument("--layer", type=int, default=1, help="the layer copied")
    ap.add_argument("--geometry", nargs="+", choices=sorted(GEOMETRIES), default=["gqa", "mla"])
    ap.add_argument("--layout", nargs="+", choices=HOST_LAYOUTS, default=list(HOST_LAYOUTS))
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--max-alloc-gib", type=float, default=480.0, help="host per-allocation cap (slab size)"
    )
    ap.add_argument("--block-words", type=int, default=KernelConfig.block_words)
    ap.add_argument("--num-warps", type=int, default=KernelConfig.num_warps)
    ap.add_argument("--items-per-program", type=int, default=KernelConfig.items_per_program)
    ap.add_argument(
        "--max-programs",
        type=int,
        default=KernelConfig.max_programs or 0,
        help="programs per copy launch, each looping over its share (0: one per step)",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time a grid of kernel launch shapes (CUDA; every geometry, first --layout)",
    )
    ap.add_argument("--seed", type=int, default=0)
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values the benchmark cannot run with, before it allocates a pool."""
    check_device(args.device)
    for name in ("pages", "page_size", "layers"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.layer < args.layers:
        raise ConfigError(f"--layer must lie in [0, --layers), got {args.layer} of {args.layers}")
    if not 1 <= args.repeats <= _MAX_REPEATS or not 0 <= args.warmup <= _MAX_REPEATS:
        raise ConfigError(
            f"--repeats must lie in [1, {_MAX_REPEATS:,}] and --warmup in [0, {_MAX_REPEATS:,}], "
            f"got {args.repeats} and {args.warmup}"
        )
    if not 0 < args.max_alloc_gib < float("inf"):
        raise ConfigError(f"--max-alloc-gib must be a finite number > 0, got {args.max_alloc_gib}")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed must lie in [0, 2**63), got {args.seed}")
    KernelConfig(  # validates
        args.block_words, args.num_warps, args.items_per_program, args.max_programs or None
    )
    device = torch.device(args.device)
    pool = max(
        KVLayout(args.layers, GEOMETRIES[g]).page_bytes(args.page_size) for g in args.geometry
    ) * (2 * args.pages)
    hint = "lower --pages, --page-size or --layers"
    if device.type == "cpu":
        check_fits([("the device pool", pool), ("the host pool", pool)], device, hint)
    else:
        check_fits([("the device pool", pool)], device, hint)
        check_fits([("the host pool", pool)], torch.device("cpu"), hint)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for command-line arguments ``argv``; returns the exit status."""
    args = build_parser().parse_args(argv)
    check_args(args)
    device = torch.device(args.device)
    kernel = KernelConfig(
        args.block_words, args.num_warps, args.items_per_program, args.max_programs or None
    )
    rows: list[Row] = []
    sweep: list[dict[str, object]] = []
    for geometry in args.geometry:
        layout = KVLayout(args.layers, GEOMETRIES[geometry])
        dev = DevicePool(layout, args.page_size, 2 * args.pages, device)
        for host_layout in args.layout:
            layout_name: HostLayout = host_layout
            host = HostPool(
                layout,
                args.page_size,
                2 * args.pages,
                host_layout=layout_name,
                max_alloc_bytes=int(args.max_alloc_gib * 2**30),
            )
            case = _Case(args, device, dev, host)
            base = case.baseline()
            t = Transfer(dev, host, kernel=kernel if device.type == "cuda" else None)
            verified = case.verify(t)
            for direction in DIRECTIONS:
                m = case.measure(t, direction, base[direction], args.repeats)
                rows.append(
                    Row(geometry, host_layout, direction, args.pages, case.layer_bytes,
                        m["ours"] * 1e3, case.layer_bytes / m["ours"] / 1e9,
                        case.layer_bytes / m["theirs"] / 1e9, m["theirs"] / m["ours"],
                        case.layer_bytes / m["wall"] / 1e9, m["submit"] * 1e6, verified,
                        _kernel_name(kernel) if t.backend == "triton" else t.backend)
                )  # fmt: skip
            if args.sweep and device.type == "cuda" and host_layout == args.layout[0]:
                for k in SWEEP:
                    tk = Transfer(dev, host, kernel=k)
                    entry: dict[str, object] = {"geometry": geometry, "layout": host_layout}
                    entry |= asdict(k)
                    entry["verified"] = case.verify(tk)
                    for direction in DIRECTIONS:
                        m = case.measure(tk, direction, base[direction], max(3, args.repeats // 4))
                        entry[f"{direction}_gbps"] = round(case.layer_bytes / m["ours"] / 1e9, 2)
                        entry[f"{direction}_ratio"] = round(m["theirs"] / m["ours"], 3)
                    sweep.append(entry)
            host.close()
        del dev
        if device.type == "cuda":
            torch.cuda.empty_cache()

    header = (
        f"{'geometry':<8} {'host layout':<12} {'dir':<4} {'pages':>6} {'MiB':>7} {'ms':>8} "
        f"{'GB/s':>7} {'contig GB/s':>11} {'ratio':>6} {'wall GB/s':>9} {'submit us':>9} "
        f"{'bytes ok':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.geometry:<8} {r.layout:<12} {r.direction:<4} {r.pages:>6} "
            f"{r.bytes / 2**20:>7.1f} {r.ms:>8.3f} {r.gbps:>7.2f} {r.contiguous_gbps:>11.2f} "
            f"{r.ratio:>6.3f} {r.wall_gbps:>9.2f} {r.submit_us:>9.1f} "
            f"{'yes' if r.verified else 'NO':>8}"
        )
    if sweep:
        print("\nkernel sweep: block words, warps, items per program -> GB/s (ratio)")
        for e in sweep:
            print(
                f"  {e['geometry']:<4} {e['layout']:<12} block={e['block_words']:<5} warps={e['num_warps']} "
                f"items={e['items_per_program']:<2} d2h {e['d2h_gbps']:>6} ({e['d2h_ratio']}) "
                f"h2d {e['h2d_gbps']:>6} ({e['h2d_ratio']}) {'ok' if e['verified'] else 'BAD'}"
            )
    summary = {
        "bench": "transfer",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "page_size": args.page_size,
        "layers": args.layers,
        "repeats": args.repeats,
        "kernel": asdict(kernel),
        "results": [
            {
                **asdict(r),
                "ms": round(r.ms, 4),
                "gbps": round(r.gbps, 3),
                "contiguous_gbps": round(r.contiguous_gbps, 3),
                "ratio": round(r.ratio, 4),
                "wall_gbps": round(r.wall_gbps, 3),
                "submit_us": round(r.submit_us, 1),
            }
            for r in rows
        ],  # fmt: skip
        "sweep": sweep,
    }
    try:
        import triton

        summary["triton"] = triton.__version__
    except ImportError:
        summary["triton"] = None
    print(json.dumps(summary))
    ok = all(r.verified for r in rows) and all(e["verified"] for e in sweep)
    return 0 if ok else 1


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench transfer``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
