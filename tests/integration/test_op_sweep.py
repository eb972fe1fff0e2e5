"""Every op of api.md x every sharding of its operands, on meshes (4,), (2,2), (2,3) with uneven and
empty shards, against numpy (the nabla analogue of DTensor's OpInfo sweep)."""

import itertools

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh
from nabla.testing import assert_sharded_allclose, elementwise_ops

MESHES = [DeviceMesh("m4", (4,), ("x",)), DeviceMesh("m22", (2, 2), ("x", "y")),
          DeviceMesh("m23", (2, 3), ("x", "y"), devices=[5, 3, 1, 4, 2, 0])]
SHAPE = (5, 3)  # 5 over 4 gives 2,2,1,0; 3 over 2 gives 2,1; 5 over 6 gives 1,1,1,1,1,0


def dim_specs(mesh, rank):
    """Every assignment of mesh axes to dims (each axis at most once, any order within a dim)."""
    axes = list(mesh.axis_names)
    per_dim = [None] + axes + [p for p in itertools.permutations(axes, 2)]
    out = []
    for combo in itertools.product(per_dim, repeat=rank):
        used = [a for c in combo if c for a in ((c,) if isinstance(c, str) else c)]
        if len(used) == len(set(used)):
            out.append(list(combo))
    return out


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


R = np.random.default_rng(7)
X = (R.standard_normal(SHAPE) + 0.1).astype(np.float32)
Y = (R.standard_normal(SHAPE) + 0.1).astype(np.float32)
POS = np.abs(X) + 0.5
I = R.integers(-5, 5, SHAPE).astype(np.int32)
IDS0 = np.array([[4, 0, -1], [2, 2, 3]])  # indices into the 5 rows (negative ones count from the end)
IDS1 = np.array([2, -3, 1, 1])  # ... into the 3 columns
ALONG = np.array([[2, 0], [1, 1], [0, 2], [2, 2], [-1, 0]])
TARGETS = np.array([0, 2, 1, 2, 0])

