"""Trace blocks into tokens: hash id ``h`` names the 512 tokens of ``numpy.random.PCG64(h)``.

Token ``j`` of block ``h`` is the high 32 bits of the ``j``-th raw output of
``numpy.random.PCG64(h)``, reduced modulo the vocabulary. Building that generator costs about
11 µs, two thirds of it in ``SeedSequence``'s hashing, and a trace names a new block for most of
its requests' tokens: on the conversation trace expanding the blocks took about a quarter of a
``--model none`` replay. So the seeding is done here, for all the new blocks of a request at
once, in numpy's uint32 arithmetic (``SeedSequence``'s ``mix_entropy`` and ``generate_state``,
then PCG64's two seeding steps in Python's integers), and one reused generator is set to each
block's state and drawn from. The outputs are numpy's own, bit for bit (numpy keeps both
algorithms stable across versions; ``tests/test_workloads.py`` compares them with
``PCG64(h)`` for ids from 0 to 2**64 - 1). Ids of more than 32 bits take numpy's own seeding.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import numpy.typing as npt

TokenArray = npt.NDArray[np.uint32]

# numpy/random/bit_generator.pyx (SeedSequence, pool size 4) and pcg64.h.
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_POOL = 4
_PCG_MULT = (2549297995355413924 << 64) | 4865540595714422341
_MASK128 = (1 << 128) - 1
_U32 = np.uint32


def _hashmix(value: npt.NDArray[np.uint32], const: int) -> tuple[npt.NDArray[np.uint32], int]:
    value = value ^ _U32(const)
    const = (const * _MULT_A) & 0xFFFFFFFF
    value = value * _U32(const)
    return value ^ (value >> _U32(16)), const


def _mix(x: npt.NDArray[np.uint32], y: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    r = _U32(_MIX_L) * x - _U32(_MIX_R) * y
    return r ^ (r >> _U32(16))


def seed_words(ids: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint64]:
    """``SeedSequence(h).generate_state(4, np.uint64)`` for every 32-bit id ``h``: ``[n, 4]``."""
    const = _INIT_A
    pool = []
    for i in range(_POOL):  # one entropy word (the id), the rest of the pool mixes zeros
        word, const = _hashmix(ids if i == 0 else np.zeros_like(ids), const)
        pool.append(word)
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                hashed, const = _hashmix(pool[src], const)
                pool[dst] = _mix(pool[dst], hashed)
    const = _INIT_B
    state = np.empty((ids.size, 8), dtype="<u4")
    for i in range(8):
        value = pool[i % _POOL] ^ _U32(const)
        const = (const * _MULT_B) & 0xFFFFFFFF
        value = value * _U32(const)
        state[:, i] = value ^ (value >> _U32(16))
    return state.view("<u8")


def pcg64_state(words: npt.NDArray[np.uint64]) -> dict[str, Any]:
    """PCG64's state after seeding it with ``words`` (one row of :func:`seed_words`)."""
    w = [int(x) for x in words]
    initstate, initseq = (w[0] << 64) | w[1], (w[2] << 64) | w[3]
    inc = ((initseq << 1) | 1) & _MASK128
    state = inc  # state 0, one step
    state = ((state + initstate) * _PCG_MULT + inc) & _MASK128
    return {
        "bit_generator": "PCG64",
        "state": {"state": state, "inc": inc},
        "has_uint32": 0,
        "uinteger": 0,
    }


def raw_to_tokens(raw: npt.NDArray[np.uint64], vocab_size: int) -> TokenArray:
    """Map raw PCG64 outputs to token ids: their high 32 bits, reduced modulo the vocabulary."""
    high = (raw >> np.uint64(32)).astype(np.uint32)
    if vocab_size < 1 << 32:
        high %= np.uint32(vocab_size)  # a 32-bit division: 4x faster than one of uint64
    return high


class BlockExpander:
    """Expands trace hash ids into tokens, keeping the ``max_blocks`` blocks used most recently
    (ids repeat heavily in traces; a block dropped is simply generated again, identically)."""

    def __init__(self, vocab_size: int, block_tokens: int, max_blocks: int) -> None:
        self.vocab_size = vocab_size
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, TokenArray] = OrderedDict()
        self._gen = np.random.PCG64(0)

    def expand(self, hash_ids: list[int], input_length: int) -> TokenArray:
        """The ``input_length`` tokens of a request whose blocks are ``hash_ids``."""
        return self.expand_many([(hash_ids, input_length)])[0]

    def expand_many(self, requests: list[tuple[list[int], int]]) -> list[TokenArray]:
        """:meth:`expand` of several requests, their new blocks seeded together (the seeding's
        numpy work is per call, not per block)."""
        B = self.block_tokens
        cached = self._blocks
        cut = [hash_ids[: -(-length // B)] for hash_ids, length in requests]
        new = [h for h in dict.fromkeys(h for ids in cut for h in ids) if h not in cached]
        fresh = self._generate(new) if new else {}
        out = []
        for ids, (_, length) in zip(cut, requests, strict=True):
            blocks = []
            for h in ids:
                tokens = cached.get(h)
                if tokens is not None:
                    cached.move_to_end(h)
                else:  # new, or dropped since by an earlier request of this call
                    fresh_tokens = fresh.get(h)
                    if fresh_tokens is None:
                        fresh_tokens = self._generate([h])[h]
                    tokens = cached[h] = fresh_tokens
                blocks.append(tokens)
                if len(cached) > self.max_blocks:
                    cached.popitem(last=False)
            blocks[-1] = blocks[-1][: length - (len(ids) - 1) * B]
            out.append(np.concatenate(blocks) if len(blocks) > 1 else blocks[0].copy())
        return out

    def _generate(self, new: list[int]) -> dict[int, TokenArray]:
        """The tokens of blocks ``new`` (distinct ids)."""
        raw = np.empty((len(new), self.block_tokens), dtype=np.uint64)
        small = [i for i, h in enumerate(new) if 0 <= h < 1 << 32]
        words = seed_words(np.array([new[i] for i in small], dtype=np.uint32))
        gen = self._gen
        for row, i in enumerate(small):
            gen.state = pcg64_state(words[row])  # type: ignore[assignment]
            raw[i] = gen.random_raw(self.block_tokens)
        for i, h in enumerate(new):  # past 32 bits: numpy's own seeding
            if not 0 <= h < 1 << 32:
                raw[i] = np.random.PCG64(h).random_raw(self.block_tokens)
        tokens = raw_to_tokens(raw, self.vocab_size)
        # A row of its own for each: a block kept does not keep the others of its call alive.
        return {h: tokens[i].copy() for i, h in enumerate(new)}
