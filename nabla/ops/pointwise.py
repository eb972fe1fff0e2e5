"""Elementwise ops (arithmetic, comparisons, unary math, ``where``, ``astype``): one registry entry each, with
its derivative and its ONNX export. Their rule is one factor per dim; numpy broadcasting decides the rest."""

from __future__ import annotations

import math
from math import prod
from typing import Any

import numpy as np

from ..dtypes import exp_dtype, is_float, is_inexact
from .. import rules as R
from ..backends import xp as _xp
from ..errors import ShardingError
from ..value import Value
from ..opdef import OpDef
from .core import ArrayLike, Tensor, apply, _is_diff, _mask
from .registry import _unbroadcast, elementwise, onnx_export, register
from ..collectives import user_op
from ..args import dtype_arg


# ---- ONNX export of the elementwise group -----------------------------------------------------------------------


def _arith(op_type: str, bool_type: str | None = None):
    """Arithmetic in the result's dtype; on bools numpy's logic (``+`` is or, ``*`` is and) or an error."""
    @onnx_export(*((op_type,) if op_type != "Pow" else _POWER_TYPES))
    def export(ex):
        if ex.dtype == np.bool_ and bool_type is None:
            raise ShardingError(f"export: op {ex.name} on bool operands has no ONNX form (numpy computes it as "
                                f"int8 and casts back); cast the operands first")
        if op_type == "Pow" and ex.dtype.kind in "iu":
            return _integer_power(ex)
        return ex.one(bool_type if ex.dtype == np.bool_ else op_type)
    return export


_POWER_TYPES = ("Pow", "Cast", "Mul", "Add", "BitwiseAnd", "Equal", "Where", "Expand", "Shape")


def _integer_power(ex):
    """numpy's integer power (``bool ** bool`` is int8): squarings and products in the dtype, which wrap, so done in
    uint32 (uint64 for 64-bit results), whose products keep the same low bits, and cast back. ONNX's Pow takes no
    8- or 16-bit or unsigned integers, and onnxruntime's int32 and int64 Pow go through double: 3 ** 39 in int64 was
    4052555153018976256 (numpy: ...267) and 3 ** 21 in int32 -2**31 (numpy: the low 32 bits, 1870418611). An
    exponent the trace holds as a number is unrolled to the products its bits need; a tensor one is read bit by bit
    (a negative exponent numpy refuses)."""
    dt = ex.dtype
    wide = np.dtype(np.uint64 if dt.itemsize == 8 else np.uint32)
    a = ex.operand(0, dt)
    x = ex.b.cast(a, dt, wide)
    e = ex.args[1]
    if not isinstance(e, Value):
        e = int(e)
        if e == 0:  # x ** 0 is 1 everywhere
            one = ex.b.constant(np.ones((), dt), dt)
            return ex.finish(ex.out("Expand", [one, ex.emit("Shape", [a], "shape")]), [(a, 0)])
        acc, square, k = None, x, 0
        while e >> k:
            if k:
                square = ex.emit("Mul", [square, square], f"sq{k}")
            if (e >> k) & 1:
                acc = square if acc is None else ex.emit("Mul", [acc, square], f"acc{k}")
            k += 1
        return ex.finish(ex.out("Cast", [acc], to=ex.onnx_type(dt, ex.name)), [(a, 0)])
    b = ex.operand(1, dt)
    bits = ex.b.cast(b, dt, wide)
    zero = ex.b.constant(wide.type(0), wide)
    acc = ex.emit("Mul", [x, zero], "acc0")
    acc = ex.emit("Add", [acc, ex.b.constant(wide.type(1), wide)], "one")  # (ones of x's shape)
    square = x
    for k in range(dt.itemsize * 8 - (dt.kind == "i")):  # (a signed exponent's sign bit: negative, refused)
        if k:
            square = ex.emit("Mul", [square, square], f"sq{k}")
        unset = ex.emit("Equal", [ex.emit("BitwiseAnd", [bits, ex.b.constant(wide.type(1 << k), wide)], f"bit{k}"),
                                  zero], f"unset{k}")
        acc = ex.emit("Where", [unset, acc, ex.emit("Mul", [acc, square], f"times{k}")], f"acc{k}")
    return ex.finish(ex.out("Cast", [acc], to=ex.onnx_type(dt, ex.name)), [(a, 0), (b, 1)])


