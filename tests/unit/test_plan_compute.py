"""nabla.plan.compute: the roofline of one kernel, against arithmetic done by hand."""

from __future__ import annotations

import numpy as np
import pytest

from nabla.plan import Hardware, PricedStep, kernel_time, kernel_times

A100 = Hardware.preset("a100-sxm-80gb")


def test_large_matmul_is_compute_bound():
    n = 8192
    s = PricedStep("matmul", out_dtype="bfloat16", flops=2 * n**3, bytes_in=2 * 2 * n * n, bytes_out=2 * n * n)
    # 2 * 8192^3 = 1.0995e12 FLOPs at 312e12 x 0.859 = 4.103 ms; 402.65 MB at 2039e9 x 0.88 = 0.224 ms
    assert kernel_time(s, A100) == pytest.approx(2 * 8192**3 / (312e12 * 0.859))


def test_elementwise_is_memory_bound():
    n = 2**24
    s = PricedStep("add", out_dtype="float32", flops=n, bytes_in=2 * 4 * n, bytes_out=4 * n)
    # 16.8 MFLOP at 19.5 TFLOP/s = 0.86 us; 201 MB at 1794 GB/s = 112 us
    assert kernel_time(s, A100) == pytest.approx(12 * 2**24 / (2039e9 * 0.88))


def test_skinny_matmul_is_memory_bound():
    # a (8192 x 8192) x (8192 x 1) product reads the whole matrix for 2 FLOPs per element
    s = PricedStep("einsum", out_dtype="bfloat16", flops=2 * 8192**2, bytes_in=2 * (8192**2 + 8192), bytes_out=2 * 8192)
    assert kernel_time(s, A100) == pytest.approx(2 * (8192**2 + 2 * 8192) / (2039e9 * 0.88))


def test_float32_matmul_uses_tf32_only_when_allowed():
    s = PricedStep("matmul", out_dtype="float32", flops=10**12)
    assert kernel_time(s, A100) == pytest.approx(1e12 / (19.5e12 * 0.859))
    assert kernel_time(s, A100.replace(allow_tf32=True)) == pytest.approx(1e12 / (156e12 * 0.859))


def test_size_dependent_efficiency():
    hw = A100.replace(matmul_efficiency=[(0, 0.5), (10**10, 0.859)])
    small = PricedStep("conv", out_dtype="bfloat16", flops=10**9)
    assert kernel_time(small, hw) == pytest.approx(1e9 / (312e12 * 0.5))


def test_a_step_with_nothing_to_do_is_free():
    assert kernel_time(PricedStep("with_sharding"), A100) == 0.0


# ---- fusion: a chain of elementwise steps is one kernel ---------------------------------------------------------

HBM = 2039e9 * 0.88  # A100's achievable HBM bandwidth (the preset's)


def _chain(n: int, k: int, events_at: int | None = None) -> list[PricedStep]:
    """``k`` elementwise steps on an (n,) float32 block: value 1 in, value k + 1 out, each step reading the
    previous result (step 0 also a scalar-free second operand, value 100, to show inputs are counted once)."""
    from nabla.collectives import CommEvent
    steps = []
    for i in range(k):
        reads = ((i + 1, 4 * n),) + (((100, 4 * n),) if i == 0 else ())
        events = (CommEvent("all_reduce", ("x",), 4 * n, 2),) if i == events_at else ()
        steps.append(PricedStep("multiply" if i == 0 else "exp", out_dtype="float32", flops=n, bytes_in=4 * n * len(reads),
                          bytes_out=4 * n, events=events, reads=reads, out=i + 2, elems=n))
    return steps


@pytest.mark.parametrize("k", [1, 2, 5])
def test_an_elementwise_chain_reads_its_inputs_once_and_writes_its_output_once(k):
    n = 2**24
    times, first = kernel_times(_chain(n, k), A100)
    # by hand: values 1 and 100 read (2 x 4n bytes), value k + 1 written (4n); the k - 1 values between stay
    # in registers. k n FLOPs at 19.5 TFLOP/s (at most 4.3 us) is under the 41 us of memory: memory-bound
    assert sum(times) == pytest.approx(12 * n / HBM)
    assert first == [0] * k  # one kernel, from step 0
    # the kernel's time is shared in proportion to the steps' own times: step 0 read two operands, the rest one
    alone = [kernel_time(s, A100) for s in _chain(n, k)]
    assert times == pytest.approx([sum(times) * a / sum(alone) for a in alone])


