"""sort, argsort and top_k: numpy's stable sort (NaN last) and jax.lax.top_k's order (largest first, NaN first, ties
by lower index) on random meshes, layouts and dtypes (bf16 and ints included); a sorted sharded dim is gathered once,
top_k over a sharded dim gathers only k candidates per device (bytes asserted); gradients against jax.grad; nb.jit."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import nabla as nb
from nabla import ShardingError
from nabla.testing import assert_gradient_matches, assert_sharded_allclose, examples, meshes, shapes, specs

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from jit_check import assert_jit_matches_eager  # noqa: E402

DTYPES = ["float32", "float64", "bfloat16", "int8", "int64", "bool", "float16"]


def _top_k_reference(v: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k largest by (NaN first, value descending, index ascending), with Python's exact comparisons."""
    rows = v.reshape(int(np.prod(v.shape[:-1])), v.shape[-1])
    idx = np.zeros((rows.shape[0], k), np.intp)
    for r, row in enumerate(rows):
        exact = [int(e) if v.dtype.kind in "iub" else float(e) for e in row]
        order = sorted(range(len(row)), key=lambda i: (exact[i] == exact[i], -exact[i] if exact[i] == exact[i] else 0, i))
        idx[r] = order[:k]
    idx = idx.reshape(v.shape[:-1] + (k,))
    return np.take_along_axis(v, idx, -1), idx


def _values(draw, dtype, shape):
    """Small integers (many ties), NaN, +-inf and -0.0 where the dtype has them."""
    v = np.asarray(draw(st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.0, -3.0, 5.0, np.nan, np.inf, -np.inf]),
                                  min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))).reshape(shape)
    if dtype in ("int8", "int64"):
        return np.nan_to_num(v, posinf=100, neginf=-100, nan=7).astype(dtype)
    if dtype == "bool":
        return np.nan_to_num(v).astype(bool)
    return v.astype(dtype)


@settings(max_examples=examples(60))
@given(st.data())
def test_sort_argsort_and_top_k_on_every_layout(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes(max_rank=3, max_dim=6, min_rank=1))
    spec = draw(specs(mesh, shape))
    v = _values(draw, dtype, shape)
    t = nb.tensor(v).shard(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes)
    axis = draw(st.sampled_from([None] + list(range(-len(shape), len(shape)))))
    host = v.astype(np.float32) if dtype == "bfloat16" else v  # numpy does not order bf16's NaN
    s = nb.sort(t, axis)
    assert s.dtype == v.dtype
    assert_sharded_allclose(s.astype("float64") if dtype != "bool" else s,
                            np.sort(host, axis, kind="stable").astype(np.float64 if dtype != "bool" else bool), 0, 0)
    a = nb.argsort(t, axis)
    assert a.dtype == np.intp
    assert_sharded_allclose(a, np.argsort(host, axis, kind="stable"), 0, 0)
    k = draw(st.integers(0, shape[-1]))
    values, index = nb.top_k(t, k)
    want_v, want_i = _top_k_reference(v, k)
    assert values.dtype == v.dtype and index.dtype == np.intp
    assert_sharded_allclose(index, want_i, 0, 0)
    assert_sharded_allclose(values.astype("float64") if dtype != "bool" else values,
                            want_v.astype(np.float64) if dtype != "bool" else want_v, 0, 0)


def test_top_k_is_jaxs():
    x = np.random.default_rng(0).integers(-3, 3, (4, 9)).astype(np.float32)
    x[1, 3] = np.nan
    for k in (0, 1, 4, 9):
        v, i = nb.top_k(nb.tensor(x).shard(nb.DeviceMesh("m", (4,), ("x",)), [None, "x"]), k)
        jv, ji = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(i.numpy(), np.asarray(ji))
        np.testing.assert_array_equal(v.numpy(), np.asarray(jv))


def test_top_k_over_a_sharded_dim_gathers_k_candidates_per_device():
    """(6, 1000) float32 over (2, 4), vocabulary-like dim over y: each device holds 3 rows of 250. Gathering the
    dim (what sort does) sends 3 * 250 * 4 * 3 = 9,000 B per device; top_k(5) sends each device's 5 candidates per
    row: 3 * 5 * 4 * 3 = 180 B of values and 360 B of (int64) indices."""
    mesh = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    x = np.random.default_rng(1).standard_normal((6, 1000)).astype(np.float32)
    t = nb.tensor(x).shard(mesh, ["x", "y"])
    with nb.comm_log() as log:
        v, i = nb.top_k(t, 5)
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("all_gather", ("y",), 180),
                                                                ("all_gather", ("y",), 360)], log.summary()
    want_v, want_i = _top_k_reference(x, 5)
    assert_sharded_allclose(v, want_v, 0, 0)
    assert_sharded_allclose(i, want_i, 0, 0)
    assert [d.axes for d in v.sharding.dim_specs] == [("x",), ()]
    with nb.comm_log() as log:
        nb.sort(t)
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("all_gather", ("y",), 9000)], log.summary()


