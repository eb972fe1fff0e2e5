"""nabla.plan.pipeline: the bubble of 1F1B, (p-1)/m, and of the interleaved schedule, (p-1)/(v m)
(Narayanan et al. SC'21), and the stage-to-stage sends, on a toy stage with round numbers."""

from __future__ import annotations

import pytest

from nabla.collectives import CommEvent
from nabla.errors import ShardingError
from nabla.plan import Cluster, Hardware, PricedStep, estimate_steps, pipeline_estimate

TOY = Hardware("toy", peak_flops={"float32": 1e12}, vector_flops=1e12, hbm_bytes=10**9, hbm_bandwidth=1e9,
               nvlink_bandwidth=1e9, network_bandwidth=1e8, nvlink_latency=1e-6, network_latency=1e-5)
CL = Cluster(TOY, nodes=1, devices_per_node=2)
MESH = CL.mesh("m", (2,), ("dp",))
# one microbatch on one stage: 3 ms of matmul, then a 1 ms gradient all_reduce (1e6 bytes over NVLink + 1 step)
STAGE = (PricedStep("matmul", "f", "forward", "float32", flops=10**9),
         PricedStep("matmul", "g", "backward", "float32", flops=2 * 10**9),
         PricedStep("with_sharding", "grad of p['w']", "backward", events=(CommEvent("all_reduce", ("dp",), 10**6, 2),)))


def test_1f1b_bubble():
    r = estimate_steps(STAGE, CL, MESH, overlap="none")
    assert r.step_time == pytest.approx(3e-3 + 2 * 1e-6 + 1e-3)  # all_reduce over 2: 2 ring steps
    p = pipeline_estimate(r, stages=4, microbatches=8)
    assert p.bubble_fraction == pytest.approx(3 / 8)  # (p - 1) / m
    assert p.microbatch_time == pytest.approx(3e-3)  # the gradient reduction is paid once, not per microbatch
    assert p.bubble_time == pytest.approx(3 * 3e-3)
    assert p.step_time == pytest.approx(8 * 3e-3 + 3 * 3e-3 + (2e-6 + 1e-3))
    assert p.tflops_per_device == pytest.approx(8 * 3e9 / p.step_time / 1e12)
    assert p.mfu == pytest.approx(p.tflops_per_device)  # peak 1 TFLOP/s, model FLOPs = FLOPs


def test_interleaved_bubble_and_sends():
    r = estimate_steps(STAGE[:2], CL, MESH)
    # 4 stages of 2 devices span 8 > 2 devices per node: sends on the network, 1e-5 + 1e5 / 1e8 = 1.01 ms
    p = pipeline_estimate(r, stages=4, microbatches=8, schedule="interleaved", virtual_stages=2, p2p_bytes=10**5,
                          cluster=Cluster(TOY, nodes=4, devices_per_node=2))
    assert p.bubble_fraction == pytest.approx(3 / (2 * 8))  # (p - 1) / (v m)
    assert p.bubble_time == pytest.approx(3 * 3e-3 / 2)
    assert p.send_time == pytest.approx(1e-5 + 1e5 / 1e8)
    assert p.p2p_time == pytest.approx(2 * (2 * 8 + 3) * 1.01e-3)  # a send each way per chunk step
    assert p.step_time == pytest.approx(8 * 3e-3 + 4.5e-3 + 38.38e-3)
    # on one node (stages x 2 devices <= 8), the same sends run on NVLink: 1e-6 + 1e5 / 1e9
    q = pipeline_estimate(r, stages=4, microbatches=8, p2p_bytes=10**5, cluster=Cluster(TOY, 1, 8))
    assert q.send_time == pytest.approx(1.01e-4)
    assert "bubble" in str(q)


def test_bad_inputs():
    r = estimate_steps(STAGE, CL, MESH)
    with pytest.raises(ShardingError, match="schedule must be one of"):
        pipeline_estimate(r, 4, 8, schedule="gpipe")
    with pytest.raises(ShardingError, match="virtual_stages=2; use schedule='interleaved'"):
        pipeline_estimate(r, 4, 8, virtual_stages=2)
    with pytest.raises(ShardingError, match=r"microbatches \(6\) to be a multiple of stages \(4\)"):
        pipeline_estimate(r, 4, 6, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ShardingError, match="stages must be an int >= 1, got 0"):
        pipeline_estimate(r, 0, 8)
    with pytest.raises(ShardingError, match="stage_report must be a Report"):
        pipeline_estimate(1.0, 4, 8)


