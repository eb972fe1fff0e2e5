import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nabla as nb
from nabla import DeviceMesh, ShardingError
from nabla import executor, program, propagation, reshard, signatures
from nabla.testing import assert_matches_numpy, examples, meshes, shapes, specs

MESH = DeviceMesh("m", (2, 2), ("x", "y"))


def test_a_seen_op_recomputes_nothing():
    a = nb.random.normal((8, 8)).shard(MESH, ["x", None])
    b = nb.random.normal((8, 8), seed=1).shard(MESH, [None, "y"])
    a @ b
    before = (program.program_for.cache_info(), propagation.propagate.cache_info(), reshard._plan.cache_info())
    for _ in range(5):
        a @ b
    after = (program.program_for.cache_info(), propagation.propagate.cache_info(), reshard._plan.cache_info())
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


def _shared_gather(policy=None):
    """An activation, sequence-sharded, read by three column-parallel matmuls; the gradients of its gain and the
    three weights (the data ``x`` is not differentiated)."""
    mesh = DeviceMesh("tp4", (4,), ("tp",))
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((2, 16, 32)).astype(np.float32)
    g0 = rng.standard_normal(32).astype(np.float32)
    w0 = [rng.standard_normal((32, 512)).astype(np.float32) for _ in range(3)]
    x = nb.tensor(x0).shard(mesh, [None, "tp", None])
    g = nb.tensor(g0).shard(mesh, [None])
    ws = [nb.tensor(w).shard(mesh, [None, "tp"]) for w in w0]

    def loss(g, a, b, c, x):
        y = nb.tanh(x * g)
        return sum(((y @ w) ** 2).sum() for w in (a, b, c))

    run = nb.checkpoint(loss, policy=policy) if policy else loss
    with nb.comm_log() as log, nb.memory_log() as mem:
        grads = nb.grad(run, argnums=(0, 1, 2, 3))(g, *ws, x)
    y = np.tanh(x0 * g0)  # d/dw sum((y w)^2) = 2 y^T (y w); d/dg = sum over rows of x (1 - y^2) sum_w 2 (y w) w^T
    dy = sum(2 * (y @ w) @ w.T for w in w0)
    want = [(x0 * (1 - y * y) * dy).sum((0, 1))] + [np.einsum("bsk,bsn->kn", y, 2 * (y @ w)) for w in w0]
    for got, r in zip(grads, want):
        np.testing.assert_allclose(got.numpy(), r, rtol=1e-4, atol=1e-3 * np.abs(r).max())
    return log, mem


def test_a_traced_activation_is_gathered_once_and_its_copy_kept_for_the_backward_pass():
    """As XLA does (tests/integration/test_xla_parity.py, sequence_parallel_shared_gather_grads): the gathered
    copy of tanh(x * g) serves all three matmuls and the weights' gradients. The analytic minimum: one all_gather
    of the (2, 16, 32) float32 activation (3/4 of 4 KiB to each device); its cotangent, summed over the weights'
    column shards, back to the sequence shards (a reduce_scatter, as Megatron's sequence parallelism has it); the
    gain's gradient summed over the sequence shards (an all_reduce of 32 float32s)."""
    log, mem = _shared_gather()
    assert log.counts == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}
    assert [(e.phase, e.kind, e.bytes) for e in log.events if e.kind == "all_gather"] == [("forward", "all_gather",
                                                                                            3072)]
    # the kept copy counts for the backward pass: the gathered 4 KiB on top of what policy="regather" keeps
    _, lean = _shared_gather("regather")
    assert max(mem.kept.values()) - max(lean.kept.values()) == 2 * 16 * 32 * 4


def test_regather_keeps_the_shard_and_gathers_again_once():
    """Megatron-LM's sequence parallelism: the shard is kept, and the backward pass gathers it once more."""
    log, _ = _shared_gather("regather")
    assert [e.phase for e in log.events if e.kind == "all_gather"] == ["forward", "backward"]


