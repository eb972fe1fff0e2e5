import subprocess
import sys

import pytest

from nabla import DeviceMesh, DimSpec, ShardingError, ShardingSpec

MESH8 = DeviceMesh("m", (2, 4), ("x", "y"))
MESH2 = DeviceMesh("m", (2,), ("x",))


# ---- seed 003's worked examples -------------------------------------------------------------------

def test_seed_row_split_of_4x3_over_2_devices():
    spec = ShardingSpec.from_mhlo(MESH2, "{devices=[2,1]0,1}")
    assert spec == ShardingSpec(MESH2, ["x", None])
    assert spec.shard_slices((4, 3), 0) == (slice(0, 2), slice(0, 3))
    assert spec.shard_slices((4, 3), 1) == (slice(2, 4), slice(0, 3))
    assert spec.shard_shape((4, 3), 1) == (2, 3)
    assert spec.to_mhlo() == "{devices=[2,1]0,1}"


def test_seed_three_tile_dims():
    spec = ShardingSpec.from_mhlo(MESH8, "{devices=[1,2,4]0,1,2,3,4,5,6,7}")
    assert spec == ShardingSpec(MESH8, [None, "x", "y"])
    assert all(spec.shard_shape((3, 4, 4), d) == (3, 2, 1) for d in range(8))
    assert spec.to_mhlo() == "{devices=[1,2,4]0,1,2,3,4,5,6,7}"


def test_seed_replicated():
    spec = ShardingSpec.from_mhlo(MESH8, "{replicated}", rank=2)
    assert spec == ShardingSpec(MESH8, [None, None])
    assert spec.to_mhlo() == "{replicated}"
    with pytest.raises(ShardingError, match="pass rank="):
        ShardingSpec.from_mhlo(MESH8, "{replicated}")


def test_seed_partial_replication_follows_xla():
    # [1,2,4] with last_tile_dim_replicate: dim 0 unsplit, dim 1 split in two, each tile on 4 devices.
    text = "{devices=[1,2,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    spec = ShardingSpec.from_mhlo(MESH8, text)
    assert spec == ShardingSpec(MESH8, [None, "x"])
    assert {spec.shard_slices((4, 6), d)[1].start for d in (0, 1, 2, 3)} == {0}
    assert {spec.shard_slices((4, 6), d)[1].start for d in (4, 5, 6, 7)} == {3}
    assert spec.to_mhlo() == text
    # the row split the seed meant is [2,1,4]
    rows = ShardingSpec.from_mhlo(MESH8, "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}")
    assert rows.shard_slices((4, 3), 0) == (slice(0, 2), slice(0, 3))
    assert rows.shard_slices((4, 3), 6) == (slice(2, 4), slice(0, 3))


def test_maximal_is_refused_except_on_a_one_device_mesh():
    """Regression: '{maximal device=3}' used to come back as a replicated spec on 8 devices."""
    with pytest.raises(ShardingError) as e:
        ShardingSpec.from_mhlo(MESH8, "{maximal device=3}", rank=1)
    for words in ["device 3", "no single-device placement", "8", "{replicated}", "one-device mesh"]:
        assert words in str(e.value)
    with pytest.raises(ShardingError, match="maximal device=9 is not in mesh"):
        ShardingSpec.from_mhlo(MESH8, "{maximal device=9}", rank=1)
    one = DeviceMesh("one", (1,), ("d",), devices=[3])
    assert ShardingSpec.from_mhlo(one, "{maximal device=3}", rank=2) == ShardingSpec(one, [None, None])
    with pytest.raises(ShardingError, match="pass rank="):
        ShardingSpec.from_mhlo(one, "{maximal device=3}")


# ---- device orders -----------------------------------------------------------------------------------

def test_device_list_in_another_order():
    spec = ShardingSpec.from_mhlo(MESH8, "{devices=[4,2]0,4,1,5,2,6,3,7}")
    assert spec == ShardingSpec(MESH8, ["y", "x"])
    assert spec.to_mhlo() == "{devices=[4,2]0,4,1,5,2,6,3,7}"


