"""Elementwise ops JAX's ``lax`` has and nabla's public API does not: bitwise logic and shifts, a bitcast, more
transcendental functions, ``erf_inv``, and the threefry2x32 hash behind ``jax.random``. Internal ops named
``lax_<primitive>`` (no ``nb.<name>``, no numpy name: those stay free for users' own ops): ``nb.import_jax`` runs a
JAX program's primitives as them, so they are recorded steps like any. Each exports to ONNX (opset 21) as the
nodes that compute it."""

from __future__ import annotations

import math
from functools import lru_cache
from math import prod

import numpy as np

from .. import rules as R
from ..backends import require_jax, xp as _xp
from ..errors import ShardingError
from ..opdef import OpDef
from ..rules.core import PASS, build
from .core import apply
from . import pointwise as P
from .pointwise import exp, sqrt
from .registry import elementwise, onnx_export, register


@onnx_export("BitShift", "Cast", "BitwiseNot", "Less", "Where")
def _shift_onnx(ex):
    """BitShift, which ONNX has for unsigned integers, whose shifts are numpy's (a count of the width or more gives
    0). A signed value is shifted as the unsigned one of its bits (a negative count is then a huge one, as numpy and
    XLA read it), and cast back: a left shift keeps the same low bits; an arithmetic right shift of a negative value
    is the complement of the logical right shift of its complement (all ones for a count of the width or more)."""
    left = ex.name == "lax_left_shift"
    if ex.dtype.kind == "u":
        return ex.one("BitShift", direction="LEFT" if left else "RIGHT")
    u = np.dtype(f"uint{ex.dtype.itemsize * 8}")
    a, b = ex.operand(0, ex.dtype), ex.operand(1, ex.dtype)
    ua, ub = ex.b.cast(a, ex.dtype, u), ex.b.cast(b, ex.dtype, u)
    if left:
        out = ex.emit("BitShift", [ua, ub], "shifted", direction="LEFT")
    else:
        pos = ex.emit("BitShift", [ua, ub], "shifted", direction="RIGHT")
        neg = ex.emit("BitwiseNot", [ex.emit("BitShift", [ex.emit("BitwiseNot", [ua], "not_a"), ub], "not_shifted",
                                             direction="RIGHT")], "neg_shifted")
        out = ex.emit("Where", [ex.emit("Less", [a, ex.b.constant(ex.dtype.type(0), ex.dtype)], "negative"), neg, pos],
                      "arith")
    return ex.finish(ex.out("Cast", [out], to=ex.onnx_type(ex.dtype, ex.name)), [(a, 0), (b, 1)])


# ---- bitwise logic and shifts (bools are logic) ------------------------------------------------------------------

bitwise_and = elementwise("lax_bitwise_and", lambda xp, a, b: xp.bitwise_and(a, b), onnx="BitwiseAnd", public=False)
bitwise_or = elementwise("lax_bitwise_or", lambda xp, a, b: xp.bitwise_or(a, b), onnx="BitwiseOr", public=False)
bitwise_xor = elementwise("lax_bitwise_xor", lambda xp, a, b: xp.bitwise_xor(a, b), onnx="BitwiseXor", public=False)
invert = elementwise("lax_invert", lambda xp, x: xp.invert(x), onnx="BitwiseNot", public=False)
# a shift by the width or more gives 0 (a right shift of a negative signed value: -1), in numpy and in XLA alike
left_shift = elementwise("lax_left_shift", lambda xp, a, b: xp.left_shift(a, b), onnx=_shift_onnx, public=False)
right_shift = elementwise("lax_right_shift", lambda xp, a, b: xp.right_shift(a, b), onnx=_shift_onnx, public=False)


# ---- more transcendental functions (float32 stays float32) --------------------------------------------------------


@onnx_export("Sin", "Cos", "Div", "Cast")
def _tan_onnx(ex):
    work = ex.carrier("Sin", "Cos")  # (bfloat16 in float32, as ml_dtypes computes it)
    x = ex.operand(0, work)
    return ex.finish(ex.out_as(work, "Div", [ex.emit("Sin", [x], "sin"), ex.emit("Cos", [x], "cos")]), [(x, 0)])


