"""nb.import_jax: each supported JAX primitive run as nabla ops equals JAX's own evaluation (``jax.jit`` of the same
function on the same values), on inputs sharded as hypothesis draws them, and so do the gradients a ``jax.grad``
program holds; labels, errors, the cache and PRNG bits."""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytestmark = pytest.mark.usefixtures("jax_x32")  # these programs are written for 32-bit jax
import jax.numpy as jnp  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import nabla as nb  # noqa: E402
from nabla.pytree import flatten  # noqa: E402
from nabla.testing import examples, specs  # noqa: E402

MESH = nb.DeviceMesh("m", (2, 4), ("x", "y"))
RNG = np.random.default_rng(0)


def f32(*shape, lo=-2.0, hi=2.0):
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def pos(*shape):
    return RNG.uniform(0.5, 3.0, shape).astype(np.float32)


def i32(*shape, lo=-20, hi=20):
    return RNG.integers(lo, hi, shape).astype(np.int32)


def nonzero(a):
    return np.where(a == 0, 3, a).astype(a.dtype)


def u32(*shape):
    return RNG.integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32)


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


def _window(x, op, window, strides, padding, **kw):
    """``lax.reduce_window`` with ``op``'s identity as its initial value (JAX maps it to reduce_window_max/_min/_sum)."""
    init = {jax.lax.max: -jnp.inf, jax.lax.min: jnp.inf, jax.lax.add: 0.0}[op]
    return jax.lax.reduce_window(x, init, op, window, strides, padding, **kw)


@jax.custom_jvp
def _softplus(x):
    return jnp.log1p(jnp.exp(x))


_softplus.defjvp(lambda p, t: (_softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))


def _scan_cumsum(x):
    def body(c, row):
        c = c * 0.5 + jnp.tanh(row)
        return c, c * 2.0
    return jax.lax.scan(body, jnp.zeros(x.shape[1:], x.dtype), x)


def _fori(x):
    return jax.lax.fori_loop(0, 3, lambda i, c: c * 1.5 + jnp.sin(c) * i, x)


def _while(x, n):
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 1.1 + 1.0), (0, x))[1]


def _cond(x, p):
    return jax.lax.cond(p > 0, lambda a: a * 2.0, lambda a: jnp.exp(a), x)


def _switch(x, i):
    return jax.lax.switch(i, [lambda a: a + 1.0, lambda a: a * a, lambda a: -a], x)


