"""Attention under context parallelism (docs/design.md, "Attention under CP").

Page ``p`` of every sequence is owned by rank ``p % cp_size``: the owner computes that page's query
tokens, writes their K/V into its own slots, and is the only rank that stores them. Per layer a
rank's queries need K/V that other ranks hold; two exact strategies get it there::

    move KV        every rank fills the rows it owns of a dense [sequence, payloads] buffer per
                   request (zeros elsewhere); one SUM all-reduce gives every rank the whole
                   K/V (x + 0 is exact, so it is the owners' bytes); ordinary causal attention.
                   Bytes per layer grow with the context. An MLA model's payload is its
                   latent (576 values a token for DeepSeek-V2/V3 shapes), so it moves latents,
                   never K/V.
    move queries   every rank fills its rows of the step's query buffer; one SUM all-reduce gives
                   all queries to all ranks; each rank attends them against the K/V it owns only
                   and returns partial outputs with their log-sum-exp; the partials merge exactly:
                   out = sum_r exp(lse_r - lse) out_r. Bytes per layer grow with the extend.

:class:`CPStep` holds one forward's index metadata for this rank (built on the host once per
forward) and runs the exchanges through the :class:`~kvstrata.dist.group.Group` — the one place
collectives live. :func:`attention_bytes` is the cost model the engine uses to pick a strategy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..model.attention import ExchangeBytes
from .group import Group

IntArray = npt.NDArray[np.int64]
#: Token rows of a layer's payloads -> (keys ``[S, Hkv, D]``, values ``[S, Hkv, Dv]``).
_Split = Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, torch.Tensor]]
STRATEGIES = ("auto", "move_kv", "move_queries")
QUERY_BLOCK = 512  # queries per partial-attention block under move_queries


def attention_bytes(
    prefix_lens: list[int], extend_lens: list[int], exchange: ExchangeBytes
) -> dict[str, int]:
    """Bytes each rank puts into one layer's exchange, per strategy (the engine's cost model).

    move_kv reduces the cached payloads (K and V, or an MLA latent) over every request's whole
    sequence; move_queries reduces the queries, then the partial outputs and their log-sum-exps,
    over the extend tokens. ``exchange`` is the model's per-token sizes
    (:meth:`~kvstrata.model.decoder.Decoder.exchange_bytes`).
    """
    seq = sum(p + e for p, e in zip(prefix_lens, extend_lens, strict=True))
    ext = sum(extend_lens)
    return {"move_kv": seq * exchange.kv, "move_queries": ext * (exchange.queries + exchange.partials)}


@dataclass
class CPStep:
    """This rank's view of one forward under CP.

    ``mine`` (over the step's extend tokens, request by request) marks the tokens this rank
    computes; ``my_*`` arrays index those tokens. Dense per-request sequence buffers are laid out
    request after request (``seq_offsets``).
    """

    group: Group
    strategy: str  # "move_kv" or "move_queries"
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    all_tokens: torch.Tensor  # [T] every extend token of the step (replicated)
    all_positions: torch.Tensor  # [T]
    mine: torch.Tensor  # [T] bool
    seq_offsets: tuple[int, ...]  # dense row where each request's sequence starts (R + 1)
    ext_offsets: tuple[int, ...]  # packed index where each request's extend starts (R + 1)
    my_prefix_rows: torch.Tensor  # pool rows of the prefix positions this rank owns
    my_prefix_dense: torch.Tensor  # their dense rows
    my_prefix_positions: torch.Tensor
    my_prefix_request: torch.Tensor  # which request each belongs to
    my_ext_dense: torch.Tensor  # dense rows of this rank's extend tokens
    my_ext_request: torch.Tensor
    my_last: torch.Tensor  # per request: index into my tokens of its last extend token, or -1
    prefix_last_rows: torch.Tensor  # per request: my pool row of its last prefix position, or -1
    need_logits: bool

    @property
    def num_requests(self) -> int:
        return len(self.extend_lens)

    # -- attention -------------------------------------------------------------------------------

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Attention output for this rank's query tokens ``q`` (``[T_mine, Hq, D]``); ``k``/``v``
        are their fresh keys and values, ``k_rows``/``v_rows`` this rank's pool rows."""
        return self._attend(q, (k, v), (k_rows, v_rows), _key_value, None)

    def attend_latent(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        latent_rows: torch.Tensor,
        value_dim: int,
        scale: float,
    ) -> torch.Tensor:
        """MLA attention output (``[T_mine, H, value_dim]``) for this rank's absorbed queries
        ``q`` (``[T_mine, H, D]``): keys are latents (``D`` dims, one head shared by all),
        values their first ``value_dim`` dims. ``latent`` holds the fresh tokens' latents,
        ``latent_rows`` this rank's pool rows. Only latents are exchanged, never K/V."""

        def split(payloads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            (rows,) = payloads
            return rows[:, None, :], rows[:, None, :value_dim]

        return self._attend(q, (latent,), (latent_rows,), split, scale)

    def _attend(
        self,
        q: torch.Tensor,
        fresh: tuple[torch.Tensor, ...],
        rows: tuple[torch.Tensor, ...],
        split: _Split,
        scale: float | None,
    ) -> torch.Tensor:
        """``fresh``: this rank's extend tokens' payloads; ``rows``: its pool rows of the same
        payloads; ``split`` turns token rows of the payloads into (keys, values)."""
        if self.strategy == "move_kv":
            keys, values = split(self._dense(fresh, rows))
            return self._move_kv(q, keys, values, scale)
        return self._move_queries(q, fresh, rows, split, scale)

    def _dense(
        self, fresh: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Every request's whole sequence of every payload, on every rank: each rank fills the
        rows it owns of one ``[sequence tokens, all payloads' values]`` buffer, zeros elsewhere,
        and one SUM all-reduce adds them up (x + 0 is exact: the owners' bytes)."""
        total = self.seq_offsets[-1]
        widths = [math.prod(t.shape[1:]) for t in fresh]
        ref = fresh[0]
        dense = torch.zeros((total, sum(widths)), dtype=ref.dtype, device=ref.device)
        start = 0
        for payload, pool_rows, width in zip(fresh, rows, widths, strict=True):
            cols = slice(start, start + width)
            dense[self.my_prefix_dense, cols] = pool_rows[self.my_prefix_rows].reshape(-1, width)
            dense[self.my_ext_dense, cols] = payload.reshape(-1, width)
            start += width
        self.group.all_reduce(dense, "sum", "attention")
        parts = dense.split(widths, dim=1)
        return tuple(p.view(total, *t.shape[1:]) for p, t in zip(parts, fresh, strict=True))

    def _move_kv(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        out = q.new_empty((*q.shape[:2], values.shape[-1]))
        my_pos = self.all_positions[self.mine]
        my_req = self.my_ext_request
        for i in range(self.num_requests):
            sel = torch.nonzero(my_req == i).flatten()
            if sel.numel() == 0:
                continue
            lo, hi = self.seq_offsets[i], self.seq_offsets[i + 1]
            key_pos = torch.arange(hi - lo, device=q.device)
            mask = key_pos[None, :] <= my_pos[sel][:, None]
            out[sel] = _sdpa(q[sel], keys[lo:hi], values[lo:hi], mask, scale)
        return out

    def _move_queries(
        self,
        q: torch.Tensor,
        fresh: tuple[torch.Tensor, ...],
        rows: tuple[torch.Tensor, ...],
        split: _Split,
        scale: float | None,
    ) -> torch.Tensor:
        num_all = self.all_tokens.numel()
        queries = torch.zeros((num_all, *q.shape[1:]), dtype=q.dtype, device=q.device)
        queries[self.mine] = q
        self.group.all_reduce(queries, "sum", "attention")
        heads, value_dim = q.shape[1], split(fresh)[1].shape[-1]
        out = torch.zeros((num_all, heads, value_dim), dtype=torch.float32, device=q.device)
        lse = torch.full((num_all, heads), float("-inf"), dtype=torch.float32, device=q.device)
        ext_req_of_mine = self.my_ext_request
        for i in range(self.num_requests):
            lo, hi = self.ext_offsets[i], self.ext_offsets[i + 1]
            if hi == lo:
                continue
            pre = torch.nonzero(self.my_prefix_request == i).flatten()
            ext = torch.nonzero(ext_req_of_mine == i).flatten()
            owned = tuple(
                torch.cat([pool_rows[self.my_prefix_rows[pre]], payload[ext]])
                for payload, pool_rows in zip(fresh, rows, strict=True)
            )
            keys, values = split(owned)
            if keys.shape[0] == 0:
                continue
            key_pos = torch.cat([self.my_prefix_positions[pre], self.all_positions[self.mine][ext]])
            for a in range(lo, hi, QUERY_BLOCK):  # bounds the [heads, block, keys] scores
                b = min(a + QUERY_BLOCK, hi)
                mask = key_pos[None, :] <= self.all_positions[a:b][:, None]
                out[a:b], lse[a:b] = _partial(queries[a:b], keys, values, mask, scale)
        # Exact merge: out = sum_r w_r out_r / sum_r w_r with w_r = exp(lse_r - max_r lse_r).
        top = lse.clone()
        self.group.all_reduce(top, "max", "attention")
        weight = torch.exp(lse - top).nan_to_num(0.0)  # a rank with no visible key: weight 0
        merged = torch.cat([out * weight[..., None], weight[..., None]], dim=-1)
        self.group.all_reduce(merged, "sum", "attention")
        full = merged[..., :-1] / merged[..., -1:]
        return full[self.mine].to(q.dtype)

    # -- logits and synthetic state --------------------------------------------------------------

    def gather_last(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, ...]`` rows for every request's last extend token from the ranks that computed
        them (``rows`` holds this rank's, in request order)."""
        out = torch.zeros((self.num_requests, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        have = self.my_last >= 0
        out[have] = rows[: int(have.sum())]
        self.group.all_reduce(out, "sum", "logits")
        return out

    def share(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of per-request values each rank fills only where it owns the source
        (zeros elsewhere): every rank gets every value."""
        self.group.all_reduce(values, "sum", "state")
        return values


def _key_value(payloads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = payloads
    return k, v


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """``[L, Hq, Dv]`` attention of ``q`` over ``k`` (``[S, Hkv, D]``) and ``v`` (``[S, Hkv,
    Dv]``) under a boolean mask."""
    gqa = q.shape[1] != k.shape[1]
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa, scale=scale)
    return out[0].transpose(0, 1)


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of ``q`` over a subset of the keys, with its log-sum-exp (fp32). The
    query heads that share a KV head are one einsum axis: no KV head is repeated."""
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    scale = dim**-0.5 if scale is None else scale
    grouped = q.float().view(length, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("lkgd,skd->kgls", grouped, k.float()).reshape(heads, length, -1) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, L]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    probs = probs.view(kv_heads, heads // kv_heads, length, -1)
    out = torch.einsum("kgls,skd->lkgd", probs, v.float()).reshape(length, heads, -1)
    return out, lse.transpose(0, 1)


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"--cp-attention must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
        )
