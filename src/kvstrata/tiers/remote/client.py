"""The connection to Redis (standalone or Cluster, through redis-py) and the circuit breaker in
front of it.

:class:`RedisClient` runs batched, non-transactional pipelines (GET, EXISTS, SET NX, DEL) with
socket connect and read timeouts and no client-side retries: a timeout or a connection error is
raised at once as :class:`StoreUnavailable`, and the :class:`Breaker` then keeps every call away
from the store for an interval, so a dead or paused store costs one timeout per interval, not one
per call. Server-side refusals of single commands (an OOM under ``noeviction``, a read-only
replica) come back as :class:`CommandError` in the result list, not raised.

The page commands run on :mod:`.wire` (a SET sent from the host pool's own bytes, a GET read
straight into the caller's buffer), on redis-py's connections: standalone, one pool; a cluster,
each key's node's pool (redis-py keeps the slot map; a MOVED or ASK reply is a refused command
this once, and the map is read again). SCAN and PING go through redis-py itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.cluster import RedisCluster as _RedisCluster
from redis.retry import Retry

from .config import RemoteAddress
from .values import PageValue
from .wire import Call, Chunk, Into, WireConnection, command, set_command

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


_TUNED = threading.Lock()
_tuned = False


def tune_malloc() -> bool:
    """Raise glibc's mmap threshold (32 MiB) and trim threshold (256 MiB), once per process.

    When every value read arrived as a Python ``bytes`` of a quarter MiB or more, glibc served
    each from fresh ``mmap`` pages or trimmed the heap after each batch, so every read paid its
    page faults again (half the fetch time, measured then). The page commands now read into
    reused buffers (``wire.py``) and the difference no longer shows (docs/benchmarks.md); what
    is left of large short-lived allocations still reuses the heap. Freed memory is kept for
    reuse: the process keeps its peak heap. Returns whether the thresholds are now set."""
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

    def abandon(self) -> None:
        """A call that got through ended for a reason of its own (not the store's): a probe it
        held is given back, so that the next call probes instead."""
        with self._lock:
            self._probing = False

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


def _taken(reply: Any) -> Any:
    """A reply as the callers see it: a refusal of one command as a :class:`CommandError`; a
    node down or loading raised (the whole call counts as down)."""
    if isinstance(reply, _DOWN):
        raise reply
    if isinstance(reply, Exception):
        return CommandError(str(reply))
    return reply


def _was_new(reply: Any) -> bool | CommandError:
    """A SET NX's reply: True where the key was new."""
    return reply if isinstance(reply, CommandError) else reply is True


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
            "protocol": 2,  # wire.py reads RESP2
        }
        self._redis: redis.Redis | _RedisCluster
        if address.kind == "standalone":
            host, port = address.nodes[0]
            pool = redis.ConnectionPool(
                host=host,
                port=port,
                db=address.db,
                connection_class=WireConnection,
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
                    connection_class=WireConnection,
                    retry=Retry(NoBackoff(), 0),
                    require_full_coverage=False,
                    max_connections=max_connections + 2,
                    **common,
                )
            except _DOWN as err:  # no seed node answered
                raise _unavailable(err) from None

    def _pools(self, keys: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
        """Which connection pool serves which keys (by index), in first-key order."""
        r = self._redis
        if not isinstance(r, _RedisCluster):
            return [(r.connection_pool, list(range(len(keys))))]
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, key in enumerate(keys):
            node = r.get_node_from_key(key)
            pool = r.get_redis_connection(node).connection_pool
            groups.setdefault(node.name, (pool, []))[1].append(i)
        return list(groups.values())

    def _pipeline(
        self,
        keys: Sequence[bytes],
        chunks: Callable[[int], list[Chunk]],
        into: Callable[[int], Into] | None = None,
        each: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        """One command per key (``chunks(i)``), pipelined on each key's connection. Each reply
        (a per-command refusal as a :class:`CommandError`) goes to ``each(i, reply)`` as it
        arrives, a bulk value read into ``into(i)`` (see ``wire.WireConnection.exchange``);
        without ``each``, the replies come back in key order."""
        replies: list[Any] = [None] * len(keys)
        moved = False

        def deliver(i: int, r: Any) -> None:
            nonlocal moved
            moved |= isinstance(r, redis.exceptions.AskError)  # MOVED is an AskError
            r = _taken(r)
            if each is None:
                replies[i] = r
            else:
                each(i, r)

        try:
            for pool, idx in self._pools(keys):
                conn = pool.get_connection()
                try:
                    conn.exchange(
                        [c for i in idx for c in chunks(i)],
                        [into(i) for i in idx] if into is not None else [None] * len(idx),
                        lambda j, r, idx=idx: deliver(idx[j], r),
                    )
                finally:
                    pool.release(conn)
        except _DOWN as err:
            raise _unavailable(err) from None
        finally:
            if moved:
                self._reread_slots()
        return replies

    def _reread_slots(self) -> None:
        """A cluster moved slots: read the slot map again (a failure here is the next call's)."""
        if isinstance(self._redis, _RedisCluster):
            try:
                self._redis.nodes_manager.initialize()
            except _DOWN as err:
                log.debug("shared tier: cannot read the cluster's slots: %s", err)

    def get(
        self,
        keys: Sequence[bytes],
        into: Callable[[int], Into],
        each: Callable[[int, Any], None],
    ) -> None:
        """GET of each key, handed to ``each(i, value)`` as it arrives: the value read into
        ``into(i)`` (one buffer or pieces, returned as given) when it is exactly that long
        (reusable once ``each`` returned), else in a buffer of its own; None where absent; a
        refusal as a :class:`CommandError`."""
        self._pipeline(keys, lambda i: [command(b"GET", keys[i])], into, each)

    def exists(self, keys: Sequence[bytes]) -> list[bool | CommandError]:
        got = self._pipeline(keys, lambda i: [command(b"EXISTS", keys[i])])
        return [r if isinstance(r, CommandError) else bool(r) for r in got]

    def set_new(
        self, items: Sequence[tuple[bytes, PageValue]], ttl_s: int
    ) -> list[bool | CommandError]:
        """SET NX (with EX ``ttl_s`` when > 0) of each item: True where the key was new."""
        keys = [k for k, _ in items]
        return [_was_new(r) for r in self._pipeline(keys, lambda i: set_command(*items[i], ttl_s))]

    def set_new_stream(
        self,
        batches: Iterable[Sequence[tuple[bytes, PageValue]]],
        ttl_s: int,
        done: Callable[[int, list[bool | CommandError]], None],
        window: int,
    ) -> None:
        """:meth:`set_new` of each batch in turn, handed to ``done(b, result)`` as batch ``b``'s
        replies arrive. On a standalone store the batches go over one connection with up to
        ``window`` of them in flight, each drawn from ``batches`` once the ones before it were
        sent (while the server stores them); a cluster's run one at a time (their keys spread
        over several nodes' connections). Raises :class:`StoreUnavailable` with the batches
        before the failure reported."""
        r = self._redis
        if isinstance(r, _RedisCluster):
            for b, items in enumerate(batches):
                done(b, self.set_new(items, ttl_s))
            return

        def calls() -> Iterator[Call]:
            for b, items in enumerate(batches):
                got: list[bool | CommandError] = [False] * len(items)

                def each(j: int, reply: Any, got: list[bool | CommandError] = got) -> None:
                    got[j] = _was_new(_taken(reply))

                chunks = [c for key, value in items for c in set_command(key, value, ttl_s)]
                yield Call(chunks, [None] * len(items), each, functools.partial(done, b, got))

        pool = r.connection_pool
        try:
            conn = pool.get_connection()
            try:
                assert isinstance(conn, WireConnection)  # the pool's connection class
                conn.exchange_many(calls(), window)
            finally:
                pool.release(conn)
        except _DOWN as err:
            raise _unavailable(err) from None

    def delete(self, keys: Sequence[bytes]) -> None:
        self._pipeline(keys, lambda i: [command(b"DEL", keys[i])])

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
