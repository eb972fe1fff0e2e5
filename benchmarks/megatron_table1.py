"""Megatron-LM's Table 1 (measured throughput of GPT models from 1.7B to 1T parameters on up to 3072 A100s) as
data, and the estimator's prediction for a row from per-layer costs. No timing runs here.

Source: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
SC'21 (arXiv:2104.04473), Table 1 "Weak-scaling throughput for GPT models ranging from 1 billion to 1 trillion
parameters". All rows: vocabulary 51,200, sequence 2048, mixed precision on Selene (DGX A100 80GB, 8 GPUs and
8 HDR HCAs per node), the interleaved pipeline schedule with the scatter/gather optimization (sec. 5.1);
percentages are of 312 TFLOP/s, and the FLOPs are eq. (3)'s (activation recomputation included).

Run ``python benchmarks/megatron_table1.py`` for the analytic per-layer costs of each row (``megatron_layer``)
priced by nabla.plan next to what the paper measured. The microbatch size and the number of model chunks are
not in the table: ``MICROBATCH`` and ``VIRTUAL_STAGES`` below are assumptions. Later the per-layer costs come
from a real nabla GPT program run abstractly instead of ``megatron_layer``.
"""

from __future__ import annotations

from typing import NamedTuple

from nabla.collectives import CommEvent
from nabla.plan import Cluster, Hardware, PipelineReport, Step, estimate_steps, pipeline_estimate

SOURCE = "Narayanan et al., SC'21, arXiv:2104.04473, Table 1"
VOCAB, SEQ = 51200, 2048
MICROBATCH = 1  # assumed: Table 1 does not list it
VIRTUAL_STAGES = 2  # assumed for rows with pipeline parallelism (interleaved schedule)


class Row(NamedTuple):
    """One row of Table 1."""

    params_billion: float
    heads: int
    hidden: int
    layers: int
    tensor_parallel: int
    pipeline_parallel: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved teraFLOP/s per GPU
    peak_percent: int  # of 312 TFLOP/s


ROWS = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)


class LayerCost(NamedTuple):
    """One transformer layer on one device for one microbatch: FLOPs of its matmuls forward and backward
    (recomputation included in the backward), HBM bytes of its memory-bound kernels (norms, softmax, GeLU,
    dropout, residuals) forward and backward, the ring bytes each device sends in the layer's
    tensor-parallel all_reduces forward and backward, and its gradient bytes (reduced over dp once a step)."""

    fwd_flops: int
    bwd_flops: int
    fwd_bytes: int
    bwd_bytes: int
    fwd_comm_bytes: int
    bwd_comm_bytes: int
    grad_bytes: int


def stage_steps(cost: LayerCost, layers: int, extra_flops: int = 0) -> list[Step]:
    """The steps of one pipeline stage for one microbatch: ``layers`` identical layers forward (a matmul step,
    a memory-bound step carrying the tensor-parallel all_reduces over ``tp``), the logit GEMMs' share
    ``extra_flops``, then the layers backward, each followed by its gradient all_reduce over ``dp``."""
    def layer(i: int, phase: str, flops: int, nbytes: int, comm: int) -> list[Step]:
        events = (CommEvent("all_reduce", ("tp",), comm),) if comm else ()
        return [Step("matmul", "layer", phase, "bfloat16", flops, 0, 0, (), f"layer {i}"),
                Step("add", "layer", phase, "bfloat16", 0, nbytes, 0, events, f"layer {i}")]

    out: list[Step] = []
    for i in range(layers):
        out += layer(i, "forward", cost.fwd_flops, cost.fwd_bytes, cost.fwd_comm_bytes)
    if extra_flops:
        out.append(Step("matmul", "logits", "forward", "bfloat16", extra_flops, 0, 0, (), "logits"))
    for i in reversed(range(layers)):
        out += layer(i, "backward", cost.bwd_flops, cost.bwd_bytes, cost.bwd_comm_bytes)
        if cost.grad_bytes:
            out.append(Step("with_sharding", f"grad of p['layer {i}']", "backward", "bfloat16", 0, 0, 0,
                            (CommEvent("all_reduce", ("dp",), cost.grad_bytes),), f"layer {i}"))
    return out


