"""The op table: one entry per ONNX op type, each a composition of nabla's public ops with the
ONNX spec's attribute semantics (defaults per opset come from the schema). Values that decide
shapes (a Reshape target, Slice bounds...) are read on the host; everything else stays on the mesh."""

from __future__ import annotations

import builtins
from math import prod
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

import nabla as nb

from ..dtypes import finfo, is_float, is_inexact
from ..errors import ShardingError
from ..tensor import Tensor


class NeedsValue(ShardingError):
    """A value that decides shapes is abstract: ``check`` and ``annotate`` then take ONNX's shape inference."""


class Node:
    """What a handler sees of one node: its name and op type, its attributes (with the schema's
    defaults for the model's opset), and which outputs are wanted."""

    def __init__(self, proto: onnx.NodeProto, opset: int, label: str) -> None:
        self.proto = proto
        self.op_type = proto.op_type
        self.label = label  # "node 'name' (OpType)"
        self.op_label = f"{proto.op_type} {proto.name}" if proto.name else proto.op_type  # for the comm log
        self.opset = opset
        self.attrs = {a.name: _attr_value(a) for a in proto.attribute}
        try:
            self.schema = onnx.defs.get_schema(proto.op_type, opset, proto.domain or "")
        except Exception:  # noqa: BLE001 - an op unknown to this onnx: no defaults
            self.schema = None

    def attr(self, name: str, default: Any = None) -> Any:
        if name in self.attrs:
            return self.attrs[name]
        if self.schema is not None and name in self.schema.attributes:
            d = self.schema.attributes[name].default_value
            if d is not None and d.type != onnx.AttributeProto.UNDEFINED:
                return _attr_value(d)
        return default

    def wants(self, i: int) -> bool:
        return len(self.proto.output) > i and bool(self.proto.output[i])

    def fail(self, msg: str) -> ShardingError:
        return ShardingError(f"{self.label}: {msg}")

    def host(self, t: Tensor | None, what: str) -> np.ndarray:
        """The value of a tensor that decides shapes, read on the host."""
        if t is None:
            raise self.fail(f"input {what!r} is required")
        if t.is_abstract:
            raise NeedsValue(f"{self.label}: "
                             f"input {what!r} decides the output shape, so its value must be known; it is "
                             f"abstract (nb.abstract). Make it a constant or an initializer")
        return value(t)

    def scalar(self, t: Tensor | None, what: str) -> Any:
        v = self.host(t, what)
        if v.size != 1:
            raise self.fail(f"input {what!r} must hold one value, it has shape {v.shape}")
        return v.reshape(-1)[0]


def value(t: Tensor) -> np.ndarray:
    """``t.numpy()`` with ``t``'s shape (this nabla returns shape (1,) for a sharded 0-d tensor)."""
    return np.asarray(t.numpy()).reshape(t.shape)


def _attr_value(a: onnx.AttributeProto) -> Any:
    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return a  # sub-graphs: the ops using them are not in the table
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode() for s in v]
    return v


DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128))


def holdable(dtype) -> bool:
    """Whether nabla tensors hold this dtype: numpy's numeric types, and ml_dtypes' bfloat16 and float8 types
    (not int4, float4 or strings)."""
    return np.dtype(dtype) in DTYPES or is_float(dtype)


class Op(NamedTuple):
    run: Callable[..., Any]
    needs: tuple[str, ...] = ()  # nabla functions the entry calls that may not exist yet
    check: Callable[[Node], None] | None = None  # static attribute checks, before anything runs


OPS: dict[str, Op] = {}


def op(*names: str, needs: tuple[str, ...] = (), check=None):
    def deco(fn):
        for name in names:
            OPS[name] = Op(fn, needs, check)
        return fn
    return deco


# ---- small helpers -----------------------------------------------------------------------------------


def _c(x: Tensor, v) -> Any:
    """``v`` as a scalar of ``x``'s dtype (so it never changes the result dtype)."""
    return x.dtype.type(v)


def _f(x: Tensor) -> bool:
    return is_inexact(x.dtype)


def _cast(x: Tensor, dtype) -> Tensor:
    return x if x.dtype == np.dtype(dtype) else nb.astype(x, dtype)


def _hi(x: Tensor) -> tuple[Tensor, np.dtype]:
    """Work in float64 (float16/32 compositions then round once, as a kernel would)."""
    return _cast(x, np.float64), x.dtype


def _ints(a: np.ndarray) -> list[int]:
    return [int(v) for v in np.asarray(a).reshape(-1)]


