"""The shared tier across hosts: a Redis (or Redis Cluster) store of verified pages that several
prefill instances publish to and fetch from (docs/design.md, "Shared tier").

``RemoteStore`` (``store.py``) needs the ``remote`` extra (redis-py); the configuration and
results here do not, so they import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import RemoteAddress, RemoteConfig, parse_url, password_from_env
from .results import FetchDone, PublishDone, RemotePoll, RemoteStats

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name == "RemoteStore":
        from .store import RemoteStore

        return RemoteStore
    raise AttributeError(name)
