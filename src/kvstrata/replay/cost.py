"""Which cost model a replay's simulated clock runs on, in which bytes, and what the summary says
about it.

:func:`resolve_cost` picks, in this order: ``--cost-profile NAME|FILE``; the flat model of
``--sim-tokens-per-s``; the shipped profile measured for the model (``--model``, or
``--model-shape`` with ``--model none``) in its dtype on the device's kind; an estimate from
that model's shape and the device's measured rates (labelled so); and, with ``--model none``
and no shape, the flat per-device default the planner always had. ``--sim-*-gbps`` replace the
chosen model's link rates.

With ``--model none`` the engine stores ``--kv-width`` bytes per token, but a profile or shape
models a real model's KV: the clock scales every byte by the modeled bytes per token over the
stored ones, and sizes in GiB (``--l1-gib`` ...) count the modeled bytes (:func:`kv_bytes_per_token`).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, NamedTuple

import torch

from ..clock import CostModel, StepCoster
from ..cost import CostProfile, ModelShape, estimate_profile, find_shipped, load_profile
from ..cost.shape import model_shape
from ..errors import ConfigError
from ..tiers.disk_format import ALIGN
from ..tiers.disk_layout import rank_roots
from ..tiers.disk_open import page_cost
from .config import ReplayConfig

GIB = 1 << 30


class SimCost(NamedTuple):
    """The simulated clock's cost model and units."""

    coster: StepCoster  # a CostProfile or the flat CostModel
    profile: CostProfile | None
    shape: ModelShape | None  # the modeled model (--model-shape, or the run's model)
    bytes_per_token: int  # of the modeled KV (the run's own without a profile or shape)
    byte_scale: float  # modeled bytes per stored byte


def _device_kind(cfg: ReplayConfig) -> str:
    return torch.device(cfg.engine.device).type


def _shape(cfg: ReplayConfig) -> ModelShape | None:
    if cfg.model_shape is not None:
        return model_shape(cfg.model_shape, cfg.dtype)
    if cfg.model == "none":
        return None
    dtype = cfg.dtype or ("bfloat16" if _device_kind(cfg) == "cuda" else "float32")
    return model_shape(cfg.model, dtype)


def resolve_cost(cfg: ReplayConfig, stored_bytes_per_token: int) -> SimCost:
    """The cost model of ``cfg``'s simulated clock (see the module docstring);
    ``stored_bytes_per_token``: what the engine's pools hold per token."""
    shape = _shape(cfg)
    links = asdict(cfg.sim_links)
    coster: StepCoster
    profile: CostProfile | None = None
    if cfg.cost_profile is not None:
        profile = load_profile(cfg.cost_profile)
    elif cfg.cost is None and shape is not None:
        kind = _device_kind(cfg)
        profile = find_shipped(kind, shape.name, shape.dtype) or estimate_profile(
            shape, kind, cfg.engine.page_size
        )
    if profile is not None:
        coster = profile = profile.with_links(**links)
    else:
        base = cfg.cost or CostModel.for_device(cfg.engine.device)
        given = {k: v for k, v in links.items() if v is not None}
        coster = CostModel(**(asdict(base) | given))
    if cfg.model != "none":
        modeled = stored_bytes_per_token  # the model's own KV
    elif shape is not None:
        modeled = shape.kv_bytes_per_token
    elif profile is not None:
        modeled = profile.kv_bytes_per_token
    else:
        modeled = stored_bytes_per_token
    return SimCost(coster, profile, shape, modeled, modeled / stored_bytes_per_token)


def kv_bytes_per_token(cfg: ReplayConfig) -> int:
    """Bytes of KV per token that sizes in GiB count: the modeled model's with ``--model none``
    and a shape or profile, else what the run's pools hold."""
    if cfg.model == "none":
        if cfg.model_shape is not None:
            return model_shape(cfg.model_shape, cfg.dtype).kv_bytes_per_token
        if cfg.cost_profile is not None:
            return load_profile(cfg.cost_profile).kv_bytes_per_token
        return cfg.kv_width
    shape = _shape(cfg)
    assert shape is not None
    return shape.kv_bytes_per_token


def tokens_for_gib(gib: float, bytes_per_token: int, page_size: int) -> int:
    """Whole pages of ``bytes_per_token`` KV that ``gib`` GiB hold, in tokens."""
    return int(gib * GIB) // (bytes_per_token * page_size) * page_size


def describe_cost(cost: SimCost) -> dict[str, Any]:
    """The summary's ``clock.cost`` block: the model's parameters, and the profile's name,
    kind and provenance where there is one."""
    if cost.profile is None:
        assert isinstance(cost.coster, CostModel)
        return asdict(cost.coster) | {
            "kind": "flat",
            "kv_bytes_per_token": cost.bytes_per_token,
            "byte_scale": cost.byte_scale,
        }
    return cost.profile.to_json() | {
        "modeled_model": cost.shape.name if cost.shape else cost.profile.provenance.model,
        "modeled_kv_bytes_per_token": cost.bytes_per_token,
        "byte_scale": cost.byte_scale,
    }


def resolve_sizes(cfg: ReplayConfig) -> ReplayConfig:
    """``cfg`` with its sizes in GiB turned into the engine's units: ``--l1-gib`` into L1 tokens
    (whole pages of :func:`kv_bytes_per_token`); with ``--model none`` planning a model's KV
    (``--model-shape`` or ``--cost-profile``), ``--l2-gib`` into L2 tokens and ``--l3-gib`` into
    a slab budget that holds as many of the stored pages as that many GiB hold modeled pages."""
    engine = cfg.engine
    modeled = cfg.model == "none" and (cfg.model_shape or cfg.cost_profile) is not None
    if not cfg.l1_gib and not (modeled and (engine.l2_gib or engine.l3_dir)):
        return cfg
    P, bpt = engine.page_size, kv_bytes_per_token(cfg)
    changes: dict[str, Any] = {}
    if cfg.l1_gib:
        changes["pool_tokens"] = tokens_for_gib(cfg.l1_gib, bpt, P)
        if changes["pool_tokens"] < P:
            raise ConfigError(
                f"--l1-gib {cfg.l1_gib} holds no page of {P} tokens x {bpt:,} bytes per token"
            )
    if modeled and engine.l2_gib:
        changes |= {"l2_tokens": tokens_for_gib(engine.l2_gib, bpt, P), "l2_gib": 0.0}
        if changes["l2_tokens"] < P:
            raise ConfigError(f"--l2-gib {engine.l2_gib} holds no page of {bpt * P:,} bytes")
    if modeled and engine.l3_dir is not None and engine.l3_gib:
        pages = tokens_for_gib(engine.l3_gib, bpt, P) // P
        slot = page_cost(cfg.kv_width * P, engine.l3_io)  # the stored page's disk bytes
        # striped over k directories, each holds an even share and its own superblocks
        k = len(rank_roots(len(engine.l3_dirs), 0, cfg.cp))
        changes["l3_gib"] = k * (-(-pages // k) * slot + 2 * ALIGN) / GIB
    return replace(cfg, engine=replace(engine, **changes))
