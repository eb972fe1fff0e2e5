"""Making tensors (``tensor``, ``ones``, ``zeros``, ``arange``, ``full``, ``abstract``: host values, no op runs) and
the argument checks they share: bad input is a ShardingError naming the argument, never a TypeError, an
OverflowError, an object or str tensor or a silently truncated shape."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import ShardingError
from ..args import MAX_DIM, MAX_RANK, allocate, dtype_arg, shape_arg, short_repr
from ..dtypes import is_ml
from ..tensor import Tensor
from .. import backends
from ..layout import chunks, grid

_NOTHING = object()


def _numeric_array(value: Any, dtype: np.dtype | None, op: str) -> np.ndarray:
    """A fresh numeric array of ``value`` (a copy: the caller's array stays writable and theirs)."""
    if isinstance(value, (str, bytes, bytearray)) or value is None:
        raise ShardingError(f"{op}: value {short_repr(value)} ({type(value).__name__}) is not numeric; nabla tensors "
                            f"hold bool, int, float or complex values")
    try:
        a = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - ragged lists (ValueError), hostile __array__, ...
        raise ShardingError(f"{op}: value {short_repr(value)} is not array-like ({type(e).__name__}: "
                            f"{short_repr(str(e), 120)})") from None
    if a.dtype.kind == "O":
        numbers = (int, float, complex, np.number, np.bool_)
        bad = next((x for x in a.flat if not isinstance(x, numbers)), _NOTHING)
        if bad is not _NOTHING or a.size == 0:
            raise ShardingError(f"{op}: value {short_repr(value)} holds {type(bad).__name__} {short_repr(bad)}, not a number; "
                                f"nabla tensors hold bool, int, float or complex values")
        if dtype is None:
            raise ShardingError(f"{op}: value {short_repr(value)} holds ints too large for int64 and uint64; pass "
                                f"dtype= (e.g. 'float64')")
        try:
            a = np.array(value, dtype=dtype)
        except (OverflowError, TypeError, ValueError) as e:
            raise ShardingError(f"{op}: value {short_repr(value)} does not fit dtype {dtype} ({e})") from None
    elif a.dtype.kind not in "biufc" and not is_ml(a.dtype):
        raise ShardingError(f"{op}: value {short_repr(value)} has dtype {a.dtype}, which is not numeric; nabla tensors "
                            f"hold bool, int, float or complex values")
    if a.ndim > MAX_RANK:
        raise ShardingError(f"{op}: value has {a.ndim} dims; at most {MAX_RANK}")
    if dtype is not None and a.dtype.kind == "c" and dtype.kind != "c" and np.any(a.imag):
        raise ShardingError(f"{op}: value {short_repr(value)} has complex entries; dtype {dtype} would drop their "
                            f"imaginary parts (pass .real for that, or a complex dtype)")
    if dtype is not None and a.dtype.kind == "c" and dtype.kind != "c":
        a = a.real  # all imaginary parts are zero: nothing is dropped, so no ComplexWarning
    try:
        # a finite value that overflows the dtype, or nan/inf cast to an int, is refused rather than warned about
        with np.errstate(over="raise", invalid="raise"):
            return a.astype(dtype if dtype is not None else a.dtype, copy=True)
    except (OverflowError, TypeError, ValueError, FloatingPointError) as e:
        raise ShardingError(f"{op}: value {short_repr(value)} of dtype {a.dtype} does not fit dtype {dtype} ({e})") from None


def tensor(value: Any, dtype: Any = None) -> Tensor:
    """A host tensor from a number, a nested sequence of numbers, a numpy array or a tensor (copied,
    then immutable). Values must be numeric (bool, int, float, complex); ``dtype`` as numpy takes it,
    plus ``"bfloat16"`` and the other ml_dtypes names when ml_dtypes is installed."""
    dt = dtype_arg(dtype, "tensor")
    if isinstance(value, Tensor):
        value = value.numpy()
    return Tensor._host(_numeric_array(value, dt, "tensor"))


def ones(shape: int | Sequence[int], dtype: Any = "float32") -> Tensor:
    shape, dt = shape_arg(shape, "ones"), dtype_arg(dtype, "ones")
    return Tensor._host(allocate(lambda: np.ones(shape, dtype=dt), f"shape {shape} of {dt}", "ones"))


def zeros(shape: int | Sequence[int], dtype: Any = "float32") -> Tensor:
    shape, dt = shape_arg(shape, "zeros"), dtype_arg(dtype, "zeros")
    return Tensor._host(allocate(lambda: np.zeros(shape, dtype=dt), f"shape {shape} of {dt}", "zeros"))


def arange(*args: int | float, dtype: Any = None) -> Tensor:
    """numpy's ``arange(stop)``, ``arange(start, stop)``, ``arange(start, stop, step)``: real, finite
    numbers and a non-zero step."""
    dt = dtype_arg(dtype, "arange")
    if not 1 <= len(args) <= 3:
        raise ShardingError(f"arange: takes stop, (start, stop) or (start, stop, step); got {len(args)} arguments")
    names = {1: ("stop",), 2: ("start", "stop"), 3: ("start", "stop", "step")}[len(args)]
    for name, v in zip(names, args):
        if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, (bool, np.bool_)):
            raise ShardingError(f"arange: {name} must be a real number, got {type(v).__name__} {short_repr(v)}")
        if isinstance(v, (float, np.floating)) and not np.isfinite(v):
            raise ShardingError(f"arange: {name} is {v}; it must be finite")
        if isinstance(v, (int, np.integer)) and abs(int(v)) > MAX_DIM:
            raise ShardingError(f"arange: {name} {short_repr(v)} is past int64")
    start, stop, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], 1) if len(args) == 2 else args
    if step == 0:
        raise ShardingError(f"arange: step is 0; it must be non-zero (start {start}, stop {stop})")

    def make():
        try:
            return np.arange(start, stop, step, dtype=dt)
        except TypeError:  # ml_dtypes types have no arange loop: count in float64, then cast
            return np.arange(start, stop, step, dtype=np.float64).astype(dt)

    return Tensor._host(allocate(make, f"arange{tuple(args)}", "arange"))


