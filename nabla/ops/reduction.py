"""Reductions (sum, max, min, argmax; mean and softmax built on them): a reduced dim sharded on the operand
leaves partial sums (sum) or is reduced across devices at once (max, min); argmax and softmax over a sharded
dim reduce across devices instead of gathering it."""

from __future__ import annotations

import builtins
import functools
from math import prod as _product  # (``prod`` is the op)
from typing import Any, Sequence

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..collectives import user_op as _user_op
from ..value import Value
from ..opdef import OpDef
from ..args import dtype_arg
from .core import _laid_like, ArrayLike, Tensor, _axes, apply, _is_diff, _mask, _named, _ndim, _shape
from ..dtypes import accumulation, exp_dtype, is_float, is_inexact
from ..errors import ShardingError
from ..layout import chunk
from .pointwise import abs, astype, divide, equal, exp, sqrt, where
from .registry import onnx_export, register
from .shape import broadcast_to, expand_dims, pad, reshape



def _reduce_leading(ufunc, x: np.ndarray, axis: int, keepdims: bool, most_inner: int, dtype=None) -> np.ndarray:
    """numpy reduces a middle axis one short inner run at a time (tens of ns per run): a block of a dim
    sharded over the grid, reduced over rows of 16, costs 3x the global reduction. Moving the axis in front
    (one strided copy) makes every run as long as the rest of the block. The rows are still combined in
    order, one after another, so the values are numpy's, bit for bit. ``dtype``: what to accumulate in."""
    how = _leading(x.shape, axis, keepdims, most_inner)
    if how is None:
        return ufunc.reduce(x, axis=axis, keepdims=keepdims, dtype=dtype)
    perm, rows, out = how
    return ufunc.reduce(np.ascontiguousarray(x.transpose(perm)).reshape(rows), axis=0, dtype=dtype).reshape(out)


def _wide_sum(x: Any, axis: tuple[int, ...]) -> Any:
    """The sum of a kernel's block along ``axis`` (kept as 1s), accumulated in ``accumulation``'s dtype and
    rounded once to ``x``'s: what ``jax.numpy.sum`` gives inside jax.nn's softmax, log_softmax and logsumexp."""
    acc = accumulation(x.dtype)
    if type(x) is np.ndarray:
        s = np.add.reduce(x, axis=axis, keepdims=True, dtype=None if acc == x.dtype else acc)
    else:
        s = _xp(x).sum(x, axis=axis, keepdims=True, dtype=acc)
    return s if s.dtype == x.dtype else s.astype(x.dtype)


