"""The numpy-like functions: each op is its rule (``rules``) plus a local kernel, run by ``executor``.

Kernels see stored blocks with ``local.G`` grid axes in front, so one numpy call serves every device.
"""

from __future__ import annotations

import builtins
import functools
from math import prod
from typing import Any, Sequence

import numpy as np

from . import rules as R
from .backends import xp as _xp
from .collectives import user_op as _user_op
from .errors import ShardingError, ShardingIndexError
from .executor import SCALARS, Local, OpDef, Value, run
from . import windows as _windows
from .layout import global_rows, grid
from .windows import out_size
from .tensor import Tensor

ArrayLike = Any  # a Tensor, a numpy array, or a Python scalar


# ---- plumbing --------------------------------------------------------------------------------------


def _arg(x: Any, op: str, i: int) -> Any:
    if isinstance(x, Value):
        return x
    if isinstance(x, SCALARS) and not isinstance(x, np.ndarray):
        return x
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - reported as the op's error
        raise ShardingError(f"{op}: operand {i} of type {type(x).__name__} is not array-like ({e})") from None
    if a.dtype.kind not in "biufc":
        raise ShardingError(f"{op}: operand {i} ({type(x).__name__} of dtype {a.dtype}) is not a numeric array")
    if a.flags.writeable:  # the caller may change their array later; the result must not change with it
        a = a.copy()
        a.flags.writeable = False
    return Value(a, None, a.shape, a.dtype)


def _named(fn):
    """The collectives a composite op runs are logged under its own name (softmax, not max and divide)."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _user_op(fn.__name__):
            return fn(*args, **kwargs)
    return wrapped


def _call(op: OpDef, args: Sequence[Any], params: tuple = ()) -> Tensor:
    return run(op, [_arg(a, op.name, i) for i, a in enumerate(args)], params, Tensor)


def _align(arrays: list, local: Local) -> list:
    """Give every block the result's rank (singletons after the grid axes) so numpy broadcasts by dim."""
    rank = len(local.out_chunk)
    if all(getattr(a, "ndim", -1) == local.G + rank for a in arrays):
        return arrays
    out = []
    for a in arrays:
        if hasattr(a, "ndim") and not isinstance(a, np.generic) and a.ndim - local.G < rank:
            a = a.reshape(a.shape[:local.G] + (1,) * (rank - a.ndim + local.G) + a.shape[local.G:])
        out.append(a)
    return out


def _elementwise(name: str, fn, linear: str | None = None, linear_args=None, dtype="sample") -> OpDef:
    """``fn`` names the function in numpy and jax.numpy alike, or is ``fn(xp, *blocks)``."""
    np_f = getattr(np, fn) if isinstance(fn, str) else (lambda *a: fn(np, *a))

    def kernel(arrays, local):
        xp = _xp(*arrays)
        f = np_f if xp is np else getattr(xp, fn) if isinstance(fn, str) else (lambda *a: fn(xp, *a))
        return f(*_align(arrays, local))

    return OpDef(name, lambda shapes, *params: R.elementwise_rule(tuple(shapes), op=name), kernel, linear,
                 linear_args, dtype=dtype, fast=np_f)


def _relu(xp, x):
    return xp.maximum(x, x.dtype.type(0) if hasattr(x, "dtype") else 0)


def _sigmoid(xp, x):
    x = xp.asarray(x)
    one = x.dtype.type(1) if x.dtype.kind == "f" else 1.0
    return one / (one + xp.exp(-x))


_BINARY = {
    "add": _elementwise("add", "add", "add"),
    "subtract": _elementwise("subtract", "subtract", "add"),
    "multiply": _elementwise("multiply", "multiply", "mul"),
    "divide": _elementwise("divide", "divide", "mul", (0,)),
    "power": _elementwise("power", "power"),
    "maximum": _elementwise("maximum", "maximum"),
    "minimum": _elementwise("minimum", "minimum"),
    "less": _elementwise("less", "less"),
    "less_equal": _elementwise("less_equal", "less_equal"),
    "greater": _elementwise("greater", "greater"),
    "greater_equal": _elementwise("greater_equal", "greater_equal"),
    "equal": _elementwise("equal", "equal"),
    "not_equal": _elementwise("not_equal", "not_equal"),
}
_UNARY = {
    "negative": _elementwise("negative", "negative", "add"),
    "exp": _elementwise("exp", "exp"),
    "log": _elementwise("log", "log"),
    "tanh": _elementwise("tanh", "tanh"),
    "sin": _elementwise("sin", "sin"),
    "cos": _elementwise("cos", "cos"),
    "sqrt": _elementwise("sqrt", "sqrt"),
    "abs": _elementwise("abs", "abs"),
    "relu": _elementwise("relu", _relu),
    "sigmoid": _elementwise("sigmoid", _sigmoid),
}
_WHERE = _elementwise("where", "where", "add", (1, 2))
# numpy's ``x ** -1`` on float arrays (see Tensor.__pow__; for complex numbers 1 / x differs in the signs of
# zeros); not a public name
_RECIPROCAL = _elementwise("reciprocal", "reciprocal")
_RECIPROCAL.vjp = lambda g, node, out: (negative(multiply(g, multiply(out, out))) if _is_diff(node.args[0]) else None,)


def add(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["add"], (a, b))
def subtract(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["subtract"], (a, b))
def multiply(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["multiply"], (a, b))
def divide(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["divide"], (a, b))
def power(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["power"], (a, b))
def maximum(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["maximum"], (a, b))
def minimum(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["minimum"], (a, b))
def less(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["less"], (a, b))
def less_equal(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["less_equal"], (a, b))
def greater(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["greater"], (a, b))
def greater_equal(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["greater_equal"], (a, b))
def equal(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["equal"], (a, b))
def not_equal(a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_BINARY["not_equal"], (a, b))
def negative(x: ArrayLike) -> Tensor: return _call(_UNARY["negative"], (x,))
def exp(x: ArrayLike) -> Tensor: return _call(_UNARY["exp"], (x,))
def log(x: ArrayLike) -> Tensor: return _call(_UNARY["log"], (x,))
def tanh(x: ArrayLike) -> Tensor: return _call(_UNARY["tanh"], (x,))
def sin(x: ArrayLike) -> Tensor: return _call(_UNARY["sin"], (x,))
def cos(x: ArrayLike) -> Tensor: return _call(_UNARY["cos"], (x,))
def sqrt(x: ArrayLike) -> Tensor: return _call(_UNARY["sqrt"], (x,))
def abs(x: ArrayLike) -> Tensor: return _call(_UNARY["abs"], (x,))  # noqa: A001
def relu(x: ArrayLike) -> Tensor: return _call(_UNARY["relu"], (x,))
def sigmoid(x: ArrayLike) -> Tensor: return _call(_UNARY["sigmoid"], (x,))
def where(cond: ArrayLike, a: ArrayLike, b: ArrayLike) -> Tensor: return _call(_WHERE, (cond, a, b))


