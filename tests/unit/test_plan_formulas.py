"""nabla.plan.formulas against the numbers their papers print."""

from __future__ import annotations

import pytest

from nabla.errors import ShardingError
from nabla.plan import gpt_flops, gpt_params, zero_model_state_bytes


def test_gpt_params_match_megatron_table_1():
    # Narayanan et al. SC'21 Table 1: V = 51200, s = 2048; (layers, hidden) -> billions of parameters, as printed
    table = ((24, 2304, 1.7), (30, 3072, 3.6), (36, 4096, 7.5), (40, 6144, 18.4), (48, 8192, 39.1),
             (60, 10240, 76.1), (80, 12288, 145.6), (96, 16384, 310.1), (105, 20480, 529.6), (128, 25600, 1008.0))
    assert [round(gpt_params(layers, hidden, 51200, 2048) / 1e9, 1) for layers, hidden, _ in table] == \
        [billions for _, _, billions in table]


def test_gpt_flops_eq_3():
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200  # GPT-3 175B as in the paper's training-time example
    assert gpt_flops(B, s, l, h, V) == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)))
    # the paper's eq. (4): training time ~ 8 T P / (n X); with T tokens = I B s and F = flops per iteration,
    # 8 P B s ~ F when 6h >> s and 16lh >> V: within 5% here
    assert gpt_flops(B, s, l, h, V) == pytest.approx(8 * gpt_params(l, h, V, s) * B * s, rel=0.05)
    # without recomputation the layers' 96 becomes 72 and the logit GEMMs (6 B s h V) stay
    assert gpt_flops(B, s, l, h, V, recompute=False) == pytest.approx(
        72 * B * s * l * h * h * (1 + s / (6 * h)) + 6 * B * s * h * V)


def test_zero_stages_match_the_papers_7_5b_example():
    # Rajbhandari et al. Figure 1: Psi = 7.5B, N_d = 64, K = 12
    psi = 7.5e9
    assert zero_model_state_bytes(psi, 0, 64) == pytest.approx(120e9)  # (2 + 2 + 12) x 7.5B
    assert zero_model_state_bytes(psi, 1, 64) == pytest.approx(31.4e9, rel=1e-3)  # 4 x 7.5 + 12 x 7.5 / 64
    assert zero_model_state_bytes(psi, 2, 64) == pytest.approx(16.6e9, rel=3e-3)  # 2 x 7.5 + 14 x 7.5 / 64
    assert zero_model_state_bytes(psi, 3, 64) == pytest.approx(1.9e9, rel=2e-2)  # 16 x 7.5 / 64
    with pytest.raises(ShardingError, match="stage must be 0, 1, 2 or 3"):
        zero_model_state_bytes(psi, 4, 64)
