"""nb.vmap against jax.vmap: functions of many op families, in_axes and out_axes, unmapped arguments, pytrees,
sharded batch dims (nothing moves for them), gradients inside and of vmap (per-example gradients), nested vmap,
nb.jit; and the errors it raises."""

import sys
from pathlib import Path

import numpy as np
import pytest

import nabla as nb
from nabla import ShardingError
from nabla.testing import assert_sharded_allclose

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from jit_check import assert_jit_matches_eager  # noqa: E402

MESH = nb.DeviceMesh("m", (2, 3), ("x", "y"))
R = np.random.default_rng(0)
X = R.standard_normal((4, 5, 6))
W = R.standard_normal((6, 3))
V = R.standard_normal(5)

# name -> (nabla fn, jax fn, [(value, in_axis)], out_axes)
CASES = {
    "matmul": (lambda x: x @ W, lambda x: x @ W, [(X, 0)], 0),
    "sum_all": (lambda x: x.sum(), jnp.sum, [(X, 0)], 0),
    "sum_axis": (lambda x: nb.sum(x, 1), lambda x: jnp.sum(x, 1), [(X, 1)], 0),
    "transpose": (lambda x: x.T, lambda x: x.T, [(X, 2)], 0),
    "reshape": (lambda x: x.reshape(-1), lambda x: x.reshape(-1), [(X, 0)], 0),
    "softmax": (lambda x: nb.softmax(x, 0), lambda x: jax.nn.softmax(x, 0), [(X, 0)], 0),
    "argmax": (lambda x: nb.argmax(x), jnp.argmax, [(X, 0)], 0),
    "slices": (lambda x: x[1:3, ::-1], lambda x: x[1:3, ::-1], [(X, 0)], 0),
    "concatenate": (lambda x: nb.concatenate([x, x * 2], 1), lambda x: jnp.concatenate([x, x * 2], 1), [(X, 0)], 0),
    "unmapped": (lambda x, v: x * v[:, None] + nb.exp(v).sum(), lambda x, v: x * v[:, None] + jnp.exp(v).sum(),
                 [(X, 0), (V, None)], 0),
    "two_mapped": (lambda a, b: nb.einsum("ij,ij->i", a, b), lambda a, b: jnp.einsum("ij,ij->i", a, b),
                   [(X, 0), (X[::-1] * 1.0, 0)], 0),
    "mixed_axes": (lambda a, b: a @ b, lambda a, b: a @ b, [(X, 0), (R.standard_normal((6, 2, 4)), 2)], 0),
    "cumsum": (lambda x: nb.cumsum(x, 0), lambda x: jnp.cumsum(x, 0), [(X, 0)], 0),
    "sort": (lambda x: nb.sort(x, 0), lambda x: jnp.sort(x, 0), [(X, 1)], 0),
    "top_k": (lambda x: nb.top_k(x, 2)[1], lambda x: jax.lax.top_k(x, 2)[1], [(X, 0)], 0),
    "tril": (lambda x: nb.tril(x), jnp.tril, [(X, 0)], 0),
    "roll_pad": (lambda x: nb.pad(nb.roll(x, 2, 0), ((1, 0), (2, 1))),
                 lambda x: jnp.pad(jnp.roll(x, 2, 0), ((1, 0), (2, 1))), [(X, 0)], 0),
    "layer_norm": (lambda x: nb.layer_norm(x),
                   lambda x: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5), [(X, 0)], 0),
    "var": (lambda x: nb.var(x, 0), lambda x: jnp.var(x, 0), [(X, 0)], 0),
    "gelu": (nb.gelu, jax.nn.gelu, [(X, 1)], 0),
    "where": (lambda x: nb.where(x > 0, x, -x * 2), lambda x: jnp.where(x > 0, x, -x * 2), [(X, 0)], 0),
    "grad_inside": (nb.grad(lambda x: (nb.tanh(x) ** 2).sum()), jax.grad(lambda x: (jnp.tanh(x) ** 2).sum()),
                    [(X, 0)], 0),
    "out_axis": (lambda x: x @ W, lambda x: x @ W, [(X, 0)], 1),
    "out_axis_last": (lambda x: nb.sum(x, 0), lambda x: jnp.sum(x, 0), [(X, 1)], -1),
}
LAYOUTS = [None, ["x", None, None], [None, "y", "x"], ["x", "y", None], [("y", "x"), None, None]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_jax_vmap_on_every_layout(name):
    fn, jfn, ins, out_axes = CASES[name]
    in_axes = tuple(a for _, a in ins)
    want = np.asarray(jax.vmap(jfn, in_axes=in_axes, out_axes=out_axes)(*[v for v, _ in ins]))
    for dims in LAYOUTS:
        args = [nb.tensor(v) if dims is None or a is None else nb.tensor(v).shard(MESH, dims) for v, a in ins]
        got = nb.vmap(fn, in_axes=in_axes, out_axes=out_axes)(*args)
        assert got.dtype == want.dtype or got.dtype.kind == want.dtype.kind == "i"  # (top_k's indices: intp)
        assert_sharded_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_a_sharded_batch_dim_moves_nothing_and_stays_sharded():
    x = nb.tensor(X).shard(MESH, ["x", None, None])
    with nb.comm_log() as log:
        y = nb.vmap(lambda a: nb.relu(a @ W).sum(-1))(x)
    assert log.events == [] and y.sharding.dim_specs[0].axes == ("x",)
    assert_sharded_allclose(y, np.maximum(X @ W, 0).sum(-1), rtol=1e-12, atol=1e-12)


def test_per_example_gradients_and_gradients_of_vmap_equal_jax():
    def loss(w, xi):
        return (nb.softmax(xi @ w, -1) * nb.cumsum(xi, 0)[:, :3]).sum()

    def jloss(w, xi):
        return (jax.nn.softmax(xi @ w, -1) * jnp.cumsum(xi, 0)[:, :3]).sum()

    want = np.asarray(jax.vmap(jax.grad(jloss), (None, 0))(W, X))
    wt = R.standard_normal(4)
    want_outer = np.asarray(jax.grad(lambda w: (jax.vmap(jloss, (None, 0))(w, X) * wt).sum())(W))
    for xd, wd in [(None, None), (["x", None, "y"], [None, "y"]), ([None, "y", None], ["y", None])]:
        x = nb.tensor(X) if xd is None else nb.tensor(X).shard(MESH, xd)
        w = nb.tensor(W) if wd is None else nb.tensor(W).shard(MESH, wd)
        assert_sharded_allclose(nb.vmap(nb.grad(loss), (None, 0))(w, x), want, rtol=1e-10, atol=1e-10)
        g = nb.grad(lambda w: (nb.vmap(loss, (None, 0))(w, x) * wt).sum())(w)
        assert_sharded_allclose(g, want_outer, rtol=1e-10, atol=1e-10)


def test_pytrees_nested_vmap_and_several_outputs():
    params = {"w": nb.tensor(W), "b": nb.tensor(R.standard_normal(3))}
    out, total = nb.vmap(lambda p, x: (x @ p["w"] + p["b"], x.sum()), in_axes=(None, 0))(params, nb.tensor(X))
    np.testing.assert_allclose(out.numpy(), X @ W + params["b"].numpy(), rtol=1e-12)
    np.testing.assert_allclose(total.numpy(), X.sum((1, 2)), rtol=1e-12)
    both = nb.vmap(lambda d: d["a"] * d["b"])({"a": nb.tensor(X), "b": nb.tensor(X + 1)})
    np.testing.assert_allclose(both.numpy(), X * (X + 1), rtol=1e-12)
    nested = nb.vmap(nb.vmap(lambda r: nb.sort(r) * 2.0))(nb.tensor(X).shard(MESH, ["x", "y", None]))
    assert_sharded_allclose(nested, np.sort(X, -1) * 2, rtol=1e-12, atol=1e-12)
    const = nb.vmap(lambda x: nb.tensor(np.ones(3)) * 2.0)(nb.tensor(X))  # an output that ignores the batch
    np.testing.assert_array_equal(const.numpy(), np.full((4, 3), 2.0))


@pytest.mark.parametrize("name", ["matmul", "grad_inside", "cumsum", "top_k"])
def test_under_jit_the_hlo_moves_what_the_log_says(name):
    fn = CASES[name][0]
    x = nb.tensor(X.astype(np.float32)).shard(nb.DeviceMesh("m8", (2, 4), ("x", "y")), ["x", "y", None])
    assert_jit_matches_eager(lambda a: nb.vmap(fn)(a), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, words", [
    (lambda: nb.vmap(lambda a, b: a + b)(nb.ones((3, 2)), nb.ones((4, 2))),
     "vmap: mapped dims have different sizes: argument 1 has 4 along dim 0, an earlier one 3"),
    (lambda: nb.vmap(lambda a: a, in_axes=2)(nb.ones((3, 2))), "vmap: in_axes 2 is out of range for argument 0"),
    (lambda: nb.vmap(lambda a: a)(nb.ones(())), "vmap: argument 0 is 0-d"),
    (lambda: nb.vmap(lambda a: a, in_axes=None)(nb.ones(3)), "vmap: no argument is mapped"),
    (lambda: nb.vmap(lambda a: a, in_axes=(0, 0))(nb.ones(3)), "vmap: in_axes must be an int, None, or a tuple"),
    (lambda: nb.vmap(lambda a: float(a.sum()))(nb.ones((3, 2))), "abstract"),
    (lambda: nb.vmap(lambda a: 3)(nb.ones((3, 2))), "vmap: fn must return tensors"),
    (lambda: nb.vmap(lambda a: a, out_axes=3)(nb.ones((3, 2))), "vmap: out_axes 3 is out of range"),
])
def test_bad_calls_raise_sharding_errors_naming_them(call, words):
    with pytest.raises(ShardingError, match=words):
        call()
