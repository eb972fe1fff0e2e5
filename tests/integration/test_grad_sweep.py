"""Gradients of every op on every sharding against jax.grad (float64), on meshes with uneven and empty
shards: the value, the gradient's shape and dtype, and its layout (the primal's dim specs, nothing pending)."""

import itertools

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh
from nabla.testing import assert_sharded_allclose

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

MESHES = [DeviceMesh("m4", (4,), ("x",)), DeviceMesh("m23", (2, 3), ("x", "y"), devices=[5, 3, 1, 4, 2, 0])]
SHAPE = (5, 3)
R = np.random.default_rng(11)
X = R.standard_normal(SHAPE) + 0.1
Y = R.standard_normal(SHAPE) + 0.1
POS = np.abs(X) + 0.5


def dim_specs(mesh, rank):
    axes = list(mesh.axis_names)
    per_dim = [None] + axes + [p for p in itertools.permutations(axes, 2)]
    out = []
    for combo in itertools.product(per_dim, repeat=rank):
        used = [a for c in combo if c for a in ((c,) if isinstance(c, str) else c)]
        if len(used) == len(set(used)):
            out.append(list(combo))
    return out


def weights(shape, seed=3):
    """Fixed random output weights, so every output element gets its own cotangent."""
    return np.random.default_rng(seed).standard_normal(shape)


# name -> (nabla fn, jax fn, input); the scalar loss is sum(out * W) for a fixed W of out's shape
UNARY = {
    "exp": (nb.exp, jnp.exp, X), "log": (nb.log, jnp.log, POS), "tanh": (nb.tanh, jnp.tanh, X),
    "sin": (nb.sin, jnp.sin, X), "cos": (nb.cos, jnp.cos, X), "sqrt": (nb.sqrt, jnp.sqrt, POS),
    "abs": (nb.abs, jnp.abs, X), "neg": (lambda t: -t, jnp.negative, X), "relu": (nb.relu, jax.nn.relu, X),
    "sigmoid": (nb.sigmoid, jax.nn.sigmoid, X), "square": (lambda t: t ** 2, lambda v: v ** 2, X),
    "rpow": (lambda t: 2.0 ** t, lambda v: 2.0 ** v, X), "scale": (lambda t: 3.0 * t - 1.0, lambda v: 3.0 * v - 1.0, X),
    "div_scalar": (lambda t: 1.0 / t, lambda v: 1.0 / v, POS),
    "sum": (lambda t: t.sum(), jnp.sum, X), "sum0": (lambda t: nb.sum(t, 0), lambda v: v.sum(0), X),
    "sum1k": (lambda t: t.sum(1, keepdims=True), lambda v: v.sum(1, keepdims=True), X),
    "mean": (lambda t: t.mean(), jnp.mean, X), "mean0": (lambda t: nb.mean(t, 0), lambda v: v.mean(0), X),
    "max": (lambda t: t.max(), jnp.max, X), "max1": (lambda t: nb.max(t, 1), lambda v: v.max(1), X),
    "min0k": (lambda t: t.min(0, keepdims=True), lambda v: v.min(0, keepdims=True), X),
    "softmax1": (lambda t: nb.softmax(t, 1), lambda v: jax.nn.softmax(v, 1), X),
    "softmax0": (lambda t: nb.softmax(t, 0), lambda v: jax.nn.softmax(v, 0), X),
    "T": (lambda t: t.T, lambda v: v.T, X), "swapaxes": (lambda t: nb.swapaxes(t, 0, 1), lambda v: v.swapaxes(0, 1), X),
    "reshape15": (lambda t: t.reshape(15), lambda v: v.reshape(15), X),
    "reshape351": (lambda t: t.reshape(3, 5, 1), lambda v: v.reshape(3, 5, 1), X),
    "broadcast_to": (lambda t: nb.broadcast_to(t, (2, 5, 3)), lambda v: jnp.broadcast_to(v, (2, 5, 3)), X),
    "expand_squeeze": (lambda t: nb.squeeze(nb.expand_dims(t, 0)), lambda v: v, X),
    "getitem": (lambda t: t[1:4, ::2], lambda v: v[1:4, ::2], X), "getitem_int": (lambda t: t[2], lambda v: v[2], X),
    "getitem_none": (lambda t: t[:, None, 1:], lambda v: v[:, None, 1:], X),
    "getitem_back": (lambda t: t[4:0:-2], lambda v: v[4:0:-2], X),
    "reverse": (lambda t: t[::-1, ::-1], lambda v: v[::-1, ::-1], X),
    "concat0": (lambda t: nb.concatenate([t, t * 2.0], 0), lambda v: jnp.concatenate([v, v * 2.0], 0), X),
    "concat1": (lambda t: nb.concatenate([t, t[:, :1]], 1), lambda v: jnp.concatenate([v, v[:, :1]], 1), X),
    "matmul": (lambda t: t @ Y.T, lambda v: v @ Y.T, X), "rmatmul": (lambda t: Y.T @ t, lambda v: Y.T @ v, X),
    "gram": (lambda t: nb.matmul(t.T, t), lambda v: v.T @ v, X),
    "einsum": (lambda t: nb.einsum("ij,kj->ik", t, Y), lambda v: jnp.einsum("ij,kj->ik", v, Y), X),
    "einsum_lonely": (lambda t: nb.einsum("ij->", t), lambda v: jnp.einsum("ij->", v), X),
    "einsum_self": (lambda t: nb.einsum("ij,ik", t, t), lambda v: jnp.einsum("ij,ik", v, v), X),
    "astype": (lambda t: t.astype("float32").astype("float64"), lambda v: v.astype(jnp.float32).astype(jnp.float64), X),
    "where": (lambda t: nb.where(t > 0.2, t * t, -t), lambda v: jnp.where(v > 0.2, v * v, -v), X),
    "maximum": (lambda t: nb.maximum(t, Y), lambda v: jnp.maximum(v, Y), X),
    "minimum": (lambda t: nb.minimum(Y, t), lambda v: jnp.minimum(Y, v), X),
    "argmax_free": (lambda t: t * nb.argmax(t, 1).astype("float64").reshape(5, 1),
                    lambda v: v * jnp.argmax(v, 1).astype(jnp.float64).reshape(5, 1), X),
    "layer_norm": (lambda t: nb.layer_norm(t), lambda v: (v - v.mean(-1, keepdims=True)) / jnp.sqrt(
        v.var(-1, keepdims=True) + 1e-5), X),
}


