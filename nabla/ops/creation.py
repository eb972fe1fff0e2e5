"""Making tensors (``tensor``, ``ones``, ``zeros``, ``arange``, ``full``, ``abstract``: host values, no op runs) and
the argument checks they share: bad input is a ShardingError naming the argument, never a TypeError, an
OverflowError, an object or str tensor or a silently truncated shape."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import ShardingError
from ..mesh import MAX_RANK, _bounded_tuple, _show
from ..tensor import Tensor
from .. import backends
from ..layout import chunks, grid

#: dtype names that numpy knows only through the ``ml_dtypes`` package (it comes with jax).
_ML_DTYPE_NAMES = frozenset({
    "bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
    "int2", "int4", "uint2", "uint4"})
_MAX_DIM = (1 << 63) - 1  # numpy's index type
_NOTHING = object()


def _is_ml_dtype(dt: np.dtype) -> bool:
    return getattr(dt.type, "__module__", "").startswith("ml_dtypes")


def _dtype_arg(dtype: Any, op: str, kinds: str = "biufc") -> np.dtype | None:
    """``dtype`` as a numeric ``np.dtype`` (``None`` stays ``None``); ml_dtypes names (``"bfloat16"``)
    through ``ml_dtypes`` when it is importable. ``kinds`` narrows the numpy kinds allowed."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in _ML_DTYPE_NAMES:
        try:
            import ml_dtypes
        except ImportError:
            raise ShardingError(f"{op}: dtype {dtype!r} needs the ml_dtypes package: pip install ml_dtypes "
                                f"(or pip install nabla-spmd[jax], which brings it)") from None
        if not hasattr(ml_dtypes, dtype):
            raise ShardingError(f"{op}: dtype {dtype!r} is not in ml_dtypes {ml_dtypes.__version__}; "
                                f"a newer ml_dtypes has it") from None
        dt = np.dtype(getattr(ml_dtypes, dtype))
    else:
        try:
            dt = np.dtype(dtype)
        except Exception:  # noqa: BLE001 - numpy raises TypeError, ValueError or worse for garbage
            raise ShardingError(f"{op}: dtype {_show(dtype)} is not a dtype numpy knows (try 'float32', "
                                f"'int64', 'bool', 'complex64' or 'bfloat16')") from None
    ok = dt.kind in kinds or (_is_ml_dtype(dt) and ("f" in kinds or dt.name.startswith(("int", "uint"))))
    if not ok and kinds == "f":
        raise ShardingError(f"{op}: dtype {dt} is not a floating dtype (float16, float32, float64, bfloat16, ...); "
                            f"cast the result with .astype for another dtype")
    if not ok:
        raise ShardingError(f"{op}: dtype {dt} is not numeric; nabla tensors hold bool, int, float or complex values")
    return dt