def _compare(*op_types: str):
    """A comparison in the operands' common dtype; ``not_equal`` is Not(Equal). ONNX orders no bools: they are
    compared as int8 (False < True, as numpy orders them)."""
    @onnx_export(*op_types)
    def export(ex):
        common = np.result_type(*(a._dtype if isinstance(a, Value) else a for a in ex.args))
        if common == np.bool_ and op_types[0] != "Equal":
            common = np.dtype(np.int8)
        ins = [ex.operand(i, common) for i in range(2)]
        name = ex.out(op_types[0], ins) if len(op_types) == 1 else \
            ex.out(op_types[1], [ex.emit(op_types[0], ins, "eq")])
        return ex.finish(name, [(ins[0], 0), (ins[1], 1)])
    return export


@onnx_export("Where")
def _where_onnx(ex):
    c = ex.operand(0, np.dtype(np.bool_))
    a, b = ex.operand(1, ex.dtype), ex.operand(2, ex.dtype)
    return ex.finish(ex.out("Where", [c, a, b]), [(c, 0), (a, 1), (b, 2)])


@onnx_export("Cast")
def _astype_onnx(ex):
    x = ex.operand(0)
    return ex.finish(ex.out("Cast", [x], to=ex.onnx_type(ex.dtype, "astype's result")), [(x, 0)])


# ---- derivatives that need more than one line --------------------------------------------------------------------


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


def _abs_dx(g, x, o):
    """d|x|/dx: the sign, 1 at 0 (as jax: select(x >= 0, g, -g)); for complex x, conj(x) / |x| (jax's
    convention for a real function of a complex value) = |x| / x, 0 at 0."""
    if isinstance(x, Value) and x._dtype.kind == "c":
        m = abs(x)  # (|x| again: the op keeps x only)
        zero = equal(m, 0)
        return g * where(zero, 0.0, m / where(zero, 1.0, x))
    return g * (_mask(greater_equal(x, 0), g) * 2.0 - 1.0)


def _relu(xp, x):
    dt = getattr(x, "dtype", None)
    return xp.maximum(x, 0 if dt is None else dt.type(0))


def _sigmoid(xp, x):
    x = xp.asarray(x)
    if not is_inexact(x.dtype):  # (-x in an integer dtype wraps: sigmoid(uint8 1) gave 0)
        x = x.astype(exp_dtype(x.dtype))
    one = x.dtype.type(1) if is_float(x.dtype) else 1.0
    return one / (one + xp.exp(-x))


_NONE = (None, None)  # comparisons: no gradient

# ---- the ops ------------------------------------------------------------------------------------------------------

add = elementwise("add", numpy="add", onnx=_arith("Add", "Or"), linear="add",
                  vjp=(lambda g, a, b, o: g, lambda g, a, b, o: g), reads=("", ""))
subtract = elementwise("subtract", numpy="subtract", onnx=_arith("Sub"), linear="add",
                       vjp=(lambda g, a, b, o: g, lambda g, a, b, o: -g), reads=("", ""))
multiply = elementwise("multiply", numpy="multiply", onnx=_arith("Mul", "And"), linear="mul",
                       vjp=(lambda g, a, b, o: g * b, lambda g, a, b, o: g * a), reads=("1", "0"))
divide = elementwise("divide", numpy="divide", onnx=_arith("Div"), linear="mul", linear_args=(0,),
                     vjp=(lambda g, a, b, o: g / b, lambda g, a, b, o: -(g * o) / b), domain=(0.5, 2.0),
                     reads=("1", "1o"))
power = elementwise("power", numpy="power", onnx=_arith("Pow"), vjp=(_pow_da, _pow_db), domain=(0.5, 2.0),
                    reads=("01", "0o"))