def abstract(shape: int | Sequence[int], dtype: Any = "float32") -> Tensor:
    """A tensor with a shape and no data: ops propagate and log communication without running kernels."""
    shape, dt = shape_arg(shape, "abstract"), dtype_arg(dtype, "abstract")
    if dt is None:  # numpy's meaning of dtype=None, as nb.ones(shape, dtype=None) and np.ones give
        dt = np.dtype(None)
    return Tensor(None, None, shape, dt)


def full(shape: int | Sequence[int], value: Any, dtype: Any = "float32") -> Tensor:
    return Tensor._host(np.full(shape, value, dtype=dtype))


def zeros_as(p: Tensor, spec: Any = "same", dtype: Any = None) -> Tensor:
    """Zeros of ``p``'s shape, laid out as ``spec`` (default ``p``'s) in ``dtype`` (default ``p``'s): abstract for an
    abstract ``p`` (a plan without data stays without data), and for a sharded one made directly as its stored
    blocks (no global array is ever built)."""
    dtype = p.dtype if dtype is None else dtype_arg(dtype, "zeros")
    spec = p.sharding if spec == "same" else spec
    if spec is None:
        return abstract(p.shape, dtype) if p.is_abstract else zeros(p.shape, dtype)
    spec = type(spec)(spec.mesh, spec.dim_specs, spec.replicated_axes)  # no pending sums in a fresh state
    if p.is_abstract:
        return Tensor(None, spec, p.shape, dtype)
    data = backends.active().commit(np.zeros(grid(spec).shape + chunks(spec, p.shape), dtype=dtype), spec)
    if isinstance(data, np.ndarray):
        data.flags.writeable = False
    return Tensor(data, spec, p.shape, dtype)