def predict(cost: LayerCost, layers: int, stage_cluster: Cluster, dp: int, tp: int, stages: int,
            microbatches: int, job_cluster: Cluster | None = None, virtual_stages: int = 1, p2p_bytes: int = 0,
            extra_flops: int = 0, overlap: str = "grads") -> PipelineReport:
    """The predicted step of a job whose stages each run ``layers`` layers of ``cost`` on a ``(dp, tp)`` mesh
    of ``stage_cluster``: the stage's schedule (``overlap``) priced per microbatch, then the pipeline.
    ``.tflops_per_device`` is the predicted TFLOP/s per GPU."""
    mesh = stage_cluster.mesh("stage", (dp, tp), ("dp", "tp"))
    report = estimate_steps(stage_steps(cost, layers, extra_flops), stage_cluster, mesh, overlap=overlap)
    schedule = "interleaved" if virtual_stages > 1 else "1f1b"
    return pipeline_estimate(report, stages, microbatches, schedule, virtual_stages, p2p_bytes or None,
                             job_cluster)


def megatron_layer(row: Row, microbatch: int = MICROBATCH, bytes_per_value: int = 2) -> LayerCost:
    """Analytic costs of one layer of ``row`` per device. Matmuls: forward ``24 b s h^2 (1 + s/(6h)) / t``
    (eq. 3's layer term over 4 passes), backward twice that plus the recomputed forward. Memory-bound
    kernels: the activations they write, ``s b h (10 + 24/t + 5 a s/(h t))`` bytes (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", eq. 2 with tensor parallelism), each
    written and read once (x2) forward, and twice that backward (a rough traffic model, not a measurement).
    Comm: Megatron's two all_reduces of the ``b s h`` activation per pass over ``t`` (forward: two;
    backward and the recomputed forward: four). Gradients: the layer's ``12 h^2 / t`` weights in bf16."""
    b, s, h, t, a = microbatch, SEQ, row.hidden, row.tensor_parallel, row.heads
    fwd = int(24 * b * s * h * h * (1 + s / (6 * h)) / t)
    traffic = int(2 * s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    ring = 2 * (t - 1) * (b * s * h * bytes_per_value) // t if t > 1 else 0
    return LayerCost(fwd, 3 * fwd, traffic, 2 * traffic, 2 * ring, 4 * ring, 12 * h * h // t * bytes_per_value)


def predict_row(row: Row, hw: Hardware | None = None) -> PipelineReport:
    """The prediction for one row of Table 1 on A100 SXM 80GB nodes of 8 (Selene's)."""
    hw = Hardware.preset("a100-sxm-80gb") if hw is None else hw
    t, p, n = row.tensor_parallel, row.pipeline_parallel, row.gpus
    d = n // (t * p)
    microbatches = row.batch // (d * MICROBATCH)
    stage_gpus = d * t
    stage_cluster = Cluster(hw, max(1, stage_gpus // 8), min(8, stage_gpus))
    job = Cluster(hw, n // 8, 8)
    v = VIRTUAL_STAGES if p > 1 else 1
    logits = int(6 * MICROBATCH * SEQ * row.hidden * VOCAB / (t * p))  # eq. (3)'s logit term, spread over stages
    p2p = MICROBATCH * SEQ * row.hidden * 2 // t  # scatter/gather: b s h / t values per boundary (sec. 4.1)
    return predict(megatron_layer(row), row.layers // p, stage_cluster, d, t, p, microbatches, job, v,
                   p2p if p > 1 else 0, logits)


def main() -> None:
    print(f"Megatron-LM Table 1 ({SOURCE}) against nabla.plan (microbatch {MICROBATCH}, v={VIRTUAL_STAGES})")
    print(f"{'params B':>9} {'t':>3} {'p':>3} {'GPUs':>5} {'measured':>9} {'predicted':>10} {'ratio':>6}")
    for row in ROWS:
        pred = predict_row(row).tflops_per_device
        print(f"{row.params_billion:>9} {row.tensor_parallel:>3} {row.pipeline_parallel:>3} {row.gpus:>5} "
              f"{row.tflops_per_gpu:>9} {pred:>10.1f} {pred / row.tflops_per_gpu:>6.2f}")


if __name__ == "__main__":
    main()