@onnx_export("Abs", "Div", "Atan", "Equal", "And", "Where", "Less", "Or", "Sub", "Neg", "Cast")
def _arctan2_onnx(ex):
    """numpy's arctan2 (C's atan2): atan(|a| / |b|) in [0, pi/2] (0 where both are zeros, pi/4 where both are
    infinite), taken from pi where b's sign bit is set and negated where a's is; a sign bit is ``x < 0`` or
    ``1 / x < 0`` (-0.0). NaN stays NaN. The former atan(a / b) moved by pi gave pi/2 for atan2(0, 0) (C: 0), NaN
    for atan2(inf, -inf) (3pi/4), pi/2 for atan2(3, NaN) and 0 for atan2(-0.0, 2) (-0.0)."""
    work = ex.carrier("Atan", "Div")
    a, b = ex.operand(0, work), ex.operand(1, work)
    c = lambda v: ex.b.constant(work.type(v), work)  # noqa: E731

    def signbit(x, tag):
        return ex.emit("Or", [ex.emit("Less", [x, c(0.0)], f"{tag}_neg"),
                              ex.emit("Less", [ex.emit("Div", [c(1.0), x], f"{tag}_inv"), c(0.0)], f"{tag}_zneg")],
                       f"{tag}_sign")

    ma, mb = ex.emit("Abs", [a], "abs_a"), ex.emit("Abs", [b], "abs_b")
    t = ex.emit("Atan", [ex.emit("Div", [ma, mb], "ratio")], "atan")
    both = lambda v, tag: ex.emit("And", [ex.emit("Equal", [ma, c(v)], f"a_{tag}"),  # noqa: E731
                                          ex.emit("Equal", [mb, c(v)], f"b_{tag}")], f"both_{tag}")
    t = ex.emit("Where", [both(0.0, "zero"), c(0.0), t], "t0")
    t = ex.emit("Where", [both(np.inf, "inf"), c(math.pi / 4), t], "t1")
    r = ex.emit("Where", [signbit(b, "b"), ex.emit("Sub", [c(math.pi), t], "left"), t], "half")
    return ex.finish(ex.out_as(work, "Where", [signbit(a, "a"), ex.emit("Neg", [r], "below"), r]), [(a, 0), (b, 1)])


@onnx_export("Abs", "Pow", "Sign", "Mul", "Div", "Sub", "Add", "Equal", "Or", "Where")
def _cbrt_onnx(ex):
    """sign(x) r with r = |x|^(1/3) and one Newton step r + (|x| / r^2 - r) / 3 (the rounded 1/3 of Pow is off by
    |ln x| times its rounding: cbrt(1e-300) in float64 was 1.0000000000000128e-100), and x itself where it is zero
    or infinite (cbrt(-0.0) is -0.0; sign(-0.0) times 0 was +0.0)."""
    x = ex.operand(0, ex.dtype)
    c = lambda v: ex.b.constant(ex.dtype.type(v), ex.dtype)  # noqa: E731
    a = ex.emit("Abs", [x], "abs")
    r = ex.emit("Pow", [a, c(1.0 / 3.0)], "pow")
    step = ex.emit("Div", [ex.emit("Sub", [ex.emit("Div", [a, ex.emit("Mul", [r, r], "r2")], "a_r2"), r], "err"), c(3.0)],
                   "step")
    r = ex.emit("Mul", [ex.emit("Sign", [x], "sign"), ex.emit("Add", [r, step], "newton")], "signed")
    kept = ex.emit("Or", [ex.emit("Equal", [x, c(0.0)], "zero"), ex.emit("Equal", [a, c(np.inf)], "inf")], "kept")
    return ex.finish(ex.out("Where", [kept, x, r]), [(x, 0)])


def _accurate(ex, u: str, x: str, y: str) -> tuple:
    """``y`` where ``u`` is neither 1 nor infinite, x where u is 1 (x is then below the float's precision: a signed
    zero or a tiny value), u where it is infinite (x is +inf)."""
    c = lambda v: ex.b.constant(ex.dtype.type(v), ex.dtype)  # noqa: E731
    y = ex.emit("Where", [ex.emit("Equal", [u, c(np.inf)], "inf"), u, y], "finite")
    return ex.finish(ex.out("Where", [ex.emit("Equal", [u, c(1.0)], "one"), x, y]), [(x, 0)])