def _astype_kernel(arrays, local):
    return arrays[0].astype(local.params[0])


_ASTYPE = OpDef("astype", lambda shapes, dt: R.elementwise_rule(tuple(shapes)), _astype_kernel, dtype="sample")


def astype(x: ArrayLike, dtype: Any) -> Tensor:
    return _call(_ASTYPE, (x,), (np.dtype(dtype),))


# ---- derivatives of the elementwise group (written with nabla ops: the backward pass shards like any code) --


def _is_diff(x: Any) -> bool:
    """Whether ``x`` needs a cotangent: a float or complex value that depends on a traced one."""
    return isinstance(x, Value) and x._node is not None and x._node.diff and x._dtype.kind in "fc"


def _unbroadcast(g: Tensor, x: Any) -> Tensor | None:
    """The cotangent of an operand that broadcasting stretched: summed back to its shape, in its dtype."""
    if not _is_diff(x):
        return None
    shape = x._shape
    lead = g.ndim - len(shape)
    if lead:
        g = sum(g, tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = sum(g, axes, keepdims=True)
    return g if g.dtype == x._dtype else astype(g, x._dtype)


def _mask(cond: Tensor, like: Any) -> Tensor:
    """``cond`` as 0/1 in the cotangent's dtype."""
    dt = like._dtype if isinstance(like, Value) and like._dtype.kind in "fc" else np.dtype(np.float64)
    return astype(cond, dt)


def _binary_vjp(da, db):
    def vjp(g, node, out):
        a, b = node.args
        return (_unbroadcast(da(g, a, b, out), a) if _is_diff(a) else None,
                _unbroadcast(db(g, a, b, out), b) if _is_diff(b) else None)
    return vjp


def _unary_vjp(dx):
    def vjp(g, node, out):
        x, = node.args
        return (_unbroadcast(dx(g, x, out), x),) if _is_diff(x) else (None,)
    return vjp


def _pow_da(g, a, b, out):
    """d(a**b)/da = b * a**(b-1), as jax: for an integer exponent 0 where b == 0 (jax's integer_pow); for a float
    one as it comes (0.0 * 0**-1: nan at a == 0, b == 0)."""
    d = multiply(b, power(a, subtract(b, 1)))
    integer = isinstance(b, (int, np.integer)) and not isinstance(b, bool) or \
        isinstance(b, Value) and b._dtype.kind in "iu"
    return g * (where(equal(b, 0), 0.0, d) if integer else d)


def _pow_db(g, a, b, out):
    """d(a**b)/db = a**b log a, with log 1 where a == 0 (as jax: 0 there unless a**b is not finite)."""
    return g * (out * log(where(equal(a, 0), 1.0, a)))


def _tie(g, a, b, win):
    """max/min: the winner takes the cotangent, a tie splits it in half (as jax)."""
    return g * (_mask(win, g) + _mask(equal(a, b), g) * 0.5)


_BINARY["add"].vjp = _binary_vjp(lambda g, a, b, o: g, lambda g, a, b, o: g)
_BINARY["subtract"].vjp = _binary_vjp(lambda g, a, b, o: g, lambda g, a, b, o: -g)
_BINARY["multiply"].vjp = _binary_vjp(lambda g, a, b, o: g * b, lambda g, a, b, o: g * a)
_BINARY["divide"].vjp = _binary_vjp(lambda g, a, b, o: g / b, lambda g, a, b, o: -(g * o) / b)
_BINARY["power"].vjp = _binary_vjp(_pow_da, _pow_db)
_BINARY["maximum"].vjp = _binary_vjp(lambda g, a, b, o: _tie(g, a, b, greater(a, b)),
                                     lambda g, a, b, o: _tie(g, a, b, less(a, b)))
_BINARY["minimum"].vjp = _binary_vjp(lambda g, a, b, o: _tie(g, a, b, less(a, b)),
                                     lambda g, a, b, o: _tie(g, a, b, greater(a, b)))
for _name in ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal"):
    _BINARY[_name].vjp = lambda g, node, out: (None, None)  # comparisons: no gradient
_UNARY["negative"].vjp = _unary_vjp(lambda g, x, o: -g)
_UNARY["exp"].vjp = _unary_vjp(lambda g, x, o: g * o)
_UNARY["log"].vjp = _unary_vjp(lambda g, x, o: g / x)
_UNARY["tanh"].vjp = _unary_vjp(lambda g, x, o: g * (1.0 - o * o))
_UNARY["sin"].vjp = _unary_vjp(lambda g, x, o: g * cos(x))
_UNARY["cos"].vjp = _unary_vjp(lambda g, x, o: -(g * sin(x)))
_UNARY["sqrt"].vjp = _unary_vjp(lambda g, x, o: g / (o * 2.0))
def _abs_dx(g, x, o):
    """d|x|/dx: the sign, 1 at 0 (as jax: select(x >= 0, g, -g)); for complex x, conj(x) / |x| (jax's
    convention for a real function of a complex value) = |x| / x, 0 at 0."""
    if isinstance(x, Value) and x._dtype.kind == "c":
        zero = equal(o, 0)
        return g * where(zero, 0.0, o / where(zero, 1.0, x))
    return g * (_mask(greater_equal(x, 0), g) * 2.0 - 1.0)


_UNARY["abs"].vjp = _unary_vjp(_abs_dx)
_UNARY["relu"].vjp = _unary_vjp(lambda g, x, o: g * _mask(greater(x, 0), g))
_UNARY["sigmoid"].vjp = _unary_vjp(lambda g, x, o: g * (o * (1.0 - o)))
_WHERE.vjp = lambda g, node, out: (None, _unbroadcast(where(node.args[0], g, 0.0), node.args[1]),
                                   _unbroadcast(where(node.args[0], 0.0, g), node.args[2]))
_ASTYPE.vjp = lambda g, node, out: (astype(g, node.args[0]._dtype) if _is_diff(node.args[0]) else None,)


# ---- contractions ----------------------------------------------------------------------------------


def _matmul_kernel(arrays, local):
    a, b = arrays
    G = local.G
    batch = len(local.out_chunk) - 2
    # give both operands the result's batch rank so grid axes line up
    a = a.reshape(a.shape[:G] + (1,) * (batch - (a.ndim - G - 2)) + a.shape[G:])
    b = b.reshape(b.shape[:G] + (1,) * (batch - (b.ndim - G - 2)) + b.shape[G:])
    return _xp(a, b).matmul(a, b)


_MATMUL = OpDef("matmul", lambda shapes: R.matmul_rule(*shapes), _matmul_kernel, "mul")


@_named
def matmul(a: ArrayLike, b: ArrayLike) -> Tensor:
    """numpy's matmul; 1-D operands are lifted to matrices and the added dim removed, as numpy does."""
    ra, rb = _ndim(a), _ndim(b)
    if ra == 0 or rb == 0:
        raise ShardingError(f"matmul: operands must have at least 1 dim, got ranks {ra} and {rb}")
    a2 = expand_dims(a, 0) if ra == 1 else a
    b2 = expand_dims(b, 1) if rb == 1 else b
    out = _call(_MATMUL, (a2, b2))
    if ra == 1:
        out = squeeze(out, out.ndim - 2)
    if rb == 1:
        out = squeeze(out, out.ndim - 1)
    return out


def _einsum_kernel(arrays, local):
    """Carry the grid axes through as extra leading letters, so one einsum serves every device."""
    subscripts = local.params[0].replace(" ", "")
    G = local.G
    if G == 0:
        return _xp(*arrays).einsum(subscripts, *arrays)
    lhs, arrow, rhs = subscripts.partition("->")
    terms = lhs.split(",")
    if not arrow:  # numpy's implicit output: ellipsis dims, then the letters used once, sorted
        letters = lhs.replace(".", "").replace(",", "")
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in subscripts]
    g = "".join(free[:G])
    xp = _xp(*arrays)
    grid = np.broadcast_shapes(*(a.shape[:G] for a in arrays))
    arrays = [xp.broadcast_to(a, grid + a.shape[G:]) for a in arrays]
    return xp.einsum(",".join(g + t for t in terms) + "->" + g + rhs, *arrays)