maximum = elementwise("maximum", numpy="maximum", onnx=_arith("Max", "Or"),
                      vjp=(lambda g, a, b, o: _tie(g, a, b, greater(a, b)),
                           lambda g, a, b, o: _tie(g, a, b, less(a, b))), reads=("01", "01"))
minimum = elementwise("minimum", numpy="minimum", onnx=_arith("Min", "And"),
                      vjp=(lambda g, a, b, o: _tie(g, a, b, less(a, b)),
                           lambda g, a, b, o: _tie(g, a, b, greater(a, b))), reads=("01", "01"))
less = elementwise("less", numpy="less", onnx=_compare("Less"), vjp=_NONE)
less_equal = elementwise("less_equal", numpy="less_equal", onnx=_compare("LessOrEqual"), vjp=_NONE)
greater = elementwise("greater", numpy="greater", onnx=_compare("Greater"), vjp=_NONE)
greater_equal = elementwise("greater_equal", numpy="greater_equal", onnx=_compare("GreaterOrEqual"), vjp=_NONE)
equal = elementwise("equal", numpy="equal", onnx=_compare("Equal"), vjp=_NONE)
not_equal = elementwise("not_equal", numpy="not_equal", onnx=_compare("Equal", "Not"), vjp=_NONE)

negative = elementwise("negative", numpy="negative", onnx="Neg", linear="add", vjp=lambda g, x, o: -g, reads="")
exp = elementwise("exp", numpy="exp", onnx="Exp", vjp=lambda g, x, o: g * o, domain=(-3.0, 3.0), reads="o")
log = elementwise("log", numpy="log", onnx="Log", vjp=lambda g, x, o: g / x, domain=(0.1, 10.0), reads="0")
tanh = elementwise("tanh", numpy="tanh", onnx="Tanh", vjp=lambda g, x, o: g * (1.0 - o * o), reads="o")
sin = elementwise("sin", numpy="sin", onnx="Sin", vjp=lambda g, x, o: g * cos(x), reads="0")
cos = elementwise("cos", numpy="cos", onnx="Cos", vjp=lambda g, x, o: -(g * sin(x)), reads="0")
sqrt = elementwise("sqrt", numpy="sqrt", onnx="Sqrt", vjp=lambda g, x, o: g / (o * 2.0), domain=(0.1, 10.0),
                   reads="o")
abs = elementwise("abs", numpy="absolute", onnx="Abs", vjp=_abs_dx, reads="0")  # noqa: A001 - numpy's name
relu = elementwise("relu", _relu, onnx="Relu", vjp=lambda g, x, o: g * _mask(greater(x, 0), g), reads="0")
sigmoid = elementwise("sigmoid", _sigmoid, onnx="Sigmoid", vjp=lambda g, x, o: g * (o * (1.0 - o)), reads="o")
@onnx_export("Mul")
def _square_onnx(ex):
    x = ex.operand(0, ex.dtype)
    return ex.finish(ex.out("Mul", [x, x]), [(x, 0)])


_DIVMOD_TYPES = ("Div", "Floor", "Mul", "Sub", "Cast", "Mod", "Less", "Greater", "Xor", "Equal", "Not", "And", "Or",
                 "Add", "Where")


def _fmod(ex) -> tuple:
    """numpy's float divmod (its ``npy_divmod``) as ONNX nodes: C's fmod of a by b (Mod with fmod=1: exact) and where
    numpy moves it by b (its sign differs from b's and it is not 0); ``a - floor(a / b) * b`` and ``floor(a / b)``
    round instead (1.0 // 0.1 is 9, Floor(1.0 / 0.1) 10). Returns a, b, the fmod, the move, and a constant 0."""
    a, b = ex.operand(0, ex.dtype), ex.operand(1, ex.dtype)
    zero = ex.b.constant(ex.dtype.type(0), ex.dtype)
    r = ex.emit("Mod", [a, b], "fmod", fmod=1)
    differ = ex.emit("Xor", [ex.emit("Less", [r, zero], "neg_r"), ex.emit("Less", [b, zero], "neg_b")], "differ")
    fix = ex.emit("And", [differ, ex.emit("Not", [ex.emit("Equal", [r, zero], "exact")], "inexact")], "fix")
    return a, b, r, fix, zero


