"""``kvstrata bench disk``: spill and reload through the disk tier against ``dd`` with O_DIRECT.

A host pool of ``--gib`` GiB of pages at a real model's page geometry (default Llama-3.2-1B:
16 layers x 8 KV heads x 64 x bf16, page 64, K and V: 1 MiB per payload per page) is spilled to a
:class:`~kvstrata.tiers.disk_store.DiskStore` under ``--dir`` (gather, CRC, O_DIRECT writes,
fdatasync, index commits) and read back (O_DIRECT reads, verification, copies into another host
pool), then every byte is compared. In the same run, alternating with it, ``dd`` writes and reads
the same number of bytes at the same block size (one slot; 4 KiB with ``--io-mode packed``) with ``oflag=direct conv=fdatasync`` /
``iflag=direct`` into a preallocated file on the same filesystem, as the slabs are, writing the
same random bytes from memory (a file in /dev/shm), not zeros. ``ratio`` is
ours over dd's (median of ``--repeat`` rounds). GB/s counts the bytes that reach the disk (slot
headers and padding included, the same bytes dd moves).

Given ``--dir`` more than once (one directory per drive), each round also spills and reloads
the same bytes through one store striped over all of them (``disk_layout.py``) and runs one
``dd`` per directory at once on its share of the bytes; the table then adds a row per op over
``N`` directories and the reload's speed-up over one directory. Directories on one device (the
same ``st_dev``) share a drive, and the note says so: the figure cannot double there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from ..command import CommandParser, HelpFormatter, run_command
from ..config import KVLayout, PayloadSpec
from ..errors import ConfigError
from ..limits import check_fits
from ..tiers.disk_config import IO_MODES, MAX_IO_THREADS, DiskConfig, DiskStats
from ..tiers.disk_format import CRC32C_HARDWARE, round_up, slot_size
from ..tiers.disk_layout import check_roots
from ..tiers.disk_open import page_cost
from ..tiers.disk_store import DiskStore
from ..tiers.host_pool import HostPool
from ..tiers.page_hash import Namespace
from .dd import dd as _dd  # noqa: F401  (the other benchmarks' dd, imported from here)
from .dd import dd_args, dd_parallel
from .dd import dd_source as _dd_source

PROG = "kvstrata bench disk"
#: More rounds than this is a typo, not a measurement.
_MAX_REPEAT = 100


def build_parser() -> CommandParser:
    """The benchmark's flags."""
    ap = CommandParser(
        prog=PROG,
        description="Disk tier spill and reload throughput against dd with O_DIRECT at the same "
        "block size, in the same run: a table, then one JSON line.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "--dir",
        action="append",
        help="where to write (a scratch directory is made inside it and removed afterwards); "
        "put it on the disk to measure. Repeat it, one per drive, to measure one store "
        "striped over them all against the first alone (default: .)",
    )
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of page payload spilled")
    ap.add_argument("--layers", type=int, default=16, help="model layers (Llama-3.2-1B: 16)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (Llama-3.2-1B: 8)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension (Llama-3.2-1B: 64)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page")
    ap.add_argument("--ticket-pages", type=int, default=16, help="pages per spill ticket")
    ap.add_argument("--read-pages", type=int, default=64, help="pages per read call")
    ap.add_argument("--repeat", type=int, default=5, help="rounds, alternating with dd")
    ap.add_argument("--io-mode", choices=IO_MODES, default="direct", help="the store's I/O mode")
    ap.add_argument(
        "--read-threads", type=int, default=3, help="the store's reads in flight (read_threads)"
    )
    ap.add_argument(
        "--write-threads", type=int, default=2, help="the store's writes in flight (write_threads)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    return ap


def _layout(args: argparse.Namespace) -> KVLayout:
    shape = (args.kv_heads, args.head_dim)
    return KVLayout(
        args.layers, (PayloadSpec("k", shape, args.dtype), PayloadSpec("v", shape, args.dtype))
    )


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values the benchmark cannot run with, before it allocates anything."""
    for name in (
        "layers",
        "kv_heads",
        "head_dim",
        "page_size",
        "ticket_pages",
        "read_pages",
        "repeat",
    ):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.gib <= 1024:
        raise ConfigError(f"--gib must lie in (0, 1024], got {args.gib}")
    if args.repeat > _MAX_REPEAT:
        raise ConfigError(f"--repeat must be <= {_MAX_REPEAT}, got {args.repeat}")
    for name in ("read_threads", "write_threads"):
        if getattr(args, name) > MAX_IO_THREADS:
            flag = name.replace("_", "-")
            raise ConfigError(f"--{flag} must be <= {MAX_IO_THREADS}, got {getattr(args, name)}")
    args.dir = args.dir or ["."]
    for d in args.dir:
        if not Path(d).is_dir():
            raise ConfigError(f"--dir {d} is not a directory")
    check_roots(args.dir)  # one given twice, or inside another
    if shutil.which("dd") is None:
        raise ConfigError("dd is not on PATH; the benchmark compares against it")
    page = _layout(args).page_bytes(args.page_size)
    pages = max(1, int(args.gib * 2**30) // page)
    check_fits([("two host pools", 2 * pages * page)], torch.device("cpu"), hint="lower --gib")


def _spill(
    store: DiskStore, pool: HostPool, hashes: list[bytes], ticket_pages: int, base: int
) -> float:
    """Spill every page (host slot i holds hashes[i]); seconds until all are durable."""
    t0 = time.perf_counter()
    tickets = [
        [(h, i, 1) for i, h in enumerate(hashes[s : s + ticket_pages], start=s)]
        for s in range(0, len(hashes), ticket_pages)
    ]
    done = 0
    for n, pages in enumerate(tickets):
        while not store.spill(base + n, pages, pool):
            done += _reap(store)
            time.sleep(0.0005)
    while done < len(tickets):
        done += _reap(store)
        time.sleep(0.0005)
    return time.perf_counter() - t0


def written_bytes() -> int | None:
    """Bytes this process (its threads and reaped children) sent to storage so far
    (``/proc/self/io`` write_bytes), None where the kernel does not say."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reap(store: DiskStore) -> int:
    got = store.poll()
    for d in got.spilled:
        if d.failed:
            raise RuntimeError(f"{len(d.failed)} pages failed to spill: {store.stats()}")
    return len(got.spilled)


def _reload(store: DiskStore, pool: HostPool, hashes: list[bytes], read_pages: int) -> float:
    t0 = time.perf_counter()
    for s in range(0, len(hashes), read_pages):
        chunk = hashes[s : s + read_pages]
        ok = store.read(chunk, pool, list(range(s, s + len(chunk))))
        if not all(ok):
            raise RuntimeError(f"a reload failed: {store.stats()}")
    return time.perf_counter() - t0


@dataclass
class _Setup:
    """What every round of :func:`main` shares."""

    args: argparse.Namespace
    ns: Namespace
    src: HostPool
    dst: HostPool
    pages: int
    budget: int
    disk_bytes: int


def _round(
    setup: _Setup,
    roots: list[Path],
    dd_write: list[list[str]],
    dd_read: list[list[str]],
    ours_first: bool,
    base: int,
    rounds: dict[str, list[float]],
    suffix: str = "",
) -> tuple[bool, str, int | None, DiskStats]:
    """One round of one store over ``roots``, dd before or after it: GB/s into ``rounds``;
    returns (every byte verified, io mode, bytes sent to storage while spilling, stats)."""
    args = setup.args
    cfg = DiskConfig(
        roots[0],
        setup.budget,
        io_mode=args.io_mode,
        read_threads=args.read_threads,
        write_threads=args.write_threads,
        more_roots=tuple(roots[1:]),
    )
    with DiskStore(setup.ns, 0, cfg) as store:
        hashes = [os.urandom(32) for _ in range(setup.pages)]
        for t in setup.dst.tensors():
            t.view(torch.uint8).zero_()
        # Alternate who goes first, so that a drift of the disk's speed cancels out.
        if not ours_first:
            rounds["dd_write" + suffix].append(dd_parallel(dd_write))
        before = written_bytes()
        rounds["spill" + suffix].append(
            setup.disk_bytes / _spill(store, setup.src, hashes, args.ticket_pages, base)
        )
        # the slabs' and the index's bytes (no dd meanwhile)
        written = None if before is None else (written_bytes() or 0) - before
        if ours_first:
            rounds["dd_write" + suffix].append(dd_parallel(dd_write))
            rounds["dd_read" + suffix].append(dd_parallel(dd_read))
        rounds["reload" + suffix].append(
            setup.disk_bytes / _reload(store, setup.dst, hashes, args.read_pages)
        )
        if not ours_first:
            rounds["dd_read" + suffix].append(dd_parallel(dd_read))
        verified = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(setup.src.tensors(), setup.dst.tensors(), strict=True)
        )
        return verified, store.io_mode, written, store.stats()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for command-line arguments ``argv``; returns the exit status."""
    args = build_parser().parse_args(argv)
    check_args(args)
    layout = _layout(args)
    ns = Namespace.for_layout("bench-disk", layout, args.page_size)
    page = layout.page_bytes(args.page_size)
    pages = max(1, int(args.gib * 2**30) // page)
    slot = slot_size(ns.payload_bytes(0), packed=args.io_mode == "packed")
    disk_bytes = round_up(pages * 2 * slot)
    # dd's block: one slot, or with packed slots the 4 KiB that O_DIRECT needs (the same bytes)
    block = round_up(slot)
    src = HostPool(layout, args.page_size, pages, pin=False)
    dst = HostPool(layout, args.page_size, pages, pin=False)
    gen = torch.Generator().manual_seed(0)
    for t in src.tensors():
        t.view(torch.uint8).random_(0, 256, generator=gen)
    dirs = [Path(d) for d in args.dir]
    scratch = [Path(tempfile.mkdtemp(prefix="kvstrata-bench-disk-", dir=d)) for d in dirs]
    rounds: dict[str, list[float]] = defaultdict(list)
    verified = True
    io_mode = ""
    amplification: list[int] = []  # bytes sent to storage while spilling, per round
    count = disk_bytes // block
    many = len(dirs) > 1
    try:
        dd_files = [s / "dd.bin" for s in scratch]
        for j, f in enumerate(dd_files):
            with open(f, "wb") as out:  # preallocated, as the slabs are
                os.posix_fallocate(
                    out.fileno(), 0, disk_bytes if j == 0 else -(-disk_bytes // len(dirs))
                )
        # under the high watermark (per directory when striped: the budget splits evenly)
        page_disk_bytes = 2 * page_cost(ns.payload_bytes(0), args.io_mode)
        budget = (-(-pages * 100 // 94) + 2 * len(dirs)) * page_disk_bytes + 2 * 4096 * len(dirs)
        dd_source = _dd_source(src, disk_bytes, scratch[0])
        one_w, one_r = dd_args(dd_files[:1], dd_source, block, count)
        all_w, all_r = dd_args(dd_files, dd_source, block, count)
        setup = _Setup(args, ns, src, dst, pages, budget, disk_bytes)
        for r in range(args.repeat):
            ok, io_mode, sent, stats = _round(
                setup, [scratch[0] / "l3"], one_w, one_r, r % 2 == 0, r << 32, rounds
            )
            verified &= ok
            if sent is not None:
                amplification.append(sent)
            if many:
                striped = [s / "l3s" for s in scratch]
                ok, _, _, _ = _round(
                    setup, striped, all_w, all_r, r % 2 == 1, (r << 32) | 1 << 31, rounds, "_all"
                )
                verified &= ok
    finally:
        if not args.keep:
            for s in scratch:
                shutil.rmtree(s, ignore_errors=True)
        Path(f"/dev/shm/kvstrata-bench-disk-{os.getpid()}.src").unlink(missing_ok=True)
    med = {k: statistics.median(v) / 1e9 for k, v in rounds.items()}
    spill_ratio, reload_ratio = med["spill"] / med["dd_write"], med["reload"] / med["dd_read"]
    print(
        f"geometry   {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} x "
        f"{args.dtype}, page {args.page_size}, K+V: {page / 2**20:.2f} MiB a page, "
        f"slot {slot:,} bytes"
    )
    print(
        f"pages      {pages:,} ({pages * page / 2**30:.2f} GiB of payload, "
        f"{disk_bytes / 2**30:.2f} GiB on disk), {args.repeat} rounds, median"
    )
    print(
        f"io         {io_mode}, crc32c {'hardware' if CRC32C_HARDWARE else 'software'}, "
        f"verified {'every byte' if verified else 'MISMATCH'}"
    )
    devices = {os.stat(d).st_dev for d in dirs}
    n = len(dirs)
    print(f"{'op':<10}{'kvstrata GB/s':>15}{'dd O_DIRECT GB/s':>19}{'ratio':>8}")
    for op, dd in (("spill", "dd_write"), ("reload", "dd_read")):
        print(f"{op:<10}{med[op]:>15.2f}{med[dd]:>19.2f}{med[op] / med[dd]:>8.2f}")
        if many:
            ours, theirs = med[op + "_all"], med[dd + "_all"]
            print(f"{op + f' x{n}':<10}{ours:>15.2f}{theirs:>19.2f}{ours / theirs:>8.2f}")
    written = statistics.median(amplification) / disk_bytes if amplification else None
    if written is not None:
        print(f"written    {written:.3f}x the slot bytes spilled (slabs and index, /proc/self/io)")
    if many:
        note = (
            f"all {n} on one device: one drive, which {n} directories cannot outrun"
            if len(devices) == 1
            else f"{len(devices)} devices"
        )
        print(
            f"dirs       {n} ({note}): reload over {n} {med['reload_all'] / med['reload']:.2f}x "
            f"one; dd {n} at once {med['dd_read_all'] / med['dd_read']:.2f}x one"
        )
    result = {
        "bench": "disk",
        "pages": pages,
        "page_bytes": page,
        "slot_bytes": slot,
        "disk_bytes": disk_bytes,
        "io_mode": io_mode,
        "crc32c_hardware": CRC32C_HARDWARE,
        "verified": verified,
        "spill_gbps": round(med["spill"], 3),
        "dd_write_gbps": round(med["dd_write"], 3),
        "spill_ratio": round(spill_ratio, 3),
        "reload_gbps": round(med["reload"], 3),
        "dd_read_gbps": round(med["dd_read"], 3),
        "reload_ratio": round(reload_ratio, 3),
        "written_per_slot_byte": None if written is None else round(written, 3),
        "dirs": [str(d) for d in dirs],
        "devices": len(devices),
        "striped": None
        if not many
        else {
            "spill_gbps": round(med["spill_all"], 3),
            "reload_gbps": round(med["reload_all"], 3),
            "dd_write_gbps": round(med["dd_write_all"], 3),
            "dd_read_gbps": round(med["dd_read_all"], 3),
            "reload_vs_one": round(med["reload_all"] / med["reload"], 3),
            "dd_read_vs_one": round(med["dd_read_all"] / med["dd_read"], 3),
        },
        "rounds_gbps": {k: [round(x / 1e9, 3) for x in v] for k, v in rounds.items()},
        "write_errors": stats.write_errors,
        "verify_failures": stats.verify_failures,
        "args": {k: v for k, v in vars(args).items() if k != "keep"},
    }
    print(json.dumps(result))
    return 0 if verified else 1


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench disk``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
