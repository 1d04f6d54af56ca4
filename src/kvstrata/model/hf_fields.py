"""Typed reads of a Hugging Face ``config.json`` and the value checks every model config shares.

A field of the wrong type is a :class:`~kvstrata.errors.CheckpointError` naming the field, never a
``TypeError`` deep in the model (and ``"false"`` is not true); a value that describes no valid model
is a :class:`~kvstrata.errors.ConfigError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

from ..errors import CheckpointError, ConfigError

REQUIRED = object()


def positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{name} must be a number > 0, got {value!r}")


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


class HFFields:
    """Typed reads of ``config.json`` fields. A field set to null counts as absent, as
    transformers reads it."""

    def __init__(self, hf: Mapping[str, Any], architecture: str) -> None:
        self.hf = hf
        self.architecture = architecture

    def _get(self, key: str, default: object) -> object:
        value = self.hf.get(key)
        if value is not None:
            return value
        if default is REQUIRED:
            raise CheckpointError(
                f"config.json lacks {key!r}, which a {self.architecture} model needs"
            )
        return default

    def integer(self, key: str, default: object = REQUIRED) -> int:
        value = self._get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"config.json: {key} must be an integer >= 1, got {value!r}")
        return value

    def count(self, key: str, default: object = REQUIRED) -> int:
        """An integer that may be 0 (a number of layers or experts of some kind)."""
        value = self._get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"config.json: {key} must be an integer >= 0, got {value!r}")
        return value

    def number(self, key: str, default: object = REQUIRED) -> float:
        value = self._get(key, default)
        if not is_number(value) or not 0 < value < math.inf:
            raise CheckpointError(f"config.json: {key} must be a finite number > 0, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"config.json: {key} must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise CheckpointError(f"config.json: {key} must be a string, got {value!r}")
        return value