def test_iota_form_with_transpose():
    spec = ShardingSpec.from_mhlo(MESH8, "{devices=[8,1]<=[2,4]T(1,0)}")
    assert spec == ShardingSpec(MESH8, [("y", "x"), None])


def test_sub_axis_tiles():
    spec = ShardingSpec.from_mhlo(MESH8, "{devices=[2,2,2]0,2,1,3,4,6,5,7 last_tile_dim_replicate}")
    assert spec == ShardingSpec(MESH8, ["x", "y:(2)2"])
    assert spec.to_mhlo() == "{devices=[2,2,2]0,2,1,3,4,6,5,7 last_tile_dim_replicate}"


def test_custom_mesh_order_round_trips():
    m = DeviceMesh("m", (2, 2), ("x", "y"), devices=[3, 2, 1, 0])
    spec = ShardingSpec(m, ["x", "y"])
    assert spec.to_mhlo() == "{devices=[2,2]3,2,1,0}"
    assert ShardingSpec.from_mhlo(m, spec.to_mhlo()) == spec


@pytest.mark.parametrize("spec_dims", [["x", "y"], [("x", "y"), None], [None, ("y", "x")], ["y", None],
                                       ["y:(1)2", ("x", "y:(2)2")], [None, None]])
def test_round_trip(spec_dims):
    spec = ShardingSpec(MESH8, spec_dims)
    assert ShardingSpec.from_mhlo(MESH8, spec.to_mhlo(), rank=2) == spec


# ---- errors --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, words", [
    ("{devices=[2,1]0,1", ["position 17", "expected }"]),
    ("{devices=[2;1]0,1}", ["position 11", "expected ]", "';'"]),
    ("{devizes=[2]0,1}", ["position 1", "'devizes'"]),
    ("{devices=[2,1]0,1} x", ["position 18", "unexpected text 'x'"]),
    ("devices=[2,1]0,1", ["position 0", "expected {"]),
])
def test_malformed_text_names_the_position(text, words):
    with pytest.raises(ShardingError) as e:
        ShardingSpec.from_mhlo(MESH2, text)
    for w in words:
        assert w in str(e.value)


def test_tile_counts_must_match_the_mesh():
    with pytest.raises(ShardingError, match=r"tile dims \[2, 2\] hold 4 devices but mesh @m \[2\] has 2"):
        ShardingSpec.from_mhlo(MESH2, "{devices=[2,2]0,1,2,3}")
    with pytest.raises(ShardingError, match="hold 2 devices but 3 are listed"):
        ShardingSpec.from_mhlo(MESH2, "{devices=[2,1]0,1,1}")
    with pytest.raises(ShardingError, match="are not the devices of mesh"):
        ShardingSpec.from_mhlo(MESH2, "{devices=[2,1]0,5}")
    with pytest.raises(ShardingError, match="rank=3 was given"):
        ShardingSpec.from_mhlo(MESH2, "{devices=[2,1]0,1}", rank=3)


def test_orders_need_sub_axes_or_are_rejected():
    m = DeviceMesh("m", (4,), ("x",))
    # 0,2,1,3 walks the minor half of x first: sub-axes express it
    assert ShardingSpec.from_mhlo(m, "{devices=[4]0,2,1,3}") == ShardingSpec(m, [("x:(2)2", "x:(1)2")])
    with pytest.raises(ShardingError, match="is not a tiling of mesh"):
        ShardingSpec.from_mhlo(m, "{devices=[4]0,3,1,2}")


def test_partial_cannot_be_written_as_hlo():
    with pytest.raises(ShardingError, match="unreduced"):
        ShardingSpec(MESH8, [None], partial_axes=["x"]).to_mhlo()


# ---- PartitionSpec ---------------------------------------------------------------------------------------

def test_partition_spec_round_trip():
    jax = pytest.importorskip("jax")
    P = jax.sharding.PartitionSpec
    spec = ShardingSpec(MESH8, ["x", None])
    assert spec.to_partition_spec() == P("x", None)
    both = ShardingSpec(MESH8, [("x", "y"), DimSpec((), is_open=True)])
    ps = both.to_partition_spec()
    assert ps == P(("x", "y"), P.UNCONSTRAINED)
    assert ShardingSpec.from_partition_spec(MESH8, ps) == both
    assert ShardingSpec.from_partition_spec(MESH8, P(None, "y")) == ShardingSpec(MESH8, [None, "y"])
    with pytest.raises(ShardingError, match="sub-axis"):
        ShardingSpec(MESH8, ["y:(1)2"]).to_partition_spec()