def _axis(n: Node, axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < rank or (rank == 0 and axis not in (0, -1)):
        raise n.fail(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def _take(x: Tensor, axis: int, sl) -> Tensor:
    key = [slice(None)] * x.ndim
    key[axis] = sl
    return x[tuple(key)]


def _iota(n: int, axis: int, rank: int) -> np.ndarray:
    shape = [1] * rank
    shape[axis] = n
    return np.arange(n, dtype=np.int64).reshape(shape)


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


def _atan2(y: Tensor, x) -> Tensor:
    """atan2 (float64) through the complex logarithm: Im log(x + iy) is atan2(y, x), exactly as numpy's
    clog gives it; log(z) - log(conj z) cancels the real parts exactly, so no rounding is added."""
    iy = nb.astype(y, np.complex128) * 1j
    z, zc = iy + x, -iy + x
    return nb.astype((nb.log(z) - nb.log(zc)) * (-0.5j), np.float64)


def _atan(x: Tensor) -> Tensor:
    finite = nb.where(nb.abs(x) == np.inf, 0.0, x)
    return nb.where(x == np.inf, np.pi / 2, nb.where(x == -np.inf, -np.pi / 2, _atan2(finite, 1.0)))


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


def _round_even(x: Tensor) -> Tensor:
    if not _f(x):
        return x
    r = _floor(x)
    d = x - r  # exact below 2**mantissa
    half = r * _c(x, 0.5)
    odd = nb.not_equal(_floor(half), half)
    up = nb.maximum(d > _c(x, 0.5), nb.multiply(d == _c(x, 0.5), odd))  # or, and on bools
    big = _c(x, 2.0 ** np.finfo(x.dtype).nmant)
    return nb.where(nb.abs(x) < big, r + nb.astype(up, x.dtype), x)


def _sign(x: Tensor) -> Tensor:
    one, zero = _c(x, 1), _c(x, 0)
    if x.dtype.kind == "u":
        return nb.astype(x > zero, x.dtype)
    s = nb.where(x > zero, one, nb.where(x < zero, _c(x, -1), zero))
    return nb.where(x != x, x, s) if _f(x) else s


def _prod(x: Tensor, axes: Sequence[int], keepdims: bool) -> Tensor:
    """Product over ``axes``: a halving tree of multiplies (padding odd counts with 1)."""
    rank = x.ndim
    axes = sorted(axes)
    rest = [d for d in range(rank) if d not in axes]
    y = nb.transpose(x, rest + axes) if axes else x
    m = prod(x.shape[a] for a in axes)
    y = nb.reshape(y, tuple(x.shape[d] for d in rest) + (m,))
    last = len(rest)
    if m == 0:
        out = nb.tensor(np.ones(tuple(x.shape[d] for d in rest), dtype=x.dtype))
    else:
        while y.shape[last] > 1:
            k = y.shape[last]
            if k % 2:
                pad = nb.tensor(np.ones(y.shape[:last] + (1,), dtype=x.dtype))
                y = nb.concatenate([y, pad], last)
                k += 1
            y = _take(y, last, slice(0, k // 2)) * _take(y, last, slice(k // 2, k))
        out = nb.squeeze(y, last)
    if keepdims:
        out = nb.reshape(out, tuple(1 if d in axes else x.shape[d] for d in range(rank)))
    return out


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


def _from_bits(bits: Sequence[Tensor], ut: np.dtype, dtype: np.dtype) -> Tensor:
    acc = None
    for k, b in enumerate(bits):
        term = nb.astype(b, ut) * (ut.type(1) << ut.type(k))
        acc = term if acc is None else acc + term
    return _cast(acc, dtype)


# ---- unary elementwise (the ONNX sharding formalism's first group) ------------------------------------------------------


def _unary(names: str, fn):
    for name in names.split():
        OPS[name] = Op(lambda n, x, _fn=fn: _fn(x))


_unary("Abs", nb.abs)
_unary("Neg", nb.negative)
_unary("Exp", nb.exp)
_unary("Log", nb.log)
_unary("Sin", nb.sin)
_unary("Cos", nb.cos)
_unary("Tanh", nb.tanh)
_unary("Sqrt", nb.sqrt)
_unary("Sigmoid", nb.sigmoid)
_unary("Relu", nb.relu)
_unary("Tan", lambda x: nb.sin(x) / nb.cos(x))
_unary("Reciprocal", lambda x: _c(x, 1) / x)
_unary("Floor", _floor)
_unary("Ceil", lambda x: -_floor(-x) if _f(x) else x)
_unary("Round", _round_even)
_unary("Sign", _sign)
_unary("IsNaN", lambda x: nb.not_equal(x, x))
_unary("Not", lambda x: nb.equal(x, False))
_unary("Softsign", lambda x: x / (_c(x, 1) + nb.abs(x)))


def _hi_unary(fn):
    def run(x):
        y, dt = _hi(x)
        return _cast(fn(y), dt)
    return run


def _sinh(x):
    t = nb.tanh(x * 0.5)
    small = nb.abs(x) < 1.0
    return nb.where(small, (t + t) / nb.where(small, 1.0 - t * t, 1.0), (nb.exp(x) - nb.exp(-x)) * 0.5)


_unary("Sinh", _hi_unary(_sinh))
_unary("Cosh", _hi_unary(lambda x: (nb.exp(x) + nb.exp(-x)) * 0.5))
_unary("Asinh", _hi_unary(lambda x: _sign(x) * _log1p(nb.abs(x) + x * x / (1.0 + nb.sqrt(x * x + 1.0)))))
_unary("Acosh", _hi_unary(lambda x: _log1p((x - 1.0) + nb.sqrt((x - 1.0) * (x + 1.0)))))
_unary("Atanh", _hi_unary(lambda x: 0.5 * _log1p((x + x) / (1.0 - x))))
_unary("Atan", _hi_unary(_atan))
_unary("Asin", _hi_unary(lambda x: _atan2(x, nb.sqrt((1.0 - x) * (1.0 + x)))))
_unary("Acos", _hi_unary(lambda x: _atan2(nb.sqrt((1.0 - x) * (1.0 + x)), x)))


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


_unary("Erf", _hi_unary(_erf64))


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
    Floats: fmod as a - b * trunc(a / b) in float64 (exact for float16/32 while |a / b| < 2**29),
    then the sign of the divisor when ``fmod`` is 0, with IEEE's signed zeros and infinities."""
    fmod = bool(n.attr("fmod", 0))
    if not _f(a):
        q = nb.divide(a, b)
        q = _cast(_trunc(q) if fmod else _floor(q), a.dtype)
        return _cast(a - b * q, a.dtype)
    (A, dt), (B, _) = _hi(a), _hi(b)
    binf = nb.abs(B) == np.inf
    q = _trunc(A / nb.where(binf, 1.0, B))
    r = nb.where(nb.multiply(binf, nb.abs(A) < np.inf), A, A - B * q)
    r = nb.where(r == 0.0, nb.where(_signbit(A), -0.0, 0.0), r)
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


def _bitwise(f):
    def run(n, a, b):
        ba, ut = _bits(a)
        bb, _ = _bits(b)
        return _from_bits([f(p, q) for p, q in zip(ba, bb)], ut, np.result_type(a.dtype, b.dtype))
    return run


OPS["BitwiseAnd"] = Op(_bitwise(nb.multiply))
OPS["BitwiseOr"] = Op(_bitwise(nb.maximum))
OPS["BitwiseXor"] = Op(_bitwise(nb.not_equal))


@op("BitwiseNot")
def _bitwise_not(n, x):
    bits, ut = _bits(x)
    return _from_bits([nb.equal(b, False) for b in bits], ut, x.dtype)


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


# ---- reductions (the ONNX sharding formalism's third group) ------------------------------------------------------------


def _reduce_axes(n: Node, x: Tensor, axes_t: Tensor | None) -> tuple[int, ...] | None:
    """The reduced axes, or None for "no reduction" (noop_with_empty_axes with no axes)."""
    if axes_t is not None and axes_t.size:
        axes = _ints(n.host(axes_t, "axes"))
    elif "axes" in n.attrs:
        axes = list(n.attrs["axes"])
    else:
        axes = []
    if not axes:
        if n.attr("noop_with_empty_axes", 0):
            return None
        return tuple(range(x.ndim))
    out = sorted({_axis(n, a, x.ndim, "axes entry") for a in axes})
    if len(out) != len(axes):
        raise n.fail(f"axes {axes} repeat a dim")
    return tuple(out)


def _reduction(kernel, empty):
    """``kernel(x, axes, keepdims)``; ``empty(dtype)`` is the value of a reduction over no elements."""
    def run(n, x, axes_t=None):
        axes = _reduce_axes(n, x, axes_t)
        if axes is None:
            return x
        keep = bool(n.attr("keepdims", 1))
        if any(x.shape[a] == 0 for a in axes):
            shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape) if keep or d not in axes)
            return nb.tensor(np.full(shape, empty(x.dtype), dtype=x.dtype))
        return _cast(kernel(x, axes, keep), x.dtype)
    return run


def _lowest(dt):
    return -np.inf if is_float(dt) else np.iinfo(dt).min if dt.kind in "iu" else False


def _highest(dt):
    return np.inf if is_float(dt) else np.iinfo(dt).max if dt.kind in "iu" else True


OPS["ReduceSum"] = Op(_reduction(lambda x, a, k: nb.sum(x, a, k), lambda dt: 0))
OPS["ReduceMean"] = Op(_reduction(lambda x, a, k: nb.mean(x, a, k), lambda dt: np.nan))
OPS["ReduceMax"] = Op(_reduction(lambda x, a, k: nb.max(x, a, k), _lowest))
OPS["ReduceMin"] = Op(_reduction(lambda x, a, k: nb.min(x, a, k), _highest))
OPS["ReduceProd"] = Op(_reduction(_prod, lambda dt: 1))
OPS["ReduceL1"] = Op(_reduction(lambda x, a, k: nb.sum(nb.abs(x), a, k), lambda dt: 0))
OPS["ReduceL2"] = Op(_reduction(lambda x, a, k: nb.sqrt(nb.sum(x * x, a, k)), lambda dt: 0))
OPS["ReduceSumSquare"] = Op(_reduction(lambda x, a, k: nb.sum(x * x, a, k), lambda dt: 0))
OPS["ReduceLogSum"] = Op(_reduction(lambda x, a, k: nb.log(nb.sum(x, a, k)), lambda dt: -np.inf))
OPS["ReduceLogSumExp"] = Op(_reduction(lambda x, a, k: nb.logsumexp(x, a, k), lambda dt: -np.inf))


def _arg(which: str):
    def run(n, x):
        ax = _axis(n, n.attr("axis", 0), x.ndim)
        size = x.shape[ax]
        last = bool(n.attr("select_last_index", 0))
        if last:
            x = _take(x, ax, slice(None, None, -1))
        if which == "max":
            idx = _cast(nb.argmax(x, ax), np.int64)
        else:  # the first index holding the min (argmax's own composition, with min)
            m = nb.min(x, ax, keepdims=True)
            hits = nb.where(x == m, _iota(size, ax, x.ndim), np.int64(size))
            idx = _cast(nb.min(hits, ax), np.int64)
        if last:
            idx = np.int64(size - 1) - idx
        return nb.expand_dims(idx, ax) if n.attr("keepdims", 1) else idx
    return run


OPS["ArgMax"] = Op(_arg("max"))
OPS["ArgMin"] = Op(_arg("min"))


# ---- MatMul-like (the ONNX sharding formalism's fourth group) ------------------------------------------------------------


@op("MatMul")
def _matmul(n, a, b):
    return nb.matmul(a, b)


@op("Gemm")
def _gemm(n, a, b, c=None):
    if n.attr("transA", 0):
        a = nb.transpose(a)
    if n.attr("transB", 0):
        b = nb.transpose(b)
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    y = nb.matmul(a, b)
    if alpha != 1.0:
        y = y * _c(y, alpha)
    if c is not None and beta != 0.0:
        y = y + (c if beta == 1.0 else c * _c(c, beta))
    return _cast(y, a.dtype)


@op("Einsum")
def _einsum(n, *xs):
    eq = n.attr("equation").replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(xs):
        raise n.fail(f"equation {eq!r} names {len(terms)} operands, got {len(xs)}")
    if not arrow:  # numpy's implicit output, decided before diagonals are taken
        letters = lhs.replace(".", "").replace(",", "")
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    ops_, new_terms = [], []
    for t, x in zip(terms, xs):
        x, t = _diagonals(n, x, t)
        ops_.append(x)
        new_terms.append(t)
    return nb.einsum(",".join(new_terms) + "->" + rhs, *ops_)


def _diagonals(n: Node, x: Tensor, term: str) -> tuple[Tensor, str]:
    """A letter repeated within one operand takes its diagonal: keep where the two indices agree, sum
    out the second (exact: the other terms are zeros chosen by ``where``, not products)."""
    while True:
        ell = x.ndim - (len(term) - 3) if "..." in term else 0
        dims = term.replace("...", "." * ell)
        rep = next((c for c in dims if c != "." and dims.count(c) > 1), None)
        if rep is None:
            return x, term
        i = dims.index(rep)
        j = dims.index(rep, i + 1)
        k, dt = x.shape[i], x.dtype
        shape = [1] * x.ndim
        shape[i], shape[j] = k, k
        eye = np.eye(k, dtype=bool).reshape(shape)
        x = nb.sum(nb.where(eye, x, _c(x, 0)), j)
        x = _cast(x, dt)
        dims = dims[:j] + dims[j + 1:]
        term = dims.replace("." * ell, "...", 1) if ell else dims


# ---- shapes and data movement -----------------------------------------------------------------------


@op("Shape")
def _shape(n, x):
    dims = list(x.shape)
    start, end = n.attr("start", 0), n.attr("end", None)
    return nb.tensor(np.array(dims[start:end] if end is not None else dims[start:], dtype=np.int64))


@op("Size")
def _size(n, x):
    return nb.tensor(np.array(x.size, dtype=np.int64))


@op("Reshape")
def _reshape(n, x, shape_t=None):
    target = _ints(n.host(shape_t, "shape")) if shape_t is not None else list(n.attr("shape"))
    if not n.attr("allowzero", 0):
        target = [x.shape[i] if v == 0 else v for i, v in enumerate(target)]
    return nb.reshape(x, tuple(target))


@op("Flatten")
def _flatten(n, x):
    ax = n.attr("axis", 1)
    if not -x.ndim <= ax <= x.ndim:
        raise n.fail(f"axis {ax} is out of range for rank {x.ndim}")
    if ax < 0:
        ax += x.ndim
    return nb.reshape(x, (prod(x.shape[:ax]), prod(x.shape[ax:])))


@op("Transpose")
def _transpose(n, x):
    perm = n.attr("perm", None)
    return nb.transpose(x, None if perm is None else tuple(perm))


@op("Concat")
def _concat(n, *xs):
    ax = _axis(n, n.attr("axis"), xs[0].ndim)
    return nb.concatenate(list(xs), ax)


@op("Split")
def _split(n, x, split_t=None):
    ax = _axis(n, n.attr("axis", 0), x.ndim)
    size = x.shape[ax]
    outs = len(n.proto.output)
    if split_t is not None and split_t.size:
        sizes = _ints(n.host(split_t, "split"))
    elif n.attrs.get("split"):
        sizes = list(n.attrs["split"])
    else:
        k = n.attr("num_outputs", None) or outs
        if n.opset >= 18 and n.attr("num_outputs", None):
            c = -(-size // k)
            sizes = [c] * (size // c) + ([size % c] if size % c else [])
        else:
            if size % k:
                raise n.fail(f"dim {ax} of size {size} does not split evenly into {k} outputs")
            sizes = [size // k] * k
    if builtins.sum(sizes) != size or len(sizes) != outs:
        raise n.fail(f"split sizes {sizes} do not cover dim {ax} of size {size} in {outs} outputs")
    out, at = [], 0
    for s in sizes:
        out.append(_take(x, ax, slice(at, at + s)))
        at += s
    return tuple(out)


def _slice_bounds(start: int, end: int, step: int, dim: int) -> slice:
    """ONNX's clamping (negative values count from the end), as a Python slice numpy agrees with."""
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        return slice(start, end, step)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)


@op("Slice")
def _slice(n, x, starts=None, ends=None, axes=None, steps=None):
    if n.opset < 10:
        st, en = list(n.attr("starts")), list(n.attr("ends"))
        ax = list(n.attr("axes", list(range(len(st)))))
        sp = [1] * len(st)
    else:
        st, en = _ints(n.host(starts, "starts")), _ints(n.host(ends, "ends"))
        ax = _ints(n.host(axes, "axes")) if axes is not None else list(range(len(st)))
        sp = _ints(n.host(steps, "steps")) if steps is not None else [1] * len(st)
    key = [slice(None)] * x.ndim
    for s, e, a, p in zip(st, en, ax, sp):
        if p == 0:
            raise n.fail("a slice step cannot be 0")
        a = _axis(n, a, x.ndim, "axes entry")
        key[a] = _slice_bounds(s, e, p, x.shape[a])
    return x[tuple(key)]


@op("Gather")
def _gather(n, x, idx):
    """nb.take: the indices stay on the mesh (the result keeps their sharding), a gathered dim sharded on the
    mesh is looked up where its rows are (partial sums, summed when needed): every move is in the comm log."""
    return nb.take(x, idx, _axis(n, n.attr("axis", 0), x.ndim))


@op("GatherElements")
def _gather_elements(n, x, idx):
    """nb.take_along_axis; ONNX lets the indices be shorter than the data on the other dims (their prefix)."""
    ax = _axis(n, n.attr("axis", 0), x.ndim)
    if idx.ndim != x.ndim:
        raise n.fail(f"indices of rank {idx.ndim} for data of rank {x.ndim}")
    key = tuple(slice(None) if d == ax or m == k else slice(0, k) for d, (m, k) in enumerate(zip(x.shape, idx.shape)))
    if any(k > m for d, (m, k) in enumerate(zip(x.shape, idx.shape)) if d != ax):
        raise n.fail(f"indices of shape {idx.shape} are longer than the data {x.shape} on a dim other than {ax}")
    return nb.take_along_axis(x[key] if any(s != slice(None) for s in key) else x, idx, ax)


@op("OneHot")
def _one_hot(n, idx, depth_t, values):
    """nb.one_hot on the indices (negative ones counted from the end, as ONNX does), then on/off values."""
    depth = int(np.asarray(n.scalar(depth_t, "depth")).astype(np.int64))
    rank = idx.ndim + 1
    ax = _axis(n, n.attr("axis", -1), rank)
    if values.shape != (2,):
        raise n.fail(f"values must hold [off, on], got shape {values.shape}")
    ids = _cast(idx, np.int64)
    ids = nb.where(ids < 0, ids + np.int64(depth), ids)
    hot = nb.one_hot(ids, depth, dtype="bool", axis=ax)
    return nb.where(hot, values[1], values[0])


@op("Unsqueeze")
def _unsqueeze(n, x, axes_t=None):
    axes = _ints(n.host(axes_t, "axes")) if axes_t is not None else list(n.attr("axes"))
    r = x.ndim + len(axes)
    norm = sorted(_axis(n, a, r, "axes entry") for a in axes)
    if len(set(norm)) != len(norm):
        raise n.fail(f"axes {axes} repeat a dim")
    return nb.expand_dims(x, tuple(norm))


@op("Squeeze")
def _squeeze(n, x, axes_t=None):
    if axes_t is not None:
        axes = _ints(n.host(axes_t, "axes"))
    else:
        axes = n.attr("axes", None)
    if axes is None or len(axes) == 0:
        return nb.squeeze(x)
    return nb.squeeze(x, tuple(_axis(n, a, x.ndim, "axes entry") for a in axes))


@op("Expand")
def _expand(n, x, shape_t):
    target = tuple(_ints(n.host(shape_t, "shape")))
    try:
        out = np.broadcast_shapes(x.shape, target)
    except ValueError:
        raise n.fail(f"shape {x.shape} does not broadcast with {target}") from None
    return x if out == x.shape else nb.broadcast_to(x, out)


@op("Tile")
def _tile(n, x, reps_t):
    reps = _ints(n.host(reps_t, "repeats"))
    if len(reps) != x.ndim:
        raise n.fail(f"repeats {reps} must have one entry per dim of a rank-{x.ndim} tensor")
    for ax, r in enumerate(reps):
        if r == 0:
            x = _take(x, ax, slice(0, 0))
        elif r > 1:
            x = nb.concatenate([x] * r, ax)
    return x


def _padding(n: Node, x: Tensor, pads_t, axes_t) -> list[tuple[int, int]]:
    if n.opset < 11:
        pads = list(n.attr("pads", n.attr("paddings", [])))
    else:
        pads = _ints(n.host(pads_t, "pads"))
    axes = list(range(x.ndim)) if axes_t is None else [_axis(n, a, x.ndim, "axes entry")
                                                       for a in _ints(n.host(axes_t, "axes"))]
    if len(pads) != 2 * len(axes):
        raise n.fail(f"pads {pads} must have two entries per padded axis ({len(axes)} axes)")
    out = [(0, 0)] * x.ndim
    for i, a in enumerate(axes):
        out[a] = (pads[i], pads[i + len(axes)])
    return out


@op("Pad")
def _pad(n, x, pads_t=None, value_t=None, axes_t=None):
    mode = n.attr("mode", "constant")
    pads = _padding(n, x, pads_t, axes_t)
    if n.opset < 11:
        value = n.attr("value", 0.0)
    else:
        value = 0 if value_t is None or value_t.size == 0 else n.scalar(value_t, "constant_value")
    for ax, (lo, hi) in enumerate(pads):  # crop first (negative pads)
        if lo < 0 or hi < 0:
            x = _take(x, ax, slice(-min(lo, 0), x.shape[ax] + min(hi, 0)))
    for ax, (lo, hi) in enumerate(pads):
        lo, hi = max(lo, 0), max(hi, 0)
        if not lo and not hi:
            continue
        size = x.shape[ax]
        if mode == "constant":
            def block(k):
                shape = list(x.shape)
                shape[ax] = k
                return nb.tensor(np.full(shape, value, dtype=x.dtype))
            parts = [block(lo)] * bool(lo) + [x] + [block(hi)] * bool(hi)
        elif mode == "edge":
            if size == 0:
                raise n.fail(f"edge padding of an empty dim {ax}")
            parts = [_take(x, ax, slice(0, 1))] * lo + [x] + [_take(x, ax, slice(size - 1, size))] * hi
        elif mode == "reflect":
            if lo >= size or hi >= size:
                raise n.fail(f"reflect padding ({lo}, {hi}) needs dim {ax} larger than the pads, it has {size}")
            parts = [_take(x, ax, slice(lo, 0, -1))] * bool(lo) + [x] + \
                [_take(x, ax, slice(size - 2, size - 2 - hi, -1) if size - 2 - hi >= 0
                       else slice(size - 2, None, -1))] * bool(hi)
        elif mode == "wrap":
            if size == 0:
                raise n.fail(f"wrap padding of an empty dim {ax}")
            parts = [_take(x, ax, slice(size - lo % size, size))] * bool(lo % size) + [x] * (lo // size) + [x] \
                + [x] * (hi // size) + [_take(x, ax, slice(0, hi % size))] * bool(hi % size)
        else:
            raise n.fail(f"unknown pad mode {mode!r}")
        x = nb.concatenate(parts, ax)
    return x


@op("Range")
def _range(n, start, limit, delta):
    s, l, d = (n.scalar(t, w) for t, w in ((start, "start"), (limit, "limit"), (delta, "delta")))
    count = builtins.max(int(np.ceil((l - s) / d)), 0)
    return nb.tensor((s + np.arange(count).astype(s.dtype) * d).astype(s.dtype))


@op("Trilu")
def _trilu(n, x, k_t=None):
    k = 0 if k_t is None else int(n.scalar(k_t, "k"))
    rows, cols = x.shape[-2], x.shape[-1]
    i = np.arange(rows).reshape(rows, 1)
    j = np.arange(cols).reshape(1, cols)
    mask = (j - i >= k) if n.attr("upper", 1) else (j - i <= k)
    return nb.where(mask, x, _c(x, 0))


@op("CumSum")
def _cumsum(n, x, axis_t):
    ax = _axis(n, int(n.scalar(axis_t, "axis")), x.ndim)
    size = x.shape[ax]
    rev = bool(n.attr("reverse", 0))
    if rev:
        x = _take(x, ax, slice(None, None, -1))

    def shifted(y, s):  # y moved s places along ax, zeros in front
        shape = list(y.shape)
        shape[ax] = s
        return nb.concatenate([nb.tensor(np.zeros(shape, y.dtype)), _take(y, ax, slice(0, size - s))], ax)

    if n.attr("exclusive", 0) and size:
        x = shifted(x, 1)
    s = 1
    while s < size:  # Hillis-Steele scan
        x = x + shifted(x, s)
        s *= 2
    return _take(x, ax, slice(None, None, -1)) if rev else x


@op("Constant")
def _constant(n):
    a = n.attrs
    if "value" in a:
        v = np.asarray(a["value"])
    elif "value_float" in a:
        v = np.array(a["value_float"], dtype=np.float32)
    elif "value_floats" in a:
        v = np.array(a["value_floats"], dtype=np.float32)
    elif "value_int" in a:
        v = np.array(a["value_int"], dtype=np.int64)
    elif "value_ints" in a:
        v = np.array(a["value_ints"], dtype=np.int64)
    else:
        raise n.fail(f"only tensor, float(s) and int(s) constants are supported, got {sorted(a)}")
    if not holdable(v.dtype):
        raise n.fail(f"constant of dtype {v.dtype} cannot be a nabla tensor")
    return nb.tensor(v)


def _check_constant(n: Node) -> None:
    if not any(k in n.attrs for k in ("value", "value_float", "value_floats", "value_int", "value_ints")):
        raise n.fail(f"only tensor, float(s) and int(s) constants are supported, got {sorted(n.attrs)}")


OPS["Constant"] = Op(_constant, (), _check_constant)


@op("ConstantOfShape")
def _constant_of_shape(n, shape_t):
    shape = tuple(_ints(n.host(shape_t, "input")))
    v = n.attrs.get("value")
    v = np.zeros(1, np.float32) if v is None else np.asarray(v).reshape(-1)
    return nb.tensor(np.full(shape, v[0], dtype=v.dtype))


# ---- softmax family ---------------------------------------------------------------------------------


def _softmax_like(n: Node, x: Tensor, fn) -> Tensor:
    """Opset >= 13: along one axis. Before 13: over the flattened dims from ``axis`` on."""
    if n.opset >= 13:
        return fn(x, _axis(n, n.attr("axis", -1), x.ndim))
    ax = n.attr("axis", 1)
    ax = ax + x.ndim if ax < 0 else ax
    y = nb.reshape(x, (prod(x.shape[:ax]), prod(x.shape[ax:])))
    return nb.reshape(fn(y, 1), x.shape)


def _hardmax(x, ax):
    idx = nb.expand_dims(nb.argmax(x, ax), ax)
    return nb.astype(nb.equal(idx, _iota(x.shape[ax], ax, x.ndim)), x.dtype)


OPS["Softmax"] = Op(lambda n, x: _softmax_like(n, x, lambda y, a: nb.softmax(y, a)))
OPS["LogSoftmax"] = Op(lambda n, x: _softmax_like(n, x, lambda y, a: nb.log_softmax(y, a)))
OPS["Hardmax"] = Op(lambda n, x: _softmax_like(n, x, _hardmax))


# ---- normalization, convolution and pooling ------------------------------------------------------------


def _moments(x: Tensor, axes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    mean = nb.mean(x, axes, keepdims=True)
    d = x - mean
    return mean, nb.mean(d * d, axes, keepdims=True)


@op("InstanceNormalization")
def _instance_norm(n, x, scale, bias):
    axes = tuple(range(2, x.ndim))
    mean, var = _moments(x, axes)
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    y = (x - mean) / nb.sqrt(var + _c(x, n.attr("epsilon", 1e-5)))
    return y * nb.reshape(scale, shape) + nb.reshape(bias, shape)


@op("LRN")
def _lrn(n, x):
    """Sum of squares over a window of ``size`` channels (zero padded), from shifted slices."""
    size = n.attr("size")
    alpha, beta, bias = n.attr("alpha", 1e-4), n.attr("beta", 0.75), n.attr("bias", 1.0)
    c = x.shape[1]
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = x * x

    def zeros(k):
        shape = list(x.shape)
        shape[1] = k
        return nb.tensor(np.zeros(shape, x.dtype))

    padded = nb.concatenate([zeros(lo)] * bool(lo) + [sq] + [zeros(hi)] * bool(hi), 1)
    total = None
    for k in range(size):
        part = _take(padded, 1, slice(k, k + c))
        total = part if total is None else total + part
    return x / nb.power(total * _c(x, alpha / size) + _c(x, bias), _c(x, beta))


@op("GlobalMaxPool")
def _global_max_pool(n, x):
    return nb.max(x, tuple(range(2, x.ndim)), keepdims=True)


@op("LayerNormalization", needs=("layer_norm",))
def _layer_norm(n, x, scale, bias=None):
    ax = _axis(n, n.attr("axis", -1), x.ndim)
    eps = n.attr("epsilon", 1e-5)
    trailing = x.shape[ax:]
    flat = x if len(trailing) == 1 else nb.reshape(x, x.shape[:ax] + (prod(trailing),))
    s = nb.reshape(nb.broadcast_to(scale, trailing), (prod(trailing),)) if len(trailing) != 1 else \
        nb.broadcast_to(scale, trailing)
    b = None
    if bias is not None:
        b = nb.reshape(nb.broadcast_to(bias, trailing), (prod(trailing),))
    y = nb.layer_norm(flat, s, b, axis=-1, eps=eps)
    y = nb.reshape(y, x.shape) if len(trailing) != 1 else y
    if not (n.wants(1) or n.wants(2)):
        return y
    axes = tuple(range(ax, x.ndim))
    xs, _ = _hi(x) if n.attr("stash_type", 1) == 1 else (x, x.dtype)
    mean, var = _moments(xs, axes)
    inv = 1.0 / nb.sqrt(var + eps)
    st = np.float32 if n.attr("stash_type", 1) == 1 else x.dtype
    return y, _cast(mean, st), _cast(inv, st)


def _check_batch_norm(n: Node) -> None:
    if n.attr("training_mode", 0) or any(n.wants(i) for i in range(1, 5)):
        raise n.fail("training-mode BatchNormalization (running statistics outputs) is not supported; "
                     "only inference")


@op("BatchNormalization", needs=("batch_norm",), check=_check_batch_norm)
def _batch_norm(n, x, scale, bias, mean, var):
    return nb.batch_norm(x, mean, var, scale, bias, eps=n.attr("epsilon", 1e-5))


def _window(n: Node, x: Tensor, kernel: Sequence[int], with_dilation: bool = True):
    """(strides, dilations, per-dim (before, after) pads) from the attributes, auto_pad included."""
    sp = x.ndim - 2
    strides = list(n.attr("strides", None) or [1] * sp)
    dil = list(n.attr("dilations", None) or [1] * sp)
    auto = n.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for i in range(sp):
            size = x.shape[2 + i]
            out = -(-size // strides[i])
            total = builtins.max((out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - size, 0)
            small = total // 2
            pads.append((small, total - small) if auto == "SAME_UPPER" else (total - small, small))
    elif auto == "VALID":
        pads = [(0, 0)] * sp
    else:
        p = list(n.attr("pads", None) or [0] * (2 * sp))
        pads = [(p[i], p[i + sp]) for i in range(sp)]
    return strides, dil, pads


def _ceil_pads(x: Tensor, kernel, strides, dil, pads) -> list[tuple[int, int]]:
    """ceil_mode as extra padding at the end: the last window starts inside the input or the left pad."""
    out = []
    for i, (lo, hi) in enumerate(pads):
        size = x.shape[2 + i]
        span = (kernel[i] - 1) * dil[i] + 1
        n_out = -(-(size + lo + hi - span) // strides[i]) + 1
        if (n_out - 1) * strides[i] >= size + lo:
            n_out -= 1
        extra = builtins.max((n_out - 1) * strides[i] + span - (size + lo + hi), 0)
        out.append((lo, hi + extra))
    return out


@op("Conv", needs=("conv",))
def _conv(n, x, w, b=None):
    kernel = list(n.attr("kernel_shape", None) or w.shape[2:])
    strides, dil, pads = _window(n, x, kernel)
    return nb.conv(x, w, bias=b, stride=tuple(strides), padding=tuple(pads), dilation=tuple(dil),
                   groups=n.attr("group", 1))


def conv_act(n: Node, x: Tensor, w: Tensor, b: Tensor | None, relu: bool) -> Tensor | None:
    """The Conv node with its bias (and a following Relu) as one op (``fuse.CONV_ACT``), or None when that
    does not apply: input channels sharded (their partial sums must be added before any bias or relu), or
    operands that are not a plain conv's."""
    from .fuse import conv_act as fused

    def whole_channels(t: Tensor) -> bool:
        sp = t.sharding
        return sp is None or (not sp.dim_specs[1].axes and not sp.partial_axes)

    if x.ndim < 3 or w.ndim != x.ndim or not whole_channels(x) or not whole_channels(w):
        return None
    if b is not None and (b.ndim != 1 or b.shape[0] != w.shape[0] or (b.sharding is not None and b.sharding.partial_axes)):
        return None
    kernel = list(n.attr("kernel_shape", None) or w.shape[2:])
    if list(kernel) != list(w.shape[2:]):
        return None
    strides, dil, pads = _window(n, x, kernel)
    return fused(x, w, b, tuple(strides), tuple(pads), tuple(dil), n.attr("group", 1), relu)


def _check_pool(n: Node) -> None:
    if n.op_type == "MaxPool" and n.wants(1):
        raise n.fail("the Indices output of MaxPool is not supported")


@op("MaxPool", needs=("max_pool",), check=_check_pool)
def _max_pool(n, x):
    kernel = list(n.attr("kernel_shape"))
    strides, dil, pads = _window(n, x, kernel)
    if n.attr("ceil_mode", 0):
        pads = _ceil_pads(x, kernel, strides, dil, pads)
    return nb.max_pool(x, tuple(kernel), stride=tuple(strides), padding=tuple(pads), dilation=tuple(dil))


@op("AveragePool", needs=("avg_pool",), check=_check_pool)
def _avg_pool(n, x):
    """With ceil_mode and count_include_pad, the explicit pads count but the extra end padding that
    emulates ceil_mode does not: rescale each window by (kernel size) / (its cells inside the pads)."""
    kernel = list(n.attr("kernel_shape"))
    strides, dil, pads = _window(n, x, kernel)
    include = bool(n.attr("count_include_pad", 0))
    wide = _ceil_pads(x, kernel, strides, dil, pads) if n.attr("ceil_mode", 0) else pads
    y = nb.avg_pool(x, tuple(kernel), stride=tuple(strides), padding=tuple(wide), count_include_pad=include,
                    dilation=tuple(dil))
    if not include or wide == pads:
        return y
    scale = np.ones((), np.float64)
    for i, ((lo, hi), (_, hi2)) in enumerate(zip(pads, wide)):
        end = x.shape[2 + i] + lo + hi  # the explicitly padded extent
        starts = np.arange(y.shape[2 + i]) * strides[i]
        inside = np.clip(-((starts - end) // dil[i]), 0, kernel[i])  # taps j with start + j*dilation < end
        shape = [1] * y.ndim
        shape[2 + i] = len(starts)
        scale = scale * (kernel[i] / inside).reshape(shape)
    return y * scale.astype(y.dtype)


@op("GlobalAveragePool", needs=("global_avg_pool",))
def _global_avg_pool(n, x):
    return nb.global_avg_pool(x)


def _lp(x: Tensor, p: int) -> Tensor:
    """``|x| ** p`` (p = 1 or 2 without a power)."""
    return nb.abs(x) if p == 1 else x * x if p == 2 else nb.power(nb.abs(x), _c(x, p))


def _root(s: Tensor, p: int) -> Tensor:
    return s if p == 1 else nb.sqrt(s) if p == 2 else nb.power(s, _c(s, 1.0 / p))


@op("LpNormalization")
def _lp_normalization(n, x):
    """``x / ||x||_p`` along ``axis`` (p 1 or 2); a zero norm gives 0. A sharded axis leaves partial sums,
    added (one all_reduce) before the root."""
    p = n.attr("p", 2)
    if p not in (1, 2):
        raise n.fail(f"p must be 1 or 2, got {p}")
    ax = _axis(n, n.attr("axis", -1), x.ndim)
    norm = _root(nb.sum(_lp(x, p), (ax,), keepdims=True), p)
    zero = nb.equal(norm, _c(norm, 0))
    return nb.where(zero, _c(x, 0), x / nb.where(zero, _c(norm, 1), norm))


@op("LpPool", needs=("avg_pool",), check=_check_pool)
def _lp_pool(n, x):
    """``(sum over each window of |x|^p) ** (1/p)``: an average pool of ``|x|^p`` counting the zero padding,
    times the window size (a sharded spatial dim exchanges halo rows, as the average pool does)."""
    p = n.attr("p", 2)
    kernel = list(n.attr("kernel_shape"))
    strides, dil, pads = _window(n, x, kernel)
    if n.attr("ceil_mode", 0):
        pads = _ceil_pads(x, kernel, strides, dil, pads)
    mean = nb.avg_pool(_lp(x, p), tuple(kernel), stride=tuple(strides), padding=tuple(pads),
                       count_include_pad=True, dilation=tuple(dil))
    return _root(mean * _c(mean, prod(kernel)), p)


@op("GlobalLpPool")
def _global_lp_pool(n, x):
    p = n.attr("p", 2)
    return _root(nb.sum(_lp(x, p), tuple(range(2, x.ndim)), keepdims=True), p)


def _upsample(x: Tensor, axis: int, stride: int) -> Tensor:
    """``stride - 1`` zeros between consecutive rows of dim ``axis``: rows ``(n - 1) * stride + 1``. Built as
    ``(n, stride)`` rows (the row, then zeros) merged into one dim and cut, so a sharded dim stays sharded."""
    if stride == 1 or x.shape[axis] == 0:
        return x
    shape = list(x.shape)
    shape[axis] = shape[axis] * (stride - 1)
    zeros = nb.tensor(np.zeros(x.shape[:axis + 1] + (stride - 1,) + x.shape[axis + 1:], x.dtype))
    pair = nb.concatenate([nb.expand_dims(x, axis + 1), zeros], axis + 1)  # (..., n, stride, ...)
    flat = nb.reshape(pair, x.shape[:axis] + (x.shape[axis] * stride,) + x.shape[axis + 1:])
    return _take(flat, axis, slice(0, (x.shape[axis] - 1) * stride + 1))


@op("ConvTranspose", needs=("conv",))
def _conv_transpose(n, x, w, b=None):
    """The transpose (gradient) of a conv, as a conv: the input's rows spread ``stride`` apart (zeros between),
    padded by ``(kernel - 1) * dilation`` less the pads, correlated with the kernel flipped and its channel
    dims swapped (per group). Batch and channels shard as for Conv, and a sharded spatial dim stays sharded:
    the spreading is a reshape of a sharded dim, the conv exchanges halo rows."""
    sp = x.ndim - 2
    if sp < 1 or w.ndim != x.ndim:
        raise n.fail(f"X must be (N, C, *spatial) and W (C, M/group, *kernel) of the same rank, got {x.shape}, "
                     f"{w.shape}")
    groups = n.attr("group", 1)
    kernel = list(n.attr("kernel_shape", None) or w.shape[2:])
    if list(kernel) != list(w.shape[2:]):
        raise n.fail(f"kernel_shape {kernel} does not match W's spatial dims {list(w.shape[2:])}")
    strides = list(n.attr("strides", None) or [1] * sp)
    dil = list(n.attr("dilations", None) or [1] * sp)
    out_pad = list(n.attr("output_padding", None) or [0] * sp)
    out_shape = list(n.attr("output_shape", None) or [])
    auto = n.attr("auto_pad", "NOTSET")
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dil)]
    full = [s * (size - 1) + op + k for s, size, op, k in zip(strides, x.shape[2:], out_pad, span)]
    if out_shape or auto in ("SAME_UPPER", "SAME_LOWER"):
        if len(out_shape) == sp + 2:
            out_shape = out_shape[2:]
        target = out_shape or [size * s for size, s in zip(x.shape[2:], strides)]
        if len(target) != sp:
            raise n.fail(f"output_shape must give {sp} spatial sizes, got {out_shape}")
        total = [f - t for f, t in zip(full, target)]
        upper = auto == "SAME_UPPER"
        pads = [(t // 2, t - t // 2) if upper else (t - t // 2, t // 2) for t in total]
    elif auto == "VALID":
        pads = [(0, 0)] * sp
    else:
        p = list(n.attr("pads", None) or [0] * (2 * sp))
        pads = [(p[i], p[i + sp]) for i in range(sp)]
    C, Mg = w.shape[0], w.shape[1]
    if x.shape[1] != C or C % groups:
        raise n.fail(f"X has {x.shape[1]} channels, W {C}; with group={groups} both must match and divide")
    # W (C, M/g, *k) -> (M, C/g, *k), flipped: per group, the channel dims swapped
    wg = nb.reshape(w, (groups, C // groups, Mg) + tuple(kernel))
    wg = nb.transpose(wg, (0, 2, 1) + tuple(range(3, 3 + sp)))
    wc = nb.reshape(wg, (groups * Mg, C // groups) + tuple(kernel))
    wc = wc[(slice(None), slice(None)) + (slice(None, None, -1),) * sp]
    u = x
    for i in range(sp):
        u = _upsample(u, 2 + i, strides[i])
    conv_pads, crop = [], []
    for i in range(sp):
        lo = span[i] - 1 - pads[i][0]
        hi = span[i] - 1 - pads[i][1] + out_pad[i]
        conv_pads.append((max(lo, 0), max(hi, 0)))
        crop.append((max(-lo, 0), max(-hi, 0)))
    y = nb.conv(u, wc, stride=1, padding=tuple(conv_pads), dilation=tuple(dil), groups=groups)
    for i, (a, c) in enumerate(crop):
        if a or c:
            y = _take(y, 2 + i, slice(a, y.shape[2 + i] - c))
    if b is not None:
        y = y + nb.reshape(b, (1, -1) + (1,) * sp)
    return y


# ---- op groups (the ONNX sharding formalism), for the checker and the report -------------------------------------------

UNARY = frozenset("""Abs Acos Acosh Asin Asinh Atan Atanh Cast Ceil Cos Cosh Dropout Erf Exp Floor Identity IsInf
IsNaN Log Neg Not Reciprocal Round Sigmoid Sign Sin Sinh Tan Tanh ConstantOfShape Relu Sqrt LeakyRelu Elu Selu
Celu ThresholdedRelu HardSigmoid HardSwish Softplus Softsign Mish Swish Gelu Shrink CastLike Clip""".split())
BROADCAST = frozenset("""Add And BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Equal Greater Less Mod Mul Or
Pow Sub Sum Where Xor Div GreaterOrEqual LessOrEqual Max Min Mean PRelu""".split())
REDUCTION = frozenset("""ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceSumSquare
ReduceLogSum ReduceLogSumExp ArgMax ArgMin""".split())
MATMUL = frozenset({"MatMul", "Gemm", "Einsum"})
WINDOWED = frozenset("""AveragePool GlobalAveragePool GlobalLpPool GlobalMaxPool LpPool MaxPool MaxRoiPool Conv
ConvInteger ConvTranspose DeformConv InstanceNormalization LpNormalization LayerNormalization BatchNormalization
LRN""".split())  # the ONNX formalism draft's pooling and convolution group, with the norms real models use

GROUPS = {"unary elementwise": UNARY, "broadcast n-ary": BROADCAST, "reduction": REDUCTION,
          "matmul/gemm/einsum": MATMUL, "conv/pool/norm": WINDOWED}


def group_of(op_type: str) -> str:
    """The op group (the ONNX sharding formalism's, and conv/pool/norm) of an ONNX op type; ``"other"`` for the rest."""
    for name, ops in GROUPS.items():
        if op_type in ops:
            return name
    return "other"
