"""Every op x mesh x spec x dtype against numpy, by hypothesis: bool, int8, uint8, int32, int64, float16, float32,
float64 and complex64; values that break careless code (NaN, +-inf, -0.0, the dtype's extremes); 0-d and zero-size
tensors; partial inputs, either the whole value on one device of each group (``shard(partial_axes=...)``) or
random summands on every device (``from_local``), whose sum is the value. Each result must be numpy's: shape,
dtype, NaN positions, infinities, signs of zeros, values (to a rounding tolerance where summation order differs),
and every device's block; where numpy raises, nabla raises a ShardingError or numpy's error class.

The CI profile runs a few dozen derandomized examples per property; ``HYPOTHESIS_PROFILE=thorough`` runs 10,000.
"""

from __future__ import annotations

import operator

import numpy as np
from hypothesis import given, strategies as st

import nabla as nb
from nabla.layout import dim_position
from nabla.testing import assert_matches_numpy, meshes, shapes, special_values, specs

DTYPES = ["bool", "int8", "uint8", "int32", "int64", "float16", "float32", "float64", "complex64"]
RTOL = {"float16": 4e-3, "float32": 2e-5, "float64": 1e-12, "complex64": 2e-5, "complex128": 1e-12}
SCALARS = [0, 2, -1, 300, 2**40, 0.5, 0.0, -0.0, 3.0, -2.5, np.inf, -np.inf, np.nan, 1e300, 1e-300, True, False,
           1 + 2j, np.float16(2), np.int8(-3), np.uint8(200), np.float32(-0.0), np.float64(0.25)]


# ---- operands ---------------------------------------------------------------------------------------------


@st.composite
def operands(draw, mesh, dtype, shape, extreme=True, nonfinite=True):
    """``(tensor, value)``: a value placed with a random spec. With partial axes, the value is either on the first
    device of each group, or made of random summands on every device (moderate values: no overflow, so any
    order of summation gives one sum), folded from -0.0 in device order to give the value."""
    spec = draw(specs(mesh, shape))
    if not spec.partial_axes or not draw(st.booleans()):
        v = draw(special_values(dtype, shape, extreme, nonfinite))
        return nb.tensor(v).shard(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes), v
    groups = 1
    for r in spec.partial_refs:
        groups *= r.size
    summands = [draw(special_values(dtype, shape, False, nonfinite)) for _ in range(groups)]
    blocks = {}
    for d in mesh.devices:
        c = dim_position(spec.partial_refs, mesh, mesh.coords(d))
        blocks[d] = summands[c][spec.shard_slices(shape, d)]
    t = nb.from_local(blocks, mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes, shape=shape)
    with np.errstate(all="ignore"):
        v = summands[0]
        for s in summands[1:]:
            v = v + s
    return t, np.asarray(v, dtype=np.dtype(dtype))


def check(got_fn, want_fn, rtol_of=None, signed_zeros=True):
    """Run numpy's and nabla's version; both raise (nabla a ShardingError or numpy's class) or both agree."""
    with np.errstate(all="ignore"):
        try:
            want = np.asarray(want_fn())
            werr = None
        except Exception as e:  # noqa: BLE001 - compared with nabla's below
            want, werr = None, e
        try:
            got = got_fn()
            gerr = None
        except Exception as e:  # noqa: BLE001
            got, gerr = None, e
    if werr is not None:
        assert gerr is not None, f"numpy raises {type(werr).__name__}: {werr}; nabla gives {got!r}"
        assert isinstance(gerr, (nb.ShardingError, type(werr))), \
            f"numpy raises {type(werr).__name__}: {werr}; nabla raises {type(gerr).__name__}: {gerr}"
        return
    if gerr is not None:
        raise AssertionError(f"nabla raises {type(gerr).__name__}: {gerr}; numpy gives {want!r}") from gerr
    rtol = 0.0 if rtol_of is None else RTOL.get(want.dtype.name, 0.0) * rtol_of
    with np.errstate(all="ignore"):
        assert_matches_numpy(got, want, rtol=rtol, atol=rtol * 64, signed_zeros=signed_zeros)


def _exact_zero_signs(*operands) -> bool:
    """Whether the signs of zeros are promised: not through a pending sum (a negated or scaled sum of summands
    that cancel exactly is +0.0 where numpy's negated sum is -0.0; see nabla's executor)."""
    return not any(isinstance(t, nb.Tensor) and t.sharding is not None and t.sharding.partial_axes for t in operands)