# name -> (function, arguments, argnums to differentiate or None). Each exercises one primitive or a few.
CASES = {
    "add_sub_mul_div": (lambda a, b: (a + b, a - b, a * b, a / b), (f32(4, 8), pos(4, 8)), (0, 1)),
    "max_min_pow": (lambda a, b: (jnp.maximum(a, b), jnp.minimum(a, b), b ** a), (f32(4, 8), pos(4, 8)), (0, 1)),
    "unary_math": (lambda a: (jnp.exp(a), jnp.tanh(a), jnp.sin(a), jnp.cos(a), jnp.abs(a), jnp.sign(a), -a,
                              jnp.square(a), a ** 3, a ** -2, jnp.floor(a), jnp.ceil(a), jnp.round(a)),
                   (f32(8, 4),), (0,)),
    "positive_math": (lambda a: (jnp.log(a), jnp.sqrt(a), jax.lax.rsqrt(a), jnp.log1p(a), jnp.expm1(a),
                                 jnp.cbrt(a), jnp.tan(a * 0.3), jnp.arctan(a), jnp.arcsin(a * 0.2),
                                 jnp.arccos(a * 0.2), jnp.sinh(a), jnp.cosh(a), jnp.exp2(a),
                                 jnp.arctan2(a, a - 1.5), jnp.arcsinh(a - 1.5), jnp.arccosh(a + 1.0),
                                 jnp.arctanh(a * 0.3)), (pos(4, 8),), (0,)),
    "erf_logistic": (lambda a: (jax.scipy.special.erf(a), jax.nn.sigmoid(a), jax.lax.erf_inv(jnp.tanh(a) * 0.9),
                                jax.scipy.special.erfc(a), jax.nn.gelu(a), jax.nn.gelu(a, approximate=False),
                                jax.nn.silu(a), jax.nn.relu(a), _softplus(a)), (f32(8, 4),), (0,)),
    "compare_select": (lambda a, b: (jnp.where(a < b, a, b), a == b, a != b, a <= b, a > b, a >= b,
                                     jnp.clip(a, -0.5, 0.7), jax.lax.clamp(-0.5, a, b), jnp.isfinite(a / b),
                                     jax.lax.reduce_precision(a, 8, 7), jnp.copy(b), jax.lax.stop_gradient(a) * b),
                       (f32(4, 8), f32(4, 8)), (0, 1)),
    "select_n_cases": (lambda a, i: jax.lax.select_n(i, a, a * 2, -a), (f32(4, 8), RNG.integers(0, 3, (4, 8)).astype(np.int32)), (0,)),
    "integer_div_rem": (lambda a, b: (jax.lax.div(a, b), jax.lax.rem(a, b), a // b, a % b),
                        (i32(4, 8), nonzero(i32(4, 8))), None),
    "float_rem": (lambda a, b: (jax.lax.rem(a, b), jnp.fmod(a, b), jnp.remainder(a, b)), (f32(4, 8), pos(4, 8)), None),
    "bits": (lambda a, b: (a & b, a | b, a ^ b, ~a, a << (b & 7), jax.lax.shift_right_logical(a, b & 31),
                           jax.lax.shift_right_arithmetic(a, b & 31)), (i32(4, 8, lo=-1000, hi=1000),
                                                                         i32(4, 8, lo=0, hi=100)), None),
    "unsigned_bits": (lambda a, b: (a ^ b, a >> (b & 31), a << (b & 31), a + b, a * b), (u32(4, 8), u32(4, 8)), None),
    "casts": (lambda a: (a.astype(jnp.int32), a.astype(jnp.bfloat16).astype(jnp.float32), a > 0,
                         jax.lax.bitcast_convert_type(a, jnp.uint32), (a > 0).astype(jnp.float32)), (f32(4, 8),), None),
    "reshape_transpose": (lambda a: (a.reshape(2, 16), a.T, a.reshape(4, 2, 4).transpose(2, 0, 1), a[None],
                                     a[:, None, :].squeeze(1), jnp.flip(a, 1)), (f32(4, 8),), (0,)),
    "broadcast": (lambda a, b: (a[:, None, :] + b[None, :, None], jnp.broadcast_to(b, (3, 8)), a * 2.0),
                  (f32(4, 8), f32(8)), (0, 1)),
    "concat_pad": (lambda a, b: (jnp.concatenate([a, b], 1), jnp.pad(a, ((1, 2), (0, 3))),
                                 jax.lax.pad(a, -1.0, ((1, -1, 1), (-2, 2, 0))), jnp.stack([a, b], 1)),
                   (f32(4, 8), f32(4, 8)), (0, 1)),
    "slices": (lambda a: (a[1:3], a[:, ::2], a[::-1, 1:7:3], a[2], jnp.split(a, [3, 5], axis=1)[1]), (f32(4, 8),), (0,)),
    "dynamic_slices": (lambda a, i: (jax.lax.dynamic_slice(a, (i, 2), (2, 4)),
                                     jax.lax.dynamic_update_slice(a, jnp.ones((2, 3), a.dtype) * 7.0, (i, 9))),
                       (f32(4, 8), np.int32(1)), (0,)),
    "iota": (lambda a: (jnp.arange(8)[None, :] + jnp.arange(4)[:, None], jnp.tril(a), a * jnp.eye(4, 8)),
             (f32(4, 8),), (0,)),
    "reductions": (lambda a: (a.sum(), a.sum(0), a.max(1), a.min(), jnp.prod(a * 0.3 + 1.0, 1), (a > 0).any(1),
                              (a > -3).all(0), a.mean(0), jnp.var(a, 1)), (f32(4, 8),), (0,)),
    "arg_reductions": (lambda a: (jnp.argmax(a, 1), jnp.argmin(a, 0)), (f32(4, 8),), None),
    "cumsum": (lambda a: (jnp.cumsum(a, 1), jax.lax.cumsum(a, 0, reverse=True)), (f32(4, 8),), (0,)),
    "cumulative": (lambda a, i: (jax.lax.cummax(a, 1), jax.lax.cummin(a, 0, reverse=True), jnp.cumprod(a * 0.5 + 1.0, 1),
                                 jax.lax.cumlogsumexp(a, 1), jax.lax.cummax(i, 1)), (f32(4, 9), i32(4, 9)), (0,)),
    "sort": (lambda a, b: (jnp.sort(a, 1), jnp.argsort(a, 0), jax.lax.sort((a, b), num_keys=1),
                           jax.lax.sort((jnp.round(a), b, a), num_keys=2), jax.lax.top_k(a, 3)),
             (f32(4, 8), f32(4, 8)), (0, 1)),
    "dot_general": (lambda a, b, c, d: (a @ b, jnp.einsum("ij,kj->ik", a, a), jnp.einsum("bij,bjk->bik", c, c),
                                        jnp.einsum("bij,bkj->kb", c, c), jax.lax.dot_general(a, a, (((0,), (0,)), ((), ()))),
                                        jax.lax.dot_general(d, a, (((2,), (0,)), ((), ()))),
                                        jax.lax.dot_general(a, d, (((0,), (2,)), ((), ()))),
                                        jax.lax.dot_general(d, d, (((1,), (1,)), ((0,), (0,))))),
                    (f32(4, 8), f32(8, 6), f32(2, 4, 4), f32(2, 3, 4)), (0, 1, 2, 3)),
    "softmax_logsumexp": (lambda a: (jax.nn.softmax(a, -1), jax.nn.log_softmax(a, 0), jax.nn.logsumexp(a, 1),
                                     jax.nn.one_hot(jnp.argmax(a, 1), 8)), (f32(4, 8),), (0,)),
    "gather_take": (lambda t, i: (t[i], jnp.take(t, i, axis=1), t[i, i], t[:, i[:2]]),
                    (f32(8, 8), RNG.integers(0, 8, (4,)).astype(np.int32)), (0,)),
    "gather_along": (lambda t, i: (jnp.take_along_axis(t, i, axis=1), jnp.take_along_axis(t, i[:, :1], axis=1)),
                     (f32(4, 8), RNG.integers(0, 8, (4, 3)).astype(np.int32)), (0,)),
    "gather_modes": (lambda t, i: (jnp.take(t, i, axis=0, mode="clip"), jnp.take(t, i, axis=0, mode="fill",
                                                                                fill_value=-1.0), t.at[i].get(mode="fill")),
                     (f32(6, 4), np.array([0, 5, 7, -9, 2], np.int32)), (0,)),
    "scatter_add": (lambda t, i, u: (t.at[i].add(u), t.at[:, i[:2]].add(1.0), t.at[i, i].add(u[:, 0])),
                    (f32(6, 4), np.array([0, 5, 2, 5], np.int32), f32(4, 4)), (0, 2)),
    "embedding_grad": (lambda t, i: (t[i] * 2.0).sum(-1), (f32(16, 4), RNG.integers(0, 16, (4, 8)).astype(np.int32)), (0,)),
    "conv": (lambda x, w, v: (jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
                              jax.lax.conv_general_dilated(x, w, (2, 1), ((1, 0), (2, 1)), rhs_dilation=(1, 2),
                                                           dimension_numbers=("NHWC", "HWIO", "NCHW")),
                              jax.lax.conv_general_dilated(x, v, (1, 1), "VALID", feature_group_count=2,
                                                           dimension_numbers=("NHWC", "HWIO", "NHWC"))),
             (f32(2, 8, 6, 4), f32(3, 3, 4, 6), f32(2, 2, 2, 6)), (0, 1, 2)),
    # Flax's pools as flax/linen/pooling.py writes them (lax.reduce_window with max or add over NHWC's (1, h, w, 1);
    # avg_pool divides the sum, by the counted ones without the padding), a min window, a 1-d pool over (N, L): their
    # gradients are select_and_scatter_add, and pad + a sum window
    "pools": (lambda x: (_window(x, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "SAME"),
                         _window(x, jax.lax.add, (1, 3, 3, 1), (1, 2, 1, 1), ((0, 0), (1, 1), (1, 1), (0, 0))) / 9,
                         _window(x, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
                         / _window(jnp.ones_like(x), jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME"),
                         _window(x, jax.lax.min, (1, 2, 2, 1), (1, 1, 2, 1), "VALID"),
                         _window(x[:, :, 0, 0], jax.lax.max, (1, 3), (1, 2), ((0, 0), (1, 0))),
                         _window(jnp.stack([x, 2 * x]), jax.lax.max, (1, 1, 2, 2, 1), (1, 1, 2, 2, 1), "VALID")),
              (f32(2, 8, 6, 4),), (0,)),
    "dilated_pool": (lambda x: _window(x, jax.lax.max, (1, 3, 1, 1), (1, 1, 1, 1), "SAME",
                                       window_dilation=(1, 2, 1, 1)),  # (JAX has no VJP for it)
                     (f32(2, 8, 6, 4),), None),
    "calls": (lambda a: (jax.jit(lambda x: x * 2 + 1)(a), _clip_grad(a) * a, jax.checkpoint(lambda x: jnp.sin(x) * x)(a),
                         jax.checkpoint(lambda x: jnp.tanh(x @ x.T), policy=jax.checkpoint_policies.dots_saveable)(a)),
              (f32(4, 8),), (0,)),
    "checkpoint_name": (lambda a: jax.checkpoint(lambda x: jnp.sin(checkpoint_name(x @ x.T, "h")) * 2,
                                                 policy=jax.checkpoint_policies.save_only_these_names("h"))(a),
                        (f32(4, 8),), (0,)),
    "scan": (_scan_cumsum, (f32(5, 4, 8),), (0,)),
    "fori_loop": (_fori, (f32(4, 8),), (0,)),
    "while_loop": (_while, (f32(4, 8), np.int32(3)), None),  # (JAX has no reverse-mode rule for while)
    "cond": (_cond, (f32(4, 8), np.float32(-1.0)), (0,)),
    "switch": (_switch, (f32(4, 8), np.int32(1)), (0,)),
}


def _flat(out):
    return [np.asarray(o) for o in jax.tree_util.tree_leaves(out)]


@functools.lru_cache(maxsize=None)
def _reference(name: str, grad: bool):
    fn, args, argnums = CASES[name]
    f = _grad_of(fn, argnums) if grad else fn
    return _flat(jax.jit(f)(*args))


def _grad_of(fn, argnums):
    def scalar(*a):
        outs = [o for o in jax.tree_util.tree_leaves(fn(*a)) if jnp.issubdtype(o.dtype, jnp.floating)]
        return sum(jnp.sum(jnp.sin(o) * (k + 1.0)) for k, o in enumerate(outs))
    return jax.grad(scalar, argnums=argnums)


@functools.lru_cache(maxsize=None)
def _imported(name: str, grad: bool):
    fn, _, argnums = CASES[name]
    return nb.import_jax(_grad_of(fn, argnums) if grad else fn)


def _place(data, args):
    out = []
    for a in args:
        a = np.asarray(a)
        spec = data.draw(specs(MESH, a.shape, partial=a.dtype.kind == "f"), label=f"spec of {a.shape}")
        out.append(nb.tensor(a).shard(MESH, spec.dim_specs, spec.replicated_axes, spec.partial_axes))
    return out


def _compare(got, want, name):
    got = [g.numpy() for g in jax.tree_util.tree_leaves(got)]
    assert len(got) == len(want), name
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, k, g.shape, w.shape, g.dtype, w.dtype)
        if w.dtype.kind in "fV":  # (atol at the output's scale: float32 sums of many terms cancel)
            scale = max(1.0, float(np.nanmax(np.abs(np.where(np.isfinite(w), w, 0)), initial=0.0)))
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=2e-5, atol=2e-6 * scale,
                                       err_msg=f"{name} output {k}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{name} output {k}")


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=examples(6))
@given(data=st.data())
def test_primitive_equals_jax_on_any_sharding(name, data):
    _, args, _ = CASES[name]
    _compare(_imported(name, False)(*_place(data, args)), _reference(name, False), name)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[2] is not None))
