"""Value's read-only accessors: what readers outside the executor see of a value, and that they cannot change it."""

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh, ShardingSpec
from nabla.executor import Value as ReExported
from nabla.value import Value

MESH = DeviceMesh("m", (2, 2), ("x", "y"))
ACCESSORS = ("shape", "dtype", "sharding", "blocks", "is_abstract")


def test_a_sharded_tensor_reads_through_its_accessors():
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = nb.tensor(host).shard(MESH, ["x", "y"])
    assert isinstance(t, Value) and ReExported is Value
    assert t.shape == (4, 6) and t.dtype == np.float32 and not t.is_abstract
    assert isinstance(t.sharding, ShardingSpec) and t.sharding == t._spec
    blocks = t.blocks
    assert blocks.shape == (2, 2, 2, 3)  # the device grid, then one block
    np.testing.assert_array_equal(blocks[1, 0], host[2:, :3])
    np.testing.assert_array_equal(blocks[1, 0], t.shards[2])
    assert not blocks.flags.writeable
    with pytest.raises(ValueError):
        blocks[0, 0, 0, 0] = 1.0


def test_blocks_are_read_only_even_when_the_stored_array_is_not():
    data = np.zeros((2, 3), np.float32)
    v = Value(data, None, (2, 3), data.dtype)
    assert v.blocks is not data and not v.blocks.flags.writeable and data.flags.writeable
    assert np.shares_memory(v.blocks, data)  # a view, not a copy


def test_an_abstract_tensor_reads_through_its_accessors():
    a = nb.abstract((3, 5), "float16")
    assert a.shape == (3, 5) and a.dtype == np.float16 and a.is_abstract
    assert a.blocks is None and a.sharding is None
    s = a.shard(MESH, [None, "y"])
    assert s.is_abstract and s.blocks is None and s.sharding.mesh == MESH and s.shape == (3, 5)


@pytest.mark.parametrize("name", ACCESSORS)
def test_assigning_an_accessor_raises(name):
    t = nb.tensor(np.ones((2, 2), np.float32)).shard(MESH, ["x", None])
    v = Value(None, None, (2,), np.dtype(np.float32))
    for x in (t, v):
        before = getattr(x, name)
        with pytest.raises(AttributeError):
            setattr(x, name, before)
        with pytest.raises(AttributeError):
            delattr(x, name)
    assert t.shape == (2, 2)