def test_top_k_candidates_on_uneven_blocks_and_ties():
    """11 over 4 (blocks 3, 3, 3, 2, one padded): ties across blocks go to the lower global index; the padding
    (the dtype's lowest value) never wins over a real element equal to it."""
    mesh = nb.DeviceMesh("m", (4,), ("x",))
    for dtype in ("float32", "int8", "bool"):
        x = np.array([[1, 5, 5, 0, 5, 1, 2, 5, 0, 1, 5], [-128, -128, 3, -128, 0, 0, 0, 0, 0, 0, -128]])
        x = x.astype(dtype) if dtype != "float32" else np.where(x == -128, -np.inf, x).astype(dtype)
        for k in (1, 3, 11):
            v, i = nb.top_k(nb.tensor(x).shard(mesh, [None, "x"]), k)
            want_v, want_i = _top_k_reference(x, k)
            assert_sharded_allclose(i, want_i, 0, 0)
            assert_sharded_allclose(v, want_v, 0, 0)


GRADS = {
    "sort0": (lambda t: nb.sort(t, 0), lambda v: jnp.sort(v, 0)),
    "sort": (lambda t: t.sort(), lambda v: jnp.sort(v)),
    "top_k": (lambda t: nb.top_k(t, 3)[0], lambda v: jax.lax.top_k(v, 3)[0]),
    "top_k_T": (lambda t: nb.top_k(t.T, 2)[0], lambda v: jax.lax.top_k(v.T, 2)[0]),
}


@pytest.mark.parametrize("name", sorted(GRADS))
def test_gradients_on_every_placement_equal_jax(name):
    fn, ref = GRADS[name]
    x = np.random.default_rng(3).standard_normal((5, 7))
    w = np.random.default_rng(4).standard_normal(np.shape(ref(x)))
    want = np.asarray(jax.grad(lambda v: (ref(v) * w).sum())(x))
    assert_gradient_matches(fn, x, w, want, nb.DeviceMesh("m23", (2, 3), ("x", "y"), devices=[5, 3, 1, 4, 2, 0]),
                            rtol=1e-10, atol=1e-10)


def test_bf16_sorts_with_nan_last_as_jax():
    x = np.array([[3.0, np.nan, -1.0, 2.0, -np.inf, 0.5]], ml_dtypes.bfloat16)
    t = nb.tensor(x).shard(nb.DeviceMesh("m", (2,), ("x",)), [None, "x"])
    np.testing.assert_array_equal(nb.sort(t).numpy().astype(np.float32), np.asarray(jnp.sort(x)).astype(np.float32))
    np.testing.assert_array_equal(nb.argsort(t).numpy(), np.asarray(jnp.argsort(x, stable=True)))


@pytest.mark.parametrize("call, words", [
    (lambda: nb.top_k(nb.ones((2, 3)), 4), r"top_k: k must be an int in \[0, 3\] \(the last dim's size\), got 4"),
    (lambda: nb.top_k(nb.ones(()), 1), "top_k: needs a tensor of at least 1 dim"),
    (lambda: nb.sort(nb.ones((2, 3)), 2), "sort: axis 2 is out of range for a tensor of rank 2"),
    (lambda: nb.argsort(nb.ones(()), 0), "argsort: axis 0 is out of range for a tensor of rank 0"),
])
def test_bad_arguments_raise_sharding_errors_naming_them(call, words):
    with pytest.raises(ShardingError, match=words):
        call()


@pytest.mark.parametrize("name", ["sort", "argsort", "top_k_values", "top_k_indices", "sort_grad", "top_k_grad"])
def test_under_jit_the_hlo_moves_what_the_log_says(name):
    fn = {"sort": lambda a: nb.sort(a, 1), "argsort": lambda a: nb.argsort(a, -1),
          "top_k_values": lambda a: nb.top_k(a, 3)[0], "top_k_indices": lambda a: nb.top_k(a, 4)[1],
          "sort_grad": nb.grad(lambda a: (nb.sort(a, 1) * a).sum()),
          "top_k_grad": nb.grad(lambda a: (nb.top_k(a, 3)[0] ** 2).sum())}[name]
    mesh = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    x = np.random.default_rng(5).standard_normal((3, 5, 10)).astype(np.float32)
    x[0, 0, 3] = np.nan
    for dims in ([None, "x", "y"], [None, None, ("x", "y")], ["x", "y:(1)2", "y:(2)2"]):
        # (top_k computes values and indices, nb.jit drops the one the function does not return; sort's gradient
        # gathers the operand again for its argsort, which nb.jit finds is the forward pass's gather)
        assert_jit_matches_eager(fn, nb.tensor(x).shard(mesh, dims), same_log=name in ("sort", "argsort"))