@settings(max_examples=examples(4))
@given(data=st.data())
def test_gradient_program_equals_jax_on_any_sharding(name, data):
    _, args, _ = CASES[name]
    _compare(_imported(name, True)(*_place(data, args)), _reference(name, True), name)


# ---- per-device code, constraints, PRNG bits ------------------------------------------------------------------------

JMESH = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _per_device(a, b):
    def body(a, b):
        i = jax.lax.axis_index("y")
        return (jax.lax.psum(a, "y"), jax.lax.all_gather(b, "x", axis=0, tiled=True), jax.lax.all_gather(b, "y", axis=1),
                jax.lax.ppermute(a, "y", [(i, (i + 1) % 4) for i in range(4)]) * i,
                jax.lax.psum_scatter(a, "y", scatter_dimension=1, tiled=True), jax.lax.all_to_all(a, "y", 1, 0, tiled=True),
                jax.lax.all_to_all(b.reshape(2, 4, 1), "y", 1, 2), jax.lax.pmax(a, "x"))
    return jax.shard_map(body, check_vma=False, in_specs=(P("x", "y"), P("x", "y")),
                         out_specs=(P("x", None), P(None, "y"), P("x", None, "y"), P("x", "y"), P("x", "y"), P("x", "y"),
                                    P("x", "y"), P(None, "y")))(a, b)


