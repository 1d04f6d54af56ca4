"""The Triton kernel behind the CUDA attention path (used by :mod:`kvstrata.model.attention` only).

Causal prefill attention of a packed batch whose keys and values are read from the paged pool in
place: no request's sequence is gathered. Query rows are the packed extend tokens; request ``r``'s
queries are the last ``extend`` of its ``prefix + extend`` positions, and its keys are the pool rows
``page_table[r][t // P] * P + t % P`` for ``t < prefix + extend`` (the layer has already written the
extend tokens' K/V there)::

    program (block, head group, request):  rows = TOKENS query tokens x G heads of one KV head
        keys [0, full_end)          every row sees them: no mask
        keys [full_end, kv_end)     the diagonal: key t visible to the query at position q if t <= q

It is flash attention (online softmax in fp32, base-2 exponentials) with one extra load per key:
its slot from the request's page table. With ``pack_gqa`` the ``G`` query heads that share a KV
head are rows of one program, so each K/V tile is loaded once for all of them.

Triton is optional (the ``gpu`` extra). With ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors,
which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # the CUDA attention path then refuses to start (require_triton)
    triton = None


@dataclass(frozen=True)
class AttentionKernelConfig:
    """Launch shape of the paged attention kernel.

    block_m: query rows per program (tokens x packed heads); block_n: keys per inner step.
    pack_gqa: a program's rows are ``block_m // G`` tokens x the ``G`` query heads of one KV head.
    The defaults come from ``kvstrata bench attention --sweep`` on the H200 (docs/benchmarks.md),
    for bf16/fp16; fp32 (exact fp32 dots, twice the registers per tile) takes
    :meth:`default_for`'s smaller tiles.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    pack_gqa: bool = True

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ConfigError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ConfigError(f"num_stages must lie in [1, 8], got {self.num_stages}")

    @classmethod
    def default_for(cls, dtype: torch.dtype, latent: bool = False) -> AttentionKernelConfig:
        """The default launch shape for ``dtype``; ``latent``: for an MLA latent (a 512-wide
        value tile, so fewer rows per program; not yet swept on a GPU)."""
        if latent:
            return cls(32, 16, 4, 2, True) if dtype == torch.float32 else cls(32, 32, 8, 2, True)
        return cls(64, 32, 4, 2, True) if dtype == torch.float32 else cls()


def require_triton() -> None:
    """Raise a :class:`ConfigError` saying how to get Triton, if it is missing."""
    if triton is None:
        raise ConfigError(
            "the CUDA attention path needs Triton, which is not installed; pip install "
            "'kvstrata[gpu]' (or triton matching your torch), or choose --attention sdpa"
        )