_EINSUM = OpDef("einsum", lambda shapes, sub: R.einsum_rule(sub, tuple(shapes)), _einsum_kernel, "mul")


def einsum(subscripts: str, *operands: ArrayLike) -> Tensor:
    """numpy's einsum (no repeated letters within one operand); contracted letters sharded on the
    operands give partial sums."""
    if not isinstance(subscripts, str):
        raise ShardingError(f"einsum: subscripts (the first argument) must be a str such as 'ij,jk->ik', got "
                            f"{type(subscripts).__name__} {_show(subscripts)}")
    return _call(_EINSUM, operands, (subscripts,))


def _matmul_vjp(g, node, out):
    a, b = node.args
    ga = _unbroadcast(matmul(g, swapaxes(b, -1, -2)), a) if _is_diff(a) else None
    gb = _unbroadcast(matmul(swapaxes(a, -1, -2), g), b) if _is_diff(b) else None
    return ga, gb


_MATMUL.vjp = _matmul_vjp


def _einsum_terms(subscripts: str, shapes) -> tuple[list[str], str]:
    """Explicit letters for every operand and the output (ellipses spelled out, implicit output made explicit)."""
    spec = subscripts.replace(" ", "")
    lhs, arrow, rhs = spec.partition("->")
    terms = lhs.split(",")
    letters = [c for c in lhs if c.isalpha()]
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in spec]
    ell = builtins.max((len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t), default=0)
    e = "".join(spare[:ell])
    out_terms = [t.replace("...", e[ell - (len(s) - (len(t) - 3)):]) if "..." in t else t
                 for t, s in zip(terms, shapes)]
    if arrow:
        out = rhs.replace("...", e)
    else:
        out = e + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return out_terms, out


def _einsum_vjp(g, node, out):
    operands = node.args
    shapes = [_shape(x) for x in operands]
    terms, res = _einsum_terms(node.params[0], shapes)
    sizes = {c: n for t, s in zip(terms, shapes) for c, n in zip(t, s) if n != 1}
    grads = []
    for i, (x, t) in enumerate(zip(operands, terms)):
        if not _is_diff(x):
            grads.append(None)
            continue
        others = [(o, u) for j, (o, u) in enumerate(zip(operands, terms)) if j != i]
        seen = set(res) | {c for _, u in others for c in u}
        keep = "".join(c for c in t if c in seen)
        d = einsum(",".join([res] + [u for _, u in others]) + "->" + keep, g, *(o for o, _ in others))
        if keep != t:  # letters summed in x alone: their cotangent is broadcast back
            d = broadcast_to(reshape(d, tuple(sizes.get(c, 1) if c in keep else 1 for c in t)),
                             tuple(sizes.get(c, 1) for c in t))
        grads.append(_unbroadcast(d, x) if d.shape != x._shape else
                     (d if d.dtype == x._dtype else astype(d, x._dtype)))
    return tuple(grads)


_EINSUM.vjp = _einsum_vjp


# ---- reductions ------------------------------------------------------------------------------------