@functools.lru_cache(maxsize=1024)
def _leading(shape: tuple[int, ...], axis: int, keepdims: bool, most_inner: int) -> tuple | None:
    n, inner = shape[axis], _product(shape[axis + 1:])
    if n < 16 or inner > most_inner or inner == 1:
        return None
    perm = (axis,) + tuple(range(axis)) + tuple(range(axis + 1, len(shape)))
    out = shape[:axis] + (1,) * keepdims + shape[axis + 1:]
    return perm, (n, _product(shape) // n), out


@functools.lru_cache(maxsize=1024)
def _folded(shape: tuple[int, ...], fold: tuple[int, ...], axis: tuple[int, ...], keepdims: bool) -> tuple:
    """How to reduce grid axes ``fold`` and block axes ``axis`` in one call: the reduced axes and the rest
    are made two contiguous runs (one copy), the fewer of them outermost."""
    gone = fold + axis
    rest = tuple(a for a in range(len(shape)) if a not in gone)
    n = _product(shape[a] for a in gone)
    m = _product(shape) // n if n else _product(shape[a] for a in rest)
    front = n <= m
    perm = gone + rest if front else rest + gone
    out = tuple(1 if a in fold or a in axis and keepdims else shape[a] for a in range(len(shape))
                if a not in axis or keepdims)
    return perm, ((n, m) if front else (m, n)), 0 if front else 1, out


def _per_input(blocks, out, params) -> int:
    """One per element read (a reduction combines each into its result)."""
    return _product(blocks[0])


def _reduction(name: str, linear, reduction, onnx_type: str, vjp, public, replicate=False, saves="none") -> OpDef:
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[name]

    def kernel(arrays, local):
        axes, keepdims = local.params[:2]
        x = arrays[0]
        axis = (local.G + axes[0],) if len(axes) == 1 else tuple([local.G + a for a in axes])
        dt = x.dtype
        acc = dt if name != "sum" or dt.itemsize != 2 else accumulation(dt)  # float16 and bfloat16 sums in
        # float32 ...
        if acc is not dt and acc != dt and not local.params[2]:  # ... rounded on each device (a transpose of a
            # broadcast)
            return kernel(arrays, local._replace(params=(axes, keepdims, True))).astype(dt)
        if local.fold:  # the all_reduce over devices that follows is the same reduction: one call does both
            if type(x) is not np.ndarray:
                out = getattr(_xp(x), name)(x, axis=local.fold + axis, keepdims=True)
                return out if keepdims else out.reshape(_folded(x.shape, local.fold, axis, False)[3])
            perm, two, a, out = _folded(x.shape, local.fold, axis, keepdims)
            return ufunc.reduce(np.ascontiguousarray(x.transpose(perm)).reshape(two), axis=a).reshape(out)
        wide = None if acc is dt or acc == dt else acc
        if type(x) is np.ndarray:  # what np.sum/np.max call, without their Python wrapper
            if len(axis) == 1 and x.flags.c_contiguous:
                return _reduce_leading(ufunc, x, axis[0], keepdims, 64 if name != "sum" else 16, wide)
            return ufunc.reduce(x, axis=axis, keepdims=keepdims, dtype=wide)
        if wide is not None:
            return _xp(x).sum(x, axis=axis, keepdims=keepdims, dtype=wide)
        return getattr(_xp(x), name)(x, axis=axis, keepdims=keepdims)

    @onnx_export(onnx_type, "Cast", "IsNaN", "Where", "Transpose", "Reshape", "MatMul")
    def export(ex):
        axes, keepdims = ex.params[:2]
        x = ex.operand(0, ex.dtype)
        if name == "sum" and ex.dtype.kind in "iu" and axes:
            return _integer_sum(ex, x, axes, keepdims)
        work = ex.carrier(onnx_type)  # (ONNX's ReduceMax and ReduceMin take no int16 or uint16: int32 holds them)
        ins = [ex.b.cast(x, ex.dtype, work), ex.ints(axes, "axes")]
        attrs = dict(keepdims=int(keepdims), noop_with_empty_axes=int(not axes))
        if name == "sum" or not is_float(ex.dtype) or not axes:
            return ex.finish(ex.out_as(work, onnx_type, ins, **attrs), [(x, 0)])
        # NaN where a reduced element is NaN, as numpy's: ONNX does not say what ReduceMax and ReduceMin make of
        # NaN, and onnxruntime's ReduceMin over an axis skipped it (the min of [0, NaN, 0.5] was 0)
        red, nan = ex.emit(onnx_type, ins, name, like=-1, **attrs), ex.b.constant(ex.dtype.type(np.nan), ex.dtype)
        return ex.finish(ex.out("Where", [ex.any_of(ex.nan_flags(x), axes, keepdims), nan, red]), [(x, 0)])

    return register(OpDef(name, lambda shapes, axes, keepdims, *wide: R.reduce_rule(shapes[0], axes, keepdims,
                                                                                      replicate),
                          kernel, linear, None, reduction, folds=reduction != "sum", vjp=vjp, numpy=name, onnx=export,
                          arity=1, public=public, flops=_per_input, saves=saves))


def _integer_sum(ex, x: str, axes: tuple[int, ...], keepdims: bool) -> tuple:
    """An integer sum as numpy's, wrapping: the reduced dims flattened last, times a vector of ones (MatMul).
    onnxruntime's integer ReduceSum goes through double: [2**53, 1, 1, 1] summed to 2**53 + 4 in int64, and a sum
    past 2**63 saturated where numpy's wraps."""
    flat, n = ex.reduced_last(x, axes)
    ones = ex.b.constant(np.ones((n,), ex.dtype), ex.dtype, base="ones")
    if not keepdims:
        return ex.finish(ex.out("MatMul", [flat, ones]), [(x, 0)])
    return ex.finish(ex.out("Reshape", [ex.emit("MatMul", [flat, ones], "sum"), ex.ints(ex.step.out_shape)]),
                     [(x, 0)])


def _dt(x: Any) -> np.dtype:
    d = x._dtype if isinstance(x, Value) else np.asarray(x).dtype
    return d if isinstance(d, np.dtype) else np.dtype(d)


def sum(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001 - numpy's name
    """numpy's ``sum``, but float16 and bfloat16 accumulate in float32 and are rounded once (``jax.numpy.sum``'s
    rule): over a sharded dim the partial sums are float32 and are summed before the rounding, as XLA's
    partitioner all-reduces them (measured on ``jax.jit`` of ``jnp.sum``: an ``f32`` all-reduce, then the
    convert)."""
    dt = _dt(x)
    out = apply(_SUM, (x,), (_axes(axis, _ndim(x), "sum"), bool(keepdims), True))
    return out if dt.itemsize != 2 or accumulation(dt) == dt else astype(out, dt)


def max(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return apply(_MAX, (x,), (_axes(axis, _ndim(x), "max"), bool(keepdims)))


def min(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return apply(_MIN, (x,), (_axes(axis, _ndim(x), "min"), bool(keepdims)))


def _keep(g: Tensor, axes, keepdims: bool) -> Tensor:
    return g if keepdims or not axes else expand_dims(g, axes)


def _sum_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    axes, keepdims = node.params[:2]
    g = g if g.dtype == x._dtype else astype(g, x._dtype)  # a float32 accumulation of bfloat16: back to bf16
    return (_laid_like(broadcast_to(_keep(g, axes, keepdims), x._shape), x),)


def _chooser_vjp(g, node, out):
    """max/min: the cotangent goes to the elements that equal the result, split evenly among ties (as jax)."""
    x, = node.args
    if not _is_diff(x):
        return (None,)
    axes, keepdims = node.params
    hit = _mask(equal(x, _keep(out, axes, keepdims)), x)
    return (hit * (_keep(g, axes, keepdims) / sum(hit, axes, keepdims=True)),)


_SUM = _reduction("sum", "add", "sum", "ReduceSum", _sum_vjp, sum)
_MAX = _reduction("max", None, "max", "ReduceMax", _chooser_vjp, max, saves="all")  # x == max, where it won
_MIN = _reduction("min", None, "min", "ReduceMin", _chooser_vjp, min, saves="all")


@_named
def mean(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    """Accumulates as numpy and jax.numpy do: float16 and bfloat16 in float32 (summed, divided, then rounded
    once), integers and bools in float64."""
    axes = _axes(axis, _ndim(x), "mean")
    count = 1
    for a in axes:
        count *= _shape(x)[a]
    dt = _dt(x)
    wide = accumulation(dt) != dt
    s = apply(_SUM, (astype(x, np.float64) if dt.kind in "iub" else x,), (axes, bool(keepdims), True))
    if (dt.kind in "iub" or wide) and s._spec is not None and s._spec.partial_axes:
        # numpy and jax sum, then divide: dividing each summand first is off by an ulp (the float64 sum of
        # integers is exact, so it must be made before the division; a float32 one is rounded once after it)
        s = s.with_sharding(s._spec.mesh, s._spec.dim_specs)
    out = divide(s, s.dtype.type(count) if count else s.dtype.type(np.nan))
    return out if dt.kind in "iub" or out.dtype == dt else astype(out, dt)


# ---- argmax, argmin ----------------------------------------------------------------------------------------------


def _search_op(name: str, chooser) -> OpDef:
    """argmax or argmin: the op (on a dim held whole, or every element with axis None) and its public function."""
    onnx_type = "ArgMax" if name == "argmax" else "ArgMin"

    def kernel(arrays, local):
        axis, = local.params
        x = arrays[0]
        if axis is None:
            return getattr(_xp(x), name)(x.reshape(x.shape[:local.G] + (-1,)), axis=local.G)
        return getattr(_xp(x), name)(x, axis=local.G + axis)

    @onnx_export(onnx_type, "Reshape", "Cast", "IsNaN", "ArgMax", "ReduceMax", "Where")
    def export(ex):
        """ONNX's ArgMax and ArgMin (the first index on ties, ``select_last_index=0``), over bools in int32; over
        floats the first NaN where there is one, as numpy's (ONNX does not say what they make of NaN:
        onnxruntime's ArgMin of [0, NaN, 0.5] was 0, numpy's 1)."""
        axis, = ex.params
        x0 = ex.operand(0)
        dt = ex.args[0]._dtype
        x = x0 if axis is not None else ex.emit("Reshape", [x0, ex.ints([-1])], "flat")
        axis = 0 if axis is None else int(axis)

        def result(op_type, inputs, **attrs):
            if ex.dtype == np.int64:
                return ex.finish(ex.out(op_type, inputs, **attrs), [(x0, 0)])
            i64 = ex.emit(op_type, inputs, "i64", **attrs)
            return ex.finish(ex.out("Cast", [i64], to=ex.onnx_type(ex.dtype, f"{name}'s result")), [(x0, 0)])

        xs = ex.b.cast(x, dt, ex.carrier(onnx_type, dtype=dt))
        if not is_float(dt):
            return result(onnx_type, [xs], axis=axis, keepdims=0)
        found = ex.emit(onnx_type, [xs], "found", like=-1, axis=axis, keepdims=0)
        nan = ex.nan_flags(x, 0 if x is x0 else None)  # (a flattened operand's flags: laid out as nothing nabla held)
        first = ex.emit("ArgMax", [nan], "first_nan", like=-1, axis=axis, keepdims=0)
        return result("Where", [ex.any_of(nan, [axis], False), first, found])

    def search(x: ArrayLike, axis: int | None = None, keepdims: bool = False) -> Tensor:
        r = found(x, axis)
        nd = _ndim(x)
        if not keepdims or not nd:
            return r
        return reshape(r, (1,) * nd) if axis is None else expand_dims(r, _axes(axis, nd, name)[0])

    def found(x: ArrayLike, axis: int | None) -> Tensor:
        if axis is None:
            if isinstance(x, Tensor) and x.sharding is not None and x.ndim > 1:
                return found(reshape(x, (-1,)), 0)
            return apply(op, (x,), (None,))
        if not _axes(axis, _ndim(x), name):  # 0-d, axis 0 or -1 (numpy: 0)
            return found(x, None)
        ax = _axes(axis, _ndim(x), name)[0]
        spec = x.sharding if isinstance(x, Tensor) else None
        if spec is not None and spec.dim_specs[ax].axes and x.shape[ax]:
            n = x.shape[ax]
            iota = np.arange(n, dtype=np.intp).reshape((n,) + (1,) * (x.ndim - 1 - ax))
            hits = where(x != x, iota, where(x == chooser(x, ax, keepdims=True), iota, n))
            return min(hits, ax)
        return apply(op, (x,), (ax,))

    search.__name__ = search.__qualname__ = name
    search.__module__ = "nabla"
    which = "maximum" if name == "argmax" else "minimum"
    search.__doc__ = (f"Global indices of the first {which} (numpy's ``{name}``: a NaN counts as the {which}; "
                      f"``keepdims`` keeps the searched dim as size 1). When "
                      f"the searched dim is sharded it is not gathered: the {which[:3]} is reduced across devices (an "
                      f"all_reduce of one value per remaining element), then the smallest index holding it (another).")
    op = register(OpDef(name, lambda shapes, axis: R.reduce_rule(
        shapes[0], tuple(range(len(shapes[0]))) if axis is None else (axis,), False, True), kernel,
        reduction="sum", dtype=np.intp, vjp=lambda g, node, out: (None,), saves="none",  # an index: no gradient
        numpy=name, onnx=export, arity=1, public=_named(search), flops=_per_input))
    return op


_ARGMAX = _search_op("argmax", max)
_ARGMIN = _search_op("argmin", min)
argmax, argmin = _ARGMAX.public, _ARGMIN.public


# ---- softmax ---------------------------------------------------------------------------------------------------


def _softmax_kernel(arrays, local):
    x = arrays[0]
    xp = _xp(x)
    x = x if is_inexact(x.dtype) else x.astype(exp_dtype(x.dtype))  # (x - max in int8 wraps: -100 - 100 is 56)
    if x.size == 0:
        return xp.exp(x)
    ax = local.G + local.params[0]
    if xp is np:  # what np.max calls, without its Python wrapper
        e = np.exp(x - np.maximum.reduce(x, axis=ax, keepdims=True))
    else:
        e = xp.exp(x - xp.max(x, axis=ax, keepdims=True))
    return e / _wide_sum(e, (ax,))


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
        return apply(_SOFTMAX, (x,), (axes[0],))  # one kernel: the dim is whole on every device
    with _user_op("softmax"):  # its steps' collectives are logged as softmax's
        if not axes:  # a 0-d value (numpy reduces it over axis 0 or -1): exp(0) / exp(0)
            e = exp(x - max(x))
            return e / sum(e)
        y = x if is_inexact(x._dtype) else astype(x, exp_dtype(x._dtype))  # (x - max in an integer dtype wraps)
        e = exp(y - max(y, axes[0], keepdims=True))
        return e / sum(e, axes[0], keepdims=True)


_SOFTMAX = register(OpDef("softmax", lambda shapes, axis: R.elementwise_rule((shapes[0],), (axis,), "softmax"),
                          _softmax_kernel, vjp=_softmax_vjp, onnx=_softmax_onnx, arity=1, public=softmax, saves="output",
                          flops=lambda blocks, out, params: 5 * _product(out)))  # max, subtract, exp, sum, divide


# ---- var, std ------------------------------------------------------------------------------------------------


@_named
def var(x: ArrayLike, axis: int | Sequence[int] | None = None, dtype=None, ddof: int = 0,
        keepdims: bool = False) -> Tensor:
    """numpy's ``var``: the mean of squared deviations from the mean, divided by ``n - ddof``; integers and bools
    in float64, complex values give their (real) magnitude's variance, ``dtype`` computes in that dtype;
    float16 and bfloat16 (in or as ``dtype``) are computed in float32 and rounded once, as jax.numpy's. Over a
    sharded dim nothing is gathered: the sum for the mean and the sum of squares are each reduced across
    devices (one value per remaining element)."""
    return _var(x, axis, dtype, ddof, keepdims, "var")


def _var(x: ArrayLike, axis: int | Sequence[int] | None, dtype: Any, ddof: Any, keepdims: bool, name: str
         ) -> Tensor:
    """``var``, its errors naming ``name`` (the call the user made: ``var`` or ``std``)."""
    axes = _axes(axis, _ndim(x), name)
    if not isinstance(ddof, (int, float, np.integer, np.floating)):
        raise ShardingError(f"{name}: ddof must be a number, got {ddof!r}")
    dt = _dt(x)
    out_dt = dtype_arg(dtype, name) if dtype is not None else np.dtype(np.float64) if dt.kind in "iub" else dt
    comp = accumulation(out_dt)
    if comp != dt:
        x = astype(x, comp)
    n = _product(_shape(x)[a] for a in axes)
    mu = divide(sum(x, axes, keepdims=True), n)
    d = x - mu
    sq = abs(d) * abs(d) if isinstance(d, Value) and d._dtype.kind == "c" else d * d
    out = divide(sum(sq, axes, keepdims), builtins.max(n - ddof, 0))
    return out if comp == out_dt else astype(out, out_dt)


@_named
def std(x: ArrayLike, axis: int | Sequence[int] | None = None, dtype=None, ddof: int = 0,
        keepdims: bool = False) -> Tensor:
    """numpy's ``std``: the square root of ``var`` (same dtypes, ``ddof`` and sharding: no gather)."""
    return sqrt(_var(x, axis, dtype, ddof, keepdims, "std"))


# ---- a sharded dim reduced or scanned per block, then across blocks ----------------------------------------------


def _by_blocks(x: Tensor, ax: int, fill) -> Tensor:
    """``x`` with dim ``ax`` (sharded ``k`` ways, blocks of ``c``) padded with ``fill`` to ``k*c`` and split into
    dims ``(k, c)``, ``k`` keeping the sharding: each device holds one block whole, and nothing moves."""
    spec, shape = x._spec, x._shape
    k = spec.num_shards(ax)
    c = chunk(shape[ax], k)
    if k * c != shape[ax]:
        widths = [(0, 0)] * len(shape)
        widths[ax] = (0, k * c - shape[ax])
        x = pad(x, widths, constant_values=fill)
    return reshape(x, shape[:ax] + (k, c) + shape[ax + 1:])


def _sharded(x: Any, axes: Sequence[int]) -> list[int]:
    """The dims among ``axes`` that ``x`` holds sharded (and not empty)."""
    spec = x._spec if isinstance(x, Value) else None
    return [a for a in axes if spec is not None and spec.num_shards(a) > 1 and x._shape[a]]


# ---- prod, any, all ------------------------------------------------------------------------------------------


def _prod_kernel(arrays, local):
    axes, keepdims = local.params
    x = arrays[0]
    axis = tuple(local.G + a for a in axes)
    if type(x) is np.ndarray:
        return np.multiply.reduce(x, axis=axis, keepdims=keepdims)
    return _xp(x).prod(x, axis=axis, keepdims=keepdims)


@onnx_export("ReduceProd", "Transpose", "Reshape", "Pad", "Slice", "Mul")
def _prod_onnx(ex):
    """ReduceProd; an integer product as numpy's, wrapping: the reduced dims flattened last, padded with ones to a
    power of two, and halves multiplied (Mul) until one is left. onnxruntime's integer ReduceProd goes through
    double: 3 * (2**53 + 1) in int64 was 27021597764222976 (numpy: ...979), and a product past 2**63 saturated."""
    axes, keepdims = ex.params
    x = ex.operand(0, ex.dtype)
    if ex.dtype.kind not in "iu" or not axes:
        return ex.finish(ex.out("ReduceProd", [x, ex.ints(axes, "axes")], keepdims=int(keepdims),
                                noop_with_empty_axes=int(not axes)), [(x, 0)])
    flat, n = ex.reduced_last(x, axes)
    size = 1 << (n - 1).bit_length() if n > 1 else 1
    if size != n:
        flat = ex.emit("Pad", [flat, ex.ints([0, size - n], "pads"), ex.b.constant(ex.dtype.type(1), ex.dtype),
                               ex.ints([-1], "axes")], "ones")
    last = ex.ints([-1], "axes")
    while size > 1:
        size //= 2
        lo = ex.emit("Slice", [flat, ex.ints([0], "starts"), ex.ints([size], "ends"), last], "lo")
        hi = ex.emit("Slice", [flat, ex.ints([size], "starts"), ex.ints([2 * size], "ends"), last], "hi")
        flat = ex.emit("Mul", [lo, hi], "times")
    return ex.finish(ex.out("Reshape", [flat, ex.ints(ex.step.out_shape)]), [(x, 0)])


def _prod_vjp(g, node, out):
    """d prod / dx_i = prod of the others: out / x_i where x_i != 0; where x_i is the only zero, the product of
    the rest (computed with the zero replaced by 1); elsewhere 0 (as jax)."""
    x, = node.args
    if not _is_diff(x):
        return (None,)
    axes, keepdims = node.params
    zero = equal(x, 0)
    rest = prod(where(zero, 1, x), axes, keepdims=True)  # the product without the zeros
    zeros = sum(astype(zero, np.int64), axes, keepdims=True)
    others = where(zero, where(equal(zeros, 1), rest, 0), _keep(out, axes, keepdims) / where(zero, 1, x))
    return (_keep(g, axes, keepdims) * others,)


@_named
def prod(x: ArrayLike, axis: int | Sequence[int] | None = None, dtype=None, keepdims: bool = False) -> Tensor:
    """numpy's ``prod`` (small integers and bools multiply in int64, as numpy's). A sharded reduced dim is not
    gathered: each device multiplies its block (padded with ones to the block size), then the ``k`` block
    products are gathered (one all_gather of ``k`` values per remaining element) and multiplied."""
    axes = _axes(axis, _ndim(x), "prod")
    if dtype is not None:
        x = astype(x, dtype)
    sharded = _sharded(x, axes)
    for a in sorted(sharded, reverse=True):  # each sharded dim becomes its k block products
        x = apply(_PROD, (_by_blocks(x, a, 1),), ((a + 1,), False))
    return apply(_PROD, (x,), (axes, bool(keepdims)))


_PROD = register(OpDef("prod", lambda shapes, axes, keepdims: R.reduce_rule(shapes[0], axes, keepdims, True),
                       _prod_kernel, vjp=_prod_vjp, numpy="prod", onnx=_prod_onnx, arity=1, public=prod,
                       flops=_per_input))


def _truth(name: str, reduction: str):
    def kernel(arrays, local):
        axes, keepdims = local.params
        x = arrays[0]
        return getattr(_xp(x), name)(x, axis=tuple(local.G + a for a in axes), keepdims=keepdims)

    @onnx_export("Cast", "ReduceMax" if name == "any" else "ReduceMin")
    def export(ex):
        axes, keepdims = ex.params
        x = ex.operand(0, np.dtype(np.uint8))
        red = ex.emit("ReduceMax" if name == "any" else "ReduceMin", [x, ex.ints(axes, "axes")], "u8",
                      keepdims=int(keepdims), noop_with_empty_axes=int(not axes))
        return ex.finish(ex.out("Cast", [red], to=ex.onnx_type(np.dtype(np.bool_), name)), [(x, 0)])

    return OpDef(name, lambda shapes, axes, keepdims: R.reduce_rule(shapes[0], axes, keepdims), kernel,
                 reduction=reduction, dtype=np.bool_, vjp=lambda g, node, out: (None,), saves="none", numpy=name,
                 onnx=export,
                 arity=1, flops=_per_input)


@_named
def any(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """numpy's ``any`` (a NaN is true). Over a sharded dim: each device's block, then an all_reduce (max) of one
    bool per remaining element; nothing is gathered."""
    axes = _axes(axis, _ndim(x), "any")
    return apply(_ANY, (astype(x, np.bool_),), (axes, bool(keepdims)))


@_named
def all(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """numpy's ``all``. Over a sharded dim: each device's block, then an all_reduce (min) of one bool per
    remaining element; nothing is gathered."""
    axes = _axes(axis, _ndim(x), "all")
    return apply(_ALL, (astype(x, np.bool_),), (axes, bool(keepdims)))


_ANY = register(_truth("any", "max"))
_ALL = register(_truth("all", "min"))
_ANY.public, _ALL.public = any, all


# ---- cumsum ----------------------------------------------------------------------------------------------------


def _cumsum_kernel(arrays, local):
    axis, exclusive, reverse = local.params
    x = arrays[0]
    xp = _xp(x)
    a = local.G + axis
    if reverse:
        x = xp.flip(x, a)
    out = xp.cumsum(x, axis=a)
    if exclusive and x.shape[a]:  # the sum of the elements before each one: 0, then all but the last sum
        lead = (slice(None),) * a
        out = xp.concatenate([xp.zeros_like(out[lead + (slice(0, 1),)]), out[lead + (slice(0, -1),)]], axis=a)
    return xp.flip(out, a) if reverse else out


def _cumsum_vjp(g, node, out):
    """The cotangent summed from the other end: the same scan, reversed."""
    x, = node.args
    if not _is_diff(x):
        return (None,)
    axis, exclusive, reverse = node.params
    return (astype(_scan(g, axis, exclusive, not reverse), x._dtype),)


@onnx_export("CumSum")
def _cumsum_onnx(ex):
    axis, exclusive, reverse = ex.params
    x = ex.operand(0, ex.dtype)
    return ex.finish(ex.out("CumSum", [x, ex.b.constant(np.array(axis, dtype=np.int64), base="axis")],
                            exclusive=int(exclusive), reverse=int(reverse)), [(x, 0)])


def _scan(x: Any, ax: int, exclusive: bool, reverse: bool) -> Tensor:
    """The running sum along ``ax`` (from the end with ``reverse``; of the elements strictly before with
    ``exclusive``). A sharded dim: each device scans its block and adds the exclusive scan of the block totals."""
    if not _sharded(x, (ax,)):
        return apply(_CUMSUM, (x,), (ax, exclusive, reverse))
    n = x._shape[ax]
    blocks = _by_blocks(x, ax, 0)
    others = apply(_CUMSUM, (sum(blocks, ax + 1, keepdims=True),), (ax, True, reverse))  # the other blocks' totals
    out = apply(_CUMSUM, (blocks,), (ax + 1, exclusive, reverse)) + others
    shape = list(x._shape)
    shape[ax] = blocks.shape[ax] * blocks.shape[ax + 1]
    out = reshape(out, tuple(shape))
    return out if shape[ax] == n else out[(slice(None),) * ax + (slice(0, n),)]


@_named
def cumsum(x: ArrayLike, axis: int | None = None, dtype=None) -> Tensor:
    """numpy's ``cumsum`` (``axis`` None: over the flattened tensor; small integers and bools sum in int64).

    A sharded scanned dim is not gathered: each device scans its block, and adds the sum of the blocks before
    it, an exclusive scan over the devices of that dim. What moves is one all_gather of the block totals: one
    value per remaining element from each device (``k`` of them arrive), whatever the dim's length. The gradient
    is the same scan run from the end (no reversal of the data)."""
    if axis is None:
        x, axis = reshape(x, (-1,)), 0
    ax = _axes(axis, _ndim(x), "cumsum")
    if not ax:
        raise ShardingError(f"cumsum: axis {axis} is out of range for a tensor of rank 0")
    if dtype is not None:
        x = astype(x, dtype)
    return _scan(x, ax[0], False, False)


_CUMSUM = register(OpDef("cumsum", lambda shapes, axis, exclusive, reverse: R.elementwise_rule(
    (shapes[0],), (axis,), "cumsum"), _cumsum_kernel, "add", vjp=_cumsum_vjp, saves="none", numpy="cumsum", onnx=_cumsum_onnx,
    arity=1, public=cumsum))
