import numpy as np
import pytest

from nabla import DeviceMesh, DimSpec, ShardingError, ShardingSpec

MESH = DeviceMesh("cluster", (2, 4), ("dp", "tp"))


def test_dimspec_reprs():
    assert repr(DimSpec(["x"])) == '{"x"}'
    assert repr(DimSpec(["x", "y"])) == '{"x", "y"}'
    assert repr(DimSpec(["x"], is_open=True)) == '{"x", ?}'
    assert repr(DimSpec([], is_open=True)) == "{?}"
    assert repr(DimSpec([])) == "{}"
    assert repr(DimSpec(["x"], priority=1)) == '{"x"}p1'


def test_dimspec_frozen_hashable_and_coerced():
    d = DimSpec(["x"])
    assert d == DimSpec(("x",)) and hash(d) == hash(DimSpec("x"))
    with pytest.raises(Exception):
        d.axes = ("y",)
    assert DimSpec.coerce(None) == DimSpec()
    assert DimSpec.coerce("x") == DimSpec(("x",))
    assert DimSpec.coerce(("x", "y")) == DimSpec(("x", "y"))


def test_spec_repr_and_shorthands():
    s = ShardingSpec(MESH, [DimSpec(["dp"]), DimSpec(["tp"])])
    assert repr(s) == '[{"dp"}, {"tp"}]'
    assert ShardingSpec(MESH, ["dp", "tp"]) == s and hash(ShardingSpec(MESH, ["dp", "tp"])) == hash(s)
    t = ShardingSpec(MESH, [None, ("dp", "tp")], replicated_axes=(), partial_axes=())
    assert repr(t) == '[{}, {"dp", "tp"}]'
    u = ShardingSpec(MESH, ["dp", None], replicated_axes=["tp"])
    assert repr(u) == '[{"dp"}, {}], replicated={"tp"}'
    v = ShardingSpec(MESH, [None, None], partial_axes=["tp"])
    assert repr(v) == '[{}, {}], partial={"tp"}'


def test_full_sub_axis_is_canonicalised():
    assert ShardingSpec(MESH, ["tp:(1)4"]) == ShardingSpec(MESH, ["tp"])


@pytest.mark.parametrize("dims, rep, par, words", [
    (["q", None], (), (), ["unknown axis 'q'", "dim 0"]),
    (["dp", "dp"], (), (), ["'dp' (dim 0) is used twice (dim 1)"]),
    (["dp", None], ("dp",), (), ["'dp' (dim 0) is used twice (replicated_axes)"]),
    ([None, "tp"], (), ("tp",), ["'tp' (dim 1) is used twice (partial_axes)"]),
    (["tp:(1)2", "tp:(1)4"], (), (), ["'tp:(1)2' (dim 0) overlaps 'tp' (dim 1)"]),
    (["tp", "tp:(2)2"], (), (), ["overlaps"]),
    (["tp:(2)3", None], (), (), ["does not divide axis 'tp' of size 4"]),
])
def test_invalid_specs_name_the_axis(dims, rep, par, words):
    with pytest.raises(ShardingError) as e:
        ShardingSpec(MESH, dims, rep, par)
    for w in words:
        assert w in str(e.value)


def test_disjoint_sub_axes_are_allowed():
    s = ShardingSpec(MESH, ["tp:(1)2", "tp:(2)2"])
    assert s.num_shards(0) == 2 and s.num_shards(1) == 2


def test_rank_mismatch_is_reported():
    s = ShardingSpec(MESH, ["dp", "tp"])
    with pytest.raises(ShardingError, match=r"2 dims but the tensor has shape \(5,\) \(rank 1\)"):
        s.shard_slices((5,), 0)


def test_layout_drops_hints_only():
    s = ShardingSpec(MESH, [DimSpec(["dp"], True, 2), None], replicated_axes=["tp"])
    assert s.layout() == ShardingSpec(MESH, ["dp", None])
    assert s != s.layout()


def test_bad_types():
    with pytest.raises(ShardingError, match="must be a DeviceMesh"):
        ShardingSpec("mesh", ["dp"])
    with pytest.raises(ShardingError, match="dim spec must be"):
        ShardingSpec(MESH, [3])
    with pytest.raises(ShardingError, match="one entry per dim"):
        ShardingSpec(MESH, "dp")


