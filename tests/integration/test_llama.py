"""A Llama-style training step (examples/train_llama.py) on a mesh: every layout's losses equal the unsharded
run's; bf16 mixed precision trains; one step's communication per mesh axis is Megatron-LM's analytical count
(Shoeybi et al. 2019, Korthikanti et al. 2022 for sequence parallelism), and no more bytes than jax.jit sends for
the same program with the same shardings."""

import importlib.util
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import nabla as nb

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_llama as L  # noqa: E402

CFG = L.CONFIG  # vocab 64, dim 64, 4 heads, 2 layers, SwiGLU 128, sequence 32, batch 8
F32 = 4


def _ring(kind: str, block: int, k: int) -> int:
    """Bytes per device of a ring collective over ``k`` devices on a local block of ``block`` bytes."""
    return {"all_reduce": 2 * (k - 1) * block // k, "reduce_scatter": (k - 1) * block // k,
            "all_gather": (k - 1) * block}[kind]


@pytest.mark.parametrize("layout", ["dp_tp", "dp_tp_sp", "fsdp"])
def test_every_layout_trains_as_the_unsharded_run(layout):
    want = L.train("single", steps=4)
    got = L.train(layout, steps=4)
    np.testing.assert_allclose(got, want, rtol=2e-4)
    assert got[-1] < got[0]


def test_bf16_mixed_precision_trains():
    f32 = L.train("dp_tp", steps=30)
    bf16 = L.train("dp_tp", steps=30, bf16=True)
    assert bf16[-1] < 0.75 * bf16[0]  # it learns
    assert abs(bf16[-1] - f32[-1]) < 0.25 * f32[-1]  # and ends where float32 does, within bf16's precision


def test_bf16_losses_are_the_same_on_every_layout():
    """bf16: every reduction accumulates in float32 and rounds once, whatever the layout (the cross-entropy's
    vocabulary-parallel sums, the norms' means, the loss's mean over the batch), so each layout's losses are the
    unsharded run's: within one bf16 ulp of the loss, where a bf16 matmul's partial sums (summed in bf16 across
    devices, as XLA sums a bf16 dot's on GPU) may round an activation or a gradient differently. (Before, when
    the reductions summed in bf16, the first step's loss was 4.94 unsharded and 4.56 on dp_tp: 12 ulps.)"""
    single = np.array(L.train("single", steps=8, bf16=True))
    ulp = np.spacing(single.astype(np.float32).astype(ml_dtypes.bfloat16)).astype(np.float32)
    for layout in ("dp_tp", "dp_tp_sp", "fsdp"):
        got = np.array(L.train(layout, steps=8, bf16=True))
        assert np.all(np.abs(got - single) <= ulp), (layout, got, single)


def _step_log(layout_name: str):
    layout = L.Layout(layout_name)
    params = L.init(CFG)
    specs = layout.param_specs(params)
    placed = L._tree_map2(lambda a, s: nb.abstract(a.shape).shard(layout.mesh, s), params, specs)
    ids = nb.abstract((CFG["batch"], CFG["seq"]), "int64").shard(layout.mesh, ["dp", None])
    step = nb.value_and_grad(lambda p, x, y: L.loss_fn(p, x, y, CFG, layout if layout.sp else None))
    with nb.comm_log() as log:
        step(placed, ids, ids)
    return log, params, specs, layout


def _param_blocks(params, specs, mesh):
    """Each parameter's block on one device, in bytes (float32)."""
    out = []

    def walk(a, s):
        if isinstance(a, dict):
            for k in a:
                walk(a[k], s[k])
        elif isinstance(a, list):
            for x, y in zip(a, s):
                walk(x, y)
        else:
            spec = nb.ShardingSpec(mesh, s)
            out.append(int(np.prod(spec.shard_shape(a.shape, 0))) * F32)
    walk(params, specs)
    return out


