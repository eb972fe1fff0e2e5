"""nabla.ops.gather: take, take_along_axis and x[ids] against numpy and jax.grad on random meshes, specs (uneven,
sub-axes, tables held as partial sums) and dtypes, every device's block checked; the vocabulary-parallel lookup's
communication in bytes; refusals (indices out of range, data-dependent masks); nb.jit's HLO against the log."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import nabla as nb
from nabla import DeviceMesh, ShardingError
from nabla.testing import assert_comm, assert_sharded_allclose, meshes, shapes, specs

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), BF16]
MESH = DeviceMesh("cluster", (2, 4), ("dp", "tp"))


def placed(draw, mesh, value, partial=True):
    spec = draw(specs(mesh, value.shape, partial=partial))
    return nb.tensor(value).shard(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes)


def values(draw, shape, dtype):
    v = np.random.default_rng(draw(st.integers(0, 2 ** 16))).standard_normal(shape)
    return v.astype(dtype)


def indices(draw, shape, n):
    """Indices into a dim of ``n`` (negative ones included, as numpy allows)."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    return rng.integers(-n, n, shape) if n else np.zeros(shape, np.int64)


def same(got, want):
    """Gathers are exact: every value is one of the table's (the pending sums hold zeros beside it)."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if want.dtype == BF16:
        got, want = got.astype("float64"), want.astype(np.float64)
    assert_sharded_allclose(got, want, rtol=0, atol=0)


# ---- values on every sharding -------------------------------------------------------------------------------


def table(draw):
    """A mesh, a value of a drawn dtype placed on it (held as partial sums too: gathers are linear in it), and
    an axis to gather along."""
    mesh = draw(meshes(max_devices=8))
    shape = draw(shapes(max_rank=3, max_dim=5, min_rank=1))
    v = values(draw, shape, draw(st.sampled_from(DTYPES)))
    return mesh, v, placed(draw, mesh, v), draw(st.integers(-len(shape), len(shape) - 1))


@given(st.data())
def test_take_equals_numpy(data):
    draw = data.draw
    mesh, v, t, axis = table(draw)
    ids = indices(draw, draw(shapes(max_rank=2, max_dim=4)) if v.shape[axis] else (0,), v.shape[axis])
    i = placed(draw, mesh, ids) if draw(st.booleans()) else ids
    same(nb.take(t, i, axis), np.take(v, ids, axis))


@given(st.data())
def test_take_along_axis_equals_numpy(data):
    draw = data.draw
    mesh, v, t, axis = table(draw)
    ishape = [n if draw(st.integers(0, 3)) else 1 for n in v.shape]  # broadcasting the other dims
    ishape[axis] = draw(st.integers(0, 4)) if v.shape[axis] else 0
    ids = indices(draw, tuple(ishape), v.shape[axis])
    same(nb.take_along_axis(t, placed(draw, mesh, ids), axis), np.take_along_axis(v, ids, axis))


@st.composite
def keys(draw, shape):
    """An index with one integer array among ints, slices, None and an Ellipsis."""
    j = draw(st.integers(0, len(shape) - 1))
    n = shape[j]
    ids = indices(draw, draw(shapes(max_rank=2, max_dim=3)), n) if n else np.zeros((0,), np.int64)
    key = []
    for d, size in enumerate(shape):
        if d == j:
            key.append("ids")
            continue
        kind = draw(st.sampled_from(["all", "slice", "int"] if size else ["all", "slice"]))
        if kind == "all":
            key.append(slice(None))
        elif kind == "int":
            key.append(draw(st.integers(-size, size - 1)))
        else:
            key.append(slice(draw(st.integers(-size, size)), draw(st.integers(-size, size)),
                             draw(st.sampled_from([1, 2, -1]))))
    if draw(st.booleans()):
        key.insert(draw(st.integers(0, len(key))), None)
    if draw(st.booleans()):  # an Ellipsis standing for the leading (or trailing) whole dims
        lead = 0
        while lead < len(key) and key[lead] == slice(None):
            lead += 1
        key = [Ellipsis] + key[lead:] if lead else key + [Ellipsis]
    return tuple(key), ids


@given(st.data())
def test_getitem_with_an_integer_array_equals_numpy(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    shape = draw(shapes(max_rank=3, max_dim=5, min_rank=1))
    key, ids = draw(keys(shape))
    v = values(draw, shape, np.float32)
    t = placed(draw, mesh, v)
    as_tensor = draw(st.sampled_from(["tensor", "array", "list"] if ids.size else ["tensor", "array"]))
    i = placed(draw, mesh, ids) if as_tensor == "tensor" else ids if as_tensor == "array" else ids.tolist()
    want = v[tuple(ids if k == "ids" else k for k in key)]
    same(t[tuple(i if isinstance(k, str) else k for k in key)], want)


def test_getitem_places_the_array_dims_as_numpy():
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    t = nb.tensor(x).shard(MESH, ["dp", "tp", None, None])
    i = np.array([[1, 0, -1]])
    for key in [(0, slice(None), i), (0, i), (slice(None), 0, i), (0, Ellipsis, i), (Ellipsis, 0, i), (0, None, i),
                (i, None), (None, i), (slice(1, None), i, 0), (i, slice(None), 0), (slice(None), 0, Ellipsis, i)]:
        same(t[key], x[key])
    mask = np.array([True, False, True])  # a mask on the host: its positions are static
    same(t[:, mask], x[:, mask])
    same(t[..., np.array([True, False, False, True]), :], x[..., np.array([True, False, False, True]), :])
    with pytest.raises(IndexError, match="mask of length 3 for dim 0 of size 2"):
        t[mask]


# ---- gradients (float64, against jax.grad) ------------------------------------------------------------------


@given(st.data())
@settings(max_examples=25)
def test_gradients_equal_jax_and_are_laid_out_as_the_table(data):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    shape = draw(shapes(max_rank=3, max_dim=5, min_rank=1))
    if 0 in shape:
        shape = tuple(n or 1 for n in shape)
    axis = draw(st.integers(0, len(shape) - 1))
    v = values(draw, shape, np.float64)
    which = draw(st.sampled_from(["take", "take_along_axis", "getitem"]))
    if which == "take_along_axis":
        ishape = list(shape)
        ishape[axis] = draw(st.integers(1, 4))
        ids = indices(draw, tuple(ishape), shape[axis])
        f, jf = (lambda a, i: nb.take_along_axis(a, i, axis)), (lambda a: jnp.take_along_axis(a, ids, axis))
    else:
        ids = indices(draw, draw(shapes(max_rank=2, max_dim=4)), shape[axis])
        key = (slice(None),) * axis
        f = (lambda a, i: nb.take(a, i, axis)) if which == "take" else (lambda a, i: a[key + (i,)])
        jf = lambda a: jnp.take(a, ids, axis)  # noqa: E731
    w = np.random.default_rng(5).standard_normal(np.shape(jf(v)))
    want = np.asarray(jax.grad(lambda a: (jf(a) * w).sum())(v))
    t, i = placed(draw, mesh, v), placed(draw, mesh, ids, partial=False)
    g = nb.grad(lambda a: (f(a, i) * w).sum())(t)
    assert [d.axes for d in g.sharding.dim_specs] == [d.axes for d in t.sharding.dim_specs]
    assert g.sharding.partial_axes == ()
    assert_sharded_allclose(g, want, rtol=1e-12, atol=1e-12)


def test_bfloat16_gradients_equal_jax_at_bf16_precision():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(3)
    table = rng.standard_normal((11, 6)).astype(BF16)
    ids = rng.integers(0, 11, (4, 5))  # repeated rows: their gradients add up
    w = rng.standard_normal((4, 5, 6)).astype(BF16)
    want = np.asarray(jax.grad(lambda e: (jnp.take(e, ids, 0) * w).sum())(jnp.asarray(table))).astype(np.float64)
    t = nb.tensor(table).shard(MESH, ["tp", None])
    g = nb.grad(lambda e: (nb.take(e, nb.tensor(ids).shard(MESH, ["dp", None]), 0) * w).sum())(t)
    assert g.dtype == BF16 and g.sharding.dim_specs[0].axes == ("tp",)
    np.testing.assert_allclose(g.numpy().astype(np.float64), want, rtol=2e-2, atol=2e-2)


# ---- the vocabulary-parallel lookup: what moves -------------------------------------------------------------


V, D, B, S = 64, 16, 8, 4
R = np.random.default_rng(0)
TABLE = R.standard_normal((V, D)).astype(np.float32)
IDS = R.integers(0, V, (B, S))


def ring(kind, block, k):
    return {"all_reduce": 2 * (k - 1) * block // k, "reduce_scatter": (k - 1) * block // k,
            "all_gather": (k - 1) * block}[kind]


def test_embedding_is_a_pending_sum_summed_once_by_its_use():
    """A (V, D) table on [tp, -] and ids (B, S) on [dp, -]: each device looks up the ids its rows hold, and the
    (B, S, D) result is [dp, -, -], partial over tp, with nothing moved; its first use that needs the value makes
    the sum once: one all_reduce over tp of the (B/dp, S, D) block (ring bytes 2(k-1)/k of it)."""
    e = nb.tensor(TABLE).shard(MESH, ["tp", None])
    i = nb.tensor(IDS).shard(MESH, ["dp", None])
    with nb.comm_log() as log:
        h = nb.take(e, i, axis=0)
    assert log.events == []
    assert [d.axes for d in h.sharding.dim_specs] == [("dp",), (), ()] and h.sharding.partial_axes == ("tp",)
    block = B // 2 * S * D * 4
    with nb.comm_log() as log:
        y = nb.relu(h)
        y2 = nb.tanh(h)  # a second use reads the sum made for the first
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("all_reduce", ("tp",), ring("all_reduce", block, 4))]
    assert ring("all_reduce", block, 4) == 1536
    assert_sharded_allclose(y, np.maximum(TABLE[IDS], 0))
    assert_sharded_allclose(y2, np.tanh(TABLE[IDS]), rtol=1e-5, atol=1e-6)
    with nb.comm_log() as log:  # a consumer that shards the result: the sum is a reduce_scatter
        z = nb.take(e, i, axis=0).with_sharding(MESH, ["dp", None, "tp"])
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [
        ("reduce_scatter", ("tp",), ring("reduce_scatter", block, 4))]
    assert_sharded_allclose(z, TABLE[IDS])


def test_embedding_gradient_is_local_to_the_table_rows():
    """The table's gradient is a scatter-add of the cotangent (laid out as the result) into each device's own rows:
    nothing moves but data parallelism's sum over dp of the (V/tp, D) block."""
    e = nb.tensor(TABLE).shard(MESH, ["tp", None])
    w = R.standard_normal((B, S, D)).astype(np.float32)
    with nb.comm_log() as log:
        g = nb.grad(lambda t: (nb.take(t, nb.tensor(IDS).shard(MESH, ["dp", None]), 0) * w).sum())(e)
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("all_reduce", ("dp",), ring("all_reduce", V // 4 * D * 4, 2))]
    want = np.zeros_like(TABLE)
    np.add.at(want, IDS, w)
    assert g.sharding.dim_specs[0].axes == ("tp",)
    assert_sharded_allclose(g, want, rtol=1e-5, atol=1e-5)
    with nb.comm_log() as log:  # replicated ids: no sum over dp either
        nb.grad(lambda t: (nb.take(t, IDS, 0) * w).sum())(e)
    assert log.events == []


def test_ids_on_the_tables_axis_the_side_that_sends_less_gives_way():
    """ids sharded on tp, the axis of the table's rows. A large table (4,096 rows) keeps its rows: the small ids
    are all_gathered over tp and the lookup is a pending sum over tp (vocabulary parallelism). A small one
    (64 x 16) is gathered instead, 3 x 1,024 B, less than the ids' 192 B plus summing the (8, 4, 16) lookup
    later (3,072 B), and the lookup stays cut as the ids are, with no sum pending (ZeRO-3's weight gather)."""
    big = R.standard_normal((4096, D)).astype(np.float32)
    for table, gathered in ((big, "ids"), (TABLE, "table")):
        e = nb.tensor(table).shard(MESH, ["tp", None])
        for dims in (["tp", None], [nb.DimSpec(["tp"], is_open=True), None]):
            i = nb.tensor(IDS).shard(MESH, dims)
            with nb.comm_log() as log:
                h = nb.take(e, i, 0)
            if gathered == "ids":
                assert [(e.kind, e.axes, e.bytes) for e in log.events] == [
                    ("all_gather", ("tp",), ring("all_gather", 2 * S * 8, 4))]
                assert h.sharding.partial_axes == ("tp",)
            else:
                assert [(e.kind, e.axes, e.bytes) for e in log.events] == [
                    ("all_gather", ("tp",), ring("all_gather", V // 4 * D * 4, 4))]
                assert h.sharding.partial_axes == () and h.sharding.dim_specs[0].axes == ("tp",)
            assert_sharded_allclose(h, table[IDS])


def test_take_along_axis_on_a_sharded_dim_picks_locally():
    x = R.standard_normal((B, V)).astype(np.float32)
    t = nb.tensor(x).shard(MESH, ["dp", "tp"])
    ids = R.integers(0, V, (B, 3))
    with nb.comm_log() as log:
        out = nb.take_along_axis(t, nb.tensor(ids).shard(MESH, ["dp", None]), 1)
    assert log.events == [] and out.sharding.partial_axes == ("tp",)
    assert_sharded_allclose(out, np.take_along_axis(x, ids, 1))


def test_numpy_functions_and_flops():
    t = nb.tensor(TABLE).shard(MESH, ["tp", None])
    same(np.take(t, IDS, axis=0), np.take(TABLE, IDS, axis=0))
    cols = R.integers(0, D, (V, 2))
    same(np.take_along_axis(t, cols, 1), np.take_along_axis(TABLE, cols, 1))
    same(nb.take(t, [3, 70, -2], mode="clip"), np.take(TABLE, [3, 70, -2], mode="clip"))
    assert nb.flops(lambda a: nb.take(a, IDS, 0), t) == 0  # a lookup moves data, computes nothing
    w = np.ones((B, S, D), np.float32)
    # the gradient adds each looked-up row into the table: one add per element of the cotangent, on its device
    assert nb.flops(lambda a: nb.grad(lambda u: (nb.take(u, IDS, 0) * w).sum())(a), t) >= B * S * D


# ---- refusals ---------------------------------------------------------------------------------------------


def test_indices_out_of_range_raise_index_error_as_numpy():
    t = nb.tensor(TABLE).shard(MESH, ["tp", None])
    for bad in (V, -V - 1):
        ids = IDS.copy()
        ids[1, 2] = bad
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds for axis 0 with size {V}"):
            nb.take(t, nb.tensor(ids).shard(MESH, ["dp", "tp"]), 0)
        with pytest.raises(IndexError):
            np.take(TABLE, ids, 0)
        with pytest.raises(ShardingError, match="out of bounds"):
            t[ids]
    # uneven ids (5 rows over 2): the padding of the last block is never read as an index
    odd = nb.tensor(R.integers(0, V, (5, 3))).shard(MESH, [("dp", "tp"), None])
    same(nb.take(t, odd, 0), TABLE[odd.numpy()])
    with pytest.raises(ShardingError, match="indices must be integers"):
        nb.take(t, np.array([0.5]), 0)


def test_data_dependent_masks_are_refused_naming_where():
    x = nb.tensor(TABLE).shard(MESH, ["tp", None])
    for call in (lambda: x[x > 0], lambda: nb.nonzero(x), lambda: nb.argwhere(x), lambda: nb.flatnonzero(x),
                 lambda: np.nonzero(x), lambda: np.where(x > 0), lambda: x[np.ones((V, D), bool)]):
        with pytest.raises(ShardingError, match=r"nb\.where\(mask, t, fill\)"):
            call()
    assert_sharded_allclose(nb.where(x > 0, x, 0.0), np.where(TABLE > 0, TABLE, 0))
    with pytest.raises(ShardingError, match="2 arrays in one index"):
        x[[0, 1], [1, 2]]


# ---- nb.jit: the compiled program moves what the log says --------------------------------------------------


def test_jit_of_lookups_and_their_gradients_has_the_logs_collectives():
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 jax devices (set in tests/conftest.py)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from jit_check import assert_hlo_is_the_log

    e = nb.tensor(TABLE[:13]).shard(MESH, ["tp", None])  # 13 rows over 4: uneven blocks
    i = nb.tensor(IDS % 13).shard(MESH, ["dp", None])
    x = nb.tensor(R.standard_normal((B, 13)).astype(np.float32)).shard(MESH, ["dp", "tp"])
    fns = [lambda e, i, x: nb.relu(e[i]),
           lambda e, i, x: nb.grad(lambda u: nb.sum(nb.take(u, i, 0) ** 2))(e),
           lambda e, i, x: nb.take_along_axis(x, i[:, :2], 1) * 2.0,
           lambda e, i, x: nb.grad(lambda u: nb.sum(nb.take_along_axis(u, i[:, :2], 1) ** 2))(x)]
    for f in fns:
        lowered = nb.jit(f).lower(e, i, x)
        assert_hlo_is_the_log(lowered)
        assert_sharded_allclose(nb.jit(f)(e, i, x), f(e, i, x).numpy(), rtol=1e-5, atol=1e-5)
    assert_comm(nb.jit(fns[0]).lower(e, i, x).comm_log, all_reduce=1)
    # nothing is checked under nb.jit (the indices have no values when it plans): an index out of range gives
    # zeros, on every layout of the table (eagerly, numpy's IndexError)
    bad = np.array([0, 12, 13, -14, -1])
    for dims in ([None, None], ["tp", None]):
        got = nb.jit(lambda a, b: a[b])(nb.tensor(TABLE[:13]).shard(MESH, dims), nb.tensor(bad).shard(MESH, [None]))
        want = TABLE[:13][np.clip(bad, -13, 12)] * ((bad >= -13) & (bad < 13))[:, None]
        assert_sharded_allclose(got, want)
