"""``kvstrata bench disk``: spill and reload through the disk tier against ``dd`` with O_DIRECT.

A host pool of ``--gib`` GiB of pages at a real model's page geometry (default Llama-3.2-1B:
16 layers x 8 KV heads x 64 x bf16, page 64, K and V: 1 MiB per payload per page) is spilled to a
:class:`~kvstrata.tiers.disk_store.DiskStore` under ``--dir`` (gather, CRC, O_DIRECT writes,
fdatasync, index commits) and read back (O_DIRECT reads, verification, copies into another host
pool), then every byte is compared. In the same run, alternating with it, ``dd`` writes and reads
the same number of bytes at the same block size (one slot) with ``oflag=direct conv=fdatasync`` /
``iflag=direct`` into a preallocated file on the same filesystem, as the slabs are, writing the
same random bytes from memory (a file in /dev/shm), not zeros. ``ratio`` is
ours over dd's (median of ``--repeat`` rounds). GB/s counts the bytes that reach the disk (slot
headers and padding included, the same bytes dd moves).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ..command import CommandParser, HelpFormatter, run_command
from ..config import KVLayout, PayloadSpec
from ..errors import ConfigError
from ..limits import check_fits
from ..tiers.disk_config import IO_MODES, MAX_IO_THREADS, DiskConfig
from ..tiers.disk_format import CRC32C_HARDWARE, round_up
from ..tiers.disk_store import DiskStore
from ..tiers.host_pool import HostPool
from ..tiers.page_hash import Namespace

PROG = "kvstrata bench disk"
#: More rounds than this is a typo, not a measurement.
_MAX_REPEAT = 100
_DD_RATE = re.compile(r"^(\d+) bytes .* copied, ([\d.]+) s", re.MULTILINE)


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
        default=".",
        help="where to write (a scratch directory is made inside it and removed afterwards); "
        "put it on the disk to measure",
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
    if not Path(args.dir).is_dir():
        raise ConfigError(f"--dir {args.dir} is not a directory")
    if shutil.which("dd") is None:
        raise ConfigError("dd is not on PATH; the benchmark compares against it")
    page = _layout(args).page_bytes(args.page_size)
    pages = max(1, int(args.gib * 2**30) // page)
    check_fits([("two host pools", 2 * pages * page)], torch.device("cpu"), hint="lower --gib")


def _dd_source(src: HostPool, nbytes: int, scratch: Path) -> Path:
    """A file of the pool's (random) bytes for dd to write from, in memory (/dev/shm) where the
    machine has it: dd then copies real data from RAM, as a spill does, not zeros a virtual disk
    might short-cut."""
    shm = Path("/dev/shm")
    have = shutil.disk_usage(shm).free if shm.is_dir() else 0
    path = shm / f"kvstrata-bench-disk-{os.getpid()}.src" if have > 2 * nbytes else scratch / "src"
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            for t in src.tensors():
                chunk = t.view(torch.uint8).reshape(-1)[:left].numpy().tobytes()
                f.write(chunk)
                left -= len(chunk)
                if left <= 0:
                    break
    return path


def _dd(argv: list[str]) -> float:
    """Run dd; returns its bytes per second."""
    out = subprocess.run(["dd", *argv], capture_output=True, text=True, check=True).stderr
    m = _DD_RATE.search(out)
    if m is None:
        raise RuntimeError(f"cannot read dd's output: {out!r}")
    return int(m.group(1)) / float(m.group(2))


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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for command-line arguments ``argv``; returns the exit status."""
    args = build_parser().parse_args(argv)
    check_args(args)
    layout = _layout(args)
    ns = Namespace.for_layout("bench-disk", layout, args.page_size)
    page = layout.page_bytes(args.page_size)
    pages = max(1, int(args.gib * 2**30) // page)
    slot = round_up(64 + ns.payload_bytes(0))
    disk_bytes = pages * 2 * slot
    src = HostPool(layout, args.page_size, pages, pin=False)
    dst = HostPool(layout, args.page_size, pages, pin=False)
    gen = torch.Generator().manual_seed(0)
    for t in src.tensors():
        t.view(torch.uint8).random_(0, 256, generator=gen)
    scratch = Path(tempfile.mkdtemp(prefix="kvstrata-bench-disk-", dir=args.dir))
    rounds: dict[str, list[float]] = {"spill": [], "dd_write": [], "reload": [], "dd_read": []}
    verified = True
    io_mode = ""
    amplification: list[int] = []  # bytes sent to storage while spilling, per round
    try:
        dd_file = scratch / "dd.bin"
        with open(dd_file, "wb") as f:  # preallocated, as the slabs are
            os.posix_fallocate(f.fileno(), 0, disk_bytes)
        budget = (-(-pages * 100 // 94) + 2) * 2 * slot + 2 * 4096  # under the high watermark
        count = disk_bytes // slot
        dd_source = _dd_source(src, disk_bytes, scratch)
        dd_write = [
            f"if={dd_source}",
            f"of={dd_file}",
            f"bs={slot}",
            f"count={count}",
            "oflag=direct",
            "conv=fdatasync,notrunc",
        ]
        dd_read = [f"if={dd_file}", "of=/dev/null", f"bs={slot}", f"count={count}", "iflag=direct"]
        for r in range(args.repeat):
            cfg = DiskConfig(
                scratch / "l3",
                budget,
                io_mode=args.io_mode,
                read_threads=args.read_threads,
                write_threads=args.write_threads,
            )
            with DiskStore(ns, 0, cfg) as store:
                io_mode = store.io_mode
                hashes = [os.urandom(32) for _ in range(pages)]
                for t in dst.tensors():
                    t.view(torch.uint8).zero_()
                # Alternate who goes first, so that a drift of the disk's speed cancels out.
                ours_first = r % 2 == 0
                if not ours_first:
                    rounds["dd_write"].append(_dd(dd_write))
                before = written_bytes()
                rounds["spill"].append(
                    disk_bytes / _spill(store, src, hashes, args.ticket_pages, r << 32)
                )
                if before is not None:  # the slabs' and the index's bytes (no dd meanwhile)
                    amplification.append((written_bytes() or 0) - before)
                if ours_first:
                    rounds["dd_write"].append(_dd(dd_write))
                    rounds["dd_read"].append(_dd(dd_read))
                rounds["reload"].append(disk_bytes / _reload(store, dst, hashes, args.read_pages))
                if not ours_first:
                    rounds["dd_read"].append(_dd(dd_read))
                verified &= all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(src.tensors(), dst.tensors(), strict=True)
                )
                stats = store.stats()
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
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
    print(f"{'op':<8}{'kvstrata GB/s':>15}{'dd O_DIRECT GB/s':>19}{'ratio':>8}")
    print(f"{'spill':<8}{med['spill']:>15.2f}{med['dd_write']:>19.2f}{spill_ratio:>8.2f}")
    print(f"{'reload':<8}{med['reload']:>15.2f}{med['dd_read']:>19.2f}{reload_ratio:>8.2f}")
    written = statistics.median(amplification) / disk_bytes if amplification else None
    if written is not None:
        print(f"written    {written:.3f}x the slot bytes spilled (slabs and index, /proc/self/io)")
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