def test_a_weight_cast_for_compute_is_gathered_again_not_kept():
    """FSDP with mixed precision: a float32 weight cast to bfloat16 and gathered for the forward matmul is gathered
    again for the backward pass (as PyTorch FSDP does), not kept: a value made from parameters alone."""
    mesh = DeviceMesh("dp4", (4,), ("dp",))
    w = nb.abstract((256, 256), "float32").shard(mesh, ["dp", None])
    x = nb.abstract((64, 256), "bfloat16").shard(mesh, ["dp", None])

    def loss(w, x):
        h = nb.tanh(x @ w.astype("bfloat16"))
        return (h @ w.astype("bfloat16")).astype("float32").sum()  # (the second use needs dh: w read again)

    with nb.comm_log() as log:
        nb.grad(loss)(w, x)
    gathers = [e.phase for e in log.events if e.kind == "all_gather"]
    assert gathers.count("backward") >= 1 and gathers.count("forward") >= 1, log.summary()


MESH24 = DeviceMesh("m24", (2, 4), ("dp", "tp"))


def test_operands_cut_locally_run_the_ufunc_on_views():
    """A[dp,-] + B[-,tp]: each device's blocks are views of what it holds (no copy, nothing logged), and the
    cached program calls numpy's ufunc on them directly."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
    a[3, 4], b[5, 6] = np.nan, -np.inf
    A, B = nb.tensor(a).shard(MESH24, ["dp", None]), nb.tensor(b).shard(MESH24, [None, "tp"])
    prog = program.program_for(nb.ops._BINARY["add"], (signatures.sid_of(A), signatures.sid_of(B)), (),
                               executor.current_strategy(), executor.current_cost_model())
    assert prog.fast is not None and all(isinstance(v, tuple) and isinstance(v[0], tuple) for v in prog.fast)
    with nb.comm_log() as log:
        out = A + B
    assert log.events == [] and out.sharding.dim_specs[0].axes == ("dp",)
    assert_matches_numpy(out, a + b)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.uint8, np.bool_, np.float64])
@pytest.mark.parametrize("op", ["max", "min"])
def test_a_max_over_sharded_dims_reduces_across_devices_in_its_kernel(op, dtype):
    """The all_reduce after a max over a sharded dim is done by the kernel (one numpy call over the grid and
    the block); the log still shows it, with its bytes, and values, blocks and dtype are numpy's."""
    rng = np.random.default_rng(1)
    g = (rng.standard_normal((48, 40)) * 60).astype(dtype)
    if dtype in (np.float32, np.float64, np.float16):
        g[7, 3], g[30, 9] = np.nan, np.inf
    for spec, axis in [(["dp", "tp"], 0), (["dp", "tp"], None), ([("dp", "tp"), None], 0), (["tp", "dp"], 1),
                       ([None, "tp"], 1), (["dp", None], (0, 1))]:
        t = nb.tensor(g).shard(MESH24, spec)
        for keepdims in (False, True):
            with nb.comm_log() as log:
                out = getattr(t, op)(axis, keepdims)
            want = getattr(g, op)(axis, keepdims=keepdims)
            assert_matches_numpy(out, want)
            assert log.counts["all_reduce"] == 1 and all(e.op == op for e in log.events)
            if len(log.events) == 1:  # ring all_reduce: 2 (k - 1) / k of the reduced block
                e, block = log.events[0], out.to_local(0).nbytes
                assert e.bytes == 2 * (e.group - 1) * block // e.group


def test_the_fold_is_one_call_over_grid_and_block():
    t = nb.tensor(np.arange(64 * 64, dtype=np.float32).reshape(64, 64)).shard(MESH24, ["dp", "tp"])
    prog = program.program_for(nb.ops._MAX, (signatures.sid_of(t),), ((0,), False), executor.current_strategy(),
                             executor.current_cost_model())
    assert prog.folded and prog.local.fold == (0,)
    uneven = nb.tensor(np.arange(63 * 64, dtype=np.float32).reshape(63, 64)).shard(MESH24, ["dp", "tp"])
    prog = program.program_for(nb.ops._MAX, (signatures.sid_of(uneven),), ((0,), False), executor.current_strategy(),
                             executor.current_cost_model())
    assert not prog.folded  # padded blocks: the padding must not take part, the plain path handles it
    assert_matches_numpy(uneven.max(0), np.arange(63 * 64, dtype=np.float32).reshape(63, 64).max(0))