@onnx_export("Add", "Sub", "Log", "Mul", "Div", "Equal", "Where")
def _log1p_onnx(ex):
    """log1p as log(u) * (x / (u - 1)) with u = 1 + x (Goldberg's: the rounding of u cancels), x where u is 1.
    Log(1 + x) lost what 1 + x rounds away: log1p(1e-10) in float64 was 1.00000008e-10, and log1p(-0.0) +0.0."""
    x = ex.operand(0, ex.dtype)
    one = ex.b.constant(ex.dtype.type(1), ex.dtype)
    u = ex.emit("Add", [one, x], "u")
    y = ex.emit("Mul", [ex.emit("Log", [u], "log"), ex.emit("Div", [x, ex.emit("Sub", [u, one], "u_1")], "ratio")],
                "y")
    return _accurate(ex, u, x, y)


@onnx_export("Exp", "Sub", "Log", "Mul", "Div", "Equal", "Where")
def _expm1_onnx(ex):
    """expm1 as (u - 1) * (x / log(u)) with u = exp(x) (Kahan's), x where u is 1, -1 where u - 1 is (u may be 0).
    Exp(x) - 1 lost what exp(x) rounds away: expm1(1e-10) in float64 was 1.00000008e-10, and expm1(-0.0) +0.0."""
    x = ex.operand(0, ex.dtype)
    u = ex.emit("Exp", [x], "u")
    m1 = ex.b.constant(ex.dtype.type(-1), ex.dtype)
    um = ex.emit("Add", [u, m1], "u_1")
    y = ex.emit("Mul", [um, ex.emit("Div", [x, ex.emit("Log", [u], "log")], "ratio")], "y")
    y = ex.emit("Where", [ex.emit("Equal", [um, m1], "all"), m1, y], "floor")
    return _accurate(ex, u, x, y)


log1p = elementwise("lax_log1p", lambda xp, x: xp.log1p(x), onnx=_log1p_onnx, public=False,
                    vjp=lambda g, x, o: g / (x + 1.0))
expm1 = elementwise("lax_expm1", lambda xp, x: xp.expm1(x), onnx=_expm1_onnx, public=False,
                    vjp=lambda g, x, o: g * (o + 1.0))
tan = elementwise("lax_tan", lambda xp, x: xp.tan(x), onnx=_tan_onnx, public=False,
                  vjp=lambda g, x, o: g * (o * o + 1.0))
arctan = elementwise("lax_arctan", lambda xp, x: xp.arctan(x), onnx="Atan", public=False,
                     vjp=lambda g, x, o: g / (x * x + 1.0))
arcsin = elementwise("lax_arcsin", lambda xp, x: xp.arcsin(x), onnx="Asin", public=False,
                     vjp=lambda g, x, o: g / sqrt(1.0 - x * x))
arccos = elementwise("lax_arccos", lambda xp, x: xp.arccos(x), onnx="Acos", public=False,
                     vjp=lambda g, x, o: -g / sqrt(1.0 - x * x))
sinh = elementwise("lax_sinh", lambda xp, x: xp.sinh(x), onnx="Sinh", public=False,
                   vjp=lambda g, x, o: g * ((exp(x) + exp(-x)) * 0.5))
cosh = elementwise("lax_cosh", lambda xp, x: xp.cosh(x), onnx="Cosh", public=False,
                   vjp=lambda g, x, o: g * ((exp(x) - exp(-x)) * 0.5))
