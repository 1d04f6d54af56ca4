"""The connection to Redis (standalone or Cluster, through redis-py) and the circuit breaker in
front of it.

:class:`RedisClient` runs batched, non-transactional pipelines (GET, EXISTS, SET NX, DEL) with
socket connect and read timeouts and no client-side retries: a timeout or a connection error is
raised at once as :class:`StoreUnavailable`, and the :class:`Breaker` then keeps every call away
from the store for an interval, so a dead or paused store costs one timeout per interval, not one
per call. Server-side refusals of single commands (an OOM under ``noeviction``, a read-only
replica) come back as :class:`CommandError` in the result list, not raised.

A value is sent as its header and then the host pool's bytes themselves (``_Packer``, redis-py's
Python command packer taught :class:`~.values.PageValue`); the hiredis packer (the default where
hiredis is installed) would copy every value twice more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.cluster import RedisCluster as _RedisCluster
from redis.connection import Connection, PythonRespSerializer
from redis.retry import Retry

from .config import RemoteAddress
from .values import PageValue

log = logging.getLogger("kvstrata.remote")
#: Keys a SCAN asks for per round trip.
SCAN_COUNT = 1000
#: glibc mallopt parameters (malloc.h) and the values :func:`tune_malloc` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit
_TRIM_THRESHOLD = 256 << 20


class StoreUnavailable(Exception):
    """A round trip timed out or the connection failed (``timeout`` says which)."""

    def __init__(self, message: str, timeout: bool) -> None:
        super().__init__(message)
        self.timeout = timeout


class CommandError(Exception):
    """The server refused one command of a pipeline (its message says why)."""


class _Packer(PythonRespSerializer):
    """redis-py's Python command packer, which also sends a :class:`~.values.PageValue`
    argument as its header and the host pool's own bytes: no copy on the way to the socket."""

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if not any(isinstance(a, PageValue) for a in args):
            return super().pack(*args)
        assert isinstance(args[0], str) and " " not in args[0], "one-word commands only"
        out: list[bytes | memoryview] = []
        buff = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, PageValue):
                out.append(buff + b"$%d\r\n" % arg.nbytes + arg.header)
                out.extend(arg.parts)
                buff = b"\r\n"
            else:
                enc = self.encode(arg)
                buff += b"$%d\r\n%s\r\n" % (len(enc), enc)
        out.append(buff)
        return out


class _Connection(Connection):
    """A redis-py connection that sends large values without copying them."""

    def _construct_command_packer(self, packer: Any) -> Any:
        return _Packer(self._buffer_cutoff, self.encoder.encode)


_TUNED = threading.Lock()
_tuned = False


def tune_malloc() -> bool:
    """Raise glibc's mmap threshold (32 MiB) and trim threshold (256 MiB), once per process.

    Every value read arrives as a Python ``bytes`` of a quarter MiB or more; by default glibc
    serves each from fresh ``mmap`` pages or trims the heap after each batch, so every read pays
    its page faults again (half the fetch time, measured). Freed memory is kept for reuse
    instead: the process keeps its peak heap. Returns whether the thresholds are now set."""
    global _tuned
    with _TUNED:
        if not _tuned:
            name = ctypes.util.find_library("c")
            libc = ctypes.CDLL(name) if name else None
            mallopt = getattr(libc, "mallopt", None)
            if mallopt is not None:
                _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
                    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
                )
            if not _tuned:
                log.warning("shared tier: cannot tune malloc (not glibc?); reads fault pages")
        return _tuned


class Breaker:
    """Closed (calls go through) or open for ``interval_s`` after a failure; when the interval
    is over, one call at a time probes the store and closes the breaker if it succeeds. Wall
    clock only decides whether this rank tries its I/O, never what the tree holds."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self._clock = interval_s, clock
        self._lock = threading.Lock()
        self._open_until: float | None = None  # None: closed
        self._probing = False

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None

    def blocked(self) -> bool:
        """Whether a call would be refused now (without taking the probe)."""
        with self._lock:
            return self._open_until is not None and (
                self._probing or self._clock() < self._open_until
            )

    def allow(self) -> bool:
        """Whether a call may go to the store now."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._open_until, self._probing = None, False

    def failure(self) -> bool:
        """Open (again) for an interval; True when this call opened it."""
        with self._lock:
            opened = self._open_until is None or self._probing
            self._open_until, self._probing = self._clock() + self.interval_s, False
            return opened


