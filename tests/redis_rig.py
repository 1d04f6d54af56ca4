"""Real Redis servers for the shared tier's tests: standalone and a 3-node Redis Cluster, on free
loopback ports, started from Debian's ``redis-server`` (``scripts/setup.sh`` installs it).

A test that needs one takes the ``redis_server`` / ``redis_cluster`` fixture (tests/conftest.py);
where ``redis-server`` is missing or cannot start, the fixture skips the test with the reason.
Servers run without persistence (``--save '' --appendonly no``) in the test's own directory and
are killed when the test ends; :class:`RedisServer` can also kill, restart, pause (SIGSTOP) and
resume (SIGCONT) one, which is how the fault tests break the store under a running client.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The longest a server may take to answer PING after it was started.
START_S = 10.0
#: A cluster node's bus port is its client port plus this (Redis's fixed offset).
BUS_OFFSET = 10000


class RedisUnavailable(Exception):
    """redis-server cannot be started here (the reason is the message)."""


def free_port(bus: bool = False) -> int:
    """A loopback port nobody listens on (and, for a cluster node, its bus port too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not bus:
            return port
        if port + BUS_OFFSET < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + BUS_OFFSET))
                except OSError:
                    continue
            return port
    raise RedisUnavailable("no free loopback port pair for a cluster node")


def _ping(port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up (and maybe locked)
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port`` under ``workdir``."""

    def __init__(self, workdir: Path, port: int | None = None, *args: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisUnavailable("redis-server is not installed (scripts/setup.sh installs it)")
        self.exe, self.workdir, self.args = exe, workdir, list(args)
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [
            self.exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / f"redis-{self.port}.log"),
            *self.args,
        ]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_S
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                log = self.workdir / f"redis-{self.port}.log"
                tail = log.read_text(errors="replace")[-400:] if log.exists() else ""
                raise RedisUnavailable(f"redis-server did not start on port {self.port}: {tail}")
            time.sleep(0.02)

    def cli(self, *args: str) -> str:
        """``redis-cli -p PORT ARGS``; its output."""
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisUnavailable("redis-cli is not installed (Debian's redis-tools)")
        out = subprocess.run(
            [cli, "-p", str(self.port), *args], capture_output=True, text=True, timeout=30
        )
        return out.stdout

    def kill(self) -> None:
        """SIGKILL (its data is gone: nothing is persisted)."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()


class RedisCluster:
    """Three ``redis-server`` cluster nodes (no replicas) joined by ``redis-cli --cluster
    create``; all 16384 slots covered."""

    def __init__(self, workdir: Path, nodes: int = 3) -> None:
        if shutil.which("redis-cli") is None:
            raise RedisUnavailable("redis-cli is not installed (Debian's redis-tools)")
        self.nodes: list[RedisServer] = []
        try:
            for i in range(nodes):
                port = free_port(bus=True)
                node_dir = workdir / f"node{i}"
                self.nodes.append(
                    RedisServer(
                        node_dir,
                        port,
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(node_dir / "nodes.conf"),
                        "--cluster-node-timeout",
                        "2000",
                    )
                )
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            out = subprocess.run(
                ["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0",
                 "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if out.returncode != 0:
                raise RedisUnavailable(f"redis-cli --cluster create failed: {out.stdout[-400:]}")
            deadline = time.monotonic() + 30
            while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RedisUnavailable("the cluster did not reach cluster_state:ok in 30 s")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def flush(self) -> None:
        for n in self.nodes:
            n.cli("flushall")

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()
