"""Token keys and their prefix-closed page hashes.

A :class:`TokenKey` wraps one request's token ids (``uint32``) and, computed once with numpy, the
hash of every page-boundary prefix::

    key(t) = (sum_{j < t} tokens[j] * W[j]  +  t * C)  mod 2**64        for a prefix of t tokens

``W`` is a fixed table of random odd 64-bit weights, one per position, drawn from a seeded
``numpy.random.PCG64`` (identical in every process, never ``hash()``); ``C`` folds the length in so
that a short page never collides with the same tokens followed by zeros. ``key(t)`` depends only on
the first ``t`` tokens, so the keys are *prefix-closed*: equal keys at a boundary mean (up to a
2**-64 collision) equal prefixes up to there. The tree uses them to find a child in O(1) and to
decide in O(1) whether a whole node matches; every hit is still confirmed against the tokens.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..errors import InvalidTokensError

U64Array = npt.NDArray[np.uint64]
U32Array = npt.NDArray[np.uint32]

_WEIGHT_SEED = 0x6B7673747261  # "kvstra"
_CHUNK = 1 << 16
_LEN_MULT = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_MAX_TOKEN = 1 << 32


def as_token_array(tokens: object) -> U32Array:
    """Validate token ids and return them as a 1-D ``uint32`` array (no copy when already one).

    Raises :class:`InvalidTokensError` for an empty key, a non-integer dtype, more than one
    dimension, or ids outside ``[0, 2**32)``.
    """
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidTokensError(f"a token key must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidTokensError("a token key must hold at least one token id, got an empty key")
    if arr.dtype == np.uint32:
        return arr
    if arr.dtype.kind not in "iu":
        raise InvalidTokensError(
            f"token ids must be integers, got dtype {arr.dtype}; pass token ids, not text or floats"
        )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= _MAX_TOKEN:
        bad = lo if lo < 0 else hi
        raise InvalidTokensError(f"token ids must lie in [0, 2**32), got {bad}")
    return arr.astype(np.uint32)


class PrefixHasher:
    """Computes prefix keys. Owns the per-position weight table, grown on demand.

    Chunk ``i`` of the table is drawn from ``PCG64([seed, i])``, so the weights are the same
    whatever order the table grows in, in every process.
    """

    def __init__(self, seed: int = _WEIGHT_SEED) -> None:
        self._seed = seed
        self._weights: U64Array = np.empty(0, dtype=np.uint64)
        # Reused for the per-token products: a fresh multi-hundred-KB temporary per request costs
        # more in page faults than the hashing itself.
        self._scratch: U64Array = np.empty(0, dtype=np.uint64)
        self._length_terms: dict[int, U64Array] = {}

    def weights(self, n: int) -> U64Array:
        if n > self._weights.size:
            chunks = [self._weights]
            for i in range(self._weights.size // _CHUNK, -(-n // _CHUNK)):
                rng = np.random.Generator(np.random.PCG64([self._seed, i]))
                chunks.append(rng.integers(0, 1 << 63, _CHUNK, dtype=np.uint64) * 2 + 1)
            self._weights = np.concatenate(chunks)
        return self._weights[:n]

    def length_terms(self, page_size: int, num_pages: int) -> U64Array:
        """``t * C mod 2**64`` for the prefix lengths ``t = page_size, 2 * page_size, ...``."""
        terms = self._length_terms.get(page_size)
        if terms is None or terms.size < num_pages:
            count = max(num_pages, 2 * (terms.size if terms is not None else 1024))
            t = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(page_size)
            terms = self._length_terms[page_size] = t * np.uint64(_LEN_MULT)
        return terms[:num_pages]

    def prefix_sums(self, tokens: U32Array) -> U64Array:
        """``cumsum(tokens * W)`` mod 2**64, in a scratch buffer valid until the next call."""
        n = tokens.size
        if n > self._scratch.size:
            self._scratch = np.empty(max(n, 2 * self._scratch.size), dtype=np.uint64)
        out = self._scratch[:n]
        np.multiply(tokens, self.weights(n), out=out)
        np.cumsum(out, out=out)
        return out

    def key(self, tokens: object, page_size: int) -> TokenKey:
        return TokenKey(as_token_array(tokens), page_size, self)

    def continue_keys(
        self, before_key: int, start: int, tokens: U32Array, page_size: int
    ) -> tuple[U64Array, int]:
        """Keys of a path continued by ``tokens`` from position ``start`` (a page boundary).

        ``before_key`` is the key of the path's first ``start`` tokens (0 for the empty path).
        Returns the keys at the full-page boundaries inside ``[start, start + len(tokens))`` and
        the key at its end: exactly what :class:`TokenKey` computes for the whole path, without
        the path's earlier tokens (``RadixTree.check`` verifies a node from its parent's key).
        """
        assert start % page_size == 0 and tokens.size >= 1, (start, page_size, tokens.size)
        n = tokens.size
        raw = (before_key - start * _LEN_MULT) & _MASK
        cum = np.cumsum(tokens * self.weights(start + n)[start:], dtype=np.uint64) + np.uint64(raw)
        first = start // page_size
        page_keys = (
            cum[page_size - 1 :: page_size]
            + self.length_terms(page_size, first + n // page_size)[first:]
        )
        end_key = (cum.item(n - 1) + (start + n) * _LEN_MULT) & _MASK
        return page_keys, end_key


class TokenKey:
    """One request's tokens plus its prefix keys at every full-page boundary and at its end.

    ``page_keys[i]`` is ``key((i + 1) * page_size)`` for each full page ``i``; ``end_key`` is
    ``key(len(tokens))``. Build it once per request and pass it to both match and insert.
    A tree that inserts the key copies the tokens each node needs; the key itself is not kept.
    """

    __slots__ = ("tokens", "page_size", "num_full_pages", "page_keys", "end_key")

    def __init__(self, tokens: U32Array, page_size: int, hasher: PrefixHasher) -> None:
        n = tokens.size
        self.tokens = tokens
        self.page_size = page_size
        self.num_full_pages = n // page_size
        cum = hasher.prefix_sums(tokens)
        self.page_keys: U64Array = cum[page_size - 1 :: page_size] + hasher.length_terms(
            page_size, self.num_full_pages
        )
        self.end_key = (cum.item(n - 1) + n * _LEN_MULT) & _MASK

    def __len__(self) -> int:
        return int(self.tokens.size)

    def prefix(self, num_tokens: int) -> TokenKey:
        """The key of the first ``num_tokens`` tokens (a full-page boundary, or the whole key),
        without hashing again: prefix keys are prefix-closed."""
        if num_tokens == self.tokens.size:
            return self
        q, r = divmod(num_tokens, self.page_size)
        assert r == 0 and 1 <= q <= self.num_full_pages, (num_tokens, self.page_size)
        out = TokenKey.__new__(TokenKey)
        out.tokens = self.tokens[:num_tokens]
        out.page_size = self.page_size
        out.num_full_pages = q
        out.page_keys = self.page_keys[:q]
        out.end_key = int(self.page_keys[q - 1])
        return out

    def key_at(self, num_tokens: int) -> int:
        """The key of the prefix of ``num_tokens`` tokens, a full-page boundary or the end."""
        if num_tokens == self.tokens.size:
            return self.end_key
        q, r = divmod(num_tokens, self.page_size)
        assert r == 0 and q >= 1, (num_tokens, self.page_size)
        return int(self.page_keys[q - 1])

    def same_tokens(self, lo: int, other: U32Array) -> bool:
        """Whether ``tokens[lo : lo + len(other)]`` equals ``other`` (a node's own tokens)."""
        return self.tokens[lo : lo + other.size].tobytes() == other.tobytes()

    def same_prefix(self, other: U32Array, lo: int, hi: int) -> bool:
        """Whether ``tokens[lo:hi]`` equals ``other[lo:hi]`` (both long enough, both uint32)."""
        # Two memcpy + one memcmp: faster than array_equal's elementwise compare and reduction.
        return self.tokens[lo:hi].tobytes() == other[lo:hi].tobytes()
