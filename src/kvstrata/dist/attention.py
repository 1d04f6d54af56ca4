"""Attention under context parallelism (docs/design.md, "Attention under CP").

Page ``p`` of every sequence is owned by rank ``p % cp_size``: the owner computes that page's query
tokens, writes their K/V into its own slots, and is the only rank that stores them. Per layer a
rank's queries need K/V that other ranks hold; two exact strategies get it there::

    move KV        every rank fills the rows it owns of a dense [sequence, heads, dim] K/V buffer
                   per request (zeros elsewhere); one SUM all-reduce gives every rank the whole
                   K/V (x + 0 is exact, so it is the owners' bytes); ordinary causal attention.
                   Bytes per layer grow with the context.
    move queries   every rank fills its rows of the step's query buffer; one SUM all-reduce gives
                   all queries to all ranks; each rank attends them against the K/V it owns only
                   and returns partial outputs with their log-sum-exp; the partials merge exactly:
                   out = sum_r exp(lse_r - lse) out_r. Bytes per layer grow with the extend.

:class:`CPStep` holds one forward's index metadata for this rank (built on the host once per
forward) and runs the exchanges through the :class:`~kvstrata.dist.group.Group` — the one place
collectives live. :func:`attention_bytes` is the cost model the engine uses to pick a strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .group import Group

IntArray = npt.NDArray[np.int64]
STRATEGIES = ("auto", "move_kv", "move_queries")
QUERY_BLOCK = 512  # queries per partial-attention block under move_queries


def attention_bytes(
    prefix_lens: list[int], extend_lens: list[int], kv_token_bytes: int, q_token_bytes: int
) -> dict[str, int]:
    """Bytes each rank puts into one layer's exchange, per strategy (the engine's cost model).

    move_kv reduces K and V over every request's whole sequence; move_queries reduces the
    queries, then the partial outputs (same size as the queries) and their log-sum-exps.
    """
    seq = sum(p + e for p, e in zip(prefix_lens, extend_lens, strict=True))
    ext = sum(extend_lens)
    return {"move_kv": seq * kv_token_bytes, "move_queries": ext * (2 * q_token_bytes + 8)}


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
        if self.strategy == "move_kv":
            return self._move_kv(q, k, v, k_rows, v_rows)
        return self._move_queries(q, k, v, k_rows, v_rows)

    def _dense_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = self.seq_offsets[-1]
        kv = torch.zeros((2, total, *k.shape[1:]), dtype=k.dtype, device=k.device)
        kv[0, self.my_prefix_dense] = k_rows[self.my_prefix_rows]
        kv[1, self.my_prefix_dense] = v_rows[self.my_prefix_rows]
        kv[0, self.my_ext_dense] = k
        kv[1, self.my_ext_dense] = v
        self.group.all_reduce(kv, "sum", "attention")
        return kv[0], kv[1]

    def _move_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
    ) -> torch.Tensor:
        keys, values = self._dense_kv(k, v, k_rows, v_rows)
        out = torch.empty_like(q)
        my_pos = self.all_positions[self.mine]
        my_req = self.my_ext_request
        for i in range(self.num_requests):
            sel = torch.nonzero(my_req == i).flatten()
            if sel.numel() == 0:
                continue
            lo, hi = self.seq_offsets[i], self.seq_offsets[i + 1]
            key_pos = torch.arange(hi - lo, device=q.device)
            mask = key_pos[None, :] <= my_pos[sel][:, None]
            out[sel] = _sdpa(q[sel], keys[lo:hi], values[lo:hi], mask)
        return out

    def _move_queries(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
    ) -> torch.Tensor:
        num_all = self.all_tokens.numel()
        queries = torch.zeros((num_all, *q.shape[1:]), dtype=q.dtype, device=q.device)
        queries[self.mine] = q
        self.group.all_reduce(queries, "sum", "attention")
        heads = q.shape[1]
        out = torch.zeros((num_all, heads, q.shape[2]), dtype=torch.float32, device=q.device)
        lse = torch.full((num_all, heads), float("-inf"), dtype=torch.float32, device=q.device)
        ext_req_of_mine = self.my_ext_request
        for i in range(self.num_requests):
            lo, hi = self.ext_offsets[i], self.ext_offsets[i + 1]
            if hi == lo:
                continue
            pre = torch.nonzero(self.my_prefix_request == i).flatten()
            ext = torch.nonzero(ext_req_of_mine == i).flatten()
            keys = torch.cat([k_rows[self.my_prefix_rows[pre]], k[ext]])
            values = torch.cat([v_rows[self.my_prefix_rows[pre]], v[ext]])
            if keys.shape[0] == 0:
                continue
            key_pos = torch.cat([self.my_prefix_positions[pre], self.all_positions[self.mine][ext]])
            for a in range(lo, hi, QUERY_BLOCK):  # bounds the [heads, block, keys] scores
                b = min(a + QUERY_BLOCK, hi)
                mask = key_pos[None, :] <= self.all_positions[a:b][:, None]
                out[a:b], lse[a:b] = _partial(queries[a:b], keys, values, mask)
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


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[L, Hq, D]`` attention of ``q`` over ``k``/``v`` (``[S, Hkv, D]``) under a boolean mask."""
    gqa = q.shape[1] != k.shape[1]
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of ``q`` over a subset of the keys, with its log-sum-exp (fp32)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5
    scores = torch.einsum("lhd,shd->hls", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, L]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hls,shd->lhd", probs, v.float())
    return out, lse.transpose(0, 1)


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"--cp-attention must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
        )