def test_from_partition_spec_accepts_tuples_without_jax():
    assert ShardingSpec.from_partition_spec(MESH8, ("x", None)) == ShardingSpec(MESH8, ["x", None])


def test_import_nabla_does_not_import_jax():
    code = "import sys, nabla; sys.exit(1 if 'jax' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- sizes, rank and argument order ------------------------------------------------------------------

import tracemalloc  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402

from nabla.testing import meshes, specs  # noqa: E402

_HUGE_TEXTS = [
    "{devices=[2,1]<=[1000000000000000]}",
    "{devices=[2,1]<=[50000000]}",
    "{devices=[2,1]<=[" + "9" * 5000 + "]}",
    "{devices=[4294967296,4294967296]0,1}",
    "{devices=[" + ",".join(["65536"] * 60) + "]0,1}",
    "{devices=[" + "9" * 5000 + ",1]0,1}",
    "{devices=[2,1]0," + "9" * 5000 + "}",
    "{devices=[2,1]0,18446744073709551616}",
    "{devices=[2,1]" + ",".join(["0"] * 200_000) + "}",
    "{devices=[2,1]" + ",".join(map(str, range(200_000))) + "}",
    "{devices=[2,1]<=[2]T(" + "9" * 30 + ")}",
    "{devices=[2,1]<=[2]T(" + ",".join(["0"] * 100_000) + ")}",
    "{devices=[" + ",".join(["1"] * 100_000) + ",2]0,1}",
    "{maximal device=" + "9" * 5000 + "}",
]


