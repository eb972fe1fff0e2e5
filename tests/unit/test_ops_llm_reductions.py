"""var, std, argmin, prod, any, all and cumsum: numpy's values and dtypes on random meshes, layouts (uneven, partial,
sub-axes) and dtypes, bf16 against jax at bf16 precision; over a sharded dim nothing is gathered (the bytes of what
moves are asserted); gradients against jax.grad; nb.jit's HLO is the log."""

import sys
from pathlib import Path

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

TOL = {"float32": 2e-5, "float64": 1e-12, "bfloat16": 3e-2, "int8": 0, "int64": 0, "bool": 0}


def _ops(axis, keep):
    """name -> (nabla, numpy) at one axis (an int, a tuple or None) and keepdims."""
    one = axis if not isinstance(axis, tuple) else (axis[0] if axis else None)
    return {
        "var": (lambda t: nb.var(t, axis, keepdims=keep), lambda v: np.var(v, axis, keepdims=keep)),
        "std_ddof": (lambda t: t.std(axis, ddof=1, keepdims=keep), lambda v: np.std(v, axis, ddof=1, keepdims=keep)),
        "argmin": (lambda t: t.argmin(one), lambda v: np.argmin(v, one)),
        "prod": (lambda t: nb.prod(t, axis, keepdims=keep), lambda v: np.prod(v, axis, keepdims=keep)),
        "any": (lambda t: nb.any(t, axis, keep), lambda v: np.any(v, axis, keepdims=keep)),
        "all": (lambda t: t.all(axis, keep), lambda v: np.all(v, axis, keepdims=keep)),
        "cumsum": (lambda t: nb.cumsum(t, one), lambda v: np.cumsum(v, one)),
    }


