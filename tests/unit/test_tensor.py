import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nabla as nb
from nabla import DeviceMesh, DimSpec, ShardingError, Tensor
from nabla.testing import assert_sharded_allclose, numpy_unanswered, sharded_arrays

MESH = DeviceMesh("cluster", (2, 4), ("dp", "tp"))


def test_issue_example():
    x = nb.arange(40, dtype="float32").reshape(5, 8)
    xs = x.shard(MESH, [DimSpec(["dp"]), DimSpec(["tp"])])
    assert repr(xs.sharding) == '[{"dp"}, {"tp"}]'
    np.testing.assert_array_equal(xs.shards[5], x.numpy()[3:5, 2:4])
    np.testing.assert_array_equal(xs.numpy(), x.numpy())
    assert xs.sharding.to_mhlo() == "{devices=[2,4]0,1,2,3,4,5,6,7}"
    assert xs.mesh == MESH and x.sharding is None and x.mesh is None


def test_constructors():
    assert nb.ones((2, 3)).dtype == np.float32 and nb.zeros(4).shape == (4,)
    assert Tensor.ones((2,)).numpy().tolist() == [1.0, 1.0]
    assert Tensor.zeros((1, 2)).numpy().tolist() == [[0.0, 0.0]]
    assert nb.tensor([[1, 2]], dtype="int32").dtype == np.int32
    assert nb.arange(3).numpy().tolist() == [0, 1, 2]
    a, b = nb.random.normal((3, 2), seed=4), nb.random.normal((3, 2), seed=4)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    t = nb.tensor(np.ones((2, 2)))
    assert (t.ndim, t.size, t.shape) == (2, 4, (2, 2))


def test_a_placed_value_does_not_follow_its_source_and_blocks_are_read_only():
    src = np.zeros(3)
    t = nb.tensor(src)
    src[0] = 5
    assert t.numpy()[0] == 0
    s = t.shard(DeviceMesh("m", (3,), ("x",)), ["x"])
    with pytest.raises(ValueError):
        s.shards[0][0] = 1.0


def test_partial_placement_of_a_host_value():
    x = nb.tensor(np.arange(4.0))
    p = x.shard(MESH, [None], partial_axes=["tp"])
    assert p.sharding.partial_axes == ("tp",)
    np.testing.assert_array_equal(p.shards[0], np.arange(4.0))
    np.testing.assert_array_equal(p.shards[1], np.zeros(4))
    np.testing.assert_array_equal(p.numpy(), np.arange(4.0))


def test_shard_errors_name_the_problem():
    x = nb.ones((4, 4))
    with pytest.raises(ShardingError, match=r"2 dims but the tensor has shape \(4,\)"):
        nb.ones(4).shard(MESH, ["dp", None])
    with pytest.raises(ShardingError, match="unknown axis 'zz'"):
        x.shard(MESH, ["zz", None])
    with pytest.raises(ShardingError, match="used twice"):
        x.shard(MESH, ["dp", "dp"])


def test_reading_an_abstract_tensor_raises():
    a = nb.abstract((4, 4))
    with pytest.raises(ShardingError, match="abstract"):
        a.numpy()


@given(sharded_arrays())
def test_random_placements_round_trip(pair):
    t, x = pair
    assert_sharded_allclose(t, x, rtol=0, atol=0)


@given(sharded_arrays(partial=False), st.data())
def test_reshard_to_another_spec_keeps_value(pair, data):
    from nabla.testing import specs
    t, x = pair
    target = data.draw(specs(t.mesh, t.shape, partial=False))
    u = t.shard(t.mesh, target.dim_specs)
    assert_sharded_allclose(u, x, rtol=0, atol=0)


def test_repr_iteration_and_scalars():
    m = DeviceMesh("m", (2,), ("x",))
    t = nb.arange(6.0).reshape(2, 3).shard(m, ["x", None])
    assert repr(t) == 'Tensor([[0., 1., 2.],\n        [3., 4., 5.]], dtype=float64, sharding=[{"x"}, {}] on @m)'
    assert [row.tolist() for row in t] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert t.sum().item() == 15.0 and len(t) == 2
    assert repr(nb.abstract((3,))) == "Tensor(abstract, shape=(3,), dtype=float32)"
    assert repr(nb.ones((10, 10))) == "Tensor(shape=(10, 10), dtype=float32)"


def test_tensors_are_immutable():
    m = DeviceMesh("m", (2, 2), ("x", "y"))
    v = np.arange(16.0).reshape(4, 4)
    t = nb.tensor(v).shard(m, ["x", None])
    y = t * 2
    for blocks in (t.shards, y.shards, y.T.shards):
        with pytest.raises(ValueError, match="read-only"):
            blocks[0][0, 0] = 99.0
    np.testing.assert_array_equal(y.numpy(), v * 2)