@settings(max_examples=examples(6))
@given(data=st.data())
def test_shard_map_and_its_collectives_equal_jax(data):
    a, b = f32(4, 16), f32(4, 16)
    with jax.set_mesh(JMESH):
        want = _flat(jax.jit(_per_device)(a, b))
    _compare(nb.import_jax(_per_device)(*_place(data, (a, b))), want, "shard_map")


def test_sharding_constraint_is_with_sharding_and_the_comm_log_names_its_line():
    def f(x, w):
        y = jnp.tanh(x @ w)
        return jax.lax.with_sharding_constraint(y, P(None, None))  # the gather of y's columns
    line = f.__code__.co_firstlineno + 2
    x, w = f32(8, 16), f32(16, 32)
    with nb.comm_log() as log:
        out = nb.import_jax(f)(nb.tensor(x).shard(MESH, ["x", None]), nb.tensor(w).shard(MESH, [None, "y"]))
    assert out.sharding.dim_specs[1].axes == () and out.sharding.dim_specs[0].axes == ()
    kinds = {(e.kind, e.axes) for e in log.events}
    assert kinds == {("all_gather", ("x",)), ("all_gather", ("y",))}, kinds
    assert all(e.op == f"test_import_jax.py:{line}" for e in log.events), [e.op for e in log.events]
    assert f"test_import_jax.py:{line}" in log.summary()
    np.testing.assert_allclose(out.numpy(), np.tanh(x @ w), rtol=1e-5, atol=1e-6)


