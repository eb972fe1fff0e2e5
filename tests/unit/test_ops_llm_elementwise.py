"""The elementwise and masking ops of language models (gelu, silu, sigmoid, isnan, isfinite, tril, triu, dropout):
values and every device's block on random meshes and layouts (uneven, partial, sub-axes) and dtypes, bf16 against
jax at bf16 precision, gradients against jax.grad, no communication where none is promised, and nb.jit's HLO."""

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

TOL = {"float32": (2e-6, 2e-6), "float64": (1e-13, 1e-13), "bfloat16": (1.6e-2, 1.6e-2)}


def _jax_dropout(x, rate, key):
    """jax with nabla's documented mask (the hash of key and global index; not jax.random's stream)."""
    from nabla.ops.masks import _host_offsets, keep_mask
    keep = np.broadcast_to(keep_mask(np, _host_offsets(x.shape), rate, key), x.shape)
    return jnp.where(keep, x / (1 - rate), 0)


# name -> (nabla, jax); every op keeps the operand's layout and moves nothing
OPS = {
    "gelu": (nb.gelu, lambda v: jax.nn.gelu(v, approximate=True)),
    "gelu_exact": (lambda t: nb.gelu(t, approximate=False), lambda v: jax.nn.gelu(v, approximate=False)),
    "silu": (nb.silu, jax.nn.silu),
    "sigmoid": (nb.sigmoid, jax.nn.sigmoid),
    "tril": (lambda t: nb.tril(t, 1), lambda v: jnp.tril(v, 1)),
    "triu": (lambda t: nb.triu(t, -1), lambda v: jnp.triu(v, -1)),
    "dropout": (lambda t: nb.dropout(t, 0.3, 11), lambda v: _jax_dropout(v, 0.3, 11)),
}
LINEAR = ("tril", "triu", "dropout")


@st.composite
def operand(draw, dtype, min_rank=0, partial=True):
    mesh = draw(meshes(max_devices=8))
    shape = draw(shapes(max_rank=3, max_dim=6, min_rank=min_rank))
    spec = draw(specs(mesh, shape, partial=partial))
    v = np.random.default_rng(draw(st.integers(0, 999))).standard_normal(shape).astype(dtype)
    return nb.tensor(v).shard(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes), v


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("dtype", sorted(TOL))
@settings(max_examples=examples(6))  # per dtype and op: 44 such tests
@given(data=st.data())
def test_values_on_every_layout_equal_jax(name, dtype, data):
    fn, ref = OPS[name]
    t, v = data.draw(operand(dtype, 2 if name in ("tril", "triu") else 0))
    with nb.comm_log() as log:
        got = fn(t)
    assert got.dtype == v.dtype
    want = np.asarray(ref(jnp.asarray(v))).astype(np.float64)
    assert_sharded_allclose(got.astype("float64"), want, *TOL[dtype])
    if min(t.shape, default=2) < 2:
        return  # (elementwise rules give size-1 and empty dims no factor: they are gathered, as for every op)
    if not t.sharding.partial_axes:
        assert log.events == [], log.summary()  # each device computes its own block
        assert [d.axes for d in got.sharding.dim_specs] == [d.axes for d in t.sharding.dim_specs]
    elif name in LINEAR:  # linear: the pending sum stays pending (over axes of more than one device)
        mesh = t.sharding.mesh
        pending = {a for a in t.sharding.partial_axes if mesh.axis_ref(a).size > 1}
        assert pending <= set(got.sharding.partial_axes) and log.events == [], log.summary()


@pytest.mark.parametrize("name", sorted(OPS))
def test_gradients_on_every_placement_equal_jax(name):
    fn, ref = OPS[name]
    x = np.random.default_rng(3).standard_normal((5, 7))
    w = np.random.default_rng(4).standard_normal(np.shape(ref(x)))
    want = np.asarray(jax.grad(lambda v: (ref(v) * w).sum())(x))
    assert_gradient_matches(fn, x, w, want, nb.DeviceMesh("m23", (2, 3), ("x", "y"), devices=[5, 3, 1, 4, 2, 0]),
                            rtol=1e-10, atol=1e-10)


def test_the_dropout_mask_is_the_same_on_every_sharding_and_sub_axis():
    mesh = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    x = np.ones((6, 9, 5), np.float32)
    want = nb.dropout(nb.tensor(x), 0.25, 2024).numpy()
    kept = (want != 0).mean()
    assert 0.6 < kept < 0.9 and set(np.unique(want)) == {0, np.float32(1 / 0.75)}
    for dims in (["x", "y", None], [None, "y:(1)2", ("x", "y:(2)2")], [("y", "x"), None, None]):
        assert_sharded_allclose(nb.dropout(nb.tensor(x).shard(mesh, dims), 0.25, 2024), want, rtol=0, atol=0)
    assert not np.array_equal(nb.dropout(nb.tensor(x), 0.25, 2025).numpy(), want)  # another key, another mask
    assert nb.dropout(nb.tensor(x), 0.0, 5) is not None and np.array_equal(nb.dropout(nb.tensor(x), 0.0, 5).numpy(), x)
    assert not nb.dropout(nb.tensor(x * np.inf), 1.0, 5).numpy().any()  # nothing kept, even infinities