@onnx_export("Mod", "Equal", "Or", "Where")
def _rem_onnx(ex):
    """Mod with ``fmod=1`` (C's); for integers XLA's ``x rem 0 = x``, over a divisor 1 where it is 0 or -1 (ONNX's
    integer Mod fails on 0, and C's INT_MIN % -1 traps; x rem -1 is 0)."""
    if ex.dtype.kind not in "biu":
        return ex.one("Mod", fmod=1)
    a, b = ex.operand(0, ex.dtype), ex.operand(1, ex.dtype)
    c = lambda v: ex.b.constant(ex.dtype.type(v), ex.dtype)  # noqa: E731
    zero = ex.emit("Equal", [b, c(0)], "by_zero")
    unsafe = zero if ex.dtype.kind == "u" else ex.emit("Or", [zero, ex.emit("Equal", [b, c(-1)], "by_m1")], "unsafe")
    r = ex.emit("Mod", [a, ex.emit("Where", [unsafe, c(1), b], "safe_b")], "fmod", fmod=1)
    return ex.finish(ex.out("Where", [zero, a, r]), [(a, 0), (b, 1)])


def _rem(xp, a, b):
    """lax.rem: C's fmod (the dividend's sign); for integers XLA's ``x rem 0 = x`` and ``INT_MIN rem -1 = 0``
    (its ``EmitIntegerRemainder``), where numpy's fmod gives 0 and warns. Computed over a divisor of 1 there."""
    if np.result_type(*(getattr(v, "dtype", v) for v in (a, b))).kind not in "biu":  # (jax tracers: their dtype)
        return xp.fmod(a, b)
    zero = xp.equal(b, 0)
    r = xp.fmod(a, xp.where(zero, xp.ones_like(b), b))
    return xp.where(zero, a, r).astype(r.dtype)


def _rem_db(g, a, b, o):
    q = a / b
    return -(g * (P.sign(q) * P.floor(P.abs(q))))  # -g * trunc(a / b), as jax's rule


# C's fmod, the dividend's sign (lax.rem; ONNX's Mod with fmod=1): exact, where a - b * trunc(a / b) rounds (1.0 rem
# 0.1 in float64 gave 0, not 0.09999999999999995) and remainder(a, b) - b loses a tiny a (-1e-30 rem 1 gave 0)
rem = elementwise("lax_rem", _rem, onnx=_rem_onnx, public=False, arity=2,
                  vjp=(lambda g, a, b, o: g, _rem_db))
arcsinh = elementwise("lax_asinh", lambda xp, x: xp.arcsinh(x), onnx="Asinh", public=False,
                      vjp=lambda g, x, o: g / sqrt(x * x + 1.0))
arccosh = elementwise("lax_acosh", lambda xp, x: xp.arccosh(x), onnx="Acosh", public=False,
                      vjp=lambda g, x, o: g / sqrt((x - 1.0) * (x + 1.0)))
arctanh = elementwise("lax_atanh", lambda xp, x: xp.arctanh(x), onnx="Atanh", public=False,
                      vjp=lambda g, x, o: g / ((1.0 - x) * (1.0 + x)))
arctan2 = elementwise("lax_arctan2", lambda xp, a, b: xp.arctan2(a, b), onnx=_arctan2_onnx, public=False,
                      vjp=(lambda g, a, b, o: g * b / (a * a + b * b), lambda g, a, b, o: -g * a / (a * a + b * b)))
rint = elementwise("lax_rint", lambda xp, x: xp.rint(x), onnx="Round", public=False, vjp=lambda g, x, o: g * 0.0)
cbrt = elementwise("lax_cbrt", lambda xp, x: xp.cbrt(x), onnx=_cbrt_onnx, public=False,
                   vjp=lambda g, x, o: g / (3.0 * o * o))

# Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011): single-precision coefficients, highest first
_ERF_INV_SMALL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                  -0.00417768164, 0.246640727, 1.50140941)
_ERF_INV_LARGE = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                  0.00943887047, 1.00167406, 2.83297682)


