"""What fills the cache's pages: a real model, or deterministic synthetic payloads.

The engine schedules, matches, allocates and inserts identically for both; only the forward
differs. :class:`ModelCompute` runs the reference decoder and returns last-token logits.
:class:`SyntheticCompute` (``--model none``) writes ``kv_width`` bytes per token that are a pure
function of the token's whole prefix and position, as real KV is, so whole traces replay without a
model while the pool sees realistic traffic, and any page served from the cache can be checked byte
for byte.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from ..config import KVLayout, PayloadSpec
from ..errors import ConfigError
from ..tiers.pool import DevicePool
from .attention import ExchangeBytes
from .batch import ForwardBatch, LayerHooks
from .decoder import Decoder
from .layout import DRAFT_PREFIX


class Compute(Protocol):
    """One forward over a packed batch that writes every extend token's KV into the pool."""

    layout: KVLayout
    vocab_size: int
    max_seq_len: int  # the longest sequence it can compute (the model's positions)
    exchange: ExchangeBytes  # per layer and token, what a CP attention strategy moves

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        all_logits: bool = False,
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor | None:
        """Write the batch's KV; return ``[num_requests, vocab]`` last-token logits (``[T, vocab]``
        for every packed token with ``all_logits``), or None without a model. ``hooks`` see
        every layer before it reads the pool and after it wrote its KV."""
        ...

    def forward_pages(
        self,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        page_tables: Sequence[npt.NDArray[np.int64]],
        tokens: npt.NDArray[np.uint32],
        pool: DevicePool,
        hooks: LayerHooks | None = None,
    ) -> bool:
        """Write one packed step's KV straight from the requests' page tables, without a
        :class:`ForwardBatch`, where this compute can do with no more (synthetic payloads on a
        CPU pool: a copy per page, not an index per token); False where it needs :meth:`forward`
        (a model: logits, attention over the prefix). ``tokens``: the extends, packed."""
        ...

    def snapshot(
        self, pool: DevicePool, pages: npt.NDArray[np.int64], num_tokens: int
    ) -> torch.Tensor | None:
        """A CPU copy of a sequence's cached payload, where it is small enough to keep for
        verification (synthetic payloads); None where verification recomputes logits instead."""
        ...


class _ModelForward:
    """What every compute that runs a model shares: its KV needs a :class:`ForwardBatch`
    (attention over the prefix, logits), and verification recomputes logits instead of keeping
    the payload."""

    def forward_pages(
        self,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        page_tables: Sequence[npt.NDArray[np.int64]],
        tokens: npt.NDArray[np.uint32],
        pool: DevicePool,
        hooks: LayerHooks | None = None,
    ) -> bool:
        return False  # logits and attention need a ForwardBatch

    def snapshot(self, pool: DevicePool, pages: npt.NDArray[np.int64], num_tokens: int) -> None:
        return None


class ModelCompute(_ModelForward):
    """The reference decoder: its payloads per layer (K and V, or an MLA latent), last-token
    logits."""

    def __init__(self, model: Decoder, dtype: torch.dtype) -> None:
        self.model = model
        self.layout = model.config.kv_layout(str(dtype).removeprefix("torch."))
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = model.config.max_position_embeddings
        self.exchange = model.exchange_bytes()

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        all_logits: bool = False,
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        return self.model(
            input_ids, batch, pool, logits="all" if all_logits else "last", hooks=hooks
        )


class PairCompute(_ModelForward):
    """A target model and its speculative draft, prefilled in the same forward on the same pages.

    The draft's payloads (``draft_k`` / ``draft_v``, or ``draft_kv_latent``) are on the target's
    pages (same owners, same host and disk slots), so a cache hit restores both or neither. The draft runs first with
    the load-back waits only; the target then runs with every hook, so a layer's write-through
    backup starts once both models have written it. Logits come back ``[..., 2, vocab]``: the
    target's at index 0, the draft's at 1.
    """

    def __init__(self, target: Decoder, draft: Decoder, dtype: torch.dtype) -> None:
        self.target, self.draft = target, draft.use_payloads(DRAFT_PREFIX)
        name = str(dtype).removeprefix("torch.")
        self.layout = target.config.kv_layout(name, draft=draft.config)  # checks the pair
        self.vocab_size = target.config.vocab_size
        self.max_seq_len = min(
            target.config.max_position_embeddings, draft.config.max_position_embeddings
        )
        self.exchange = target.exchange_bytes().plus(draft.exchange_bytes())

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        all_logits: bool = False,
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        mode = "all" if all_logits else "last"
        waits = _WaitsOnly(hooks) if hooks is not None else None
        draft = self.draft(input_ids, batch, pool, logits=mode, hooks=waits)
        target = self.target(input_ids, batch, pool, logits=mode, hooks=hooks)
        return torch.stack((target, draft), dim=-2)


