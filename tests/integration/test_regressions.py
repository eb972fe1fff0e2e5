"""Bugs the sweeps and random programs found, each pinned by the smallest program that showed it."""

import numpy as np
import pytest

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


# ---- found by fuzzing and by comparing with XLA (each failed before its fix) ------------------------------

M4 = DeviceMesh("m4", (4,), ("x",))
M2 = DeviceMesh("m2", (2,), ("x",))


def test_pending_sums_of_bools_and_small_ints_keep_numpy_dtypes():
    a = np.array([[True, False]]), np.array([[True], [True]])
    got = nb.tensor(a[0]).shard(M2, [None, "x"]) @ nb.tensor(a[1]).shard(M2, ["x", None])
    assert got.dtype == np.bool_ and got.numpy().dtype == np.bool_
    np.testing.assert_array_equal(got.numpy(), a[0] @ a[1])  # [[True]], not the int 2
    i8 = np.full((1, 4), 100, np.int8), np.full((4, 1), 1, np.int8)
    got = nb.tensor(i8[0]).shard(M4, [None, "x"]) @ nb.tensor(i8[1]).shard(M4, ["x", None])
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got.numpy(), i8[0] @ i8[1])  # numpy wraps: -112
    p = nb.tensor(np.arange(4, dtype=np.int32)).shard(M4, [None], partial_axes=["x"])
    assert p.numpy().dtype == np.int32 and p.shards[0].dtype == np.int32


def test_infinite_or_zero_factors_reduce_pending_sums_first():
    """Scaling summands is linear only for finite factors: inf * 0 (the zeros other devices hold) is NaN."""
    with np.errstate(all="ignore"):
        v = np.array([np.inf, 1.0])
        p = nb.tensor(v).shard(M2, [None], partial_axes=["x"])
        np.testing.assert_array_equal((p / 0.0).numpy(), v / 0.0)
        q = nb.tensor(np.array([1.0, -2.0])).shard(M2, [None], partial_axes=["x"])
        np.testing.assert_array_equal((q * np.inf).numpy(), np.array([1.0, -2.0]) * np.inf)
        a, b = np.ones((2, 4)), np.ones((4, 2))
        pm = nb.tensor(a).shard(M2, [None, "x"]) @ nb.tensor(b).shard(M2, ["x", None])
        assert pm.sharding.partial_axes == ("x",)
        np.testing.assert_array_equal((pm * np.inf).numpy(), (a @ b) * np.inf)
        # finite factors keep the sum pending: no communication
        r = nb.tensor(np.array([1.0, 2.0])).shard(M2, [None], partial_axes=["x"])
        with nb.comm_log() as log:
            s = r * 3.0
        assert log.events == [] and s.sharding.partial_axes == ("x",)


def test_mean_accumulates_as_numpy_does():
    x = np.full((4096, 30), 100, np.float16)  # a float16 sum overflows; numpy accumulates in float32
    m = nb.tensor(x).shard(M4, ["x", None]).mean()
    assert m.dtype == np.float16 and float(m) == float(x.mean()) == 100.0
    big = np.array([2**62, 2**62, 3, 5], dtype=np.int64)  # an int64 sum overflows; numpy uses float64
    got = nb.tensor(big).shard(M4, ["x"]).mean()
    assert got.dtype == np.float64
    np.testing.assert_allclose(got.numpy(), big.mean(), rtol=1e-15)


def test_boolean_scalar_indices_add_an_axis():
    v = np.arange(12.0).reshape(4, 3)
    t = nb.tensor(v).shard(M4, ["x", None])
    for key in (True, False, (True, slice(1, 3)), (slice(None), False)):
        assert_sharded_allclose(t[key], v[key], rtol=0, atol=0)


def test_transpose_axes_out_of_range_raise_like_numpy():
    t = nb.tensor(np.ones((2, 3))).shard(M2, ["x", None])
    for axes in ((0, 2), (0, -3), (0, 0), (0,)):
        with pytest.raises(nb.ShardingError, match="transpose"):
            nb.transpose(t, axes)
    assert nb.transpose(t, (-1, 0)).shape == (3, 2)


