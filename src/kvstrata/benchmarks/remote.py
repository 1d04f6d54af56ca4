"""``kvstrata bench remote``: publish and fetch through the shared tier against
``redis-benchmark``'s SET and GET of the same value size, on one loopback Redis, in the same run.

The benchmark starts its own ``redis-server`` (no persistence) on a free loopback port. A host
pool of ``--gib`` GiB of random pages at a real model's page geometry (default Llama-3.2-1B:
16 layers x 8 KV heads x 64 x bf16, page 16, K and V: 256 KiB per payload per page) is published
to a :class:`~kvstrata.tiers.remote.store.RemoteStore` (one EXISTS pipeline per ticket of
``--ticket-pages`` pages, then CRC-32C over the host pool's bytes and SET NX pipelines of
``--batch-pages`` pages sent from them on ``--threads`` connections, ``--publish-window`` of
them in flight on each) and fetched back into another host pool (GET pipelines read straight into
the host slots, every page checked, header and CRC), then every byte is compared. In the same
rounds, ``redis-benchmark`` SETs and GETs as many values of the same size (header + payload; every
SET a new key on an emptied server, as ours are, reads alternating who goes first) over as many
keys, with as many connections (``-c``), at the same pipeline depth (``-P``: pages per round trip x
payloads, and for SET that times the publish window as well) and without pipelining; the fastest
is the reference (deep pipelines of large values slow redis-benchmark down). ``ratio`` is ours
over that (median of ``--repeat`` rounds); GB/s counts value bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..command import CommandParser, HelpFormatter, run_command
from ..config import KVLayout, PayloadSpec
from ..errors import ConfigError
from ..limits import check_fits
from ..tiers.host_pool import HostPool
from ..tiers.page_hash import Namespace
from ..tiers.remote.config import RemoteConfig

if TYPE_CHECKING:  # the remote extra (redis) is imported only when the benchmark runs
    from ..tiers.remote import RemoteStore

PROG = "kvstrata bench remote"
_MAX_REPEAT = 100
#: redis-benchmark's SET draws its keys from this many: every value it writes is a new key.
_NEW_KEYS = 10**9  # redis-benchmark reads it with atoi()
#: More pages per ticket or round trip than this is a typo, not a measurement.
_MAX_PAGES = 4096
_RPS = re.compile(r"([\d.]+) requests per second")


def build_parser() -> CommandParser:
    """The benchmark's flags."""
    ap = CommandParser(
        prog=PROG,
        description="Shared tier publish and fetch throughput against redis-benchmark's SET and "
        "GET of the same value size on one loopback redis-server, in the same run: a table, then "
        "one JSON line.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--gib", type=float, default=0.25, help="GiB of page payload per round")
    ap.add_argument("--layers", type=int, default=16, help="model layers (Llama-3.2-1B: 16)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (Llama-3.2-1B: 8)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension (Llama-3.2-1B: 64)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--ticket-pages", type=int, default=64, help="pages per publish/fetch ticket")
    ap.add_argument(
        "--batch-pages", type=int, default=4, help="pages per round trip (the store's default)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=RemoteConfig.threads,
        help="connections (round trips in flight; the store's default)",
    )
    ap.add_argument(
        "--publish-window",
        type=int,
        default=RemoteConfig.publish_window,
        help="SET batches in flight per connection on a publish (the store's default)",
    )
    ap.add_argument(
        "--repeat", type=int, default=5, help="rounds, alternating with redis-benchmark"
    )
    ap.add_argument(
        "--tune-malloc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="raise glibc's mmap/trim thresholds (RemoteConfig.tune_malloc)",
    )
    return ap