def test_a_megatron_step_sends_megatrons_bytes():
    """DP x TP (2 x 4): forward, 2 sums over tp of the (B/dp, S, D) activation per layer, plus the embedding's
    (its vocabulary-parallel lookup); backward, 2 per layer plus the final norm's input (its cotangent arrives
    summed over tp); dp, one sum of each parameter's local block; nothing else but the cross-entropy's (B, S)
    sums (the max and the sum of exponentials, over tp) and the loss's scalar."""
    log, params, specs, layout = _step_log("dp_tp")
    dp, tp, nl = 2, 4, CFG["layers"]
    act = CFG["batch"] // dp * CFG["seq"] * CFG["dim"] * F32  # one device's (B/dp, S, D) block
    rows = CFG["batch"] // dp * CFG["seq"] * F32
    by = lambda phase, kind, axes: sorted(e.bytes for e in log.events  # noqa: E731
                                          if e.phase == phase and e.kind == kind and e.axes == axes)
    assert by("forward", "all_reduce", ("tp",)) == sorted([_ring("all_reduce", act, tp)] * (2 * nl + 1) +
                                                          [_ring("all_reduce", rows, tp)] * 2)
    assert by("backward", "all_reduce", ("tp",)) == [_ring("all_reduce", act, tp)] * (2 * nl + 1)
    assert by("backward", "all_reduce", ("dp",)) == sorted(_ring("all_reduce", b, dp)
                                                           for b in _param_blocks(params, specs, layout.mesh))
    assert {(e.phase, e.kind, e.axes) for e in log.events} == {
        ("forward", "all_reduce", ("tp",)), ("backward", "all_reduce", ("tp",)),
        ("backward", "all_reduce", ("dp",))}, "nothing else moves"


