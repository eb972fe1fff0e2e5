"""Gradients of every op on every sharding against jax.grad (float64), on the op sweep's meshes (4,), (2,2) and
(2,3) with uneven and empty shards, primals held as partial sums included: the value, the gradient's shape and
dtype, and its layout (the primal's dim specs, nothing pending).

Unary ops run on every placement. Of the pairs of placements of binary ops, and of the (x, w) placements of
convolutions and normalizations, CI runs a deterministic part (a different part per op, so that every case is
covered by some op); ``NABLA_FULL_SWEEP=1`` or ``HYPOTHESIS_PROFILE=thorough`` runs them all."""

import itertools
import os
import zlib

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh
from nabla.testing import assert_sharded_allclose

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

MESHES = [DeviceMesh("m4", (4,), ("x",)), DeviceMesh("m22", (2, 2), ("x", "y")),
          DeviceMesh("m23", (2, 3), ("x", "y"), devices=[5, 3, 1, 4, 2, 0])]
FULL = os.environ.get("NABLA_FULL_SWEEP") == "1" or os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
SHAPE = (5, 3)
R = np.random.default_rng(11)
X = R.standard_normal(SHAPE) + 0.1
Y = R.standard_normal(SHAPE) + 0.1
POS = np.abs(X) + 0.5
Z3 = R.standard_normal((5, 2, 3))
IDS0 = np.array([[4, 0, -1], [2, 2, 3]])  # indices into the 5 rows (repeated ones: their gradients add up)
IDS1 = np.array([2, -3, 1, 1])  # ... into the 3 columns
ALONG = np.array([[2, 0], [1, 1], [0, 2], [2, 2], [-1, 0]])
TARGETS = np.array([0, 2, 1, 2, 0])


def dim_specs(mesh, rank):
    axes = list(mesh.axis_names)
    per_dim = [None] + axes + [p for p in itertools.permutations(axes, 2)]
    out = []
    for combo in itertools.product(per_dim, repeat=rank):
        used = [a for c in combo if c for a in ((c,) if isinstance(c, str) else c)]
        if len(used) == len(set(used)):
            out.append(list(combo))
    return out


def placements(mesh, rank):
    """Every dim-spec assignment, and each again held as partial sums over each axis it leaves free (and over
    all of them): ``(dim specs, partial axes)``."""
    out = []
    for spec in dim_specs(mesh, rank):
        used = {a for c in spec if c for a in ((c,) if isinstance(c, str) else c)}
        free = [a for a in mesh.axis_names if a not in used]
        out.append((spec, ()))
        out += [(spec, (a,)) for a in free]
        if len(free) > 1:
            out.append((spec, tuple(free)))
    return out


def subsample(cases, key, mesh=None):
    """All of ``cases`` under FULL or on a one-axis mesh; otherwise every other one, from an offset that depends on
    ``key`` (so that across ops every case runs)."""
    if FULL or (mesh is not None and mesh.ndim == 1):
        return list(cases)
    return list(cases)[zlib.crc32(key.encode()) % 2::2]