def loss_pair(fn, jfn, shape_out):
    w = weights(shape_out)
    return (lambda t: (fn(t) * w).sum()), (lambda v: (jfn(v) * w).sum())


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_grad_on_every_sharding_equals_jax(mesh, name):
    fn, jfn, value = UNARY[name]
    out_shape = np.shape(jfn(value))
    f, jf = loss_pair(fn, jfn, out_shape)
    want = np.asarray(jax.grad(jf)(value))
    for spec in dim_specs(mesh, 2):
        t = nb.tensor(value).shard(mesh, spec)
        g = nb.grad(f)(t)
        what = f"d {name} on {value.shape} sharded {spec} over {mesh!r}"
        assert g.shape == value.shape and g.dtype == value.dtype, what
        assert g.sharding.layout() == t.sharding.layout(), f"{what}: gradient laid out {g.sharding}"
        try:
            assert_sharded_allclose(g, want, rtol=1e-9, atol=1e-9)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None


BINARY = {
    "add": (nb.add, jnp.add), "subtract": (nb.subtract, jnp.subtract), "multiply": (nb.multiply, jnp.multiply),
    "divide": (lambda a, b: a / (b * b + 1.0), lambda a, b: a / (b * b + 1.0)),
    "power": (lambda a, b: nb.power(nb.abs(a) + 0.5, b), lambda a, b: jnp.power(jnp.abs(a) + 0.5, b)),
    "maximum": (nb.maximum, jnp.maximum), "matmul_T": (lambda a, b: a @ b.T, lambda a, b: a @ b.T),
    "broadcast_row": (lambda a, b: a * b[:1], lambda a, b: a * b[:1]),
}


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_grads_of_both_operands_on_pairs_of_shardings(mesh, name):
    fn, jfn = BINARY[name]
    w = weights(np.shape(jfn(X, Y)))
    want = [np.asarray(g) for g in jax.grad(lambda a, b: (jfn(a, b) * w).sum(), argnums=(0, 1))(X, Y)]
    specs = dim_specs(mesh, 2)
    for sa, sb in list(itertools.product(specs, specs))[::3]:
        a, b = nb.tensor(X).shard(mesh, sa), nb.tensor(Y).shard(mesh, sb)
        ga, gb = nb.grad(lambda p, q: (fn(p, q) * w).sum(), argnums=(0, 1))(a, b)
        assert ga.sharding.layout() == a.sharding.layout() and gb.sharding.layout() == b.sharding.layout()
        assert_sharded_allclose(ga, want[0], rtol=1e-9, atol=1e-9)
        assert_sharded_allclose(gb, want[1], rtol=1e-9, atol=1e-9)