def test_without_fusion_every_step_is_its_own_kernel():
    n, k = 2**24, 5
    steps = _chain(n, k)
    times, first = kernel_times(steps, A100, fusion=False)
    assert times == [kernel_time(s, A100) for s in steps]
    assert sum(times) == pytest.approx((12 + 8 * (k - 1)) * n / HBM)  # each step reads and writes its block
    assert first == list(range(k))


def test_a_collective_between_elementwise_steps_breaks_the_chain():
    n = 2**24
    steps = _chain(n, 4, events_at=2)  # step 2's operand is all_reduced before its kernel
    times, first = kernel_times(steps, A100)
    assert first == [0, 0, 2, 2]
    # steps 0-1: read values 1 and 100, write value 3 (step 2 reads it later); steps 2-3: read 3, write 5
    assert sum(times[:2]) == pytest.approx(12 * n / HBM)
    assert sum(times[2:]) == pytest.approx(8 * n / HBM)


def test_a_value_read_after_the_chain_is_written_and_a_matmul_is_its_own_kernel():
    n = 2**20
    steps = _chain(n, 3)
    # a matmul after the chain reads value 2 (made by step 0, inside the chain) and value 4 (the chain's result)
    mm = PricedStep("matmul", out_dtype="float32", flops=2 * n * 64, bytes_in=8 * n, bytes_out=4 * n,
              reads=((2, 4 * n), (4, 4 * n)), out=50, elems=n)
    times, first = kernel_times(steps + [mm], A100)
    assert first == [0, 0, 0, 3]
    assert sum(times[:3]) == pytest.approx((2 * 4 * n + 2 * 4 * n) / HBM)  # reads 1, 100; writes 2 and 4
    assert times[3] == kernel_time(mm, A100)


def test_a_reduction_ends_a_chain_and_other_shapes_start_a_new_one():
    n = 2**20
    steps = _chain(n, 2)
    red = PricedStep("sum", out_dtype="float32", flops=n, bytes_in=4 * n, bytes_out=4, reads=((3, 4 * n),), out=10,
               elems=n)
    after = PricedStep("exp", out_dtype="float32", flops=4, bytes_in=16, bytes_out=16, reads=((10, 4),), out=11, elems=4)
    same = PricedStep("exp", out_dtype="float32", flops=4, bytes_in=16, bytes_out=16, reads=((11, 16),), out=12, elems=4)
    odd = PricedStep("exp", out_dtype="float32", flops=6, bytes_in=24, bytes_out=24, reads=((12, 16),), out=13, elems=6)
    _, first = kernel_times(steps + [red, after, same, odd], A100)
    # the sum closes the first kernel (its producers fuse into it, its consumer does not); 4 elements then 6:
    # neither a broadcast nor a slice of the other's loop, so a third kernel
    assert first == [0, 0, 0, 3, 3, 5]


def test_steps_without_recorded_dataflow_are_priced_alone():
    s = [PricedStep("add", out_dtype="float32", flops=10, bytes_in=80, bytes_out=40)] * 3
    times, first = kernel_times(s, A100)
    assert first == [0, 1, 2] and times == [kernel_time(x, A100) for x in s]


# ---- kernels as compilers emit them: views, the weight gradient's batch sum, float8, FlashAttention -------------


def test_a_view_is_no_kernel_and_its_reader_reads_the_source_once():
    n = 2**24
    view = PricedStep("transpose", out_dtype="float32", bytes_in=4 * n, bytes_out=4 * n, reads=((1, 4 * n),), out=2,
                elems=n, kind="alias")
    use = PricedStep("exp", out_dtype="float32", flops=n, bytes_in=4 * n, bytes_out=4 * n, reads=((2, 4 * n),), out=3,
               elems=n)
    times, first = kernel_times([view, use], A100)
    assert times[0] == 0 and sum(times) == pytest.approx(8 * n / HBM)  # value 1 read once, value 3 written once
    # priced as a copy (what the estimate did before), the transpose alone was another 8n bytes
    assert kernel_time(view._replace(kind=""), A100) == pytest.approx(8 * n / HBM)


def test_views_of_a_recorded_program_cost_nothing():
    import nabla as nb
    from nabla.plan import Cluster, estimate_steps, priced_step
    cl = Cluster(A100, 1, 2)
    mesh = cl.mesh("m", (2,), ("x",))
    x = nb.abstract((512, 256, 64)).shard(mesh, ["x", None, None])
    with nb.comm_log() as log:
        x.transpose(0, 2, 1).reshape(512, -1)
    steps = [priced_step(s) for s in log.steps]
    assert [s.kind for s in steps] == ["alias", "alias"]
    assert estimate_steps(steps, cl, mesh).compute_time == 0


