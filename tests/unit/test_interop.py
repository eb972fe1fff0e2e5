import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import nabla as nb
from nabla import ShardingError

pytest.importorskip("jax")


def test_round_trip_through_jax_on_forced_host_devices():
    code = textwrap.dedent("""
        import numpy as np, nabla as nb
        from nabla import DeviceMesh
        mesh = DeviceMesh("m", (2, 4), ("dp", "tp"))
        x = np.arange(32, dtype=np.float32).reshape(4, 8)
        t = nb.tensor(x).shard(mesh, ["dp", "tp"])
        j = t.to_jax()
        assert tuple(j.sharding.spec) == ("dp", "tp"), j.sharding.spec
        assert {s.device.id: s.data.shape for s in j.addressable_shards}[5] == (2, 2)
        np.testing.assert_array_equal(np.asarray(j), x)
        back = nb.from_jax(j)
        assert back.sharding.dim_specs[0].axes == ("dp",) and back.sharding.dim_specs[1].axes == ("tp",)
        np.testing.assert_array_equal(back.shards[5], x[2:4, 2:4])
        try:
            nb.tensor(np.ones((5, 8), np.float32)).shard(mesh, ["dp", None]).to_jax()
            raise SystemExit("uneven dim did not raise")
        except nb.ShardingError as e:
            assert "dim 0 of size 5 is split over 2 shards" in str(e), e
        p = nb.tensor(x).shard(mesh, [None, "tp"]) @ nb.tensor(x.T).shard(mesh, ["tp", None])
        np.testing.assert_allclose(nb.from_jax(p.to_jax()).numpy(), x @ x.T, rtol=1e-5)
        print("ok")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_unknown_backend():
    with nb.backend("numpy"):
        assert (nb.ones(2) + 1).numpy().tolist() == [2.0, 2.0]
    with pytest.raises(ShardingError, match="unknown backend 'tpu'"):
        with nb.backend("tpu"):
            pass


# ---- in-process jax (tests/conftest.py gives the pytest process 8 CPU devices) ------------------------------


def _jax8():
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 jax devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax


def test_to_jax_gives_a_concrete_sharding_device_put_accepts():
    jax = _jax8()
    from jax.sharding import PartitionSpec as P

    mesh = nb.DeviceMesh("m", (2, 4), ("dp", "tp"))
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    y = nb.exp(nb.tensor(x).shard(mesh, ["dp", None]))  # an op's result: every dim open ({"dp", ?}, {?})
    assert y.sharding.dim_specs[1].is_open
    j = y.to_jax()
    assert j.sharding.spec == P("dp", None)  # closed None, never UNCONSTRAINED, in a concrete array
    z = jax.device_put(x, j.sharding)
    assert z.sharding == j.sharding
    np.testing.assert_allclose(np.asarray(z), x)
    np.testing.assert_allclose(np.asarray(j), np.exp(x), rtol=1e-6)
    named = nb.NamedSharding(mesh, P(None, "tp"))
    assert named.to_jax().spec == P(None, "tp") and named.to_jax().mesh.axis_names == ("dp", "tp")


def test_from_jax_comes_back_onto_the_same_mesh():
    jax = _jax8()
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = nb.DeviceMesh("m2", (2, 4), ("dp", "tp"))
    x = nb.tensor(np.arange(32, dtype=np.float32).reshape(4, 8)).shard(mesh, ["dp", "tp"])
    back = nb.from_jax(x.to_jax())
    assert back.mesh is mesh and back.sharding == x.sharding
    np.testing.assert_array_equal((back + x).numpy(), 2 * x.numpy())  # same mesh: mixing works
    # a jax mesh built separately, equal by devices and axis names, maps to the same nabla mesh
    jm = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    a = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(jm, P(None, "tp")))
    assert nb.from_jax(a).mesh is mesh
    # onto a given mesh: the same PartitionSpec there
    other = nb.DeviceMesh("other", (4, 2), ("tp", "dp"))
    c = nb.from_jax(x.to_jax(), mesh=other)
    assert c.mesh is other and [d.axes for d in c.sharding.dim_specs] == [("dp",), ("tp",)]
    np.testing.assert_array_equal(c.numpy(), x.numpy())
    with pytest.raises(ShardingError, match="unknown axis 'dp'"):
        nb.from_jax(x.to_jax(), mesh=nb.DeviceMesh("z", (8,), ("d",)))
    # a mesh jax made on its own becomes a new mesh named "jax"
    jm3 = Mesh(np.array(jax.devices()[:8]).reshape(8), ("q",))
    d = nb.from_jax(jax.device_put(np.ones(8, np.float32), NamedSharding(jm3, P("q"))))
    assert d.mesh.name == "jax" and d.mesh.axis_names == ("q",)


def test_from_jax_reads_unreduced_arrays_as_partial():
    jax = _jax8()
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    jm = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    w = np.arange(16, dtype=np.float32).reshape(8, 2)
    xs = jax.device_put(x, NamedSharding(jm, P("dp", "tp")))
    ws = jax.device_put(w, NamedSharding(jm, P("tp", None)))
    with jax.sharding.set_mesh(jm):
        y = jax.jit(lambda a, b: jnp.einsum("ij,jk->ik", a, b, out_sharding=P("dp", None, unreduced={"tp"})))(xs, ws)
    assert y.sharding.spec.unreduced  # jax refuses list(spec) and device_indices_map on it
    t = nb.from_jax(y)
    assert t.sharding.partial_axes == ("tp",) and t.sharding.dim_specs[0].axes == ("dp",)
    np.testing.assert_allclose(t.numpy(), x @ w)
    with nb.comm_log() as log:
        r = nb.relu(t)
    assert log.counts == {"all_reduce": 1}
    np.testing.assert_allclose(r.numpy(), x @ w)


def test_without_jax_every_jax_entry_point_says_how_to_install_it():
    """jax is an optional extra: with it absent (simulated: sys.modules["jax"] = None), nb.jit, to_jax,
    from_jax, from_process_local and distributed.initialize raise ShardingError with the install hint."""
    code = textwrap.dedent("""
        import sys
        sys.modules["jax"] = None  # import jax now fails, as when it is not installed
        import numpy as np, nabla as nb
        mesh = nb.DeviceMesh("m", (2,), ("x",))
        t = nb.tensor(np.ones(4, np.float32)).shard(mesh, ["x"])
        calls = {
            "jit": lambda: nb.jit(lambda a: a * 2)(t),
            "to_jax": lambda: t.to_jax(),
            "from_jax": lambda: nb.from_jax(object()),
            "from_process_local": lambda: nb.from_process_local(np.ones(4, np.float32), mesh, ["x"], (4,)),
            "initialize": lambda: nb.distributed.initialize("localhost:1", 1, 0),
            "named_sharding": lambda: nb.NamedSharding(mesh, ["x"]).to_jax(),
        }
        for name, call in calls.items():
            try:
                call()
            except nb.ShardingError as e:
                assert "pip install 'nabla-spmd[jax]'" in str(e), (name, e)
            else:
                raise SystemExit(name + " did not raise")
        assert (t * 2).numpy().tolist() == [2.0] * 4  # numpy nabla works without jax
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_from_jax_of_something_else_is_a_sharding_error():
    _jax8()
    with pytest.raises(ShardingError, match="expects a jax.Array, got object"):
        nb.from_jax(object())
    with pytest.raises(ShardingError, match="expects a jax.Array, got ndarray"):
        nb.from_jax(np.ones(3))


def test_to_jax_keeps_a_partial_value_unreduced_and_jax_sums_it():
    jax = _jax8()
    from jax.sharding import PartitionSpec as P

    mesh = nb.DeviceMesh("mp", (2, 4), ("dp", "tp"))
    x = np.arange(32, dtype=np.float32).reshape(4, 8) / 7
    p = nb.tensor(x).shard(mesh, ["dp", "tp"]) @ nb.tensor(x.T).shard(mesh, ["tp", None])
    assert p.sharding.partial_axes == ("tp",)
    with nb.comm_log() as log:
        j = p.to_jax()
    assert log.events == []  # nothing summed: each device's summand goes to jax as it is
    assert j.sharding.spec == P("dp", None, unreduced={"tp"})
    with jax.sharding.set_mesh(j.sharding.mesh):  # jax's own reduction of the unreduced axis
        total = jax.jit(lambda a: jax.sharding.reshard(a, P("dp", None)))(j)
    np.testing.assert_allclose(np.asarray(total), x @ x.T, rtol=1e-5)
    back = nb.from_jax(j)
    assert back.mesh is mesh and back.sharding == p.sharding.layout()  # jax keeps no open dims
    for d in mesh.devices:
        np.testing.assert_array_equal(back.shards[d], p.shards[d])


def test_to_jax_puts_sub_axes_on_a_jax_mesh_with_the_axis_split():
    jax = _jax8()
    from jax.sharding import PartitionSpec as P

    mesh = nb.DeviceMesh("ms", (8,), ("x",), devices=[3, 1, 0, 2, 7, 5, 4, 6])
    v = np.arange(64, dtype=np.float32).reshape(8, 8)
    t = nb.tensor(v).shard(mesh, ["x:(1)2", "x:(2)4"])
    j = t.to_jax()
    assert dict(zip(j.sharding.mesh.axis_names, j.sharding.mesh.devices.shape)) == {"x:(1)2": 2, "x:(2)4": 4}
    assert j.sharding.spec == P("x:(1)2", "x:(2)4")
    for shard in j.addressable_shards:  # each jax device holds nabla's block of it
        np.testing.assert_array_equal(np.asarray(shard.data), t.shards[shard.device.id])
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a * 2)(j)), v * 2)
    back = nb.from_jax(j)
    assert back.mesh is mesh and back.sharding == t.sharding
    # partial over a sub-axis: unreduced on the split mesh, and back
    p = nb.tensor(v).shard(mesh, [None, "x:(2)4"], partial_axes=["x:(1)2"])
    jp = p.to_jax()
    assert jp.sharding.spec == P(None, "x:(2)4", unreduced={"x:(1)2"})
    with jax.sharding.set_mesh(jp.sharding.mesh):
        total = jax.jit(lambda a: jax.sharding.reshard(a, P(None, "x:(2)4")))(jp)
    np.testing.assert_array_equal(np.asarray(total), v)
    bp = nb.from_jax(jp)
    assert bp.sharding == p.sharding and bp.mesh is mesh
    np.testing.assert_array_equal(bp.numpy(), v)
    with pytest.raises(ShardingError, match="dim 0 of size 5 is split over 2 shards"):
        nb.tensor(np.ones((5, 8), np.float32)).shard(mesh, ["x:(1)2", None]).to_jax()
