"""Elementwise ops, one output element from the same element of each input: the unary math (``Abs`` ... ``Erf``,
``IsInf``, ``IsNaN``), ``Identity``, ``Cast``/``CastLike``, inference ``Dropout``, the activations with attributes
(``LeakyRelu`` ... ``Gelu``, ``Shrink``, ``PRelu``, ``Clip``) and the broadcast n-ary ops (arithmetic,
comparisons, logic, ``Mod``, bit ops, ``Sum``/``Max``/``Min``/``Mean``, ``Where``): the ONNX sharding formalism's
unary and broadcast groups. They share exact compositions of nabla's ops (floor, trunc, log1p, erf, the bits of
an integer) that no other family needs."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper

import nabla as nb

from ...dtypes import finfo, is_float, is_inexact
from ...ops import lax_ops as X
from ...tensor import Tensor
from .registry import OPS, Node, Op, _c, _cast, _hi, holdable, op


def _f(x: Tensor) -> bool:
    return is_inexact(x.dtype)


def _log1p(y: Tensor) -> Tensor:
    """log(1 + y), accurate for small y (Goldberg: log(u) * y / (u - 1) with u = 1 + y)."""
    u = y + _c(y, 1)
    d = u - _c(y, 1)
    safe = nb.where(d == _c(y, 0), _c(y, 1), d)
    return nb.where(d == _c(y, 0), y, nb.log(u) * (y / safe))


def _expm1(x: Tensor) -> Tensor:
    """exp(x) - 1, accurate near 0 (2t / (1 - t) with t = tanh(x / 2))."""
    t = nb.tanh(x * _c(x, 0.5))
    near = nb.abs(x) < _c(x, 0.5)
    den = nb.where(near, _c(x, 1) - t, _c(x, 1))
    return nb.where(near, (t + t) / den, nb.exp(x) - _c(x, 1))


def _floor(x: Tensor) -> Tensor:
    """floor through an int64 cast (truncation): exact, since every float of magnitude >= 2**mantissa
    is an integer already (kept as is, like inf and NaN)."""
    if not _f(x):
        return x
    big = _c(x, 2.0 ** np.finfo(x.dtype).nmant)
    t = nb.astype(nb.astype(x, np.int64), x.dtype)
    fl = t - nb.astype(nb.greater(t, x), x.dtype)
    return nb.where(nb.abs(x) < big, fl, x)


def _trunc(x: Tensor) -> Tensor:
    if not _f(x):
        return x
    big = _c(x, 2.0 ** np.finfo(x.dtype).nmant)
    return nb.where(nb.abs(x) < big, nb.astype(nb.astype(x, np.int64), x.dtype), x)


def _sign(x: Tensor) -> Tensor:
    one, zero = _c(x, 1), _c(x, 0)
    if x.dtype.kind == "u":
        return nb.astype(x > zero, x.dtype)
    s = nb.where(x > zero, one, nb.where(x < zero, _c(x, -1), zero))
    return nb.where(x != x, x, s) if _f(x) else s


def _bits(x: Tensor) -> tuple[list[Tensor], np.dtype]:
    """The bits of an integer tensor, least significant first, as bool tensors (exact: compare and
    subtract on the unsigned view, most significant bit first)."""
    w = x.dtype.itemsize * 8
    ut = np.dtype(f"uint{w}")
    u = _cast(x, ut)
    out: list[Tensor] = []
    for k in reversed(range(w)):
        p = ut.type(1) << ut.type(k)
        b = u >= p
        u = u - nb.astype(b, ut) * p
        out.append(b)
    return out[::-1], ut


# ---- unary elementwise (the ONNX sharding formalism's first group) ------------------------------------------------------


def _unary(names: str, fn):
    for name in names.split():
        OPS[name] = Op(lambda n, x, _fn=fn: _fn(x))


_unary("Tan", lambda x: nb.sin(x) / nb.cos(x))
_unary("IsNaN", lambda x: nb.not_equal(x, x))
_unary("Not", lambda x: nb.equal(x, False))
_unary("Softsign", lambda x: x / (_c(x, 1) + nb.abs(x)))




def _erf64(x: Tensor) -> Tensor:
    """erf in float64: its Maclaurin series below |x| = 2 and the continued fraction of erfc above.

    Not an exact composition (erf is no finite combination of nabla's ops): accurate to ~1e-15."""
    a = nb.abs(x)
    s = nb.minimum(a, 2.0)
    z = s * s
    term = s
    total = s
    for k in range(1, 60):  # sum (-1)^k x^(2k+1) / (k! (2k+1))
        term = term * (-z / k)
        total = total + term * (1.0 / (2 * k + 1))
    small = total * (2.0 / np.sqrt(np.pi))
    b = nb.maximum(a, 2.0)
    frac = 0.0
    for k in range(60, 0, -1):  # erfc(x) = exp(-x^2)/sqrt(pi) / (x + (1/2)/(x + 1/(x + (3/2)/(x + ...))))
        frac = (k * 0.5) / (b + frac)
    erfc = nb.exp(-b * b) / (b + frac) * (1.0 / np.sqrt(np.pi))
    big = 1.0 - erfc
    return _sign(x) * nb.where(a < 2.0, small, big) + nb.where(x != x, x, 0.0)




@op("IsInf")
def _isinf(n, x):
    pos = bool(n.attr("detect_positive", 1))
    neg = bool(n.attr("detect_negative", 1))
    if not _f(x):
        return nb.not_equal(x, x)  # False everywhere
    if pos and neg:
        return nb.equal(nb.abs(x), _c(x, np.inf))
    if pos:
        return nb.equal(x, _c(x, np.inf))
    if neg:
        return nb.equal(x, _c(x, -np.inf))
    return nb.less(x, x)  # False everywhere


@op("Identity")
def _identity(n, x):
    return x


def _to_dtype(n: Node, to: int) -> np.dtype:
    try:
        dt = np.dtype(helper.tensor_dtype_to_np_dtype(to))
    except Exception:  # noqa: BLE001
        raise n.fail(f"element type {to} has no numpy dtype") from None
    if not holdable(dt):
        raise n.fail(f"nabla tensors cannot hold {onnx.TensorProto.DataType.Name(to)} "
                     f"(numpy dtype {dt}); only bool, ints, uints, floats and complex")
    return dt


def _check_cast(n: Node) -> None:
    _to_dtype(n, n.attr("to"))


@op("Cast", check=_check_cast)
def _cast_op(n, x):
    return _cast(_saturated(n, x, _to_dtype(n, n.attr("to"))), _to_dtype(n, n.attr("to")))


@op("CastLike")
def _castlike(n, x, like):
    return _cast(_saturated(n, x, like.dtype), like.dtype)


def _saturated(n: Node, x, dt: np.dtype):
    """ONNX casts to float8 saturate by default (``saturate=1``): out-of-range values and infinities become the
    type's largest finite value (numpy's cast would give NaN)."""
    if not (is_float(dt) and np.dtype(dt).itemsize == 1 and n.attr("saturate", 1)) or not is_inexact(x.dtype):
        return x
    info = finfo(dt)
    lo, hi = np.asarray(info.min, x.dtype), np.asarray(info.max, x.dtype)
    return nb.minimum(nb.maximum(x, lo), hi)


def _check_dropout(n: Node) -> None:
    if n.opset < 7 and not n.attr("is_test", 0):
        raise n.fail("training-mode Dropout (is_test=0) draws random masks; only inference is supported")


@op("Dropout", check=_check_dropout)
def _dropout(n, x, ratio=None, training=None):
    if training is not None and bool(n.scalar(training, "training_mode")):
        r = 0.5 if ratio is None else float(n.scalar(ratio, "ratio"))
        if r != 0:
            raise n.fail("training-mode Dropout draws random masks; only inference (or ratio 0) is supported")
    if not n.wants(1):
        return x
    return x, nb.tensor(np.ones(x.shape, dtype=bool))


# ---- activations (unary, with attributes) --------------------------------------------------------------


@op("LeakyRelu")
def _leaky(n, x):
    return nb.where(x < _c(x, 0), x * _c(x, n.attr("alpha", 0.01)), x)


def _in_hi(fn):
    """Float activations computed in float64 and rounded once to the input's dtype."""
    def run(n, x, *rest):
        y, dt = _hi(x)
        return _cast(fn(n, y, *rest), dt)
    return run


@op("Elu")
@_in_hi
def _elu(n, x):
    return nb.where(x < 0.0, _expm1(x) * n.attr("alpha", 1.0), x)


@op("Selu")
@_in_hi
def _selu(n, x):
    a, g = n.attr("alpha", 1.67326319217681884765625), n.attr("gamma", 1.05070102214813232421875)
    return nb.where(x <= 0.0, _expm1(x) * a, x) * g


@op("Celu")
@_in_hi
def _celu(n, x):
    a = n.attr("alpha", 1.0)
    return nb.maximum(x, 0.0) + nb.minimum(_expm1(x / a) * a, 0.0)


@op("ThresholdedRelu")
def _thr(n, x):
    return nb.where(x > _c(x, n.attr("alpha", 1.0)), x, _c(x, 0))


@op("HardSigmoid")
def _hsig(n, x):
    y = x * _c(x, n.attr("alpha", 0.2)) + _c(x, n.attr("beta", 0.5))
    return nb.minimum(nb.maximum(y, _c(x, 0)), _c(x, 1))


@op("HardSwish")
def _hswish(n, x):
    y = x * _c(x, 1 / 6) + _c(x, 0.5)
    return x * nb.minimum(nb.maximum(y, _c(x, 0)), _c(x, 1))


def _softplus(x):
    return nb.maximum(x, _c(x, 0)) + _log1p(nb.exp(-nb.abs(x)))


@op("Softplus")
@_in_hi
def _softplus_op(n, x):
    return _softplus(x)


@op("Mish")
@_in_hi
def _mish(n, x):
    return x * nb.tanh(_softplus(x))


@op("Swish")
def _swish(n, x):
    return x * nb.sigmoid(x * _c(x, n.attr("alpha", 1.0)))


@op("Gelu")
def _gelu(n, x):
    y, dt = _hi(x)
    if n.attr("approximate", "none") == "tanh":
        inner = (y + 0.044715 * y * y * y) * np.sqrt(2 / np.pi)
        out = 0.5 * y * (1.0 + nb.tanh(inner))
    else:
        out = 0.5 * y * (1.0 + _erf64(y * (1 / np.sqrt(2))))
    return _cast(out, dt)


@op("Shrink")
def _shrink(n, x):
    lam, bias = n.attr("lambd", 0.5), n.attr("bias", 0.0)
    return nb.where(x < _c(x, -lam), x + _c(x, bias), nb.where(x > _c(x, lam), x - _c(x, bias), _c(x, 0)))


@op("PRelu")
def _prelu(n, x, slope):
    return nb.where(x < _c(x, 0), x * slope, x)


@op("Clip")
def _clip(n, x, lo=None, hi=None):
    if n.opset < 11:
        lo = n.attrs.get("min")
        hi = n.attrs.get("max")
        lo = None if lo is None else _c(x, lo)
        hi = None if hi is None else _c(x, hi)
    if lo is not None:
        x = nb.maximum(x, lo)
    if hi is not None:
        x = nb.minimum(x, hi)
    return x


# ---- broadcast n-ary elementwise (the ONNX sharding formalism's second group) --------------------------------------------


_binary_fns: dict[str, Callable] = {
    "Add": nb.add, "Sub": nb.subtract, "Mul": nb.multiply,
    "Equal": nb.equal, "Greater": nb.greater, "Less": nb.less,
    "GreaterOrEqual": nb.greater_equal, "LessOrEqual": nb.less_equal,
    "And": nb.multiply, "Or": nb.maximum, "Xor": nb.not_equal,
}
for _name, _fn in _binary_fns.items():
    OPS[_name] = Op(lambda n, a, b, _fn=_fn: _fn(a, b))


@op("Div")
def _div(n, a, b):
    q = nb.divide(a, b)
    if _f(a):
        return q
    return _cast(_trunc(q), a.dtype)  # integer division truncates toward zero


@op("Pow")
def _pow(n, a, b):
    return _cast(nb.power(a, b), a.dtype)


def _signbit(x: Tensor) -> Tensor:
    return nb.maximum(x < _c(x, 0), nb.multiply(x == _c(x, 0), (_c(x, 1) / x) < _c(x, 0)))


@op("Mod")
def _mod(n, a, b):
    """Integers: through a float64 quotient, then exact integer arithmetic (exact below 2**53).
    Floats: C's fmod (exact; a - b * trunc(a / b) rounded: 1.0 mod 0.1 in float64 gave 0), then the sign of the
    divisor when ``fmod`` is 0, with IEEE's signed zeros and infinities."""
    fmod = bool(n.attr("fmod", 0))
    if not _f(a):
        q = nb.divide(a, b)
        q = _cast(_trunc(q) if fmod else _floor(q), a.dtype)
        return _cast(a - b * q, a.dtype)
    (A, dt), (B, _) = _hi(a), _hi(b)
    r = X.rem(A, B)  # (its zeros have A's sign)
    if not fmod:
        flip = nb.multiply(r != 0.0, nb.not_equal(_signbit(r), _signbit(B)))
        r = nb.where(flip, r + B, r)
        r = nb.where(r == 0.0, nb.where(_signbit(B), -0.0, 0.0), r)
    return _cast(r, dt)


@op("BitShift")
def _bitshift(n, x, s):
    """Shifts on the unsigned view: a shift amount read as unsigned (so negative ones are huge), capped
    at the width; left multiplies by a wrapping power of two, right sums the surviving bits, and an
    arithmetic (signed) right shift adds the sign's high bits."""
    d = n.attr("direction")
    if d not in ("LEFT", "RIGHT"):
        raise n.fail(f"direction must be LEFT or RIGHT, got {d!r}")
    w = x.dtype.itemsize * 8
    ut = np.dtype(f"uint{w}")
    two = nb.tensor(np.asarray(ut.type(2)))
    sh = nb.minimum(_cast(s, ut), ut.type(w))
    if d == "LEFT":
        return _cast(_cast(x, ut) * nb.power(two, sh), x.dtype)
    bits, _ = _bits(x)
    acc = None
    for k, b in enumerate(bits):
        exp = nb.where(sh <= ut.type(k), ut.type(k) - nb.minimum(sh, ut.type(k)), ut.type(0))
        term = nb.where(sh <= ut.type(k), nb.astype(b, ut), ut.type(0)) * nb.power(two, exp)
        acc = term if acc is None else acc + term
    if x.dtype.kind == "i":
        high = ut.type(0) - nb.power(two, ut.type(w) - sh)  # the top `sh` bits set (all of them at sh = w)
        acc = acc + nb.where(x < _c(x, 0), high, ut.type(0))
    return _cast(acc, x.dtype)




def _variadic(fn):
    def run(n, *xs):
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        return out
    return run


OPS["Sum"] = Op(_variadic(nb.add))
OPS["Max"] = Op(_variadic(nb.maximum))
OPS["Min"] = Op(_variadic(nb.minimum))


@op("Mean")
def _mean(n, *xs):
    s = _variadic(nb.add)(n, *xs)
    return s / _c(s, len(xs))


@op("Where")
def _where(n, c, a, b):
    return nb.where(c, a, b)