@pytest.mark.parametrize("text", _HUGE_TEXTS, ids=lambda t: t[:40])
def test_huge_sizes_are_refused_before_anything_is_built(text):
    """Regression: <=[10**15] raised MemoryError and <=[50000000] took seconds and gigabytes. What was built
    is measured in bytes (peak allocation), not with a clock."""
    tracemalloc.start()
    try:
        with pytest.raises(ShardingError) as e:
            ShardingSpec.from_mhlo(MESH2, text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * len(text) + 4_000_000, peak
    assert any(w in str(e.value) for w in ("hold", "out of range", "listed", "more than")), str(e.value)


@pytest.mark.parametrize("text, words", [
    ("{devices=[2,1]<=[1000000000000000]}", ["iota dims [1000000000000000]", "hold 2"]),
    ("{devices=[4294967296,4294967296]0,1}", ["tile dims [4294967296, 4294967296]", "mesh @m [2] has 2"]),
    ("{devices=[2,1]0,18446744073709551616}", ["device id 18446744073709551616 is out of range"]),
    ("{devices=[2,1]0,0}", ["device(s) [0] are listed more than once"]),
    ("{devices=[2,1]<=[2]T(1)}", ["transpose dim 1 is out of range [0, 0]"]),
    ("{devices=[0,1]0,1}", ["tile count 0 is out of range"]),
    ("{manual}", ["no nabla spec", "shard_map"]),
])
def test_size_errors_name_the_sizes(text, words):
    with pytest.raises(ShardingError) as e:
        ShardingSpec.from_mhlo(MESH2, text)
    for w in words:
        assert w in str(e.value)


def test_iota_needs_devices_0_to_n():
    m = DeviceMesh("m", (2,), ("x",), devices=[7, 9])
    with pytest.raises(ShardingError, match="names devices 0..1"):
        ShardingSpec.from_mhlo(m, "{devices=[2]<=[2]}")
    assert ShardingSpec.from_mhlo(m, "{devices=[2]7,9}") == ShardingSpec(m, ["x"])


@pytest.mark.parametrize("rank", [-1, "2", 2.0, True, 10**100, [2]])
def test_rank_is_validated(rank):
    """Regression: rank=-1 gave a rank-0 spec and rank="2" raised TypeError."""
    for text in ["{replicated}", "{devices=[2,1]0,1}"]:
        with pytest.raises(ShardingError, match=r"rank must be an int in \[0, 32\] \(or None\)"):
            ShardingSpec.from_mhlo(MESH2, text, rank=rank)
    assert ShardingSpec.from_mhlo(MESH2, "{replicated}", rank=np.int64(2)).rank == 2


def test_from_mhlo_takes_the_mesh_first_and_warns_on_the_old_order():
    """Regression: from_mhlo(text, mesh) and from_partition_spec(mesh, pspec) took different orders."""
    new = ShardingSpec.from_mhlo(MESH2, "{devices=[2,1]0,1}")
    assert ShardingSpec.from_mhlo(mesh=MESH2, text="{devices=[2,1]0,1}", rank=2) == new
    with pytest.warns(DeprecationWarning, match=r"pass the mesh first: from_mhlo\(mesh, text, rank\)"):
        old = ShardingSpec.from_mhlo("{devices=[2,1]0,1}", MESH2, 2)
    assert old == new
    with pytest.warns(DeprecationWarning):
        assert ShardingSpec.from_mhlo("{replicated}", MESH2, rank=1) == ShardingSpec(MESH2, [None])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardingSpec.from_mhlo(MESH2, "{replicated}", 1)
    with pytest.raises(ShardingError, match="mesh must be a DeviceMesh, got str"):
        ShardingSpec.from_mhlo("{replicated}", "{replicated}", 1)
    with pytest.raises(ShardingError, match="text must be a str, got int"):
        ShardingSpec.from_mhlo(MESH2, 5)


def test_long_malformed_text_is_shown_around_the_fault_only():
    text = "{devices=[2,1]0,1" + " " * 100_000 + "x}"
    with pytest.raises(ShardingError) as e:
        ShardingSpec.from_mhlo(MESH2, text)
    assert len(str(e.value)) < 400 and "<<here>>" in str(e.value)


# ---- PartitionSpec entries and partial specs -------------------------------------------------------------

@pytest.mark.parametrize("entries, words", [
    ((5, None), ["entry 0", "int 5"]),
    ((b"x",), ["entry 0", "bytes b'x'"]),
    ((None, 1.5), ["entry 1", "float 1.5"]),
    ((("x", 5),), ["entry 0", "('x', 5)"]),
    ((("x", b"y"),), ["entry 0"]),
    (({"x"},), ["entry 0", "set"]),
])
def test_from_partition_spec_refuses_non_axis_entries(entries, words):
    """Regression: P(5, None), bytes and floats were read as open dims."""
    for pspec in _pspecs(entries):
        with pytest.raises(ShardingError) as e:
            ShardingSpec.from_partition_spec(MESH8, pspec)
        for w in words:
            assert w in str(e.value)


def _pspecs(entries):
    out = [tuple(entries), list(entries)]
    try:
        from jax.sharding import PartitionSpec as P
        out.append(P(*entries))
    except (ImportError, TypeError):  # jax itself refuses some (a set entry is unhashable)
        pass
    return out


@pytest.mark.parametrize("pspec", ["x", None, 5, b"xy", {"x": 1}])
def test_from_partition_spec_refuses_non_specs(pspec):
    with pytest.raises(ShardingError, match="pspec must be a jax PartitionSpec or a tuple"):
        ShardingSpec.from_partition_spec(MESH8, pspec)
    with pytest.raises(ShardingError, match="mesh must be a DeviceMesh"):
        ShardingSpec.from_partition_spec(("x",), MESH8)


def test_partial_spec_round_trips_through_partition_spec():
    """Regression: a spec with partial axes made a PartitionSpec that from_partition_spec could not read."""
    jax = pytest.importorskip("jax")
    P = jax.sharding.PartitionSpec
    spec = ShardingSpec(MESH8, ["x", None], partial_axes=["y"])
    ps = spec.to_partition_spec()
    assert ps == P("x", None, unreduced={"y"})
    assert ShardingSpec.from_partition_spec(MESH8, ps) == spec
    open_ = ShardingSpec(MESH8, [DimSpec((), is_open=True), None], partial_axes=["x", "y"])
    assert ShardingSpec.from_partition_spec(MESH8, open_.to_partition_spec()) == open_
    with pytest.raises(ShardingError, match="partial axis 'y:.*' is a sub-axis"):
        ShardingSpec(MESH8, [None], partial_axes=["y:(1)2"]).to_partition_spec()
    with pytest.raises(ShardingError, match="reduced axes"):
        ShardingSpec.from_partition_spec(MESH8, P("x", reduced={"y"}))
    with pytest.raises(ShardingError, match="unknown axis 'q'"):
        ShardingSpec.from_partition_spec(MESH8, P("x", unreduced={"q"}))
    # ShardingSpec itself takes PartitionSpec entries, UNCONSTRAINED included; an unreduced one it cannot iterate
    assert ShardingSpec(MESH8, P("x", P.UNCONSTRAINED)) == ShardingSpec(MESH8, ["x", DimSpec((), is_open=True)])
    with pytest.raises(ShardingError, match="dim_specs.*raised ValueError"):
        ShardingSpec(MESH8, P("x", unreduced={"y"}))


def test_partial_spec_on_a_jax_without_unreduced_says_so(monkeypatch):
    jax = pytest.importorskip("jax")
    real = jax.sharding.PartitionSpec

    def old_partition_spec(*entries, **kw):
        if kw:
            raise TypeError("PartitionSpec() got an unexpected keyword argument 'unreduced'")
        return real(*entries)

    old_partition_spec.UNCONSTRAINED = real.UNCONSTRAINED
    monkeypatch.setattr(jax.sharding, "PartitionSpec", old_partition_spec)
    with pytest.raises(ShardingError, match="partial axes \\['y'\\].*has no `unreduced`"):
        ShardingSpec(MESH8, ["x"], partial_axes=["y"]).to_partition_spec()


# ---- fuzzing ---------------------------------------------------------------------------------------------

_NUMS = st.one_of(st.integers(0, 9), st.integers(0, 2**70), st.sampled_from([2**63, 2**64, 10**30]))


@st.composite
def near_mhlo(draw):
    """Strings that are mostly well formed HLO shardings, with sizes from tiny to absurd."""
    head = draw(st.sampled_from(["devices", "replicated", "maximal", "manual", "devizes"]))
    if head == "replicated":
        body = "replicated"
    elif head == "maximal":
        body = f"maximal device={draw(_NUMS)}"
    else:
        dims = draw(st.lists(_NUMS, min_size=1, max_size=4))
        body = f"{head}=[" + ",".join(map(str, dims)) + "]"
        if draw(st.booleans()):
            iota = draw(st.lists(_NUMS, min_size=1, max_size=3))
            body += "<=[" + ",".join(map(str, iota)) + "]"
            if draw(st.booleans()):
                body += "T(" + ",".join(map(str, draw(st.permutations(range(len(iota)))))) + ")"
        else:
            body += ",".join(map(str, draw(st.lists(_NUMS, min_size=1, max_size=20))))
        if draw(st.booleans()):
            body += " last_tile_dim_replicate"
    text = "{" + body + "}"
    if draw(st.booleans()):  # a random edit
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(st.text(alphabet="{}[],=<>T() 0123456789xl_", max_size=3)) + text[i + 1:]
    return text


def _check_parsed(mesh, text, rank):
    try:
        spec = ShardingSpec.from_mhlo(mesh, text, rank)
    except ShardingError:
        return
    assert isinstance(spec, ShardingSpec) and spec.mesh == mesh and not spec.partial_axes
    assert rank is None or (rank >= 0 and spec.rank == rank)
    again = ShardingSpec.from_mhlo(mesh, spec.to_mhlo(), spec.rank)
    assert again.to_mhlo() == spec.to_mhlo()


@given(mesh=meshes(), text=st.one_of(st.text(max_size=60), near_mhlo()),
       rank=st.one_of(st.none(), st.integers(-2, 4)))
def test_fuzz_from_mhlo_parses_or_refuses(mesh, text, rank):
    _check_parsed(mesh, text, rank)  # a negative rank is refused whatever the text


def _factorization(data, n, max_len=4):
    """n as an ordered product of 1 to max_len factors (1s allowed)."""
    out = []
    while len(out) < max_len - 1 and data.draw(st.booleans()):
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        d = data.draw(st.sampled_from(divisors))
        out.append(d)
        n //= d
    return out + [n]


@given(mesh=meshes(max_devices=8), data=st.data())
def test_fuzz_from_mhlo_device_lists(mesh, data):
    """Tilings of the mesh's own devices, explicit or iota, in any order and count: a spec that puts every
    device on its tile, or a ShardingError."""
    if data.draw(st.booleans()):
        dims = _factorization(data, mesh.size)
    else:
        dims = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    rep = len(dims) > 1 and data.draw(st.booleans())
    form = data.draw(st.sampled_from(["permutation", "iota", "any"]))
    if form == "iota" and sorted(mesh.devices) == list(range(mesh.size)):
        iota = _factorization(data, mesh.size)
        perm = data.draw(st.permutations(range(len(iota))))
        ids = np.arange(mesh.size).reshape(iota).transpose(perm).reshape(-1).tolist()
        body = "<=[" + ",".join(map(str, iota)) + "]T(" + ",".join(map(str, perm)) + ")"
    else:
        ids = data.draw(st.permutations(mesh.devices) if form != "any" else
                        st.lists(st.sampled_from(mesh.devices + (99,)), max_size=mesh.size + 2))
        body = ",".join(map(str, ids))
    text = "{devices=[" + ",".join(map(str, dims)) + "]" + body + (" last_tile_dim_replicate" if rep else "") + "}"
    _check_parsed(mesh, text, None)
    try:
        spec = ShardingSpec.from_mhlo(mesh, text)
    except ShardingError:
        return
    tiles = dims[:-1] if rep else dims
    shape = tuple(2 * t for t in tiles)
    grid = np.array(ids).reshape(tiles + [-1])
    for tile in np.ndindex(*tiles):
        for d in grid[tile]:
            assert spec.shard_slices(shape, int(d)) == tuple(slice(2 * i, 2 * i + 2) for i in tile), (text, spec)


@given(mesh=meshes(), data=st.data())
def test_fuzz_to_mhlo_from_mhlo_round_trip(mesh, data):
    rank = data.draw(st.integers(0, 3))
    spec = data.draw(specs(mesh, (4,) * rank, partial=False))
    text = spec.to_mhlo()
    back = ShardingSpec.from_mhlo(mesh, text, rank)
    assert back.to_mhlo() == text
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=rank, max_size=rank)))
    for d in mesh.devices:  # the same blocks on every device (hints like open dims and size-1 axes aside)
        assert back.shard_slices(shape, d) == spec.shard_slices(shape, d)


