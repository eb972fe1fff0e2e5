"""benchmarks/megatron_table1.py: Table 1's rows as recorded, and the analytic predict() (per-layer costs through the
schedule and the pipeline) on synthetic numbers worked out by hand (a toy device: 1 TFLOP/s, 1 GB/s HBM and
NVLink, 0.1 GB/s network, no latency)."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

from nabla.plan import Cluster, Hardware, gpt_flops

ROOT = Path(__file__).resolve().parents[2]
TOY = Hardware("toy", peak_flops={"bfloat16": 1e12}, vector_flops=1e12, hbm_bytes=10**9, hbm_bandwidth=1e9,
               nvlink_bandwidth=1e9, network_bandwidth=1e8, nvlink_latency=0.0, network_latency=0.0)


@pytest.fixture(scope="module")
def table():
    return SimpleNamespace(**runpy.run_path(str(ROOT / "benchmarks" / "megatron_table1.py")))


def test_rows_are_consistent_with_the_paper(table):
    assert len(table.ROWS) == 10 and table.ROWS[0].params_billion == 1.7 and table.ROWS[-1].params_billion == 1008.0
    for r in table.ROWS:
        assert r.gpus % (r.tensor_parallel * r.pipeline_parallel) == 0
        assert round(100 * r.tflops_per_gpu / 312) == r.peak_percent  # percent of 312 TFLOP/s, as printed
    # the 1T row's aggregate, 502 PFLOP/s in the paper's last column, is 3072 GPUs x 163 TFLOP/s
    last = table.ROWS[-1]
    assert last.gpus * last.tflops_per_gpu / 1e3 == pytest.approx(502, rel=5e-3)  # 500.7: X is rounded
    # and its iteration takes F / (n X): 96 x 3072 x 2048 x 128 x 25600^2 x (1 + 2048/153600 + 51200/52428800)
    # = 5.139e19 FLOPs over 3072 x 163e12 FLOP/s = 102.6 s
    assert gpt_flops(3072, 2048, 128, 25600, 51200) / (3072 * 163e12) == pytest.approx(102.6, rel=1e-3)


def test_predict_two_layers_tensor_parallel(table):
    # per layer: 1 ms of matmul, a tp all_reduce of 1e6 bytes (1 ms, blocks) and 1e6 bytes of memory-bound
    # kernel (1 ms) forward; 2 ms of matmul backward. Two layers: 2 x 3 + 2 x 2 = 10 ms per microbatch
    cost = table.LayerCost(10**9, 2 * 10**9, 10**6, 0, 10**6, 0, 0)
    p = table.predict(cost, layers=2, stage_cluster=Cluster(TOY, 1, 2), dp=1, tp=2, stages=2, microbatches=4)
    assert p.microbatch_time == pytest.approx(10e-3)
    assert p.step_time == pytest.approx(4 * 10e-3 + (2 - 1) * 10e-3)  # m t + (p - 1) t = 50 ms
    assert p.tflops_per_device == pytest.approx(4 * 6e9 / 50e-3 / 1e12)  # 0.48


def test_predict_overlaps_data_parallel_gradients(table):
    # dp = 2 over two one-GPU nodes: each layer's gradient all_reduce of 1e5 bytes takes 1 ms on the network.
    # forward 0-2 | backward L1 2-4, its gradients 4-5 behind backward L0 4-6 | gradients of L0 6-7
    cost = table.LayerCost(10**9, 2 * 10**9, 0, 0, 0, 0, 10**5)
    p = table.predict(cost, layers=2, stage_cluster=Cluster(TOY, 2, 1), dp=2, tp=1, stages=1, microbatches=3)
    assert p.stage_report.step_time == pytest.approx(7e-3)
    assert p.grad_time == pytest.approx(1e-3) and p.microbatch_time == pytest.approx(6e-3)
    assert p.step_time == pytest.approx(3 * 6e-3 + 1e-3)  # gradients reduced once per step, not per microbatch
    assert p.tflops_per_device == pytest.approx(3 * 6e9 / 19e-3 / 1e12)


def test_every_row_predicts(table):
    for row in table.ROWS:
        assert 0 < table.analytic_row(row).tflops_per_device < 312