def _axes(axis, ndim: int, op: str) -> tuple[int, ...]:
    if type(axis) is int and 0 < ndim and -ndim <= axis < ndim:  # the common call, checked in one line
        return (axis % ndim,)
    if axis is None:
        return tuple(range(ndim))
    if ndim == 0 and isinstance(axis, (int, np.integer)) and not isinstance(axis, (bool, np.bool_)) and axis in (0, -1):
        return ()  # numpy lets a 0-d array be reduced over an int axis 0 (or -1): nothing to reduce
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, (bool, np.bool_)):
        axes = (axis,)
    elif isinstance(axis, (tuple, list)):
        axes = tuple(axis)
    else:  # numpy raises TypeError here; nabla's errors about op arguments are ShardingErrors (ValueErrors)
        raise ShardingError(f"{op}: axis must be None, an int or a tuple of ints, got {type(axis).__name__} "
                            f"{_show(axis)}")
    out = []
    for a in axes:
        if not isinstance(a, (int, np.integer)) or isinstance(a, (bool, np.bool_)):
            raise ShardingError(f"{op}: axis {_show(axis)} holds {type(a).__name__} {_show(a)}; axes are ints")
        if not -ndim <= a < ndim:
            raise ShardingError(f"{op}: axis {a} is out of range for a tensor of rank {ndim}")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ShardingError(f"{op}: repeated axis in {axis}")
    return tuple(sorted(out))


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


def _reduction(name: str, linear, reduction, replicate=False) -> OpDef:
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

    return OpDef(name, lambda shapes, axes, keepdims: R.reduce_rule(shapes[0], axes, keepdims, replicate),
                 kernel, linear, None, reduction, folds=reduction != "sum")


_SUM = _reduction("sum", "add", "sum")
_MAX = _reduction("max", None, "max")
_MIN = _reduction("min", None, "min")


def _ndim(x) -> int:
    return len(x._shape) if isinstance(x, Value) else np.ndim(x)


def _shape(x) -> tuple[int, ...]:
    return x._shape if isinstance(x, Value) else np.shape(x)


