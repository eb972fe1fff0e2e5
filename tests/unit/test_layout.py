import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nabla import DeviceMesh, ShardingSpec
from nabla.layout import chunk, is_nested
from nabla.testing import meshes, shapes, specs

MESH = DeviceMesh("cluster", (2, 4), ("dp", "tp"))


def test_ceil_rule_uneven_and_empty():
    s = ShardingSpec(DeviceMesh("m", (4,), ("x",)), ["x"])
    assert [s.shard_shape((5,), d) for d in range(4)] == [(2,), (2,), (1,), (0,)]
    assert [s.shard_slices((5,), d)[0] for d in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)]
    assert [s.shard_shape((0,), d) for d in range(4)] == [(0,)] * 4


def test_issue_example_device_5():
    s = ShardingSpec(MESH, ["dp", "tp"])
    assert s.shard_slices((5, 8), 5) == (slice(3, 5), slice(2, 4))
    assert s.shard_shape((5, 8), 5) == (2, 2)


def test_several_axes_on_one_dim_are_major_to_minor():
    s = ShardingSpec(MESH, [("tp", "dp")])
    # device 1 is dp=0, tp=1 -> position 1*2+0 = 2 of 8
    assert s.shard_slices((16,), 1) == (slice(4, 6),)
    assert s.shard_slices((16,), 4) == (slice(2, 4),)


def test_sub_axes_layout():
    m = DeviceMesh("m", (8,), ("x",))
    s = ShardingSpec(m, ["x:(1)2", "x:(2)4"])
    # device 6: x:(1)2 coord 1, x:(2)4 coord 2
    assert s.shard_slices((4, 8), 6) == (slice(2, 4), slice(4, 6))


def test_replicas_on_unused_axes():
    s = ShardingSpec(MESH, ["dp", None])
    assert len({tuple((x.start, x.stop) for x in s.shard_slices((4, 3), d)) for d in range(8)}) == 2


def test_nesting():
    assert chunk(5, 4) == 2 and chunk(5, 1) == 5
    assert is_nested(8, 2, 2)  # 4,4 -> 2,2,2,2
    assert not is_nested(5, 2, 2)  # 3,2 cut in two is 2,1,1,1 but the ceil rule for 4 is 2,2,1,0


@given(st.data())
def test_blocks_tile_the_value_once_per_replica(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes())
    spec = data.draw(specs(mesh, shape, partial=False))
    cover = np.zeros(shape, dtype=np.int64)
    for d in mesh.devices:
        sl = spec.shard_slices(shape, d)
        assert spec.shard_shape(shape, d) == tuple(s.stop - s.start for s in sl)
        cover[sl] += 1
    replicas = mesh.size // np.prod([spec.num_shards(i) for i in range(len(shape))], dtype=np.int64)
    assert (cover == replicas).all()


@pytest.mark.parametrize("n, k", [(5, 4), (9, 2), (3, 3), (1, 4), (0, 2)])
def test_chunks_sum_to_the_dim(n, k):
    s = ShardingSpec(DeviceMesh("m", (k,), ("x",)), ["x"])
    assert sum(s.shard_shape((n,), d)[0] for d in range(k)) == n
