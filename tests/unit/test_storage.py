import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from nabla import DeviceMesh, ShardingSpec
from nabla import backends, storage
from nabla.layout import chunks, grid
from nabla.testing import meshes, shapes, specs

MESH = DeviceMesh("c", (2, 4), ("dp", "tp"))


def test_stored_shape_has_grid_then_chunk():
    s = ShardingSpec(MESH, ["dp", None])
    d = backends.NUMPY.place(np.arange(15.0).reshape(5, 3), s)
    assert d.shape == (2, 1, 3, 3)  # tp is replicated: stored once
    assert storage.block(d, s, (5, 3), 7).tolist() == [[9.0, 10.0, 11.0], [12.0, 13.0, 14.0]]


def test_blocks_are_views():
    s = ShardingSpec(MESH, ["dp", "tp"])
    d = backends.NUMPY.place(np.arange(64.0).reshape(8, 8), s)
    assert np.shares_memory(storage.block(d, s, (8, 8), 3), d)


def test_partial_place_puts_value_on_first_device_of_each_group():
    s = ShardingSpec(MESH, ["dp", None], partial_axes=["tp"])
    x = np.arange(8.0).reshape(4, 2)
    d = backends.NUMPY.place(x, s)
    assert storage.block(d, s, (4, 2), 0).tolist() == x[:2].tolist()
    assert storage.block(d, s, (4, 2), 1).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    np.testing.assert_array_equal(storage.assemble(d, s, (4, 2)), x)


def test_pad_regions_mark_only_past_the_end():
    s = ShardingSpec(DeviceMesh("m", (4,), ("x",)), ["x"])
    regions = storage.pad_regions(s, (5,), 0)  # blocks 2,2,1,0: shard 2 pads its last slot, shard 3 both
    assert regions == ((2, slice(1, None)), (3, slice(0, None)))
    assert storage.pad_regions(s, (8,), 0) == ()
    d = backends.NUMPY.place(np.arange(5.0), s)
    assert storage.fill(d, regions, -1.0).tolist() == [[0, 1], [2, 3], [4, -1], [-1, -1]]
    assert d[3].tolist() == [0.0, 0.0]  # the stored blocks themselves are untouched


def test_add_once_keeps_coordinate_zero():
    s = ShardingSpec(MESH, [None])
    d = backends.NUMPY.place(np.array([1.0, 2.0]), s)
    out = backends.NUMPY.add_once(d, s, ("tp",))
    wide = ShardingSpec(MESH, [None], partial_axes=["tp"])
    np.testing.assert_array_equal(storage.assemble(out, wide, (2,)), [1.0, 2.0])
    assert out.shape == grid(wide).shape + (2,)


@given(st.data())
def test_place_then_assemble_round_trips(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes())
    spec = data.draw(specs(mesh, shape))
    x = np.random.default_rng(0).standard_normal(shape)
    d = backends.NUMPY.place(x, spec)
    assert d.shape == grid(spec).shape + chunks(spec, shape)
    np.testing.assert_allclose(storage.assemble(d, spec, shape), x, rtol=1e-12, atol=1e-12)
    if not spec.partial_axes:
        for dev in mesh.devices:
            np.testing.assert_array_equal(storage.block(d, spec, shape, dev), x[spec.shard_slices(shape, dev)])


def test_a_sharded_0d_result_reads_back_0d():
    """Regression: np.ascontiguousarray made every 0-d global value 1-d ((1,) instead of ())."""
    import nabla as nb
    m = DeviceMesh("m", (4,), ("x",))
    s = nb.tensor(np.arange(5.0)).shard(m, ["x"]).sum()
    assert s.numpy().shape == () and float(s.numpy()) == 10.0 and float(s) == 10.0
    assert nb.tensor(np.float32(3)).shard(m, []).numpy().shape == ()