def sum(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001 - numpy's name
    return _call(_SUM, (x,), (_axes(axis, _ndim(x), "sum"), bool(keepdims)))


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


_SUM.vjp = _sum_vjp
_MAX.vjp = _chooser_vjp
_MIN.vjp = _chooser_vjp


def _argmax_kernel(arrays, local):
    axis, = local.params
    x = arrays[0]
    if axis is None:
        G = local.G
        flat = x.reshape(x.shape[:G] + (-1,))
        return _xp(x).argmax(flat, axis=G)
    return _xp(x).argmax(x, axis=local.G + axis)


_ARGMAX = OpDef("argmax", lambda shapes, axis: R.reduce_rule(
    shapes[0], tuple(range(len(shapes[0]))) if axis is None else (axis,), False, True), _argmax_kernel,
    reduction="sum", dtype=np.intp)


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


_SOFTMAX = OpDef("softmax", lambda shapes, axis: R.elementwise_rule((shapes[0],), (axis,), "softmax"),
                 _softmax_kernel)


def _softmax_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    ax = node.params[0]
    return (out * (g - sum(g * out, ax, keepdims=True)),)


_SOFTMAX.vjp = _softmax_vjp
_ARGMAX.vjp = lambda g, node, out: (None,)  # an index: no gradient


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


# ---- moving elements -------------------------------------------------------------------------------


def _transpose_kernel(arrays, local):
    G = local.G
    return arrays[0].transpose(tuple(range(G)) + tuple(G + p for p in local.params[0]))


_TRANSPOSE = OpDef("transpose", lambda shapes, perm: R.transpose_rule(shapes[0], perm), _transpose_kernel, "add",
                   dtype="same")


def transpose(x: ArrayLike, axes: Sequence[int] | None = None) -> Tensor:
    n = _ndim(x)
    if axes is None:
        perm = tuple(range(n))[::-1]
    else:
        axes = tuple(axes)
        if len(axes) != n or any(not isinstance(a, (int, np.integer)) or isinstance(a, bool) or not -n <= a < n
                                 for a in axes):
            raise ShardingError(f"transpose: axes {axes} are not a permutation of the {n} dims of shape {_shape(x)}")
        perm = tuple(int(a) % n for a in axes)
    if sorted(perm) != list(range(n)):
        raise ShardingError(f"transpose: axes {axes} are not a permutation of {n} dims")
    return _call(_TRANSPOSE, (x,), (perm,))


def swapaxes(x: ArrayLike, axis1: int, axis2: int) -> Tensor:
    n = _ndim(x)
    a, b = _axes(axis1, n, "swapaxes")[0], _axes(axis2, n, "swapaxes")[0]
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return _call(_TRANSPOSE, (x,), (tuple(perm),))


def _reshape_kernel(arrays, local):
    x = arrays[0]
    return x.reshape(x.shape[:local.G] + local.out_chunk)


_RESHAPE = OpDef("reshape", lambda shapes, target: R.reshape_rule(shapes[0], target), _reshape_kernel, "add",
                 dtype="same")


def reshape(x: ArrayLike, shape: int | Sequence[int]) -> Tensor:
    """Keeps the sharding wherever the dims split or merge into common factors (sub-axes where needed)."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    src = _shape(x)
    total = 1
    for s in src:
        total *= s
    negative = [s for s in shape if s < 0]
    if len(negative) > 1:
        raise ShardingError(f"reshape: can only specify one unknown dim (-1), got shape {shape} for a tensor "
                            f"of shape {tuple(src)}")
    if negative and negative[0] != -1:  # numpy 2.4 takes any negative as -1 (undocumented); JAX refuses it
        raise ShardingError(f"reshape: negative dim {negative[0]} in shape {shape} for a tensor of shape "
                            f"{tuple(src)}; only -1 (one unknown dim) is allowed")
    if -1 in shape:
        rest = 1
        for s in shape:
            if s != -1:
                rest *= s
        if rest == 0 or total % rest:
            raise ShardingError(f"reshape: cannot reshape size {total} {tuple(src)} into {shape}")
        shape = tuple(total // rest if s == -1 else s for s in shape)
    return _call(_RESHAPE, (x,), (shape,))


def _broadcast_kernel(arrays, local):
    x = _align(arrays, local)[0]
    return _xp(x).broadcast_to(x, x.shape[:local.G] + local.out_chunk)


_BROADCAST = OpDef("broadcast_to", lambda shapes, target: R.broadcast_to_rule(shapes[0], target), _broadcast_kernel,
                   "add", dtype="same")


def broadcast_to(x: ArrayLike, shape: int | Sequence[int]) -> Tensor:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    return _call(_BROADCAST, (x,), (shape,))


def _expand_kernel(arrays, local):
    return arrays[0].reshape(arrays[0].shape[:local.G] + local.out_chunk)


_EXPAND = OpDef("expand_dims", lambda shapes, axes: R.expand_dims_rule(shapes[0], axes), _expand_kernel, "add",
                dtype="same")
_SQUEEZE = OpDef("squeeze", lambda shapes, axes: R.squeeze_rule(shapes[0], axes), _expand_kernel, "add",
                 dtype="same")


def expand_dims(x: ArrayLike, axis: int | Sequence[int]) -> Tensor:
    n = _ndim(x)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = _axes(axes, n + len(axes), "expand_dims")
    return _call(_EXPAND, (x,), (axes,))


def squeeze(x: ArrayLike, axis: int | Sequence[int] | None = None) -> Tensor:
    shape = _shape(x)
    axes = tuple(d for d, s in enumerate(shape) if s == 1) if axis is None else _axes(axis, len(shape), "squeeze")
    for a in axes:
        if shape[a] != 1:
            raise ShardingError(f"squeeze: dim {a} has size {shape[a]}, not 1")
    return _call(_SQUEEZE, (x,), (axes,))


def _concat_kernel(arrays, local):
    G = local.G
    xp = _xp(*arrays)
    axis = local.params[0]
    if not local.windowed:
        return xp.concatenate(arrays, axis=axis)
    # each operand's block is already its window into the result's rows (padding elsewhere): pick, per row,
    # the operand that owns it; `rows` holds the global result row of every local row
    rows, offsets = local.aux
    out = arrays[-1]
    for j in range(len(arrays) - 2, -1, -1):
        out = xp.where((rows >= offsets[j]) & (rows < offsets[j + 1]), arrays[j], out)
    return out


def _concat_aux(spec, cuts, shapes, params):
    axis = params[0]
    offsets = tuple(int(o) for o in np.cumsum([0] + [s[axis] for s in shapes]))
    return global_rows(spec, cuts, offsets[-1], axis, len(shapes[0])), offsets


_CONCAT = OpDef("concatenate", lambda shapes, axis: R.concatenate_rule(tuple(shapes), axis), _concat_kernel, "add",
                aux=_concat_aux)


def concatenate(tensors: Sequence[ArrayLike], axis: int = 0) -> Tensor:
    """A sharded joined dim stays sharded: each device receives only the rows of its result block it lacks."""
    tensors = list(tensors)
    if not tensors:
        raise ShardingError("concatenate: needs at least one operand")
    return _call(_CONCAT, tensors, (_axes(axis, _ndim(tensors[0]), "concatenate")[0],))


def _index_kernel(arrays, local):
    key = local.params[0]
    idx = [slice(None)] * local.G
    for e in key:
        if e[0] == "full":
            idx.append(slice(None))
        elif e[0] == "reverse":  # blocks were already swapped across devices: reverse each one locally
            idx.append(slice(None, None, -1))
        elif e[0] == "slice":
            start, stop, step = e[1:]
            if local.windowed and step > 0:  # the window factor already cut each block to its window
                idx.append(slice(None, None, step))
            elif step < 0 and start < 0:  # slice.indices gives start -1 for "before 0": nothing is taken
                idx.append(slice(0, 0))
            else:
                idx.append(slice(start, stop if stop >= 0 else None, step))  # slice.indices gives -1 for "past 0"
        elif e[0] == "int":
            idx.append(e[1])
        else:
            idx.append(None)
    out = arrays[0][tuple(idx)]
    if any(e[0] == "empty" for e in key):  # a False index: the new axis holds nothing
        at = [e[0] for e in key if e[0] != "int"]
        out = out[(slice(None),) * local.G + tuple(slice(0, 0) if e == "empty" else slice(None) for e in at)]
    return out


_INDEX = OpDef("getitem", lambda shapes, key: R.index_rule(shapes[0], key), _index_kernel, "add", dtype="same")


def _normalize_key(key, shape: tuple[int, ...]) -> tuple[tuple, ...]:
    if not isinstance(key, tuple):
        key = (key,)
    n_real = len([k for k in key if k is not None and k is not Ellipsis and not isinstance(k, (bool, np.bool_))])
    if n_real > len(shape):
        raise ShardingIndexError(f"getitem: {n_real} indices for a tensor of rank {len(shape)}")
    if builtins.sum(k is Ellipsis for k in key) > 1:
        raise ShardingError("getitem: an index can only have a single ellipsis")
    out: list[tuple] = []
    d = 0
    for k in key:
        if k is Ellipsis:
            for _ in range(len(shape) - n_real):
                out.append(("full",))
                d += 1
        elif k is None or k is True or (isinstance(k, np.bool_) and k):
            out.append(("new",))  # numpy: a True scalar index adds an axis of size 1
        elif k is False or isinstance(k, np.bool_):
            out.append(("empty",))  # ... and False one of size 0
        elif isinstance(k, slice):
            start, stop, step = k.indices(shape[d])
            if (start, stop, step) == (0, shape[d], 1):
                out.append(("full",))
            elif step == -1 and start == shape[d] - 1 and stop == -1:
                out.append(("reverse",))
            else:
                out.append(("slice", start, stop, step))
            d += 1
        elif isinstance(k, (int, np.integer)):
            if not -shape[d] <= k < shape[d]:
                raise ShardingIndexError(f"getitem: index {k} is out of bounds for dim {d} of size {shape[d]}")
            out.append(("int", int(k) % shape[d]))
            d += 1
        else:
            raise ShardingError(f"getitem: only basic indexing (ints, slices, None, ...) is supported, got {k!r}")
    while d < len(shape):
        out.append(("full",))
        d += 1
    return tuple(out)


_KEYS: dict = {}  # (hashable form of an index, shape) -> its normalized form


def getitem(x: ArrayLike, key: Any) -> Tensor:
    """Basic indexing. A sharded dim cut by a forward slice stays sharded: each device receives only the rows
    of its result block it lacks (none where they line up); a reversed dim is one collective_permute."""
    shape = _shape(x)
    parts = key if type(key) is tuple else (key,)
    try:
        hk = (tuple((k.start, k.stop, k.step) if type(k) is slice else (type(k), k) for k in parts), shape)
        norm = _KEYS.get(hk)
    except TypeError:  # an unhashable index: refused by _normalize_key with its message
        hk, norm = None, None
    if norm is None:
        norm = _normalize_key(key, shape)
        if hk is not None and len(_KEYS) < 4096:
            _KEYS[hk] = norm
    return _call(_INDEX, (x,), (norm,))


# ---- derivatives of the ops that move elements ----------------------------------------------------------


def _transpose_vjp(g, node, out):
    perm = node.params[0]
    inv = tuple(int(i) for i in np.argsort(perm))
    return (transpose(g, inv),) if _is_diff(node.args[0]) else (None,)


def _reshape_vjp(g, node, out):
    x = node.args[0]
    return (reshape(g, x._shape),) if _is_diff(x) else (None,)


_TRANSPOSE.vjp = _transpose_vjp
_RESHAPE.vjp = _reshape_vjp
_EXPAND.vjp = _reshape_vjp
_SQUEEZE.vjp = _reshape_vjp
_BROADCAST.vjp = lambda g, node, out: (_unbroadcast(g, node.args[0]),)


def _concat_vjp(g, node, out):
    axis = node.params[0]
    grads, off = [], 0
    for x in node.args:
        n = _shape(x)[axis]
        if _is_diff(x):
            key = (slice(None),) * axis + (slice(off, off + n),)
            grads.append(getitem(g, key))
        else:
            grads.append(None)
        off += n
    return tuple(grads)


_CONCAT.vjp = _concat_vjp


def _pad_dim(g: Tensor, axis: int, before: int, after: int) -> Tensor:
    """Zeros around ``g`` along ``axis`` (a concatenate: a sharded dim stays sharded)."""
    parts = []
    shape = list(g.shape)
    if before:
        shape[axis] = before
        parts.append(zeros(tuple(shape), g.dtype))
    parts.append(g)
    if after:
        shape[axis] = after
        parts.append(zeros(tuple(shape), g.dtype))
    return g if len(parts) == 1 else concatenate(parts, axis)


def _scatter_slice(g: Tensor, axis: int, n: int, start: int, step: int) -> Tensor:
    """The transpose of ``x[start::step]`` along ``axis`` (``step > 0``): each row back at its place, zeros
    between (rows spread by stacking zeros beside them and merging), zeros around."""
    m = g.shape[axis]
    if m == 0:
        shape = list(g.shape)
        shape[axis] = n
        return zeros(tuple(shape), g.dtype)
    if step > 1:
        wide = list(g.shape)
        wide.insert(axis + 1, step - 1)
        spread = concatenate([expand_dims(g, axis + 1), zeros(tuple(wide), g.dtype)], axis + 1)
        merged = list(g.shape)
        merged[axis] = m * step
        g = reshape(spread, tuple(merged))
        g = getitem(g, (slice(None),) * axis + (slice(0, (m - 1) * step + 1),))
    span = (m - 1) * step + 1
    return _pad_dim(g, axis, start, n - start - span)


def _getitem_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    key = node.params[0]
    shape = x._shape
    # undo new axes and integer indices first, then slices dim by dim
    squeeze_at = [i for i, e in enumerate([e for e in key if e[0] != "int"]) if e[0] == "new"]
    if squeeze_at:
        g = squeeze(g, tuple(squeeze_at))
    d = 0
    entries = [e for e in key if e[0] != "new"]
    for e in entries:
        if e[0] == "int":
            g = expand_dims(g, d)
        d += 1
    for d, e in enumerate(entries):
        n = shape[d]
        if e[0] == "reverse":
            g = getitem(g, (slice(None),) * d + (slice(None, None, -1),))
        elif e[0] == "int":
            g = _pad_dim(g, d, e[1], n - e[1] - 1)
        elif e[0] == "slice":
            start, stop, step = e[1:]
            if step > 0:
                g = _scatter_slice(g, d, n, start, step)
            else:  # x[start:stop:step] is the reversed x cut forward from n-1-start by -step
                g = getitem(_scatter_slice(g, d, n, n - 1 - start, -step), (slice(None),) * d + (slice(None, None, -1),))
    return (g if g.dtype == x._dtype else astype(g, x._dtype),)


_INDEX.vjp = _getitem_vjp


# ---- creation --------------------------------------------------------------------------------------
# Every constructor refuses bad input with a ShardingError naming the argument: no TypeError, no
# OverflowError, no object or str tensor, no silently truncated shape.

from .mesh import MAX_RANK, _bounded_tuple, _show  # noqa: E402 - kept with the creation functions that use them

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





# ---- convolution, pooling, normalization (the ONNX formalism draft's fifth group) ------------------------------------------


def _per_dim(v: Any, nd: int, what: str, op: str) -> tuple[int, ...]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = (int(v),) * nd
    try:
        v = tuple(int(i) for i in v)
    except (TypeError, ValueError):
        raise ShardingError(f"{op}: {what} must be an int or {nd} ints, got {v!r}") from None
    if len(v) != nd or any(i < 1 for i in v):
        raise ShardingError(f"{op}: {what} needs {nd} ints >= 1 (one per spatial dim), got {v}")
    return v


def _pads(padding: Any, nd: int, op: str) -> tuple[tuple[int, int], ...]:
    """An int, one int per spatial dim, or one (before, after) pair per spatial dim."""
    if isinstance(padding, (int, np.integer)) and not isinstance(padding, bool):
        out = ((int(padding), int(padding)),) * nd
    else:
        try:
            items = list(padding)
            if len(items) == nd and all(isinstance(p, (int, np.integer)) for p in items):
                out = tuple((int(p), int(p)) for p in items)
            else:
                out = tuple((int(a), int(b)) for a, b in items)
        except (TypeError, ValueError):
            raise ShardingError(f"{op}: padding must be an int, {nd} ints or {nd} (before, after) pairs, "
                                f"got {padding!r}") from None
    if len(out) != nd or any(a < 0 or b < 0 for a, b in out):
        raise ShardingError(f"{op}: padding needs {nd} non-negative (before, after) pairs, got {padding!r}")
    return out


def _pad_spatial(x, pads, fill, G: int = 0):
    """Host path (no window factors ran): pad the spatial dims as the op asks."""
    if not any(a or b for a, b in pads):
        return x
    widths = [(0, 0)] * (G + 2) + list(pads)
    return _xp(x).pad(x, widths, constant_values=_windows._fill_value(fill, x.dtype))


def _conv_kernel(arrays, local):
    x, w = arrays
    stride, padding, dilation, groups = local.params
    if not local.windowed:
        x = _pad_spatial(x, padding, 0)
    G = local.G
    # a sharded group factor leaves each device its own groups: as many as its channels hold
    return _windows.conv(x, w, G, stride, dilation, x.shape[G + 1] // w.shape[G + 1])


_CONV = OpDef("conv", lambda shapes, stride, padding, dilation, groups: R.conv_rule(
    shapes[0], shapes[1], stride, padding, dilation, groups), _conv_kernel, "mul",
    dtype=lambda a, b: np.result_type(a, b))


@_named
def conv(x: ArrayLike, w: ArrayLike, bias: ArrayLike | None = None, stride: Any = 1, padding: Any = 0,
         dilation: Any = 1, groups: int = 1) -> Tensor:
    """N-d convolution (cross-correlation) in ONNX's layout: ``x (N, C, *spatial)``, ``w (O, C/groups,
    *kernel)``. Batch and output channels pass through; sharded input channels give partial sums; a sharded
    spatial dim stays sharded, each device receiving only the halo rows its windows read."""
    nd = _ndim(x) - 2
    if nd < 1:
        raise ShardingError(f"conv: x must be (N, C, *spatial), got shape {_shape(x)}")
    if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool):
        raise ShardingError(f"conv: groups must be an int, got {groups!r}")
    params = (_per_dim(stride, nd, "stride", "conv"), _pads(padding, nd, "conv"),
              _per_dim(dilation, nd, "dilation", "conv"), int(groups))
    out = _call(_CONV, (x, w), params)
    if bias is not None:
        out = add(out, reshape(bias, (-1,) + (1,) * nd))
    return out


def _pool_params(x, kernel_size, stride, padding, dilation, op):
    nd = _ndim(x) - 2
    if nd < 1:
        raise ShardingError(f"{op}: x must be (N, C, *spatial), got shape {_shape(x)}")
    kernel = _per_dim(kernel_size, nd, "kernel_size", op)
    stride = kernel if stride is None else _per_dim(stride, nd, "stride", op)
    return kernel, stride, _pads(padding, nd, op), _per_dim(dilation, nd, "dilation", op)


def _max_pool_kernel(arrays, local):
    kernel, stride, padding, dilation = local.params
    x = arrays[0]
    if not local.windowed:
        x = _pad_spatial(x, padding, -np.inf)
    return _windows.max_pool(x, local.G, kernel, stride, dilation)


_MAX_POOL = OpDef("max_pool", lambda shapes, kernel, stride, padding, dilation: R.pool_rule(
    shapes[0], kernel, stride, padding, dilation, -np.inf, "max_pool"), _max_pool_kernel, dtype="same")


def max_pool(x: ArrayLike, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1) -> Tensor:
    """Max over each window (padding never wins); a sharded spatial dim exchanges halo rows only."""
    return _call(_MAX_POOL, (x,), _pool_params(x, kernel_size, stride, padding, dilation, "max_pool"))


def _avg_pool_kernel(arrays, local):
    kernel, stride, padding, dilation, include = local.params
    x = arrays[0]
    if not local.windowed:
        x = _pad_spatial(x, padding, 0)
        n = x.shape[2:]
        outs = tuple((ni - (k - 1) * d - 1) // s + 1 for ni, k, d, s in zip(n, kernel, dilation, stride))
        counts = _windows.avg_divisor([m - a - b for m, (a, b) in zip(n, padding)], [0] * len(n), outs, kernel,
                                      stride, [a for a, _ in padding], include, dilation)
    else:
        counts = local.aux[0]
    return _windows.avg_pool(x, local.G, kernel, stride, counts, dilation)


def _avg_pool_aux(spec, cuts, shapes, params):
    kernel, stride, padding, dilation, include = params
    x = shapes[0]
    g = grid(spec, cuts)
    nd = len(kernel)
    outs = [out_size(x[2 + i], kernel[i], stride[i], dilation[i], *padding[i]) for i in range(nd)]
    axes = [tuple(a for a in g.dims[2 + i] if g.shape[a] > 1) for i in range(nd)]
    return (_windows.avg_divisor_blocks(len(g.shape), g.shape, axes, x[2:], outs, kernel, stride,
                                        [a for a, _ in padding], include, dilation),)


_AVG_POOL = OpDef("avg_pool", lambda shapes, kernel, stride, padding, dilation, include: R.pool_rule(
    shapes[0], kernel, stride, padding, dilation, 0.0, "avg_pool"), _avg_pool_kernel,
    dtype=lambda a: a if a.kind in "fc" else np.dtype(np.float64), aux=_avg_pool_aux)


def avg_pool(x: ArrayLike, kernel_size: Any, stride: Any = None, padding: Any = 0, count_include_pad: bool = True,
             dilation: Any = 1) -> Tensor:
    """Mean over each window; with ``count_include_pad=False`` padding is left out of the divisor."""
    params = _pool_params(x, kernel_size, stride, padding, dilation, "avg_pool") + (bool(count_include_pad),)
    return _call(_AVG_POOL, (x,), params)


@_named
def global_avg_pool(x: ArrayLike) -> Tensor:
    """Mean over every spatial dim, kept as size-1 dims (a sharded spatial dim leaves partial sums)."""
    nd = _ndim(x) - 2
    if nd < 1:
        raise ShardingError(f"global_avg_pool: x must be (N, C, *spatial), got shape {_shape(x)}")
    return mean(x, tuple(range(2, 2 + nd)), keepdims=True)


@_named
def batch_norm(x: ArrayLike, mean: ArrayLike, var: ArrayLike, scale: ArrayLike, bias: ArrayLike,
               eps: float = 1e-5) -> Tensor:
    """Inference form, per channel (dim 1): ``(x - mean) / sqrt(var + eps) * scale + bias``."""
    nd = _ndim(x) - 2
    if nd < 0:
        raise ShardingError(f"batch_norm: x must be (N, C, ...), got shape {_shape(x)}")
    shape = (-1,) + (1,) * nd
    inv = reshape(divide(scale, sqrt(add(var, eps))), shape)
    return add(multiply(subtract(x, reshape(mean, shape)), inv), reshape(bias, shape))


@_named
def layer_norm(x: ArrayLike, scale: ArrayLike | None = None, bias: ArrayLike | None = None, axis: Any = -1,
               eps: float = 1e-5) -> Tensor:
    """Normalise over ``axis`` (an int or a tuple, the trailing dims the scale and bias cover). Over a
    sharded dim: two all_reduces, the mean's and the variance's."""
    axes = _axes(axis, _ndim(x), "layer_norm")
    mu = mean(x, axes, keepdims=True)
    centred = subtract(x, mu)
    var = mean(multiply(centred, centred), axes, keepdims=True)
    out = divide(centred, sqrt(add(var, eps)))
    if scale is not None:
        out = multiply(out, scale)
    if bias is not None:
        out = add(out, bias)
    return out


# ---- derivatives of the windowed ops: each window tap is a strided slice (a window op itself), so the
# backward pass keeps spatial dims sharded and exchanges halos like the forward one ---------------------------


def _taps(kernel, stride, dilation, outs):
    """Per kernel tap, the index key of the strided slice of the padded input that it reads."""
    for tap in np.ndindex(*kernel):
        yield tap, (slice(None), slice(None)) + tuple(
            slice(t * d, t * d + (o - 1) * s + 1, s) for t, d, o, s in zip(tap, dilation, outs, stride))


def _padded(x, pads, fill=0.0):
    for i, (lo, hi) in enumerate(pads):
        if lo or hi:
            if fill == 0.0:
                x = _pad_dim(x, 2 + i, lo, hi)
            else:
                shape = list(x.shape)
                parts = []
                for n in (lo, hi):
                    shape[2 + i] = n
                    parts.append(full(tuple(shape), fill, x.dtype) if n else None)
                x = concatenate([p for p in (parts[0], x, parts[1]) if p is not None], 2 + i)
    return x


def _unpad(g, pads, shape):
    key = (slice(None), slice(None)) + tuple(slice(lo, lo + n) for (lo, _), n in zip(pads, shape[2:]))
    return getitem(g, key)


def _scatter_taps(parts, shape, pads, stride, dilation, outs):
    """Sum the cotangents of the window taps back into the (unpadded) input."""
    padded = tuple(n + lo + hi for n, (lo, hi) in zip(shape[2:], pads))
    total = None
    for tap, part in parts:
        g = part
        for i, (t, d, s, n) in enumerate(zip(tap, dilation, stride, padded)):
            g = _scatter_slice(g, 2 + i, n, t * d, s)
        total = g if total is None else add(total, g)
    return _unpad(total, pads, shape)


def _conv_vjp(g, node, out):
    x, w = node.args
    stride, pads, dilation, groups = node.params
    kernel = _shape(w)[2:]
    outs = g.shape[2:]
    N, C = _shape(x)[:2]
    O, Cg = _shape(w)[:2]
    og = O // groups
    gg = reshape(g, (N, groups, og) + outs)
    gx = gw = None
    if _is_diff(w):
        xp = _padded(x, pads)
        cols = [reshape(getitem(xp, key), (N, groups, Cg) + outs) for _, key in _taps(kernel, stride, dilation, outs)]
        letters = "".join("stuv"[:len(outs)])
        per_tap = [einsum(f"ngc{letters},ngo{letters}->goc", c, gg) for c in cols]
        gw = reshape(concatenate([expand_dims(t, -1) for t in per_tap], -1), (O, Cg) + tuple(kernel))
        gw = gw if gw.dtype == w._dtype else astype(gw, w._dtype)
    if _is_diff(x):
        wg = reshape(w, (groups, og, Cg, -1))
        letters = "".join("stuv"[:len(outs)])
        parts = []
        for j, (tap, _) in enumerate(_taps(kernel, stride, dilation, outs)):
            part = einsum(f"ngo{letters},goc->ngc{letters}", gg, getitem(wg, (slice(None),) * 3 + (j,)))
            parts.append((tap, reshape(part, (N, C) + outs)))
        gx = _scatter_taps(parts, _shape(x), pads, stride, dilation, outs)
        gx = gx if gx.dtype == x._dtype else astype(gx, x._dtype)
    return gx, gw


def _max_pool_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    kernel, stride, pads, dilation = node.params
    outs = g.shape[2:]
    xp = _padded(x, pads, -np.inf)
    parts, taken = [], None
    for tap, key in _taps(kernel, stride, dilation, outs):
        hit = equal(getitem(xp, key), out)
        if taken is not None:  # the first tap holding the max takes the cotangent (as XLA's select)
            hit = where(taken, False, hit)
        taken = hit if taken is None else where(taken, True, hit)
        parts.append((tap, where(hit, g, 0.0)))
    return (_scatter_taps(parts, _shape(x), pads, stride, dilation, outs),)


def _avg_pool_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    kernel, stride, pads, dilation, include = node.params
    outs = g.shape[2:]
    counts = _windows.avg_divisor([n for n in _shape(x)[2:]], [0] * len(outs), outs, kernel, stride,
                                  [lo for lo, _ in pads], include, dilation)
    share = g / tensor(counts.astype(g.dtype if g.dtype.kind in "fc" else np.float64))
    parts = [(tap, share) for tap, _ in _taps(kernel, stride, dilation, outs)]
    gx = _scatter_taps(parts, _shape(x), pads, stride, dilation, outs)
    return (gx if gx.dtype == x._dtype else astype(gx, x._dtype),)


_CONV.vjp = _conv_vjp
_MAX_POOL.vjp = _max_pool_vjp
_AVG_POOL.vjp = _avg_pool_vjp


def full(shape: int | Sequence[int], value: Any, dtype: Any = "float32") -> Tensor:
    return Tensor._host(np.full(shape, value, dtype=dtype))