def test_partial_and_replicated_axes_are_sets():
    a = ShardingSpec(MESH, [None], partial_axes=["tp", "dp"])
    b = ShardingSpec(MESH, [None], partial_axes=["dp", "tp"])
    assert a == b and a.partial_axes == ("dp", "tp")
    assert ShardingSpec(MESH, [None], replicated_axes=["tp", "dp"]).replicated_axes == ("dp", "tp")


def test_partial_pieces_of_one_axis_are_that_axis():
    m = DeviceMesh("m", (4,), ("x",))
    s = ShardingSpec(m, [None], partial_axes=["x:(2)2", "x:(1)2"])
    assert s.partial_axes == ("x",) and s == ShardingSpec(m, [None], partial_axes=["x"])


def test_partial_axes_from_reductions_over_split_dims_are_canonical():
    """A dim sharded over x (4) reshaped into two dims (x:(1)2, x:(2)2) and summed over both: partial over x."""
    import nabla as nb
    m = DeviceMesh("m", (4,), ("x",))
    v = np.arange(32.0).reshape(4, 8)
    t = nb.tensor(v).shard(m, ["x", None])
    r = t.reshape(2, 2, 8).sum(0).sum(0)
    assert r.sharding.partial_axes == ("x",)
    u = r.with_sharding(m, [None], partial_axes=["x"])  # the same placement: nothing moves
    np.testing.assert_array_equal(u.numpy(), v.sum(0))


# ---- bad arguments and repeated axes -------------------------------------------------------------------

import itertools  # noqa: E402

from hypothesis import given, strategies as st  # noqa: E402

from nabla.testing import meshes  # noqa: E402


@pytest.mark.parametrize("make, words", [
    (lambda: ShardingSpec(MESH, 5), ["dim_specs", "5"]),
    (lambda: ShardingSpec(MESH, {"dp", "tp"}), ["dim_specs", "set"]),
    (lambda: ShardingSpec(MESH, itertools.repeat(None)), ["dim_specs", "more than 32"]),
    (lambda: ShardingSpec(MESH, [None], partial_axes=[["dp"]]), ["partial_axes", "['dp']"]),
    (lambda: ShardingSpec(MESH, [None], replicated_axes=5), ["replicated_axes", "5"]),
    (lambda: ShardingSpec(MESH, [None], replicated_axes=[b"dp"]), ["replicated_axes", "b'dp'"]),
    (lambda: ShardingSpec(MESH, [5.0]), ["dim 0", "5.0"]),
    (lambda: ShardingSpec(MESH, [[["dp"]]]), ["['dp']", "is not a str"]),
    (lambda: ShardingSpec(MESH, ["dp:(" + "9" * 5000 + ")2"]), ["dim 0", "far past the axis size"]),
    (lambda: ShardingSpec(MESH, ["tp:(2)1"]), ["dim 0", "size 1"]),
    (lambda: DimSpec(5), ["axes", "5"]),
    (lambda: DimSpec({"x", "y"}), ["axes", "set"]),
    (lambda: DimSpec(["x"], is_open="no"), ["is_open", "'no'"]),
    (lambda: DimSpec(["x"], priority=True), ["priority", "True"]),
    (lambda: DimSpec(["x"], priority=10**5000), ["priority", "bits"]),
    (lambda: DimSpec(["x"], priority=-1), ["priority", "-1"]),
    (lambda: ShardingSpec.replicated(MESH, -1), ["rank", "-1"]),
])
def test_bad_arguments_name_the_argument(make, words):
    """Regression: ShardingSpec(mesh, 5), partial_axes=[["x"]], replicated_axes=5 raised TypeError."""
    with pytest.raises(ShardingError) as e:
        make()
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("dims, rep, par", [
    ([("x", "x"), None], (), ()),
    (["x", "x"], (), ()),
    ([None, "x"], ("x",), ()),
    ([None, None], (), ("x", "x")),
    ([None, None], ("x", "x"), ()),
    (["x", None], (), ("x",)),
])
def test_a_repeated_axis_is_refused_even_of_size_1(dims, rep, par):
    """Regression: [("x", "x"), None] with x of size 1 was accepted (the two merged into one "x")."""
    m = DeviceMesh("m", (1, 4), ("x", "y"))
    with pytest.raises(ShardingError, match="'x' .* is used twice"):
        ShardingSpec(m, dims, rep, par)


