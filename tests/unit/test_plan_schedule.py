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
from nabla.plan import Cluster, Hardware, Step, estimate_steps, simulate

TOY = Hardware("toy", peak_flops={"float32": 1e12}, vector_flops=1e12, hbm_bytes=10**9, hbm_bandwidth=1e9,
               nvlink_bandwidth=1e9, network_bandwidth=1e8, nvlink_latency=0.0, network_latency=0.0)
CL = Cluster(TOY, nodes=2, devices_per_node=2)
MESH = CL.mesh("m", (2, 2), ("dp", "tp"))  # tp inside a node, dp across the two


def mm(ms, phase="forward", layer=None):
    return Step("matmul", "matmul", phase, "float32", flops=int(ms * 1e9), layer=layer)


def ar(axis, ms):  # an all_reduce taking `ms` milliseconds: 1e6 bytes per ms on tp, 1e5 on dp
    return CommEvent("all_reduce", (axis,), int(ms * (1e6 if axis == "tp" else 1e5)), 2)


PROGRAM = (
    mm(1, layer="L0"),                                                          # 1 ms
    Step("add", "add", "forward", "float32", events=(ar("tp", 1),), layer="L0"),  # 1 ms, blocks
    mm(2, "backward", "L1"),                                                    # 2 ms
    Step("with_sharding", "grad of p['w1']", "backward", events=(ar("dp", 3),), layer="L1"),  # 3 ms
    mm(2, "backward", "L0"),                                                    # 2 ms
    Step("with_sharding", "grad of p['w0']", "backward", events=(ar("dp", 1),), layer="L0"),  # 1 ms
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
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    mem = SimpleNamespace(peak={0: 9}, by_kind={}, timeline=[1, 2, 3, 4, 5, 6])
    fig = estimate_steps(PROGRAM, CL, MESH, memory=mem).plot(str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0 and len(fig.axes) == 2


def test_bad_inputs():
    with pytest.raises(ShardingError, match="overlap must be one of"):
        simulate(PROGRAM, CL, MESH, "all")
    with pytest.raises(ShardingError, match="device 7 but the cluster has devices 0..3"):
        estimate_steps(PROGRAM, CL, DeviceMesh("m", (8,), ("dp",)))
    with pytest.raises(ShardingError, match="model_flops"):
        estimate_steps(PROGRAM, CL, MESH, model_flops=-1)


KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
events = st.builds(lambda k, a, b: CommEvent(k, a, b, 2), st.sampled_from(KINDS),
                   st.sampled_from([("dp",), ("tp",), ("dp", "tp")]), st.integers(0, 10**6))
steps = st.builds(lambda op, phase, grad, flops, ev, layer: Step(
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