def test_partial_inputs_get_gradients_too():
    """A primal held as partial sums: its gradient has its dims and no pending sum."""
    mesh = MESHES[1]
    p = nb.tensor(X).shard(mesh, ["x", None], partial_axes=["y"])
    g = nb.grad(lambda t: (nb.exp(t) * weights(SHAPE)).sum())(p)
    want = np.asarray(jax.grad(lambda v: (jnp.exp(v) * weights(SHAPE)).sum())(X))
    assert g.sharding.partial_axes == () and g.sharding.dim_specs[0].axes == ("x",)
    assert_sharded_allclose(g, want, rtol=1e-9, atol=1e-9)


WINDOW = [  # conv / pools with spatial, channel and batch shardings
    ("conv", lambda t, w: nb.conv(t, w, stride=(2, 1), padding=((1, 1), (0, 1)), dilation=(1, 2)),
     lambda v, w: jax.lax.conv_general_dilated(v, w, (2, 1), [(1, 1), (0, 1)], rhs_dilation=(1, 2))),
    ("conv_groups", lambda t, w: nb.conv(t, w[:, :2], padding=1, groups=2),
     lambda v, w: jax.lax.conv_general_dilated(v, w[:, :2], (1, 1), [(1, 1), (1, 1)], feature_group_count=2)),
    ("max_pool", lambda t, w: nb.max_pool(t, 3, 2, 1),
     lambda v, w: jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2),
                                        [(0, 0), (0, 0), (1, 1), (1, 1)])),
    ("avg_pool", lambda t, w: nb.avg_pool(t, 2, 1, 1, count_include_pad=False),
     lambda v, w: jax.lax.reduce_window(v, 0.0, jax.lax.add, (1, 1, 2, 2), (1, 1, 1, 1),
                                        [(0, 0), (0, 0), (1, 1), (1, 1)]) /
     jax.lax.reduce_window(jnp.ones_like(v), 0.0, jax.lax.add, (1, 1, 2, 2), (1, 1, 1, 1),
                           [(0, 0), (0, 0), (1, 1), (1, 1)])),
]


@pytest.mark.parametrize("name,fn,jfn", WINDOW, ids=[w[0] for w in WINDOW])
def test_windowed_op_gradients_equal_jax(name, fn, jfn):
    mesh = DeviceMesh("m22", (2, 2), ("x", "y"))
    x = R.standard_normal((2, 4, 9, 7))
    w = R.standard_normal((4, 4, 3, 2))
    out = jfn(x, w)
    wt = weights(out.shape)
    gx_want, gw_want = (np.asarray(g) for g in jax.grad(lambda a, b: (jfn(a, b) * wt).sum(), (0, 1))(x, w))
    for spec in ([None, None, "x", None], ["x", None, "y", None], [None, "x", None, "y"], ["y", None, None, "x"]):
        t = nb.tensor(x).shard(mesh, spec)
        u = nb.tensor(w).shard(mesh, [None] * 4)
        gx, gw = nb.grad(lambda a, b: (fn(a, b) * wt).sum(), (0, 1))(t, u)
        assert gx.sharding.layout() == t.sharding.layout()
        assert_sharded_allclose(gx, gx_want, rtol=1e-9, atol=1e-9)
        if name.startswith("conv"):
            assert_sharded_allclose(gw, gw_want, rtol=1e-9, atol=1e-9)


# ---- finite differences, where jax.grad has no twin ---------------------------------------------------------