def test_summands_that_overflow_where_their_sum_does_not_warn_nothing():
    """A pending sum of 3e38 and -3e38 is 0: numpy on the value warns nothing, so neither does nabla (whose
    summands overflow when the op is applied to them; the result is redone from the sum). A value that does
    overflow still raises under np.errstate(over="raise"), as numpy does."""
    ring = DeviceMesh("ring4", (4,), ("k",))
    z = nb.from_local([np.array([3e38], np.float32), np.array([-3e38], np.float32)] +
                      [np.zeros(1, np.float32)] * 2, ring, [None], partial_axes=["k"])
    w = nb.from_local([np.full((1, 1), s, np.float32) for s in (3e38, -3e38, 0, 0)], ring, [None, None],
                      partial_axes=["k"])
    with np.errstate(all="raise"):
        for got in (z * 2, z / 0.5, z + z, z.sum(), w @ nb.tensor(np.full((1, 1), 4, np.float32))):
            assert_matches_numpy(got, np.zeros(got.shape, np.float32))
        big = nb.from_local([np.array([3e38], np.float32)] + [np.zeros(1, np.float32)] * 3, ring, [None],
                            partial_axes=["k"])
        with pytest.raises(FloatingPointError):
            np.float32(3e38) * np.float32(2)
        with pytest.raises(FloatingPointError):
            big * 2


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_a_mixed_add_runs_in_the_order_of_an_operands_blocks(order):
    """A[dp,-] + B[-,tp]: numpy's loop over the result's [dp,tp] order steps through 16-element rows of both
    operands; in B's stored order (tp's blocks, each 64 rows of 16) A's rows are the only strided operand. The
    kernel runs there and the result is that output with its grid axes transposed: each device's block is still
    contiguous, and later ops read it as any stored value."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
    a[0, 0], b[63, 63], a[7, 9], b[7, 9] = np.nan, np.inf, -0.0, -0.0
    A, B = nb.tensor(a).shard(MESH24, ["dp", None]), nb.tensor(b).shard(MESH24, [None, "tp"])
    (x, y), (u, v) = ((A, B), (a, b)) if order == "ab" else ((B, A), (b, a))
    prog = program.program_for(nb.ops._BINARY["add"], (signatures.sid_of(x), signatures.sid_of(y)), (),
                               executor.current_strategy(), executor.current_cost_model())
    assert prog.reorder == (1, 0, 2, 3)
    with nb.comm_log() as log:
        out = x + y
    assert log.events == []
    assert not out._data.flags.c_contiguous and all(out._data[i, j].flags.c_contiguous
                                                     for i in range(2) for j in range(4))
    assert_matches_numpy(out, u + v)
    # what reads it: an elementwise op, a matmul, a reduction, views, a relayout that moves data, the host
    assert_matches_numpy(out * out, (u + v) * (u + v))
    assert_matches_numpy(out @ B, (u + v) @ b, rtol=1e-5, atol=1e-5)
    assert_matches_numpy(out.sum(1), (u + v).sum(1), rtol=1e-5, atol=1e-5)
    assert_matches_numpy(out.T.reshape(4, 16, 64), (u + v).T.reshape(4, 16, 64))
    assert_matches_numpy(out.with_sharding(MESH24, ["tp", "dp"]), u + v)
    np.testing.assert_array_equal(np.asarray(out), u + v)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint16", "bool", "complex64", "bfloat16"])
def test_a_strided_operand_is_packed_before_the_kernel(dtype):
    """A[dp,-] + B[-,tp] at 64x64: in B's block order A's rows are 16-element runs numpy would loop over one by
    one; the kernel copies them contiguous first (each run one void item), then runs numpy's ufunc once and, where
    the copy has the result's dtype, writes into it. Values (NaN, -0.0, integer wrap-around) and dtypes are
    numpy's, on every device; the operands' blocks are untouched and the result shares no memory with them."""
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(3)
    a, b = ((rng.standard_normal((64, 64)) * 100).astype(dt) for _ in range(2))
    if dt.kind in "fc" or dtype == "bfloat16":
        a[0, 0], b[63, 63], a[7, 9], b[7, 9] = np.nan, np.inf, -0.0, -0.0
    a0, b0 = a.copy(), b.copy()
    A, B = nb.tensor(a).shard(MESH24, ["dp", None]), nb.tensor(b).shard(MESH24, [None, "tp"])
    ops = [(nb.add, np.add), (nb.less, np.less)] + ([] if dt.kind == "b" else [(nb.maximum, np.maximum)])
    for f, g in ops:
        prog = program.program_for(f.op, (signatures.sid_of(A), signatures.sid_of(B)), (),
                                   executor.current_strategy(), executor.current_cost_model())
        assert prog.fast[0][-1][0] == "pack" and prog.reorder == (1, 0, 2, 3)
        with np.errstate(invalid="ignore"):  # (NaN compared: numpy warns, in both)
            out, want = f(A, B), g(a, b)
        assert prog.into == (0 if want.dtype == dt else None)  # (a bool result is not A's dtype)
        assert_matches_numpy(out, want)
        assert not np.shares_memory(out._data, A._data) and not np.shares_memory(out._data, B._data)
        assert all(out._data[i, j].flags.c_contiguous for i in range(2) for j in range(4))
    assert np.asarray(A).tobytes() == a0.tobytes() and np.asarray(B).tobytes() == b0.tobytes()


def test_a_pack_of_an_operand_held_as_a_lazy_view_copies_it_whole():
    """The program plans a pack on the layout (the signature), not on how the blocks lie in memory: an operand
    held as a lazy transpose has no contiguous last axis to copy as void items, so it is copied as it is (a
    regression: numpy's "the last axis must be contiguous" came out of an elementwise add)."""
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
    At = nb.tensor(a).shard(MESH24, [None, "dp"]).T
    B = nb.tensor(b).shard(MESH24, [None, "tp"])
    assert At._data.strides[-1] != At._data.itemsize
    prog = program.program_for(nb.add.op, (signatures.sid_of(At), signatures.sid_of(B)), (),
                               executor.current_strategy(), executor.current_cost_model())
    assert any(k == "pack" for v in prog.fast if v for k, _ in v)
    assert_matches_numpy(At + B, a.T + b)
    assert_matches_numpy(B - At, b - a.T)


def test_a_strided_operand_of_single_element_runs_or_of_many_bytes_is_not_packed():
    """A pack copies runs of the last dim as void items: at 4x4 on 2x4 each run is one element (there is nothing to
    pack); at 1024x1024 float32 (4 MiB) the copy's extra pass through memory costs more than numpy's loops
    (``program._PACK_BYTES``)."""
    for n, dt in ((4, np.float32), (1024, np.float32)):
        A = nb.tensor(np.ones((n, n), dt)).shard(MESH24, ["dp", None])
        B = nb.tensor(np.ones((n, n), dt)).shard(MESH24, [None, "tp"])
        prog = program.program_for(nb.add.op, (signatures.sid_of(A), signatures.sid_of(B)), (),
                                   executor.current_strategy(), executor.current_cost_model())
        assert all(k != "pack" for v in prog.fast if v for k, _ in v) and prog.into is None
        np.testing.assert_array_equal(np.asarray(A + B), np.full((n, n), 2, dt))


@given(mesh=meshes(max_axes=3, max_devices=16), data=st.data())
@settings(max_examples=examples(40))
def test_elementwise_ops_on_any_two_layouts_equal_numpy(mesh, data):
    """Two operands on unrelated layouts of a mesh (each kept where it lies, cut locally, or moved): every
    result, and what reads it, is numpy's at every device."""
    shape = data.draw(shapes(min_rank=1, max_rank=3, max_dim=8))
    s1 = data.draw(specs(mesh, shape, partial=False))
    s2 = data.draw(specs(mesh, shape[data.draw(st.integers(0, len(shape))):], partial=False))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape[len(shape) - len(s2.dim_specs):]).astype(np.float32)
    A = nb.tensor(a).shard(mesh, s1.dim_specs, s1.replicated_axes)
    B = nb.tensor(b).shard(mesh, s2.dim_specs, s2.replicated_axes)
    for got, want in [(A + B, a + b), (B - A, b - a), (nb.maximum(A, B), np.maximum(a, b))]:
        assert_matches_numpy(got, want)
        assert_matches_numpy(got * 2.0, want * np.float32(2.0))
        assert_matches_numpy(got + A, want + a)