# name -> (nabla fn of the sharded operand t, numpy fn of its value v, input value)
UNARY = {
    "exp": (nb.exp, np.exp, X), "log": (nb.log, np.log, POS), "tanh": (nb.tanh, np.tanh, X),
    "sin": (nb.sin, np.sin, X), "cos": (nb.cos, np.cos, X), "sqrt": (nb.sqrt, np.sqrt, POS),
    "abs": (nb.abs, np.abs, X), "negative": (nb.negative, np.negative, X), "neg_op": (lambda t: -t, np.negative, X),
    "relu": (nb.relu, lambda v: np.maximum(v, 0), X), "sigmoid": (nb.sigmoid, lambda v: 1 / (1 + np.exp(-v)), X),
    "sum": (lambda t: t.sum(), np.sum, X), "sum0": (lambda t: nb.sum(t, 0), lambda v: v.sum(0), X),
    "sum1k": (lambda t: t.sum(1, keepdims=True), lambda v: v.sum(1, keepdims=True), X),
    "mean": (lambda t: t.mean(), np.mean, X), "mean0": (lambda t: nb.mean(t, 0), lambda v: v.mean(0), X),
    "max": (lambda t: t.max(), np.max, X), "max1": (lambda t: nb.max(t, 1), lambda v: v.max(1), X),
    "min0k": (lambda t: t.min(0, keepdims=True), lambda v: v.min(0, keepdims=True), X),
    "argmax": (lambda t: t.argmax(), np.argmax, X), "argmax0": (lambda t: nb.argmax(t, 0), lambda v: v.argmax(0), X),
    "argmax1": (lambda t: t.argmax(1), lambda v: v.argmax(1), X),
    "softmax1": (lambda t: nb.softmax(t, 1), lambda v: _softmax(v, 1), X),
    "softmax0": (lambda t: nb.softmax(t, 0), lambda v: _softmax(v, 0), X),
    "T": (lambda t: t.T, lambda v: v.T, X), "transpose": (lambda t: nb.transpose(t, (1, 0)), np.transpose, X),
    "swapaxes": (lambda t: nb.swapaxes(t, 0, 1), lambda v: np.swapaxes(v, 0, 1), X),
    "reshape15": (lambda t: t.reshape(15), lambda v: v.reshape(15), X),
    "reshape351": (lambda t: nb.reshape(t, (3, 5, 1)), lambda v: v.reshape(3, 5, 1), X),
    "broadcast_to": (lambda t: nb.broadcast_to(t, (2, 5, 3)), lambda v: np.broadcast_to(v, (2, 5, 3)), X),
    "expand_dims": (lambda t: nb.expand_dims(t, 1), lambda v: np.expand_dims(v, 1), X),
    "squeeze": (lambda t: nb.squeeze(nb.expand_dims(t, 0)), lambda v: v, X),
    "getitem": (lambda t: t[1:4, ::2], lambda v: v[1:4, ::2], X), "getitem_int": (lambda t: t[2], lambda v: v[2], X),
    "getitem_none": (lambda t: t[:, None, 1:], lambda v: v[:, None, 1:], X),
    "reverse": (lambda t: t[::-1, ::-1], lambda v: v[::-1, ::-1], X),
    "concatenate0": (lambda t: nb.concatenate([t, t], 0), lambda v: np.concatenate([v, v], 0), X),
    "concatenate1": (lambda t: nb.concatenate([t, t * 2], 1), lambda v: np.concatenate([v, v * 2], 1), X),
    "matmul": (lambda t: t @ Y.T, lambda v: v @ Y.T, X), "rmatmul": (lambda t: Y.T @ t, lambda v: Y.T @ v, X),
    "matmul_self": (lambda t: nb.matmul(t.T, t), lambda v: v.T @ v, X),
    "einsum": (lambda t: nb.einsum("ij,kj->ik", t, Y), lambda v: np.einsum("ij,kj->ik", v, Y), X),
    "einsum_ellipsis": (lambda t: nb.einsum("...j,kj", t, Y), lambda v: np.einsum("...j,kj", v, Y), X),
    "einsum_implicit": (lambda t: nb.einsum("ij,ik", t, t), lambda v: np.einsum("ij,ik", v, v), X),
    "pow_scalar": (lambda t: t ** 2, lambda v: v ** 2, X), "rpow": (lambda t: 2.0 ** t, lambda v: 2.0 ** v, X),
    "astype": (lambda t: t.astype("float64"), lambda v: v.astype(np.float64), X),
    "int_add": (lambda t: t + 3, lambda v: v + 3, I), "int_mul": (lambda t: t * t, lambda v: v * v, I),
    "int_sum": (lambda t: t.sum(0), lambda v: v.sum(0), I), "int_max": (lambda t: t.max(1), lambda v: v.max(1), I),
    "int_div": (lambda t: t / 2, lambda v: v / 2, I),
    # the ops of language models
    "gelu": (nb.gelu, lambda v: v * (0.5 * (1 + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (v + np.float32(0.044715) *
                                                                                         v ** 3)))), X),
    "silu": (nb.silu, lambda v: v / (1 + np.exp(-v)), X), "isnan": (nb.isnan, np.isnan, X),
    "isfinite": (nb.isfinite, np.isfinite, X), "tril": (lambda t: nb.tril(t, 1), lambda v: np.tril(v, 1), X),
    "triu": (lambda t: nb.triu(t, -1), lambda v: np.triu(v, -1), X),
    "var0": (lambda t: nb.var(t, 0), lambda v: v.var(0), X), "std1": (lambda t: t.std(1, ddof=1), lambda v: v.std(1, ddof=1), X),
    "argmin0": (lambda t: nb.argmin(t, 0), lambda v: v.argmin(0), X), "argmin": (lambda t: t.argmin(), np.argmin, X),
    "prod1": (lambda t: nb.prod(t, 1), lambda v: v.prod(1), X), "prod0": (lambda t: t.prod(0), lambda v: v.prod(0), X),
    "any0": (lambda t: nb.any(t > 1, 0), lambda v: (v > 1).any(0), X), "all1": (lambda t: nb.all(t > -1, 1), lambda v: (v > -1).all(1), X),
    "cumsum0": (lambda t: nb.cumsum(t, 0), lambda v: v.cumsum(0), X), "cumsum1": (lambda t: t.cumsum(1), lambda v: v.cumsum(1), X),
    "cumsum_int": (lambda t: nb.cumsum(t, 0), lambda v: v.cumsum(0), I),
    "sort0": (lambda t: nb.sort(t, 0), lambda v: np.sort(v, 0), X), "argsort1": (nb.argsort, np.argsort, X),
    "top_k": (lambda t: nb.top_k(t, 2)[1], lambda v: np.argsort(-v, 1, kind="stable")[:, :2], X),
    "top_k_T": (lambda t: nb.top_k(t.T, 3)[0], lambda v: -np.sort(-v.T, 1)[:, :3], X),
    "flip": (lambda t: nb.flip(t, 0), lambda v: np.flip(v, 0), X), "roll": (lambda t: nb.roll(t, (2, -1), (0, 1)),
                                                                      lambda v: np.roll(v, (2, -1), (0, 1)), X),
    "pad": (lambda t: nb.pad(t, ((1, 2), (0, 3))), lambda v: np.pad(v, ((1, 2), (0, 3))), X),
    "split_stack": (lambda t: nb.stack(nb.split(t, [1, 3], 0)[1:], 2), lambda v: np.stack(np.split(v, [1, 3], 0)[1:], 2), X),
    "dropout": (lambda t: nb.dropout(t, 0.5, 3), lambda v: nb.dropout(nb.tensor(v), 0.5, 3).numpy(), X),
    "take0": (lambda t: nb.take(t, IDS0, 0), lambda v: np.take(v, IDS0, 0), X),
    "take1": (lambda t: nb.take(t, IDS1, 1), lambda v: np.take(v, IDS1, 1), X),
    "getitem_ids": (lambda t: t[1:, IDS1], lambda v: v[1:, IDS1], X),
    "take_along_axis1": (lambda t: nb.take_along_axis(t, ALONG, 1), lambda v: np.take_along_axis(v, ALONG, 1), X),
    "log_softmax1": (lambda t: nb.log_softmax(t, 1), lambda v: v - np.log(np.exp(v).sum(1, keepdims=True)), X),
    "log_softmax0": (lambda t: nb.log_softmax(t, 0), lambda v: v - np.log(np.exp(v).sum(0, keepdims=True)), X),
    "logsumexp": (lambda t: nb.logsumexp(t), lambda v: np.log(np.exp(v).sum()), X),
    "logsumexp1": (lambda t: nb.logsumexp(t, 1), lambda v: np.log(np.exp(v).sum(1)), X),
    "stop_gradient": (nb.stop_gradient, lambda v: v, X),
    "one_hot": (lambda t: nb.one_hot(t, 4), lambda v: (v[..., None] == np.arange(4)).astype(np.float32), I),
    "cross_entropy": (lambda t: nb.cross_entropy(t, TARGETS),
                      lambda v: (np.log(np.exp(v).sum(1)) - v[np.arange(5), TARGETS]).mean(), X),
}
BINARY = {
    "add": (nb.add, np.add), "subtract": (nb.subtract, np.subtract), "multiply": (nb.multiply, np.multiply),
    "divide": (nb.divide, np.divide), "maximum": (nb.maximum, np.maximum), "minimum": (nb.minimum, np.minimum),
    "power": (lambda a, b: nb.power(nb.abs(a), b), lambda a, b: np.power(np.abs(a), b)),
    "less": (lambda a, b: a < b, np.less), "less_equal": (lambda a, b: a <= b, np.less_equal),
    "greater": (lambda a, b: a > b, np.greater), "greater_equal": (lambda a, b: a >= b, np.greater_equal),
    "equal": (lambda a, b: a == b, np.equal), "not_equal": (lambda a, b: a != b, np.not_equal),
    "where": (lambda a, b: nb.where(a > b, a, b), lambda a, b: np.where(a > b, a, b)),
    "matmul_T": (lambda a, b: a @ b.T, lambda a, b: a @ b.T),
}


