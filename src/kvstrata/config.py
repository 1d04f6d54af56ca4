"""Frozen, validated configuration. Every structural parameter of kvstrata lives here.

Each dataclass validates itself in ``__post_init__`` and raises :class:`~kvstrata.errors.ConfigError`
with a message that says which value to change. Nothing deep in the code reads globals or the
environment: configuration is built once (by the CLI or the caller) and passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .errors import ConfigError

#: dtype names a payload may use (torch dtypes by name, so this module needs no torch import).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "int8": 1}

EVICTION_POLICIES = ("lru", "slru")

#: How the L2 host pool lays pages out (``host_pool.py``); both copy at the same measured speed,
#: page_first keeps one page's layers in one extent (what the disk tier writes).
HostLayout = Literal["layer_first", "page_first"]
HOST_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first")
DEFAULT_HOST_LAYOUT: HostLayout = "page_first"

#: When device pages are backed up to the host tier (``writethrough.py``).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def _positive(name: str, value: int, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}{hint}")


@dataclass(frozen=True)
class CacheConfig:
    """How the prefix cache is paged, sharded and evicted.

    page_size: tokens per page, the unit of allocation, ownership, hashing and transfer.
    cp_size: ranks in the context-parallel group; page ``p`` of a sequence is owned by ``p % cp_size``.
    eviction: ``"lru"`` (logical-clock LRU) or ``"slru"`` (segmented LRU with a capped protected
        segment of nodes hit at least twice).
    protected_fraction: the cap of the SLRU protected segment, as a fraction of the tier capacity.
    """

    page_size: int = 16
    cp_size: int = 1
    eviction: str = "lru"
    protected_fraction: float = 0.2

    def __post_init__(self) -> None:
        _positive("page_size", self.page_size, " (tokens per page; 16 or 64 are typical)")
        _positive("cp_size", self.cp_size, " (ranks in the context-parallel group; 1 without CP)")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(
                f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}"
            )
        if not 0.0 < self.protected_fraction < 1.0:
            raise ConfigError(
                f"protected_fraction must lie in (0, 1), got {self.protected_fraction!r}"
            )


@dataclass(frozen=True)
class PayloadSpec:
    """One family of per-token KV tensors: its name, per-layer per-token shape and dtype.

    A page of this payload in one layer is a tensor of shape ``[page_size, *token_shape]``.
    ``num_layers``: the layers this payload has, the first ones of the layout (None: all of them);
    a speculative draft model with fewer layers than the target stores only its own.
    """

    name: str
    token_shape: tuple[int, ...]
    dtype: str = "float32"
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ConfigError(f"payload name must be a Python identifier, got {self.name!r}")
        if not self.token_shape or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in self.token_shape
        ):
            raise ConfigError(
                f"payload {self.name!r}: token_shape must be a non-empty tuple of positive ints, "
                f"got {self.token_shape!r}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"payload {self.name!r}: dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
            )
        if self.num_layers is not None:
            _positive(f"payload {self.name!r}: num_layers", self.num_layers)

    @property
    def token_bytes(self) -> int:
        """Bytes one token of this payload takes in one layer."""
        n = DTYPE_BYTES[self.dtype]
        for d in self.token_shape:
            n *= d
        return n


@dataclass(frozen=True)
class KVLayout:
    """What one page holds: every payload, in every layer."""

    num_layers: int
    payloads: tuple[PayloadSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _positive("num_layers", self.num_layers)
        if not self.payloads:
            raise ConfigError("a KV layout needs at least one payload (for example K and V)")
        names = [p.name for p in self.payloads]
        if len(set(names)) != len(names):
            raise ConfigError(f"payload names must be unique, got {names}")
        for p in self.payloads:
            if p.num_layers is not None and p.num_layers > self.num_layers:
                raise ConfigError(
                    f"payload {p.name!r} has {p.num_layers} layers, the layout {self.num_layers}"
                )

    def layers(self, payload: PayloadSpec | str) -> int:
        """How many layers ``payload`` has (the first ones of the layout)."""
        spec = self.payload(payload) if isinstance(payload, str) else payload
        return self.num_layers if spec.num_layers is None else spec.num_layers

    def page_bytes(self, page_size: int) -> int:
        """Bytes one page takes across all payloads and their layers."""
        return page_size * sum(self.layers(p) * p.token_bytes for p in self.payloads)

    def layer_bytes(self, layer: int) -> int:
        """Bytes one token takes in ``layer``, over the payloads that have it."""
        return sum(p.token_bytes for p in self.payloads if layer < self.layers(p))

    def payload(self, name: str) -> PayloadSpec:
        for p in self.payloads:
            if p.name == name:
                return p
        raise ConfigError(
            f"no payload named {name!r}; this layout has {[p.name for p in self.payloads]}"
        )


@dataclass(frozen=True)
class PoolConfig:
    """A tier's logical page space: ``num_pages`` logical pages striped over ``cp_size`` lanes."""

    num_pages: int
    cp_size: int = 1

    def __post_init__(self) -> None:
        _positive("cp_size", self.cp_size)
        if (
            isinstance(self.num_pages, bool)
            or not isinstance(self.num_pages, int)
            or self.num_pages < self.cp_size
        ):
            raise ConfigError(
                f"a pool of {self.num_pages!r} pages cannot hold one page per lane with "
                f"cp_size={self.cp_size}; give it at least {self.cp_size} pages "
                "(more tokens or a smaller page size)"
            )

    @property
    def slots_per_rank(self) -> int:
        """Rank-local slots each rank must provide (the busiest lane's page count)."""
        return -(-self.num_pages // self.cp_size)