def _layout(args: argparse.Namespace) -> KVLayout:
    shape = (args.kv_heads, args.head_dim)
    return KVLayout(
        args.layers, (PayloadSpec("k", shape, args.dtype), PayloadSpec("v", shape, args.dtype))
    )


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values the benchmark cannot run with, before it starts anything."""
    for name in ("layers", "kv_heads", "head_dim", "page_size", "ticket_pages", "batch_pages"):
        if not 1 <= getattr(args, name) <= _MAX_PAGES:
            flag = name.replace("_", "-")
            raise ConfigError(f"--{flag} must lie in [1, {_MAX_PAGES}], got {getattr(args, name)}")
    if not 1 <= args.threads <= 64:
        raise ConfigError(f"--threads must lie in [1, 64], got {args.threads}")
    if not 1 <= args.publish_window <= 8:
        raise ConfigError(f"--publish-window must lie in [1, 8], got {args.publish_window}")
    if not 1 <= args.repeat <= _MAX_REPEAT:
        raise ConfigError(f"--repeat must lie in [1, {_MAX_REPEAT}], got {args.repeat}")
    if not 0 < args.gib <= 64:
        raise ConfigError(f"--gib must lie in (0, 64], got {args.gib}")
    for tool in ("redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            raise ConfigError(
                f"{tool} is not on PATH; install Debian's redis-server and redis-tools "
                "(scripts/setup.sh does where apt is available)"
            )
    page = _layout(args).page_bytes(args.page_size)
    pages = max(1, int(args.gib * 2**30) // page)
    # two host pools here, and in the server our values and redis-benchmark's
    check_fits([("pools and server", 4 * pages * page)], torch.device("cpu"), hint="lower --gib")


class _Server:
    """A private redis-server on a free loopback port."""

    def __init__(self, workdir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(workdir), "--logfile", str(workdir / "log")]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self._up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"redis-server did not start (see {workdir / 'log'})")
            time.sleep(0.02)
        words = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
        self.version = next((w[2:] for w in words.stdout.split() if w.startswith("v=")), "?")

    def _up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(8).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _redis_benchmark(port: int, argv: list[str]) -> tuple[float, float]:
    """Run redis-benchmark; returns its requests per second and the CPU seconds it used."""
    cmd = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-q", *argv]
    cpu0 = _children_cpu_s()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    cpu = _children_cpu_s() - cpu0
    found = _RPS.findall(out)
    if not found:
        raise RuntimeError(f"cannot read redis-benchmark's output: {out[-300:]!r}")
    return float(found[-1]), cpu


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for command-line arguments ``argv``; returns the exit status."""
    args = build_parser().parse_args(argv)
    check_args(args)
    import redis  # the remote extra

    from ..tiers.remote import RemoteStore
    from ..tiers.remote.values import value_bytes

    layout = _layout(args)
    page = layout.page_bytes(args.page_size)
    pages = max(1, int(args.gib * 2**30) // page)
    ns0 = Namespace.for_layout("bench-remote", layout, args.page_size)
    value = value_bytes(ns0, 0)
    kinds = len(layout.payloads)
    keys, total = pages * kinds, pages * kinds * value
    src = HostPool(layout, args.page_size, pages, pin=False)
    dst = HostPool(layout, args.page_size, pages, pin=False)
    gen = torch.Generator().manual_seed(0)
    for t in src.tensors():
        t.view(torch.uint8).random_(0, 256, generator=gen)
    depth = args.batch_pages * kinds
    # a publish has up to publish_window batches in flight: redis-benchmark gets that depth too
    set_depths = sorted({depth, depth * args.publish_window, 1}, reverse=True)
    bench_common = ["-n", str(keys), "-r", str(keys), "-c", str(args.threads)]
    rounds: dict[str, list[float]] = {"publish": [], "set": [], "fetch": [], "get": []}
    cpu_s: dict[str, float] = dict.fromkeys(rounds, 0.0)  # client CPU seconds, all rounds

    def note(op: str, bytes_per_s: float, cpu: float) -> None:
        rounds[op].append(bytes_per_s)
        cpu_s[op] += cpu

    verified = True
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-bench-remote-"))
    server = _Server(workdir)
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        blob = bytes(value)
        for r in range(args.repeat):
            admin.flushall()
            ns = Namespace.for_layout(f"bench-remote-{r}", layout, args.page_size)
            cfg = RemoteConfig(
                url,
                budget_bytes=2 * total + (1 << 20),
                batch_pages=args.batch_pages,
                threads=args.threads,
                publish_window=args.publish_window,
                timeout_s=30.0,
                tune_malloc=args.tune_malloc,
            )
            store = RemoteStore(ns, 0, cfg)
            try:
                hashes = [bytes([r % 256]) + i.to_bytes(31, "little") for i in range(pages)]
                for t in dst.tensors():
                    t.view(torch.uint8).zero_()
                # Every timed write starts on an emptied server and writes new keys (a new
                # value costs the server fresh memory: twice an overwrite's time, measured).
                note("set", *_set_round(admin, server.port, bench_common, set_depths, value))
                admin.flushall()
                note("publish", *_publish(store, src, hashes, args.ticket_pages, total))
                ours_first = r % 2 == 0  # reads alternate who goes first
                # redis-benchmark's GET reads key:000000000000 ... : the same number of values
                pipe = admin.pipeline(transaction=False)
                for i in range(keys):
                    pipe.set(f"key:{i:012d}", blob)
                    if i % 64 == 63:
                        pipe.execute()
                pipe.execute()
                if not ours_first:
                    note("get", *_get_round(server.port, bench_common, depth, value))
                note("fetch", *_fetch(store, dst, hashes, args.ticket_pages, total))
                if ours_first:
                    note("get", *_get_round(server.port, bench_common, depth, value))
                verified &= all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(src.tensors(), dst.tensors(), strict=True)
                )
                stats = store.stats()
            finally:
                store.close()
        admin.close()
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    med = {k: statistics.median(v) / 1e9 for k, v in rounds.items()}
    pub_ratio, fetch_ratio = med["publish"] / med["set"], med["fetch"] / med["get"]
    import hiredis

    print(
        f"geometry   {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} x "
        f"{args.dtype}, page {args.page_size}, K+V: {page / 2**20:.2f} MiB a page, "
        f"value {value:,} bytes"
    )
    print(
        f"pages      {pages:,} ({total / 2**30:.2f} GiB of values, {keys:,} keys), "
        f"{args.repeat} rounds, median; {args.threads} connections, {depth} values a round trip, "
        f"{args.publish_window} SET round trip(s) in flight on each (redis-benchmark: the "
        f"fastest of -P {' / '.join(map(str, set_depths))} for SET, -P {depth} / 1 for GET)"
    )
    print(
        f"client     redis-py {redis.__version__} + hiredis {hiredis.__version__}, malloc "
        f"{'tuned' if stats.malloc_tuned else 'default'}; server redis {server.version}"
        f" on loopback; verified {'every byte' if verified else 'MISMATCH'}"
    )
    gb = total * args.repeat / 1e9
    cpu = {k: v / gb for k, v in cpu_s.items()}  # client CPU seconds per GB moved
    print(
        f"{'op':<9}{'kvstrata GB/s':>15}{'redis-benchmark GB/s':>23}{'ratio':>8}"
        f"{'client CPU s/GB: ours':>24}{'theirs':>8}"
    )
    for op, ref, cmd, ratio in (
        ("publish", "set", "SET", pub_ratio),
        ("fetch", "get", "GET", fetch_ratio),
    ):
        print(
            f"{op:<9}{med[op]:>15.2f}{med[ref]:>19.2f} {cmd}{ratio:>8.2f}"
            f"{cpu[op]:>24.2f}{cpu[ref]:>8.2f}"
        )
    result = {
        "bench": "remote",
        "pages": pages,
        "page_bytes": page,
        "value_bytes": value,
        "keys": keys,
        "verified": verified,
        "malloc_tuned": stats.malloc_tuned,
        "publish_gbps": round(med["publish"], 3),
        "set_gbps": round(med["set"], 3),
        "publish_ratio": round(pub_ratio, 3),
        "fetch_gbps": round(med["fetch"], 3),
        "get_gbps": round(med["get"], 3),
        "fetch_ratio": round(fetch_ratio, 3),
        "rounds_gbps": {k: [round(x / 1e9, 3) for x in v] for k, v in rounds.items()},
        "client_cpu_s_per_gb": {k: round(v, 3) for k, v in cpu.items()},
        "verify_failures": stats.verify_failures,
        "writes_skipped": stats.writes_skipped,
        "args": vars(args),
    }
    print(json.dumps(result))
    return 0 if verified else 1


