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
from collections import OrderedDict
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
#: A prefix fingerprint of :class:`PrefixHasher`: a radix prefix key, or BLAKE2b bytes.
Print = int | bytes
_POWERS = 1 << np.arange(63, dtype=np.int64)  # page counts 1, 2, 4, ...


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


class PrefixHasher:
    """:func:`page_hashes` of one namespace that reuses the chain of a recent sequence sharing a
    prefix: requests of a conversation or an agent's session repeat the earlier ones' pages, and
    hashing them again was a tenth of a disk-tier replay's engine thread. The result is exactly
    :func:`page_hashes`'s (the chain continues from the last shared page's hash, the shared
    length found by comparing tokens); only the time differs.

    A sequence is found by fingerprints of its first 1, 2, 4, 8, ... pages (the radix tree's
    prefix keys of those pages when the caller passes them, else BLAKE2b over the tokens, one
    pass; either way a candidate is confirmed by comparing tokens): the longest fingerprint of
    a new sequence that a kept one has names the candidate. At most ``sequences`` are kept, and
    ``max_tokens`` of their tokens (64 MiB at the default: the last one is kept whatever its
    length), least recently used dropped first (256: on ``agentic:0:1000`` 68 % of the pages came
    from a chain, 41 % with 64). A sequence that extends a kept one (a conversation's next turn)
    replaces it: the new one has every fingerprint the old one had, so a session takes one place,
    not one a turn (on ``agentic:0:3000`` pages hashed 2.47 M -> 0.85 M of 8.68 M, the new ones
    0.74 M)."""

    def __init__(
        self, namespace: Namespace, sequences: int = 256, max_tokens: int = 1 << 24
    ) -> None:
        if sequences < 1 or max_tokens < 1:
            raise ConfigError(
                f"a prefix hasher keeps >= 1 sequence and token, got {sequences} / {max_tokens}"
            )
        self.namespace, self.sequences, self.max_tokens = namespace, sequences, max_tokens
        self._kept_tokens = 0
        self._kept: OrderedDict[int, tuple[np.ndarray, list[bytes], list[Print]]] = OrderedDict()
        self._by_prefix: dict[Print, int] = {}  # fingerprint -> the kept sequence's number
        self._next = 0
        self.pages_hashed = 0  # pages whose hash was computed (the rest came from a chain)
        self.pages_reused = 0

    def _fingerprints(
        self, words: np.ndarray, num_pages: int, page_keys: np.ndarray | None
    ) -> list[Print]:
        """Fingerprints of the first 1, 2, 4, ... pages (page counts up to ``num_pages``): the
        prefix keys ``page_keys[k - 1]`` when given (no pass over the tokens; BLAKE2b lets go
        of the GIL on long inputs, and the engine thread then waited for it back each time while
        the disk tier's threads ran), else BLAKE2b of the tokens."""
        if page_keys is not None:
            return page_keys[_POWERS[: num_pages.bit_length()] - 1].tolist()
        data, step = (
            memoryview(words.astype("<u4", copy=False).tobytes()),
            4 * self.namespace.page_size,
        )
        m, done, k = hashlib.blake2b(digest_size=16), 0, 1
        out: list[Print] = []
        while k <= num_pages:
            m.update(data[done * step : k * step])
            out.append(m.copy().digest())
            done, k = k, 2 * k
        return out

    def __call__(
        self, tokens: Sequence[int] | np.ndarray, page_keys: np.ndarray | None = None
    ) -> list[bytes]:
        """:func:`page_hashes` ``(namespace, tokens)``. ``page_keys``: the tokens' prefix keys
        (:attr:`~kvstrata.cache.keys.TokenKey.page_keys`, of this namespace's page size), at
        least one per full page, used as fingerprints; pass them always or never to one hasher
        (a BLAKE2b fingerprint never equals a key, so a mix only finds fewer chains)."""
        P = self.namespace.page_size
        if len(tokens) == 0:
            return []
        words = as_token_array(tokens)  # refuses what page_hashes refuses, short or not
        num_pages = words.size // P
        if num_pages == 0:
            return []
        words = words[: num_pages * P]
        if page_keys is not None and (page_keys.ndim != 1 or page_keys.size < num_pages):
            raise ConfigError(
                f"page_keys must hold a key per full page ({num_pages}), got shape "
                f"{page_keys.shape}"
            )
        prints = self._fingerprints(words, num_pages, page_keys)
        shared, chain, subsumed = 0, None, None
        for fp in reversed(prints):
            seq = self._by_prefix.get(fp)
            if seq is not None:
                seen, chain, _ = self._kept[seq]
                self._kept.move_to_end(seq)
                n = min(seen.size, words.size)
                differ = np.flatnonzero(seen[:n] != words[:n])
                shared = (int(differ[0]) if differ.size else n) // P
                if not differ.size and seen.size <= words.size:
                    subsumed = seq  # all of it starts this one (a conversation's next turn)
                break
        out = chain[:shared] if chain is not None else []
        if num_pages > shared:
            parent = out[-1] if out else ROOT_HASH
            out = out + page_hashes(self.namespace, words[shared * P :], parent=parent)
        self.pages_hashed += num_pages - shared
        self.pages_reused += shared
        if subsumed is not None:  # the new sequence finds whatever the old one would
            self._forget(subsumed)
        self._keep(words.copy(), out, prints)  # copies: the caller may change its array or list
        return list(out)

    def _keep(self, words: np.ndarray, hashes: list[bytes], prints: list[Print]) -> None:
        seq, self._next = self._next, self._next + 1
        self._kept[seq] = (words, hashes, prints)
        self._kept_tokens += words.size
        for fp in prints:
            self._by_prefix[fp] = seq
        while len(self._kept) > self.sequences or (
            self._kept_tokens > self.max_tokens and len(self._kept) > 1
        ):
            self._forget(next(iter(self._kept)))

    def _forget(self, seq: int) -> None:
        words, _, prints = self._kept.pop(seq)
        self._kept_tokens -= words.size
        for fp in prints:
            if self._by_prefix.get(fp) == seq:
                del self._by_prefix[fp]