def check(got, want, what):
    try:
        assert_sharded_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_ops_on_every_sharding(mesh, name):
    fn, ref, value = UNARY[name]
    want = ref(value)
    for spec in dim_specs(mesh, 2):
        t = nb.tensor(value).shard(mesh, spec)
        check(fn(t), want, f"{name} on {value.shape} sharded {spec} over {mesh!r}")


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_ops_on_every_pair_of_shardings(mesh, name):
    fn, ref = BINARY[name]
    want = ref(X, Y)
    specs = dim_specs(mesh, 2)
    for sa, sb in itertools.product(specs, specs[::2]):
        a, b = nb.tensor(X).shard(mesh, sa), nb.tensor(Y).shard(mesh, sb)
        check(fn(a, b), want, f"{name} on {X.shape} sharded {sa} and {sb} over {mesh!r}")
    for sa in specs:  # with host operands on either side
        a = nb.tensor(X).shard(mesh, sa)
        check(fn(a, Y), want, f"{name}(sharded {sa}, host) over {mesh!r}")
        check(fn(nb.tensor(Y), a), ref(Y, X), f"{name}(host, sharded {sa}) over {mesh!r}")


def _in_domain(op, *values):
    return [v if op.domain is None else np.clip(v, *op.domain).astype(v.dtype) for v in values]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