def _random_program(key, x):
    k1, k2 = jax.random.split(key)
    keep = jax.random.bernoulli(k1, 0.9, x.shape)
    return (jnp.where(keep, x / 0.9, 0), jax.random.normal(jax.random.fold_in(k2, 3), x.shape),
            jax.random.uniform(k2, (3, 5)), jax.random.bits(key, (7,), dtype=jnp.uint8),
            jax.vmap(jax.vmap(lambda k: jax.random.bits(k, (2,))))(jax.random.split(key, (2, 3))),
            jax.random.randint(k1, (4,), 0, 10), jax.random.permutation(k2, 6),
            jax.random.uniform(jax.random.PRNGKey(11), (3,)), jax.random.bits(jax.random.key(5), (2, 2)))


@settings(max_examples=examples(4))
@given(data=st.data(), seed=st.integers(0, 2 ** 31 - 1))
def test_jax_random_bits_are_jaxs_on_any_sharding(data, seed):
    key, x = np.asarray(jax.random.PRNGKey(seed)), f32(4, 8)
    want = _flat(jax.jit(_random_program)(key, x))
    got = [g.numpy() for g in nb.import_jax(_random_program)(*_place(data, (key, x)))]
    np.testing.assert_array_equal(got[0] == 0, want[0] == 0)  # the dropped elements
    for k, (g, w) in enumerate(zip(got, want)):
        if w.dtype.kind == "f":  # arithmetic on the bits (x / 0.9; normal's erf_inv): within an ulp or two of XLA's
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        else:  # the bits themselves
            np.testing.assert_array_equal(g, w, err_msg=f"output {k}")


def test_flax_dropout_keeps_the_elements_jax_keeps():
    nn = pytest.importorskip("flax.linen")

    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.3, deterministic=False)(nn.Dense(16)(x))

    x = f32(8, 16)
    params = Drop().init(jax.random.PRNGKey(0), x)
    fn = lambda p, x, k: Drop().apply(p, x, rngs={"dropout": k})  # noqa: E731
    key = np.asarray(jax.random.PRNGKey(7))
    want = np.asarray(jax.jit(fn)(params, x, key))
    p = jax.tree_util.tree_map(lambda a: nb.tensor(np.asarray(a)).shard(MESH, [None] * a.ndim), params)
    got = nb.import_jax(fn)(p, nb.tensor(x).shard(MESH, ["x", "y"]), nb.tensor(key)).numpy()
    np.testing.assert_array_equal(got == 0, want == 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---- errors, labels, the cache, composition with nabla --------------------------------------------------------------


def test_an_unsupported_primitive_names_itself_and_the_line_and_runs_nothing():
    def f(x):
        y = x * 2
        return jax.lax.population_count(y)
    line = f.__code__.co_firstlineno + 2
    x = nb.tensor(i32(4, 8)).shard(MESH, ["x", "y"])
    with nb.comm_log() as log, pytest.raises(nb.ShardingError) as err:
        nb.import_jax(f)(x)
    assert "'population_count'" in str(err.value) and f"test_import_jax.py:{line}" in str(err.value)
    assert log.steps == []


def test_a_window_no_nabla_pool_expresses_names_the_primitive_its_line_and_why():
    def dilated(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "VALID", (1, 2, 1, 1))

    def product(x):
        return jax.lax.reduce_window(x, 1.0, jax.lax.mul, (1, 2, 2, 1), (1, 1, 1, 1), "VALID")
    x = nb.tensor(f32(2, 8, 6, 4)).shard(MESH, ["x", None, "y", None])
    for f, prim, why in ((dilated, "reduce_window_max", "base_dilation"), (product, "reduce_window", "max, min or add")):
        with nb.comm_log() as log, pytest.raises(nb.ShardingError) as err:
            nb.import_jax(f)(x)
        line = f.__code__.co_firstlineno + 1
        assert f"primitive {prim!r} at" in str(err.value) and f"test_import_jax.py:{line}" in str(err.value)
        assert why in str(err.value) and "nothing was run" in str(err.value) and log.steps == []


def test_cond_on_an_abstract_value_names_the_primitive_and_line():
    def f(x):
        return jax.lax.cond(x.sum() > 0, lambda a: a * 2.0, lambda a: -a, x)
    line = f.__code__.co_firstlineno + 1
    with pytest.raises(nb.ShardingError, match=rf"'cond' at .*test_import_jax.py:{line}.*without data"):
        nb.import_jax(f)(nb.abstract((4, 8)).shard(MESH, ["x", "y"]))


def test_a_flax_programs_steps_carry_its_module_path_and_its_backward_phase():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(jnp.tanh(nn.Dense(16)(x)))

    x = f32(8, 16)
    params = MLP().init(jax.random.PRNGKey(0), x)
    loss = lambda p, x: (MLP().apply(p, x) ** 2).mean()  # noqa: E731
    p = jax.tree_util.tree_map(lambda a: nb.tensor(np.asarray(a)).shard(MESH, [None] * a.ndim), params)
    with nb.comm_log() as log:
        nb.import_jax(jax.grad(loss))(p, nb.tensor(x).shard(MESH, ["x", None]))
    layers = {s.layer for s in log.steps}
    assert {"MLP/Dense_0", "MLP/Dense_1"} <= layers, layers
    phases = {s.phase for s in log.steps if s.layer == "MLP/Dense_0"}
    assert phases == {"forward", "backward"}


def test_traced_once_per_signature_not_per_sharding():
    calls = []

    def f(x, k=2.0):
        calls.append(1)
        return x * k
    g = nb.import_jax(f)
    for spec in (["x", "y"], [None, "y"], [("x", "y"), None]):
        g(nb.tensor(f32(8, 8)).shard(MESH, spec))
    g(nb.abstract((8, 8)).shard(MESH, ["x", None]))
    assert len(calls) == 1
    g(nb.tensor(f32(4, 8)).shard(MESH, ["x", "y"]))
    g(nb.tensor(f32(8, 8)), 3)  # a Python number is static: a new trace
    assert len(calls) == 3


def test_nabla_grad_of_an_imported_function_equals_jax_grad():
    def loss(w, x):
        return jnp.mean(jax.nn.softmax(jnp.tanh(x @ w) @ w.T, -1) ** 2)
    w, x = f32(16, 8), f32(8, 16)
    want = np.asarray(jax.jit(jax.grad(loss))(w, x))
    got = nb.grad(nb.import_jax(loss))(nb.tensor(w).shard(MESH, [None, "y"]), nb.tensor(x).shard(MESH, ["x", None]))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-7)
    assert got.sharding.dim_specs[1].axes == ("y",)