def test_a_weight_gradient_s_batch_sum_is_folded_into_its_gemm():
    # (B, k, m) x (B, m, n) per example, summed over B: one GEMM over B m, writing only the (k, n) sum
    B, k, m, n = 8, 4096, 2048, 4096
    mm = PricedStep("matmul", out_dtype="bfloat16", flops=2 * B * k * m * n, bytes_in=2 * B * m * (k + n),
              bytes_out=2 * B * k * n, reads=((1, 2 * B * m * k), (2, 2 * B * m * n)), out=3, elems=B * k * n)
    total = PricedStep("sum", out_dtype="bfloat16", flops=B * k * n, bytes_in=2 * B * k * n, bytes_out=2 * k * n,
                 reads=((3, 2 * B * k * n),), out=4, elems=B * k * n)
    times, first = kernel_times([mm, total], A100)
    assert first == [0, 0]
    one = PricedStep("matmul", out_dtype="bfloat16", flops=mm.flops + total.flops, bytes_in=mm.bytes_in,
               bytes_out=total.bytes_out)
    assert sum(times) == pytest.approx(kernel_time(one, A100))
    # a sum whose operand another step also reads stays a kernel of its own
    other = PricedStep("exp", out_dtype="bfloat16", bytes_in=2 * B * k * n, bytes_out=2 * B * k * n,
                 reads=((3, 2 * B * k * n),), out=5, elems=B * k * n)
    assert kernel_times([mm, total, other], A100)[1][:2] == [0, 1]


H100 = Hardware.preset("h100-sxm-80gb")


def test_float8_gemms_run_at_the_float8_peak():
    import ml_dtypes
    f8 = ml_dtypes.float8_e4m3fn
    s = PricedStep("matmul", out_dtype="bfloat16", flops=10**13, in_dtype=f8)
    assert kernel_time(s, H100) == pytest.approx(1e13 / (1979e12 * 0.709))  # H100's FP8 MAMF: 70.9% of 1,979
    assert kernel_time(s._replace(in_dtype=None), H100) == pytest.approx(1e13 / (989e12 * 0.801))  # bf16
    assert kernel_time(s, A100) == pytest.approx(1e13 / (312e12 * 0.859))  # no FP8 tensor cores: 16-bit
    import nabla as nb
    from nabla.plan import priced_step
    x, w = nb.abstract((256, 512), "bfloat16"), nb.abstract((512, 128), "bfloat16")
    with nb.comm_log() as log:
        (x.astype(f8) @ w.astype(f8)).astype("bfloat16")
    mm = [priced_step(t) for t in log.steps if t.name == "matmul"][0]
    assert mm.in_dtype == np.dtype(f8)


def test_causal_attention_counts_half_the_pairs_and_runs_at_flashattention_s_efficiency():
    import nabla as nb
    from nabla.plan import priced_step
    B, T, N, H = 2, 1024, 8, 64
    q = nb.abstract((B, T, N, H), "bfloat16")
    full = nb.flops(lambda q: nb.dot_product_attention(q, q, q), q)
    causal = nb.flops(lambda q: nb.dot_product_attention(q, q, q, is_causal=True), q)
    assert full == 4 * B * N * T * T * H  # two matmuls (FlashAttention's count)
    assert causal == 4 * B * N * H * T * (T + 1) // 2  # only the kept (query, key) pairs
    with nb.comm_log() as log:
        nb.grad(lambda q: nb.dot_product_attention(q, q, q, is_causal=True).astype("float32").sum())(q)
    steps = {s.name: priced_step(s) for s in log.steps}
    fwd, dq, dkv = (steps[k] for k in ("dot_product_attention", "dot_product_attention_dq",
                                       "dot_product_attention_dkv"))
    assert dq.flops + dkv.flops == pytest.approx(2.5 * fwd.flops, rel=1e-6)  # FlashAttention-2's backward
    assert kernel_time(fwd, H100) == pytest.approx(max(fwd.flops / (989e12 * 0.374),
                                                       (fwd.bytes_in + fwd.bytes_out) / (3350e9 * 0.88)))
    assert kernel_time(dkv, H100) == pytest.approx(max(dkv.flops / (989e12 * 0.326),
                                                       (dkv.bytes_in + dkv.bytes_out) / (3350e9 * 0.88)))