class _WaitsOnly:
    """The load-back half of a forward's hooks: a layer's write-through is submitted once, by the
    target's forward, after both models wrote it."""

    def __init__(self, hooks: LayerHooks) -> None:
        self._hooks = hooks

    def before_layer(self, layer: int) -> None:
        self._hooks.before_layer(layer)

    def after_layer(self, layer: int) -> None:
        pass


# Like real KV, a synthetic token's bytes depend on every token before it: each token carries the
# running state S_t = sum_{j <= t} (token_j + 1) * w(j) mod 2**31 in its first four bytes (little
# endian), and every other byte mixes S_t with the token and the byte's lane. A page copied from
# another prefix, or from another position, therefore carries the wrong bytes.
_STATE_MOD = 1 << 31
_STATE_MASK = _STATE_MOD - 1  # x mod 2**31 for any int64 x (two's complement)
_POS_MULT = 0x9E3779B1
_POS_ADD = 0x7F4A7C15
_TOKEN_MULT = 0x85EBCA77
_LANE_MULT = 0x27D4EB2F
_STATE_BYTES = 4


def _position_weights(positions: torch.Tensor) -> torch.Tensor:
    """``w(position)``, odd and below 2**31."""
    return ((positions * _POS_MULT + _POS_ADD) % _STATE_MOD) | 1


