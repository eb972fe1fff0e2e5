"""Tensor's numpy-like methods and operators (``t + u``, ``t.sum()``, ``t.T``, ``Tensor.ones``), set on the class
when the ops are imported (``attach``, as JAX's ``_set_array_base_attributes``): ``tensor.py`` sits below the ops,
which build on it, so the methods that run ops are defined here, where the ops are."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..collectives import user_op
from ..dtypes import is_inexact
from ..executor import run
from ..tensor import Tensor
from ..value import Value
from .contraction import matmul
from .core import apply
from .creation import ones, zeros
from .indexing import getitem
from .pointwise import (_RECIPROCAL, abs, add, astype, divide, equal, floor_divide, greater, greater_equal, less,
                        less_equal, multiply, negative, not_equal, power, remainder, sqrt, subtract)
from .reduction import all, any, argmax, argmin, cumsum, max, mean, min, prod, std, sum, var
from .shape import reshape, transpose
from .sorting import argsort, sort


def _pow(self: Tensor, o: Any) -> Tensor:
    """numpy's ``**`` on a float or complex array: a Python 0.5 is sqrt, -1 reciprocal, 2 square (its
    fast_scalar_power); np.power(-0.0, 0.5) is +0.0 in float16 where sqrt gives -0.0."""
    if is_inexact(self._dtype) and (type(o) is float and o == 0.5 or type(o) is int and o in (-1, 2)):
        with user_op("power"):  # the comm log names what the user wrote
            if o == 2:  # numpy's square is x * x (a pending sum is made first: it is two factors of it)
                return multiply(self, self)
            return sqrt(self) if o == 0.5 else apply(_RECIPROCAL, (self,))
    if self._dtype.kind == "b" and type(o) is int and o == 2:  # numpy's square: int8
        x = astype(self, np.int8)
        return multiply(x, x)
    return power(self, o)


def _sum(self: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    return sum(self, axis, keepdims)


def _mean(self: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    with user_op("mean"):
        return mean(self, axis, keepdims)


def _max(self: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    return max(self, axis, keepdims)


def _min(self: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    return min(self, axis, keepdims)


def _argmax(self: Tensor, axis: int | None = None, keepdims: bool = False) -> Tensor:
    with user_op("argmax"):
        return argmax(self, axis, keepdims)


def _argmin(self: Tensor, axis: int | None = None, keepdims: bool = False) -> Tensor:
    return argmin(self, axis, keepdims)


def _var(self: Tensor, axis: Any = None, dtype: Any = None, ddof: int = 0, keepdims: bool = False) -> Tensor:
    return var(self, axis, dtype, ddof, keepdims)


def _std(self: Tensor, axis: Any = None, dtype: Any = None, ddof: int = 0, keepdims: bool = False) -> Tensor:
    return std(self, axis, dtype, ddof, keepdims)


def _prod(self: Tensor, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> Tensor:
    return prod(self, axis, dtype, keepdims)


def _any(self: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    return any(self, axis, keepdims)


def _all(self: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    return all(self, axis, keepdims)


def _cumsum(self: Tensor, axis: int | None = None, dtype: Any = None) -> Tensor:
    return cumsum(self, axis, dtype)


def _sort(self: Tensor, axis: int | None = -1) -> Tensor:
    return sort(self, axis)


def _argsort(self: Tensor, axis: int | None = -1) -> Tensor:
    return argsort(self, axis)


def _T(self: Tensor) -> Tensor:
    return transpose(self, None)


def _astype(self: Tensor, dtype: Any) -> Tensor:
    return astype(self, dtype)


def _reshape(self: Tensor, *shape: Any) -> Tensor:
    if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
        shape = tuple(shape[0])
    return reshape(self, shape)


def _transpose(self: Tensor, *axes: Any) -> Tensor:
    if len(axes) == 1 and axes[0] is not None and not isinstance(axes[0], (int, np.integer)):
        axes = tuple(axes[0])
    return transpose(self, axes or None)


def _ones(shape: Sequence[int] | int, dtype: Any = "float32") -> Tensor:
    return ones(shape, dtype)  # nb.ones validates the shape and dtype (ShardingError naming them)


def _zeros(shape: Sequence[int] | int, dtype: Any = "float32") -> Tensor:
    return zeros(shape, dtype)


def _binary(fn: Any, reflected: bool = False) -> Any:
    """An operator running ``fn``'s op on its two operands (``apply``, as ``fn`` does: an operator always has
    both, so the public function's argument handling, for calls by name, is skipped; two values, the common
    case, need nothing of ``apply`` either when the op does not rearrange its operands: they go to the
    executor as they are)."""
    op = fn.op
    if op.arrange is not None:
        return (lambda self, o: apply(op, (o, self))) if reflected else lambda self, o: apply(op, (self, o))
    if reflected:
        return lambda self, o: run(op, (o, self), (), Tensor) if isinstance(o, Value) else apply(op, (o, self))
    return lambda self, o: run(op, (self, o), (), Tensor) if isinstance(o, Value) else apply(op, (self, o))


_METHODS: dict[str, Any] = {
    "__add__": _binary(add), "__radd__": _binary(add, True),
    "__sub__": _binary(subtract), "__rsub__": _binary(subtract, True),
    "__mul__": _binary(multiply), "__rmul__": _binary(multiply, True),
    "__truediv__": _binary(divide), "__rtruediv__": _binary(divide, True),
    "__floordiv__": _binary(floor_divide), "__rfloordiv__": _binary(floor_divide, True),
    "__mod__": _binary(remainder), "__rmod__": _binary(remainder, True),
    "__pow__": _pow, "__rpow__": _binary(power, True),
    "__matmul__": lambda self, o: matmul(self, o), "__rmatmul__": lambda self, o: matmul(o, self),
    "__neg__": lambda self: negative(self), "__pos__": lambda self: self, "__abs__": lambda self: abs(self),
    "__lt__": _binary(less), "__le__": _binary(less_equal),
    "__gt__": _binary(greater), "__ge__": _binary(greater_equal),
    "__eq__": _binary(equal), "__ne__": _binary(not_equal),
    "__getitem__": lambda self, key: getitem(self, key),
    "sum": _sum, "mean": _mean, "max": _max, "min": _min, "argmax": _argmax, "argmin": _argmin, "var": _var,
    "std": _std, "prod": _prod, "any": _any, "all": _all, "cumsum": _cumsum, "sort": _sort, "argsort": _argsort,
    "reshape": _reshape, "transpose": _transpose, "T": property(_T), "astype": _astype,
    "ones": staticmethod(_ones),
    "zeros": staticmethod(_zeros),
}


def attach(cls: type) -> None:
    """Set the methods on ``cls`` (Tensor), each named as it is there (``Tensor.sum.__name__ == "sum"``)."""
    for name, fn in _METHODS.items():
        inner = fn.fget if isinstance(fn, property) else fn.__func__ if isinstance(fn, staticmethod) else fn
        inner.__name__, inner.__qualname__ = name, f"{cls.__name__}.{name}"
        setattr(cls, name, fn)