# ---- memory of a pipelined job ----------------------------------------------------------------------------------

import nabla as nb  # noqa: E402
from nabla.plan.pipeline import in_flight  # noqa: E402


@pytest.mark.parametrize("p, v, m", [(2, 1, 8), (4, 1, 8), (4, 1, 2), (4, 2, 8), (8, 3, 16), (8, 4, 8)])
def test_microbatches_in_flight_as_megatron_and_korthikanti_count_them(p, v, m):
    """1F1B holds min(p, m) microbatches on its first stage; the interleaved schedule p (1 + (p - 1) / (p v))
    (Korthikanti et al., MLSys'23, sec. 4.2.3), as Megatron-LM's warm-up count 2 (p - 1) + (v - 1) p gives it."""
    if v == 1:
        assert in_flight(p, m, "1f1b") == min(p, m)
    got = in_flight(p, m, "interleaved", v)
    assert got == pytest.approx(min(p * (1 + (p - 1) / (p * v)), m))


def test_pipeline_memory_adds_the_microbatches_in_flight_to_the_stage():
    cluster = Cluster(Hardware.preset("a100-sxm-80gb"), nodes=1, devices_per_node=8)
    mesh = cluster.mesh("m", (8,), ("dp",))
    w = [nb.abstract((1024, 1024), "bfloat16").shard(mesh, [None, None]) for _ in range(4)]
    x = nb.abstract((64, 1024), "bfloat16").shard(mesh, ["dp", None])

    def stage(ws, x):
        for w in ws:
            x = nb.gelu(x @ w)
        return x.astype("float32").sum()

    report = nb.estimate(nb.grad(stage), cluster)(w, x)
    one = report.memory
    kept = max(one.kept.values())
    assert kept > 0
    pipe = pipeline_estimate(report, stages=4, microbatches=8)
    mem = pipe.memory
    assert mem.in_flight == 4
    assert max(mem.peak.values()) == max(one.peak.values()) + 3 * kept
    assert max(mem.by_kind["params"].values()) == max(one.by_kind["params"].values())
    assert max(mem.by_kind["activations"].values()) == max(one.by_kind["activations"].values()) + 3 * kept
    assert mem.fits
    tight = Cluster(Hardware.preset("a100-sxm-80gb").replace(hbm_bytes=max(one.peak.values()) + kept), 1, 8)
    tight_report = nb.estimate(nb.grad(stage), tight)(w, x)
    assert tight_report.memory.fits and not pipeline_estimate(tight_report, stages=4, microbatches=8).memory.fits
    assert "in flight" in str(pipe)


def test_overlapped_sends_wait_only_through_the_fill_and_drain():
    job = Cluster(TOY, nodes=4, devices_per_node=2)  # 4 stages of 2 devices: sends on the network
    send = 1e-5 + 1e5 / 1e8  # 1.01 ms
    blocking = pipeline_estimate(estimate_steps(STAGE[:2], CL, MESH, overlap="grads"), 4, 8, p2p_bytes=10**5,
                                 cluster=job)
    assert blocking.p2p_time == pytest.approx(2 * (8 + 3) * send)
    overlapped = pipeline_estimate(estimate_steps(STAGE[:2], CL, MESH, overlap=("grads", "p2p")), 4, 8,
                                   p2p_bytes=10**5, cluster=job)
    # a chunk step's two sends (2.02 ms) hide behind its 3 ms of compute; the fill and the drain wait for 3 each
    assert overlapped.p2p_time == pytest.approx(2 * 3 * send)
    assert overlapped.step_time == pytest.approx(8 * 3e-3 + 3 * 3e-3 + 6 * send)
    # sends longer than the compute show their excess; an H100-like 24 of 96 SMs taken slow the compute beside them
    long = pipeline_estimate(estimate_steps(STAGE[:2], CL, MESH, overlap="all"), 4, 8, p2p_bytes=2 * 10**5,
                             cluster=Cluster(TOY.replace(sms=96), nodes=4, devices_per_node=2))
    two = 2 * (1e-5 + 2e5 / 1e8)  # 4.02 ms per chunk step, against 3 ms of compute
    assert long.p2p_time == pytest.approx(2 * 3 * two / 2 + 11 * ((two - 3e-3) + 0.25 * 3e-3))
