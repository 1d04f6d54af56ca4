"""The shared tier across hosts: a Redis (or Redis Cluster) store of verified pages that several
prefill instances publish to and fetch from (docs/design.md, "Shared tier")."""

from .config import RemoteAddress, RemoteConfig, parse_url, password_from_env
from .results import FetchDone, PublishDone, RemotePoll, RemoteStats
from .store import RemoteStore

__all__ = [
    "FetchDone",
    "PublishDone",
    "RemoteAddress",
    "RemoteConfig",
    "RemotePoll",
    "RemoteStats",
    "RemoteStore",
    "parse_url",
    "password_from_env",
]