def test_sequence_parallelism_trades_each_all_reduce_for_an_all_gather_and_a_reduce_scatter():
    """DP x TP x SP: the residual stream's sequence split over tp between blocks; every activation all_reduce of
    the plain step becomes an all_gather (before attention, the MLP and the head) and a reduce_scatter (after
    them, and after the embedding), forward and backward (each move's transpose), the same bytes in all; the
    norms' scales, computed on sequence shards, are summed over tp as well as dp (Megatron-SP's extra
    all-reduce of them)."""
    log, params, specs, layout = _step_log("dp_tp_sp")
    dp, tp, nl = 2, 4, CFG["layers"]
    act = CFG["batch"] // dp * CFG["seq"] * CFG["dim"] * F32
    moves = [(e.phase, e.kind) for e in log.events if e.axes == ("tp",) and e.bytes in
             (_ring("reduce_scatter", act, tp), _ring("all_gather", act // tp, tp))]
    for phase in ("forward", "backward"):
        assert moves.count((phase, "reduce_scatter")) == 2 * nl + 1
        assert moves.count((phase, "all_gather")) == 2 * nl + 1
    plain, *_ = _step_log("dp_tp")
    activation = lambda lg: sum(e.bytes for e in lg.events if e.axes == ("tp",) and e.bytes >= act // 2)  # noqa
    assert activation(log) == activation(plain)  # SP moves as many activation bytes as the all_reduces did
    norms = 2 * nl + 1
    small = [e for e in log.events if e.phase == "backward" and e.axes == ("tp",) and e.bytes < act // 2]
    assert len(small) == 2 * norms  # each norm scale's gradient: a reduce_scatter and an all_gather of (D,)
    assert all(e.bytes <= _ring("all_gather", CFG["dim"] * F32 // tp, tp) for e in small)


def _jax_loss(attend, cos, sin):
    """train_llama's loss in jax.numpy, the reference the tests compare with; ``attend(q, k, v)``: its causal
    attention on (batch, seq, heads, head dim) operands, ``cos``, ``sin``: the rotary tables."""
    import jax
    import jax.numpy as jnp

    def rms(x, g):  # L.rms_norm
        return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    def rot(x):
        h = x.shape[-1] // 2
        return x * cos + jnp.concatenate([-x[..., h:], x[..., :h]], -1) * sin

    def loss(p, ids, tgt):
        x = jnp.take(p["embed"], ids, axis=0)
        B, S, D = x.shape
        H = CFG["heads"]
        for q in p["layers"]:
            h = rms(x, q["norm1"])
            heads = lambda w: (h @ w).reshape(B, S, H, D // H)  # noqa: E731
            x = x + attend(rot(heads(q["wq"])), rot(heads(q["wk"])), heads(q["wv"])).reshape(B, S, D) @ q["wo"]
            h = rms(x, q["norm2"])
            x = x + (jax.nn.silu(h @ q["w1"]) * (h @ q["w3"])) @ q["w2"]
        logits = rms(x, p["norm"]) @ p["head"]
        lse = jax.scipy.special.logsumexp(logits, -1)
        return (lse - jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0]).mean()

    return loss


def test_no_more_bytes_than_jax_jit_sends_for_the_same_shardings():
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 jax devices")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import xla_harness as H

    log, params, specs, layout = _step_log("dp_tp")
    jmesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    to_p = lambda s: P(*[(a if isinstance(a, str) else None) for a in s])  # noqa: E731
    shard = L._tree_map2(lambda a, s: NamedSharding(jmesh, to_p(s)), params, specs)
    loss = _jax_loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     *L.rotary_tables(CFG["seq"], CFG["dim"] // CFG["heads"]))
    data = NamedSharding(jmesh, P("dp", None))
    f = jax.jit(jax.value_and_grad(loss), in_shardings=(shard, data, data), out_shardings=(None, shard))
    ids = np.zeros((CFG["batch"], CFG["seq"]), np.int32)
    hlo = f.lower(params, ids, ids).compile().as_text()
    xla = H.bytes_per_device(H.collectives(hlo))
    ours = log.total_bytes
    print(f"nabla {ours:,} B per device, XLA {xla:,}")
    assert ours <= xla, (ours, xla, log.summary())


def test_fsdp_gathers_weights_and_reduce_scatters_gradients_only():
    """ZeRO-3 (Rajbhandari et al. 2020): each parameter's block is all_gathered over dp while it is used, forward
    and again in the backward pass, and its gradient reduce_scattered to the block. The embedding is a weight
    like the others: with its rows and the batch both on dp, gathering the 64 x 64 table (12 KiB a device)
    is cheaper than gathering the token ids and summing the whole batch's embeddings (the vocabulary-parallel
    plan, 3.7 MB a step)."""
    log, params, specs, layout = _step_log("fsdp")
    k = layout.mesh.shape[layout.mesh.axis_names.index("dp")]
    kinds = {(e.phase, e.kind, e.axes) for e in log.events}
    assert kinds == {("forward", "all_gather", ("dp",)), ("backward", "all_gather", ("dp",)),
                     ("backward", "reduce_scatter", ("dp",))}, kinds
    blocks = _param_blocks(params, specs, layout.mesh)
    gathered = sum(e.bytes for e in log.events if e.phase == "forward")
    assert gathered == sum(_ring("all_gather", b, k) for b in blocks)  # every weight once, nothing else
    scattered = sum(e.bytes for e in log.events if e.kind == "reduce_scatter")
    assert scattered == sum(_ring("reduce_scatter", b * k, k) for b in blocks)


# ---- bf16 activations: what cannot halve is what jax keeps too ----------------------------------------------------

def _bench_llama():
    """benchmarks/llama.py, whose ``activation_widths`` makes the README's bf16 / float32 activations row."""
    spec = importlib.util.spec_from_file_location("bench_llama", ROOT / "benchmarks" / "llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _widths(dtype) -> dict[str, int]:
    """One DP x TP step at CFG as the benchmark runs it (Adam, a float32 master copy in bf16): its activations at
    their peak on one device, by width."""
    layout = L.Layout("dp_tp")
    params = layout.place(L.init(CFG), dtype)
    x, y = layout.data(*next(L.batches(L.tokens(vocab=CFG["vocab"])[0], CFG["batch"], CFG["seq"])))
    with nb.memory_log() as log:
        opt = nb.optim.Adam(1e-3, master_dtype=None if dtype == np.float32 else "float32")
        state = opt.init(params)
        _, grads = nb.value_and_grad(lambda p, a, b: L.loss_fn(p, a, b, CFG))(params, x, y)
        opt.update(grads, state, params)
    return _bench_llama().activation_widths(log)


def _jax_bf16_residuals() -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of what jax.vjp keeps for the same loss in bfloat16, read from jax's own report
    (jax.ad_checkpoint.print_saved_residuals), the arguments aside; attention is jax's FlashAttention
    (jax.experimental.pallas.ops.gpu.attention.mha, traced only: its residuals are q, k, v, the output and a
    float32 log-sum-exp per query row, as nabla's op keeps)."""
    import contextlib
    import io
    import re

    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax.ad_checkpoint import print_saved_residuals
    from jax.experimental.pallas.ops.gpu import attention as pallas

    bf16 = jnp.bfloat16
    scale = (CFG["dim"] // CFG["heads"]) ** -0.5
    loss = _jax_loss(lambda q, k, v: pallas.mha(q, k, v, None, sm_scale=scale, causal=True, interpret=True),
                     *(jnp.asarray(t, bf16) for t in L.rotary_tables(CFG["seq"], CFG["dim"] // CFG["heads"])))
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, bf16), L.init(CFG))
    ids = jnp.zeros((CFG["batch"], CFG["seq"]), jnp.int32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss, params, ids, ids)
    got = []
    for line in out.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line.strip())
        if m and not m.group(3).startswith("from the argument"):
            got.append((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)))
    return got


def test_bf16_activations_halve_but_for_what_jax_keeps_at_its_own_width(jax_x32):
    """The README's "activations, bf16 / float32" row: the bf16 step's activations are half the float32 step's
    except the ones whose width is not the program's float dtype, and those are what jax.vjp keeps for the same
    bf16 loss: one float32 log-sum-exp per query row of each attention layer (FlashAttention's; the norms' and
    the cross-entropy's statistics are bf16 in both) and the integer token ids and targets (the gather's and
    take_along_axis's indices; jax also keeps a bool per row in its logsumexp). nabla also keeps each attention
    layer's query positions (T int32; jax's kernel derives them from its grid): the same bytes in any dtype."""
    B, S, N, nl, dp, tp = CFG["batch"], CFG["seq"], CFG["heads"], CFG["layers"], 2, 4
    jax_kept = _jax_bf16_residuals()
    assert [s for d, s in jax_kept if d == "f32"] == [(B, N, S)] * nl  # the log-sum-exp, nothing else
    assert sorted(int(np.prod(s)) for d, s in jax_kept if d[0] in "iu") == [B * S, B * S]  # ids, targets
    # and a (B, S) bool of its logsumexp (its sum of exponentials >= 0, for abs's derivative): nabla keeps none
    assert [s for d, s in jax_kept if d not in ("bf16", "f32", "i32")] == [(B, S)]
    f32, bf16 = _widths(np.float32), _widths(ml_dtypes.bfloat16)
    # per device: the log-sum-exp split as the queries are (batch over dp, heads over tp)
    assert bf16["float32"] == f32["float32"] == nl * (B // dp) * (N // tp) * S * 4
    # the batch's ids and targets (int64, as numpy gives them; jax's are int32 without x64), the positions
    assert bf16["integer"] == f32["integer"] == 2 * (B // dp) * S * 8 + nl * S * 4
    assert 2 * bf16["float"] == f32["float"] > 0  # everything else halves