def _int_like(v: Any) -> bool:
    return (isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))) or \
        (isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iu")


def _shape_arg(shape: Any, op: str) -> tuple[int, ...]:
    """A shape as numpy takes it (one int or a sequence of ints, each >= 0), never truncated or guessed."""
    if _int_like(shape):
        dims = (shape,)
    elif isinstance(shape, (str, bytes, bytearray, set, frozenset, dict)) or shape is None or \
            (isinstance(shape, np.ndarray) and shape.ndim != 1):
        raise ShardingError(f"{op}: shape must be an int or a sequence of ints, got {type(shape).__name__} "
                            f"{_show(shape)}")
    else:
        try:
            dims = _bounded_tuple(shape, f"{op}: shape", MAX_RANK)
        except ShardingError:
            raise ShardingError(f"{op}: shape must be an int or a sequence of at most {MAX_RANK} ints, got "
                                f"{type(shape).__name__} {_show(shape)}") from None
    for i, d in enumerate(dims):
        if not _int_like(d):
            raise ShardingError(f"{op}: shape {_show(shape)} has a non-integer dim {_show(d)} "
                                f"({type(d).__name__}) at position {i}; dims are ints")
        if d < 0:
            raise ShardingError(f"{op}: shape {_show(shape)} has a negative dim {_show(d)} at position {i}; "
                                f"dims are ints >= 0")
        if d > _MAX_DIM:
            raise ShardingError(f"{op}: shape {_show(shape)} has dim {_show(d)} at position {i}, past numpy's "
                                f"limit 2**63 - 1")
    dims = tuple(int(d) for d in dims)
    total = 1
    for d in dims:
        total *= d if d else 1
        if total > _MAX_DIM:
            raise ShardingError(f"{op}: shape {_show(dims)} has more than 2**63 elements")
    return dims


def _numeric_array(value: Any, dtype: np.dtype | None, op: str) -> np.ndarray:
    """A fresh numeric array of ``value`` (a copy: the caller's array stays writable and theirs)."""
    if isinstance(value, (str, bytes, bytearray)) or value is None:
        raise ShardingError(f"{op}: value {_show(value)} ({type(value).__name__}) is not numeric; nabla tensors "
                            f"hold bool, int, float or complex values")
    try:
        a = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - ragged lists (ValueError), hostile __array__, ...
        raise ShardingError(f"{op}: value {_show(value)} is not array-like ({type(e).__name__}: "
                            f"{_show(str(e), 120)})") from None
    if a.dtype.kind == "O":
        numbers = (int, float, complex, np.number, np.bool_)
        bad = next((x for x in a.flat if not isinstance(x, numbers)), _NOTHING)
        if bad is not _NOTHING or a.size == 0:
            raise ShardingError(f"{op}: value {_show(value)} holds {type(bad).__name__} {_show(bad)}, not a number; "
                                f"nabla tensors hold bool, int, float or complex values")
        if dtype is None:
            raise ShardingError(f"{op}: value {_show(value)} holds ints too large for int64 and uint64; pass "
                                f"dtype= (e.g. 'float64')")
        try:
            a = np.array(value, dtype=dtype)
        except (OverflowError, TypeError, ValueError) as e:
            raise ShardingError(f"{op}: value {_show(value)} does not fit dtype {dtype} ({e})") from None
    elif a.dtype.kind not in "biufc" and not _is_ml_dtype(a.dtype):
        raise ShardingError(f"{op}: value {_show(value)} has dtype {a.dtype}, which is not numeric; nabla tensors "
                            f"hold bool, int, float or complex values")
    if a.ndim > MAX_RANK:
        raise ShardingError(f"{op}: value has {a.ndim} dims; at most {MAX_RANK}")
    if dtype is not None and a.dtype.kind == "c" and dtype.kind != "c" and np.any(a.imag):
        raise ShardingError(f"{op}: value {_show(value)} has complex entries; dtype {dtype} would drop their "
                            f"imaginary parts (pass .real for that, or a complex dtype)")
    if dtype is not None and a.dtype.kind == "c" and dtype.kind != "c":
        a = a.real  # all imaginary parts are zero: nothing is dropped, so no ComplexWarning
    try:
        # a finite value that overflows the dtype, or nan/inf cast to an int, is refused rather than warned about
        with np.errstate(over="raise", invalid="raise"):
            return a.astype(dtype if dtype is not None else a.dtype, copy=True)
    except (OverflowError, TypeError, ValueError, FloatingPointError) as e:
        raise ShardingError(f"{op}: value {_show(value)} of dtype {a.dtype} does not fit dtype {dtype} ({e})") from None


def _allocate(make, what: str, op: str) -> np.ndarray:
    try:
        with np.errstate(over="raise", invalid="raise"):  # values past the dtype are refused, not made inf
            return make()
    except FloatingPointError as e:
        raise ShardingError(f"{op}: the values of {what} overflow the dtype ({e})") from None
    except MemoryError as e:
        raise ShardingError(f"{op}: cannot allocate {what} (MemoryError: {_show(str(e), 120)})") from None
    except (ValueError, OverflowError) as e:
        raise ShardingError(f"{op}: cannot make {what} ({type(e).__name__}: {_show(str(e), 120)})") from None


def tensor(value: Any, dtype: Any = None) -> Tensor:
    """A host tensor from a number, a nested sequence of numbers, a numpy array or a tensor (copied,
    then immutable). Values must be numeric (bool, int, float, complex); ``dtype`` as numpy takes it,
    plus ``"bfloat16"`` and the other ml_dtypes names when ml_dtypes is installed."""
    dt = _dtype_arg(dtype, "tensor")
    if isinstance(value, Tensor):
        value = value.numpy()
    return Tensor._host(_numeric_array(value, dt, "tensor"))


def ones(shape: int | Sequence[int], dtype: Any = "float32") -> Tensor:
    shape, dt = _shape_arg(shape, "ones"), _dtype_arg(dtype, "ones")
    return Tensor._host(_allocate(lambda: np.ones(shape, dtype=dt), f"shape {shape} of {dt}", "ones"))


def zeros(shape: int | Sequence[int], dtype: Any = "float32") -> Tensor:
    shape, dt = _shape_arg(shape, "zeros"), _dtype_arg(dtype, "zeros")
    return Tensor._host(_allocate(lambda: np.zeros(shape, dtype=dt), f"shape {shape} of {dt}", "zeros"))


def arange(*args: int | float, dtype: Any = None) -> Tensor:
    """numpy's ``arange(stop)``, ``arange(start, stop)``, ``arange(start, stop, step)``: real, finite
    numbers and a non-zero step."""
    dt = _dtype_arg(dtype, "arange")
    if not 1 <= len(args) <= 3:
        raise ShardingError(f"arange: takes stop, (start, stop) or (start, stop, step); got {len(args)} arguments")
    names = {1: ("stop",), 2: ("start", "stop"), 3: ("start", "stop", "step")}[len(args)]
    for name, v in zip(names, args):
        if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, (bool, np.bool_)):
            raise ShardingError(f"arange: {name} must be a real number, got {type(v).__name__} {_show(v)}")
        if isinstance(v, (float, np.floating)) and not np.isfinite(v):
            raise ShardingError(f"arange: {name} is {v}; it must be finite")
        if isinstance(v, (int, np.integer)) and abs(int(v)) > _MAX_DIM:
            raise ShardingError(f"arange: {name} {_show(v)} is past int64")
    start, stop, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], 1) if len(args) == 2 else args
    if step == 0:
        raise ShardingError(f"arange: step is 0; it must be non-zero (start {start}, stop {stop})")

    def make():
        try:
            return np.arange(start, stop, step, dtype=dt)
        except TypeError:  # ml_dtypes types have no arange loop: count in float64, then cast
            return np.arange(start, stop, step, dtype=np.float64).astype(dt)

    return Tensor._host(_allocate(make, f"arange{tuple(args)}", "arange"))


def abstract(shape: int | Sequence[int], dtype: Any = "float32") -> Tensor:
    """A tensor with a shape and no data: ops propagate and log communication without running kernels."""
    shape, dt = _shape_arg(shape, "abstract"), _dtype_arg(dtype, "abstract")
    if dt is None:  # numpy's meaning of dtype=None, as nb.ones(shape, dtype=None) and np.ones give
        dt = np.dtype(None)
    return Tensor(None, None, shape, dt)


def full(shape: int | Sequence[int], value: Any, dtype: Any = "float32") -> Tensor:
    return Tensor._host(np.full(shape, value, dtype=dtype))


def zeros_as(p: Tensor, spec: Any = "same", dtype: Any = None) -> Tensor:
    """Zeros of ``p``'s shape, laid out as ``spec`` (default ``p``'s) in ``dtype`` (default ``p``'s): abstract for an
    abstract ``p`` (a plan without data stays without data), and for a sharded one made directly as its stored
    blocks (no global array is ever built)."""
    dtype = p.dtype if dtype is None else _dtype_arg(dtype, "zeros")
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
