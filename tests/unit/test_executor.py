import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh, ShardingError
from nabla import executor, propagation, reshard

MESH = DeviceMesh("m", (2, 2), ("x", "y"))


def test_a_seen_op_recomputes_nothing():
    a = nb.random.normal((8, 8)).shard(MESH, ["x", None])
    b = nb.random.normal((8, 8), seed=1).shard(MESH, [None, "y"])
    a @ b
    before = (executor._program.cache_info(), propagation.propagate.cache_info(), reshard._plan.cache_info())
    for _ in range(5):
        a @ b
    after = (executor._program.cache_info(), propagation.propagate.cache_info(), reshard._plan.cache_info())
    assert after[0].hits == before[0].hits + 5 and after[0].misses == before[0].misses
    assert after[1].misses == before[1].misses and after[2].misses == before[2].misses


def test_kernels_run_once_for_all_devices():
    """The stored result is one array with the mesh axes in front, not a per-device loop."""
    a = nb.random.normal((8, 8)).shard(MESH, ["x", "y"])
    out = nb.exp(a)
    assert out._data.shape == (2, 2, 4, 4)


def test_no_global_copy_is_kept():
    a = nb.random.normal((8, 8)).shard(MESH, ["x", "y"])
    out = a + a
    assert out._data.size == 64  # exactly the blocks: 4 devices x 16 elements
    rep = nb.random.normal((8, 8)).shard(MESH, ["x", None])
    assert rep._data.shape == (2, 1, 4, 8)  # replicas over y are stored once: 64 elements, not 128


def test_host_operands_become_open_and_are_sliced_locally():
    a = nb.random.normal((8, 8)).shard(MESH, ["x", "y"])
    with nb.comm_log() as log:
        out = a + np.ones((8, 8), np.float32)
    assert log.events == [] and out.sharding.dim_specs[0].axes == ("x",)


def test_mesh_mismatch_names_both_meshes():
    other = DeviceMesh("n", (4,), ("x",))
    with pytest.raises(ShardingError, match=r"add: operand 0 is on mesh @m .* operand 1 is on mesh @n"):
        nb.ones(4).shard(MESH, ["x"]) + nb.ones(4).shard(other, ["x"])


def test_abstract_values_skip_kernels():
    a = nb.abstract((64, 64)).shard(MESH, ["x", None])
    out = nb.relu(a @ nb.abstract((64, 32)).shard(MESH, [None, "y"]))
    assert out.is_abstract and out.shape == (64, 32) and out.dtype == np.float32
    assert out.sharding.dim_specs[1].axes == ("y",)
    host = nb.abstract((3, 4)) + 1.0
    assert host.is_abstract and host.shape == (3, 4) and host.sharding is None


def test_dtype_of_results_follows_numpy():
    i = nb.tensor(np.arange(4, dtype=np.int16)).shard(MESH, ["x"])
    assert (i + i).dtype == np.int16 and i.sum().dtype == np.sum(np.arange(4, dtype=np.int16)).dtype
    assert nb.exp(i).dtype == np.exp(np.arange(4, dtype=np.int16)).dtype
    assert (i > 1).dtype == np.bool_ and i.argmax().dtype == np.intp


def test_a_partial_value_is_summed_once_for_many_uses():
    """Tensors are immutable, so the sum made for relu is reused by tanh and exp: one all_reduce, not three."""
    a = nb.random.normal((8, 8)).shard(MESH, [None, "y"])
    w = nb.random.normal((8, 8), seed=1).shard(MESH, ["y", None])
    p = a @ w
    assert p.sharding.partial_axes == ("y",)
    with nb.comm_log() as log:
        r, t, e = nb.relu(p), nb.tanh(p), nb.exp(p)
    assert log.counts == {"all_reduce": 1}
    ref = a.numpy() @ w.numpy()
    np.testing.assert_allclose(t.numpy(), np.tanh(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e.numpy(), np.exp(ref), rtol=1e-5, atol=1e-6)