def test_abstract_inputs_plan_the_program_without_data():
    def f(x, w):
        return jax.nn.relu(x @ w).sum(0)
    x, w = nb.abstract((64, 32)).shard(MESH, ["x", None]), nb.abstract((32, 128)).shard(MESH, [None, "y"])
    with nb.comm_log() as log:
        out = nb.import_jax(f)(x, w)
    assert out.is_abstract and out.shape == (128,)
    with nb.comm_log() as real:
        nb.import_jax(f)(nb.tensor(f32(64, 32)).shard(MESH, ["x", None]), nb.tensor(f32(32, 128)).shard(MESH, [None, "y"]))
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [(e.kind, e.axes, e.bytes) for e in real.events]


# ---- the planners read an imported program as they read nabla code --------------------------------------------------


def _sgd_mlp():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = jnp.tanh(nn.Dense(256, name=f"fc{i}")(x))
            return x

    def step(p, x):
        loss, g = jax.value_and_grad(lambda p: (MLP().apply(p, x) ** 2).mean())(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), loss
    params = jax.tree_util.tree_map(np.asarray, MLP().init(jax.random.PRNGKey(0), np.zeros((64, 256), np.float32)))
    return step, params


def test_memory_log_counts_an_imported_steps_parameters_and_gradients():
    step, params = _sgd_mlp()
    p = jax.tree_util.tree_map(lambda a: nb.abstract(a.shape).shard(MESH, [None] * a.ndim), params)
    with nb.memory_log() as mem:
        nb.import_jax(step)(p, nb.abstract((64, 256)).shard(MESH, [("x", "y"), None]))
    nbytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(params))
    assert mem.by_kind["params"][0] == nbytes  # replicated: every device holds them all
    assert mem.by_kind["grads"][0] > 0 and mem.by_kind["optimizer"][0] == 0


