"""Argument checks shared by the public API (meshes, specs, tensors, random, optimizers): bad input is a
ShardingError naming the argument, never a TypeError, an OverflowError, a hang on an endless iterator or a
silently truncated shape. A leaf module (it imports only numpy, the errors and the dtype tests), so every other
module may use it."""

from __future__ import annotations

from collections.abc import Mapping, Set
from itertools import islice
from typing import Any, Callable

import numpy as np

from .dtypes import is_ml
from .errors import ShardingError

#: The highest rank a spec or a tensor may have (numpy 1.x's limit on array dims; blocks are stored with grid
#: axes in front, so this leaves room under numpy 2's 64).
MAX_RANK = 32


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message: never raises, never huge (ints past str's digit limit too)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and abs(int(value)).bit_length() > 128:
        return f"an int of {abs(int(value)).bit_length()} bits"
    if isinstance(value, (str, bytes)) and len(value) > limit:  # no repr of a megabyte string
        return short_repr(value[:limit], limit)[:limit - 5] + " ...>"
    if type(value) in (tuple, list):
        inner = ", ".join(short_repr(v, limit) for v in value[:8]) + (", ..." if len(value) > 8 else "")
        text = ("(" + inner + ("," if len(value) == 1 else "") + ")") if type(value) is tuple else "[" + inner + "]"
    else:
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001 - a hostile __repr__ must not replace the real error
            return f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 5] + " ...>"


def is_int(value: Any) -> bool:
    """A Python or numpy int, not a bool (numpy's habit: ``np.zeros(True)`` is an error in spirit)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def bounded_tuple(value: Any, what: str, limit: int, too_long: str | None = None) -> tuple[Any, ...]:
    """An ordered finite sequence as a tuple of at most ``limit`` items (no hang on endless iterators);
    refuses str, bytes, sets and mappings, whose iteration order or items are not what was meant."""
    if type(value) is tuple and len(value) <= limit:  # the common case, kept cheap: specs are built often
        return value
    if isinstance(value, (str, bytes, bytearray, Set, Mapping)) or value is None:
        raise ShardingError(f"{what} must be a sequence, got {type(value).__name__} {short_repr(value)}")
    if isinstance(value, np.ndarray):
        if not value.ndim:
            raise ShardingError(f"{what} must be a sequence, got a 0-d array {short_repr(value)}")
        value = value.reshape(-1).tolist()
    try:
        items = tuple(islice(iter(value), limit + 1))
    except TypeError:
        raise ShardingError(f"{what} must be a sequence, got {type(value).__name__} {short_repr(value)}") from None
    except Exception as e:  # noqa: BLE001 - an iterable that raises (jax refuses to iterate an unreduced spec)
        raise ShardingError(f"{what}: iterating {type(value).__name__} {short_repr(value)} raised "
                            f"{type(e).__name__}: {short_repr(str(e), 160)}") from None
    if len(items) > limit:
        shown = short_repr(value) if isinstance(value, (tuple, list, range)) else type(value).__name__
        raise ShardingError(too_long or f"{what} has more than {limit} entries: {shown}")
    return items


#: dtype names that numpy knows only through the ``ml_dtypes`` package (it comes with jax).
_ML_DTYPE_NAMES = frozenset({
    "bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
    "int2", "int4", "uint2", "uint4"})
#: the largest dim numpy takes (its index type)
MAX_DIM = (1 << 63) - 1


def dtype_arg(dtype: Any, op: str, kinds: str = "biufc") -> np.dtype | None:
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
            raise ShardingError(f"{op}: dtype {short_repr(dtype)} is not a dtype numpy knows (try 'float32', "
                                f"'int64', 'bool', 'complex64' or 'bfloat16')") from None
    ok = dt.kind in kinds or (is_ml(dt) and ("f" in kinds or dt.name.startswith(("int", "uint"))))
    if not ok and kinds == "f":
        raise ShardingError(f"{op}: dtype {dt} is not a floating dtype (float16, float32, float64, bfloat16, ...); "
                            f"cast the result with .astype for another dtype")
    if not ok:
        raise ShardingError(f"{op}: dtype {dt} is not numeric; nabla tensors hold bool, int, float or complex values")
    return dt


def _int_like(v: Any) -> bool:
    """An int (numpy's too, or a 0-d int array), not a bool."""
    return (isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))) or \
        (isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iu")


def shape_arg(shape: Any, op: str) -> tuple[int, ...]:
    """A shape as numpy takes it (one int or a sequence of ints, each >= 0), never truncated or guessed."""
    if _int_like(shape):
        dims = (shape,)
    elif isinstance(shape, (str, bytes, bytearray, set, frozenset, dict)) or shape is None or \
            (isinstance(shape, np.ndarray) and shape.ndim != 1):
        raise ShardingError(f"{op}: shape must be an int or a sequence of ints, got {type(shape).__name__} "
                            f"{short_repr(shape)}")
    else:
        try:
            dims = bounded_tuple(shape, f"{op}: shape", MAX_RANK)
        except ShardingError:
            raise ShardingError(f"{op}: shape must be an int or a sequence of at most {MAX_RANK} ints, got "
                                f"{type(shape).__name__} {short_repr(shape)}") from None
    for i, d in enumerate(dims):
        if not _int_like(d):
            raise ShardingError(f"{op}: shape {short_repr(shape)} has a non-integer dim {short_repr(d)} "
                                f"({type(d).__name__}) at position {i}; dims are ints")
        if d < 0:
            raise ShardingError(f"{op}: shape {short_repr(shape)} has a negative dim {short_repr(d)} at position {i}; "
                                f"dims are ints >= 0")
        if d > MAX_DIM:
            raise ShardingError(f"{op}: shape {short_repr(shape)} has dim {short_repr(d)} at position {i}, past numpy's "
                                f"limit 2**63 - 1")
    dims = tuple(int(d) for d in dims)
    total = 1
    for d in dims:
        total *= d if d else 1
        if total > MAX_DIM:
            raise ShardingError(f"{op}: shape {short_repr(dims)} has more than 2**63 elements")
    return dims


def allocate(make: Callable[[], np.ndarray], what: str, op: str) -> np.ndarray:
    """``make()``, its failures (overflow, no memory, a bad size) a ShardingError naming ``what``."""
    try:
        with np.errstate(over="raise", invalid="raise"):  # values past the dtype are refused, not made inf
            return make()
    except FloatingPointError as e:
        raise ShardingError(f"{op}: the values of {what} overflow the dtype ({e})") from None
    except MemoryError as e:
        raise ShardingError(f"{op}: cannot allocate {what} (MemoryError: {short_repr(str(e), 120)})") from None
    except (ValueError, OverflowError) as e:
        raise ShardingError(f"{op}: cannot make {what} ({type(e).__name__}: {short_repr(str(e), 120)})") from None