def test_placing_a_numpy_array_keeps_no_view_of_it():
    m = DeviceMesh("m", (2,), ("x",))
    v = np.arange(8.0).reshape(2, 4)
    t = nb.tensor(v)
    s = t.shard(m, ["x", None])
    host = np.arange(8.0).reshape(2, 4)
    r = nb.reshape(host, (8,))      # a host operand of an op
    mixed = s + host                # a host operand met by a sharded one
    v[:] = -1
    host[:] = -1
    np.testing.assert_array_equal(t.numpy(), np.arange(8.0).reshape(2, 4))
    np.testing.assert_array_equal(s.numpy(), np.arange(8.0).reshape(2, 4))
    np.testing.assert_array_equal(r.numpy(), np.arange(8.0))
    np.testing.assert_array_equal(mixed.numpy(), 2 * np.arange(8.0).reshape(2, 4))
    assert v.flags.writeable and host.flags.writeable  # the caller's arrays are left writeable


def test_an_open_dim_in_with_sharding_keeps_what_the_value_has():
    """Like JAX's P.UNCONSTRAINED: C on [x, -] asked for [{?}, {}] stays [x, -] and nothing moves."""
    m = DeviceMesh("m", (2, 2), ("x", "y"))
    v = np.arange(16.0).reshape(4, 4)
    c = nb.tensor(v).shard(m, ["x", None])
    with nb.comm_log() as log:
        u = c.with_sharding(m, [DimSpec([], is_open=True), DimSpec([])])
        w = c.with_sharding(m, [DimSpec(["x"], is_open=True), "y"])  # "at least x": x kept, y added locally
        z = c.with_sharding(m, [DimSpec(["y"], is_open=True), DimSpec([])])  # y is not a prefix of x: moved
    assert u.sharding.dim_specs[0].axes == ("x",) and u.sharding.dim_specs[0].is_open
    assert w.sharding.dim_specs[0].axes == ("x",) and w.sharding.dim_specs[1].axes == ("y",)
    assert z.sharding.dim_specs[0].axes == ("y",)
    assert log.counts == {"collective_permute": 1}  # only z moved
    for t in (u, w, z):
        np.testing.assert_array_equal(t.numpy(), v)


# ---- numpy's protocols -----------------------------------------------------------------------------------

A = np.arange(40, dtype=np.float32).reshape(5, 8) / 7


def _sharded(a=A, dims=("dp", "tp")):
    return nb.tensor(a).shard(MESH, list(dims))


def test_numpy_ufuncs_give_sharded_tensors():
    t = _sharded()
    cases = {
        "exp": (np.exp(t), np.exp(A)), "maximum": (np.maximum(t, 2), np.maximum(A, 2)),
        "add numpy first": (np.add(A, t), A + A), "ndarray + t": (A + t, A + A), "ndarray * t": (A * t, A * A),
        "power": (np.power(t, 2), A ** 2), "abs": (np.abs(-t), A), "negative": (np.negative(t), -A),
        "sqrt": (np.sqrt(t), np.sqrt(A)), "divide": (np.divide(t, 3), A / 3), "square": (np.square(t), A * A),
        "tanh": (np.tanh(t), np.tanh(A)), "greater": (np.greater(t, 2), A > 2), "ndarray == t": (A == t, A == A),
        "minimum": (np.minimum(A, t), A), "positive": (np.positive(t), A),
    }
    for name, (got, want) in cases.items():
        assert isinstance(got, Tensor) and got.sharding is not None, name
        assert_sharded_allclose(got, want)
    # the layout is propagated, not gathered: an elementwise op keeps [dp|tp]
    assert [d.axes for d in np.exp(t).sharding.dim_specs] == [("dp",), ("tp",)]
    m = np.matmul(t, np.transpose(t))
    assert isinstance(m, Tensor) and m.sharding.partial_axes == ("tp",)
    assert_sharded_allclose(m, A @ A.T, rtol=1e-5, atol=1e-4)
    assert_sharded_allclose(np.add.reduce(t, axis=1), A.sum(1))
    assert_sharded_allclose(np.maximum.reduce(t), A.max(0))


