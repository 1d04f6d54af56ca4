"""The shared tier's configuration: where the Redis store is (``RemoteAddress``) and how this rank
uses it (``RemoteConfig``).

URL forms::

    redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]                      one server (db 0 by default)
    redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]  Redis Cluster seed nodes

A password comes from the URL, else from ``RemoteConfig.password`` (the CLI fills it from
``REDIS_PASSWORD`` or ``REDISCLI_AUTH``). It never appears in a ``repr``, a log line, the
``--json`` summary or an error message: those show :attr:`RemoteAddress.shown`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote

from ...errors import ConfigError

DEFAULT_PORT = 6379
#: Environment variables a password is taken from when the URL has none, in this order.
PASSWORD_ENV = ("REDIS_PASSWORD", "REDISCLI_AUTH")
StoreKind = Literal["standalone", "cluster"]
_SCHEMES: dict[str, StoreKind] = {"redis": "standalone", "redis+cluster": "cluster"}
_FORMS = "redis://HOST:PORT[/DB] or redis+cluster://HOST:PORT[,HOST:PORT...]"


@dataclass(frozen=True)
class RemoteAddress:
    """A parsed store URL. ``password`` is kept out of ``repr``."""

    kind: StoreKind
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def shown(self) -> str:
        """The URL without its password: what logs, errors and the JSON summary show."""
        scheme = "redis+cluster" if self.kind == "cluster" else "redis"
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}{':***' if self.password else ''}@"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{auth}{hosts}" + (f"/{self.db}" if self.kind == "standalone" else "")


def _host_port(text: str, url_shown: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:PORT
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError(f"remote store URL {url_shown}: cannot read host {text!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError(f"remote store URL {url_shown}: a host is missing; use {_FORMS}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"remote store URL {url_shown}: port {port_text!r} is not in 1..65535")
    return host, int(port_text)


def parse_url(url: str, password: str | None = None) -> RemoteAddress:
    """The address ``url`` names (``password`` is used when the URL carries none)."""
    scheme, sep, rest = url.partition("://")
    kind = _SCHEMES.get(scheme.lower()) if sep else None
    if kind is None:
        raise ConfigError(f"remote store URL must look like {_FORMS}; got scheme {scheme!r}")
    auth, at, hosts = rest.rpartition("@")
    username: str | None = None
    if at:
        user, colon, secret = auth.partition(":")
        username = unquote(user) or None
        if colon:
            password = unquote(secret) or password
    shown_url = f"{scheme}://{'***@' if at else ''}{hosts}"  # for messages: no secret in them
    hosts, slash, path = hosts.partition("/")
    db = 0
    if slash and path:
        if kind == "cluster":
            raise ConfigError(f"remote store URL {shown_url}: Redis Cluster has no databases")
        if not path.isdigit():
            raise ConfigError(f"remote store URL {shown_url}: database {path!r} is not a number")
        db = int(path)
    nodes = tuple(_host_port(h.strip(), shown_url) for h in hosts.split(",") if h.strip())
    if not nodes:
        raise ConfigError(f"remote store URL {shown_url}: no host; use {_FORMS}")
    if kind == "standalone" and len(nodes) > 1:
        raise ConfigError(
            f"remote store URL {shown_url}: several hosts are Redis Cluster seed nodes; write "
            "redis+cluster://HOST:PORT,HOST:PORT"
        )
    return RemoteAddress(kind, nodes, db, username, password)


def password_from_env(environ: Mapping[str, str]) -> str | None:
    """The password the standard environment variables give (:data:`PASSWORD_ENV`), if any."""
    return next((environ[name] for name in PASSWORD_ENV if environ.get(name)), None)


@dataclass(frozen=True)
class RemoteConfig:
    """How one rank uses the shared store.

    url: see the module docstring; parsed (and validated) into :attr:`address`.
    budget_bytes: bytes of values this namespace may keep in the store, all ranks together
        (each rank counts its own keys against ``budget_bytes / cp_size``); writes past it are
        skipped and counted. Redis's own ``maxmemory`` and eviction policy bound the store.
    timeout_s: socket connect and read timeout of every round trip.
    breaker_s: after a timeout or connection error, the store answers misses at once (and
        skips writes) for this long, then tries again with one probe.
    min_hits: pages published with fewer hits are skipped (frequency-gated admission).
    ttl_s: expiry of every value written (0: none; Redis's eviction decides).
    batch_pages: pages per round trip (a pipeline of SETs or GETs of all their payloads; a
        publish asks which pages exist in one EXISTS pipeline per ticket first).
    threads: round trips in flight (each on its own connection and thread). 3 measured best on
        the H200 host (16 cores): fetch 0.79-0.86x ``redis-benchmark``'s GET against 0.71-0.77x
        with 2 (docs/benchmarks.md, "Shared tier").
    publish_window: SET batches a publish keeps in flight on one connection (a standalone
        store; a cluster's go one at a time): the next batch's values are made while the server
        stores the ones before, which can hide a network's round trip (only loopback was
        measured). On loopback (the H200 host, 3 connections) 1 measured 0.81-0.83x
        ``redis-benchmark``'s SET in four runs, 2 0.67-0.83x (docs/benchmarks.md, "Shared
        tier").
    max_tickets: publish and fetch tickets in flight or unpolled; more are refused.
    tune_malloc: raise glibc's mmap and trim thresholds once (``mallopt``) so that large
        short-lived allocations reuse heap memory instead of faulting fresh pages (it was worth
        x1.7 on fetches when each value was read into a new ``bytes``; values now land in
        reused buffers and the difference no longer shows: docs/benchmarks.md).
    password: used when the URL carries none (never shown).
    """

    url: str = field(repr=False)
    budget_bytes: int
    timeout_s: float = 0.5
    breaker_s: float = 5.0
    min_hits: int = 1
    ttl_s: int = 0
    batch_pages: int = 4
    threads: int = 3
    publish_window: int = 1
    max_tickets: int = 64
    tune_malloc: bool = True
    password: str | None = field(default=None, repr=False)
    address: RemoteAddress = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "address", parse_url(self.url, self.password))
        for name, least in (
            ("budget_bytes", 1),
            ("min_hits", 0),
            ("ttl_s", 0),
            ("batch_pages", 1),
            ("threads", 1),
            ("publish_window", 1),
            ("max_tickets", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"remote {name} must be an integer >= {least}, got {value!r}")
        if self.threads > 64:
            raise ConfigError(f"remote threads must be at most 64, got {self.threads}")
        if self.publish_window > 8:
            raise ConfigError(f"remote publish_window must be at most 8, got {self.publish_window}")
        for name in ("timeout_s", "breaker_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value <= 3600:
                raise ConfigError(f"remote {name} must lie in (0, 3600] seconds, got {value!r}")
