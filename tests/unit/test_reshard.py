import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nabla as nb
from nabla import DeviceMesh, ShardingError, ShardingSpec
from nabla.propagation import keep_open
from nabla.reshard import plan
from nabla.testing import assert_comm, assert_sharded_allclose, meshes, shapes, specs

MESH = DeviceMesh("c", (2, 4), ("x", "y"))
X = np.arange(64, dtype=np.float32).reshape(8, 8)  # 256 bytes


def move(src_dims, dst_dims, value=X, mesh=MESH, src_partial=(), dst_partial=()):
    t = nb.tensor(value).shard(mesh, src_dims, partial_axes=src_partial)
    with nb.comm_log() as log:
        u = t.with_sharding(mesh, dst_dims, partial_axes=dst_partial)
    return u, log


def test_dim_to_dim_is_one_all_to_all_with_minimal_bytes():
    m = DeviceMesh("m", (4,), ("x",))
    u, log = move(["x", None], [None, "x"], mesh=m)
    assert_comm(log, all_to_all=1)
    # local block 64 B, k = 4: (k-1)/k * B = 48 B per device, i.e. N(k-1)/k^2 with N = 256
    assert log.events[0].bytes == 256 * 3 // 16 == 48
    assert log.events[0].axes == ("x",)
    assert_sharded_allclose(u, X, rtol=0, atol=0)


def test_adding_an_axis_is_a_local_slice():
    u, log = move([None, None], ["x", "y"])
    assert log.events == []
    assert_sharded_allclose(u, X, rtol=0, atol=0)


def test_gather_bytes():
    u, log = move(["x", None], [None, None])
    assert_comm(log, all_gather=1)
    assert log.events[0].bytes == (2 - 1) * 128  # (k-1) * local block
    assert_sharded_allclose(u, X, rtol=0, atol=0)


def test_partial_to_replicated_is_one_all_reduce():
    u, log = move([None, None], [None, None], src_partial=("y",))
    assert_comm(log, all_reduce=1)
    assert log.events[0].bytes == 2 * 3 * 256 // 4  # 2(k-1)/k * B
    assert_sharded_allclose(u, X, rtol=0, atol=0)


def test_partial_to_sharded_is_one_reduce_scatter():
    u, log = move([None, None], ["y", None], src_partial=("y",))
    assert_comm(log, reduce_scatter=1)
    assert log.events[0].bytes == 3 * 256 // 4  # (k-1)/k * B
    assert_sharded_allclose(u, X, rtol=0, atol=0)


def test_partial_kept_while_dims_move():
    u, log = move(["x", None], [None, "x"], src_partial=("y",), dst_partial=("y",))
    assert_comm(log, all_to_all=1)
    assert u.sharding.partial_axes == ("y",)
    np.testing.assert_array_equal(u.numpy(), X)


def test_axis_order_change_within_a_dim_is_a_permute():
    u, log = move([("x", "y"), None], [("y", "x"), None])
    assert_comm(log, collective_permute=1)
    assert log.events[0].bytes == 32  # the whole local block
    assert_sharded_allclose(u, X, rtol=0, atol=0)


def test_whole_multi_axis_sharding_moves_in_one_all_to_all():
    u, log = move([("x", "y"), None], [None, ("x", "y")])
    assert_comm(log, all_to_all=1)
    assert log.events[0].bytes == 32 * 7 // 8
    assert_sharded_allclose(u, X, rtol=0, atol=0)


def test_uneven_and_empty_shards():
    m = DeviceMesh("m", (4,), ("x",))
    v = np.arange(15, dtype=np.float32).reshape(5, 3)
    u, log = move(["x", None], [None, "x"], value=v, mesh=m)
    # an all_to_all would send (k-1)/k of a padded 2x3 block (18 B); device 0 lacks only 3 floats (12 B),
    # which arrive in two collective_permute rounds of at most 8 B each
    assert log.total_bytes == 16 and log.counts == {"collective_permute": 2}
    assert_sharded_allclose(u, v, rtol=0, atol=0)
    assert u.shards[3].shape == (5, 0)


def test_cannot_add_partial():
    t = nb.tensor(X).shard(MESH, ["x", None])
    with pytest.raises(ShardingError, match=r"partial over \['y'\] but the value"):
        t.with_sharding(MESH, ["x", None], partial_axes=["y"])
    with pytest.raises(ShardingError, match="partial"):
        nb.tensor(X).with_sharding(MESH, [None, None], partial_axes=["y"])


def test_plans_are_cached_and_pure():
    a = ShardingSpec(MESH, ["x", None])
    b = ShardingSpec(MESH, [None, "x"])
    p = plan((8, 8), 4, a, b)
    assert p is plan((8, 8), 4, a, b)
    assert [s.kind for s in p.collectives] == ["all_to_all"] and p.total_bytes == 64
    assert plan((8, 8), 4, a, a).steps == ()


