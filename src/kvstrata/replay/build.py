"""What a replay builds before it runs: the compute (a model, a model and its draft, or
synthetic payloads), and the memory checks that come before any large allocation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import KVLayout
from ..limits import ALLOCATOR_BYTES_PER_PAGE, check_fits
from ..model.attention import PagedAttention
from ..model.compute import Compute, ModelCompute, PairCompute, SyntheticCompute
from ..model.loader import load_model, read_model_config, resolve_dtype, weight_bytes
from .config import ReplayConfig


def build_compute(cfg: ReplayConfig) -> Compute:
    """The model the replay runs (or synthetic payloads for ``model="none"``)."""
    if cfg.model == "none":
        return SyntheticCompute(cfg.kv_width, cfg.vocab_size)
    _, model = load_model(cfg.model, device=cfg.engine.device, dtype=cfg.dtype, seed=cfg.seed)
    model.use_attention(cfg.attention)
    PagedAttention.for_device(  # refuse a backend the device cannot run before any work
        cfg.attention, torch.device(cfg.engine.device), model.config.head_dim
    )
    dtype = next(model.parameters()).dtype
    if cfg.draft_model is None:
        return ModelCompute(model, dtype)
    _, draft = load_model(cfg.draft_model, device=cfg.engine.device, dtype=dtype, seed=cfg.seed)
    draft.use_attention(cfg.attention)
    return PairCompute(model, draft, dtype)


@dataclass(frozen=True)
class ComputeShape:
    """What the compute will be, known before its weights are loaded."""

    vocab_size: int
    max_seq_len: int
    layout: KVLayout
    weight_bytes: int


def compute_shape(cfg: ReplayConfig, compute: Compute | None) -> ComputeShape:
    """The shape of ``compute``, or of the one :func:`build_compute` would build, read from the
    checkpoint's config.json only (weights come after the checks)."""
    if compute is None and cfg.model == "none":
        compute = SyntheticCompute(cfg.kv_width, cfg.vocab_size)  # allocates nothing
    if compute is not None:
        return ComputeShape(compute.vocab_size, compute.max_seq_len, compute.layout, 0)
    config = read_model_config(cfg.model)
    dtype = resolve_dtype(cfg.dtype, torch.device(cfg.engine.device))
    draft = read_model_config(cfg.draft_model) if cfg.draft_model is not None else None
    return ComputeShape(
        vocab_size=config.vocab_size,
        max_seq_len=min(
            config.max_position_embeddings,
            draft.max_position_embeddings if draft else config.max_position_embeddings,
        ),
        layout=config.kv_layout(str(dtype).removeprefix("torch."), draft=draft),
        weight_bytes=weight_bytes(config, dtype) + (weight_bytes(draft, dtype) if draft else 0),
    )


def check_memory(cfg: ReplayConfig, shape: ComputeShape) -> None:
    """Refuse pools and weights that the device (and the host, for L2) cannot hold, naming the
    flag to lower, before any of them is allocated."""
    engine = cfg.engine
    device = torch.device(engine.device)
    pool_bytes = engine.pool_pages * shape.layout.page_bytes(engine.page_size)
    allocator_bytes = engine.pool_pages * ALLOCATOR_BYTES_PER_PAGE
    if device.type == "cpu":
        parts = [(f"the L1 pool ({engine.pool_pages:,} pages)", pool_bytes + allocator_bytes)]
    else:
        check_fits(
            [("the page allocator", allocator_bytes)], torch.device("cpu"), "lower --l1-tokens"
        )
        parts = [(f"the L1 pool ({engine.pool_pages:,} pages)", pool_bytes)]
    if shape.weight_bytes:
        parts.append(("the model weights", shape.weight_bytes))
    check_fits(parts, device, hint="lower --l1-tokens")
    if engine.has_l2:  # the L2 host pool: pinned CPU memory, plus its allocator
        page_bytes = shape.layout.page_bytes(engine.page_size)
        host_pages = (
            engine.l2_tokens // engine.page_size
            if engine.l2_tokens
            else int(engine.l2_gib * 2**30) // page_bytes
        )
        host = host_pages * (page_bytes + ALLOCATOR_BYTES_PER_PAGE)
        cpu_parts = [(f"the L2 host pool ({host_pages:,} pages)", host)]
        if device.type == "cpu":
            cpu_parts = parts + cpu_parts
        check_fits(cpu_parts, torch.device("cpu"), hint="lower --l1-tokens or the L2 size")
