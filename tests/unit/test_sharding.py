"""Every spelling of a placement users bring: dim lists, ShardingSpec, jax PartitionSpec, nb.NamedSharding."""

import pickle

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh, DimSpec, ShardingError, ShardingSpec

MESH = DeviceMesh("cluster", (2, 4), ("dp", "tp"))
X = np.arange(40, dtype=np.float32).reshape(5, 8)


def test_named_sharding_is_a_hashable_value():
    a = nb.NamedSharding(MESH, ["dp", None])
    b = nb.NamedSharding(MESH, ShardingSpec(MESH, [DimSpec(["dp"]), None]))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.mesh is MESH and a.spec == ShardingSpec(MESH, ["dp", None])
    assert a != nb.NamedSharding(MESH, [None, "dp"]) and a != "dp"
    assert repr(a) == 'NamedSharding(mesh=@cluster = <["dp"=2, "tp"=4]>, spec=[{"dp"}, {}])'
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a.mesh = None
    # JAX's helpers
    assert a.shard_shape((5, 8)) == (3, 8) and a.shard_shape((5, 8), 4) == (2, 8)
    assert a.devices_indices_map((5, 8))[5] == (slice(3, 5), slice(0, 8))
    assert a.device_set == frozenset(range(8)) and not a.is_fully_replicated
    assert nb.NamedSharding(MESH, []).is_fully_replicated


def test_named_sharding_refuses_bad_input():
    with pytest.raises(ShardingError, match="mesh must be a nabla DeviceMesh"):
        nb.NamedSharding("cluster", ["dp"])
    with pytest.raises(ShardingError, match="unknown axis 'zz'"):
        nb.NamedSharding(MESH, ["zz"])
    other = DeviceMesh("other", (8,), ("d",))
    with pytest.raises(ShardingError, match="is on mesh @other"):
        nb.NamedSharding(MESH, ShardingSpec(other, ["d"]))


def test_shard_takes_a_named_sharding_without_a_mesh_and_pads_it():
    t = nb.tensor(X).shard(nb.NamedSharding(MESH, ["dp"]))  # short: dim 1 replicated, as JAX pads
    assert t.sharding == ShardingSpec(MESH, ["dp", None])
    np.testing.assert_array_equal(t.shards[5], X[3:5])
    u = t.with_sharding(nb.NamedSharding(MESH, [None, "tp"]))
    assert u.sharding == ShardingSpec(MESH, [None, "tp"])
    np.testing.assert_array_equal(u.shards[5], X[:, 2:4])
    assert nb.tensor(X).shard(MESH, nb.NamedSharding(MESH, ["tp"])).sharding.dim_specs[0].axes == ("tp",)
    with pytest.raises(ShardingError, match="3 dims but the tensor has rank 2"):
        nb.tensor(X).shard(nb.NamedSharding(MESH, ["dp", None, None]))


def test_shard_takes_a_sharding_spec():
    spec = ShardingSpec(MESH, ["dp", "tp"])
    for t in (nb.tensor(X).shard(MESH, spec), nb.tensor(X).shard(spec)):
        assert t.sharding == spec
        np.testing.assert_array_equal(t.shards[5], X[3:5, 2:4])
    # its partial and replicated axes come along, and extra ones add up
    p = nb.tensor(X).shard(MESH, ShardingSpec(MESH, [None, "tp"], partial_axes=["dp"]))
    assert p.sharding.partial_axes == ("dp",)
    np.testing.assert_array_equal(p.shards[4], np.zeros((5, 2)))
    r = nb.tensor(X).shard(MESH, ShardingSpec(MESH, [None, None], replicated_axes=["tp"]), partial_axes=["dp"])
    assert r.sharding.replicated_axes == ("tp",) and r.sharding.partial_axes == ("dp",)
    # on a sharded value: a reshard
    with nb.comm_log() as log:
        q = nb.tensor(X).shard(MESH, ["dp", None]).with_sharding(MESH, ShardingSpec(MESH, [None, "dp"]))
    assert log.counts == {"all_to_all": 1}
    np.testing.assert_array_equal(q.numpy(), X)