def test_a_device_sending_to_itself_moves_nothing():
    # a reversed dim sharded on an axis of size 1: every device is its own mirror, and the comm log once
    # showed a 12 B collective_permute; so did a reshard to a mesh that differs only by its name, and an
    # explicit ppermute whose pairs all send to themselves
    v = np.arange(3, dtype=np.float32)
    for mesh in (DeviceMesh("one", (1,), ("x",)), DeviceMesh("m", (1, 4), ("x", "y"))):
        t = nb.tensor(v).shard(mesh, ["x"])
        with nb.comm_log() as log:
            u = t[::-1]
        assert log.events == [] and log.total_bytes == 0
        assert_sharded_allclose(u, v[::-1], rtol=0, atol=0)
        assert nb.jit(lambda a: a[::-1])(t).numpy().tolist() == v[::-1].tolist()
    renamed = DeviceMesh("c", (2, 2), ("x", "y"))
    t = nb.tensor(np.arange(4, dtype=np.float32)).shard(M22, ["x"])
    with nb.comm_log() as log:
        u = t.with_sharding(renamed, ["x"])
    assert log.events == [] and u.mesh == renamed
    assert_sharded_allclose(u, np.arange(4, dtype=np.float32), rtol=0, atol=0)
    line = DeviceMesh("l", (4,), ("x",))
    step = nb.shard_map(lambda b: nb.lax.ppermute(b, "x", [(i, i) for i in range(4)]), line, [["x"]], ["x"])
    with nb.comm_log() as log:
        u = step(nb.tensor(np.arange(8, dtype=np.float32)))
    assert log.events == []
    assert_sharded_allclose(u, np.arange(8, dtype=np.float32), rtol=0, atol=0)
    with nb.comm_log() as log:  # a reversal over devices that do move still sends its block
        nb.tensor(np.arange(8, dtype=np.float32)).shard(line, ["x"])[::-1]
    assert [(e.kind, e.bytes) for e in log.events] == [("collective_permute", 8)]


def _most_lacked(t, u, cut):
    """The most bytes any device lacks of its block of ``u = t[cut:...]`` (dim 0 cut, others whole)."""
    most = 0
    for d in t.sharding.mesh.devices:
        res, src = u.sharding.shard_slices(u.shape, d), t.sharding.shard_slices(t.shape, d)
        need = held = 1
        for j, (r, s) in enumerate(zip(res, src)):
            lo, hi = r.start + (cut if j == 0 else 0), r.stop + (cut if j == 0 else 0)
            need *= hi - lo
            held *= max(0, min(hi, s.stop) - max(lo, s.start))
        most = max(most, (need - held) * t.dtype.itemsize)
    return most


def test_slicing_a_sharded_dim_moves_only_what_changes_owner():
    # issue 13: cutting a sharded dim sends only the rows a device lacks of its new block, nothing when the
    # cut keeps every device's rows; rows from both sides at one distance share one collective_permute
    # (x[4:12] on tp: device 0 reads from its right, device 3 from its left: one 128 B round, not two)
    m = DeviceMesh("m", (2, 4), ("dp", "tp"))
    x = np.arange(256, dtype=np.float32).reshape(16, 16)
    for spec, start, stop, want in [(["tp", None], 4, 12, 128), (["dp", "tp"], 4, 12, 0), (["dp", None], 4, 12, 0),
                                    (["tp", None], 1, 15, 64), (["tp", None], 3, 11, 192)]:
        t = nb.tensor(x).shard(m, spec)
        with nb.comm_log() as log:
            u = t[start:stop]
        assert log.total_bytes == want, (spec, start, stop, log.events)
        assert_sharded_allclose(u, x[start:stop], rtol=0, atol=0)
        lacked = _most_lacked(t, u, start)
        # x[3:11] on tp: device 1 sends a row to each side and device 2 two rows to its right; per side and
        # distance that is 64 B + 128 B (XLA: 256 B), where splitting device 2's rows over both rounds would
        # reach the 128 B device 3 lacks
        assert log.total_bytes == lacked or (start, stop) == (3, 11) and lacked == 128, (spec, start, stop)
        w = nb.jit(lambda a: a[start:stop])(t)
        assert_sharded_allclose(w, x[start:stop], rtol=0, atol=0)
