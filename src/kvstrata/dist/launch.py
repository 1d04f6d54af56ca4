"""Starting context-parallel ranks: ``torchrun`` (its environment variables) or local processes.

:func:`run_ranks` starts ``cp`` processes on this machine (torch.multiprocessing, spawn), each
with an initialised process group (gloo on CPU, NCCL on GPU, one device per rank), calls
``fn(group, *args)`` in each and returns the results by rank. A rank that raises or dies makes
:func:`run_ranks` raise :class:`~kvstrata.errors.CollectiveError` naming it; the others are
stopped. :func:`torchrun_group` joins the group ``torchrun`` describes instead, for ranks launched
across hosts by the tool people already use.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import CollectiveError, ConfigError, KVStrataError
from .group import TorchGroup

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun(environ: dict[str, str] | None = None) -> bool:
    """Whether this process was started by ``torchrun`` (its variables are set)."""
    env = os.environ if environ is None else environ
    return all(name in env for name in TORCHRUN_VARS)


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _init(rank: int, size: int, device: str, timeout_s: float) -> TorchGroup:
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
    dist.init_process_group(
        backend_for(device), rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
    )
    return TorchGroup()


def torchrun_group(device: str, timeout_s: float) -> TorchGroup:
    """Join the process group ``torchrun`` set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    if not under_torchrun():
        raise ConfigError(f"not started by torchrun: {', '.join(TORCHRUN_VARS)} must be set")
    return _init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plain(value: Any) -> Any:
    """``value`` with tensors as numpy arrays: a tensor sent through a torch queue lives in shared
    memory that vanishes with its process."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _entry(
    rank: int,
    size: int,
    port: int,
    device: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        group = _init(rank, size, device, timeout_s)
        try:
            results.put((rank, "ok", _plain(fn(group, *args))))
        finally:
            dist.destroy_process_group()
    except KVStrataError as err:
        results.put((rank, "error", f"{type(err).__name__}: {err}"))
        raise SystemExit(2) from None
    except BaseException:
        results.put((rank, "error", traceback.format_exc(limit=6)))
        raise


def _root_cause(cp: int, procs: list[Any], out: dict[int, Any], errors: dict[int, str]) -> str:
    """Name the rank that failed first: one that died without a word, or one whose error is not
    just the broken connection to a peer; the others only saw the consequence."""
    for rank, p in enumerate(procs):
        if rank not in out and rank not in errors and p.exitcode not in (None, 0):
            code = p.exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return f"rank {rank} of {cp} died ({how}); the other ranks were stopped"
    causes = {r: t for r, t in errors.items() if "CollectiveError" not in t}
    rank, text = next(iter(causes.items() or errors.items()))
    return f"rank {rank} of {cp} failed: {text.strip().splitlines()[-1]}"


def run_ranks(
    cp: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    device: str = "cpu",
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run ``fn(group, *args)`` on ``cp`` local ranks; return their results, rank 0 first (with
    tensors as numpy arrays)."""
    if cp < 1:
        raise ConfigError(f"--cp must be >= 1, got {cp}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(rank, cp, port, device, timeout_s, fn, args, results),
            daemon=False,
        )
        for rank in range(cp)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = None  # once a rank failed: a short grace for the others to report why
    try:
        while len(out) + len(errors) < cp:
            if deadline is not None and time.monotonic() > deadline:
                break
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue_module.Empty:
                silent = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in out and r not in errors
                ]
                if silent and deadline is None:
                    deadline = time.monotonic() + 3.0
                if silent and all(p.exitcode is not None for p in procs):
                    break
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors[rank] = value
                deadline = deadline or time.monotonic() + 3.0
        if len(out) < cp:
            raise CollectiveError(_root_cause(cp, procs, out, errors))
    finally:
        for p in procs:
            p.join(timeout=0.5 if len(out) < cp else timeout_s)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [out[r] for r in range(cp)]