def _erf_inv(xp, x):
    """The inverse error function by Giles' single-precision polynomials, as XLA evaluates it (``w = -log1p(-x^2)``;
    within a few ulps of XLA's), +-inf at +-1; in float64 refined by one Halley step on libm's erf, as precise as
    XLA's float64 erf_inv (the polynomial alone gave erf_inv(0.5) = 0.47693629..., XLA 0.4769362762044699).
    Under ``nb.jit``: ``jax.lax.erf_inv``."""
    if xp is not np:
        return require_jax("erf_inv under nb.jit").lax.erf_inv(x)
    x = xp.asarray(x)
    dt = x.dtype

    w = -xp.log1p(-x * x).astype(dt)
    small = w < 5.0
    ws = (w - 2.5).astype(dt)
    wl = (xp.sqrt(xp.where(small, 5.0, w)) - 3.0).astype(dt)
    ps, pl = np.asarray(_ERF_INV_SMALL[0], dt), np.asarray(_ERF_INV_LARGE[0], dt)
    for cs, cl in zip(_ERF_INV_SMALL[1:], _ERF_INV_LARGE[1:]):
        ps = (np.asarray(cs, dt) + ps * ws).astype(dt)
        pl = (np.asarray(cl, dt) + pl * wl).astype(dt)
    out = xp.where(small, ps, pl) * x
    if dt == np.float64 and x.size:
        out = np.where(np.isfinite(out), np.copysign(_erf_inv_refined(np.abs(x), np.abs(out)), x), out)
    return xp.where(xp.abs(x) == 1.0, x * np.asarray(np.inf, dt), out).astype(dt)


def _erf_inv_refined(a, y):
    """erf_inv(a) for 0 <= a < 1 from the polynomial's ``y`` (1e-7 off in float64, 10% at a = 1 - 2**-53): Halley
    steps on erf(y) = a below erf(1) (cubic: one is enough), Newton steps on log(erfc(y)) = log(1 - a) above (no
    cancellation near 1, and nearly linear there: erfc falls as exp(-y^2))."""
    y = np.where(np.isfinite(y), y, 0.0)
    head, tail = np.nonzero(a <= 0.8427), np.nonzero(a > 0.8427)
    yh, ah = y[head], a[head]
    for _ in range(2):
        yh = _halley(yh, P._ERF64(yh) - ah, np.exp(-yh * yh))
    yt, lq = y[tail], np.log1p(-a[tail])
    for _ in range(5):
        c = _ERFC64(yt)
        yt = yt + (np.log(c) - lq) * c / ((2.0 / math.sqrt(math.pi)) * np.exp(-yt * yt))
    y[head], y[tail] = yh, yt
    return y


def _halley(y, f, g):
    """One Halley step for erf(y) = x, given f = erf(y) - x and g = exp(-y^2): f' = 2/sqrt(pi) g, f'' = -2 y f'."""
    return y - f / ((2.0 / math.sqrt(math.pi)) * g * (1.0 + y * f))


@onnx_export("Mul", "Sub", "Log", "Neg", "Less", "Where", "Sqrt", "Add", "Abs", "Equal", "Erf", "Exp", "Div", "IsInf")
def _erf_inv_onnx(ex):
    """Giles' single-precision polynomials, and in float64 one Halley step on Erf, as the kernel."""
    x = ex.operand(0, ex.dtype)
    c = lambda v: ex.b.constant(v, ex.dtype)  # noqa: E731
    w = ex.emit("Neg", [ex.emit("Log", [ex.emit("Sub", [c(1.0), ex.emit("Mul", [x, x], "xx")], "1mxx")], "log")],
                "w")
    small = ex.emit("Less", [w, c(5.0)], "small")
    ws = ex.emit("Sub", [w, c(2.5)], "ws")
    wl = ex.emit("Sub", [ex.emit("Sqrt", [ex.emit("Where", [small, c(5.0), w], "wc")], "sq"), c(3.0)], "wl")

    def horner(coefs, v, tag):
        p = c(coefs[0])
        for k, co in enumerate(coefs[1:]):
            p = ex.emit("Add", [c(co), ex.emit("Mul", [p, v], f"{tag}m{k}")], f"{tag}a{k}")
        return p
    out = ex.emit("Mul", [ex.emit("Where", [small, horner(_ERF_INV_SMALL, ws, "s"), horner(_ERF_INV_LARGE, wl, "l")],
                                  "p"), x], "px")
    edge = ex.emit("Equal", [ex.emit("Abs", [x], "abs"), c(1.0)], "edge")
    if ex.dtype == np.float64:
        f = ex.emit("Sub", [ex.emit("Erf", [out], "erf"), x], "f")
        g = ex.emit("Exp", [ex.emit("Neg", [ex.emit("Mul", [out, out], "yy")], "myy")], "g")
        d = ex.emit("Mul", [ex.emit("Mul", [c(2.0 / math.sqrt(math.pi)), g], "d1"),
                            ex.emit("Add", [c(1.0), ex.emit("Mul", [out, f], "yf")], "hal")], "d")
        out = ex.emit("Sub", [out, ex.emit("Div", [f, d], "step")], "halley")
    return ex.finish(ex.out("Where", [edge, ex.emit("Mul", [x, c(np.inf)], "inf"), out]), [(x, 0)])