def _integer_divmod(ex, remainder: bool) -> tuple:
    """An integer floor_divide or remainder as numpy's, in integers: 0 where b is 0, and a // -1 is -a (wrapping:
    INT_MIN // -1 is INT_MIN). Computed over a divisor that is neither (1 there): ONNX's integer Mod fails on 0
    and a C division of INT_MIN by -1 traps. ONNX's integer Div truncates toward zero, so a quotient whose remainder
    (C's, with a's sign) is nonzero and signed unlike b is one less; Mod with ``fmod=0`` has b's sign, as numpy's.
    8- and 16-bit integers are computed in int32 and uint32 in int64 (exact: no quotient or remainder of theirs
    leaves the wider type, and -2**15 // -1 casts back to -2**15), as onnxruntime has the nodes for. The float64
    quotient the export used to floor is inexact past 2**53 (an int64 ``(2**62 + 12345) // 1000003`` was one too
    large)."""
    dt = ex.dtype
    work = np.dtype(np.int32 if dt.itemsize < 4 else np.int64 if dt == np.uint32 else dt)
    a, b = ex.operand(0, work), ex.operand(1, work)
    c = lambda v: ex.b.constant(work.type(v), work)  # noqa: E731
    zero = ex.emit("Equal", [b, c(0)], "by_zero")
    unsafe = zero if work.kind == "u" else ex.emit("Or", [zero, ex.emit("Equal", [b, c(-1)], "by_m1")], "unsafe")
    safe = ex.emit("Where", [unsafe, c(1), b], "safe_b")
    if remainder:
        out = ex.emit("Mod", [a, safe], "mod", fmod=0)
    else:
        out = ex.emit("Div", [a, safe], "trunc")
        if work.kind == "i":
            r = ex.emit("Mod", [a, safe], "rem", fmod=1)
            below = ex.emit("And", [ex.emit("Not", [ex.emit("Equal", [r, c(0)], "exact")], "inexact"),
                                    ex.emit("Xor", [ex.emit("Less", [r, c(0)], "neg_r"),
                                                    ex.emit("Less", [b, c(0)], "neg_b")], "differ")], "below")
            out = ex.emit("Where", [below, ex.emit("Sub", [out, c(1)], "floor"), out], "floored")
            out = ex.emit("Where", [ex.emit("Equal", [b, c(-1)], "by_m1"), ex.emit("Sub", [c(0), a], "neg"), out],
                          "m1")
    if work == dt:
        return ex.finish(ex.out("Where", [zero, c(0), out]), [(a, 0), (b, 1)])
    out = ex.emit("Where", [zero, c(0), out], "safe")
    return ex.finish(ex.out("Cast", [out], to=ex.onnx_type(dt, ex.name)), [(a, 0), (b, 1)])


@onnx_export(*_DIVMOD_TYPES)
def _floor_divide_onnx(ex):
    """numpy's float floor_divide: (a - fmod) / b, one less where the fmod is moved, rounded to the nearest integer
    (a floor and a half-up step), a zero signed as a / b; a / b itself for b = 0."""
    if not is_float(ex.dtype):
        return _integer_divmod(ex, False)
    a, b, r, fix, zero = _fmod(ex)
    div = ex.emit("Div", [ex.emit("Sub", [a, r], "a_r"), b], "div")
    div = ex.emit("Where", [fix, ex.emit("Sub", [div, ex.b.constant(ex.dtype.type(1), ex.dtype)], "less"), div], "moved")
    fl = ex.emit("Floor", [div], "floor")
    up = ex.emit("Greater", [ex.emit("Sub", [div, fl], "frac"), ex.b.constant(ex.dtype.type(0.5), ex.dtype)], "up")
    fl = ex.emit("Where", [up, ex.emit("Add", [fl, ex.b.constant(ex.dtype.type(1), ex.dtype)], "fl1"), fl], "near")
    q = ex.emit("Div", [a, b], "q")  # (finite where div is 0: 0 * q is a zero signed as q)
    fl = ex.emit("Where", [ex.emit("Equal", [div, zero], "none"), ex.emit("Mul", [q, zero], "zero_q"), fl], "signed")
    return ex.finish(ex.out("Where", [ex.emit("Equal", [b, zero], "by_zero"), q, fl]), [(a, 0), (b, 1)])


