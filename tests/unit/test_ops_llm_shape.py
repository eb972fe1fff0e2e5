"""flip, roll, pad, split and stack: numpy's values on random meshes, layouts (uneven, partial, sub-axes) and dtypes;
a sharded dim stays sharded and only rows that change owner move (bytes asserted for roll and pad); gradients
against jax.grad; nb.jit's HLO is the log."""

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


@st.composite
def _case(draw, rank):
    """(nabla fn, numpy fn) of one shape op with random arguments for a tensor of ``rank`` dims (>= 1)."""
    op = draw(st.sampled_from(["flip", "roll", "roll_flat", "pad", "pad_value", "split", "stack"]))
    axis = draw(st.integers(-rank, rank - 1))
    if op == "flip":
        ax = draw(st.sampled_from([None, axis, tuple(range(rank))[::2]]))
        return lambda t: nb.flip(t, ax), lambda v: np.flip(v, ax)
    if op in ("roll", "roll_flat"):
        shift = draw(st.integers(-13, 13))
        ax = None if op == "roll_flat" else axis
        return lambda t: nb.roll(t, shift, ax), lambda v: np.roll(v, shift, ax)
    if op in ("pad", "pad_value"):
        widths = [(draw(st.integers(0, 4)), draw(st.integers(0, 4))) for _ in range(rank)]
        c = 0 if op == "pad" else draw(st.sampled_from([1, -2.5]))
        return lambda t: nb.pad(t, widths, constant_values=c), lambda v: np.pad(v, widths, constant_values=c)
    if op == "split":
        cuts = sorted(draw(st.lists(st.integers(0, 7), max_size=3)))
        return (lambda t: nb.concatenate(nb.split(t, cuts, axis)[::-1], axis),
                lambda v: np.concatenate(np.split(v, cuts, axis)[::-1], axis))
    at = draw(st.integers(0, rank))
    return lambda t: nb.stack([t, t * 2], at), lambda v: np.stack([v, v * 2], at)


@settings(max_examples=examples(80))
@given(st.data())
def test_values_on_every_layout_equal_numpy(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    dtype = draw(st.sampled_from(["float32", "float64", "int32", "bfloat16", "bool"]))
    shape = draw(shapes(max_rank=3, max_dim=7, min_rank=1))
    spec = draw(specs(mesh, shape))
    v = (np.random.default_rng(draw(st.integers(0, 999))).standard_normal(shape) * 3).astype(dtype)
    t = nb.tensor(v).shard(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes)
    fn, ref = draw(_case(len(shape)))
    want = ref(v.astype(np.float64) if dtype == "bfloat16" else v)
    got = fn(t)
    assert got.shape == want.shape
    if dtype != "bfloat16":
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert_sharded_allclose(got.astype("float64") if dtype == "bfloat16" else got,
                            want if dtype != "bfloat16" else want.astype(np.float64), rtol=1e-2 * (dtype == "bfloat16"),
                            atol=1e-2 * (dtype == "bfloat16"))


def _row(mesh, n, dims=("x",)):
    v = np.arange(float(n))
    return nb.tensor(v).shard(mesh, list(dims)), v


@pytest.mark.parametrize("shift, events", [
    (1, [8, 8]),  # each device's last row to its right neighbour; the last device's to device 0 (the wrap)
    (3, [24, 24]),
    (4, [32, 32]),  # a whole block: block p to device p+1, and the last block round to device 0
    (-5, [8, 8, 24, 24]),  # 5 back: 3 rows from the next block and 1 from the one after, each also wrapping
])
def test_roll_moves_only_the_rows_that_change_owner(shift, events):
    """16 float64 rows over 4 devices (blocks of 4): gathering the dim would send 96 B per device; a roll sends
    each device only the rows of its new block that another device holds, as collective_permutes (the rows from
    the left, and those that wrap around from the end, are separate permutes)."""
    mesh = nb.DeviceMesh("m", (4,), ("x",))
    t, v = _row(mesh, 16)
    with nb.comm_log() as log:
        r = nb.roll(t, shift)
    assert set(log.counts) == {"collective_permute"}, log.summary()
    assert sorted(e.bytes for e in log.events) == sorted(events), log.summary()
    assert r.sharding.dim_specs[0].axes == ("x",)
    assert_sharded_allclose(r, np.roll(v, shift), rtol=0, atol=0)


def test_pad_keeps_the_dim_sharded_and_makes_its_padding_in_place():
    mesh = nb.DeviceMesh("m", (4,), ("x",))
    t, v = _row(mesh, 10)  # blocks 3, 3, 3, 1
    with nb.comm_log() as log:
        r = nb.pad(t, (0, 2))  # 12 rows: blocks 3, 3, 3, 3, the padding on the last device
    assert log.events == [] and r.sharding.dim_specs[0].axes == ("x",)
    assert_sharded_allclose(r, np.pad(v, (0, 2)), rtol=0, atol=0)
    with nb.comm_log() as log:
        r = nb.pad(t, (1, 1), constant_values=-1.0)  # 12 rows: every block one row later
    assert [(e.kind, e.bytes) for e in log.events] == [("collective_permute", 8)], log.summary()
    assert_sharded_allclose(r, np.pad(v, (1, 1), constant_values=-1.0), rtol=0, atol=0)


def test_flip_sends_each_block_to_its_mirror():
    mesh = nb.DeviceMesh("m", (2, 2), ("x", "y"))
    x = np.arange(32.0).reshape(8, 4)
    t = nb.tensor(x).shard(mesh, ["x", "y"])
    with nb.comm_log() as log:
        r = nb.flip(t, 0)
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("collective_permute", ("x",), 4 * 2 * 8)]
    assert_sharded_allclose(r, np.flip(x, 0), rtol=0, atol=0)