def check_layout(g, t, what):
    """A gradient has its primal's dim specs and no pending sums."""
    assert g.sharding.partial_axes == (), f"{what}: gradient left partial {g.sharding}"
    assert [d.axes for d in g.sharding.dim_specs] == [d.axes for d in t.sharding.dim_specs], \
        f"{what}: gradient laid out {g.sharding}"


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
    "transpose_axes": (lambda t: nb.transpose(nb.broadcast_to(t[:, None, :], (5, 2, 3)) * Z3, (2, 0, 1)),
                       lambda v: jnp.transpose(jnp.broadcast_to(v[:, None, :], (5, 2, 3)) * Z3, (2, 0, 1)), X),
    "einsum_ellipsis": (lambda t: nb.einsum("...j,kj->...k", t, Y[:2]), lambda v: jnp.einsum("...j,kj->...k", v, Y[:2]),
                        X),
    "einsum_ellipsis_mid": (lambda t: nb.einsum("i...,i->...", t * Z3[:, 0, :], Y[:, 0]),
                            lambda v: jnp.einsum("i...,i->...", v * Z3[:, 0, :], Y[:, 0]), X),
    "take0": (lambda t: nb.take(t, IDS0, 0), lambda v: jnp.take(v, IDS0, 0), X),
    "take1": (lambda t: nb.take(t, IDS1, 1), lambda v: jnp.take(v, IDS1, 1), X),
    "getitem_ids": (lambda t: t[1:, IDS1], lambda v: v[1:, IDS1], X),
    "take_along_axis1": (lambda t: nb.take_along_axis(t, ALONG, 1), lambda v: jnp.take_along_axis(v, ALONG, 1), X),
    "log_softmax1": (lambda t: nb.log_softmax(t, 1), lambda v: jax.nn.log_softmax(v, 1), X),
    "log_softmax0": (lambda t: nb.log_softmax(t, 0), lambda v: jax.nn.log_softmax(v, 0), X),
    "logsumexp": (lambda t: nb.logsumexp(t), lambda v: jax.nn.logsumexp(v), X),
    "logsumexp1": (lambda t: nb.logsumexp(t, 1), lambda v: jax.nn.logsumexp(v, 1), X),
    "stop_gradient": (lambda t: t * nb.stop_gradient(t), lambda v: v * jax.lax.stop_gradient(v), X),
    "cross_entropy": (lambda t: nb.cross_entropy(t, TARGETS), lambda v: (
        jax.nn.logsumexp(v, 1) - jnp.take_along_axis(v, TARGETS[:, None], 1)[:, 0]).mean(), X),
    # the ops of language models
    "gelu": (nb.gelu, jax.nn.gelu, X), "gelu_exact": (lambda t: nb.gelu(t, False), lambda v: jax.nn.gelu(v, False), X),
    "silu": (nb.silu, jax.nn.silu, X), "tril": (lambda t: nb.tril(t, 1), lambda v: jnp.tril(v, 1), X),
    "triu": (lambda t: nb.triu(t), jnp.triu, X), "var0": (lambda t: nb.var(t, 0), lambda v: jnp.var(v, 0), X),
    "std1": (lambda t: nb.std(t, 1, ddof=1), lambda v: jnp.std(v, 1, ddof=1), X),
    "prod1": (lambda t: nb.prod(t, 1), lambda v: jnp.prod(v, 1), X),
    "cumsum0": (lambda t: nb.cumsum(t, 0), lambda v: jnp.cumsum(v, 0), X),
    "cumsum1": (lambda t: nb.cumsum(t, 1), lambda v: jnp.cumsum(v, 1), X),
    "sort0": (lambda t: nb.sort(t, 0), lambda v: jnp.sort(v, 0), X),
    "top_k": (lambda t: nb.top_k(t, 2)[0], lambda v: jax.lax.top_k(v, 2)[0], X),
    "flip": (lambda t: nb.flip(t, 0), lambda v: jnp.flip(v, 0), X),
    "roll": (lambda t: nb.roll(t, (2, -1), (0, 1)), lambda v: jnp.roll(v, (2, -1), (0, 1)), X),
    "pad": (lambda t: nb.pad(t, ((1, 2), (0, 3))), lambda v: jnp.pad(v, ((1, 2), (0, 3))), X),
    "split_stack": (lambda t: nb.stack(nb.split(t, [1, 3], 0)[1:], 2), lambda v: jnp.stack(jnp.split(v, [1, 3], 0)[1:], 2),
                    X),
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
    for spec, partial in placements(mesh, 2):
        t = nb.tensor(value).shard(mesh, spec, partial_axes=partial)
        g = nb.grad(f)(t)
        what = f"d {name} on {value.shape} sharded {spec} (partial over {partial}) over {mesh!r}"
        assert g.shape == value.shape and g.dtype == value.dtype, what
        check_layout(g, t, what)
        try:
            assert_sharded_allclose(g, want, rtol=1e-9, atol=1e-9)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None


@pytest.mark.parametrize("name", sorted(UNARY))
def test_second_order_on_shardings_equals_jax(name):
    """Every op's VJP differentiates again: a Hessian-vector product (grad of <grad, v>) against jax on (2, 2)."""
    fn, jfn, value = UNARY[name]
    mesh = MESHES[1]
    w = weights(np.shape(jfn(value)))
    v = weights(value.shape, seed=8)
    want = np.asarray(jax.grad(lambda a: (jax.grad(lambda u: (jfn(u) * w).sum())(a) * v).sum())(value))
    cases = subsample(placements(mesh, 2), f"hvp {name}")
    for spec, partial in cases if FULL else cases[::3]:
        t = nb.tensor(value).shard(mesh, spec, partial_axes=partial)
        g = nb.grad(lambda a: (nb.grad(lambda u: (fn(u) * w).sum())(a) * v).sum())(t)
        check_layout(g, t, f"hvp of {name} on {spec} partial {partial}")
        assert_sharded_allclose(g, want, rtol=1e-9, atol=1e-9)


