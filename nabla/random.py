"""Random tensors (host values; shard them to place them), with numpy's habits: without a seed, fresh
values on each call from a ``numpy.random.Generator`` that ``seed(n)`` resets; with a seed, the same values
every time. The generator belongs to the calling context (a thread, an async task): ``seed`` in one thread
does not change what another draws, and two threads never share one generator's state."""

from __future__ import annotations

import contextvars
import math
from typing import Any, Sequence

import numpy as np

from .errors import ShardingError
from .args import allocate, dtype_arg, is_int, shape_arg, short_repr
from .tensor import Tensor

__all__ = ["seed", "normal", "uniform"]

_MAX_SEED_BITS = 1024
_rng: contextvars.ContextVar[np.random.Generator | None] = contextvars.ContextVar("nabla_random", default=None)


def _seed_arg(value: Any, op: str) -> int:
    if not is_int(value) or value < 0 or int(value).bit_length() > _MAX_SEED_BITS:
        raise ShardingError(f"{op}: seed must be None or an int in [0, 2**{_MAX_SEED_BITS}), got "
                            f"{type(value).__name__} {short_repr(value)}")
    return int(value)


def seed(n: int | None = None) -> None:
    """Reset the generator that ``normal`` and ``uniform`` draw from when called without a seed
    (``seed()`` with no argument: fresh entropy, as ``numpy.random.seed()``), in the calling context."""
    _rng.set(np.random.default_rng(None if n is None else _seed_arg(n, "random.seed")))


def _generator(s: Any, op: str) -> np.random.Generator:
    if s is not None:
        return np.random.default_rng(_seed_arg(s, op))
    rng = _rng.get()
    if rng is None:  # a context that never seeded: fresh entropy, its own generator
        rng = np.random.default_rng()
        _rng.set(rng)
    return rng


def _real(value: Any, name: str, op: str) -> float:
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        raise ShardingError(f"{op}: {name} must be a real number, got {type(value).__name__} {short_repr(value)}")
    v = float(value) if abs(value) < 1e308 or isinstance(value, (float, np.floating)) else math.inf
    if not math.isfinite(v):
        raise ShardingError(f"{op}: {name} is {short_repr(value)}; it must be finite")
    return v


def normal(shape: Sequence[int] | int, seed: int | None = None, dtype: Any = "float32",
           scale: float = 1.0) -> Tensor:
    """Standard normal values times ``scale``, of a floating ``dtype``; ``seed=None`` draws from the
    context's generator (see ``seed``), an int seed gives the same values every time."""
    op = "random.normal"
    shape, dt = shape_arg(shape, op), dtype_arg(dtype, op, kinds="f")
    scale = _real(scale, "scale", op)
    rng = _generator(seed, op)
    return Tensor._host(allocate(lambda: (rng.standard_normal(shape) * scale).astype(dt),
                                  f"shape {shape} of {dt}", op))


def uniform(shape: Sequence[int] | int, seed: int | None = None, dtype: Any = "float32", low: float = 0.0,
            high: float = 1.0) -> Tensor:
    """Values uniform on ``[low, high)``, of a floating ``dtype``; seeds as for ``normal``."""
    op = "random.uniform"
    shape, dt = shape_arg(shape, op), dtype_arg(dtype, op, kinds="f")
    low, high = _real(low, "low", op), _real(high, "high", op)
    if not math.isfinite(high - low):
        raise ShardingError(f"{op}: high - low = {high} - {low} overflows float64")
    rng = _generator(seed, op)
    return Tensor._host(allocate(lambda: rng.uniform(low, high, shape).astype(dt), f"shape {shape} of {dt}", op))