erf_inv = elementwise("lax_erf_inv", _erf_inv, onnx=_erf_inv_onnx, public=False,
                      vjp=lambda g, x, o: g * (0.886226925452758 * exp(o * o)))  # sqrt(pi)/2 e^(y^2)


_ERFC64 = np.vectorize(math.erfc, otypes=[np.float64])


def _erfc(xp, x):
    """erfc without the cancellation of ``1 - erf(x)`` (erfc(6) is 2.2e-17, ``1 - erf(6)`` is 0, and erfc(2) in
    float32 loses 4 digits): libm's through float64 under numpy, ``jax.lax.erfc`` under ``nb.jit``."""
    x = xp.asarray(x)
    if xp is np:
        return _ERFC64(x.astype(np.float64)).astype(x.dtype) if x.size else x.copy()
    return require_jax("erfc under nb.jit").lax.erfc(x)


@onnx_export("Erf", "Sub", "Cast")
def _erfc_onnx(ex):
    """ONNX has no Erfc: Sub(1, Erf(x)), exact to the float's precision near 0 and 0 where erfc is below it."""
    work = ex.carrier("Erf")
    x = ex.operand(0, work)
    return ex.finish(ex.out_as(work, "Sub", [ex.b.constant(1.0, work), ex.emit("Erf", [x], "erf")]), [(x, 0)])


erfc = elementwise("lax_erfc", _erfc, onnx=_erfc_onnx, public=False,
                   vjp=lambda g, x, o: g * (exp(-(x * x)) * -1.1283791670955126))  # -2/sqrt(pi) e^(-x^2)


# ---- bitcast ------------------------------------------------------------------------------------------------------


def _bitcast_kernel(arrays, local):
    x = arrays[0]
    dt = np.dtype(local.params[0])
    return x.view(dt) if _xp(x) is np else _jax_bitcast(x, dt)


def _jax_bitcast(x, dt):
    import jax  # under nb.jit only
    return jax.lax.bitcast_convert_type(x, dt)


@onnx_export("BitCast")
def _bitcast_onnx(ex):
    """ONNX has BitCast from opset 24 only; nabla writes opset 21."""
    raise ShardingError(f"export: a bitcast of {ex.args[0].dtype} to {ex.dtype} has no ONNX form at opset 21 "
                        f"(BitCast arrived in opset 24)")


def bitcast(x, dtype) -> object:
    """``x``'s bits read as ``dtype`` (of the same width): ``jax.lax.bitcast_convert_type``. Elementwise."""
    dt = np.dtype(dtype)
    src = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    if np.dtype(src).itemsize != dt.itemsize:
        raise ShardingError(f"bitcast: {src} and {dt} differ in width ({np.dtype(src).itemsize} vs {dt.itemsize} "
                            f"bytes); only a same-width bitcast is elementwise")
    return apply(_BITCAST, (x,), (dt.str,))


_BITCAST = register(OpDef("lax_bitcast_convert_type",
                          lambda shapes, dtype: R.elementwise_rule(tuple(shapes), op="bitcast_convert_type"),
                          _bitcast_kernel, arity=1, onnx=_bitcast_onnx, flops=lambda blocks, out, params: 0,
                          saves="none"))