def test_placement_errors_say_what_is_wrong():
    t = nb.tensor(X)
    other = DeviceMesh("other", (2, 4), ("dp", "tp"))
    with pytest.raises(ShardingError, match="is on mesh @other.*not on the mesh given @cluster"):
        t.shard(MESH, ShardingSpec(other, ["dp", None]))
    with pytest.raises(ShardingError, match=r"2 dims but the tensor has shape \(5, 8, 1\)"):
        nb.tensor(X[..., None]).shard(MESH, ShardingSpec(MESH, ["dp", None]))
    with pytest.raises(ShardingError, match="mesh must be a nabla DeviceMesh or NamedSharding, got str"):
        t.shard("cluster", ["dp", None])
    with pytest.raises(ShardingError, match="one entry per dim.*write \\['dp'\\]"):
        nb.ones(4).shard(MESH, "dp")
    with pytest.raises(ShardingError, match="got a NamedSharding .* and also dim_specs"):
        t.shard(nb.NamedSharding(MESH, ["dp"]), ["dp", None])


def test_shard_with_only_a_mesh_replicates():
    t = nb.tensor(X).shard(MESH)
    assert t.sharding == ShardingSpec(MESH, [None, None])
    np.testing.assert_array_equal(t.shards[7], X)


def test_jax_partition_specs_are_padded_and_open():
    pytest.importorskip("jax")
    from jax.sharding import PartitionSpec as P

    t = nb.tensor(X).shard(MESH, P("dp"))  # short: padded with None (closed), as JAX does
    assert t.sharding.dim_specs == (DimSpec(("dp",)), DimSpec(()))
    assert nb.tensor(X).shard(MESH, P()).sharding == ShardingSpec(MESH, [None, None])
    assert nb.tensor(X).shard(MESH, P(("dp", "tp"))).sharding.dim_specs[0].axes == ("dp", "tp")
    # UNCONSTRAINED is an open dim: with_sharding keeps what the value has there, nothing moves for it
    s = nb.tensor(X).shard(MESH, ["dp", "tp"])
    with nb.comm_log() as log:
        u = s.with_sharding(MESH, P(None, P.UNCONSTRAINED))
    assert u.sharding.dim_specs == (DimSpec(()), DimSpec(("tp",), is_open=True))
    assert log.counts == {"all_gather": 1}
    np.testing.assert_array_equal(u.numpy(), X)
    # unreduced axes are partial axes
    p = nb.tensor(X).shard(MESH, P(None, "tp", unreduced={"dp"}))
    assert p.sharding.partial_axes == ("dp",)
    np.testing.assert_array_equal(p.numpy(), X)
    with pytest.raises(ShardingError, match="3 dims but the tensor has rank 2"):
        nb.tensor(X).shard(MESH, P("dp", None, None))
    with pytest.raises(ShardingError, match="unknown axis 'x'"):
        nb.tensor(X).shard(MESH, P("x"))
    assert nb.NamedSharding(MESH, P("tp")).spec == ShardingSpec(MESH, ["tp"])


def test_a_placement_of_the_wrong_type_lists_the_forms_accepted():
    m = nb.DeviceMesh("m", (2,), ("x",))
    t = nb.tensor(np.ones(4))
    for bad in (object(), 5, {"x": 0}):
        with pytest.raises(nb.ShardingError, match="shard: dim_specs must be a list .* a ShardingSpec, a "
                                                    "PartitionSpec or an nb.NamedSharding; got"):
            t.shard(m, bad)
    assert t.shard(m, ("x",)).sharding == t.shard(m, ["x"]).sharding


def test_with_sharding_constraint_takes_what_jax_takes():
    m = nb.DeviceMesh("m", (2, 4), ("dp", "tp"))
    v = np.arange(32.0).reshape(8, 4)
    t = nb.tensor(v).shard(m, ["dp", "tp"])
    with nb.comm_log() as log:
        r = nb.with_sharding_constraint(t, nb.NamedSharding(m, ["dp", None]))
    assert r.sharding == ShardingSpec(m, ["dp", None]) and log.counts == {"all_gather": 1}
    np.testing.assert_array_equal(r.numpy(), v)
    tree = nb.with_sharding_constraint({"a": t, "b": [t, t]}, ShardingSpec(m, [None, None]))
    assert all(x.sharding == ShardingSpec(m, [None, None]) for x in (tree["a"], *tree["b"]))
    pair = nb.with_sharding_constraint((t, t), (ShardingSpec(m, [None, "tp"]), nb.NamedSharding(m, ["dp"])))
    assert pair[0].sharding.dim_specs[1].axes == ("tp",) and pair[1].sharding.dim_specs[0].axes == ("dp",)
    with pytest.raises(ShardingError, match="2 shardings for 3 values"):
        nb.with_sharding_constraint([t, t, t], [ShardingSpec(m, [None, None])] * 2)
