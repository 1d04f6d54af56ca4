"""Ranks that stop answering, a parent that dies, and what local ranks expose (issue 19: 2, 7, 8).

Every test that could hang runs its ranks in a child Python process under a timeout of its own,
so a regression fails the test instead of stalling the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvstrata.dist.group import Group
from kvstrata.dist.launch import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str, timeout_s: float, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in its own process group; kill the whole group and
    fail when it outlives ``timeout_s``."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + str(Path(__file__).parent)}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        **kw,  # type: ignore[arg-type]
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hung past {timeout_s} s\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_stopped_rank_is_named_killed_and_the_caller_exits() -> None:
    """Rank 1 SIGSTOPs itself; rank 0's collective times out (2 s). run_ranks must raise naming
    rank 1, kill it (SIGTERM alone never reaches a stopped process), and the interpreter must
    then exit instead of joining the stopped rank forever."""
    code = """
        import time
        from cp_fault_ranks import stop_self_then_reduce
        from kvstrata.dist.launch import run_ranks
        from kvstrata.errors import CollectiveError
        t0 = time.monotonic()
        try:
            run_ranks(2, stop_self_then_reduce, (1,), timeout_s=2)
        except CollectiveError as err:
            print("ERROR", err)
        print("SECONDS", round(time.monotonic() - t0, 1))
    """
    done = _python(code, timeout_s=90)
    assert done.returncode == 0, done.stderr
    assert "ERROR rank 1 of 2 stopped answering" in done.stdout, done.stdout + done.stderr
    assert "rank 0 timed out waiting for it" in done.stdout


def _pids_of(ppid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{ppid}/task"):
        with open(f"/proc/{ppid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    ranks = []
    for pid in out:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"resource_tracker" not in f.read():
                    ranks.append(pid)
        except FileNotFoundError:
            pass
    return ranks


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_ranks_die_with_a_killed_parent() -> None:
    """SIGKILL the process that started the ranks: they must not run on (holding disk locks)."""
    code = """
        from cp_fault_ranks import sleep_forever
        from kvstrata.dist.launch import run_ranks
        run_ranks(2, sleep_forever, (), timeout_s=60)
    """
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + str(Path(__file__).parent)}
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env)
    try:
        deadline = time.monotonic() + 60
        ranks: list[int] = []
        while len(ranks) < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
            ranks = _pids_of(parent.pid)
        assert len(ranks) == 2, "the ranks did not start"
        time.sleep(3)  # past their start-up: in fn
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in ranks if _alive(pid)]
    finally:
        for pid in _pids_of(parent.pid) if parent.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
    for pid in left:  # cleanup before failing: these are ours
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their parent"


def _listening(group: Group) -> list[str]:
    from cp_fault_ranks import listening_addresses

    return listening_addresses()


def test_local_ranks_listen_on_loopback_only() -> None:
    """The rendezvous is a FileStore in a private directory and gloo binds the loopback
    interface: no socket of a rank listens on another address."""
    ranks = run_ranks(2, _listening, (), timeout_s=60)
    for addresses in ranks:
        outside = [a for a in addresses if not a.startswith(("127.", "::1", "::ffff:127."))]
        assert not outside, addresses


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0]
    except FileNotFoundError:
        return "gone"


def test_a_stopped_rank_holding_its_index_write_lock_blocks_no_other_rank(tmp_path: Path) -> None:
    """Rank 1's store stops (SIGSTOP) inside an index write transaction. Rank 0's store on the
    same directory must still start, spill past its high watermark (GC deletes entries), read
    and close, within its own bounded time: no lock of the tier is shared between ranks."""
    holder_code = f"""
        import os, signal
        from disk_rig import LAYOUT, PAGE, open_store
        from kvstrata.tiers.page_hash import Namespace
        ns = Namespace.for_layout("test-model", LAYOUT, PAGE, cp_size=2)
        store = open_store({str(tmp_path)!r}, pages=20, ns=ns, rank=1)
        txn = store._index.env.begin(write=True)  # LMDB's write lock, held
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    """
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + str(Path(__file__).parent)}
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(holder_code)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        deadline = time.monotonic() + 30
        while _state(holder.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(holder.pid) == "T"
        code = f"""
            from disk_rig import LAYOUT, PAGE, hashes, host_pool, open_store, spill_all
            from kvstrata.tiers.page_hash import Namespace
            ns = Namespace.for_layout("test-model", LAYOUT, PAGE, cp_size=2)
            pool, dst = host_pool(), host_pool()
            with open_store({str(tmp_path)!r}, pages=20, ns=ns, rank=0) as store:
                for t in range(3):  # 45 pages into 20 slots: GC runs
                    spill_all(store, pool, hashes(15, seed=t, ns=ns), ticket=t + 1)
                last = hashes(15, seed=2, ns=ns)
                n = store.lookup(last)
                ok = store.read(last[:n], dst, list(range(n)))
                print("GC", store.stats().gc_reclaimed, "READ", n, all(ok))
        """
        done = _python(code, timeout_s=60)
        assert done.returncode == 0, done.stderr
        words = done.stdout.split()
        assert words[0] == "GC" and int(words[1]) > 0 and words[4] == "True", done.stdout
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_replay_with_a_stopped_rank_and_the_disk_tier_exits_naming_it(tmp_path: Path) -> None:
    """The issue's scenario end to end: `replay --cp 2` with the disk tier, rank 1 SIGSTOPped
    mid-run. The CLI must exit non-zero within --cp-timeout plus the graces, naming rank 1."""
    cmd = [sys.executable, "-m", "kvstrata", "replay", "--cp", "2", "--model", "none",
           "--trace", "synthetic:0:3000", "--l1-tokens", "8192", "--l2-tokens", "16384",
           "--l3-dir", str(tmp_path / "l3"), "--l3-gib", "0.05", "--no-progress",
           "--cp-timeout", "5"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        ranks: list[int] = []
        while len(ranks) < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
            ranks = _pids_of(proc.pid)
        assert len(ranks) == 2, "the two rank processes did not start"
        time.sleep(6)  # well into the replay
        assert proc.poll() is None, "the replay ended before the rank could be stopped"
        os.kill(ranks[1], signal.SIGSTOP)
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
            pytest.fail("the replay did not exit after a rank stopped")
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode not in (0, None)
    assert "rank 1 of 2 stopped answering" in err, err
    assert not [pid for pid in ranks if _alive(pid)]


def _torchrun_ranks(port: int, ranks: list[list[str]], timeout_s: float) -> list[tuple[int, str]]:
    """Start ``python -m kvstrata replay ARGS`` as ranks of a torchrun world (its variables set by
    hand), one per entry of ``ranks``; (exit status, stderr) of each."""
    env = {**os.environ, "PYTHONPATH": SRC, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvstrata", "replay", "--model", "none", "--no-progress", *args],
            env={**env, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank, args in enumerate(ranks)
    ]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            pytest.fail(f"a torchrun rank hung past {timeout_s} s")
        out.append((p.returncode, err))
    return out


def test_under_torchrun_a_config_mismatch_names_the_field_and_exits_2() -> None:
    from kvstrata.dist.launch import free_port

    done = _torchrun_ranks(
        free_port(), [["--page-size", "16"], ["--page-size", "32"]], timeout_s=120
    )
    for rank, (code, err) in enumerate(done):
        lines = err.strip().splitlines()
        assert code == 2, (rank, code, err)  # not 134 (SIGABRT at exit)
        assert len(lines) == 1, err
        other = "32 vs 16" if rank == 0 else "16 vs 32"
        assert f"engine.page_size: {other}" in lines[0], lines[0]
        assert "pool_tokens" not in lines[0]  # one field, not two whole configurations


def test_under_torchrun_a_rendezvous_timeout_is_one_line() -> None:
    from kvstrata.dist.launch import free_port

    env = {**os.environ, "PYTHONPATH": SRC, "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata", "replay", "--model", "none", "--no-progress",
         "--cp-timeout", "2"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "rendezvous" in lines[0] and "did not complete within 2 s" in lines[0]
