"""nb.flops and nb.estimate on programs as users write them: FLOPs against hand counts and against the FLOP
formula of Narayanan et al. (SC'21, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 5.1: 72·B·s·l·h²·(1 + s/6h) for a GPT layer's forward and backward matmuls, 96 with
activation recomputation), and an estimate's report, trace and memory."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import nabla as nb
from nabla.plan import MATMUL_OPS


def test_flops_count_matmul_einsum_and_conv_by_hand():
    a, b = nb.abstract((8, 16)), nb.abstract((16, 4))
    assert nb.flops(lambda a, b: a @ b, a, b) == 2 * 8 * 16 * 4
    assert nb.flops(lambda a, b: nb.einsum("ij,jk->ik", a, b), a, b) == 2 * 8 * 16 * 4
    x, w = nb.abstract((2, 3, 10, 10)), nb.abstract((5, 3, 3, 3))  # 8 x 8 outputs per (n, o)
    assert nb.flops(lambda x, w: nb.conv(x, w), x, w) == 2 * (2 * 5 * 8 * 8) * (3 * 3 * 3)
    assert nb.flops(lambda x: x.sum(0), a) == 8 * 16  # one per element read
    assert nb.flops(lambda x: x.T.reshape(-1), a) == 0  # moves, no arithmetic


def test_flops_of_a_sharded_run_count_every_device_s_work():
    m = nb.DeviceMesh("m", (2, 2), ("dp", "tp"))
    a, b = nb.abstract((8, 16)), nb.abstract((16, 4))
    # each device multiplies a (4 x 8) block by an (8 x 4) one: the model's FLOPs, split four ways
    assert nb.flops(lambda a, b: a @ b, a.shard(m, ["dp", "tp"]), b.shard(m, ["tp", None])) == 2 * 8 * 16 * 4
    # the rows split over dp only: the two tp replicas of each block compute it twice
    assert nb.flops(lambda a, b: a @ b, a.shard(m, ["dp", None]), b.shard(m, [None, None])) == 2 * (2 * 8 * 16 * 4)


def _gpt_layer(x, p, heads):
    """A GPT layer's matmuls as the paper counts them: QKV, scores, attention over values, output, a 4h MLP."""
    B, s, h = x.shape
    qkv = x @ p["qkv"]
    q, k, v = (qkv[..., i * h:(i + 1) * h].reshape(B, s, heads, h // heads) for i in range(3))
    att = nb.softmax(nb.einsum("bqnd,bknd->bnqk", q, k) * (1.0 / np.sqrt(h // heads)), -1)
    y = nb.einsum("bnqk,bknd->bqnd", att, v).reshape(B, s, h) @ p["out"]
    return nb.relu((x + y) @ p["w1"]) @ p["w2"]


@pytest.mark.parametrize("recompute", [False, True])
def test_a_gpt_layer_s_matmul_flops_are_megatron_s_formula(recompute):
    B, s, h, heads = 2, 32, 64, 4
    p = {"qkv": nb.abstract((h, 3 * h)), "out": nb.abstract((h, h)), "w1": nb.abstract((h, 4 * h)),
         "w2": nb.abstract((4 * h, h))}
    x = nb.abstract((B, s, h))
    layer = nb.checkpoint(_gpt_layer) if recompute else _gpt_layer
    step = nb.grad(lambda p, x: layer(x, p, heads).sum(), argnums=(0, 1))  # x too: a layer inside the model
    with nb.comm_log() as log:
        step(p, x)
    matmul = sum(st.flops for st in log.steps if st.name in MATMUL_OPS)
    # 24Bsh^2 (1 + s/6h) forward; the backward twice that; a recompute once more (Megatron-LM, sec. 5.1)
    passes = 4 if recompute else 3
    assert matmul == passes * 24 * B * s * h * h * (1 + s / (6 * h))
    total = nb.flops(step, p, x)  # everything: softmax, relu, adds (small beside the matmuls)
    assert matmul < total < 1.05 * matmul


def test_estimate_prices_a_tensor_parallel_step_on_a_cluster(tmp_path):
    hw = nb.Hardware.preset("a100-sxm-80gb")
    cluster = nb.Cluster(hw, nodes=2, devices_per_node=4)
    mesh = cluster.mesh("m", (2, 4), ("dp", "tp"))
    B, s, h, heads = 8, 128, 256, 8
    p = {"qkv": nb.abstract((h, 3 * h)).shard(mesh, [None, "tp"]), "out": nb.abstract((h, h)).shard(mesh, ["tp", None]),
         "w1": nb.abstract((h, 4 * h)).shard(mesh, [None, "tp"]), "w2": nb.abstract((4 * h, h)).shard(mesh, ["tp", None])}
    x = nb.abstract((B, s, h)).shard(mesh, ["dp", None, None])

    def step(p, x):
        with nb.named_scope("layer0"):
            return _gpt_layer(x, p, heads).sum()

    report = nb.estimate(nb.grad(step), cluster)(p, x)
    assert report.step_time > 0 and report.compute_time > 0 and report.comm_time > 0
    assert report.exposed_comm <= report.comm_time + 1e-12
    assert 0 < report.mfu < 1 and report.tflops_per_device > 0
    assert report.memory.fits and set(report.memory.peak) == set(range(8))
    text = str(report)
    assert "layer0" in text and "step" in text
    path = tmp_path / "trace.json"
    report.to_chrome_trace(str(path))
    events = json.load(open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    pids = {e["pid"] for e in events if e.get("ph") == "X"}
    assert pids == {0}  # one track: the eight devices run the same timeline
    assert [e["args"] for e in events if e["name"] == "process_name"] == [
        {"name": "devices 0-7", "devices": "0-7", "count": 8}]
    end = max(e["ts"] + e["dur"] for e in events if e.get("ph") == "X")
    assert end == pytest.approx(report.step_time * 1e6, rel=1e-6)


def test_estimate_refuses_what_it_cannot_price():
    hw = nb.Hardware.preset("h100-sxm-80gb")
    with pytest.raises(nb.ShardingError, match="overlap must be"):
        nb.estimate(lambda x: x, nb.Cluster(hw, 1, 8), overlap="some")
    with pytest.raises(nb.ShardingError, match="cluster must be"):
        nb.estimate(lambda x: x, hw)
    with pytest.raises(nb.ShardingError, match="fusion must be True or False"):
        nb.estimate(lambda x: x, nb.Cluster(hw, 1, 8), fusion="yes")


def test_estimate_fuses_a_layer_norm_into_a_few_kernels_and_fusion_false_prices_every_step():
    hw = nb.Hardware.preset("a100-sxm-80gb")
    cluster = nb.Cluster(hw, 1, 1)
    mesh = cluster.mesh("m", (1,), ("dp",))
    x = nb.abstract((4096, 1024)).shard(mesh, ["dp", None])
    g, b = nb.abstract((1024,)).shard(mesh, [None]), nb.abstract((1024,)).shard(mesh, [None])

    def norm(x, g, b):  # a layer norm as a user writes it, op by op (nb.layer_norm is one fused op)
        c = x - x.mean(-1, keepdims=True)
        return c / nb.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * g + b

    one = nb.estimate(lambda x, g, b: nb.layer_norm(x, g, b), cluster)(x, g, b)
    assert len(one.timeline.costs) == 1  # nb.layer_norm: one kernel
    fused = nb.estimate(norm, cluster)(x, g, b)
    alone = nb.estimate(norm, cluster, fusion=False)(x, g, b)
    costs = fused.timeline.costs
    assert len(costs) == len(alone.timeline.costs) > 5  # the same steps, each still in the report
    kernels = {c.kernel_of for c in costs}
    assert 1 < len(kernels) < len(costs)  # fewer kernels than steps; a reduction ends each but the last
    assert [c.kernel_of for c in alone.timeline.costs] == list(range(len(costs)))
    # the fused step reads x (16 MiB) twice and makes a few passes, far under a round trip per step
    assert fused.compute_time < 0.5 * alone.compute_time
    assert fused.compute_time == pytest.approx(sum(c.kernel for c in costs))
    assert fused.fusion and not alone.fusion and "fusion=False" in str(alone)


def test_a_chrome_trace_of_16384_devices_is_one_track_and_small(tmp_path):
    """A Llama-style 2-layer training step (examples/train_llama.py's model, bf16, Megatron's layout) on 2,048
    nodes of 8 H100s: every device runs the same timeline, so the trace holds it once, named by the devices that
    share it (it was one copy per device: 2.7 GB for a 2-layer 70B step on 16,384 devices)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import train_llama as L

    cfg = dict(L.CONFIG, batch=2048)
    cluster = nb.Cluster(nb.Hardware.preset("h100-sxm-80gb"), nodes=2048, devices_per_node=8)
    mesh = cluster.mesh("m", (2048, 8), ("dp", "tp"))
    layout = L.Layout("dp_tp")
    params = L.init(cfg)
    placed = L._tree_map2(lambda a, s: nb.abstract(a.shape, "bfloat16").shard(mesh, s), params,
                          layout.param_specs(params))
    ids = nb.abstract((cfg["batch"], cfg["seq"]), "int64").shard(mesh, ["dp", None])
    report = nb.estimate(nb.value_and_grad(lambda p, x, y: L.loss_fn(p, x, y, cfg)), cluster)(placed, ids, ids)
    path = tmp_path / "trace.json"
    report.to_chrome_trace(str(path))
    assert path.stat().st_size < 10 * 2**20
    events = json.load(open(path))["traceEvents"]
    assert [e["args"] for e in events if e["name"] == "process_name"] == [
        {"name": "devices 0-16383", "devices": "0-16383", "count": 16384}]
    assert len([e for e in events if e["ph"] == "X"]) == len(report.timeline.intervals)
    own = report.to_chrome_trace(devices=[0, 16383])["traceEvents"]
    assert [e["args"]["name"] for e in own if e["name"] == "process_name"] == ["device 0", "device 16383"]


def test_overlap_modes_on_programs_as_users_write_them():
    """FSDP's gathers hidden by "params" and Megatron's sequence-parallel all_gather / reduce_scatter pipelined
    with their GEMMs by "tp", on programs written with nabla ops (the hand-computed schedules are
    test_plan_schedule.py's); neither mode ever makes a step slower."""
    cluster = nb.Cluster(nb.Hardware.preset("h100-sxm-80gb"), nodes=1, devices_per_node=8)
    mesh = cluster.mesh("m", (8,), ("d",))
    h = 1024
    ws = [nb.abstract((h, h), "bfloat16").shard(mesh, ["d", None]) for _ in range(4)]  # FSDP: rows over d
    x = nb.abstract((64, 1024, h), "bfloat16").shard(mesh, ["d", None, None])

    def fsdp(ws, x):
        for i, w in enumerate(ws):
            with nb.named_scope(f"layer {i}"):
                x = nb.relu(x @ w)
        return x.astype("float32").sum()

    step = nb.value_and_grad(fsdp)
    grads, params = (nb.estimate(step, cluster, overlap=o)(ws, x) for o in ("grads", ("grads", "params")))
    # layers 1-3's gathers run under the layer before; the first layer's and the last gradient sum stay exposed
    assert params.step_time < grads.step_time and params.exposed_comm < 0.7 * grads.exposed_comm
    assert params.compute_time == grads.compute_time and params.overlaps == {"grads", "params"}

    tp = cluster.mesh("t", (8,), ("tp",))
    h = 4096  # GEMMs longer than the collectives beside them, as in a real layer
    w1 = nb.abstract((h, 4 * h), "bfloat16").shard(tp, [None, "tp"])
    w2 = nb.abstract((4 * h, h), "bfloat16").shard(tp, ["tp", None])
    xs = nb.abstract((8, 2048, h), "bfloat16").shard(tp, [None, "tp", None])  # sequence parallel

    def mlp(w1, w2, x):
        y = x.with_sharding(tp, [None, None, None])  # all_gather the sequence
        out = (nb.relu(y @ w1) @ w2).with_sharding(tp, [None, "tp", None])  # reduce_scatter it
        return (x + out).astype("float32").sum()

    f = nb.value_and_grad(mlp, argnums=(0, 1))
    none, over = (nb.estimate(f, cluster, overlap=o)(w1, w2, xs) for o in ("none", "all"))
    # forward: the gathered input arrives before anything can run; the reduce_scatter is pipelined with its GEMM;
    # backward: the gather of the output gradient is a ring exchange with the GEMM that reads it
    assert over.step_time < none.step_time and over.exposed_comm < 0.7 * none.exposed_comm
    assert over.compute_time == none.compute_time  # the same kernels: only the schedule differs
