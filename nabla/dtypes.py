"""Which dtypes are which: numpy's, and the ``ml_dtypes`` ones (bfloat16, the float8 types) that numpy files
under kind ``V`` although they are floats. Every float check in nabla goes through here."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np


@lru_cache(maxsize=256)
def is_ml(dt: np.dtype) -> bool:
    """A dtype of the ``ml_dtypes`` package (bfloat16, the float8 and int4 types), which numpy files under kind ``V``."""
    return getattr(dt.type, "__module__", "").startswith("ml_dtypes")


def is_float(dt: Any) -> bool:
    """A real floating dtype: numpy's float16/32/64, and bfloat16 and the float8 types of ``ml_dtypes``."""
    dt = np.dtype(dt)
    return dt.kind == "f" or (dt.kind == "V" and is_ml(dt) and "float" in dt.name)


def is_inexact(dt: Any) -> bool:
    """A float or a complex dtype: what a gradient can have (asked per operand of every differentiated op)."""
    got = _INEXACT.get(dt)
    if got is None:
        d = np.dtype(dt)
        got = d.kind in "fc" or (d.kind == "V" and is_ml(d) and "float" in d.name)
        if isinstance(dt, np.dtype):
            _INEXACT[dt] = got  # (a few dozen dtypes: bounded)
    return got


_INEXACT: dict = {}


@lru_cache(maxsize=256)
def exp_dtype(dt: Any) -> np.dtype:
    """The dtype numpy computes ``exp`` in: the dtype itself for floats and complex, numpy's promotion for integers
    and bools (int8: float16, int32: float64). Functions built on ``exp`` (softmax, sigmoid) convert integers to it
    first: ``x - max`` or ``-x`` in the integer dtype would wrap."""
    dt = np.dtype(dt)
    return dt if is_inexact(dt) else np.exp(np.zeros((), dt)).dtype


def finfo(dt: Any) -> Any:
    """``np.finfo`` for every float dtype nabla holds (``ml_dtypes.finfo`` for theirs)."""
    dt = np.dtype(dt)
    if is_ml(dt):
        import ml_dtypes
        return ml_dtypes.finfo(dt)
    return np.finfo(dt)


@lru_cache(maxsize=256)
def accumulation(dt: Any) -> np.dtype:
    """The dtype a sum of ``dt`` values accumulates in: float32 for float16 and bfloat16 (summed in their own
    precision, 256 values of 4.8 in bf16 add up to 4.375 each), ``dt`` itself otherwise. JAX's reductions upcast
    the same two (``jax.numpy``'s ``_upcast_f16``), and XLA's SPMD partitioner then all-reduces the float32
    partial sums, rounding once at the end."""
    dt = np.dtype(dt)
    if dt.itemsize != 2:  # (the common case, one attribute read: no 16-bit float is wider)
        return dt
    return np.dtype(np.float32) if dt == np.float16 or (is_ml(dt) and dt.name == "bfloat16") else dt


def identity(dtype: Any) -> Any:
    """The additive identity the devices that hold no summand keep: -0.0 for floats (IEEE: x + -0.0 is x for
    every x, -0.0 included; +0.0 would turn a sum of -0.0s into +0.0), -0-0j for complex, 0 otherwise."""
    dtype = np.dtype(dtype)
    if is_float(dtype):
        return dtype.type(-0.0)
    if dtype.kind == "c":
        return dtype.type(complex(-0.0, -0.0))
    return dtype.type(0)
