"""Starting context-parallel ranks: ``torchrun`` (its environment variables) or local processes.

:func:`run_ranks` starts ``cp`` processes on this machine (torch.multiprocessing, spawn), each
with an initialised process group (gloo on CPU, NCCL on GPU, one device per rank), calls
``fn(group, *args)`` in each and returns the results by rank. A rank that raises, dies or stops
answering (SIGSTOP, a hang) makes :func:`run_ranks` raise :class:`~kvstrata.errors.CollectiveError`
naming it; every rank still alive then is terminated, and killed (SIGKILL, which a stopped process
does not ignore) after a short grace, so the caller never waits for a rank without a bound. Local
ranks die with their parent (``PR_SET_PDEATHSIG``), meet through a ``FileStore`` in a private
temporary directory (nothing listens on a network port for the rendezvous) and run gloo on the
loopback interface. :func:`run_torchrun` joins the group ``torchrun`` describes instead, for ranks
launched across hosts by the tool people already use, and destroys it however the run ends.
"""

from __future__ import annotations

import ctypes
import os
import queue as queue_module
import shutil
import signal
import socket
import tempfile
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
#: After the first rank failed: how long the others get to report why, and then how long a
#: terminated rank gets to exit before it is killed.
REPORT_GRACE_S = 3.0
TERM_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1


def under_torchrun(environ: dict[str, str] | None = None) -> bool:
    """Whether this process was started by ``torchrun`` (its variables are set)."""
    env = os.environ if environ is None else environ
    return all(name in env for name in TORCHRUN_VARS)


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _init(
    rank: int, size: int, device: str, timeout_s: float, store: dist.Store | None = None
) -> TorchGroup:
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
    try:
        dist.init_process_group(
            backend_for(device),
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
            store=store,
        )
    except (RuntimeError, ValueError, dist.DistError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = (
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            if store is None
            else "the local rendezvous"
        )
        raise CollectiveError(
            f"rank {rank} of {size}: the rendezvous at {where} did not complete within "
            f"{timeout_s:g} s ({first}); start every rank, with the same MASTER_ADDR/PORT and "
            "WORLD_SIZE, or raise --cp-timeout"
        ) from None
    return TorchGroup()


def torchrun_group(device: str, timeout_s: float) -> TorchGroup:
    """Join the process group ``torchrun`` set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    if not under_torchrun():
        raise ConfigError(f"not started by torchrun: {', '.join(TORCHRUN_VARS)} must be set")
    return _init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, timeout_s)


def run_torchrun(
    fn: Callable[..., Any], args: tuple[Any, ...], device: str, timeout_s: float
) -> Any:
    """``fn(group, *args)`` on this rank of torchrun's world; the process group is destroyed
    however ``fn`` ends (left to interpreter exit, a failed rank aborts with SIGABRT)."""
    group = torchrun_group(device, timeout_s)
    try:
        return fn(group, *args)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux), if it has one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next(
        (n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), None)
    )


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so ranks never
    outlive a killed CLI holding the disk tier's locks; exit now if it died already."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's kill() below still bounds it
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


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
    rendezvous: str,
    parent: int,
    device: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    _die_with_parent(parent)
    lo = loopback_interface()
    if lo is not None:  # the ranks share this machine: keep their sockets off the network
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
    try:
        store = dist.FileStore(rendezvous, size)
        group = _init(rank, size, device, timeout_s, store)
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


def _root_cause(
    cp: int, procs: list[Any], out: dict[int, Any], errors: dict[int, str], silent: set[int]
) -> str:
    """Name the rank that failed first: one that died without a word, one whose error is not just
    the broken connection to a peer, or one that stopped answering (alive, silent, while the
    others timed out waiting for it); the others only saw the consequence."""
    for rank, p in enumerate(procs):
        if rank not in out and rank not in errors and p.exitcode not in (None, 0):
            if rank in silent:
                continue
            code = p.exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return f"rank {rank} of {cp} died ({how}); the other ranks were stopped"
    causes = {r: t for r, t in errors.items() if "CollectiveError" not in t}
    if not causes and silent:
        rank = min(silent)
        seen = f"; rank {min(errors)} timed out waiting for it" if errors else ""
        return (
            f"rank {rank} of {cp} stopped answering (alive but silent: stopped or hung){seen}; "
            "it was killed"
        )
    if not errors:
        return f"ranks {sorted(silent)} of {cp} stopped answering; they were killed"
    rank, text = next(iter(causes.items() or errors.items()))
    return f"rank {rank} of {cp} failed: {text.strip().splitlines()[-1]}"


def stop_ranks(procs: list[Any], join_s: float) -> None:
    """Join every rank for up to ``join_s``; terminate one still alive, and SIGKILL it after
    :data:`TERM_GRACE_S` (a stopped process ignores SIGTERM until it is continued)."""
    procs = [p for p in procs if p.pid is not None]  # started
    deadline = time.monotonic() + join_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + TERM_GRACE_S
    for p in alive:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_ranks(
    cp: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    device: str = "cpu",
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run ``fn(group, *args)`` on ``cp`` local ranks; return their results, rank 0 first (with
    tensors as numpy arrays). Call it from the main thread: the ranks die with the thread that
    started them."""
    if cp < 1:
        raise ConfigError(f"--cp must be >= 1, got {cp}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    private = tempfile.mkdtemp(prefix="kvstrata-rendezvous-")  # mode 0700: this user only
    rendezvous = os.path.join(private, "store")
    procs = [
        ctx.Process(
            target=_entry,
            args=(rank, cp, rendezvous, os.getpid(), device, timeout_s, fn, args, results),
            daemon=False,
        )
        for rank in range(cp)
    ]
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    silent: set[int] = set()
    try:
        for p in procs:
            p.start()
        deadline = None  # once a rank failed: a short grace for the others to report why
        while len(out) + len(errors) < cp:
            if deadline is not None and time.monotonic() > deadline:
                break
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue_module.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in out and r not in errors
                ]
                if dead and deadline is None:
                    deadline = time.monotonic() + REPORT_GRACE_S
                if dead and all(p.exitcode is not None for p in procs):
                    break
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors[rank] = value
                deadline = deadline or time.monotonic() + REPORT_GRACE_S
        if len(out) < cp:
            silent = {
                r for r, p in enumerate(procs) if r not in out and r not in errors and p.is_alive()
            }
            stop_ranks(procs, 0.5)
            raise CollectiveError(_root_cause(cp, procs, out, errors, silent))
    finally:
        stop_ranks(procs, 0.5 if len(out) < cp else timeout_s)
        shutil.rmtree(private, ignore_errors=True)
    return [out[r] for r in range(cp)]
