"""Reductions (sum, max, min, argmax; mean and softmax built on them): a reduced dim sharded on the operand
leaves partial sums (sum) or is reduced across devices at once (max, min); argmax and softmax over a sharded
dim reduce across devices instead of gathering it."""

from __future__ import annotations

import functools
from math import prod
from typing import Sequence

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..collectives import user_op as _user_op
from ..executor import Value
from ..opdef import OpDef
from .core import ArrayLike, Tensor, _axes, _call, _is_diff, _mask, _named, _ndim, _shape
from .pointwise import astype, divide, equal, exp, where
from .registry import onnx_export, register
from .shape import broadcast_to, expand_dims, reshape



def _reduce_leading(ufunc, x: np.ndarray, axis: int, keepdims: bool, most_inner: int) -> np.ndarray:
    """numpy reduces a middle axis one short inner run at a time (tens of ns per run): a block of a dim
    sharded over the grid, reduced over rows of 16, costs 3x the global reduction. Moving the axis in front
    (one strided copy) makes every run as long as the rest of the block. The rows are still combined in
    order, one after another, so the values are numpy's, bit for bit."""
    how = _leading(x.shape, axis, keepdims, most_inner)
    if how is None:
        return ufunc.reduce(x, axis=axis, keepdims=keepdims)
    perm, rows, out = how
    return ufunc.reduce(np.ascontiguousarray(x.transpose(perm)).reshape(rows), axis=0).reshape(out)


