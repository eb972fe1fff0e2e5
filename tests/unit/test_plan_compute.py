"""nabla.plan.compute: the roofline of one kernel, against arithmetic done by hand."""

from __future__ import annotations

import pytest

from nabla.plan import Hardware, Step, kernel_time

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