def test_valid_shorthands_still_work():
    assert DimSpec(None) == DimSpec(()) and DimSpec(("x",), is_open=np.bool_(True)).is_open is True
    assert ShardingSpec(MESH, iter(["dp", None])) == ShardingSpec(MESH, ["dp", None])
    assert ShardingSpec(MESH, [None], partial_axes={"tp", "dp"}).partial_axes == ("dp", "tp")
    assert ShardingSpec.replicated(MESH, np.int64(2)).rank == 2


# ---- fuzzing: arbitrary values give a valid spec or a ShardingError ---------------------------------------

def anything():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.complex_numbers(),
                        st.text(max_size=4), st.binary(max_size=3), st.integers(-1, 3).map(np.int64),
                        st.sampled_from(["x", "y", "z", "x:(1)2", "x:(2)2", "y:(1)2", "z:(2)1", "x:(1)1", "w",
                                         "x:(0)2", "y:(" + "9" * 30 + ")2", "?"]))
    return st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4), st.lists(kids, max_size=3).map(tuple),
                                                        st.frozensets(st.sampled_from(["x", "y", 1]), max_size=2),
                                                        st.builds(DimSpec, st.lists(st.sampled_from("xyz"), max_size=2)),
                                                        st.dictionaries(st.text(max_size=2), kids, max_size=2)),
                        max_leaves=10)


def _check_valid(spec):
    mesh = spec.mesh
    placed = [r for refs in spec.dim_refs for r in refs] + list(spec.partial_refs)
    placed += [mesh.axis_ref(a) for a in spec.replicated_axes]
    for i, a in enumerate(placed):
        assert not any(a.overlaps(b) for b in placed[i + 1:]), spec
    assert spec == ShardingSpec(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes)
    assert hash(spec) == hash(ShardingSpec(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes))
    repr(spec)


@given(mesh=meshes(), dims=anything(), rep=anything(), par=anything())
def test_fuzz_sharding_spec_takes_anything(mesh, dims, rep, par):
    try:
        spec = ShardingSpec(mesh, dims, rep, par)
    except ShardingError:
        return
    _check_valid(spec)


@given(mesh=meshes(), dims=st.lists(st.lists(st.sampled_from(["x", "y", "z", "x:(1)2", "x:(2)2", "y:(1)2",
                                                              "y:(2)2", "x:(1)4", "z:(1)1"]), max_size=3), max_size=3),
       rep=st.lists(st.sampled_from(["x", "y", "z", "x:(2)2"]), max_size=2),
       par=st.lists(st.sampled_from(["x", "y", "z", "y:(1)2"]), max_size=2))
def test_fuzz_sharding_spec_near_valid(mesh, dims, rep, par):
    try:
        spec = ShardingSpec(mesh, [tuple(d) for d in dims], rep, par)
    except ShardingError:
        return
    _check_valid(spec)


@given(axes=anything(), is_open=anything(), priority=anything())
def test_fuzz_dim_spec_takes_anything(axes, is_open, priority):
    try:
        d = DimSpec(axes, is_open, priority)
    except ShardingError:
        return
    assert all(isinstance(a, str) for a in d.axes) and isinstance(d.is_open, bool)
    assert isinstance(d.priority, int) and d.priority >= 0 and hash(d) == hash(DimSpec(d.axes, d.is_open, d.priority))
    repr(d)


def test_shard_shape_and_slices_validate_their_arguments():
    s = ShardingSpec(MESH, ["dp", None])
    for bad in ((2, -4), "ab", None, 5, (2.0, 3), (2,)):
        with pytest.raises(ShardingError, match="global_shape|dims"):
            s.shard_shape(bad, 0)
        with pytest.raises(ShardingError, match="global_shape|dims"):
            s.shard_slices(bad, 0)
    for dev in (99, "0", [0], 1.0):
        with pytest.raises(ShardingError, match="device"):
            s.shard_shape((4, 4), dev)
    assert s.shard_shape((5, 3), 4) == (2, 3) and s.shard_slices((5, 3), 4) == (slice(3, 5), slice(0, 3))
