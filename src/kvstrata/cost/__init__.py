"""The planner's cost model: what an engine step costs on a device (:class:`CostProfile`), model
shapes without weights (:class:`ModelShape`), estimates from a shape and a device's measured
rates, and the profiles kvstrata ships (``profiles/*.json``). ``kvstrata calibrate``
(:mod:`kvstrata.cost.calibrate`) fits a profile to the real engine."""

from __future__ import annotations

from .profile import (
    DISK_DEFAULTS,
    CostProfile,
    Provenance,
    StepCost,
    find_shipped,
    load_profile,
    shipped_profiles,
)
from .shape import DEVICE_RATES, ModelShape, estimate_profile, model_shape

__all__ = [
    "DEVICE_RATES",
    "DISK_DEFAULTS",
    "CostProfile",
    "ModelShape",
    "Provenance",
    "StepCost",
    "estimate_profile",
    "find_shipped",
    "load_profile",
    "model_shape",
    "shipped_profiles",
]