BINARY = {
    "add": (nb.add, jnp.add), "subtract": (nb.subtract, jnp.subtract), "multiply": (nb.multiply, jnp.multiply),
    "divide": (lambda a, b: a / (b * b + 1.0), lambda a, b: a / (b * b + 1.0)),
    "power": (lambda a, b: nb.power(nb.abs(a) + 0.5, b), lambda a, b: jnp.power(jnp.abs(a) + 0.5, b)),
    "maximum": (nb.maximum, jnp.maximum), "matmul_T": (lambda a, b: a @ b.T, lambda a, b: a @ b.T),
    "broadcast_row": (lambda a, b: a * b[:1], lambda a, b: a * b[:1]),
    "minimum": (nb.minimum, jnp.minimum),
    "where": (lambda a, b: nb.where(a > b, a * b, b - a), lambda a, b: jnp.where(a > b, a * b, b - a)),
    "einsum_ellipsis": (lambda a, b: nb.einsum("...i,...i->...", a, b), lambda a, b: jnp.einsum("...i,...i->...", a, b)),
}


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_grads_of_both_operands_on_pairs_of_shardings(mesh, name):
    fn, jfn = BINARY[name]
    w = weights(np.shape(jfn(X, Y)))
    want = [np.asarray(g) for g in jax.grad(lambda a, b: (jfn(a, b) * w).sum(), argnums=(0, 1))(X, Y)]
    specs = placements(mesh, 2)
    pairs = list(itertools.product(specs, specs))
    step = 1 if FULL else max(1, len(pairs) // 24)  # pairs grow as the square of the placements: a stride
    for (sa, pa), (sb, pb) in pairs[zlib.crc32(name.encode()) % step::step]:
        a, b = nb.tensor(X).shard(mesh, sa, partial_axes=pa), nb.tensor(Y).shard(mesh, sb, partial_axes=pb)
        ga, gb = nb.grad(lambda p, q: (fn(p, q) * w).sum(), argnums=(0, 1))(a, b)
        what = f"d {name} of ({sa} partial {pa}, {sb} partial {pb}) over {mesh!r}"
        check_layout(ga, a, what)
        check_layout(gb, b, what)
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


def _jconv(v, w, stride=(1, 1), pads=((0, 0), (0, 0)), dilation=(1, 1), groups=1, bias=None):
    out = jax.lax.conv_general_dilated(v, w, stride, list(pads), rhs_dilation=dilation, feature_group_count=groups)
    return out if bias is None else out + bias[None, :, None, None]


def _jpool(v, kind, kernel, stride, pads, include=True):
    k, s, p = (1, 1) + kernel, (1, 1) + stride, [(0, 0), (0, 0)] + list(pads)
    if kind == "max":
        return jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, k, s, p)
    total = jax.lax.reduce_window(v, 0.0, jax.lax.add, k, s, p)
    if include:
        return total / np.prod(kernel)
    return total / jax.lax.reduce_window(jnp.ones_like(v), 0.0, jax.lax.add, k, s, p)


WINDOW = [  # conv / pools with spatial, channel and batch shardings: (name, nabla, jax), all of (x, w, bias)
    ("conv", lambda t, w, b: nb.conv(t, w, stride=(2, 1), padding=((1, 1), (0, 1)), dilation=(1, 2)),
     lambda v, w, b: _jconv(v, w, (2, 1), [(1, 1), (0, 1)], (1, 2))),
    ("conv_bias", lambda t, w, b: nb.conv(t, w, b, padding=1), lambda v, w, b: _jconv(v, w, pads=[(1, 1)] * 2, bias=b)),
    ("conv_groups", lambda t, w, b: nb.conv(t, w[:, :2], padding=1, groups=2),
     lambda v, w, b: _jconv(v, w[:, :2], pads=[(1, 1), (1, 1)], groups=2)),
    ("max_pool", lambda t, w, b: nb.max_pool(t, 3, 2, 1), lambda v, w, b: _jpool(v, "max", (3, 3), (2, 2), [(1, 1)] * 2)),
    ("avg_pool", lambda t, w, b: nb.avg_pool(t, 2, 1, 1, count_include_pad=False),
     lambda v, w, b: _jpool(v, "avg", (2, 2), (1, 1), [(1, 1)] * 2, False)),
    ("avg_pool_include_pad", lambda t, w, b: nb.avg_pool(t, (3, 2), (2, 1), ((1, 2), (0, 1)), count_include_pad=True),
     lambda v, w, b: _jpool(v, "avg", (3, 2), (2, 1), [(1, 2), (0, 1)], True)),
    ("global_avg_pool", lambda t, w, b: nb.global_avg_pool(t), lambda v, w, b: v.mean((2, 3), keepdims=True)),
]
# x (N, C, H, W) and w (O, I, kh, kw) placements; for convolutions w is also sharded on O and I, and the bias on O
X_SPECS = ([None, None, "x", None], ["x", None, "y", None], [None, "x", None, "y"], ["y", None, None, "x"])
W_SPECS = ([None] * 4, ["x", None, None, None], [None, "y", None, None], ["y", "x", None, None])