@settings(max_examples=examples(60))
@given(st.data())
def test_values_and_dtypes_equal_numpy_on_every_layout(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    dtype = draw(st.sampled_from(sorted(TOL)))
    shape = draw(shapes(max_rank=3, max_dim=6))
    spec = draw(specs(mesh, shape))
    rng = np.random.default_rng(draw(st.integers(0, 999)))
    v = (rng.standard_normal(shape) * 2).astype(np.float32)
    v = v.astype(dtype) if dtype != "int8" else np.round(v).astype(np.int8)
    t = nb.tensor(v).shard(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes)
    r = len(shape)
    axis = draw(st.sampled_from([None] + list(range(-r, r)) + ([(0, r - 1)] if r > 1 else [])))
    name = draw(st.sampled_from(sorted(_ops(axis, False))))
    keep = draw(st.booleans())
    fn, ref = _ops(axis, keep)[name]
    one = axis[0] if isinstance(axis, tuple) else axis  # (argmin takes one axis: a tuple's first)
    if name == "argmin" and (v.size if one is None else shape[one]) == 0:  # numpy raises: nothing to pick from
        with pytest.raises((ShardingError, ValueError)):
            fn(t)
        return
    if name == "prod" and dtype in ("float32", "bfloat16"):
        v64 = v.astype(np.float64)  # products of many values: compare with float64's, at the dtype's precision
        want = np.prod(v64, axis, keepdims=keep)
    else:
        with np.errstate(all="ignore"):
            want = ref(v.astype(np.float32) if dtype == "bfloat16" else v)
    got = fn(t)
    if dtype != "bfloat16":
        assert got.dtype == np.asarray(ref(v)).dtype, (got.dtype, np.asarray(ref(v)).dtype)
    tol = TOL[dtype] * (8 if name in ("var", "std_ddof", "cumsum", "prod") else 1)
    if name in ("var", "std_ddof") and not tol:
        tol = 1e-12  # integers and bools: in float64
    with np.errstate(all="ignore"):
        assert_sharded_allclose(got.astype("float64") if tol else got, np.asarray(want, np.float64 if tol else None),
                                rtol=tol, atol=tol * 4)


def _sharded(shape=(6, 1000), dtype=np.float64):
    mesh = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    return nb.tensor(x).shard(mesh, ["x", "y"]), x


@pytest.mark.parametrize("name, kinds, nbytes", [
    # 3 rows per device, 4 devices along y: the block totals, one float64 per row from each device
    ("cumsum", {"all_gather"}, 3 * 8 * 3),
    ("prod", {"all_gather"}, 3 * 8 * 3),  # the 4 block products of each row
    ("var", {"all_reduce"}, 2 * 3 * 8 * 3 // 4),  # the row sums (the result keeps its own sum pending)
    ("std_ddof", {"all_reduce"}, 2 * (2 * 3 * 8 * 3 // 4)),  # and the sums of squares
    ("argmin", {"all_reduce"}, 2 * (2 * 3 * 8 * 3 // 4)),  # the row minimum, then the first index holding it
    ("any", {"all_reduce"}, 2 * 3 * 1 * 3 // 4),  # one bool per row
])
def test_over_a_sharded_dim_only_one_value_per_row_moves(name, kinds, nbytes):
    """(6, 1000) over (2, 4), the reduced or scanned dim 1000 over y: gathering it would send 3 * 250 * 8 * 3 =
    18,000 B per device; what moves is a few values per row."""
    t, x = _sharded()
    fn, ref = _ops(1, False)[name]
    with nb.comm_log() as log:
        got = fn(t)
    assert set(log.counts) == kinds, log.summary()
    assert log.total_bytes == nbytes, log.summary()
    assert all(e.axes == ("y",) for e in log.events)
    assert_sharded_allclose(got, ref(x), rtol=1e-9, atol=1e-9)


def test_cumsum_keeps_the_scanned_dim_sharded_on_uneven_blocks_and_sub_axes():
    mesh = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    x = np.random.default_rng(1).integers(-9, 9, (3, 11)).astype(np.int32)
    for dims in ([None, "y"], [None, ("y", "x")], ["y:(1)2", ("x", "y:(2)2")], ["x", "y:(2)2"]):
        t = nb.tensor(x).shard(mesh, dims)
        with nb.comm_log() as log:
            got = nb.cumsum(t, 1)
        assert got.dtype == np.cumsum(x, 1).dtype
        assert_sharded_allclose(got, np.cumsum(x, 1), rtol=0, atol=0)
        assert [d.axes for d in got.sharding.dim_specs][1] == t.sharding.dim_specs[1].axes
        assert set(log.counts) <= {"all_gather"}, log.summary()


def test_partial_inputs_stay_pending_through_cumsum_and_var_sums_them_once():
    mesh = nb.DeviceMesh("m", (2, 2), ("x", "y"))
    x = np.random.default_rng(2).standard_normal((4, 6))
    p = nb.tensor(x).shard(mesh, [None, "y"], partial_axes=["x"])
    with nb.comm_log() as log:
        c = nb.cumsum(p, 1)
    assert c.sharding.partial_axes == ("x",) and set(log.counts) == {"all_gather"}  # linear: the sum waits
    assert_sharded_allclose(c, np.cumsum(x, 1), rtol=1e-12, atol=1e-12)
    assert_sharded_allclose(nb.var(p, 1), np.var(x, 1), rtol=1e-12, atol=1e-12)


GRADS = {
    "var": (lambda t: nb.var(t, 0), lambda v: jnp.var(v, 0)),
    "std": (lambda t: nb.std(t, 1, ddof=1), lambda v: jnp.std(v, 1, ddof=1)),
    "var_all": (lambda t: nb.var(t), lambda v: jnp.var(v)),
    "prod": (lambda t: nb.prod(t, 1), lambda v: jnp.prod(v, 1)),
    "prod0": (lambda t: t.prod(0, keepdims=True), lambda v: jnp.prod(v, 0, keepdims=True)),
    "cumsum0": (lambda t: nb.cumsum(t, 0), lambda v: jnp.cumsum(v, 0)),
    "cumsum1": (lambda t: t.cumsum(1), lambda v: jnp.cumsum(v, 1)),
    "cumsum_flat": (lambda t: nb.cumsum(t), lambda v: jnp.cumsum(v)),
}


@pytest.mark.parametrize("name", sorted(GRADS))
def test_gradients_on_every_placement_equal_jax(name):
    fn, ref = GRADS[name]
    x = np.random.default_rng(3).standard_normal((5, 7))
    x[1, 2] = x[3, 4] = x[3, 5] = 0.0  # prod: a row with one zero, a row with two
    w = np.random.default_rng(4).standard_normal(np.shape(ref(x)))
    want = np.asarray(jax.grad(lambda v: (ref(v) * w).sum())(x))
    assert_gradient_matches(fn, x, w, want, nb.DeviceMesh("m23", (2, 3), ("x", "y"), devices=[5, 3, 1, 4, 2, 0]),
                            rtol=1e-10, atol=1e-10)


def test_numpy_protocols_and_methods_reach_the_ops():
    t, x = _sharded((4, 6))
    for fn, ref in ((lambda a: np.var(a, 0, ddof=1), lambda v: np.var(v, 0, ddof=1)), (np.std, np.std),
                    (lambda a: np.prod(a, 1), lambda v: np.prod(v, 1)), (lambda a: np.any(a > 1, 0), None),
                    (lambda a: np.all(a > -3), None), (lambda a: np.cumsum(a, 1), lambda v: np.cumsum(v, 1)),
                    (lambda a: np.argmin(a, 1, keepdims=True), lambda v: np.argmin(v, 1, keepdims=True))):
        got = fn(t)
        assert type(got) is nb.Tensor
        assert_sharded_allclose(got, fn(x) if ref is None else ref(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call, words", [
    (lambda: nb.cumsum(nb.ones((2, 3)), 2), "cumsum: axis 2 is out of range for a tensor of rank 2"),
    (lambda: nb.var(nb.ones((2, 3)), (0, 0)), "var: repeated axis"),
    (lambda: nb.prod(nb.ones(3), 1), "prod: axis 1 is out of range"),
    (lambda: nb.argmin(nb.ones((2, 3)), 5), "argmin: axis 5 is out of range"),
    (lambda: nb.any(nb.ones(3), "a"), "any: axis must be None, an int or a tuple of ints"),
])
def test_bad_arguments_raise_sharding_errors_naming_them(call, words):
    with pytest.raises(ShardingError, match=words):
        call()


@pytest.mark.parametrize("name", ["cumsum", "prod", "var", "argmin", "any"])
def test_under_jit_the_hlo_moves_what_the_log_says(name):
    mesh = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    x = np.random.default_rng(5).standard_normal((3, 10, 7)).astype(np.float32)
    fn = _ops(1, False)[name][0]
    for dims in ([None, "y", "x"], ["x", ("y:(1)2",), "y:(2)2"], [None, ("x", "y"), None]):
        t = nb.tensor(x).shard(mesh, dims)
        assert_jit_matches_eager(fn, t, rtol=1e-5, atol=1e-5)
    t = nb.tensor(x).shard(mesh, [None, "y", "x"])
    if name in ("cumsum", "prod", "var"):
        assert_jit_matches_eager(nb.grad(lambda a: (fn(a) ** 2).sum()), t, rtol=1e-4, atol=1e-4)