def test_an_imported_mlp_step_has_the_memory_kinds_of_the_same_step_written_in_nabla():
    """Parameters, gradients and optimizer state as the native program has them: the differentiated weights are
    parameters also under a bare jax.grad, and a gradient's partial blocks (fc2's, row-parallel, before their sum
    over tp and dp) are temporaries, not gradients besides their sum."""
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    mesh = nb.DeviceMesh("m", (2, 2), ("dp", "tp"))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64, name="fc2")(nn.relu(nn.Dense(256, name="fc1")(x)))

    def loss(p, x, y):
        return ((MLP().apply(p, x) - y) ** 2).mean()

    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        u, s = optax.adam(1e-3).update(g, s, p)
        return optax.apply_updates(p, u), s

    def native_loss(p, x, y):
        q = p["params"]
        h = nb.relu(x @ q["fc1"]["kernel"] + q["fc1"]["bias"])
        return ((h @ q["fc2"]["kernel"] + q["fc2"]["bias"] - y) ** 2).mean()

    def native_step(p, s, x, y):
        return nb.optim.Adam(1e-3).update(nb.grad(native_loss)(p, x, y), s, p)

    x, y = f32(32, 64), f32(32, 64)
    params = jax.tree_util.tree_map(np.asarray, MLP().init(jax.random.PRNGKey(0), x))
    dims = lambda path, a: (["tp", None] if "fc2" in path and a.ndim == 2 else  # noqa: E731
                            [None] * (a.ndim - 1) + ["tp"] if "fc1" in path else [None] * a.ndim)
    place = lambda t: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, a: nb.tensor(a).shard(mesh, dims(jax.tree_util.keystr(path), a)), t)
    data = (nb.tensor(x).shard(mesh, ["dp", None]), nb.tensor(y).shard(mesh, ["dp", None]))
    kinds = {}
    for name, run in {"imported": lambda p: nb.import_jax(step)(p, place(optax.adam(1e-3).init(params)), *data),
                      "native": lambda p: native_step(p, nb.optim.Adam(1e-3).init(p), *data),
                      "imported grad": lambda p: nb.import_jax(jax.grad(loss))(p, *data),
                      "native grad": lambda p: nb.grad(native_loss)(p, *data)}.items():
        p = place(params)
        with nb.memory_log() as mem:
            run(p)
        kinds[name] = {k: mem.by_kind[k][0] for k in ("params", "grads", "optimizer")}
    assert kinds["imported"] == kinds["native"] and kinds["imported grad"] == kinds["native grad"], kinds
    assert kinds["native"]["grads"] == kinds["native"]["params"] > 0 and kinds["native grad"]["params"] > 0


def test_autoshard_chooses_for_a_jax_program_and_hands_jax_the_layout():
    step, params = _sgd_mlp()
    cluster = nb.Cluster(nb.Hardware.preset("h100-sxm-80gb"), nodes=1, devices_per_node=8)
    mesh = cluster.mesh("m", (2, 4), ("x", "y"))
    free = lambda shape: nb.abstract(shape).shard(mesh, [nb.DimSpec([], is_open=True)] * len(shape))  # noqa: E731
    g = nb.import_jax(step)
    plan = nb.autoshard(g, cluster, jax.tree_util.tree_map(lambda a: free(a.shape), params), free((64, 256)))
    assert plan.report.step_time <= min(r.step_time for r in plan.report.baselines.values()) * (1 + 1e-9)
    shardings = plan.jax_shardings(JMESH)
    for s, spec in zip(jax.tree_util.tree_leaves(shardings), flatten(plan.specs)[0]):
        assert tuple(s.spec) == tuple(None if not d.axes else d.axes[0] if len(d.axes) == 1 else d.axes
                                      for d in spec.dim_specs)
    x = f32(64, 256)
    want = jax.jit(step)(params, x)
    got = jax.jit(step, in_shardings=shardings)(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(nb.ShardingError, match="axes"):
        plan.jax_shardings(jax.make_mesh((8,), ("x",)))


def test_nb_jit_compiles_an_imported_program_and_explain_names_its_lines():
    def f(key, x, w):
        h = jnp.einsum("bi,ij->bj", x, w)
        keep = jax.random.bernoulli(key, 0.8, h.shape)
        return jnp.where(keep, h, 0.0) + jax.lax.erf_inv(jnp.tanh(h) * 0.5)
    key, x, w = np.asarray(jax.random.PRNGKey(3)), f32(8, 16), f32(16, 32)
    args = (nb.tensor(key), nb.tensor(x).shard(MESH, ["x", None]), nb.tensor(w).shard(MESH, [None, "y"]))
    want = np.asarray(jax.jit(f)(key, x, w))
    got = nb.jit(nb.import_jax(f))(*args)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    line = f.__code__.co_firstlineno + 1
    text = nb.explain(nb.import_jax(f), *args)
    assert f"(in test_import_jax.py:{line})" in text


def test_keyword_arguments_captured_constants_and_an_outer_scope():
    table = jnp.asarray(f32(8, 8))  # closed over: a constant of the jaxpr

    def f(x, *, scale, bias=None):
        y = jnp.tanh(x @ table) * scale
        return {"y": y if bias is None else y + bias, "none": None}
    x, b = f32(4, 8), f32(8)
    g = nb.import_jax(f)
    with nb.comm_log() as log, nb.named_scope("outer"):
        out = g(nb.tensor(x).shard(MESH, ["x", None]), scale=2.0, bias=nb.tensor(b))
    assert set(out) == {"y", "none"} and out["none"] is None
    want = jax.jit(lambda x, b: f(x, scale=2.0, bias=b)["y"])(x, b)
    np.testing.assert_allclose(out["y"].numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert {s.layer for s in log.steps} == {"outer"}
    with pytest.raises(nb.ShardingError, match="typed PRNG key"):
        nb.import_jax(lambda k: jax.random.bits(k, (2,)))(jax.random.key(0))


def test_round_erfc_and_float_to_int_casts_are_xlas_at_their_edges():
    """lax.round halves away from zero without rounding ``|x| + 0.5`` first (0.49999997 gave 1), erfc keeps its
    relative precision in the tail (``1 - erf``: erfc(6) gave 0), and a float-to-integer cast saturates and takes NaN
    to 0 (numpy's cast gave -2**31 for 3e9 and 44 for 300 to uint8)."""
    x = np.float32([0.49999997, -0.49999997, 2.5, -2.5, 8388609.0, -0.3, -0.0, np.nan, np.inf, -np.inf, 3e9, -3e9,
                    300.0, 2.0, 6.0])
    f = lambda a: (jax.lax.round(a), jax.lax.erfc(a), a.astype(jnp.int32), a.astype(jnp.uint8))  # noqa: E731
    got = [g.numpy() for g in nb.import_jax(f)(nb.tensor(x).shard(MESH, ["y"]))]  # 15 over 4: 4, 4, 4, 3
    want = [np.asarray(w) for w in jax.jit(f)(x)]
    np.testing.assert_array_equal(got[0], want[0])
    assert (np.signbit(got[0]) == np.signbit(want[0])).all()  # -0.3 and -0.0 round to -0.0
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=0)
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[3], want[3])