def _unavailable(err: Exception) -> StoreUnavailable:
    timeout = isinstance(err, redis.exceptions.TimeoutError)
    return StoreUnavailable(f"{type(err).__name__}: {err}", timeout)


#: What a lost or unreachable server raises in redis-py (a cluster adds its own kinds).
_DOWN = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.RedisClusterException,
    OSError,
)


class RedisClient:
    """Pipelines against one store; safe to call from several threads at once."""

    def __init__(self, address: RemoteAddress, timeout_s: float, max_connections: int) -> None:
        self.address = address
        common: dict[str, Any] = {
            "username": address.username,
            "password": address.password,
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "socket_keepalive": True,
        }
        self._redis: redis.Redis | _RedisCluster
        if address.kind == "standalone":
            host, port = address.nodes[0]
            pool = redis.ConnectionPool(
                host=host,
                port=port,
                db=address.db,
                connection_class=_Connection,
                max_connections=max_connections + 2,
                retry=Retry(NoBackoff(), 0),
                **common,
            )
            self._redis = redis.Redis(connection_pool=pool)
        else:
            # The url form is the one that takes a connection class; the seeds follow it.
            host, port = address.nodes[0]
            try:
                self._redis = _RedisCluster(
                    url=f"redis://{host}:{port}",
                    startup_nodes=[ClusterNode(h, p) for h, p in address.nodes],
                    connection_class=_Connection,
                    retry=Retry(NoBackoff(), 0),
                    require_full_coverage=False,
                    max_connections=max_connections + 2,
                    **common,
                )
            except _DOWN as err:  # no seed node answered
                raise _unavailable(err) from None

    def _pipeline(self, build: Callable[[Any], None]) -> list[Any]:
        """Run one pipeline; per-command refusals become :class:`CommandError` entries."""
        try:
            pipe = self._redis.pipeline(transaction=False)
            build(pipe)
            results = pipe.execute(raise_on_error=False)
        except _DOWN as err:
            raise _unavailable(err) from None
        out: list[Any] = []
        for r in results:
            if isinstance(r, _DOWN):  # one cluster node down: the whole call counts as down
                raise _unavailable(r)
            out.append(CommandError(str(r)) if isinstance(r, Exception) else r)
        return out

    def get(self, keys: Sequence[bytes]) -> list[bytes | None | CommandError]:
        def build(pipe: Any) -> None:
            for k in keys:
                pipe.get(k)

        return self._pipeline(build)

    def exists(self, keys: Sequence[bytes]) -> list[bool | CommandError]:
        def build(pipe: Any) -> None:
            for k in keys:
                pipe.exists(k)

        return [r if isinstance(r, CommandError) else bool(r) for r in self._pipeline(build)]

    def set_new(
        self, items: Sequence[tuple[bytes, PageValue]], ttl_s: int
    ) -> list[bool | CommandError]:
        """SET NX (with EX ``ttl_s`` when > 0) of each item: True where the key was new."""

        def build(pipe: Any) -> None:
            for k, v in items:
                pipe.set(k, v, nx=True, ex=ttl_s or None)

        return [r if isinstance(r, CommandError) else bool(r) for r in self._pipeline(build)]

    def delete(self, keys: Sequence[bytes]) -> None:
        def build(pipe: Any) -> None:
            for k in keys:
                pipe.delete(k)

        self._pipeline(build)

    def scan(self, pattern: str) -> Iterator[bytes]:
        """Every key matching ``pattern`` (all primaries of a cluster)."""
        try:
            yield from self._redis.scan_iter(match=pattern, count=SCAN_COUNT)
        except _DOWN as err:
            raise _unavailable(err) from None

    def ping(self) -> None:
        try:
            self._redis.ping()
        except _DOWN as err:
            raise _unavailable(err) from None

    def close(self) -> None:
        self._redis.close()