@functools.lru_cache(maxsize=1024)
def _leading(shape: tuple[int, ...], axis: int, keepdims: bool, most_inner: int) -> tuple | None:
    n, inner = shape[axis], prod(shape[axis + 1:])
    if n < 16 or inner > most_inner or inner == 1:
        return None
    perm = (axis,) + tuple(range(axis)) + tuple(range(axis + 1, len(shape)))
    out = shape[:axis] + (1,) * keepdims + shape[axis + 1:]
    return perm, (n, prod(shape) // n), out


@functools.lru_cache(maxsize=1024)
def _folded(shape: tuple[int, ...], fold: tuple[int, ...], axis: tuple[int, ...], keepdims: bool) -> tuple:
    """How to reduce grid axes ``fold`` and block axes ``axis`` in one call: the reduced axes and the rest
    are made two contiguous runs (one copy), the fewer of them outermost."""
    gone = fold + axis
    rest = tuple(a for a in range(len(shape)) if a not in gone)
    n = prod(shape[a] for a in gone)
    m = prod(shape) // n if n else prod(shape[a] for a in rest)
    front = n <= m
    perm = gone + rest if front else rest + gone
    out = tuple(1 if a in fold or a in axis and keepdims else shape[a] for a in range(len(shape))
                if a not in axis or keepdims)
    return perm, ((n, m) if front else (m, n)), 0 if front else 1, out


def _per_input(blocks, out, params) -> int:
    """One per element read (a reduction combines each into its result)."""
    return prod(blocks[0])


def _reduction(name: str, linear, reduction, onnx_type: str, vjp, public, replicate=False) -> OpDef:
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[name]

    def kernel(arrays, local):
        axes, keepdims = local.params
        x = arrays[0]
        axis = tuple(local.G + a for a in axes)
        if local.fold:  # the all_reduce over devices that follows is the same reduction: one call does both
            if type(x) is not np.ndarray:
                out = getattr(_xp(x), name)(x, axis=local.fold + axis, keepdims=True)
                return out if keepdims else out.reshape(_folded(x.shape, local.fold, axis, False)[3])
            perm, two, a, out = _folded(x.shape, local.fold, axis, keepdims)
            return ufunc.reduce(np.ascontiguousarray(x.transpose(perm)).reshape(two), axis=a).reshape(out)
        if type(x) is np.ndarray:  # what np.sum/np.max call, without their Python wrapper
            if len(axis) == 1 and x.flags.c_contiguous:
                return _reduce_leading(ufunc, x, axis[0], keepdims, 64 if name != "sum" else 16)
            return ufunc.reduce(x, axis=axis, keepdims=keepdims)
        return getattr(_xp(x), name)(x, axis=axis, keepdims=keepdims)

    @onnx_export(onnx_type)
    def export(ex):
        axes, keepdims = ex.params
        x = ex.operand(0, ex.dtype)
        return ex.finish(ex.out(onnx_type, [x, ex.ints(axes, "axes")], keepdims=int(keepdims),
                                noop_with_empty_axes=int(not axes)), [(x, 0)])

    return register(OpDef(name, lambda shapes, axes, keepdims: R.reduce_rule(shapes[0], axes, keepdims, replicate),
                          kernel, linear, None, reduction, folds=reduction != "sum", vjp=vjp, numpy=name, onnx=export,
                          arity=1, public=public, flops=_per_input))


def sum(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001 - numpy's name
    return _call(_SUM, (x,), (_axes(axis, _ndim(x), "sum"), bool(keepdims)))


def max(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return _call(_MAX, (x,), (_axes(axis, _ndim(x), "max"), bool(keepdims)))


def min(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return _call(_MIN, (x,), (_axes(axis, _ndim(x), "min"), bool(keepdims)))


def _keep(g: Tensor, axes, keepdims: bool) -> Tensor:
    return g if keepdims or not axes else expand_dims(g, axes)


def _sum_vjp(g, node, out):
    x, = node.args
    axes, keepdims = node.params
    return (broadcast_to(_keep(g, axes, keepdims), x._shape),) if _is_diff(x) else (None,)


def _chooser_vjp(g, node, out):
    """max/min: the cotangent goes to the elements that equal the result, split evenly among ties (as jax)."""
    x, = node.args
    if not _is_diff(x):
        return (None,)
    axes, keepdims = node.params
    hit = _mask(equal(x, _keep(out, axes, keepdims)), x)
    return (hit * (_keep(g, axes, keepdims) / sum(hit, axes, keepdims=True)),)


_SUM = _reduction("sum", "add", "sum", "ReduceSum", _sum_vjp, sum)
_MAX = _reduction("max", None, "max", "ReduceMax", _chooser_vjp, max)
_MIN = _reduction("min", None, "min", "ReduceMin", _chooser_vjp, min)


@_named
def mean(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    """Accumulates as numpy does: float16 in float32 (the result float16), integers and bools in float64."""
    axes = _axes(axis, _ndim(x), "mean")
    count = 1
    for a in axes:
        count *= _shape(x)[a]
    dt = np.dtype(x._dtype if isinstance(x, Value) else np.asarray(x).dtype)
    acc = np.dtype(np.float32) if dt == np.float16 else np.dtype(np.float64) if dt.kind in "iub" else dt
    s = sum(x if acc == dt else astype(x, acc), axes, keepdims)
    if dt.kind in "iub" and s._spec is not None and s._spec.partial_axes:
        # numpy sums, then divides: dividing each summand first is off by an ulp (the float64 sum of integers
        # is exact, so it must be made before the division)
        s = s.with_sharding(s._spec.mesh, s._spec.dim_specs)
    out = divide(s, s.dtype.type(count) if count else s.dtype.type(np.nan))
    return out if dt.kind in "iub" or out.dtype == dt else astype(out, dt)


# ---- argmax ----------------------------------------------------------------------------------------------------


def _argmax_kernel(arrays, local):
    axis, = local.params
    x = arrays[0]
    if axis is None:
        G = local.G
        flat = x.reshape(x.shape[:G] + (-1,))
        return _xp(x).argmax(flat, axis=G)
    return _xp(x).argmax(x, axis=local.G + axis)


@onnx_export("ArgMax", "Reshape")
def _argmax_onnx(ex):
    axis, = ex.params
    x = ex.operand(0)
    if axis is None:
        x = ex.emit("Reshape", [x, ex.ints([-1])], "flat")
        axis = 0
    x0 = ex.operand(0)
    if ex.dtype == np.int64:
        return ex.finish(ex.out("ArgMax", [x], axis=int(axis), keepdims=0), [(x0, 0)])
    i64 = ex.emit("ArgMax", [x], "i64", axis=int(axis), keepdims=0)
    return ex.finish(ex.out("Cast", [i64], to=ex.onnx_type(ex.dtype, "argmax's result")), [(x0, 0)])


@_named
def argmax(x: ArrayLike, axis: int | None = None) -> Tensor:
    """Global indices of the first maximum. When the searched dim is sharded it is not gathered: the max
    is reduced across devices, then the smallest index holding it (NaN counts as the max, as in numpy)."""
    if axis is None:
        if isinstance(x, Tensor) and x.sharding is not None and x.ndim > 1:
            return argmax(reshape(x, (-1,)), 0)
        return _call(_ARGMAX, (x,), (None,))
    if not _axes(axis, _ndim(x), "argmax"):  # 0-d, axis 0 or -1 (numpy: 0)
        return argmax(x)
    ax = _axes(axis, _ndim(x), "argmax")[0]
    spec = x.sharding if isinstance(x, Tensor) else None
    if spec is not None and spec.dim_specs[ax].axes and x.shape[ax]:
        n = x.shape[ax]
        iota = np.arange(n, dtype=np.intp).reshape((n,) + (1,) * (x.ndim - 1 - ax))
        hits = where(x != x, iota, where(x == max(x, ax, keepdims=True), iota, n))
        return min(hits, ax)
    return _call(_ARGMAX, (x,), (ax,))


_ARGMAX = register(OpDef("argmax", lambda shapes, axis: R.reduce_rule(
    shapes[0], tuple(range(len(shapes[0]))) if axis is None else (axis,), False, True), _argmax_kernel,
    reduction="sum", dtype=np.intp, vjp=lambda g, node, out: (None,),  # an index: no gradient
    numpy="argmax", onnx=_argmax_onnx, arity=1, public=argmax, flops=_per_input))


# ---- softmax ---------------------------------------------------------------------------------------------------


def _softmax_kernel(arrays, local):
    x = arrays[0]
    xp = _xp(x)
    if x.size == 0:
        return xp.exp(x)
    ax = local.G + local.params[0]
    if xp is np:  # what np.max and np.sum call, without their Python wrappers
        e = np.exp(x - np.maximum.reduce(x, axis=ax, keepdims=True))
        return e / np.add.reduce(e, axis=ax, keepdims=True)
    e = xp.exp(x - xp.max(x, axis=ax, keepdims=True))
    return e / xp.sum(e, axis=ax, keepdims=True)


def _softmax_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    ax = node.params[0]
    return (out * (g - sum(g * out, ax, keepdims=True)),)


@onnx_export("Softmax")
def _softmax_onnx(ex):
    return ex.one("Softmax", axis=int(ex.params[0]))


def softmax(x: ArrayLike, axis: int = -1) -> Tensor:
    """Along ``axis``. When that dim is sharded it is not gathered: the row max and the row sum are
    reduced across devices instead (two all_reduces of one value per row)."""
    axes = _axes(axis, _ndim(x), "softmax")
    spec = x._spec if isinstance(x, Value) else None
    if axes and not (spec is not None and spec.dim_specs[axes[0]].axes and x.size):
        return _call(_SOFTMAX, (x,), (axes[0],))  # one kernel: the dim is whole on every device
    with _user_op("softmax"):  # its steps' collectives are logged as softmax's
        if not axes:  # a 0-d value (numpy reduces it over axis 0 or -1): exp(0) / exp(0)
            e = exp(x - max(x))
            return e / sum(e)
        e = exp(x - max(x, axes[0], keepdims=True))
        return e / sum(e, axes[0], keepdims=True)


_SOFTMAX = register(OpDef("softmax", lambda shapes, axis: R.elementwise_rule((shapes[0],), (axis,), "softmax"),
                          _softmax_kernel, vjp=_softmax_vjp, onnx=_softmax_onnx, arity=1, public=softmax,
                          flops=lambda blocks, out, params: 5 * prod(out)))  # max, subtract, exp, sum, divide