def test_integer_division_by_zero_signed_zeros_and_powers_are_xlas_without_warnings():
    """XLA defines what C leaves undefined (xla/service/elemental_ir_emitter.cc, EmitIntegerDivide and
    EmitIntegerRemainder): x / 0 is -1 (all ones: an unsigned type's maximum), INT_MIN / -1 is INT_MIN, x rem 0 is
    x, INT_MIN rem -1 is 0; nabla gave 0 for x / 0 and x rem 0, with numpy's 'divide by zero' warning. lax.sign
    keeps a zero's sign (sign(-0.0) is -0.0; numpy's is +0.0); lax.max and lax.min order -0.0 below +0.0
    (max(-0.0, 0.0) is +0.0 in either order, so relu(-0.0) and a clip at 0 are +0.0; numpy's maximum gives either
    zero); integer_pow(x, 0) is 1 for NaN and infinities (x * 0 + 1 gave NaN). No numpy warning is raised: XLA's
    overflow and invalid operations are values (exp(100) in float32 is inf, log(0) -inf). jax.jit on CPU is the
    reference, bit for bit (signs of zeros included)."""
    import warnings

    def check(f, *args):
        want = [np.asarray(w) for w in jax.tree_util.tree_leaves(jax.jit(f)(*args))]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = [g.numpy() for g in jax.tree_util.tree_leaves(
                nb.import_jax(f)(*[nb.tensor(a).shard(MESH, ["y"]) for a in args]))]
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)
            if w.dtype.kind == "f":
                np.testing.assert_array_equal(np.signbit(g[w == 0]), np.signbit(w[w == 0]))

    for dt in (np.int8, np.int32, np.uint8, np.uint32):
        info = np.iinfo(dt)
        a = np.array([7, info.min, 0, info.max, 5, info.min, 9, 1], dtype=object).astype(dt)
        b = np.array([0, -1, 0, 0, 3, 0, -2, 1] if info.min < 0 else [0, 0, 0, 0, 3, 0, 2, 1]).astype(dt)
        check(lambda a, b: (jax.lax.div(a, b), jax.lax.rem(a, b), a // b, a % b), a, b)
    z = np.float32([-0.0, 0.0, -0.0, 0.0, np.nan, np.inf, -np.inf, -2.0])
    check(lambda x, y: (jax.lax.sign(x), jax.lax.max(x, y), jax.lax.min(x, y), jax.lax.max(y, x), jax.lax.min(y, x),
                        jax.nn.relu(x), jnp.clip(x, 0.0, 1.0), jax.lax.integer_pow(x, 0), jnp.exp(x * 100.0),
                        jnp.log(x), x / y), z, z[::-1].copy())


def test_float64_erf_inv_is_as_precise_as_xlas():
    """lax.erf_inv in float64: Giles' single-precision polynomial alone gave erf_inv(0.5) = 0.47693629 (XLA's float64
    erf_inv: 0.4769362762044699, 3.6e-8 off) and was 10% off at 1 - 2**-53; refined on libm's erf and erfc it agrees
    with XLA's float64 erf_inv (jax.jit, 64-bit) to 1e-10 (the gap XLA's own polynomial leaves in the far tail)."""
    x = np.concatenate([np.linspace(-0.999999, 0.999999, 401), 1 - np.logspace(-16, -1, 40), [0.5, -0.0, 1e-300]])
    with jax.enable_x64(True):
        want = np.asarray(jax.jit(jax.lax.erf_inv)(x))
        got = nb.import_jax(jax.lax.erf_inv)(nb.tensor(x).shard(MESH, ["y"])).numpy()
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=2e-10, atol=0)
    assert got[-3] == 0.4769362762044699 and np.signbit(got[-2])  # (erf_inv(0.5), to the last bit; XLA's: 1 ulp under)