@given(mesh=meshes(max_axes=3, max_devices=16), data=st.data(),
       dtype=st.sampled_from(["float32", "float64", "int8", "int64", "bool", "complex128"]))
@settings(max_examples=examples(60))
def test_elementwise_ops_on_packed_operands_equal_numpy(mesh, data, dtype):
    """Operands each cut locally from a common layout (every dim a prefix of its axes), so the kernel reads
    views of them, with every operand that can be packed packed (packs priced at nothing, numpy's loops dear):
    what any pack the kernel may choose computes, on layouts too small for it to choose one, is numpy's, and
    the operands' blocks are untouched; one operand may broadcast, the other be held as a lazy transpose."""
    rank = data.draw(st.integers(1, 3))
    common = data.draw(specs(mesh, (64,) * rank, partial=False, open_dims=False, sub_axes=False))
    shape = tuple(common.num_shards(d) * data.draw(st.integers(1, 4)) for d in range(rank))
    cut = [[list(ds.axes[:data.draw(st.integers(0, len(ds.axes)))]) for ds in common.dim_specs] for _ in range(2)]
    lead = data.draw(st.integers(0, rank - 1))  # B broadcasts along its first ``lead`` dims (it has none of them)
    perm = data.draw(st.permutations(range(rank)))  # A is held as a lazy transpose of blocks laid out in this order
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    a, b = (rng.standard_normal(shape) * 50).astype(dtype), (rng.standard_normal(shape[lead:]) * 50).astype(dtype)
    saved = program._LOOP, program._DEEP_LOOP, program._VIEW_CALL, program._COPY_CALL
    program._LOOP, program._DEEP_LOOP, program._VIEW_CALL, program._COPY_CALL = 10**6, 10**6, 0, -10**6
    program.program_for.cache_clear()
    try:
        A = nb.tensor(a.transpose(perm)).shard(mesh, [cut[0][p] for p in perm]).transpose(np.argsort(perm))
        B = nb.tensor(b).shard(mesh, cut[1][lead:])
        with np.errstate(all="ignore"):
            for got, want in [(A + B, a + b), (nb.maximum(B, A), np.maximum(b, a)), (A == B, a == b)]:
                assert_matches_numpy(got, want)
                assert_matches_numpy(got * got, want * want)
        assert np.asarray(A).tobytes() == a.tobytes() and np.asarray(B).tobytes() == b.tobytes()
    finally:
        program._LOOP, program._DEEP_LOOP, program._VIEW_CALL, program._COPY_CALL = saved
        program.program_for.cache_clear()


