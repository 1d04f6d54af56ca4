"""Content addresses of the disk tier (L3): a namespace and prefix-chained page hashes.

A page on disk is named by what it holds, not by where a tree node put it::

    h_0 = SHA-256(ROOT_HASH ‖ ns ‖ tokens of page 0)          ROOT_HASH = 32 zero bytes
    h_i = SHA-256(h_{i-1}   ‖ ns ‖ tokens of page i)          tokens as little-endian uint32

``ns`` is :attr:`Namespace.digest`, a SHA-256 over a canonical encoding of everything that changes
a page's bytes: the weights' id, layer count, page size, every payload's name, per-token shape and dtype,
cp_size and the on-disk format version. Because the chain runs through every earlier page, ``h_i``
names the whole prefix up to page ``i``: equal hashes mean equal prefixes (up to a SHA-256
collision), so one hash is one position is one owner (``i % cp_size``), the same in every process,
on every machine and after a restart. Nothing here uses ``hash()`` or pickle.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cache.keys import as_token_array
from ..config import KVLayout, PayloadSpec
from ..errors import ConfigError

#: Version of the on-disk format (slot header, slab superblock, index encoding). A change of any
#: of them bumps it, which changes every namespace digest: old pages are never read as new ones.
FORMAT_VERSION = 1
HASH_BYTES = 32
#: The hash before the first page.
ROOT_HASH = bytes(HASH_BYTES)


@dataclass(frozen=True)
class Namespace:
    """What a page's bytes depend on, fingerprinted by :attr:`digest` (32 bytes).

    model_id: names the weights, not what a user typed: ``kvstrata.model.identity.weights_id``
        (a preset's name, seed and device type; a checkpoint's digest). Two models whose
        weights differ must have different ids, or one serves the other's KV.
    num_layers / payloads / page_size: the page geometry, as in :class:`~kvstrata.config.KVLayout`.
    cp_size: ranks of the context-parallel group (page ``i`` lives on rank ``i % cp_size``).
    """

    model_id: str
    num_layers: int
    payloads: tuple[PayloadSpec, ...]
    page_size: int
    cp_size: int = 1
    format_version: int = FORMAT_VERSION
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError(f"a namespace needs a model id (name or path), got {self.model_id!r}")
        for name in ("num_layers", "page_size", "cp_size", "format_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"namespace {name} must be an integer >= 1, got {value!r}")
        # Validates the payloads (non-empty, unique names) the same way a layout does.
        KVLayout(self.num_layers, tuple(self.payloads))
        object.__setattr__(self, "payloads", tuple(self.payloads))
        object.__setattr__(self, "digest", hashlib.sha256(self.canonical()).digest())

    @classmethod
    def for_layout(
        cls, model_id: str, layout: KVLayout, page_size: int, cp_size: int = 1
    ) -> Namespace:
        """The namespace of ``layout``'s pages of ``page_size`` tokens under ``model_id``."""
        return cls(model_id, layout.num_layers, layout.payloads, page_size, cp_size)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.payloads)

    @property
    def short(self) -> str:
        """The first 16 hex digits of the digest (file names, messages)."""
        return self.digest.hex()[:16]

    def payload_bytes(self, kind: int) -> int:
        """Bytes one page of payload ``kind`` (its index in ``payloads``) takes, all layers."""
        spec = self.payloads[kind]
        return self.layout.layers(spec) * self.page_size * spec.token_bytes

    def canonical(self) -> bytes:
        """The encoding the digest is taken over: sorted-key compact JSON, UTF-8."""
        doc = {
            "format": "kvstrata-l3",
            "format_version": self.format_version,
            "model_id": self.model_id,
            "num_layers": self.num_layers,
            "page_size": self.page_size,
            "cp_size": self.cp_size,
            "payloads": [
                [p.name, list(p.token_shape), p.dtype]
                + ([] if p.num_layers is None else [p.num_layers])
                for p in self.payloads
            ],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def page_hashes(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    parent: bytes = ROOT_HASH,
) -> list[bytes]:
    """The content address of every full page of ``tokens`` (a trailing partial page has none).

    ``parent`` continues a chain: the hashes of ``tokens[k * page_size:]`` with ``parent`` set
    to the hash of page ``k - 1`` equal ``page_hashes(namespace, tokens)[k:]``.
    """
    if len(parent) != HASH_BYTES:
        raise ConfigError(f"a parent page hash is {HASH_BYTES} bytes, got {len(parent)}")
    if len(tokens) == 0:
        return []
    words = as_token_array(tokens).astype("<u4", copy=False)
    page_size = namespace.page_size
    num_pages = words.size // page_size
    data = memoryview(words[: num_pages * page_size].tobytes())
    step = 4 * page_size
    out: list[bytes] = []
    h = parent
    for i in range(num_pages):
        m = hashlib.sha256(h)
        m.update(namespace.digest)
        m.update(data[i * step : (i + 1) * step])
        h = m.digest()
        out.append(h)
    return out