def test_numpy_functions_give_sharded_tensors():
    t = _sharded()
    b = np.arange(8, dtype=np.float32)
    cases = {
        "sum": (np.sum(t), A.sum()), "sum axis keepdims": (np.sum(t, axis=0, keepdims=True), A.sum(0, keepdims=True)),
        "sum initial": (np.sum(t, axis=1, initial=1.0), A.sum(1) + 1), "mean": (np.mean(t, axis=1), A.mean(1)),
        "max": (np.max(t, axis=1), A.max(1)), "amax": (np.amax(t), A.max()), "min": (np.min(t, 0), A.min(0)),
        "amin keepdims": (np.amin(t, axis=1, keepdims=True), A.min(1, keepdims=True)),
        "argmax": (np.argmax(t, axis=1), A.argmax(1)), "argmax all": (np.argmax(t), A.argmax()),
        "argmax keepdims": (np.argmax(t, axis=0, keepdims=True), A.argmax(0)[None]),
        "transpose": (np.transpose(t), A.T), "reshape": (np.reshape(t, (8, 5)), A.reshape(8, 5)),
        "ravel": (np.ravel(t), A.ravel()),
        "concatenate": (np.concatenate([t, t], axis=1), np.concatenate([A, A], 1)),
        "concatenate none": (np.concatenate([t, b], axis=None), np.concatenate([A.ravel(), b])),
        "stack": (np.stack([t, t], axis=1), np.stack([A, A], 1)),
        "where": (np.where(t > 2, t, 0.0), np.where(A > 2, A, 0.0)),
        "einsum": (np.einsum("ij,j->i", t, b), A @ b), "squeeze": (np.squeeze(np.expand_dims(t, 0)), A),
        "expand_dims": (np.expand_dims(t, -1), A[..., None]), "swapaxes": (np.swapaxes(t, 0, 1), A.T),
        "moveaxis": (np.moveaxis(np.expand_dims(t, 0), 0, -1), A[..., None]),
        "broadcast_to": (np.broadcast_to(t[0], (3, 8)), np.broadcast_to(A[0], (3, 8))),
        "dot": (np.dot(t, b), A @ b), "clip": (np.clip(t, 1, 3), np.clip(A, 1, 3)),
        "zeros_like": (np.zeros_like(t), np.zeros_like(A)), "full_like": (np.full_like(t, 2.5), np.full_like(A, 2.5)),
    }
    for name, (got, want) in cases.items():
        assert isinstance(got, Tensor) and got.sharding is not None, name
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.ones_like(t).sharding == t.sharding  # the layout of the model, each device filling its block
    assert np.copy(t) is t  # immutable: a copy is the same value
    assert (np.shape(t), np.ndim(t), np.size(t), np.size(t, 1)) == ((5, 8), 2, 40, 8)
    assert np.result_type(t, np.float64) == np.float64


def test_numpy_composites_name_the_users_op_in_the_comm_log():
    t = _sharded(dims=(None, "tp"))
    with nb.comm_log() as log:
        np.argmax(t, axis=1)
        t.argmax(1)
    assert {e.op for e in log.events} == {"argmax"} and len(log.events) == 4


def test_host_reads_stay_host_reads():
    t = _sharded()
    a = np.asarray(t)
    assert type(a) is np.ndarray and np.array_equal(a, A)
    assert np.array(t, dtype=np.float64).dtype == np.float64
    np.testing.assert_allclose(t, A)  # numpy.testing reads through __array__


def test_numpy_without_a_sharded_version_raises_and_points_to_numpy():
    t = _sharded()
    for call, name in [(lambda: np.median(t), "np.median"), (lambda: np.cbrt(t), "np.cbrt"),
                       (lambda: np.add.accumulate(t), "np.add.accumulate"), (lambda: np.allclose(t, A), "np.allclose"),
                       (lambda: np.where(t > 1), "np.where(condition)"), (lambda: np.linalg.norm(t), "np.norm"),
                       (lambda: np.exp(t, where=A > 1), "np.exp")]:
        # (an op nabla adds for one of them is set aside here: the test reserves no name)
        with numpy_unanswered("median", "cbrt", "allclose", "norm"), \
                pytest.raises(ShardingError, match="not supported on nabla tensors") as e:
            call()
        assert name in str(e.value) and "t.numpy()" in str(e.value), name
    with pytest.raises(ShardingError, match="tensors are immutable"):
        np.exp(t, out=np.empty((5, 8), np.float32))
    with pytest.raises(ShardingError, match="tensors are immutable"):
        np.sum(t, out=np.empty((), np.float32))


def test_numpy_defers_to_other_array_types():
    class Other:
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            return "other"

        def __array_function__(self, func, types, args, kwargs):
            return "other"

    assert np.add(_sharded(), Other()) == "other"
    assert np.concatenate([_sharded(), Other()]) == "other"


# ---- DTensor habits: from_local / to_local --------------------------------------------------------------------