@pytest.mark.parametrize("mesh", MESHES[1:], ids=lambda m: m.name)
@pytest.mark.parametrize("name,fn,jfn", WINDOW, ids=[w[0] for w in WINDOW])
def test_windowed_op_gradients_equal_jax(mesh, name, fn, jfn):
    x = R.standard_normal((2, 4, 9, 7))
    w = R.standard_normal((4, 4, 3, 2))
    bias = R.standard_normal(4)
    out = jfn(x, w, bias)
    wt = weights(out.shape)
    want = [np.asarray(g) for g in jax.grad(lambda a, b, c: (jfn(a, b, c) * wt).sum(), (0, 1, 2))(x, w, bias)]
    conv = name.startswith("conv")
    cases = list(itertools.product(X_SPECS, W_SPECS if conv else W_SPECS[:1]))
    for xs, ws in subsample(cases, f"{name} {mesh.name}") if conv else cases:
        t = nb.tensor(x).shard(mesh, xs)
        u = nb.tensor(w).shard(mesh, ws)
        c = nb.tensor(bias).shard(mesh, ws[:1])
        gx, gw, gb = nb.grad(lambda a, b, c: (fn(a, b, c) * wt).sum(), (0, 1, 2))(t, u, c)
        what = f"d {name} with x {xs}, w {ws} over {mesh!r}"
        for g, primal, ref in zip((gx, gw, gb), (t, u, c), want):
            check_layout(g, primal, what)
            try:
                assert_sharded_allclose(g, ref, rtol=1e-9, atol=1e-9)
            except AssertionError as e:
                raise AssertionError(f"{what}: {e}") from None


def _jbatch_norm(x, mean, var, scale, bias, eps=1e-5):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / jnp.sqrt(var.reshape(shape) + eps) * scale.reshape(shape) + bias.reshape(shape)


def _jlayer_norm(x, scale, bias, axes, eps=1e-5):
    mu = x.mean(axes, keepdims=True)
    return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(axes, keepdims=True) + eps) * scale + bias


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
def test_normalization_gradients_of_every_input_equal_jax(mesh):
    """batch_norm with respect to all five inputs, layer_norm with respect to x, scale and bias over a tuple of
    axes; channels, batch and normalised dims sharded, parameters sharded like their dims."""
    r = np.random.default_rng(17)
    x = r.standard_normal((4, 6, 5, 3))
    mean, var = r.standard_normal(6), np.abs(r.standard_normal(6)) + 0.5
    scale, bias = r.standard_normal(6), r.standard_normal(6)
    wt = weights(x.shape)
    want = [np.asarray(g) for g in jax.grad(lambda *a: (_jbatch_norm(*a) * wt).sum(), tuple(range(5)))(
        x, mean, var, scale, bias)]
    a0, a1 = mesh.axis_names[0], mesh.axis_names[-1]
    for xs in subsample(([None] * 4, [None, a0, None, None], [a0, a1 if a1 != a0 else None, None, None],
                         [None, a1, a0 if a0 != a1 else None, None]), f"bn {mesh.name}", mesh):
        ts = [nb.tensor(x).shard(mesh, xs)] + [nb.tensor(v).shard(mesh, [xs[1]]) for v in (mean, var, scale, bias)]
        grads = nb.grad(lambda *a: (nb.batch_norm(*a) * wt).sum(), tuple(range(5)))(*ts)
        for g, t, ref in zip(grads, ts, want):
            check_layout(g, t, f"d batch_norm with x {xs} over {mesh!r}")
            assert_sharded_allclose(g, ref, rtol=1e-9, atol=1e-9)
    s2, b2 = r.standard_normal((5, 3)), r.standard_normal((5, 3))
    want = [np.asarray(g) for g in jax.grad(lambda a, b, c: (_jlayer_norm(a, b, c, (2, 3)) * wt).sum(), (0, 1, 2))(
        x, s2, b2)]
    for xs in subsample(([None] * 4, [a0, None, a1 if a1 != a0 else None, None], [None, None, a0, None],
                         [None, a0, None, a1 if a1 != a0 else None]), f"ln {mesh.name}", mesh):
        ts = [nb.tensor(x).shard(mesh, xs), nb.tensor(s2).shard(mesh, xs[2:]), nb.tensor(b2).shard(mesh, xs[2:])]
        grads = nb.grad(lambda a, b, c: (nb.layer_norm(a, b, c, axis=(-2, -1)) * wt).sum(), (0, 1, 2))(*ts)
        for g, t, ref in zip(grads, ts, want):
            check_layout(g, t, f"d layer_norm with x {xs} over {mesh!r}")
            assert_sharded_allclose(g, ref, rtol=1e-9, atol=1e-9)


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