def test_isnan_and_isfinite_are_numpys_on_every_dtype():
    mesh = nb.DeviceMesh("m", (4,), ("x",))
    v = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1.5, -2.0], np.float64)
    for dtype in ("float16", "float32", "float64", "bfloat16", "complex64", "int8", "bool"):
        a = v.astype(dtype) if dtype not in ("int8", "bool") else np.nan_to_num(v, posinf=3, neginf=-3).astype(dtype)
        t = nb.tensor(a).shard(mesh, ["x"])
        ref = a.astype(np.float32) if dtype == "bfloat16" else a
        for fn, np_fn in ((nb.isnan, np.isnan), (nb.isfinite, np.isfinite)):
            got = fn(t)
            assert got.dtype == np.bool_
            assert_sharded_allclose(got, np_fn(ref), rtol=0, atol=0)
        assert type(np.isnan(t)) is nb.Tensor  # numpy's protocol reaches the op
    g = nb.grad(lambda a: (a * nb.isfinite(a)).sum())(nb.tensor(np.array([1.0, 2.0])))
    np.testing.assert_array_equal(g.numpy(), [1.0, 1.0])  # no gradient through the test itself


def test_tril_masks_by_global_row_and_column():
    """Uneven blocks (9 rows over 4 devices: 3, 3, 3, 0) and a batch dim: each device masks by the global indices
    of its own elements."""
    mesh = nb.DeviceMesh("m", (4, 2), ("x", "y"))
    x = np.random.default_rng(0).standard_normal((3, 9, 5))
    for k in (-3, 0, 2, 7):
        for dims in ([None, "x", "y"], ["y", None, "x"], [None, ("y", "x"), None]):
            t = nb.tensor(x).shard(mesh, dims)
            with nb.comm_log() as log:
                lo, hi = nb.tril(t, k), nb.triu(t, k)
            assert log.events == []
            assert_sharded_allclose(lo, np.tril(x, k), rtol=0, atol=0)
            assert_sharded_allclose(hi, np.triu(x, k), rtol=0, atol=0)


@pytest.mark.parametrize("call, words", [
    (lambda: nb.tril(nb.ones(3)), "tril: needs a tensor of at least 2 dims"),
    (lambda: nb.triu(nb.ones((2, 2)), 1.5), "triu: k must be an int"),
    (lambda: nb.dropout(nb.ones(3), 1.5, 0), r"dropout: rate must be in \[0, 1\]"),
    (lambda: nb.dropout(nb.ones(3), 0.5, 1.0), "dropout: key must be an int"),
    (lambda: nb.dropout(nb.ones(3, "int32"), 0.5, 1), "dropout: x must be a float tensor"),
    (lambda: nb.silu(nb.ones((2, 3)) + nb.ones((4, 3))), "do not broadcast"),
])
def test_bad_arguments_raise_sharding_errors_naming_them(call, words):
    with pytest.raises(ShardingError, match=words):
        call()


def test_the_tanh_form_is_jaxs_default():
    x = np.linspace(-4, 4, 9)
    np.testing.assert_allclose(nb.gelu(nb.tensor(x)).numpy(), np.asarray(jax.nn.gelu(x)), rtol=1e-12)
    assert nb.gelu(nb.tensor(np.arange(3))).dtype == np.float64  # integers compute in float64, as numpy's tanh


@pytest.mark.parametrize("name", ["gelu", "gelu_exact", "silu", "tril", "dropout"])
def test_under_jit_the_hlo_moves_what_the_log_says(name):
    mesh = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    x = np.random.default_rng(1).standard_normal((3, 10, 7)).astype(np.float32)
    fn = OPS[name][0]
    for dims in ([None, "x", "y"], ["x", ("y:(1)2",), "y:(2)2"]):
        t = nb.tensor(x).shard(mesh, dims)
        assert_jit_matches_eager(fn, t)
        assert_jit_matches_eager(nb.grad(lambda a: (fn(a) * a).sum()), t, rtol=1e-5, atol=1e-5)


def test_ml_dtypes_bf16_stays_bf16():
    t = nb.tensor(np.ones((4, 4), ml_dtypes.bfloat16)).shard(nb.DeviceMesh("m", (2,), ("x",)), ["x", None])
    for fn, _ in OPS.values():
        assert fn(t).dtype == ml_dtypes.bfloat16
