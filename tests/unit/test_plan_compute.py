"""nabla.plan.compute: the roofline of one kernel, against arithmetic done by hand."""

from __future__ import annotations

import pytest

from nabla.plan import Hardware, Step, kernel_time, kernel_times

A100 = Hardware.preset("a100-sxm-80gb")


def test_large_matmul_is_compute_bound():
    n = 8192
    s = Step("matmul", out_dtype="bfloat16", flops=2 * n**3, bytes_in=2 * 2 * n * n, bytes_out=2 * n * n)
    # 2 * 8192^3 = 1.0995e12 FLOPs at 312e12 x 0.859 = 4.103 ms; 402.65 MB at 2039e9 x 0.88 = 0.224 ms
    assert kernel_time(s, A100) == pytest.approx(2 * 8192**3 / (312e12 * 0.859))


def test_elementwise_is_memory_bound():
    n = 2**24
    s = Step("add", out_dtype="float32", flops=n, bytes_in=2 * 4 * n, bytes_out=4 * n)
    # 16.8 MFLOP at 19.5 TFLOP/s = 0.86 us; 201 MB at 1794 GB/s = 112 us
    assert kernel_time(s, A100) == pytest.approx(12 * 2**24 / (2039e9 * 0.88))


def test_skinny_matmul_is_memory_bound():
    # a (8192 x 8192) x (8192 x 1) product reads the whole matrix for 2 FLOPs per element
    s = Step("einsum", out_dtype="bfloat16", flops=2 * 8192**2, bytes_in=2 * (8192**2 + 8192), bytes_out=2 * 8192)
    assert kernel_time(s, A100) == pytest.approx(2 * (8192**2 + 2 * 8192) / (2039e9 * 0.88))


def test_float32_matmul_uses_tf32_only_when_allowed():
    s = Step("matmul", out_dtype="float32", flops=10**12)
    assert kernel_time(s, A100) == pytest.approx(1e12 / (19.5e12 * 0.859))
    assert kernel_time(s, A100.replace(allow_tf32=True)) == pytest.approx(1e12 / (156e12 * 0.859))


def test_size_dependent_efficiency():
    hw = A100.replace(matmul_efficiency=[(0, 0.5), (10**10, 0.859)])
    small = Step("conv", out_dtype="bfloat16", flops=10**9)
    assert kernel_time(small, hw) == pytest.approx(1e9 / (312e12 * 0.5))


def test_a_step_with_nothing_to_do_is_free():
    assert kernel_time(Step("with_sharding"), A100) == 0.0


# ---- fusion: a chain of elementwise steps is one kernel ---------------------------------------------------------

HBM = 2039e9 * 0.88  # A100's achievable HBM bandwidth (the preset's)


def _chain(n: int, k: int, events_at: int | None = None) -> list[Step]:
    """``k`` elementwise steps on an (n,) float32 block: value 1 in, value k + 1 out, each step reading the
    previous result (step 0 also a scalar-free second operand, value 100, to show inputs are counted once)."""
    from nabla.collectives import CommEvent
    steps = []
    for i in range(k):
        reads = ((i + 1, 4 * n),) + (((100, 4 * n),) if i == 0 else ())
        events = (CommEvent("all_reduce", ("x",), 4 * n, 2),) if i == events_at else ()
        steps.append(Step("multiply" if i == 0 else "exp", out_dtype="float32", flops=n, bytes_in=4 * n * len(reads),
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
    mm = Step("matmul", out_dtype="float32", flops=2 * n * 64, bytes_in=8 * n, bytes_out=4 * n,
              reads=((2, 4 * n), (4, 4 * n)), out=50, elems=n)
    times, first = kernel_times(steps + [mm], A100)
    assert first == [0, 0, 0, 3]
    assert sum(times[:3]) == pytest.approx((2 * 4 * n + 2 * 4 * n) / HBM)  # reads 1, 100; writes 2 and 4
    assert times[3] == kernel_time(mm, A100)


def test_a_reduction_ends_a_chain_and_other_shapes_start_a_new_one():
    n = 2**20
    steps = _chain(n, 2)
    red = Step("sum", out_dtype="float32", flops=n, bytes_in=4 * n, bytes_out=4, reads=((3, 4 * n),), out=10,
               elems=n)
    after = Step("exp", out_dtype="float32", flops=4, bytes_in=16, bytes_out=16, reads=((10, 4),), out=11, elems=4)
    same = Step("exp", out_dtype="float32", flops=4, bytes_in=16, bytes_out=16, reads=((11, 16),), out=12, elems=4)
    odd = Step("exp", out_dtype="float32", flops=6, bytes_in=24, bytes_out=24, reads=((12, 16),), out=13, elems=6)
    _, first = kernel_times(steps + [red, after, same, odd], A100)
    # the sum closes the first kernel (its producers fuse into it, its consumer does not); 4 elements then 6:
    # neither a broadcast nor a slice of the other's loop, so a third kernel
    assert first == [0, 0, 0, 3, 3, 5]


def test_steps_without_recorded_dataflow_are_priced_alone():
    s = [Step("add", out_dtype="float32", flops=10, bytes_in=80, bytes_out=40)] * 3
    times, first = kernel_times(s, A100)
    assert first == [0, 1, 2] and times == [kernel_time(x, A100) for x in s]