def test_abstract_tensors_log_without_data():
    t = nb.abstract((1024, 1024)).shard(MESH, ["x", None])
    with nb.comm_log() as log:
        u = t.with_sharding(MESH, [None, "x"])
    assert u.is_abstract and log.counts == {"all_to_all": 1}
    assert log.total_bytes == 1024 * 1024 * 4 // 2 // 2


def test_comm_log_summary_and_cost():
    _, log = move(["x", None], [None, None])
    text = log.summary()
    assert "all_gather" in text and "128" in text and "total" in text
    assert log.total_cost > 0 and log.events[0].cost == pytest.approx(5e-6 + 128 / 25e9)


@given(st.data())
def test_any_to_any_keeps_value_and_round_trips(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes(max_rank=3))
    src = data.draw(specs(mesh, shape))
    dst = data.draw(specs(mesh, shape, partial=False))
    keep = data.draw(st.lists(st.sampled_from(src.partial_axes), unique=True)) if src.partial_axes else []
    dst = ShardingSpec(mesh, dst.dim_specs, partial_axes=[a for a in keep if not any(
        mesh.axis_ref(a).overlaps(mesh.axis_ref(b)) for d in dst.dim_specs for b in d.axes)])
    value = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    t = nb.tensor(value).shard(mesh, src.dim_specs, partial_axes=src.partial_axes)
    u = t.with_sharding(mesh, dst.dim_specs, partial_axes=dst.partial_axes)
    # open target dims keep what the value has there (JAX's UNCONSTRAINED); the rest is as asked
    assert u.sharding.layout() == keep_open(t.sharding, dst).layout()
    for d, asked, got in zip(dst.dim_specs, dst.dim_refs, u.sharding.dim_refs):
        assert got == asked or (d.is_open and got[:len(asked)] == asked)
    assert_sharded_allclose(u, value, rtol=1e-5, atol=1e-5)
    if not src.partial_axes:
        back = u.with_sharding(mesh, src.dim_specs)
        for d in mesh.devices:
            np.testing.assert_array_equal(back.shards[d], t.shards[d])


def test_device_order_change_is_one_collective_permute():
    a = DeviceMesh("m", (2, 2), ("x", "y"))
    b = DeviceMesh("m", (2, 2), ("x", "y"), devices=[1, 0, 3, 2])  # swapped along y
    x = np.arange(16.0).reshape(4, 4)
    t = nb.tensor(x).shard(a, ["x", "y"])
    with nb.comm_log() as log:
        u = t.with_sharding(b, ["x", "y"])
    assert_comm(log, collective_permute=1)
    assert log.events[0].axes == ("y",) and log.events[0].bytes == 4 * 8
    assert u.mesh == b
    assert_sharded_allclose(u, x, rtol=0, atol=0)
    np.testing.assert_array_equal(u.shards[0], t.shards[1])  # device 0 took device 1's grid place


def test_unrelated_meshes_are_refused():
    t = nb.tensor(X).shard(MESH, ["x", None])
    with pytest.raises(ShardingError, match="only a change of device order"):
        t.with_sharding(DeviceMesh("q", (8,), ("x",)), ["x", None])


def test_same_shard_counts_with_other_axes_is_one_permute():
    m = DeviceMesh("m", (4, 4), ("x", "y"))
    v = np.arange(64, dtype=np.float32).reshape(8, 8)
    for src, dst in [(["x", None], ["y", None]), (["x", "y"], ["y", "x"]),
                     ([("x", "y:(1)2"), None], [("y", "x:(1)2"), None])]:
        t = nb.tensor(v).shard(m, src)
        with nb.comm_log() as log:
            u = t.with_sharding(m, dst)
        assert_comm(log, collective_permute=1)
        block = 4 * int(np.prod([t.sharding.shard_shape(v.shape, 0)]))
        assert log.events[0].bytes == block  # one block per device, instead of (k-1) blocks to gather
        assert_sharded_allclose(u, v, rtol=0, atol=0)


# ---- the planner against the lower bound: what no plan can beat ------------------------------------------

import itertools  # noqa: E402

from hypothesis import settings  # noqa: E402

from nabla import storage  # noqa: E402
from nabla.layout import grid  # noqa: E402
from nabla.reshard import execute, lower_bound  # noqa: E402

def _all_specs(mesh, rank, partial=False):
    """Every spec of a rank: each mesh axis on one dim (in every order within the dim), unused, or (with
    ``partial``) a pending sum."""
    out = []
    for where in itertools.product(range(-2 if partial else -1, rank), repeat=mesh.ndim):
        dims = [[] for _ in range(rank)]
        for a, w in zip(mesh.axis_names, where):
            if w >= 0:
                dims[w].append(a)
        par = [a for a, w in zip(mesh.axis_names, where) if w == -2]
        for perms in itertools.product(*[list(itertools.permutations(d)) for d in dims]):
            out.append(ShardingSpec(mesh, [tuple(p) for p in perms], partial_axes=par))
    return out


