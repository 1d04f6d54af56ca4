"""``dd`` with O_DIRECT as the benchmarks' yardstick: the same bytes at the same block size,
from memory, into a preallocated file on the disk measured; several at once for several drives."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from ..tiers.host_pool import HostPool

_DD_RATE = re.compile(r"^(\d+) bytes .* copied, ([\d.]+) s", re.MULTILINE)


def dd_source(src: HostPool, nbytes: int, scratch: Path) -> Path:
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


def dd(argv: list[str]) -> float:
    """Run dd; returns its bytes per second."""
    return dd_parallel([argv])


def dd_parallel(argvs: list[list[str]]) -> float:
    """Run one dd per argument list, all at once; returns their bytes over the slowest's
    seconds (what the drives move together)."""
    procs = [
        subprocess.Popen(["dd", *a], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for a in argvs
    ]
    moved, slowest = 0, 0.0
    for proc in procs:
        _, out = proc.communicate()
        m = _DD_RATE.search(out)
        if proc.returncode != 0 or m is None:
            raise RuntimeError(f"dd failed or said something unexpected: {out!r}")
        moved, slowest = moved + int(m.group(1)), max(slowest, float(m.group(2)))
    return moved / slowest


def dd_args(files: list[Path], source: Path, slot: int, count: int) -> tuple[list[list[str]], ...]:
    """dd's write and read arguments: ``count`` slots split over ``files`` (one dd each)."""
    share = [count // len(files) + (j < count % len(files)) for j in range(len(files))]
    writes, reads = [], []
    skip = 0
    for f, n in zip(files, share, strict=True):
        writes.append(
            [
                f"if={source}",
                f"of={f}",
                f"bs={slot}",
                f"count={n}",
                f"skip={skip}",
                "oflag=direct",
                "conv=fdatasync,notrunc",
            ]
        )
        reads.append([f"if={f}", "of=/dev/null", f"bs={slot}", f"count={n}", "iflag=direct"])
        skip += n
    return writes, reads
