"""Bugs the sweeps and random programs found, each pinned by the smallest program that showed it."""

import numpy as np

import nabla as nb
from nabla import DeviceMesh, ShardingSpec
from nabla.reshard import plan
from nabla.testing import assert_sharded_allclose

M22 = DeviceMesh("b", (2, 2), ("x", "y"))


def test_planner_does_not_cycle_on_uneven_dims_that_do_not_nest():
    # (6, 4): moving x under y on dim 0 cannot be done one atom at a time (3 rows per y-shard do not
    # split evenly into 2); the planner once sliced and gathered y forever.
    v = np.arange(24, dtype=np.float32).reshape(6, 4)
    t = nb.tensor(v).shard(M22, ["y", "x"])
    u = t.with_sharding(M22, [("y", "x"), None])
    assert_sharded_allclose(u, v, rtol=0, atol=0)
    p = plan((6, 4), 4, ShardingSpec(M22, ["y", "x"]), ShardingSpec(M22, [("y", "x"), None]))
    assert len(p.steps) <= 3


def test_reduction_padding_mask_on_a_finer_grid():
    # sum over an uneven dim sharded on x while y shards the other dim: the mask lives on the kernel grid
    v = np.arange(15, dtype=np.float32).reshape(5, 3)
    t = nb.tensor(v).shard(M22, ["x", "y"])
    assert_sharded_allclose(t.sum(0), v.sum(0))
    assert_sharded_allclose(t @ v.T, v @ v.T, rtol=1e-5, atol=1e-5)


def test_adjacent_sub_axes_are_one_axis():
    m = DeviceMesh("m", (4,), ("y",))
    s = ShardingSpec(m, [("y:(1)2", "y:(2)2")])
    assert s == ShardingSpec(m, ["y"]) and repr(s) == '[{"y"}]'
    t = nb.tensor(np.arange(5.0)).shard(m, ["y"]).with_sharding(m, [("y:(1)2", "y:(2)2")])
    assert_sharded_allclose(t, np.arange(5.0), rtol=0, atol=0)


def test_scalar_added_to_a_partial_sum_is_added_once():
    m = DeviceMesh("m", (4,), ("x",))
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    p = nb.tensor(a).shard(m, [None, "x"]) @ nb.tensor(a.T).shard(m, ["x", None])
    assert_sharded_allclose(p + 1.0, a @ a.T + 1.0)
    assert_sharded_allclose(1.0 - p, 1.0 - a @ a.T)


def test_softmax_of_an_empty_tensor():
    t = nb.tensor(np.zeros((0, 3), np.float32)).shard(M22, ["x", None])
    assert nb.softmax(t, 0).shape == (0, 3)


def test_negative_step_slices():
    v = np.arange(12.0).reshape(3, 4)
    t = nb.tensor(v).shard(M22, ["x", "y"])
    assert_sharded_allclose(t[::-1, ::-2], v[::-1, ::-2], rtol=0, atol=0)


def test_ellipsis_index_with_sum_shadowing():
    t = nb.tensor(np.arange(24.0).reshape(2, 3, 4)).shard(M22, ["x", None, "y"])
    assert_sharded_allclose(t[..., 1], np.arange(24.0).reshape(2, 3, 4)[..., 1], rtol=0, atol=0)


def test_partial_sums_over_different_axes_add():
    # p is partial over x, q over y: p + q is partial over both, each summand added once
    v, w = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    p = nb.tensor(v).shard(M22, [None, None], partial_axes=["x"])
    q = nb.tensor(w).shard(M22, [None, None], partial_axes=["y"])
    r = p + q
    assert r.sharding.partial_axes == ("x", "y")
    assert_sharded_allclose(r, v + w)
    assert_sharded_allclose(p * q, v * w)  # a product of sums over different axes is their double sum


def test_size_one_axes_are_not_used_twice():
    # found by the thorough profile: x=1 counted as not overlapping itself, so two factors took it
    m = DeviceMesh("m", (1, 1), ("x", "y"))
    import pytest
    with pytest.raises(nb.ShardingError, match="used twice"):
        ShardingSpec(m, ["x", "x"])
    a = nb.tensor(np.ones((2, 2), np.float32)).shard(m, [("x", "y"), None])
    b = nb.tensor(np.ones((2, 1), np.float32)).shard(m, [("x", "y"), None])
    with nb.strategy("aggressive"):
        assert_sharded_allclose(a @ b, np.full((2, 1), 2.0, np.float32))


def test_one_placement_spelled_two_ways():
    # found by the thorough profile: a size-1 axis between two sub-axes of x is the same placement as
    # x itself, but the stored grids differ; the empty plan must still regrid the blocks
    m = DeviceMesh("m", (4, 2, 1), ("x", "y", "z"))
    for shape in [(0,), (5,), (8,)]:
        v = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        for a, b in [([("y", "x:(1)2", "z", "x:(2)2")], [("x", "y", "z")]),
                     ([("x", "y", "z")], [("x:(1)2", "z", "x:(2)2")])]:
            assert_sharded_allclose(nb.tensor(v).shard(m, a).with_sharding(m, b), v, rtol=0, atol=0)
