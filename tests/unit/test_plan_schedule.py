"""nabla.plan.schedule and report: the two-stream timeline, its report, table, Chrome trace and plot, on a toy
device with round numbers (1 TFLOP/s, 1 GB/s HBM and NVLink, 0.1 GB/s network, no latency) so every time
below is worked out by hand in milliseconds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nabla.collectives import CommEvent
from nabla.errors import ShardingError
from nabla.mesh import DeviceMesh
from nabla.plan import Cluster, Hardware, PricedStep, estimate_steps, simulate

TOY = Hardware("toy", peak_flops={"float32": 1e12}, vector_flops=1e12, hbm_bytes=10**9, hbm_bandwidth=1e9,
               nvlink_bandwidth=1e9, network_bandwidth=1e8, nvlink_latency=0.0, network_latency=0.0)
CL = Cluster(TOY, nodes=2, devices_per_node=2)
MESH = CL.mesh("m", (2, 2), ("dp", "tp"))  # tp inside a node, dp across the two


def mm(ms, phase="forward", layer=None):
    return PricedStep("matmul", "matmul", phase, "float32", flops=int(ms * 1e9), layer=layer)


def ar(axis, ms):  # an all_reduce taking `ms` milliseconds: 1e6 bytes per ms on tp, 1e5 on dp
    return CommEvent("all_reduce", (axis,), int(ms * (1e6 if axis == "tp" else 1e5)), 2)


PROGRAM = (
    mm(1, layer="L0"),                                                          # 1 ms
    PricedStep("add", "add", "forward", "float32", events=(ar("tp", 1),), layer="L0"),  # 1 ms, blocks
    mm(2, "backward", "L1"),                                                    # 2 ms
    PricedStep("with_sharding", "grad of p['w1']", "backward", events=(ar("dp", 3),), layer="L1"),  # 3 ms
    mm(2, "backward", "L0"),                                                    # 2 ms
    PricedStep("with_sharding", "grad of p['w0']", "backward", events=(ar("dp", 1),), layer="L0"),  # 1 ms
)


def test_no_overlap_adds_everything_up():
    t = simulate(PROGRAM, CL, MESH, "none")
    assert t.step_time == pytest.approx(1e-3 * (1 + 1 + 2 + 3 + 2 + 1))
    assert t.compute_time == pytest.approx(5e-3) and t.comm_time == pytest.approx(5e-3)
    assert t.exposed_comm == pytest.approx(5e-3)


def test_gradient_reductions_hide_behind_the_backward_compute():
    t = simulate(PROGRAM, CL, MESH, "grads")
    # compute: 0-1 matmul | 1-2 tp all_reduce blocks | 2-4 matmul | grad w1 on the comm stream 4-7 |
    # 4-6 matmul | grad w0 waits for the comm stream: 7-8 | the step ends when the comm stream does: 8 ms
    comm = [(round(i.start * 1e3, 9), round(i.end * 1e3, 9)) for i in t.intervals if i.stream == "comm"]
    assert comm == [(1, 2), (4, 7), (7, 8)]
    assert t.step_time == pytest.approx(8e-3) and t.exposed_comm == pytest.approx(3e-3)
    # per step, what each held the compute stream back; the comm tail (8 - 6) goes to grad of w0
    assert [round(c.exposed * 1e3, 9) for c in t.costs] == [0, 1, 0, 0, 0, 2]


def test_report_numbers():
    r = estimate_steps(PROGRAM, CL, MESH, overlap="grads", model_flops=4e9)
    assert r.step_time == pytest.approx(8e-3)
    assert r.flops == 5 * 10**9
    assert r.tflops_per_device == pytest.approx(5e9 / 8e-3 / 1e12)  # 0.625
    assert r.mfu == pytest.approx(4e9 / 8e-3 / 1e12)  # 0.5 of the float32 peak
    # gradients add 8 - 6 ms over the same program without them (1 + 1 + 2 + 2)
    assert r.exposed_grad_comm == pytest.approx(2e-3)
    assert estimate_steps(PROGRAM, CL, MESH, overlap="none").exposed_grad_comm == pytest.approx(4e-3)
    assert r.layers() == [("L0", pytest.approx(3e-3), pytest.approx(2e-3), pytest.approx(3e-3), 3 * 10**9),
                          ("L1", pytest.approx(2e-3), pytest.approx(3e-3), 0.0, 2 * 10**9)]
    assert r.device_timeline(3) is r.timeline and r.devices == (0, 1, 2, 3)


def test_printed_table_has_layers_and_totals():
    text = str(estimate_steps(PROGRAM, CL, MESH))
    assert "L0" in text and "L1" in text and "total" in text and "step 8.000 ms" in text
    assert "memory: not recorded" in text


def test_memory_record():
    ok = SimpleNamespace(peak={d: 5 * 10**8 for d in range(4)}, by_kind={"params": {d: 10**8 for d in range(4)}})
    r = estimate_steps(PROGRAM, CL, MESH, memory=ok)
    assert r.memory.fits is True and r.memory.peak[2] == 5 * 10**8 and r.memory.by_kind["params"][0] == 10**8
    big = SimpleNamespace(peak={0: 10**9 + 1}, by_kind={})
    assert estimate_steps(PROGRAM, CL, MESH, memory=big).memory.fits is False
    assert estimate_steps(PROGRAM, CL, MESH).memory.fits is None
    with pytest.raises(ShardingError, match="memory must have .peak"):
        estimate_steps(PROGRAM, CL, MESH, memory=object())


def test_chrome_trace(tmp_path):
    r = estimate_steps(PROGRAM, CL, MESH)
    path = tmp_path / "trace.json"
    r.to_chrome_trace(str(path))
    trace = json.load(open(path))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0}  # the four devices run one timeline: one track
    assert {(e["pid"], e["tid"]) for e in spans} == {(0, 0), (0, 1)}
    assert len(spans) == len(r.timeline.intervals)
    assert min(e["ts"] for e in spans) == 0
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(8000)  # step_time in microseconds
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"devices 0-3", "compute", "comm"} <= names
    own = r.to_chrome_trace(devices=[1, 3])["traceEvents"]  # those devices' own tracks
    assert {e["pid"] for e in own if e["ph"] == "X"} == {1, 3}
    assert {e["args"]["name"] for e in own if e["name"] == "process_name"} == {"device 1", "device 3"}
    assert len([e for e in own if e["ph"] == "X"]) == 2 * len(spans)
    with pytest.raises(ShardingError):
        r.to_chrome_trace(devices=[4])


def test_plot(tmp_path):
    import matplotlib  # (in the test extra: a plot that cannot be drawn fails here, it is not skipped)

    matplotlib.use("Agg")
    mem = SimpleNamespace(peak={0: 9}, by_kind={}, timeline=[1, 2, 3, 4, 5, 6])
    fig = estimate_steps(PROGRAM, CL, MESH, memory=mem).plot(str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0 and len(fig.axes) == 2


def test_bad_inputs():
    with pytest.raises(ShardingError, match="overlap must be 'none', 'grads', 'all' or a tuple"):
        simulate(PROGRAM, CL, MESH, "everything")
    with pytest.raises(ShardingError, match="overlap must be"):
        simulate(PROGRAM, CL, MESH, ("grads", "pipeline"))
    with pytest.raises(ShardingError, match="device 7 but the cluster has devices 0..3"):
        estimate_steps(PROGRAM, CL, DeviceMesh("m", (8,), ("dp",)))
    with pytest.raises(ShardingError, match="model_flops"):
        estimate_steps(PROGRAM, CL, MESH, model_flops=-1)


KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
events = st.builds(lambda k, a, b: CommEvent(k, a, b, 2), st.sampled_from(KINDS),
                   st.sampled_from([("dp",), ("tp",), ("dp", "tp")]), st.integers(0, 10**6))
steps = st.builds(lambda op, phase, grad, flops, ev, layer: PricedStep(
    op, "grad of p['w']" if grad else op, phase, "float32", flops, 0, 0, tuple(ev), layer),
    st.sampled_from(["matmul", "add"]), st.sampled_from(["forward", "backward"]), st.booleans(),
    st.integers(0, 10**9), st.lists(events, max_size=3), st.sampled_from([None, "a", "b"]))


@given(st.lists(steps, max_size=12))
def test_overlapping_gradients_is_never_slower(program):
    none, grads = simulate(program, CL, MESH, "none"), simulate(program, CL, MESH, "grads")
    assert grads.step_time <= none.step_time * (1 + 1e-12) + 1e-18
    assert none.step_time == pytest.approx(none.compute_time + none.comm_time)
    for t in (none, grads):
        assert sum(c.exposed for c in t.costs) == pytest.approx(t.exposed_comm, abs=1e-15)
        assert all(i.end <= t.step_time * (1 + 1e-12) for i in t.intervals)


# ---- overlap modes, each against a schedule worked out by hand (TOY: 1 ms per 1e9 FLOPs, 1 ms per 1e6 bytes of a
# collective over tp; ``sms`` 0, so overlapped collectives take no compute unless a test gives SMs) ------------------


def ag(ms, axis="tp"):  # an all_gather over 2 taking `ms` milliseconds on NVLink
    return CommEvent("all_gather", (axis,), int(ms * 1e6), 2)


def st(op, ms=0.0, phase="forward", layer=None, events=(), moves=(), reads=(), out=0, user=None):
    return PricedStep(op, user or op, phase, "float32", flops=int(ms * 1e9), layer=layer, events=tuple(events),
                moves=tuple(moves), reads=tuple((v, 0) for v in reads), out=out)


def comm_spans(t):
    return [(round(i.start * 1e3, 6), round(i.end * 1e3, 6)) for i in t.intervals if i.stream == "comm"]


FSDP = (  # three layers, each gathering its weight (an argument, values 1-3) before its 2 ms matmul
    st("matmul", 2, layer="L0", events=[ag(1)], moves=[1], reads=[1, 100], out=10),
    st("matmul", 2, layer="L1", events=[ag(1)], moves=[2], reads=[2, 10], out=11),
    st("matmul", 2, layer="L2", events=[ag(3)], moves=[3], reads=[3, 11], out=12),
)


def test_params_prefetches_fsdp_gathers_one_layer_ahead():
    assert simulate(FSDP, CL, MESH, "none").step_time == pytest.approx(11e-3)  # 1 + 2 + 1 + 2 + 3 + 2
    t = simulate(FSDP, CL, MESH, ("params",))
    # L1's gather may start once L0 starts (t = 0), behind L0's on the comm stream: 1-2, hidden by L0's matmul
    # (1-3); L2's once L1 starts (3): 3-6, so L2's matmul waits until 6: 6-8
    assert comm_spans(t) == [(0, 1), (1, 2), (3, 6)]
    assert t.step_time == pytest.approx(8e-3) and t.exposed_comm == pytest.approx(2e-3)
    assert simulate(FSDP, CL, MESH, "grads").step_time == pytest.approx(11e-3)  # gathers are not gradients


def test_an_overlapped_collective_slows_the_compute_beside_it_by_the_sms_it_takes():
    hw = TOY.replace(sms=96)  # NCCL's 24 SMs of 96: the compute runs at 3/4 of its speed beside a collective
    cl = Cluster(hw, nodes=2, devices_per_node=2)
    prog = (st("matmul", 2, "backward", out=20),
            st("with_sharding", 0, "backward", events=[ar("tp", 2)], moves=[20], reads=[20], out=21,
               user="grad of p['w']"),
            st("matmul", 4, "backward", reads=[30], out=22))
    # the gradient's all_reduce runs 2-4 beside the second matmul: 2 ms at 3/4 speed do 1.5 ms of its 4, the
    # remaining 2.5 ms run alone: it ends at 6.5 (6 without the SMs)
    assert simulate(prog, cl, MESH, "grads").step_time == pytest.approx(6.5e-3)
    assert simulate(prog, CL, MESH, "grads").step_time == pytest.approx(6e-3)
    assert simulate(prog, cl, MESH, "none").step_time == pytest.approx(8e-3)  # blocking: no compute beside it


def test_tp_pipelines_a_gather_with_the_matmul_that_reads_it():
    prog = (st("layer_norm", 0, reads=[4], out=5),  # an activation (made by a step), so not a parameter
            st("matmul", 4, events=[ag(2)], moves=[5], reads=[5, 6], out=7))
    assert simulate(prog, CL, MESH, "none").step_time == pytest.approx(6e-3)
    # ring exchange in 2 chunks (the group): 1 ms transfer, then max(1, 2) while chunk 1 multiplies, then chunk 2
    t = simulate(prog, CL, MESH, "tp")
    assert t.step_time == pytest.approx(5e-3)
    cl = Cluster(TOY.replace(sms=132), nodes=2, devices_per_node=2)  # the ring exchange's 1 SM of 132
    assert simulate(prog, cl, MESH, "tp").step_time == pytest.approx((1 + (2 + 1 / 131) + 2) * 1e-3)


def test_tp_pipelines_a_sum_with_the_matmul_that_made_it():
    prog = (st("matmul", 4, reads=[1, 2], out=30),
            st("add", 0, reads=[30, 3], out=31),  # a residual add between (elementwise: fused away)
            st("multiply", 0, events=[ar("tp", 2)], moves=[31], reads=[31, 31], out=32))
    assert simulate(prog, CL, MESH, "none").step_time == pytest.approx(6e-3)
    # TE's pipelined reduce-scatter: 4 chunks; 1 ms of GEMM, 3 rounds of max(0.5, 1), 0.5 ms of the last transfer
    assert simulate(prog, CL, MESH, "tp").step_time == pytest.approx(4.5e-3)


def test_tp_bulk_overlap_starts_when_its_data_is_ready():
    prog = (st("matmul", 3, "backward", reads=[1, 2], out=40),   # dgrad: the value to sum
            st("matmul", 3, "backward", reads=[3, 4], out=41),   # wgrad, independent of it
            st("add", 0, "backward", events=[ar("tp", 2)], moves=[40], reads=[40, 5], out=42))
    assert simulate(prog, CL, MESH, "none").step_time == pytest.approx(8e-3)
    t = simulate(prog, CL, MESH, "tp")  # the sum runs 3-5 beside the wgrad matmul (3-6)
    assert comm_spans(t) == [(3, 5)] and t.step_time == pytest.approx(6e-3)


def test_params_runs_the_optimizer_s_gathers_under_the_next_forward():
    prog = (st("matmul", 2, reads=[1, 2], out=3),
            st("matmul", 2, "backward", reads=[3, 1], out=4),
            st("astype", 0, reads=[4], out=5),  # the update (after the backward pass) makes the new parameter
            st("with_sharding", 0, events=[ag(1)], moves=[5], reads=[5], out=6))
    assert simulate(prog, CL, MESH, "none").step_time == pytest.approx(5e-3)
    t = simulate(prog, CL, MESH, ("params",))
    assert comm_spans(t) == [(0, 1)] and t.step_time == pytest.approx(4e-3)
    assert simulate(prog, CL, MESH, "all").step_time == pytest.approx(4e-3)


def test_overlap_spellings():
    from nabla.plan.schedule import overlap_modes
    assert overlap_modes("none") == frozenset() and overlap_modes("grads") == {"grads"}
    assert overlap_modes("all") == {"grads", "params", "tp", "p2p"} == overlap_modes(("tp", "all"))
    assert overlap_modes(("grads", "tp")) == {"grads", "tp"} and overlap_modes(["params"]) == {"params"}
    for bad in ((), ("grads", "bad"), 3, ("none",)):
        with pytest.raises(ShardingError, match="overlap must be"):
            overlap_modes(bad)
    r = estimate_steps(PROGRAM, CL, MESH, overlap=("grads", "tp"))
    assert r.overlaps == {"grads", "tp"} and r.step_time == pytest.approx(8e-3)  # PROGRAM's tp sum has no matmul pair


def test_a_gradient_summed_before_a_cast_is_still_a_gradient_sum():
    # a weight used in float8 (w.astype): its gradient arrives as partial sums that the cast back must sum first,
    # in a step run for "gradient of astype"; what it feeds is the parameter's gradient, so "grads" overlaps it
    prog = (st("matmul", 2, "backward", reads=[1, 2], out=50),
            st("astype", 0, "backward", events=[ar("dp", 2)], moves=[50], reads=[50], out=51,
               user="gradient of astype"),
            st("with_sharding", 0, "backward", reads=[51], out=52, user="grad of p['w']"),
            st("matmul", 3, "backward", reads=[3, 4], out=53))
    assert simulate(prog, CL, MESH, "none").step_time == pytest.approx(7e-3)
    t = simulate(prog, CL, MESH, "grads")
    assert comm_spans(t) == [(2, 4)] and t.step_time == pytest.approx(5e-3)
    r = estimate_steps(prog, CL, MESH, overlap="grads")
    assert r.exposed_grad_comm == pytest.approx(0.0)