@onnx_export(*_DIVMOD_TYPES)
def _remainder_onnx(ex):
    """numpy's float remainder, with the divisor's sign: the fmod moved by b where numpy moves it, an exact zero
    signed as b (``a - floor(a / b) * b`` rounded: 12345.678 % 0.7 in float32 was 0.47753906, numpy's 0.4779446,
    and 2.15 % inf NaN)."""
    if not is_float(ex.dtype):
        return _integer_divmod(ex, True)
    a, b, r, fix, zero = _fmod(ex)
    moved = ex.emit("Where", [fix, ex.emit("Add", [r, b], "rb"), r], "moved")
    minus = ex.emit("Mul", [zero, ex.b.constant(ex.dtype.type(-1), ex.dtype)], "minus_zero")  # (-0.0: b may be inf)
    signed = ex.emit("Where", [ex.emit("Less", [b, zero], "neg_b"), minus, zero], "signed_zero")
    return ex.finish(ex.out("Where", [ex.emit("Equal", [r, zero], "exact"), signed, moved]), [(a, 0), (b, 1)])


floor = elementwise("floor", numpy="floor", onnx="Floor", vjp=lambda g, x, o: g * 0.0, reads="")  # as jax: zero
ceil = elementwise("ceil", numpy="ceil", onnx="Ceil", vjp=lambda g, x, o: g * 0.0, reads="")
@onnx_export("Sign", "IsNaN", "Where")
def _sign_onnx(ex):
    """Sign; NaN where x is NaN, as numpy's (ONNX does not say what Sign makes of NaN: onnxruntime's float16 and
    bfloat16 Sign gave 0)."""
    if not is_float(ex.dtype):
        return ex.one("Sign")
    x = ex.operand(0, ex.dtype)
    return ex.finish(ex.out("Where", [ex.emit("IsNaN", [x], "nan"), x, ex.emit("Sign", [x], "sign")]), [(x, 0)])


sign = elementwise("sign", numpy="sign", onnx=_sign_onnx, vjp=lambda g, x, o: g * 0.0, reads="")
square = elementwise("square", numpy="square", onnx=_square_onnx, vjp=lambda g, x, o: g * (x * 2.0), reads="0")
floor_divide = elementwise("floor_divide", numpy="floor_divide", onnx=_floor_divide_onnx, vjp=(lambda g, a, b, o: g * 0.0,
                                                                      lambda g, a, b, o: g * 0.0),
                           domain=(0.5, 2.0), reads=("", ""))
remainder = elementwise("remainder", numpy="remainder", onnx=_remainder_onnx, domain=(0.5, 2.0),  # numpy's %: the sign of the divisor
                        vjp=(lambda g, a, b, o: g, lambda g, a, b, o: -(g * floor_divide(a, b))), reads=("", "01"))
where = elementwise("where", numpy="where", onnx=_where_onnx, linear="add", linear_args=(1, 2),
                    arity=3, operands=("cond", "a", "b"))
# numpy's ``x ** -1`` on float arrays (see Tensor.__pow__; for complex numbers 1 / x differs in the signs of
# zeros); not a public name
_reciprocal = elementwise("reciprocal", onnx="Reciprocal", public=False,
                          vjp=lambda g, x, o: negative(multiply(g, multiply(o, o))), reads="o")


def _where_vjp(g, node, out):
    # the condition has no cotangent; each branch gets the cotangent where it was chosen
    return (None, _unbroadcast(where(node.args[0], g, 0.0), node.args[1]),
            _unbroadcast(where(node.args[0], 0.0, g), node.args[2]))


where.op.vjp = _where_vjp
where.op.saves = lambda diff, params: ((0,) if diff[1] or diff[2] else (), False)  # the condition only