def _chain_of_views(data, x: np.ndarray, max_dim: int) -> tuple[tuple, np.ndarray, bool]:
    """Up to 3 reshapes and transposes of ``x`` drawn at random: the chain, numpy's result, and whether its last
    reshape copied (the chain then ends there)."""
    chain, view = [], x
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()):
            perm = tuple(data.draw(st.permutations(range(view.ndim))))
            chain.append(("transpose", perm))
            view = view.transpose(perm)
        else:
            n = view.size
            new = data.draw(st.lists(st.integers(1, max_dim), max_size=4).filter(lambda s: int(np.prod(s)) == n))
            chain.append(("reshape", tuple(new)))
            view = view.reshape(new)
            if not np.shares_memory(view, x):
                return tuple(chain), view, True
    return tuple(chain), view, False


@given(shape=shapes(min_rank=1, max_rank=4, max_dim=4).filter(lambda s: 0 not in s), data=st.data())
@settings(max_examples=examples(200))
def test_the_strides_of_a_chain_of_views_are_numpys(shape, data):
    """``program._viewed`` prices a view chain without making it: its shape and strides are numpy's (strides over
    dims of more than one element: a dim of one is never stepped), and None exactly where numpy's reshape
    copies."""
    x = np.zeros(shape, np.float32)
    chain, view, copied = _chain_of_views(data, x, 4)
    if copied:
        assert program._viewed(shape, chain) is None
        return
    got = program._viewed(shape, chain)
    assert got is not None and got[0] == view.shape
    assert tuple(s for s, n in zip(got[1], view.shape) if n > 1) == \
        tuple(s // 4 for s, n in zip(view.strides, view.shape) if n > 1)


@given(shape=shapes(min_rank=1, max_rank=4, max_dim=6).filter(lambda s: 0 not in s), data=st.data(),
       dtype=st.sampled_from(["float32", "int8", "complex128", "bool"]))
@settings(max_examples=examples(200))
def test_a_pack_read_from_the_stored_void_items_is_numpys_view_of_the_chain(shape, data, dtype):
    """``program._void_chain``: a pack may read each run as a void item of the stored blocks and make its views
    on those (fewer, smaller views). Where it says so, that is numpy's reshape and transpose of the blocks, run by
    run, whether the blocks lie C-contiguous (with no copy made on the way) or as a lazy transpose whose last axis
    is contiguous; a run that is not whole void items of the stored blocks is refused."""
    x = np.arange(int(np.prod(shape))).astype(dtype).reshape(shape)
    chain, view, copied = _chain_of_views(data, x, 6)
    if view.ndim == 0:
        return
    run = view.shape[-1]
    found = program._void_chain(shape, chain, run)
    if copied or run > 1 and view.strides[-1] != x.itemsize or shape[-1] % run or \
            any(n > 1 and (s // x.itemsize) % run for n, s in zip(view.shape[:-1], view.strides)):
        assert found is None  # (a reshape that copies; a last dim not one run; runs not whole void items)
        return
    assert found is not None
    void = np.dtype(f"V{run * x.itemsize}")
    lazy = np.ascontiguousarray(x.transpose(tuple(range(x.ndim - 1))[::-1] + (x.ndim - 1,)))
    for held in (x, lazy.transpose(tuple(range(x.ndim - 1))[::-1] + (x.ndim - 1,))):  # (the second: a lazy view)
        items = held.view(void)
        for kind, arg in found:
            items = getattr(items, kind)(arg)
        assert held is not x or np.shares_memory(items, held)  # views of C-contiguous blocks: the pack's copy only
        got = items.copy().view(x.dtype)
        assert got.shape == view.shape and got.tobytes() == np.ascontiguousarray(view).tobytes()
    assert len(found) <= 2 and all(kind != "reshape" or arg != shape[:-1] + (shape[-1] // run,)
                                   for kind, arg in found)


def test_the_mixed_add_packs_from_void_items_with_one_transpose():
    """A[dp,-] + B[-,tp]: A's stored blocks (2, 1, 32, 64) read as 64-byte items (2, 1, 32, 4) are the pack's
    layout after one transpose (the reshape to the kernel's grid only moves the 1 of tp's replicas)."""
    assert program._void_chain((2, 1, 32, 64), (("reshape", (2, 32, 4, 16)), ("transpose", (2, 0, 1, 3))), 16) == \
        (("transpose", (3, 0, 2, 1)),)