# ---- threefry2x32 ---------------------------------------------------------------------------------------------------

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def threefry2x32_words(xp, k1, k2, x1, x2):
    """The Threefry-2x32 block cipher (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), 20
    rounds, as jax.random uses it: keys ``k1, k2`` and counters ``x1, x2`` (uint32, broadcast) to two uint32 words."""
    u = np.uint32
    k1, k2, x1, x2 = (xp.asarray(a, dtype=u) for a in (k1, k2, x1, x2))
    ks = (k1, k2, k1 ^ k2 ^ u(_PARITY))
    a, b = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            a = a + b
            b = (b << u(r)) | (b >> u(32 - r))
            b = a ^ b
        a = a + ks[(i + 1) % 3]
        b = b + ks[(i + 2) % 3] + u(i + 1)
    return a, b


def _threefry_kernel(arrays, local):
    xp = _xp(*arrays)
    G = local.G
    shape = local.out_chunk[:-1]
    blocks = []
    for a in arrays:  # each operand's block, its dims aligned to the result's trailing dims (numpy broadcasting)
        a = xp.asarray(a)
        rank = a.ndim - G
        if rank < len(shape):
            a = a.reshape(a.shape[:G] + (1,) * (len(shape) - rank) + a.shape[G:])
        blocks.append(a)
    w1, w2 = threefry2x32_words(xp, *blocks)
    w1, w2 = xp.broadcast_arrays(w1, w2)
    return xp.stack([w1, w2], axis=-1)


@onnx_export("Add", "BitShift", "BitwiseOr", "BitwiseXor", "Expand", "Unsqueeze", "Concat")
def _threefry_onnx(ex):
    """The 20 rounds as uint32 nodes (ONNX's Add wraps; BitShift and the bitwise ops take uint32), both words
    stacked on a new last dim."""
    u = np.dtype(np.uint32)
    k1, k2, x1, x2 = (ex.operand(i, u) for i in range(4))
    c = lambda v: ex.b.constant(np.uint32(v), u)  # noqa: E731
    n = [0]

    def node(op, ins, **attrs):
        n[0] += 1
        return ex.emit(op, ins, f"t{n[0]}", **attrs)
    ks = (k1, k2, node("BitwiseXor", [node("BitwiseXor", [k1, k2]), c(_PARITY)]))
    a, b = node("Add", [x1, ks[0]]), node("Add", [x2, ks[1]])
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            a = node("Add", [a, b])
            b = node("BitwiseOr", [node("BitShift", [b, c(r)], direction="LEFT"),
                                   node("BitShift", [b, c(32 - r)], direction="RIGHT")])
            b = node("BitwiseXor", [a, b])
        a = node("Add", [a, ks[(i + 1) % 3]])
        b = node("Add", [node("Add", [b, ks[(i + 2) % 3]]), c(i + 1)])
    shape = ex.ints(ex.v.shape[:-1])
    last = ex.ints([-1], "axis")
    words = [node("Unsqueeze", [node("Expand", [w, shape]), last]) for w in (a, b)]
    return ex.finish(ex.out("Concat", words, axis=-1), [(k1, 0), (k2, 1), (x1, 2), (x2, 3)])


@lru_cache(maxsize=1024)
def _threefry_rule(shapes: tuple) -> R.Rule:
    """Operands broadcast to ``S`` (numpy's rule); the result is ``(*S, 2)``: both words of each hash."""
    rule = R.elementwise_rule(shapes, op="threefry2x32")
    rank = len(rule.sizes)
    return build(rule.operands, list(rule.result) + [(rank,)], list(rule.sizes) + [2], [PASS] * (rank + 1))


def threefry2x32(k1, k2, x1, x2):
    """Both words of ``threefry2x32`` stacked on a new last dim (uint32, ``(*broadcast shape, 2)``): one step hashes
    every counter once; the words are read with ``[..., 0]`` and ``[..., 1]``."""
    return apply(_THREEFRY, (k1, k2, x1, x2))


_THREEFRY = register(OpDef("lax_threefry2x32", lambda shapes: _threefry_rule(tuple(tuple(s) for s in shapes)),
                           _threefry_kernel, dtype=np.dtype(np.uint32), arity=4, onnx=_threefry_onnx,
                           flops=lambda blocks, out, params: 110 * prod(out) // 2, saves="none"))