def _token_terms(tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(token + 1) * w(position) mod 2**31``; every factor stays below 2**32, the product below
    2**63, so int64 arithmetic is exact."""
    return ((tokens + 1) * weights) % _STATE_MOD


def _payload_bytes(
    state: torch.Tensor, tokens: torch.Tensor, kv_width: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[n, kv_width]`` uint8 (into ``out`` when given): the state's four little-endian bytes,
    then lanes that mix the state with the token and the lane (one int64 temporary of them)."""
    n = state.numel()
    if out is None:
        out = torch.empty((n, kv_width), dtype=torch.uint8, device=state.device)
    shift = torch.arange(0, 8 * _STATE_BYTES, 8, device=state.device, dtype=torch.int64)
    out[:, :_STATE_BYTES] = (state[:, None] >> shift) & 0xFF
    if kv_width > _STATE_BYTES:
        lanes = torch.arange(_STATE_BYTES, kv_width, device=state.device, dtype=torch.int64)
        mixed = tokens[:, None] * _TOKEN_MULT + (lanes * _LANE_MULT)[None, :]
        mixed.remainder_(_STATE_MOD).bitwise_xor_(state[:, None])
        mixed.bitwise_right_shift_(((lanes % _STATE_BYTES) * 8)[None, :]).bitwise_and_(0xFF)
        out[:, _STATE_BYTES:] = mixed
    return out


#: Tokens per chunk of :func:`synthetic_payload`: its int64 temporaries take about
#: ``8 * kv_width`` bytes per token, so a whole 10 M-token sequence at once would need tens of GB.
PAYLOAD_CHUNK_TOKENS = 1 << 16


def synthetic_payload(
    tokens: torch.Tensor, kv_width: int, chunk_tokens: int = PAYLOAD_CHUNK_TOKENS
) -> torch.Tensor:
    """``[n, kv_width]`` uint8: the bytes ``--model none`` stores for a whole sequence.

    Built ``chunk_tokens`` at a time, carrying the running state across chunks, so the memory it
    needs beyond its result does not grow with the sequence.
    """
    if chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    n = tokens.numel()
    out = torch.empty((n, kv_width), dtype=torch.uint8, device=tokens.device)
    carry = torch.zeros((), dtype=torch.int64, device=tokens.device)
    for lo in range(0, n, chunk_tokens):
        hi = min(n, lo + chunk_tokens)
        chunk = tokens[lo:hi].to(torch.int64)
        weights = _position_weights(torch.arange(lo, hi, device=tokens.device))
        # (carry + partial sums) mod M equals the whole sequence's cumsum mod M: carry is it, mod M.
        state = (torch.cumsum(_token_terms(chunk, weights), 0) + carry) % _STATE_MOD
        _payload_bytes(state, chunk, kv_width, out=out[lo:hi])
        carry = state[-1]
    return out


class SyntheticCompute:
    """``--model none``: one payload ``kv`` of ``kv_width`` bytes per token, no logits."""

    def __init__(self, kv_width: int, vocab_size: int) -> None:
        if kv_width < _STATE_BYTES:
            raise ConfigError(
                f"kv_width (bytes per token) must be >= {_STATE_BYTES}, got {kv_width}: each "
                "synthetic token carries a 4-byte state of its whole prefix"
            )
        self.kv_width = kv_width
        self.vocab_size = vocab_size
        self.max_seq_len = 1 << 31
        self.layout = KVLayout(num_layers=1, payloads=(PayloadSpec("kv", (kv_width,), "uint8"),))
        # Its CP forward exchanges no attention; ``auto``'s choice only labels the step.
        self.exchange = ExchangeBytes(kv=kv_width, queries=2 * kv_width, partials=2 * kv_width + 8)
        self._weight_table: torch.Tensor | None = None
        self._rows: tuple[DevicePool, npt.NDArray[np.uint8]] | None = None
        self._host_table: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: DevicePool,
        all_logits: bool = False,
        hooks: LayerHooks | None = None,
    ) -> None:
        if hooks is not None:
            hooks.before_layer(0)  # one layer: its prefix rows are read below
        if batch.cp is not None:
            self._forward_cp(batch, pool)
            if hooks is not None:
                hooks.after_layer(0)
            return None
        # Only the row of each request's last cached token is read: the work grows with the
        # tokens computed, not with the requests' contexts.
        if pool.device.type == "cpu":
            assert batch.page_table is not None and batch.table_starts is not None
            table = batch.page_table.numpy()
            starts = [*batch.table_starts.tolist(), table.size]
            self._write_pages(
                batch.prefix_lens,
                batch.extend_lens,
                [table[a:b] for a, b in itertools.pairwise(starts)],
                input_ids.numpy().astype(np.uint32),
                pool,
            )
        else:
            top = max(p + e for p, e in zip(batch.prefix_lens, batch.extend_lens, strict=True))
            self._forward_device(input_ids, batch, pool, self._weights(top, pool.device))
        if hooks is not None:
            hooks.after_layer(0)
        return None

    def forward_pages(
        self,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        page_tables: Sequence[npt.NDArray[np.int64]],
        tokens: npt.NDArray[np.uint32],
        pool: DevicePool,
        hooks: LayerHooks | None = None,
    ) -> bool:
        """On a CPU pool: write the step's payloads straight from the page tables (no
        :class:`ForwardBatch`); False on another device."""
        if pool.device.type != "cpu":
            return False
        if hooks is not None:
            hooks.before_layer(0)
        self._write_pages(prefix_lens, extend_lens, page_tables, tokens, pool)
        if hooks is not None:
            hooks.after_layer(0)
        return True

    def _write_pages(
        self,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        page_tables: Sequence[npt.NDArray[np.int64]],
        tokens: npt.NDArray[np.uint32],
        pool: DevicePool,
    ) -> None:
        """The forward on a CPU pool, in numpy, with no index per token.

        The running sums are taken in ``uint32``, whose wrap-around keeps them exact mod 2**32
        and so, after the final mask, mod 2**31 (half the bytes of int64 and no mask per step).
        Request ``i``'s extend covers positions ``[p, p + e)``; its rows go to its pages whole::

            positions   p ....................................... p + e
            pages       [ head: rows p % P .. P ][ full pages, one copy ][ tail: rows 0 .. ]
        """
        P, width = pool.page_size, self.kv_width
        grid = self._host_rows(pool).reshape(-1, P, width)  # [slot, row in page, byte]
        top = max(p + e for p, e in zip(prefix_lens, extend_lens, strict=True))
        weights = self._host_weights(top)
        state = np.empty(tokens.size, dtype=np.uint32)
        bounds = list(itertools.pairwise(itertools.accumulate(extend_lens, initial=0)))
        for p, (lo, hi) in zip(prefix_lens, bounds, strict=True):
            state[lo:hi] = weights[p : p + hi - lo]
        state *= tokens + np.uint32(1)
        np.cumsum(state, dtype=np.uint32, out=state)
        # Rebase each request's slice of the packed running sum onto its cached prefix's state:
        #   state = prefix_state + (running - running just before the request's first token)
        before = [int(state[lo - 1]) if lo else 0 for lo, _ in bounds]
        for p, (lo, hi), table, b in zip(prefix_lens, bounds, page_tables, before, strict=True):
            cached = 0
            if p:
                page, row = divmod(p - 1, P)
                cached = int.from_bytes(grid[table[page], row, :_STATE_BYTES].tobytes(), "little")
            state[lo:hi] += np.uint32((cached - b) % (1 << 32))
        state &= np.uint32(_STATE_MASK)
        payload = self._host_payload(state, tokens)
        pages = grid.reshape(-1).view(np.dtype((np.void, P * width)))  # [slot]: a page, whole
        for p, (lo, hi), table in zip(prefix_lens, bounds, page_tables, strict=True):
            _scatter_pages(grid, pages, table, p, payload[lo:hi])

    def _host_payload(
        self, state: npt.NDArray[np.uint32], tokens: npt.NDArray[np.uint32]
    ) -> npt.NDArray[np.uint8]:
        """``[T, kv_width]`` bytes: the state (little endian), then the mixed lanes."""
        n = state.size
        head = state.astype("<u4", copy=False).view(np.uint8).reshape(n, _STATE_BYTES)
        if self.kv_width == _STATE_BYTES:
            return head
        out = np.empty((n, self.kv_width), dtype=np.uint8)
        out[:, :_STATE_BYTES] = head
        lanes = np.arange(_STATE_BYTES, self.kv_width, dtype=np.int64)
        mixed = tokens.astype(np.int64)[:, None] * _TOKEN_MULT + (lanes * _LANE_MULT)[None, :]
        mixed &= _STATE_MASK
        mixed ^= state.astype(np.int64)[:, None]
        mixed >>= ((lanes % _STATE_BYTES) * 8)[None, :]
        mixed &= 0xFF
        out[:, _STATE_BYTES:] = mixed
        return out

    def _host_weights(self, num_positions: int) -> npt.NDArray[np.uint32]:
        """:meth:`_weights` on the CPU as ``uint32`` (every weight is below 2**31)."""
        if self._host_table.size < num_positions:
            table = self._weights(num_positions, torch.device("cpu"))
            self._host_table = table.numpy().astype(np.uint32)
        return self._host_table

    def _host_rows(self, pool: DevicePool) -> npt.NDArray[np.uint8]:
        """The pool's payload rows as a numpy view (made once per pool)."""
        if self._rows is None or self._rows[0] is not pool:
            self._rows = (pool, pool.token_view("kv", 0).numpy())
        return self._rows[1]

    def _forward_device(
        self, input_ids: torch.Tensor, batch: ForwardBatch, pool: DevicePool, table: torch.Tensor
    ) -> None:
        """The forward in torch ops, without a host sync (any device; CUDA uses it)."""
        rows = pool.token_view("kv", 0)
        tokens = input_ids.to(torch.int64)
        running = torch.cumsum(_token_terms(tokens, table[batch.positions]), 0)
        starts = batch.cu_seqlens[:-1]
        before = torch.where(starts > 0, running[(starts - 1).clamp(min=0)], 0)
        last = batch.prefix_last_row
        assert last is not None, "build the batch with ForwardBatch.build"
        prefix_state = torch.where(last >= 0, _decode_states(rows[last.clamp(min=0)]), 0)
        lengths = torch.tensor(batch.extend_lens, device=tokens.device)
        rebase = torch.repeat_interleave(prefix_state - before, lengths, output_size=tokens.numel())
        state = (running + rebase) & _STATE_MASK
        rows.index_copy_(0, batch.write_index, _payload_bytes(state, tokens, self.kv_width))

    def _weights(self, num_positions: int, device: torch.device) -> torch.Tensor:
        """``w(position)`` for positions ``[0, num_positions)`` at least, from a table grown on
        demand (a gather per token instead of four int64 ops)."""
        table = self._weight_table
        if table is None or table.device != self._pool_device(device):
            table = None  # another device: start over (comparing "cuda" with "cuda:0" is unequal)
        if table is None or table.numel() < num_positions:
            have = table.numel() if table is not None else 0
            size = max(num_positions, 2 * have, 1 << 16)
            table = self._weight_table = _position_weights(torch.arange(size, device=device))
        return table

    @staticmethod
    def _pool_device(device: torch.device) -> torch.device:
        """``device`` with its index, as tensors made on it report it."""
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def _forward_cp(self, batch: ForwardBatch, pool: DevicePool) -> None:
        """Under context parallelism: the running state of every extend token of the step (the
        tokens are replicated; each request's prefix state comes from the rank that holds its
        last prefix row), then this rank's rows only."""
        cp = batch.cp
        assert cp is not None
        rows = pool.token_view("kv", 0)
        tokens = cp.all_tokens.to(torch.int64)
        running = torch.cumsum(_token_terms(tokens, _position_weights(cp.all_positions)), 0)
        held = cp.prefix_last_rows >= 0
        states = torch.zeros(cp.prefix_last_rows.numel(), dtype=torch.int64, device=tokens.device)
        for i in torch.nonzero(held).flatten().tolist():
            states[i] = _decode_states(rows[int(cp.prefix_last_rows[i])][None])[0]
        states = cp.share(states)
        starts = torch.tensor(cp.ext_offsets[:-1], device=tokens.device)
        lengths = torch.tensor(
            [b - a for a, b in zip(cp.ext_offsets[:-1], cp.ext_offsets[1:], strict=True)],
            device=tokens.device,
        )
        before = torch.where(starts > 0, running[(starts - 1).clamp(min=0)], 0)
        state = (running + torch.repeat_interleave(states - before, lengths)) % _STATE_MOD
        mine = cp.mine
        rows.index_copy_(
            0, batch.write_index, _payload_bytes(state[mine], tokens[mine], self.kv_width)
        )

    def snapshot(
        self, pool: DevicePool, pages: npt.NDArray[np.int64], num_tokens: int
    ) -> torch.Tensor:
        """The sequence's payload rows as the pool holds them, for ``--verify``."""
        P = pool.page_size
        slots = torch.from_numpy(pages).to(pool.device)
        rows = (slots[:, None] * P + torch.arange(P, device=pool.device)).flatten()[:num_tokens]
        return pool.token_view("kv", 0).index_select(0, rows).cpu()


def _decode_states(rows: torch.Tensor) -> torch.Tensor:
    """The prefix states stored in the first four bytes of payload rows ``[R, kv_width]``."""
    b = rows[:, :_STATE_BYTES].to(torch.int64)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def _scatter_pages(
    grid: npt.NDArray[np.uint8],
    pages: npt.NDArray[np.void],
    table: npt.NDArray[np.int64],
    start: int,
    rows: npt.NDArray[np.uint8],
) -> None:
    """Write ``rows`` (``[n, width]``, contiguous) at positions ``[start, start + n)`` of the
    sequence whose page slots are ``table``, in ``grid`` (``[slots, P, width]``) and ``pages``
    (the same bytes, one item a page): the partial pages by slices, the whole ones in one
    indexed copy of a page each."""
    P = grid.shape[1]
    n = rows.shape[0]
    page, at = divmod(start, P)
    done = 0
    if at:
        done = min(P - at, n)
        grid[table[page], at : at + done] = rows[:done]
        page += 1
    full = (n - done) // P
    if full:
        pages[table[page : page + full]] = (
            rows[done : done + full * P].reshape(-1).view(pages.dtype)
        )
        done += full * P
        page += full
    if done < n:
        grid[table[page], : n - done] = rows[done:]