def _central_differences(f, x, eps=1e-6):
    """df/dx by central differences in float64, for ``f`` taking a batch (m, *x.shape) to m scalars: every
    element perturbed both ways in one batch."""
    n = x.size
    basis = np.eye(n).reshape((n,) + x.shape) * eps
    vals = np.asarray(f(np.concatenate([x + basis, x - basis]))).reshape(2, n)
    return ((vals[0] - vals[1]) / (2 * eps)).reshape(x.shape)


def _reduce_window(v, kind, kernel, stride, pads, dilation, include=True):
    """jax's forward of a dilated pool (its VJP is what jax lacks for max): window sums or maxima."""
    k, s, d = (1, 1) + kernel, (1, 1) + stride, (1, 1) + dilation
    p = [(0, 0), (0, 0)] + list(pads)
    if kind == "max":
        return jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, k, s, p, window_dilation=d)
    total = jax.lax.reduce_window(v, 0.0, jax.lax.add, k, s, p, window_dilation=d)
    one = jnp.ones_like(v[:1])  # the divisor does not depend on the batch (computed once: XLA folds it)
    ones = one if not include else jnp.pad(one, p, constant_values=1.0)
    count = jax.lax.reduce_window(ones, 0.0, jax.lax.add, k, s, p if not include else [(0, 0)] * 4,
                                  window_dilation=d)
    return total / count


DILATED = [  # (name, kind, kernel, stride, padding, dilation, count_include_pad)
    ("max_dil", "max", (3, 2), (2, 1), ((1, 2), (1, 1)), (2, 3), True),
    ("max_dil_stride", "max", (2, 2), (1, 2), ((0, 1), (2, 0)), (3, 2), True),
    ("avg_dil", "avg", (3, 2), (2, 1), ((1, 2), (1, 1)), (2, 3), True),
    ("avg_dil_nopad", "avg", (2, 3), (1, 1), ((1, 1), (2, 1)), (2, 2), False),
]


@pytest.mark.parametrize("name,kind,kernel,stride,pads,dilation,include", DILATED, ids=[d[0] for d in DILATED])
def test_dilated_pool_gradients_equal_central_differences(name, kind, kernel, stride, pads, dilation, include):
    """jax.grad of a max reduce_window with window dilation raises NotImplementedError, so nabla's gradient is
    checked against central differences of jax's forward (float64) on sharded batch, channel and spatial dims."""
    mesh = DeviceMesh("m22", (2, 2), ("x", "y"))
    x = np.random.default_rng(21).standard_normal((2, 2, 9, 8))
    out_shape = _reduce_window(x, kind, kernel, stride, pads, dilation, include).shape
    wt = weights(out_shape)

    @jax.jit
    def losses(batch):  # (m, *x.shape) -> m values of sum(pool(x) * wt)
        out = _reduce_window(batch.reshape((-1,) + x.shape[1:]), kind, kernel, stride, pads, dilation, include)
        return (out.reshape((batch.shape[0],) + out_shape) * wt).reshape(batch.shape[0], -1).sum(-1)

    want = _central_differences(losses, x)
    if kind == "max":
        with pytest.raises(NotImplementedError):
            jax.grad(lambda v: (_reduce_window(v, kind, kernel, stride, pads, dilation) * wt).sum())(x)
    else:  # jax differentiates a dilated window sum: the two references agree
        np.testing.assert_allclose(
            jax.jit(jax.grad(lambda v: (_reduce_window(v, kind, kernel, stride, pads, dilation, include) * wt).sum()))(
                x), want, rtol=1e-6, atol=1e-7)
    pool = (lambda t: nb.max_pool(t, kernel, stride, pads, dilation)) if kind == "max" else \
        (lambda t: nb.avg_pool(t, kernel, stride, pads, include, dilation))
    for spec in ([None, None, "x", "y"], ["x", "y", None, None], [None, "x", "y", None], ["y", None, None, "x"]):
        t = nb.tensor(x).shard(mesh, spec)
        g = nb.grad(lambda a: (pool(a) * wt).sum())(t)
        assert g.sharding.layout() == t.sharding.layout()
        assert_sharded_allclose(g, want, rtol=1e-6, atol=1e-7)