def test_from_local_and_to_local_round_trip():
    t = _sharded(dims=("dp", None))
    blocks = {d: t.to_local(d) for d in MESH.devices}
    np.testing.assert_array_equal(blocks[5], A[3:5])
    for given in (blocks, [blocks[d] for d in MESH.devices]):
        u = nb.from_local(given, MESH, ["dp", None])
        assert u.shape == (5, 8) and u.sharding == t.sharding
        assert_sharded_allclose(u, A)
    # uneven and empty blocks: 5 over 4 gives 2, 2, 1, 0
    m = DeviceMesh("m", (4,), ("d",))
    v = nb.from_local([np.arange(2.0), np.arange(2.0, 4), np.arange(4.0, 5), np.zeros(0)], m, ["d"])
    np.testing.assert_array_equal(v.numpy(), np.arange(5.0))
    assert v.to_local(3).shape == (0,)
    # a PartitionSpec-like short list is not padded, but a NamedSharding is
    w = nb.from_local(blocks, nb.NamedSharding(MESH, ["dp"]))
    assert w.sharding == t.sharding
    # partial: each device holds a summand (they need not agree)
    parts = {d: np.full((5, 2), float(d)) for d in MESH.devices}
    p = nb.from_local(parts, MESH, [None, "tp"], partial_axes=["dp"])
    np.testing.assert_array_equal(p.numpy()[:, 2:4], np.full((5, 2), 1.0 + 5.0))
    assert p.to_local(5)[0, 0] == 5.0


def test_from_local_checks_shapes_and_replicas_naming_the_device():
    t = _sharded(dims=("dp", None))
    blocks = {d: t.to_local(d) for d in MESH.devices}
    bad = dict(blocks)
    bad[6] = blocks[6] + 1  # device 6 is a replica of devices 4, 5, 7 (tp is not used)
    with pytest.raises(ShardingError, match="devices 4 and 6 hold the same block"):
        nb.from_local(bad, MESH, ["dp", None])
    bad = dict(blocks)
    bad[7] = blocks[7][:1]
    with pytest.raises(ShardingError, match="devices 4 and 7 hold the same shard of dim 0"):
        nb.from_local(bad, MESH, ["dp", None])
    m = DeviceMesh("m", (4,), ("d",))
    with pytest.raises(ShardingError, match=r"block of device 0 has shape \(1,\), but a \(5,\) tensor .* gives "
                                            r"device 0 a block of \(2,\)"):
        nb.from_local([np.ones(1), np.ones(2), np.ones(2), np.ones(0)], m, ["d"])
    with pytest.raises(ShardingError, match="no block for device 3"):
        nb.from_local({0: np.ones(1), 1: np.ones(1), 2: np.ones(1)}, m, ["d"])
    with pytest.raises(ShardingError, match="device 9 is not in mesh"):
        nb.from_local({9: np.ones(1)}, m, ["d"])
    with pytest.raises(ShardingError, match="3 blocks for the 4 devices"):
        nb.from_local([np.ones(1)] * 3, m, ["d"])
    with pytest.raises(ShardingError, match="block of device 1 has dtype int64 but device 0's has float64"):
        nb.from_local([np.ones(1), np.ones(1, np.int64), np.ones(1), np.ones(1)], m, ["d"])
    with pytest.raises(ShardingError, match="to_local: device 70 is not in mesh @cluster"):
        t.to_local(70)
    with pytest.raises(ShardingError, match="call t.to_local\\(device_id\\)"):
        t.to_local()
    np.testing.assert_array_equal(nb.tensor(A).to_local(), A)


def test_dtensor_and_jax_spellings():
    t = _sharded(dims=("dp", None))
    with nb.comm_log() as log:
        full = t.full_tensor()  # gathered with a logged collective, unlike .numpy()
    assert type(full) is np.ndarray and np.array_equal(full, A) and log.counts == {"all_gather": 1}
    u = t.redistribute(MESH, [None, "dp"])
    assert u.sharding.dim_specs[1].axes == ("dp",) and np.array_equal(u.numpy(), A)
    v = nb.device_put(A, nb.NamedSharding(MESH, ["tp"]))
    assert v.sharding.dim_specs[0].axes == ("tp",) and np.array_equal(v.shards[6], A[4:5])
    assert nb.device_put(v, nb.NamedSharding(MESH, [])).sharding.is_replicated


def test_tensor_ones_and_zeros_validate_as_nb_ones_does():
    # Tensor.ones / Tensor.zeros once called numpy directly: TypeError, ValueError instead of a ShardingError
    for bad in (None, "ab", (2**40, 2**40), (-1,), (2.5,)):
        for make in (Tensor.ones, Tensor.zeros):
            with pytest.raises(ShardingError, match="shape"):
                make(bad)
    assert Tensor.ones(3).dtype == np.float32 and Tensor.zeros((2, 0), "int8").shape == (2, 0)


def test_abstract_dtype_none_means_what_nb_ones_means():
    a = nb.abstract((4,), dtype=None)
    assert a.dtype == nb.ones((4,), dtype=None).dtype == np.ones(4, dtype=None).dtype
    assert (a + 1).dtype == np.float64 and nb.exp(a.shard(MESH, ["tp"])).dtype == np.float64
