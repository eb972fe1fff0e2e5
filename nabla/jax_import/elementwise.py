"""Elementwise primitives: arithmetic, comparisons, math functions, bit operations, casts, ``select_n`` and
``clamp``. JAX's types are explicit in a jaxpr, so operands already agree; where lax and numpy differ in meaning
(integer ``div`` and ``rem`` truncate and are defined by 0, ``round`` away from zero, logical right shifts, the
signs of zeros in ``sign``, ``max`` and ``min``) it is spelled out."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .. import ops as O
from ..ops import lax_ops as X
from ..ops.pointwise import erf
from ..dtypes import finfo, is_float
from ..errors import ShardingError
from . import sums
from .table import as_tensor, primitive


def _binary(fn):
    return lambda ev, e, a, b: fn(a, b)


def _unary(fn):
    return lambda ev, e, x: fn(x)


for _name, _fn in {
    "pow": O.power, "eq": O.equal, "ne": O.not_equal, "lt": O.less, "le": O.less_equal, "gt": O.greater,
    "ge": O.greater_equal, "rem": X.rem, "and": X.bitwise_and, "or": X.bitwise_or, "xor": X.bitwise_xor, "atan2": X.arctan2,
    "shift_left": X.left_shift,
}.items():
    primitive(_name, elementwise=True)(_binary(_fn))

for _name, _fn in {
    "neg": O.negative, "exp": O.exp, "log": O.log, "tanh": O.tanh, "sin": O.sin, "cos": O.cos, "tan": X.tan,
    "sqrt": O.sqrt, "abs": O.abs, "floor": O.floor, "ceil": O.ceil, "is_finite": O.isfinite,
    "logistic": O.sigmoid, "log1p": X.log1p, "expm1": X.expm1, "asin": X.arcsin, "acos": X.arccos,
    "atan": X.arctan, "asinh": X.arcsinh, "acosh": X.arccosh, "atanh": X.arctanh, "sinh": X.sinh, "cosh": X.cosh,
    "cbrt": X.cbrt, "erf": erf, "erfc": X.erfc, "erf_inv": X.erf_inv,
    "square": O.square, "not": X.invert, "stop_gradient": O.stop_gradient,
}.items():
    primitive(_name, elementwise=True)(_unary(_fn))


primitive("add", "add_any", elementwise=True)(sums.joined(O.add))
primitive("sub", elementwise=True)(sums.joined(O.subtract))
primitive("mul", elementwise=True)(sums.joined(O.multiply))


@primitive("copy", "copy_p", "optimization_barrier", "pvary", "pbroadcast", "reduce_precision_identity", "name",
           elementwise=True)
def _identity(ev, e, *xs):
    """Identities for nabla: copies, barriers, the varying-axes casts of shard_map code, and ``checkpoint_name``'s
    ``name`` (a tag only ``jax.checkpoint``'s policy reads, when JAX traces; nabla's checkpoint keeps its own)."""
    return list(xs) if e.multi else xs[0]


@primitive("reduce_precision", elementwise=True)
def _reduce_precision(ev, e, x):
    dt = np.dtype(e.out_avals[0].dtype)
    info = ml_dtypes.finfo(dt)
    if (e.params["exponent_bits"], e.params["mantissa_bits"]) == (info.nexp, info.nmant):
        return x  # the value's own precision: nothing to round
    for c in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        ci = ml_dtypes.finfo(c)
        if (e.params["exponent_bits"], e.params["mantissa_bits"]) == (ci.nexp, ci.nmant):
            return O.astype(O.astype(x, c), dt)
    raise ShardingError(f"reduce_precision to {e.params['exponent_bits']} exponent and {e.params['mantissa_bits']} "
                        f"mantissa bits is no dtype nabla has")


def _is_int(x: Any) -> bool:
    dt = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return np.dtype(dt).kind in "iu"


@primitive("div", elementwise=True)
def _div(ev, e, a, b):
    """lax's integer division truncates toward zero (numpy's floors), and is defined everywhere, as XLA's
    ``ElementalIrEmitter::EmitIntegerDivide`` says: x / 0 is -1 (all ones: an unsigned type's maximum) and
    INT_MIN / -1 is INT_MIN. numpy's floor_divide gives 0 for x // 0 and warns: it runs over a divisor of 1 there."""
    if not _is_int(a):
        return sums.joined(O.divide)(ev, e, a, b)
    dt = np.dtype(e.out_avals[0].dtype)
    zero = O.equal(b, 0)
    safe = O.where(zero, dt.type(1), b)
    q = O.floor_divide(a, safe)
    if dt.kind == "i":  # (floor to truncation: one more where the quotient is inexact and the signs differ)
        inexact = O.not_equal(O.remainder(a, safe), 0)
        signs = O.not_equal(O.less(a, 0), O.less(safe, 0))
        q = O.where(X.bitwise_and(inexact, signs), q + dt.type(1), q)
    return O.where(zero, np.array(-1).astype(dt)[()], q)


@primitive("sign", elementwise=True)
def _sign(ev, e, x):
    """lax.sign keeps a float zero's sign (XLA: sign(-0.0) is -0.0, and NaN stays NaN); numpy's sign(-0.0) is
    +0.0."""
    if not is_float(np.dtype(e.out_avals[0].dtype)):
        return O.sign(x)
    return O.where(O.equal(x, 0), x, O.sign(x))


def _extreme(fn, zeros):
    """lax.max and lax.min are IEEE 754-2019's maximum and minimum, as XLA computes them: NaN if either is NaN, and
    -0.0 below +0.0 (max(-0.0, 0.0) is +0.0 in either order, min -0.0); numpy's maximum and minimum give either
    zero, by argument order and dtype. Where both operands are zeros the result is ``zeros(a, b)``: a + b for max
    (+0.0 unless both are -0.0), -((-a) + (-b)) for min. An operand that is a nonzero constant needs nothing; max
    with a constant +0.0 (relu) one addition of it (-0.0 + 0.0 is +0.0, and it changes no other value)."""
    def run(ev, e, a, b):
        out = fn(a, b)
        if not is_float(np.dtype(e.out_avals[0].dtype)):
            return out
        c = next((np.asarray(v) for v in (a, b) if not isinstance(v, O.Tensor) and np.asarray(v).size == 1), None)
        if c is not None:  # (a literal: relu's 0.0, a clamp's bound)
            c = c.reshape(())
            if c != 0:
                return out
            if fn is O.maximum and not np.signbit(c):
                return out + c
        both = X.bitwise_and(O.equal(a, 0), O.equal(b, 0))
        return O.where(both, zeros(a, b), out)
    return run


primitive("max", elementwise=True)(_extreme(O.maximum, lambda a, b: O.add(a, b)))
primitive("min", elementwise=True)(_extreme(O.minimum, lambda a, b: O.negative(O.add(O.negative(a), O.negative(b)))))


@primitive("integer_pow", elementwise=True)
def _integer_pow(ev, e, x):
    """x**y by products for small y, as XLA expands it; x**0 is 1 for every x, NaN and infinities included (x * 0 + 1
    gave NaN there)."""
    y = int(e.params["y"])
    if y == 0:
        if not is_float(np.dtype(e.out_avals[0].dtype)):
            return O.multiply(x, 0) + 1
        one = np.dtype(e.out_avals[0].dtype).type(1)
        return O.where(O.isnan(x), one, one)  # (ones laid out as x)
    if y == 1:
        return x
    if y == 2:
        return x * x
    if y == 3:
        return x * x * x
    if y == -1:
        return 1 / x if not _is_int(x) else O.power(x, y)
    if y == -2 and not _is_int(x):
        return 1 / (x * x)
    return O.power(x, y)


@primitive("rsqrt", elementwise=True)
def _rsqrt(ev, e, x):
    return 1.0 / O.sqrt(x)


@primitive("exp2", elementwise=True)
def _exp2(ev, e, x):
    return O.power(np.asarray(2, dtype=e.out_avals[0].dtype)[()], x)


@primitive("round", elementwise=True)
def _round(ev, e, x):
    """rounding_method 0: half away from zero; 1: half to even (numpy's)."""
    method = int(getattr(e.params.get("rounding_method"), "value", e.params.get("rounding_method", 0)))
    if method == 1:
        return X.rint(x)
    big = 2.0 ** finfo(x.dtype).nmant  # from here on every float is an integer (and inf and NaN are kept)
    c = O.clip(O.where(O.isnan(x), big, x), -big, big)  # NaN kept as x below (bfloat16 compares of NaN warn)
    a = O.abs(c)  # floor(a + 0.5) would round 0.49999997 up (the sum rounds to 1.0)
    f = O.floor(a)
    m = O.where(O.greater_equal(a - f, 0.5), f + 1, f)  # a - f: exact
    r = O.where(O.less(a, 0.5), c * 0, O.where(O.less(c, 0), -m, m))  # zeros keep x's sign, as in XLA
    return O.where(O.less(a, big), r, x)


def _shift_right(kind: str):
    """A right shift in the operands' bits read as unsigned (``kind`` "u": logical) or signed ("i": arithmetic)."""
    def run(ev, e, a, b):
        dt = np.dtype(e.out_avals[0].dtype)
        if dt.kind == kind:
            return X.right_shift(a, b)
        t = np.dtype(f"{kind}{dt.itemsize}")
        return O.astype(X.right_shift(O.astype(as_tensor(a), t), O.astype(as_tensor(b), t)), dt)
    return run


primitive("shift_right_logical", elementwise=True)(_shift_right("u"))
primitive("shift_right_arithmetic", elementwise=True)(_shift_right("i"))


@primitive("convert_element_type", elementwise=True)
def _convert(ev, e, x):
    dt = np.dtype(e.params["new_dtype"])
    x = as_tensor(x)
    if x.dtype == dt:
        return x
    if dt.kind in "iu" and is_float(x.dtype):
        return _saturating(x, dt)
    return O.astype(x, dt)


def _saturating(x, dt: np.dtype):
    """XLA's float-to-integer conversion: truncation, clamped to the type's range, NaN to 0 (numpy's cast wraps or
    gives the type's minimum: 3e9 to int32 is -2**31, 300.0 to uint8 44, where XLA gives 2**31 - 1 and 255)."""
    info, top = np.iinfo(dt), float(finfo(x.dtype).max)
    hi, lo = float(info.max) + 1.0, float(info.min)  # powers of two: exact in a float wide enough to hold them
    x = O.where(O.isnan(x), 0, x)  # (first: bfloat16 compares of NaN warn)
    over = O.greater_equal(x, hi) if hi <= top else O.greater(x, top)  # (a float16 holds no 2**31: only inf is over)
    under = O.less(x, lo) if -lo <= top else O.less(x, -top)
    inside = O.where(over, 0, O.where(under, 0, x))
    return O.where(over, dt.type(info.max), O.where(under, dt.type(info.min), O.astype(inside, dt)))


@primitive("bitcast_convert_type", elementwise=True)
def _bitcast(ev, e, x):
    return X.bitcast(as_tensor(x), e.params["new_dtype"])


@primitive("select_n", elementwise=True)
def _select_n(ev, e, which, *cases):
    """``cases[which]``: a bool chooses between two; an integer among several."""
    if len(cases) == 1:
        return cases[0]
    if np.dtype(which.dtype if hasattr(which, "dtype") else np.asarray(which).dtype) == np.bool_ and len(cases) == 2:
        return O.where(which, cases[1], cases[0])
    out = cases[0]
    for i, c in enumerate(cases[1:], 1):
        out = O.where(O.equal(which, i), c, out)
    return out


@primitive("clamp", elementwise=True)
def _clamp(ev, e, lo, x, hi):
    return O.minimum(O.maximum(x, lo), hi)