@given(mesh=meshes(), pspec=st.lists(st.one_of(st.none(), st.sampled_from(["x", "y", "z", "w"]),
                                                st.lists(st.sampled_from(["x", "y", "z"]), max_size=3).map(tuple),
                                                st.integers(), st.floats(), st.binary(max_size=2),
                                                st.sampled_from(["UNCONSTRAINED"])), max_size=4),
       unreduced=st.frozensets(st.sampled_from(["x", "y", "z", "w"]), max_size=2), as_jax=st.booleans())
def test_fuzz_from_partition_spec(mesh, pspec, unreduced, as_jax):
    jax = pytest.importorskip("jax")
    P = jax.sharding.PartitionSpec
    entries = [P.UNCONSTRAINED if e == "UNCONSTRAINED" else e for e in pspec]
    try:
        ps = P(*entries, unreduced=set(unreduced)) if as_jax else tuple(entries)
    except (ValueError, TypeError):  # jax's own refusal (an axis both partitioned and unreduced)
        return
    try:
        spec = ShardingSpec.from_partition_spec(mesh, ps)
    except ShardingError:
        return
    assert spec.rank == len(entries) and set(spec.partial_axes) == (set(unreduced) if as_jax else set())
    assert ShardingSpec.from_partition_spec(mesh, spec.to_partition_spec()) == spec