M24 = DeviceMesh("m24", (2, 4), ("dp", "tp"))
C222 = DeviceMesh("c", (2, 2, 2), ("x", "y", "z"))
LB_CASES = [(M24, (16,)), (M24, (16, 16)), (M24, (8, 8, 8)), (C222, (8,)), (C222, (8, 8)), (C222, (8, 8, 8))]
_ids = [f"{m.name}-{'x'.join(map(str, s)) or 'scalar'}" for m, s in LB_CASES]


def _summands(value, spec, rng):
    """``value`` stored as ``spec`` with random integer summands on the partial axes (not the whole value on
    coordinate 0 and zeros elsewhere, which a plan that forgets a summand would still pass)."""
    data = np.array(storage._place(value, spec))
    g = grid(spec)
    if not g.partial:
        return data
    noise = rng.integers(-4, 5, size=data.shape).astype(data.dtype)
    first = tuple(0 if j in g.partial else slice(None) for j in range(data.ndim))
    noise[first] -= noise.sum(axis=tuple(g.partial))  # the summands of each element still add up to it
    for d in range(value.ndim):
        for region in storage.pad_regions(spec, value.shape, d):
            noise[region] = 0  # padding carries no value
    return data + noise


def _check_moves(shape, a, b, p, rng=None):
    """Carrying out plan ``p`` on stored blocks gives each device its ``b`` block (summands adding up to it)."""
    v = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) - 7
    out = np.asarray(execute(_summands(v, a, rng or np.random.default_rng(0)), p))
    want = storage._place(v, b)
    assert out.shape == want.shape, (a, b, p.events)
    if b.partial_axes:
        np.testing.assert_array_equal(storage.assemble(out, b, shape), v, err_msg=f"{a!r} -> {b!r}")
    else:
        np.testing.assert_array_equal(out, want, err_msg=f"{a!r} -> {b!r}")


@pytest.mark.parametrize("mesh,shape", LB_CASES, ids=_ids)
def test_every_evenly_divided_reshard_reaches_the_lower_bound(mesh, shape):
    """Every pair of specs without partial sums, enumerated (every axis on any dim or none, multi-axis dims
    in every order): 25 + 121 + 361 pairs on 2x4 and 256 + 2,401 + 11,236 on 2x2x2 (14,400), in CI too. With
    every dim divisible by its shard counts, the planner sends exactly the most bytes any device lacks, and
    carrying the plan out gives every device its block. Gaps found: none. (Sub-axes and uneven dims are
    left to the random property below.)"""
    specs = _all_specs(mesh, len(shape))
    for a in specs:
        for b in specs:
            p = plan(shape, 4, a, b)
            assert p.total_bytes == lower_bound(shape, 4, a, b), (a, b, p.events)
            _check_moves(shape, a, b, p)


@pytest.mark.parametrize("shape", [(6, 5), (5, 7, 3)])
@settings(max_examples=40)
@given(data=st.data())
def test_uneven_reshards_stay_between_the_bound_and_a_gather(shape, data):
    """Named gap: with uneven dims, collectives move padded blocks and a block held by few devices must
    leave them, so the receive bound is not always reachable; the plan never costs more than gathering
    everything and cutting again."""
    mesh = DeviceMesh("m24", (2, 4), ("dp", "tp"))
    specs = _all_specs(mesh, len(shape))
    a, b = data.draw(st.sampled_from(specs)), data.draw(st.sampled_from(specs))
    rep = ShardingSpec(mesh, [()] * len(shape))
    p = plan(shape, 4, a, b)
    assert lower_bound(shape, 4, a, b) <= p.total_bytes <= plan(shape, 4, a, rep).total_bytes
    _check_moves(shape, a, b, p)


def test_partial_over_sub_axes_reduces_once():
    """partial over a (4) to [(a:(1)2, b)] on a (4, 2) mesh, 10 float32 (40 B): summing over each sub-axis
    (two all_reduces, 2 x 40 B) or over a at once (2 * 3/4 * 40 = 60 B) costs more than reduce_scattering
    a:(1)2 onto the dim (20 B), summing its half over a:(2)2 (20 B) and moving the 4 B no one holds."""
    m = DeviceMesh("m", (4, 2), ("a", "b"))
    v = np.arange(10.0, dtype=np.float32)
    with nb.comm_log() as log:
        u = nb.tensor(v).shard(m, [None], partial_axes=["a"]).with_sharding(m, [("a:(1)2", "b")])
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [
        ("reduce_scatter", ("a:(1)2",), 20), ("all_reduce", ("a:(2)2",), 20), ("collective_permute", ("a",), 4)]
    assert_sharded_allclose(u, v, rtol=0, atol=0)