def _set_round(
    admin: Any, port: int, common: list[str], depths: list[int], value: int
) -> tuple[float, float]:
    """redis-benchmark's SET of ``value``-byte values to new keys on an emptied server, the
    fastest of pipelines ``depths`` deep: bytes per second, and its CPU seconds then."""
    argv = ["-t", "set", "-d", str(value), *common, "-r", str(_NEW_KEYS)]  # the last -r wins
    runs = []
    for p in depths:
        admin.flushall()
        runs.append(_redis_benchmark(port, [*argv, "-P", str(p)]))
    rps, cpu = max(runs)
    return rps * value, cpu


def _get_round(port: int, common: list[str], depth: int, value: int) -> tuple[float, float]:
    """redis-benchmark's GET of the ``key:...`` values, as :func:`_set_round`."""
    argv = [*common, "GET", "key:__rand_int__"]
    rps, cpu = max(_redis_benchmark(port, ["-P", str(p), *argv]) for p in (depth, 1))
    return rps * value, cpu


def _publish(
    store: RemoteStore, pool: HostPool, hashes: list[bytes], ticket_pages: int, total: int
) -> tuple[float, float]:
    """Publish every page (host slot i holds hashes[i]): bytes per second until all are in the
    store, and this process's CPU seconds meanwhile."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    tickets = [
        [(h, i, 1) for i, h in enumerate(hashes[s : s + ticket_pages], start=s)]
        for s in range(0, len(hashes), ticket_pages)
    ]
    done = 0
    for n, pages in enumerate(tickets):
        while not store.publish(n, pages, pool):
            done += _reap_published(store)
            time.sleep(0.0005)
    store.flush(600)
    done += _reap_published(store)
    assert done == len(tickets)
    return total / (time.perf_counter() - t0), time.process_time() - cpu0


def _reap_published(store: RemoteStore) -> int:
    got = store.poll()
    for d in got.published:
        if d.failed:
            raise RuntimeError(f"{len(d.failed)} pages were not published: {store.stats()}")
    return len(got.published)


def _fetch(
    store: RemoteStore, pool: HostPool, hashes: list[bytes], ticket_pages: int, total: int
) -> tuple[float, float]:
    """Fetch every page into host slot i: bytes per second until all are verified and copied,
    and this process's CPU seconds meanwhile."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    done = 0
    starts = range(0, len(hashes), ticket_pages)
    for n, s in enumerate(starts):
        chunk = hashes[s : s + ticket_pages]
        while not store.fetch(n, chunk, pool, list(range(s, s + len(chunk)))):
            done += _reap_fetched(store)
            time.sleep(0.0005)
    store.flush(600)
    done += _reap_fetched(store)
    assert done == len(starts)
    return total / (time.perf_counter() - t0), time.process_time() - cpu0


def _reap_fetched(store: RemoteStore) -> int:
    got = store.poll()
    for d in got.fetched:
        if not all(d.ok):
            raise RuntimeError(f"a fetch missed pages: {store.stats()}")
    return len(got.fetched)


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main` with kvstrata's one-line errors and exit codes (``kvstrata bench remote``)."""
    return run_command(PROG, lambda: main(argv))


if __name__ == "__main__":
    raise SystemExit(run_main())