if triton is not None:
    # Triton reads parameter annotations as specialisation hints, so the kernels have none.
    @triton.jit
    def _attend_tile(  # type: ignore[no-untyped-def]
        q, q_rope, q_pos, m_i, l_i, acc, start, kv_end, K, V, table, kv_head,
        stride_kslot, stride_kpos, stride_kh, stride_vslot, stride_vpos, stride_vh, scale_log2,
        HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One step of the online softmax over keys ``[start, start + BLOCK_N)``."""
        dims = tl.arange(0, HEAD_DIM)
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < kv_end
        slots = tl.load(table + key_pos // PAGE, mask=key_ok, other=0).to(tl.int64)
        in_page = (key_pos % PAGE).to(tl.int64)
        k_rows = slots * stride_kslot + in_page * stride_kpos + kv_head * stride_kh
        v_rows = slots * stride_vslot + in_page * stride_vpos + kv_head * stride_vh
        if MASKED:
            k = tl.load(K + k_rows[None, :] + dims[:, None], mask=key_ok[None, :], other=0.0)
        else:
            k = tl.load(K + k_rows[None, :] + dims[:, None])
        s = tl.dot(q, k, input_precision=PRECISION)
        if ROPE_DIM > 0:  # a latent's RoPE part: keys HEAD_DIM + [0, ROPE_DIM) of the same rows
            rope_ptrs = K + k_rows[None, :] + HEAD_DIM + tl.arange(0, ROPE_DIM)[:, None]
            if MASKED:
                k_rope = tl.load(rope_ptrs, mask=key_ok[None, :], other=0.0)
            else:
                k_rope = tl.load(rope_ptrs)
            s += tl.dot(q_rope, k_rope, input_precision=PRECISION)
        s = s * scale_log2
        if MASKED:  # the diagonal and the end of the keys
            visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(V + v_rows[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        else:
            v = tl.load(V + v_rows[:, None] + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    # The per-request index arrays are slices of the step's metadata at any offset: Triton
    # would compile a variant per 16-byte alignment class of each (a second of compile in the
    # middle of a replay, seen in the H200's step logs), so their alignment is not specialised.
    @triton.jit(
        do_not_specialize_on_alignment=[
            "requests", "cu_seqlens", "prefix_lens", "page_table", "table_starts",
        ]
    )  # fmt: skip
    def _paged_prefill_kernel(  # type: ignore[no-untyped-def]
        Q, K, V, Out, Lse, requests, cu_seqlens, prefix_lens, page_table, table_starts,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kslot, stride_kpos, stride_kh,
        stride_vslot, stride_vpos, stride_vh, scale_log2,
        HEAD_DIM: tl.constexpr,  # the value width, and the query / key width before ROPE_DIM
        ROPE_DIM: tl.constexpr,  # further query / key dims (a latent's RoPE part), or 0
        GROUP: tl.constexpr,  # query heads per KV head
        PACK: tl.constexpr,  # query heads packed into a program's rows (GROUP or 1)
        PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: exact fp32 dots, not tf32
        STORE_LSE: tl.constexpr,
    ):  # fmt: skip
        TOKENS: tl.constexpr = BLOCK_M // PACK
        req = tl.load(requests + tl.program_id(2))
        q_start = tl.load(cu_seqlens + req)
        extend = tl.load(cu_seqlens + req + 1) - q_start
        # Heavier blocks (later queries see more keys) get the lower program ids: they start first.
        block = tl.num_programs(0) - 1 - tl.program_id(0)
        if block * TOKENS < extend:
            prefix = tl.load(prefix_lens + req)
            table = page_table + tl.load(table_starts + req)
            kv_head = tl.program_id(1) // (GROUP // PACK)
            rows = tl.arange(0, BLOCK_M)
            tokens = block * TOKENS + rows // PACK  # token index inside the request's extend
            heads = tl.program_id(1) * PACK + rows % PACK
            dims = tl.arange(0, HEAD_DIM)
            row_ok = tokens < extend
            q_rows = (q_start + tokens).to(tl.int64) * stride_qt + heads * stride_qh
            q = tl.load(Q + q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
            if ROPE_DIM > 0:
                rope_ptrs = Q + q_rows[:, None] + HEAD_DIM + tl.arange(0, ROPE_DIM)[None, :]
                q_rope = tl.load(rope_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                q_rope = q  # unused
            q_pos = prefix + tokens

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            kv_end = prefix + tl.minimum(extend, (block + 1) * TOKENS)
            # Keys up to the block's first query position are visible to every row: no mask.
            full_end = (prefix + block * TOKENS + 1) // BLOCK_N * BLOCK_N
            for start in range(0, full_end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, q_rope, q_pos, m_i, l_i, acc, start, kv_end, K, V, table, kv_head,
                    stride_kslot, stride_kpos, stride_kh, stride_vslot, stride_vpos, stride_vh,
                    scale_log2, HEAD_DIM, ROPE_DIM, PAGE, BLOCK_N, False, PRECISION,
                )  # fmt: skip
            for start in range(full_end, kv_end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, q_rope, q_pos, m_i, l_i, acc, start, kv_end, K, V, table, kv_head,
                    stride_kslot, stride_kpos, stride_kh, stride_vslot, stride_vpos, stride_vh,
                    scale_log2, HEAD_DIM, ROPE_DIM, PAGE, BLOCK_N, True, PRECISION,
                )  # fmt: skip

            out = acc / l_i[:, None]
            o_rows = (q_start + tokens).to(tl.int64) * stride_ot + heads * stride_oh
            out_ptrs = Out + o_rows[:, None] + dims[None, :]
            tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
            if STORE_LSE:
                # Natural-log LSE of the scaled scores, [T, heads] row-major.
                lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
                lse_rows = (q_start + tokens).to(tl.int64) * (tl.num_programs(1) * PACK) + heads
                tl.store(Lse + lse_rows, lse, mask=row_ok)


def paged_prefill(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    out: torch.Tensor,
    requests: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_table: torch.Tensor,
    table_starts: torch.Tensor,
    max_extend: int,
    config: AttentionKernelConfig,
    scale: float | None = None,
    lse: torch.Tensor | None = None,
    rope_dim: int = 0,
) -> None:
    """Launch the kernel on the current stream: the rows of ``out[T, H, D]`` that belong to
    ``requests`` (indices into the batch), from ``q[T, H, D + rope_dim]`` and the layer's
    ``[slots, P, H_kv, D + rope_dim]`` key pages and ``[slots, P, H_kv, >= D]`` value pages; other
    rows are not written. ``rope_dim`` > 0 is the MLA form: keys and values are one latent
    (``k_pages`` and ``v_pages`` the same tensor, ``H_kv`` 1), the values its first ``D`` dims.

    ``cu_seqlens`` ``[R + 1]``, ``prefix_lens`` ``[R]``, ``table_starts`` ``[R]`` (each request's
    first entry in ``page_table``) and ``page_table`` (every request's slots, concatenated) are
    integer tensors on the device; ``max_extend`` is the longest extend among ``requests``, a host int. ``lse``
    (``[T, H]`` fp32), if given, receives each row's log-sum-exp. Shapes are the caller's to
    check (:mod:`kvstrata.model.attention` does).
    """
    require_triton()
    num_tokens, num_heads, qk_dim = q.shape
    head_dim = qk_dim - rope_dim
    num_requests = requests.numel()
    if num_requests == 0 or max_extend == 0:
        return
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_heads // num_kv_heads
    pack = group if config.pack_gqa and group <= config.block_m else 1
    tokens_per_block = config.block_m // pack
    grid = (
        triton.cdiv(max_extend, tokens_per_block),
        num_heads // pack,
        num_requests,
    )
    scale = 1.0 / math.sqrt(qk_dim) if scale is None else scale
    kernel: Any = _paged_prefill_kernel
    kernel[grid](
        q,
        k_pages,
        v_pages,
        out,
        lse if lse is not None else out,
        requests,
        cu_seqlens,
        prefix_lens,
        page_table,
        table_starts,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        v_pages.stride(0),
        v_pages.stride(1),
        v_pages.stride(2),
        scale * 1.4426950408889634,  # log2(e): the kernel exponentiates in base 2
        HEAD_DIM=head_dim,
        ROPE_DIM=rope_dim,
        GROUP=group,
        PACK=pack,
        PAGE=page_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        STORE_LSE=lse is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