def test_linear_shape_ops_keep_a_pending_sum():
    mesh = nb.DeviceMesh("m", (2, 2), ("x", "y"))
    x = np.random.default_rng(0).standard_normal((6, 5))
    p = nb.tensor(x).shard(mesh, ["x", None], partial_axes=["y"])
    for fn, ref in ((lambda t: nb.flip(t, 0), lambda v: np.flip(v, 0)), (lambda t: nb.roll(t, 2, 0), lambda v: np.roll(v, 2, 0)),
                    (lambda t: nb.pad(t, ((1, 0), (0, 2))), lambda v: np.pad(v, ((1, 0), (0, 2)))),
                    (lambda t: nb.split(t, 2, 0)[1], lambda v: np.split(v, 2, 0)[1])):
        got = fn(p)
        assert got.sharding.partial_axes == ("y",)
        assert_sharded_allclose(got, ref(x), rtol=1e-12, atol=1e-12)
    got = nb.pad(p, 1, constant_values=2.0)  # not linear: the sum is made first
    assert got.sharding.partial_axes == ()
    assert_sharded_allclose(got, np.pad(x, 1, constant_values=2.0), rtol=1e-12, atol=1e-12)


GRADS = {
    "flip": (lambda t: nb.flip(t, 0), lambda v: jnp.flip(v, 0)),
    "flip_all": (lambda t: nb.flip(t), lambda v: jnp.flip(v)),
    "roll": (lambda t: nb.roll(t, (3, -2), (0, 1)), lambda v: jnp.roll(v, (3, -2), (0, 1))),
    "roll_flat": (lambda t: nb.roll(t, 9), lambda v: jnp.roll(v, 9)),
    "pad": (lambda t: nb.pad(t, ((1, 2), (0, 3))), lambda v: jnp.pad(v, ((1, 2), (0, 3)))),
    "pad_value": (lambda t: nb.pad(t, 1, constant_values=2.0), lambda v: jnp.pad(v, 1, constant_values=2.0)),
    "split_stack": (lambda t: nb.stack(nb.split(t, [2, 4], 0)[:2], 1), lambda v: jnp.stack(jnp.split(v, [2, 4], 0)[:2], 1)),
}


@pytest.mark.parametrize("name", sorted(GRADS))
def test_gradients_on_every_placement_equal_jax(name):
    fn, ref = GRADS[name]
    x = np.random.default_rng(3).standard_normal((5, 7))
    w = np.random.default_rng(4).standard_normal(np.shape(ref(x)))
    want = np.asarray(jax.grad(lambda v: (ref(v) * w).sum())(x))
    assert_gradient_matches(fn, x, w, want, nb.DeviceMesh("m23", (2, 3), ("x", "y"), devices=[5, 3, 1, 4, 2, 0]),
                            rtol=1e-10, atol=1e-10)


def test_numpy_protocols_reach_the_ops():
    t = nb.tensor(np.arange(12.0).reshape(3, 4)).shard(nb.DeviceMesh("m", (2,), ("x",)), [None, "x"])
    x = np.arange(12.0).reshape(3, 4)
    for fn in (np.flip, lambda a: np.roll(a, 1, axis=1), lambda a: np.pad(a, 1, constant_values=5),
               lambda a: np.stack([a, a], 1), lambda a: np.split(a, 2, axis=1)[1]):
        got = fn(t)
        assert type(got) is nb.Tensor
        assert_sharded_allclose(got, fn(x), rtol=0, atol=0)


@pytest.mark.parametrize("call, words", [
    (lambda: nb.pad(nb.ones((2, 3)), ((1, 0), (-1, 0))), r"pad: dim 1: pad widths must be >= 0, got \(-1, 0\)"),
    (lambda: nb.pad(nb.ones((2, 3)), 1, mode="reflect"), "pad: mode 'reflect' is not supported"),
    (lambda: nb.pad(nb.ones((2, 3)), ((1, 0), (0, 1), (2, 2))), "cannot be read as one .* pair per dim of 2 dims"),
    (lambda: nb.split(nb.ones((5, 3)), 2), "split: array split does not result in an equal division: dim 0 of "
                                           "size 5 into 2 sections"),
    (lambda: nb.roll(nb.ones((5, 3)), (1, 2, 3), (0, 1)),
     "roll: shift .* and axis .* must have the same length"),
    (lambda: nb.flip(nb.ones((5, 3)), 2), "flip: axis 2 is out of range for a tensor of rank 2"),
    (lambda: nb.stack([nb.ones(2), nb.ones(3)]), r"stack: all input arrays must have the same shape"),
])
def test_bad_arguments_raise_sharding_errors_naming_them(call, words):
    with pytest.raises(ShardingError, match=words):
        call()


@pytest.mark.parametrize("name", ["roll", "pad", "flip", "split_stack"])
def test_under_jit_the_hlo_moves_what_the_log_says(name):
    fn = {"roll": lambda a: nb.roll(a, (3, -1), (1, 2)), "pad": lambda a: nb.pad(a, ((0, 1), (2, 3), (1, 0))),
          "flip": lambda a: nb.flip(a, (1, 2)), "split_stack": lambda a: nb.stack(nb.split(a, 3, 1), 0)}[name]
    mesh = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    x = np.random.default_rng(5).standard_normal((3, 9, 7)).astype(np.float32)
    for dims in ([None, "y", "x"], [None, ("x", "y"), None], ["x", "y:(1)2", "y:(2)2"]):
        t = nb.tensor(x).shard(mesh, dims)
        assert_jit_matches_eager(fn, t)
        assert_jit_matches_eager(nb.grad(lambda a: (fn(a) ** 2).sum()), t, rtol=1e-5, atol=1e-5)
