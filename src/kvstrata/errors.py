"""Typed errors raised by kvstrata.

Everything kvstrata raises on purpose derives from :class:`KVStrataError`::

    KVStrataError
    ├── ConfigError              bad configuration or argument; the message says what to change
    │   └── InvalidTokensError   an empty key, or token ids outside [0, 2**32)
    ├── CapacityError            a pool or lane cannot hold what was asked, even after eviction
    │   └── PinnedMemoryError    the host pool's memory cannot be pinned
    ├── AllocatorError           misuse of a page allocator (a contract violation)
    │   ├── DoubleFreeError      a page freed that is already free
    │   ├── ForeignPageError     a page freed into a lane that does not own it
    │   └── UnknownPageError     a page id outside the allocator's page space
    ├── TreeInvariantError       a radix tree ``check()`` found a broken invariant
    ├── TreeUsageError           a radix tree call against its contract (pages it already holds,
    │                            an evicted node, a residency change from the wrong state)
    ├── PoolInvariantError       a pool's ``check()`` found a broken invariant
    ├── TransferError            a transfer (tier-to-tier copy) used against its contract
    │   └── TransferTimeoutError a bounded wait for copies ran out
    ├── ModelError               a checkpoint or model that kvstrata cannot load
    │   ├── CheckpointError      missing config/weights, or a weight of the wrong shape
    │   └── UnsupportedArchitectureError
    ├── DiskStoreError           the disk tier (L3) cannot start on its directory: unwritable,
    │   │                        too small for the budget, in use by another process, O_DIRECT
    │   │                        required but missing, or a store that cannot be opened
    │   └── DiskFormatError      a slab or index of another geometry or format version
    ├── WorkloadError            a malformed trace file (line number in the message)
    ├── CollectiveError          a collective across CP ranks failed or timed out (names the step)
    ├── DivergenceError          ranks' replicated state or configuration differ (names what)
    ├── RequestError             one request cannot be served (the others are unaffected)
    ├── HandoffError             a prefill -> decode handoff that cannot be assembled
    └── PeerError                a benchmark's peer binary failed or printed no result

Programmer errors inside kvstrata are ``assert``-ed; errors caused by input from the outside world
are raised as one of the types above, never swallowed.
"""

from __future__ import annotations


class KVStrataError(Exception):
    """Base class of every error kvstrata raises on purpose."""


class ConfigError(KVStrataError, ValueError):
    """A configuration value or argument is invalid; the message names it and what to change."""


class InvalidTokensError(ConfigError):
    """A token key is empty or holds ids outside [0, 2**32)."""


class CapacityError(KVStrataError):
    """A pool or lane cannot hold what was asked for, even after eviction."""


class PinnedMemoryError(CapacityError):
    """Host memory for the L2 pool could be allocated but not pinned (page-locked)."""


class AllocatorError(KVStrataError):
    """A page allocator was used against its contract."""


class DoubleFreeError(AllocatorError):
    """A page was freed while already free."""


class ForeignPageError(AllocatorError):
    """A page was freed into a lane (owner rank) that does not store it."""


class UnknownPageError(AllocatorError):
    """A page id lies outside the allocator's logical page space."""


class TreeInvariantError(KVStrataError):
    """``RadixTree.check()`` found a broken invariant."""


class TreeUsageError(KVStrataError):
    """A radix tree call broke its contract; refused before the tree changed."""


class PoolInvariantError(KVStrataError):
    """A pool's ``check()`` found a broken invariant."""


class TransferError(KVStrataError):
    """A transfer was used against its contract (an unknown or closed ticket, a layer twice, a
    slot outside its pool, waiting on a failed load). Failed copies are not raised: they are
    reported by ``Transfer.poll()``."""


class TransferTimeoutError(TransferError):
    """A bounded wait for copies (``Transfer.wait`` / ``synchronize``) ran out of time."""


class ModelError(KVStrataError):
    """A model or checkpoint cannot be loaded."""


class CheckpointError(ModelError):
    """A checkpoint directory lacks config or weights, or a weight has the wrong shape."""


class UnsupportedArchitectureError(ModelError):
    """The checkpoint's architecture is not one kvstrata implements."""


class DiskStoreError(KVStrataError):
    """The disk tier (L3) refuses to start on its directory; the message says what to change.
    Failures while it runs (a write error, a page that fails verification) are counted and
    reported by ``DiskStore.poll()`` / ``stats()``, never raised."""


class DiskFormatError(DiskStoreError):
    """A slab file or index on disk has another geometry or format version than the store."""


class WorkloadError(KVStrataError):
    """A trace or workload file is malformed."""


class CollectiveError(KVStrataError):
    """A collective across context-parallel ranks failed or timed out: a peer died, hung, or
    runs a different configuration. The message names the operation and the engine step."""


class DivergenceError(KVStrataError):
    """Ranks that must hold identical replicated state (allocator digests, tree hash) or
    configuration do not; the message names the first component that differs."""


class RequestError(KVStrataError):
    """One request cannot be served; the other requests of its batch are unaffected."""


class HandoffError(KVStrataError):
    """A prefill -> decode handoff that cannot be assembled: another layout, a page or rank
    missing or doubled (:mod:`kvstrata.handoff`)."""


class PeerError(KVStrataError):
    """A peer benchmark binary (``kvstrata bench radix``'s SGLang tree) failed, hung, or printed
    no result line; the message names the binary and what it said."""
