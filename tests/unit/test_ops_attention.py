"""nb.dot_product_attention against jax.nn.dot_product_attention (values and jax.grad) on random meshes and
shardings of batch, heads and query sequence (GQA, causal, bias, mask, bfloat16), every device's block checked;
what moves (nothing for batch and heads, the keys' and values' ring all_gathers for context parallelism); FLOPs
as FlashAttention counts them; nb.jit, ONNX export (onnxruntime) and the refusals."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import nabla as nb
from nabla import DeviceMesh, ShardingError
from nabla.ops import attention as A
from nabla.testing import assert_comm, assert_sharded_allclose, examples, meshes, specs

jax = pytest.importorskip("jax")
jnp = jax.numpy
ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = 4


def place(draw, mesh, value, partial=False):
    spec = draw(specs(mesh, value.shape, partial=partial))
    return nb.tensor(value).shard(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes)


def problem(draw, dtype=np.float32):
    """Shapes (B, T, S, N = K·G, H) with GQA, a bias and a mask of drawn broadcast shapes (some rows fully masked),
    causal or not, and the values."""
    B, T, S = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    K, G, H = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    N = K * G
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, S, K, H)).astype(dtype)
    v = rng.standard_normal((B, S, K, H)).astype(dtype)
    full = (B, N, T, S)

    def broadcast():
        return tuple(n if draw(st.booleans()) else 1 for n in full)

    bias = rng.standard_normal(broadcast()).astype(dtype) if draw(st.booleans()) else None
    mask = None
    if draw(st.booleans()):
        mask = rng.random(broadcast()) > 0.3
        mask.reshape(-1, mask.shape[-1])[0] = False  # a row with nothing kept: uniform, as jax's
    return q, k, v, bias, mask, draw(st.booleans())


def close(got, want, dtype, rtol=1e-5, atol=1e-5):
    want = np.asarray(want)
    assert got.dtype == dtype and want.dtype == dtype, (got.dtype, want.dtype)
    if dtype == BF16:
        scale = max(float(np.abs(want.astype(np.float64)).max(initial=0)), 1.0)
        assert_sharded_allclose(got.astype("float64"), want.astype(np.float64), rtol=2e-2, atol=2e-2 * scale)
    else:
        assert_sharded_allclose(got, want, rtol=rtol, atol=atol)


def placed(draw, mesh, q, k, v, bias, mask, partial=True):
    return (place(draw, mesh, q, partial), place(draw, mesh, k, partial), place(draw, mesh, v, partial),
            None if bias is None else place(draw, mesh, bias), None if mask is None else place(draw, mesh, mask))


# ---- values and gradients on every sharding, against jax -----------------------------------------------------


@settings(max_examples=examples(10))  # each example compiles jax's reference anew
@given(st.data())
def test_values_equal_jax_on_every_sharding(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    q, k, v, bias, mask, causal = problem(draw)
    scale = draw(st.sampled_from([None, 0.3]))
    want = jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, is_causal=causal)
    got = nb.dot_product_attention(*placed(draw, mesh, q, k, v, bias, mask), scale=scale, is_causal=causal)
    close(got, want, np.dtype(np.float32))


@settings(max_examples=examples(5))
@given(st.data())
def test_gradients_equal_jax_grad_on_every_sharding(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    q, k, v, bias, mask, causal = problem(draw)
    w = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)  # every output element its cotangent
    args = (q, k, v) + ((bias,) if bias is not None else ())
    nums = tuple(range(len(args)))

    def jf(q, k, v, b=None):
        return (jax.nn.dot_product_attention(q, k, v, b, mask, is_causal=causal) * w).sum()

    def f(q, k, v, b=None):
        return (nb.dot_product_attention(q, k, v, b, m, is_causal=causal) * w).sum()

    want = jax.grad(jf, argnums=nums)(*args)
    t = placed(draw, mesh, q, k, v, bias, mask)
    m = t[4]
    got = nb.grad(f, argnums=nums)(*[x for x in t[:4] if x is not None])
    for g, ww, x in zip(got, want, t):
        assert [d.axes for d in g.sharding.dim_specs] == [d.axes for d in x.sharding.dim_specs]
        assert g.sharding.partial_axes == ()
        close(g, np.asarray(ww), np.dtype(np.float32), rtol=1e-4, atol=2e-5)


@settings(max_examples=examples(3))
@given(st.data())
def test_bfloat16_values_and_gradients_equal_jax_at_bf16_precision(data):
    """Computed in float32 and rounded once (jax rounds the probabilities to bfloat16 too: the two differ by a
    bfloat16 rounding)."""
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    q, k, v, bias, mask, causal = problem(draw, BF16)
    w = np.random.default_rng(1).standard_normal(q.shape).astype(BF16)
    t = placed(draw, mesh, q, k, v, bias, mask, partial=False)
    close(nb.dot_product_attention(*t, is_causal=causal),
          jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=causal), BF16)
    want = jax.grad(lambda q, k, v: (jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=causal) * w).sum(),
                    argnums=(0, 1, 2))(q, k, v)
    got = nb.grad(lambda q, k, v: (nb.dot_product_attention(q, k, v, t[3], t[4], is_causal=causal) * w).sum(),
                  argnums=(0, 1, 2))(*t[:3])
    for g, ww in zip(got, want):
        close(g, np.asarray(ww), BF16)


def test_unbatched_operands_and_host_values_as_jax():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((5, 4, 8)), rng.standard_normal((7, 2, 8)), rng.standard_normal((7, 2, 8))
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    bias = rng.standard_normal((5, 7)).astype(np.float32)  # rank 2: broadcast as (1, 1, T, S), as jax does
    got = nb.dot_product_attention(q, k, v, bias, is_causal=True)
    assert got.shape == (5, 4, 8)
    assert_sharded_allclose(got, np.asarray(jax.nn.dot_product_attention(q, k, v, bias, is_causal=True)))


# ---- what moves ---------------------------------------------------------------------------------------------


MESH = DeviceMesh("cluster", (2, 4), ("dp", "cp"))
B, T, S, N, K, H = 4, 16, 16, 8, 4, 8
R = np.random.default_rng(0)
Q = R.standard_normal((B, T, N, H)).astype(np.float32)
KEY = R.standard_normal((B, S, K, H)).astype(np.float32)
VAL = R.standard_normal((B, S, K, H)).astype(np.float32)
W = R.standard_normal((B, T, N, H)).astype(np.float32)


def loss(q, k, v):
    return (nb.dot_product_attention(q, k, v, is_causal=True) * W).sum()


def jloss(q, k, v):
    return (jax.nn.dot_product_attention(q, k, v, is_causal=True) * W).sum()


def test_batch_and_head_shardings_move_nothing_forward_or_backward():
    """Batch over dp, heads over cp (the kv heads cut with them: 4 kv heads, 2 query heads each, over 4)."""
    dims = ["dp", None, "cp", None]
    q, k, v = (nb.tensor(x).shard(MESH, dims) for x in (Q, KEY, VAL))
    with nb.comm_log() as log:
        out = nb.dot_product_attention(q, k, v, is_causal=True)
        grads = nb.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert_comm(log)  # nothing
    assert [d.axes for d in out.sharding.dim_specs] == [("dp",), (), ("cp",), ()]
    assert_sharded_allclose(out, np.asarray(jax.nn.dot_product_attention(Q, KEY, VAL, is_causal=True)))
    for g, w in zip(grads, jax.grad(jloss, argnums=(0, 1, 2))(Q, KEY, VAL)):
        assert_sharded_allclose(g, np.asarray(w), rtol=1e-4, atol=1e-5)


def test_query_heads_cut_finer_than_kv_heads_leave_kv_gradients_summed_over_the_group():
    """8 query heads over 4 devices with 2 kv heads: the kv heads are cut over cp's major half, each device's 2
    query heads share one kv head (no move forward); dk, dv are partial over cp's minor half (the group), summed
    by one all_reduce each, of the (B/dp, S, 1, H) block."""
    k2, v2 = KEY[:, :, :2], VAL[:, :, :2]
    q = nb.tensor(Q).shard(MESH, ["dp", None, "cp", None])
    k, v = (nb.tensor(x).shard(MESH, ["dp", None, "cp:(1)2", None]) for x in (k2, v2))
    with nb.comm_log() as log:
        out = nb.dot_product_attention(q, k, v)
    assert_comm(log)
    assert_sharded_allclose(out, np.asarray(jax.nn.dot_product_attention(Q, k2, v2)))
    with nb.comm_log() as log:
        grads = nb.grad(lambda q, k, v: (nb.dot_product_attention(q, k, v) * W).sum(), argnums=(0, 1, 2))(q, k, v)
    block = B // 2 * S * 1 * H * F32
    summed = ("all_reduce", ("cp:(2)2",), 2 * (2 - 1) * block // 2)  # over the group's 2 devices
    assert sorted((e.kind, e.axes, e.bytes) for e in log.events) == [summed] * 2
    want = jax.grad(lambda q, k, v: (jax.nn.dot_product_attention(q, k, v) * W).sum(), argnums=(0, 1, 2))(Q, k2, v2)
    for g, w in zip(grads, want):
        assert_sharded_allclose(g, np.asarray(w), rtol=1e-4, atol=1e-5)


def test_context_parallelism_all_gathers_keys_and_values_only():
    """q, k, v cut on the sequence over cp (4) and the batch over dp (2): the forward all_gathers k and v over cp,
    (k-1)·block bytes each; the output stays cut on the sequence. The backward gathers them once more (for both
    fused backward ops) and reduce_scatters dk and dv to their blocks: (k-1)/k of the gathered block each."""
    dims = ["dp", "cp", None, None]
    q, k, v = (nb.tensor(x).shard(MESH, dims) for x in (Q, KEY, VAL))
    cp = 4
    block = B // 2 * (S // cp) * K * H * F32  # one device's k (or v) block
    with nb.comm_log() as log:
        out = nb.dot_product_attention(q, k, v, is_causal=True)
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("all_gather", ("cp",), (cp - 1) * block)] * 2
    assert [d.axes for d in out.sharding.dim_specs] == [("dp",), ("cp",), (), ()]
    assert_sharded_allclose(out, np.asarray(jax.nn.dot_product_attention(Q, KEY, VAL, is_causal=True)))
    with nb.comm_log() as log:
        grads = nb.grad(loss, argnums=(0, 1, 2))(q, k, v)
    back = sorted((e.kind, e.axes, e.bytes) for e in log.events if e.phase == "backward")
    assert back == sorted([("all_gather", ("cp",), (cp - 1) * block)] * 2 +
                          [("reduce_scatter", ("cp",), (cp - 1) * (cp * block) // cp)] * 2)
    for g, w in zip(grads, jax.grad(jloss, argnums=(0, 1, 2))(Q, KEY, VAL)):
        assert [d.axes for d in g.sharding.dim_specs] == [("dp",), ("cp",), (), ()]
        assert_sharded_allclose(g, np.asarray(w), rtol=1e-4, atol=1e-5)


def test_the_backward_keeps_no_scores():
    """No step of the forward or backward pass makes a (B, N, T, S) value: the scores live inside the fused
    kernels only. The backward runs the dq and dk/dv ops (and nothing that is a matmul or a softmax)."""
    q, k, v = (nb.tensor(x).shard(MESH, ["dp", "cp", None, None]) for x in (Q, KEY, VAL))
    with nb.comm_log() as log:
        nb.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert all(tuple(s.out_shape) != (B, N, T, S) and np.prod(s.out_shape) < B * N * T * S for s in log.steps)
    names = {s.name for s in log.steps if s.phase == "backward"}
    assert {"dot_product_attention_dq", "dot_product_attention_dkv"} <= names
    assert not names & {"matmul", "einsum", "softmax", "exp"}
    op = nb.dot_product_attention.op
    assert op.saves == "all"  # q, k, v (bias, mask) and the output
    block = (B // 2, T // 4, N, H)  # the result block on [dp, cp, -, -]
    assert op.saved_extra((block, (B // 2, S, K, H), (B // 2, S, K, H)), block, ()) == B // 2 * (T // 4) * N * F32


# ---- FLOPs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t, s", [(16, 16), (6, 10), (10, 6)])
@pytest.mark.parametrize("causal", [False, True])
def test_flops_are_flashattentions(t, s, causal):
    """Forward 4·B·N·T·S·H over the kept (query, key) pairs (numpy's tril counts them when causal); backward 2.5
    times that (FlashAttention-2's five matmuls against two, Dao 2023). Sharded on dp and cp: the same total."""
    q = nb.abstract((B, t, N, H))
    k = nb.abstract((B, s, K, H))
    pairs = int(np.tril(np.ones((t, s))).sum()) if causal else t * s
    forward = 4 * B * N * H * pairs
    assert nb.flops(lambda q, k, v: nb.dot_product_attention(q, k, v, is_causal=causal), q, k, k) == forward
    with nb.comm_log() as log:
        nb.grad(lambda q, k, v: nb.dot_product_attention(q, k, v, is_causal=causal).sum(), argnums=(0, 1, 2))(q, k, k)
    by = {}
    for st_ in log.steps:
        by[st_.name] = by.get(st_.name, 0) + st_.flops
    assert by["dot_product_attention"] == forward
    assert by["dot_product_attention_dq"] + by["dot_product_attention_dkv"] == 5 * forward // 2
    if t % 4 == 0:
        def sharded(shape):
            return nb.abstract(shape).shard(MESH, ["dp", "cp", None, None])
        assert nb.flops(lambda q, k, v: nb.dot_product_attention(q, k, v, is_causal=causal),
                        sharded((B, t, N, H)), sharded((B, s, K, H)), sharded((B, s, K, H))) == forward


# ---- nb.jit and ONNX ---------------------------------------------------------------------------------------------


def test_jit_lowers_to_jax_attention_and_equals_eager(monkeypatch):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 jax devices (set in tests/conftest.py)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from jit_check import assert_hlo_is_the_log

    calls = []
    real = jax.nn.dot_product_attention

    def counted(*a, **kw):
        calls.append(kw.get("is_causal"))
        return real(*a, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", counted)
    bias = R.standard_normal((1, N, T, S)).astype(np.float32)
    mask = R.random((B, 1, T, S)) > 0.2
    gqa = KEY[:, :, :2], VAL[:, :, :2]
    for dims, (k_, v_) in [(["dp", "cp", None, None], (KEY, VAL)), (["dp", None, "cp", None], gqa),
                           (["dp", None, None, None], gqa)]:
        q, k, v = nb.tensor(Q).shard(MESH, dims), nb.tensor(k_).shard(MESH, dims), nb.tensor(v_).shard(MESH, dims)
        b = nb.tensor(bias).shard(MESH, [None, dims[2], dims[1], None])

        def f(q, k, v, b):
            return nb.dot_product_attention(q, k, v, b, mask, is_causal=True)

        def g(q, k, v, b):
            return nb.grad(lambda *a: (f(*a) * W).sum(), argnums=(0, 1, 2, 3))(q, k, v, b)

        calls.clear()
        assert_sharded_allclose(nb.jit(f)(q, k, v, b), f(q, k, v, b).numpy(), rtol=1e-5, atol=1e-6)
        assert calls == [dims[1] is None]  # jax's causal flag, or its mask when the device holds some rows only
        for got, want in zip(nb.jit(g)(q, k, v, b), g(q, k, v, b)):
            assert_sharded_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
        for fn in (f, g):
            assert_hlo_is_the_log(nb.jit(fn).lower(q, k, v, b))
    assert_sharded_allclose(nb.jit(lambda q: nb.dot_product_attention(q, KEY, VAL))(nb.tensor(Q)),
                            np.asarray(real(Q, KEY, VAL)))


def test_onnx_export_equals_onnxruntime():
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import nabla.onnx as nox

    bias = R.standard_normal((B, 1, T, S)).astype(np.float32)
    mask = R.random((1, N, T, S)) > 0.2
    mask[0, 0, 3] = False
    k2, v2 = KEY[:, :, :2], VAL[:, :, :2]
    for causal in (False, True):
        dims = ["dp", "cp", None, None]
        args = [nb.tensor(Q).shard(MESH, dims), nb.tensor(k2).shard(MESH, dims), nb.tensor(v2).shard(MESH, dims),
                nb.tensor(bias), nb.tensor(mask)]
        m = nox.export(lambda q, k, v, b, msk: nb.dot_product_attention(q, k, v, b, msk, scale=0.2,
                                                                       is_causal=causal), *args)
        types = {n.op_type for n in m.graph.node}
        assert {"MatMul", "Softmax", "Where", "Add"} <= types and "Attention" not in types
        assert any(n.device_configurations for n in m.graph.node)
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        got, = sess.run(None, dict(zip([i.name for i in m.graph.input], [Q, k2, v2, bias, mask])))
        want = jax.nn.dot_product_attention(Q, k2, v2, bias, mask, scale=0.2, is_causal=causal)
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)


def test_onnx_export_of_the_backward_ops_equals_jax_grad_in_onnxruntime():
    """The fused backward ops (what nb.grad runs) exported alone, fed jax's output and a cotangent: onnxruntime's
    dq, dk/dv and dbias equal jax.grad's."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import nabla.onnx as nox
    from nabla.ops.core import apply

    bias = R.standard_normal((1, N, T, S)).astype(np.float32)
    mask = R.random((B, 1, T, S)) > 0.2
    k2, v2 = KEY[:, :, :2], VAL[:, :, :2]
    out = np.asarray(jax.nn.dot_product_attention(Q, k2, v2, bias, mask, scale=0.3, is_causal=True))
    dq, dk, dv, db = jax.grad(lambda *a: (jax.nn.dot_product_attention(*a, mask, scale=0.3, is_causal=True) * W)
                              .sum(), argnums=(0, 1, 2, 3))(Q, k2, v2, bias)
    params = (0.3, True, True, True, T)
    rows = np.arange(T, dtype=np.int32)
    dims = ["dp", "cp", None, None]
    args = [nb.tensor(x).shard(MESH, dims) for x in (Q, k2, v2, out, W)] + [nb.tensor(bias)]
    for op, want in [(A._DQ, [dq]), (A._DKV, [np.stack([dk, dv])]), (A._DBIAS, [db])]:
        m = nox.export(lambda q, k, v, o, do, b, op=op: apply(op, (q, k, v, o, do, b, mask, rows), params), *args)
        assert "Attention" not in {n.op_type for n in m.graph.node}
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run(None, dict(zip([i.name for i in m.graph.input], [Q, k2, v2, out, W, bias])))
        np.testing.assert_allclose(got[0], np.asarray(want[0]), rtol=1e-4, atol=1e-5)


# ---- refusals ----------------------------------------------------------------------------------------------------


BAD = [
    ("H", dict(key=np.zeros((4, 16, 4, 6), np.float32), value=np.zeros((4, 16, 4, 6), np.float32)),
     r"dot_product_attention: key dim 3 \(H\) has size 6 but query's dim 3 has 8"),
    ("K", dict(key=np.zeros((4, 16, 3, 8), np.float32), value=np.zeros((4, 16, 3, 8), np.float32)),
     r"dot_product_attention: key dim 2 \(K, the kv heads\) has size 3, which does not divide query's dim 2 "
     r"\(N, the query heads\) of size 8"),
    ("value", dict(value=np.zeros((4, 15, 4, 8), np.float32)),
     r"dot_product_attention: value dim 1 \(S\) has size 15 but key's has 16"),
    ("rank", dict(query=np.zeros((16, 8), np.float32)),
     r"dot_product_attention: query, key and value must all be .* \(ranks \(2, 4, 4\)\)"),
    ("mask dtype", dict(mask=np.ones((1, 1, 16, 16), np.float32)),
     r"dot_product_attention: mask has dtype float32; it must be bool"),
    ("mask dim", dict(mask=np.ones((1, 2, 16, 16), bool)),
     r"dot_product_attention: mask dim 1 \(N\) has size 2; it must be 1 or 8 .* \(4, 8, 16, 16\)"),
    ("bias rank", dict(bias=np.ones((1, 1, 1, 16, 16), np.float32)),
     r"dot_product_attention: bias has shape \(1, 1, 1, 16, 16\) \(rank 5\)"),
    ("dtypes", dict(value=np.zeros((4, 16, 4, 8), np.float64)),
     r"dot_product_attention: query, key and value have dtypes float32, float32, float64"),
    ("batch", dict(key=np.zeros((2, 16, 4, 8), np.float32), value=np.zeros((2, 16, 4, 8), np.float32)),
     r"dot_product_attention: key dim 0 \(B\) has size 2 but query's dim 0 has 4"),
]


@pytest.mark.parametrize("name, change, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_anything_runs(name, change, message):
    dims = ["dp", "cp", None, None]
    args = {"query": nb.tensor(Q).shard(MESH, dims), "key": nb.tensor(KEY).shard(MESH, dims),
            "value": nb.tensor(VAL).shard(MESH, dims)}
    args.update(change)
    with nb.comm_log() as log:
        with pytest.raises(ShardingError, match=message):
            nb.dot_product_attention(**args)
    assert log.steps == [] and log.events == []
    with pytest.raises(ShardingError, match="is_causal must be a bool"):
        nb.dot_product_attention(Q, KEY, VAL, is_causal="yes")
    with pytest.raises(ShardingError, match="scale must be a number"):
        nb.dot_product_attention(Q, KEY, VAL, scale="1")


def test_registered_with_its_backward_ops():
    from nabla.ops import registry
    op = registry.lookup("dot_product_attention")
    assert op.public is nb.dot_product_attention and "dot_product_attention" in registry.names()
    assert op.vjp is not None and op.saved_extra is A._lse_bytes
    for name in ("dot_product_attention_dq", "dot_product_attention_dkv", "dot_product_attention_dbias"):
        assert registry.lookup(name).public is None  # internal: the VJP's