def _broadcastable(draw, shape):
    """A shape that broadcasts with ``shape``: trailing dims kept or set to 1, some leading dims dropped."""
    out = [n if draw(st.booleans()) else 1 for n in shape]
    return tuple(out[draw(st.integers(0, len(out))):])


# ---- elementwise ------------------------------------------------------------------------------------------


def _relu(x):
    return np.maximum(x, x.dtype.type(0))


def _float(x):
    """numpy's float functions compute integers and bools in float64."""
    return x if x.dtype.kind in "fc" else x.astype(np.float64)


def _sigmoid(x):
    one = x.dtype.type(1) if x.dtype.kind == "f" else 1.0
    return one / (one + np.exp(-x))


UNARY = {"negative": (nb.negative, np.negative), "neg_op": (operator.neg, operator.neg), "abs": (nb.abs, np.abs),
         "exp": (nb.exp, np.exp), "log": (nb.log, np.log), "sqrt": (nb.sqrt, np.sqrt), "tanh": (nb.tanh, np.tanh),
         "sin": (nb.sin, np.sin), "cos": (nb.cos, np.cos), "relu": (nb.relu, _relu),
         "sigmoid": (nb.sigmoid, _sigmoid), "gelu": (nb.gelu, nb.ops.lookup("gelu").reference),
         "silu": (nb.silu, lambda x: _float(x) * _sigmoid(_float(x))), "isnan": (nb.isnan, np.isnan),
         "isfinite": (nb.isfinite, np.isfinite)}
BINARY = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul, "divide": operator.truediv,
          "power": operator.pow, "maximum": (nb.maximum, np.maximum), "minimum": (nb.minimum, np.minimum),
          "less": operator.lt, "less_equal": operator.le, "greater": operator.gt, "greater_equal": operator.ge,
          "equal": operator.eq, "not_equal": operator.ne}
SCALAR_OPS = {"+": lambda x, c: x + c, "-": lambda x, c: x - c, "*": lambda x, c: x * c, "/": lambda x, c: x / c,
              "**": lambda x, c: x ** c, "r-": lambda x, c: c - x, "r/": lambda x, c: c / x, "r*": lambda x, c: c * x}


@given(st.data())
def test_elementwise_ops_equal_numpy(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes(max_rank=3, max_dim=5))
    x, v = draw(operands(mesh, dtype, shape))
    kind = draw(st.sampled_from(["unary", "binary", "scalar", "where"]))
    if kind == "unary":
        name = draw(st.sampled_from(sorted(UNARY)))
        f, g = UNARY[name]
        check(lambda: f(x), lambda: g(v), rtol_of=1, signed_zeros=_exact_zero_signs(x))
    elif kind == "scalar":
        c = draw(st.sampled_from(SCALARS))
        f = SCALAR_OPS[draw(st.sampled_from(sorted(SCALAR_OPS)))]
        check(lambda: f(x, c), lambda: f(v, c), rtol_of=1, signed_zeros=_exact_zero_signs(x))
    else:
        oshape = _broadcastable(draw, shape) if draw(st.booleans()) else shape
        if draw(st.booleans()):
            shape, oshape = oshape, shape
            x, v = draw(operands(mesh, dtype, shape))
        odtype = dtype if draw(st.booleans()) else draw(st.sampled_from(DTYPES))
        y, w = draw(operands(mesh, odtype, oshape))
        if kind == "where":
            cshape = _broadcastable(draw, shape)
            c, cv = draw(operands(mesh, "bool", cshape))
            check(lambda: nb.where(c, x, y), lambda: np.where(cv, v, w))
            return
        name = draw(st.sampled_from(sorted(BINARY)))
        f = BINARY[name]
        fn, gn = f if isinstance(f, tuple) else (f, f)
        host = draw(st.sampled_from(["sharded", "host_right", "host_left"]))
        if host == "host_right":
            check(lambda: fn(x, w), lambda: gn(v, w), rtol_of=1, signed_zeros=_exact_zero_signs(x))
        elif host == "host_left":
            check(lambda: fn(v, y), lambda: gn(v, w), rtol_of=1, signed_zeros=_exact_zero_signs(y))
        else:
            check(lambda: fn(x, y), lambda: gn(v, w), rtol_of=1, signed_zeros=_exact_zero_signs(x, y))


# ---- reductions -------------------------------------------------------------------------------------------


