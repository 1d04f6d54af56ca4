"""One layer's attention over the paged pool for a packed prefill batch: which kernel reads the pages.

Inputs are the packed extend tokens' queries ``[T, heads, D]`` and K/V ``[T, kv_heads, D]`` (the
layer has already written the K/V into its pages), the layer's pages ``[slots, P, kv_heads, D]`` and
the :class:`~kvstrata.model.batch.ForwardBatch` (per-request page tables and lengths). The output is
``[T, heads, D]``: request ``i``'s queries attend causally to its whole sequence, ``prefix_lens[i]``
cached tokens then its extend tokens.

Backends (``--attention``):

* ``triton`` (CUDA): every request with a cached prefix is attended by
  :mod:`kvstrata.model.attention_kernel`, which reads each key from its page in place (one launch per
  layer for all of them, no gather, no host sync). A request without a cached prefix attends to the
  K/V it has just computed, contiguous already, with SDPA's flash kernel (never cuDNN's, which
  builds a graph per sequence length: see :func:`sdpa_causal`), which is faster there
  (H200, llama-3.2-1b shapes: 420-444 TFLOP/s against the paged kernel's 329-343; with a cached
  prefix the paged kernel is ahead, 336-343 against flash's 288-309 on gathered K/V; see
  ``kvstrata bench attention``). With ``lse`` the kernel attends every request and also returns
  each row's log-sum-exp, which a context-parallel "move queries" strategy needs to merge partial
  outputs.
* ``sdpa`` (CPU, and CUDA when asked for): torch's ``scaled_dot_product_attention`` per request; a
  request with a cached prefix first gathers its sequence's rows out of the pages. This is the CPU
  path and the oracle the kernel is tested against (tests/test_attention.py).
* ``auto``: ``triton`` on CUDA, ``sdpa`` on the CPU.

An MLA model attends over its cached latent with :meth:`PagedAttention.latent`: one "KV head" of
``kv_lora_rank + qk_rope_head_dim`` dims shared by every query head (the queries carry the absorbed
key up-projection), whose first ``kv_lora_rank`` dims are also the values. Both backends read the
latent payload alone, never an expanded K/V: ``sdpa`` gathers a request's latent rows (and slices
the values out of them), ``triton`` reads keys and values from the same latent pages in place, for
every request (flash cannot tile a 576-dim head).

There is no silent fallback: ``triton`` (or ``auto`` on CUDA) without Triton, on a CPU pool, or for a
head size the kernel cannot tile raises :class:`~kvstrata.errors.ConfigError` naming ``--attention
sdpa``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..errors import ConfigError
from ..tiers.transfer_kernel import interpreting
from . import attention_kernel
from .attention_kernel import AttentionKernelConfig
from .batch import ForwardBatch

AttentionBackend = Literal["auto", "triton", "sdpa"]
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = ("auto", "triton", "sdpa")


class ExchangeBytes(NamedTuple):
    """Bytes one layer's attention puts into the context-parallel exchange per token (the cost
    model ``--cp-attention auto`` picks a strategy by; see :mod:`kvstrata.dist.attention`).

    kv: move_kv, per token of every request's whole sequence (its cached payloads);
    queries: move_queries, per extend token, the queries;
    partials: move_queries, per extend token, the partial outputs, their merge weights and
    log-sum-exps.
    """

    kv: int
    queries: int
    partials: int

    def plus(self, other: ExchangeBytes) -> ExchangeBytes:
        """Both exchanges (a target and its draft, layer by layer)."""
        return ExchangeBytes(*(a + b for a, b in zip(self, other, strict=True)))


def _tileable(dim: int) -> bool:
    return dim >= 16 and not dim & (dim - 1)


@dataclass(frozen=True)
class PagedAttention:
    """Causal attention of a packed batch over paged K/V with one resolved backend."""

    backend: Literal["triton", "sdpa"]
    kernel: AttentionKernelConfig | None = None  # None: the default for the queries' dtype

    @classmethod
    def for_device(
        cls,
        backend: str,
        device: torch.device,
        head_dim: int,
        kernel: AttentionKernelConfig | None = None,
        rope_dim: int = 0,
    ) -> PagedAttention:
        """Resolve ``backend`` (``auto``, ``triton`` or ``sdpa``) for a pool on ``device``, or
        raise :class:`ConfigError` saying what to change. An MLA model passes its latent's two
        parts: ``head_dim`` = kv_lora_rank, ``rope_dim`` = qk_rope_head_dim."""
        if backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"--attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}"
            )
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "sdpa"
        if backend == "triton":
            attention_kernel.require_triton()
            if device.type != "cuda" and not interpreting():
                raise ConfigError(
                    f"--attention triton runs on CUDA only, the pool is on {device}; use "
                    "--attention sdpa (or auto)"
                )
            if not _tileable(head_dim) or (rope_dim and not _tileable(rope_dim)):
                what = f"is {head_dim}" if not rope_dim else f"has a {head_dim} + {rope_dim} latent"
                raise ConfigError(
                    f"the triton attention kernel tiles head sizes that are powers of two >= 16, "
                    f"the model's {what}; use --attention sdpa"
                )
            return cls("triton", kernel)
        return cls("sdpa")

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        batch: ForwardBatch,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, heads, D]`` attention output of the batch's queries ``q``.

        ``k``/``v`` are the extend tokens' K/V, already written into ``k_pages``/``v_pages`` (the
        layer's ``[slots, P, kv_heads, D]`` pool buffers). ``lse`` (``[T, heads]`` fp32, triton
        only) receives each row's natural-log log-sum-exp of the scaled scores; the kernel then
        attends every request, cached prefix or not.
        """
        if self.backend == "triton":
            if batch.page_table is None or batch.cached_requests is None:
                raise ConfigError(
                    "the triton attention path reads the page tables ForwardBatch.build puts on "
                    "the device; this batch was made without them"
                )
            assert batch.prefix_lens_device is not None and batch.table_starts is not None
            out = torch.empty_like(q)
            if lse is None:
                requests, max_extend = batch.cached_requests, batch.max_extend
                starts = batch.cu_seqlens_host
                for i, prefix in enumerate(batch.prefix_lens):
                    if prefix == 0:
                        s, e = starts[i], starts[i + 1]
                        out[s:e] = sdpa_causal(q[s:e], k[s:e], v[s:e])
            else:
                requests = torch.arange(batch.num_requests, device=q.device)
                max_extend = max(batch.extend_lens)
            attention_kernel.paged_prefill(
                q,
                k_pages,
                v_pages,
                out,
                requests,
                batch.cu_seqlens,
                batch.prefix_lens_device,
                batch.page_table,
                batch.table_starts,
                max_extend,
                self.kernel or AttentionKernelConfig.default_for(q.dtype),
                lse=lse,
            )
            return out
        if lse is not None:
            raise ConfigError("log-sum-exp output needs the triton attention backend")
        return self._sdpa(q, k, v, k_pages, v_pages, batch)

    def latent(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        latent_pages: torch.Tensor,
        batch: ForwardBatch,
        value_dim: int,
        scale: float,
    ) -> torch.Tensor:
        """``[T, heads, value_dim]`` MLA attention of the absorbed queries ``q``
        (``[T, heads, D]``) over the cached latent: keys are the latent rows (``D`` dims), values
        their first ``value_dim`` dims.

        ``latent`` (``[T, D]``) is the extend tokens' latent, already written into
        ``latent_pages`` (the layer's ``[slots, P, D]`` pool buffer).
        """
        if self.backend == "triton":
            if batch.page_table is None or batch.prefix_lens_device is None:
                raise ConfigError(
                    "the triton attention path reads the page tables ForwardBatch.build puts on "
                    "the device; this batch was made without them"
                )
            assert batch.table_starts is not None
            out = q.new_empty((*q.shape[:2], value_dim))
            pages = latent_pages.unsqueeze(2)  # [slots, P, 1, D]: one KV head
            attention_kernel.paged_prefill(
                q,
                pages,
                pages,
                out,
                torch.arange(batch.num_requests, device=q.device),
                batch.cu_seqlens,
                batch.prefix_lens_device,
                batch.page_table,
                batch.table_starts,
                max(batch.extend_lens),
                self.kernel or AttentionKernelConfig.default_for(q.dtype, latent=True),
                scale=scale,
                rope_dim=latent.shape[-1] - value_dim,
            )
            return out
        out = q.new_empty((*q.shape[:2], value_dim))
        rows = latent_pages.view(-1, latent_pages.shape[-1])
        starts = batch.cu_seqlens_host
        for i, prefix in enumerate(batch.prefix_lens):
            start, end = starts[i], starts[i + 1]
            # Without a prefix the latent just computed is bit for bit the rows just written.
            keys = latent[start:end] if prefix == 0 else rows.index_select(0, batch.read_index[i])
            keys = keys[:, None, :]
            out[start:end] = sdpa_causal(q[start:end], keys, keys[..., :value_dim], scale)
        return out

    @staticmethod
    def _sdpa(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Per request: SDPA over its own K/V, gathered from the pages when it has a prefix."""
        out = torch.empty_like(q)
        k_rows = k_pages.view(-1, *k_pages.shape[2:])
        v_rows = v_pages.view(-1, *v_pages.shape[2:])
        starts = batch.cu_seqlens_host
        for i, prefix in enumerate(batch.prefix_lens):
            start, end = starts[i], starts[i + 1]
            if prefix == 0:
                # The K/V just computed are bit for bit the rows just written (the pool has the
                # model's dtype), so no gather.
                out[start:end] = sdpa_causal(q[start:end], k[start:end], v[start:end])
            else:
                rows = batch.read_index[i]
                out[start:end] = sdpa_causal(
                    q[start:end], k_rows.index_select(0, rows), v_rows.index_select(0, rows)
                )
        return out


def sdpa_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of ``L`` queries (``[L, heads, D]``) over ``S >= L`` keys (``[S,
    kv_heads, D]``) and values (``[S, kv_heads, Dv]``), scores scaled by ``scale`` (default
    ``D ** -0.5``).

    The queries hold the last ``L`` of the ``S`` positions: query ``i`` sees keys
    ``0 .. S - L + i``. Returns ``[L, heads, Dv]``.
    """
    num_queries, num_keys = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if not q.is_cuda:
        return _sdpa(q, k, v, num_queries, num_keys, gqa, scale)
    # Never cuDNN's attention (torch's first choice on Hopper): it builds a graph for every new
    # sequence length, 39-61 ms each (390 ms at 2,048) on the H200, where flash has no per-shape
    # cost and runs 0.04-0.13 ms; a replay's fresh requests each have a length of their own.
    with sdpa_kernel(CUDA_SDPA_BACKENDS):
        return _sdpa(q, k, v, num_queries, num_keys, gqa, scale)


CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The SDPA kernels :func:`sdpa_causal` lets torch pick from on CUDA, in torch's order: flash
where the dtype and head size allow, then memory-efficient, then math (fp32 with GQA)."""


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_queries: int,
    num_keys: int,
    gqa: bool,
    scale: float | None,
) -> torch.Tensor:
    if num_queries == num_keys:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    else:
        # is_causal aligns the mask top-left. With a cached prefix the queries are the last
        # L of S positions, so the mask must align bottom-right (x: may attend):
        #                keys 0 ... S-L ....... S-1
        #     query 0         x x x x x
        #     query L-1       x x x x x x x x x x x
        # causal_lower_right does so, and on CUDA runs the flash kernel without an [L, S] mask.
        mask = causal_lower_right(num_queries, num_keys)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    return out[0].transpose(0, 1)