@pytest.mark.parametrize("op", elementwise_ops(1) + elementwise_ops(2), ids=lambda op: op.name)
def test_every_registered_elementwise_op_on_every_sharding(mesh, op):
    """The registry's ops with a numpy reference, read from it (an op registered with ``elementwise(...)`` is swept
    with no edit here): each operand on every sharding (a binary op's second on one of them in turn, or the host)."""
    args = _in_domain(op, X, Y)[:op.arity]
    with np.errstate(all="ignore"):
        want = op.reference(*args)
    specs = dim_specs(mesh, 2)
    for i, sa in enumerate(specs):
        a = nb.tensor(args[0]).shard(mesh, sa)
        if op.arity == 1:
            check(op.public(a), want, f"{op.name} on {X.shape} sharded {sa} over {mesh!r}")
            continue
        sb = specs[-1 - i]
        check(op.public(a, nb.tensor(args[1]).shard(mesh, sb)), want,
              f"{op.name} on {X.shape} sharded {sa} and {sb} over {mesh!r}")
        check(op.public(a, args[1]), want, f"{op.name}(sharded {sa}, host) over {mesh!r}")


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
def test_partial_inputs_through_every_linear_and_nonlinear_op(mesh):
    axis = mesh.axis_names[-1]
    for spec in dim_specs(mesh, 2):
        if any(axis in ((s,) if isinstance(s, str) else (s or ())) for s in spec):
            continue
        p = nb.tensor(X).shard(mesh, spec, partial_axes=[axis])
        for name in ("exp", "sum0", "T", "reshape15", "matmul", "max1", "getitem", "concatenate1", "neg_op", "take0",
                     "take1", "take_along_axis1", "getitem_ids", "stop_gradient", "log_softmax1", "cross_entropy", "tril",
                     "cumsum1", "roll", "pad", "flip", "dropout"):
            fn, ref, _ = UNARY[name]
            check(fn(p), ref(X), f"{name} of partial[{axis}] sharded {spec} over {mesh!r}")
        check(p + Y, X + Y, f"partial + host over {mesh!r} {spec}")
        check(p * 3.0, X * 3.0, f"partial * scalar over {mesh!r} {spec}")
        check(p - p, X - X, f"partial - partial over {mesh!r} {spec}")
        check(p * p, X * X, f"partial * partial over {mesh!r} {spec}")
        check(p / 2.0, X / 2.0, f"partial / scalar over {mesh!r} {spec}")