def _softmax(v, axis):
    v - v  # noqa: B018 - bool: numpy's formula raises TypeError (bool subtract), and so does nabla
    if v.size == 0:  # nabla's softmax of an empty tensor is empty (no max to subtract)
        return np.exp(v)
    e = np.exp(v - v.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _exp_dtype(v):
    return v.dtype if v.dtype.kind in "fc" else np.exp(np.zeros((), v.dtype)).dtype


def _logsumexp(v, axis, keepdims):
    """jax.scipy.special.logsumexp's formula in numpy (the max shifts nothing where it is not finite)."""
    v = v.astype(_exp_dtype(v))
    axes = tuple(range(v.ndim)) if axis is None else (axis,) if isinstance(axis, int) else axis
    if any(v.shape[a] == 0 for a in axes):
        return np.full(np.sum(v, axis=axis, keepdims=keepdims).shape, -np.inf, v.dtype)
    m = np.max(v, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, v.dtype.type(0))
    out = np.log(np.sum(np.exp(v - m), axis=axis, keepdims=True)) + m
    return out if keepdims else out.reshape(np.sum(v, axis=axis).shape)


def _log_softmax(v, axis):
    v = v.astype(_exp_dtype(v))
    if v.size == 0:
        return v
    s = v - v.max(axis=axis, keepdims=True)
    return s - np.log(np.sum(np.exp(s), axis=axis, keepdims=True))


@given(st.data())
def test_reductions_equal_numpy(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes(max_rank=3, max_dim=5))
    op = draw(st.sampled_from(["sum", "mean", "max", "min", "argmax", "softmax", "logsumexp", "log_softmax", "var",
                               "std", "prod", "any", "all", "argmin", "cumsum"]))
    if op in ("logsumexp", "log_softmax") and dtype == "complex64":
        dtype = "float32"  # (jax's complex logsumexp takes its max over the real parts; numpy's max differs)
    x, v = draw(operands(mesh, dtype, shape, extreme=op in ("max", "min", "argmax", "argmin", "any", "all")))
    r = len(shape)
    axis = draw(st.sampled_from([None] + list(range(-r, r)) + ([tuple(range(r))[::2]] if r > 1 else [])))
    keep = draw(st.booleans())
    if op in ("argmax", "argmin", "cumsum"):
        axis = axis if not isinstance(axis, tuple) else None
        check(lambda: getattr(nb, op)(x, axis) if draw(st.booleans()) else getattr(x, op)(axis),
              lambda: getattr(np, op)(v, axis), rtol_of=4)
    elif op in ("var", "std"):
        check(lambda: getattr(nb, op)(x, axis, keepdims=keep), lambda: getattr(np, op)(v, axis, keepdims=keep),
              rtol_of=8, signed_zeros=False)
    elif op in ("prod", "any", "all"):
        if op == "prod" and not isinstance(axis, int) and np.dtype(dtype).kind in "fc":
            axis = -1 if r else None  # (a float product of many values overflows, and then its order decides
            # whether a zero meets an infinity: one axis of at most 5 values stays finite)
        check(lambda: getattr(nb, op)(x, axis, keepdims=keep), lambda: getattr(np, op)(v, axis, keepdims=keep),
              rtol_of=8, signed_zeros=False)
    elif op == "softmax":
        ax = -1 if axis is None or isinstance(axis, tuple) else axis
        check(lambda: nb.softmax(x, ax), lambda: _softmax(v, ax), rtol_of=4)
    elif op == "logsumexp":
        check(lambda: nb.logsumexp(x, axis, keep), lambda: _logsumexp(v, axis, keep), rtol_of=8, signed_zeros=False)
    elif op == "log_softmax":
        ax = -1 if axis is None or isinstance(axis, tuple) else axis
        check(lambda: nb.log_softmax(x, ax), lambda: _log_softmax(v, ax), rtol_of=8, signed_zeros=False)
    else:
        # max/min of +0.0 and -0.0 may be either (IEEE leaves it open; numpy's own pick follows its SIMD reduction
        # order: np.min([0., -0.]) is -0.0, np.min([-0., 0.]) is 0.0), so their zero signs are not compared
        method = draw(st.booleans())
        check(lambda: getattr(x, op)(axis, keepdims=keep) if method else getattr(nb, op)(x, axis, keep),
              lambda: getattr(np, op)(v, axis=axis, keepdims=keep), rtol_of=4,
              signed_zeros=op in ("sum", "mean") and _exact_zero_signs(x))


# ---- contractions -----------------------------------------------------------------------------------------
# Complex contractions meet no infinities or NaN here, and the signs of their zeros are not compared: numpy's own
# result depends on its code path, i.e. on the operands' shapes (BLAS's cdotu gives nan+infj where its loop gives
# -inf+infj for (0+infj)(1+1j); ones((4,2)) @ [[0,0],[0,-0]] gives -0 in complex64, ones((1,2)) @ it +0), so no
# sharding, whose blocks have other shapes, could match it.

EINSUMS = [("ij,jk->ik", 2, 2), ("ij,ij->i", 2, 2), ("i,i->", 1, 1), ("ij->ji", 2, None), ("...j,j->...", 2, 1),
           ("ij,kj", 2, 2), ("bij,bjk->bik", 3, 3), ("ij,j->ij", 2, 1)]


@given(st.data())
def test_contractions_equal_numpy(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    dtype = draw(st.sampled_from(DTYPES))
    odtype = dtype if draw(st.booleans()) else draw(st.sampled_from(DTYPES))
    n, k, m, b = (draw(st.integers(0, 5)) for _ in range(4))
    if draw(st.booleans()):
        sa = draw(st.sampled_from([(n,), (m, n), (b, m, n)]))
        sb = draw(st.sampled_from([(n,), (n, k), (b, n, k)]))
        fin = "c" not in (np.dtype(dtype).kind, np.dtype(odtype).kind)
        x, v = draw(operands(mesh, dtype, sa, extreme=False, nonfinite=fin))
        y, w = draw(operands(mesh, odtype, sb, extreme=False, nonfinite=fin))
        host = draw(st.sampled_from([0, 1, 2]))
        check(lambda: (x if host != 1 else v) @ (y if host != 2 else w), lambda: v @ w, rtol_of=4,
              signed_zeros=fin and _exact_zero_signs(x, y))
        return
    sub, ra, rb = draw(st.sampled_from(EINSUMS))
    letters = {"i": n, "j": k, "k": m, "b": b}
    terms = sub.split("->")[0].split(",")
    sa = tuple(letters.get(c, 2) for c in terms[0].replace("...", "b"))
    fin = "c" not in (np.dtype(dtype).kind, np.dtype(odtype).kind)
    x, v = draw(operands(mesh, dtype, sa, extreme=False, nonfinite=fin))
    if rb is None:
        check(lambda: nb.einsum(sub, x), lambda: np.einsum(sub, v), rtol_of=4,
              signed_zeros=fin and _exact_zero_signs(x))
        return
    sb = tuple(letters.get(c, 2) for c in terms[1])
    y, w = draw(operands(mesh, odtype, sb, extreme=False, nonfinite=fin))
    check(lambda: nb.einsum(sub, x, y), lambda: np.einsum(sub, v, w), rtol_of=4,
          signed_zeros=fin and _exact_zero_signs(x, y))


# ---- shapes, indexing, placement ------------------------------------------------------------------------


@st.composite
def _index(draw, shape):
    key = []
    for n in shape:
        c = draw(st.sampled_from(["all", "slice", "int"] if n else ["all", "slice"]))
        if c == "all":
            key.append(slice(None))
        elif c == "int":
            key.append(draw(st.integers(-n, n - 1)))
        else:
            lo, hi = draw(st.integers(-n - 1, n + 1)), draw(st.integers(-n - 1, n + 1))
            step = draw(st.sampled_from([1, 1, 2, 3, -1, -2]))
            key.append(slice(lo, hi, step))
    if draw(st.booleans()) and key:
        key.insert(draw(st.integers(0, len(key))), None)
    return tuple(key)


@given(st.data())
def test_shape_ops_and_placement_equal_numpy(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes(max_rank=3, max_dim=5))
    x, v = draw(operands(mesh, dtype, shape))
    r = len(shape)
    op = draw(st.sampled_from(["reshape", "transpose", "T", "swapaxes", "expand_dims", "squeeze", "broadcast_to",
                               "getitem", "concatenate", "with_sharding", "astype", "take", "take_along_axis", "flip",
                               "roll", "pad", "split", "stack", "tril", "sort", "argsort"]))
    if op == "reshape":
        size = int(np.prod(shape))
        target = draw(st.sampled_from([(size,), (-1,), (1, size), (size, 1)] + ([()] if size == 1 else []) +
                                      ([(2, size // 2), (size // 2, -1)] if size % 2 == 0 and size else [])))
        check(lambda: x.reshape(target), lambda: v.reshape(target))
    elif op == "transpose":
        perm = tuple(draw(st.permutations(range(r))))
        check(lambda: nb.transpose(x, perm), lambda: np.transpose(v, perm))
    elif op == "T":
        check(lambda: x.T, lambda: v.T)
    elif op == "swapaxes" and r:
        a, b = draw(st.integers(-r, r - 1)), draw(st.integers(-r, r - 1))
        check(lambda: nb.swapaxes(x, a, b), lambda: np.swapaxes(v, a, b))
    elif op == "expand_dims":
        a = draw(st.integers(-r - 1, r))
        check(lambda: nb.expand_dims(x, a), lambda: np.expand_dims(v, a))
    elif op == "squeeze":
        ones = tuple(i for i, n in enumerate(shape) if n == 1)
        axis = draw(st.sampled_from([None] + [a for a in ones]))
        check(lambda: nb.squeeze(x, axis), lambda: np.squeeze(v, axis))
    elif op == "broadcast_to":
        target = (draw(st.integers(0, 3)),) + tuple(n if draw(st.booleans()) else n for n in shape)
        check(lambda: nb.broadcast_to(x, target), lambda: np.broadcast_to(v, target))
    elif op == "getitem":
        key = draw(_index(shape))
        check(lambda: x[key], lambda: v[key])
    elif op == "concatenate" and r:
        axis = draw(st.integers(-r, r - 1))
        other = list(shape)
        other[axis] = draw(st.integers(0, 5))
        odtype = dtype if draw(st.booleans()) else draw(st.sampled_from(DTYPES))
        y, w = draw(operands(mesh, odtype, tuple(other)))
        check(lambda: nb.concatenate([x, y], axis), lambda: np.concatenate([v, w], axis))
    elif op == "with_sharding":
        spec = draw(specs(mesh, shape))
        keep = [a for a in spec.partial_axes if a in x.sharding.partial_axes]
        check(lambda: x.with_sharding(mesh, spec.dim_specs, partial_axes=keep), lambda: v)
    elif op == "astype":
        to = draw(st.sampled_from(DTYPES))
        check(lambda: x.astype(to), lambda: v.astype(to))
    elif op in ("take", "take_along_axis") and r:
        axis = draw(st.integers(-r, r - 1))
        n = shape[axis]
        ishape = draw(shapes(max_rank=2, max_dim=4)) if op == "take" else \
            tuple(draw(st.integers(0, 3)) if d == axis % r else m for d, m in enumerate(shape))
        ids = np.random.default_rng(draw(st.integers(0, 99))).integers(-n - 1, n + 1, ishape)  # some out of range
        i, _ = draw(operands(mesh, "int64", ishape)) if draw(st.booleans()) else (ids, None)
        ids = np.asarray(i.numpy() if isinstance(i, nb.Tensor) else i)
        f = getattr(nb, op)
        check(lambda: f(x, i, axis), lambda: getattr(np, op)(v, ids, axis))
    elif op in ("flip", "sort", "argsort") and r:
        a = draw(st.integers(-r, r - 1))
        kw = {"kind": "stable"} if op != "flip" else {}
        check(lambda: getattr(nb, op)(x, a), lambda: getattr(np, op)(v, a, **kw))
    elif op == "roll" and r:
        shift, a = draw(st.integers(-7, 7)), draw(st.sampled_from([None] + list(range(r))))
        check(lambda: nb.roll(x, shift, a), lambda: np.roll(v, shift, a))
    elif op == "pad":
        widths = [(draw(st.integers(0, 3)), draw(st.integers(0, 3))) for _ in range(r)]
        check(lambda: nb.pad(x, widths), lambda: np.pad(v, widths))
    elif op == "split" and r:
        a = draw(st.integers(-r, r - 1))
        cuts = sorted(draw(st.lists(st.integers(0, 6), max_size=3)))
        check(lambda: nb.stack(nb.split(x, cuts, a)[-1:]), lambda: np.stack(np.split(v, cuts, a)[-1:]))
    elif op == "stack":
        a = draw(st.integers(-r - 1, r))
        check(lambda: nb.stack([x, x], a), lambda: np.stack([v, v], a))
    elif op == "tril" and r >= 2:
        k = draw(st.integers(-3, 3))
        check(lambda: nb.tril(x, k), lambda: np.tril(v, k))
