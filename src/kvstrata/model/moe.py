"""The mixture of experts of DeepSeek-V2 / V3 layers: a router, the routed experts, the shared ones.

A plain reference MoE, computed as transformers computes it (router in fp32, the same top-k
ops, so the same experts are chosen), not an expert-parallel kernel. The routed experts' weights
are stacked the way transformers holds them in memory: ``experts.gate_up_proj`` ``[E, 2I, H]``
(gate rows, then up rows) and ``experts.down_proj`` ``[E, H, I]``; checkpoints store them per
expert (``experts.{e}.gate_proj.weight`` ...), and the loader stacks them. Tokens are sorted by
expert and run through one grouped matmul per projection (``torch.nn.functional.grouped_mm``; on
CUDA that kernel takes bfloat16 only, and it needs rows of a multiple of 16 bytes, so other dtypes
there and odd widths anywhere run one matmul per expert, which reads the expert counts back to the
host once per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import MLP
from .deepseek_config import MoEConfig

#: Parameter name suffixes kept in fp32 whatever the model's dtype (transformers keeps the router
#: in fp32 too): the expert choice must not depend on the compute dtype's rounding.
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


class Router(nn.Module):
    """Per token, the ``experts_per_token`` experts to run and their weights (see
    :data:`~kvstrata.model.deepseek_config.GATINGS`)."""

    def __init__(self, config: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.gating == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] fp32, experts [T, k] int64)``."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        k, groups = c.experts_per_token, c.num_groups
        if c.gating == "noaux_tc":
            assert self.e_score_correction_bias is not None
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            # A group's score: the sum of its two best experts' (biased) scores.
            group_scores = choice.view(-1, groups, c.num_experts // groups).topk(2, dim=-1)[0]
            allowed = self._allowed(group_scores.sum(dim=-1))
            experts = choice.masked_fill(~allowed, float("-inf")).topk(k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, experts)
            if c.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if c.gating == "group_limited_greedy":  # a group's score: its best expert's
                best = scores.view(-1, groups, c.num_experts // groups).max(dim=-1).values
                scores = scores.masked_fill(~self._allowed(best), 0.0)
            weights, experts = torch.topk(scores, k=k, dim=-1, sorted=False)
        return weights * c.routed_scaling_factor, experts

    def _allowed(self, group_scores: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` bool: the experts of each token's ``topk_groups`` best groups."""
        c = self.config
        best = torch.topk(group_scores, k=c.topk_groups, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return mask.repeat_interleave(c.num_experts // c.num_groups, dim=1)


class Experts(nn.Module):
    """The routed experts, stacked: SwiGLU ``down(silu(gate x) * up x)`` per expert."""

    def __init__(self, config: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        e, inter = config.num_experts, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, inter))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """``[T, H]``: each token's experts' outputs, weighted and summed."""
        num_tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        # Rows per expert; not bincount, which reads its input's max back to the host on CUDA.
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        rows = x[order // k]
        gate, up = self._grouped(rows, self.gate_up_proj, counts).chunk(2, dim=-1)
        rows = self._grouped(F.silu(gate) * up, self.down_proj, counts)
        rows = rows * weights.reshape(-1)[order, None]
        # Back in (token, slot) order, then summed over the slots: no atomic adds, so the sum's
        # order (and the result) does not depend on the device's scheduling.
        unsorted = torch.empty_like(rows)
        unsorted[order] = rows
        return unsorted.view(num_tokens, k, x.shape[-1]).sum(dim=1).to(x.dtype)

    @staticmethod
    def _grouped(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows`` (sorted by expert, ``counts`` per expert) times each expert's ``weight.T``."""
        if _grouped_mm_takes(rows, weight):
            return grouped_matmul(rows, weight, counts)
        return per_expert_matmul(rows, weight, counts)


def _grouped_mm_takes(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` runs these operands: any dtype on the CPU, bfloat16 on CUDA, and
    rows of both sides a multiple of 16 bytes."""
    aligned = all(n * rows.element_size() % 16 == 0 for n in weight.shape[1:])
    return aligned and (rows.device.type == "cpu" or rows.dtype == torch.bfloat16)


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows ``[S, in]`` sorted by expert times ``weight[e].T`` (``weight`` ``[E, out, in]``) of
    their expert, in one grouped matmul; no host sync."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    return F.grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)


def per_expert_matmul(
    rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The same as :func:`grouped_matmul`, one matmul per expert that has rows."""
    out = rows.new_empty((rows.shape[0], weight.shape[1]))
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            out[start : start + count] = rows[start : start + count] @ weight[expert].T
            start += count
    return out


class MoE(nn.Module):
    """Routed experts plus the shared experts (one SwiGLU ``num_shared_experts`` times wide)."""

    def __init__(self, config: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.gate = Router(config, hidden_size)
        self.experts = Experts(config, hidden_size)
        shared = config.intermediate_size * config.num_shared_experts
        self.shared_experts = MLP(hidden_size, shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts) + self.shared_experts(x)
