"""``kvstrata bench sglang-backend``: the SGLang storage backend against ``dd`` with O_DIRECT.

SGLang's own MHA host pool (``MHATokenToKVPoolHost``, ``page_first``, CPU memory) of ``--gib``
GiB of pages at a real model's geometry (default Llama-3.2-1B: 16 layers x 8 KV heads x 64 x
bf16, page 64: 1 MiB of K and 1 MiB of V a page) is backed up through
:class:`~kvstrata.integrations.sglang.KvstrataStorage` exactly as SGLang's cache controller does
it (``batch_set_v1`` of 128 pages at a time, one call after the other, each returning once its
pages are durable), then prefetched (``batch_exists``, then ``batch_get_v1`` of 128 pages into
fresh host pages), and every byte is compared. In the same run, alternating with it, ``dd``
writes and reads the same bytes at one slot per block with ``oflag=direct conv=fdatasync`` /
``iflag=direct`` on the same filesystem (``bench disk``'s method). GB/s counts the bytes that
reach the disk (slot headers and padding included, the bytes dd moves); ``ratio`` is ours over
dd's, median of ``--repeat`` rounds. Needs sglang installed (scripts/setup.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..command import CommandParser, HelpFormatter, run_command
from ..errors import ConfigError
from ..limits import check_fits
from ..tiers.disk_config import IO_MODES, MAX_IO_THREADS
from ..tiers.disk_format import CRC32C_HARDWARE, round_up
from .disk import _dd, _dd_source

PROG = "kvstrata bench sglang-backend"
_MAX_REPEAT = 100
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


def build_parser() -> CommandParser:
    ap = CommandParser(
        prog=PROG,
        description="SGLang HiCache storage backend (batch_set_v1 / batch_get_v1 on SGLang's own "
        "host pool) against dd with O_DIRECT, in the same run: a table, then one JSON line.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "--dir",
        default=".",
        help="where to write (a scratch directory is made inside it and removed afterwards); "
        "put it on the disk to measure",
    )
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of page payload backed up")
    ap.add_argument("--layers", type=int, default=16, help="model layers (Llama-3.2-1B: 16)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (Llama-3.2-1B: 8)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension (Llama-3.2-1B: 64)")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page")
    ap.add_argument("--repeat", type=int, default=3, help="rounds, alternating with dd")
    ap.add_argument("--io-mode", choices=IO_MODES, default="direct", help="the store's I/O mode")
    ap.add_argument("--read-threads", type=int, default=3, help="the store's read_threads")
    ap.add_argument("--write-threads", type=int, default=2, help="the store's write_threads")
    ap.add_argument(
        "--staging-mib", type=float, default=256, help="the store's staging memory (staging_mib)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    return ap


def check_args(args: argparse.Namespace) -> None:
    for name in ("layers", "kv_heads", "head_dim", "page_size", "repeat"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.gib <= 1024:
        raise ConfigError(f"--gib must lie in (0, 1024], got {args.gib}")
    if args.repeat > _MAX_REPEAT:
        raise ConfigError(f"--repeat must be <= {_MAX_REPEAT}, got {args.repeat}")
    for name in ("read_threads", "write_threads"):
        if not 1 <= getattr(args, name) <= MAX_IO_THREADS:
            flag = name.replace("_", "-")
            raise ConfigError(f"--{flag} must lie in [1, {MAX_IO_THREADS}]")
    if not 1 <= args.staging_mib <= 65536:
        raise ConfigError(f"--staging-mib must lie in [1, 65536], got {args.staging_mib}")
    if not Path(args.dir).is_dir():
        raise ConfigError(f"--dir {args.dir} is not a directory")
    if shutil.which("dd") is None:
        raise ConfigError("dd is not on PATH; the benchmark compares against it")
    page_bytes, pages = _geometry(args)
    check_fits([("the host pool", 2 * pages * page_bytes)], torch.device("cpu"), hint="lower --gib")


def _geometry(args: argparse.Namespace) -> tuple[int, int]:
    """``(bytes of one page, K and V; pages backed up)``."""
    token_bytes = args.layers * args.kv_heads * args.head_dim * _DTYPES[args.dtype].itemsize
    page_bytes = 2 * args.page_size * token_bytes
    return page_bytes, max(1, int(args.gib * 2**30) // page_bytes)


def _storage_config(root: Path, args: argparse.Namespace, budget: int) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name="bench-sglang-backend",
        extra_config={
            "interface_v1": 1,
            "dir": str(root),
            "budget_bytes": budget,
            "start": "clear",
            "io_mode": args.io_mode,
            "read_threads": args.read_threads,
            "write_threads": args.write_threads,
            "staging_mib": args.staging_mib,
        },
    )


def _backup(backend: Any, keys: list[str], host: torch.Tensor, page: int) -> float:
    """``_page_backup``: batch after batch; seconds until the last call returned."""
    t0 = time.perf_counter()
    for s in range(0, len(keys), BATCH):
        batch = keys[s : s + BATCH]
        if not all(backend.batch_set_v1(batch, host[s * page : (s + len(batch)) * page])):
            raise RuntimeError(f"a backup failed: {backend.get_stats().kvstrata}")
    return time.perf_counter() - t0


def _prefetch(backend: Any, keys: list[str], host: torch.Tensor, page: int) -> float:
    """``_storage_hit_query`` then ``_page_transfer``; seconds for both."""
    t0 = time.perf_counter()
    hit = sum(backend.batch_exists(keys[s : s + BATCH]) for s in range(0, len(keys), BATCH))
    if hit != len(keys):
        raise RuntimeError(f"batch_exists found {hit} of {len(keys)} pages")
    for s in range(0, len(keys), BATCH):
        batch = keys[s : s + BATCH]
        if not all(backend.batch_get_v1(batch, host[s * page : (s + len(batch)) * page])):
            raise RuntimeError(f"a prefetch failed: {backend.get_stats().kvstrata}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    from ..integrations.sglang import KvstrataStorage
    from ..integrations.sglang.cpu_pools import mha_host_pool

    dtype = _DTYPES[args.dtype]
    page_bytes, pages = _geometry(args)
    pool = mha_host_pool(
        layers=args.layers,
        heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        pages=2 * pages,
        dtype=dtype,
    )
    src, dst = pool.alloc(pages * args.page_size), pool.alloc(pages * args.page_size)
    pool.kv_buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    slot = round_up(64 + page_bytes // 2)
    disk_bytes = pages * 2 * slot
    budget = (-(-pages * 100 // 94) + 2) * 2 * slot + 2 * 4096  # under the high watermark
    scratch = Path(tempfile.mkdtemp(prefix="kvstrata-bench-sglang-", dir=args.dir))
    rounds: dict[str, list[float]] = {"set": [], "dd_write": [], "get": [], "dd_read": []}
    verified, io_mode, counters = True, "", {}
    try:
        dd_file = scratch / "dd.bin"
        with open(dd_file, "wb") as f:  # preallocated, as the slabs are
            os.posix_fallocate(f.fileno(), 0, disk_bytes)
        backend0 = KvstrataStorage(_storage_config(scratch / "l3", args, budget), {})
        backend0.register_mem_pool_host(pool)
        dd_source = _dd_source(backend0.pages.host_pool, disk_bytes, scratch)  # type: ignore[union-attr]
        backend0.close()
        count = disk_bytes // slot
        dd_write = [
            f"if={dd_source}",
            f"of={dd_file}",
            f"bs={slot}",
            f"count={count}",
            "oflag=direct",
            "conv=fdatasync,notrunc",
        ]
        dd_read = [f"if={dd_file}", "of=/dev/null", f"bs={slot}", f"count={count}", "iflag=direct"]
        want = [pool.get_data_page(int(src[i * args.page_size])).clone() for i in range(pages)]
        for r in range(args.repeat):
            backend = KvstrataStorage(_storage_config(scratch / "l3", args, budget), {})
            backend.register_mem_pool_host(pool)
            try:
                io_mode = backend.disk_stats().io_mode
                keys = [f"{r:04x}{i:060x}" for i in range(pages)]
                for i in range(pages):
                    pool.get_data_page(int(dst[i * args.page_size]), flat=False).zero_()
                ours_first = r % 2 == 0
                if not ours_first:
                    rounds["dd_write"].append(_dd(dd_write))
                rounds["set"].append(disk_bytes / _backup(backend, keys, src, args.page_size))
                if ours_first:
                    rounds["dd_write"].append(_dd(dd_write))
                    rounds["dd_read"].append(_dd(dd_read))
                rounds["get"].append(disk_bytes / _prefetch(backend, keys, dst, args.page_size))
                if not ours_first:
                    rounds["dd_read"].append(_dd(dd_read))
                verified &= all(
                    torch.equal(
                        pool.get_data_page(int(dst[i * args.page_size])).view(torch.uint8),
                        want[i].view(torch.uint8),
                    )
                    for i in range(pages)
                )
                counters = backend.get_stats().kvstrata
            finally:
                backend.close()
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        Path(f"/dev/shm/kvstrata-bench-disk-{os.getpid()}.src").unlink(missing_ok=True)
    med = {k: statistics.median(v) / 1e9 for k, v in rounds.items()}
    set_ratio, get_ratio = med["set"] / med["dd_write"], med["get"] / med["dd_read"]
    print(
        f"geometry   SGLang MHATokenToKVPoolHost page_first, {args.layers} layers x "
        f"{args.kv_heads} KV heads x {args.head_dim} x {args.dtype}, page {args.page_size}, "
        f"K+V {page_bytes / 2**20:.2f} MiB a page, slot {slot:,} bytes"
    )
    print(
        f"pages      {pages:,} ({pages * page_bytes / 2**30:.2f} GiB of payload, "
        f"{disk_bytes / 2**30:.2f} GiB on disk), {BATCH} a call, {args.repeat} rounds, median"
    )
    print(
        f"io         {io_mode}, crc32c {'hardware' if CRC32C_HARDWARE else 'software'}, "
        f"verified {'every byte' if verified else 'MISMATCH'}"
    )
    print(f"{'op':<14}{'kvstrata GB/s':>15}{'dd O_DIRECT GB/s':>19}{'ratio':>8}")
    print(f"{'batch_set_v1':<14}{med['set']:>15.2f}{med['dd_write']:>19.2f}{set_ratio:>8.2f}")
    print(f"{'batch_get_v1':<14}{med['get']:>15.2f}{med['dd_read']:>19.2f}{get_ratio:>8.2f}")
    result = {
        "bench": "sglang-backend",
        "pages": pages,
        "page_bytes": page_bytes,
        "slot_bytes": slot,
        "disk_bytes": disk_bytes,
        "io_mode": io_mode,
        "crc32c_hardware": CRC32C_HARDWARE,
        "verified": verified,
        "set_gbps": round(med["set"], 3),
        "dd_write_gbps": round(med["dd_write"], 3),
        "set_ratio": round(set_ratio, 3),
        "get_gbps": round(med["get"], 3),
        "dd_read_gbps": round(med["dd_read"], 3),
        "get_ratio": round(get_ratio, 3),
        "rounds_gbps": {k: [round(x / 1e9, 3) for x in v] for k, v in rounds.items()},
        "verify_failures": counters.get("disk_verify_failures", 0),
        "write_errors": counters.get("disk_write_errors", 0),
        "args": {k: v for k, v in vars(args).items() if k != "keep"},
    }
    print(json.dumps(result))
    return 0 if verified else 1


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