def _astype_kernel(arrays, local):
    return arrays[0].astype(local.params[0])


def clip(x: ArrayLike, a_min: ArrayLike | None = None, a_max: ArrayLike | None = None) -> Tensor:
    """numpy's ``clip``: ``minimum(maximum(x, a_min), a_max)`` (a bound left None is not applied; NaN passes
    through, as numpy's); elementwise, so every sharding is kept and nothing moves."""
    with user_op("clip"):
        r = x if isinstance(x, Tensor) else apply(_ASTYPE, (x,), (np.asarray(x).dtype,))
        if a_min is not None:
            r = maximum(r, a_min)
        if a_max is not None:
            r = minimum(r, a_max)
    return r


def astype(x: ArrayLike, dtype: Any) -> Tensor:
    dt = dtype_arg(dtype, "astype")
    if isinstance(x, Tensor) and x._dtype == dt:
        return x  # nothing to convert (tensors are immutable: no copy needed), and a pending sum stays pending
    return apply(_ASTYPE, (x,), (dt,))


_ASTYPE = register(OpDef("astype", lambda shapes, dt: R.elementwise_rule(tuple(shapes)), _astype_kernel,
                         dtype="sample", numpy="astype", onnx=_astype_onnx, arity=1, public=astype,
                         vjp=lambda g, node, out: (astype(g, node.args[0]._dtype) if _is_diff(node.args[0])
                                                   else None,), saves="none"))

_BINARY = {f.__name__: f.op for f in (add, subtract, multiply, divide, power, maximum, minimum, less, less_equal,
                                      greater, greater_equal, equal, not_equal)}
_UNARY = {f.__name__: f.op for f in (negative, exp, log, tanh, sin, cos, sqrt, abs, relu, sigmoid)}
_WHERE = where.op
_RECIPROCAL = _reciprocal.op


for _moving in (_ASTYPE,):  # data moves, nothing is computed: no FLOPs
    _moving.flops = lambda blocks, out, params: 0


# ---- activations and float tests of language models ------------------------------------------------------------


def _float_of(xp, x):
    """``x`` as an array in the dtype numpy's float functions give it (integers and bools: float64)."""
    x = xp.asarray(x)
    return x if is_float(x.dtype) or x.dtype.kind == "c" else x.astype(np.float64)


_ERF64 = np.vectorize(math.erf, otypes=[np.float64])


def _erf(xp, x):
    """The error function: libm's ``erf`` (through float64) under numpy, ``jax.lax.erf`` under ``nb.jit``."""
    x = _float_of(xp, x)
    if xp is np:
        return _ERF64(x.astype(np.float64)).astype(x.dtype) if x.size else x.copy()
    import jax  # the kernel runs under jax only when jax is installed
    return jax.lax.erf(x)


def _silu(xp, x):
    x = _float_of(xp, x)
    return x * _sigmoid(xp, x)


def _silu_dx(g, x, out):
    s = sigmoid(x)
    return g * (s * (1.0 + x * (1.0 - s)))


@onnx_export("Sigmoid", "Mul")
def _silu_onnx(ex):
    x = ex.operand(0, ex.dtype)
    return ex.finish(ex.out("Mul", [x, ex.emit("Sigmoid", [x], "sigmoid")]), [(x, 0)])


def _float_test(op_type: str):
    """IsNaN, or isfinite as Not(Or(IsNaN, IsInf)); integer and bool operands (never NaN) are cast to float."""
    @onnx_export(*(("IsNaN",) if op_type == "IsNaN" else ("IsNaN", "IsInf", "Or", "Not")))
    def export(ex):
        a = ex.args[0]
        dt = a._dtype if isinstance(a, Value) else np.result_type(a)
        x = ex.operand(0, None if is_float(dt) else np.dtype(np.float32))
        if op_type == "IsNaN":
            return ex.finish(ex.out("IsNaN", [x]), [(x, 0)])
        bad = ex.emit("Or", [ex.emit("IsNaN", [x], "nan"), ex.emit("IsInf", [x], "inf")], "bad")
        return ex.finish(ex.out("Not", [bad]), [(x, 0)])
    return export


