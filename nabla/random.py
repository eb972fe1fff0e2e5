"""Seeded random tensors (host values; shard them to place them)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .tensor import Tensor


def normal(shape: Sequence[int] | int, seed: int = 0, dtype: Any = "float32", scale: float = 1.0) -> Tensor:
    rng = np.random.default_rng(seed)
    return Tensor._host((rng.standard_normal(shape) * scale).astype(dtype))


def uniform(shape: Sequence[int] | int, seed: int = 0, dtype: Any = "float32", low: float = 0.0,
            high: float = 1.0) -> Tensor:
    rng = np.random.default_rng(seed)
    return Tensor._host(rng.uniform(low, high, shape).astype(dtype))