erf = elementwise("erf", _erf, onnx="Erf", public=False, vjp=lambda g, x, o: g * (exp(-(x * x)) * _TWO_OVER_SQRT_PI),
                  reads="0",
                  doc="The error function (internal: ``gelu(x, approximate=False)`` is written with it).")
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
silu = elementwise("silu", _silu, onnx=_silu_onnx, vjp=_silu_dx, reference=lambda x: _silu(np, x), reads="0",
                   doc="``x * sigmoid(x)`` (``jax.nn.silu``, also called swish); elementwise, so every sharding "
                       "is kept and nothing moves. ONNX export: ``Mul(x, Sigmoid(x))``.")
isnan = elementwise("isnan", numpy="isnan", onnx=_float_test("IsNaN"), vjp=(None,),
                    doc="Where ``x`` is NaN (numpy's ``isnan``): a bool tensor with ``x``'s sharding, no gradient.")
isfinite = elementwise("isfinite", numpy="isfinite", onnx=_float_test("IsFinite"), vjp=(None,),
                       doc="Where ``x`` is neither NaN nor infinite (numpy's ``isfinite``): a bool tensor with ``x``'s "
                           "sharding, no gradient.")

# gelu: one op with a parameter (the tanh form or the exact one), as jax.nn.gelu
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_kernel_of(xp, x, approximate: bool):
    """jax.nn.gelu's formulas, in x's dtype (constants typed: numpy promotes bfloat16 with a Python float)."""
    x = _float_of(xp, x)
    half, one = np.asarray(0.5, x.dtype), np.asarray(1.0, x.dtype)
    if approximate:
        u = np.asarray(_SQRT_2_OVER_PI, x.dtype) * (x + np.asarray(0.044715, x.dtype) * (x * x * x))
        return x * (half * (one + xp.tanh(u)))
    return x * (_erf(xp, x * np.asarray(1 / math.sqrt(2.0), x.dtype)) + one) * half


def _gelu_kernel(arrays, local):
    x = arrays[0]
    return _gelu_kernel_of(_xp(x), x, local.params[0])


def _gelu_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    if node.params[0]:  # d/dx x/2 (1 + tanh u), u = c (x + a x^3)
        t = tanh((x + 0.044715 * (x * x * x)) * _SQRT_2_OVER_PI)
        d = 0.5 * (1.0 + t) + (0.5 * x) * ((1.0 - t * t) * (_SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * (x * x))))
    else:  # Phi(x) + x phi(x)
        d = 0.5 * (1.0 + erf(x * (1 / math.sqrt(2.0)))) + x * (exp(-0.5 * (x * x)) * (1 / math.sqrt(2 * math.pi)))
    return (g * d,)


@onnx_export("Gelu")
def _gelu_onnx(ex):
    x = ex.operand(0, ex.dtype)
    return ex.finish(ex.out("Gelu", [x], approximate="tanh" if ex.params[0] else "none"), [(x, 0)])


def gelu(x: ArrayLike, approximate: bool = True) -> Tensor:
    """The GELU activation, as ``jax.nn.gelu``: by default its tanh approximation
    ``x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``; ``approximate=False`` gives the exact ``x Phi(x)``
    (with the error function). Computed in ``x``'s dtype; elementwise, so every sharding is kept and nothing
    moves. ONNX export: ``Gelu`` (opset 20) with ``approximate="tanh"`` or ``"none"``."""
    return apply(_GELU, (x,), (bool(approximate),))


_GELU = register(OpDef("gelu", lambda shapes, approximate: R.elementwise_rule(tuple(shapes), op="gelu"), _gelu_kernel,
                       vjp=_gelu_vjp, onnx=_gelu_onnx, reference=lambda x: _gelu_kernel_of(np, x, True), arity=1,
                       public=gelu, flops=lambda blocks, out, params: 8 * prod(out), saves="operands"))
_UNARY.update({f.__name__: f.op for f in (silu, isnan, isfinite)})
