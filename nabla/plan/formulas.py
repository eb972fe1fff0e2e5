"""Published closed forms to check estimates against: Megatron-LM's parameter and FLOP counts for GPT models
and ZeRO's model-state bytes per device. Pure arithmetic, no steps."""

from __future__ import annotations

from ..errors import ShardingError


def gpt_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Parameters of a GPT model, eq. (2) of Narayanan et al., "Efficient Large-Scale Language Model Training
    on GPU Clusters Using Megatron-LM" (SC'21, arXiv:2104.04473): ``P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh))``."""
    l, h = layers, hidden
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def gpt_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """FLOPs of one training iteration (GEMMs only), eq. (3) of Narayanan et al. SC'21:
    ``F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` "assumes activation recomputation and takes into account
    the floating-point operations associated with the extra forward pass". The 96 is 4 passes of 24 B s h^2
    per layer (forward, recomputed forward, backward counted as two); without recomputation it is 3 passes:
    72. The logit layer's ``V/(16lh)`` term (forward plus backward only) is rescaled to stay the same."""
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    # 72 B s l h^2 (1 + s/(6h)) for the layers, plus the logit GEMM's 6 B s h V (= 96 B s l h^2 V/(16 l h))
    return 72 * B * s * l * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * V


def zero_model_state_bytes(params: float, stage: int, dp: int, optimizer_bytes: int = 12) -> float:
    """Bytes per device of model states under ZeRO (Rajbhandari et al., SC'20, arXiv:1910.02054, sec. 5 and
    Figure 1) for mixed-precision Adam: 2 bytes of fp16 parameters, 2 of fp16 gradients and ``K = 12`` of
    optimizer state (fp32 parameters, momentum, variance) per parameter, ``(2 + 2 + K) Psi = 16 Psi``.
    Stage 1 (P_os) divides ``K Psi`` by ``N_d = dp``; stage 2 (P_os+g) also the gradients; stage 3
    (P_os+g+p) all ``16 Psi``. Stage 0 is plain data parallelism."""
    if stage not in (0, 1, 2, 3):
        raise ShardingError(f"zero_model_state_bytes: stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp < 1:
        raise ShardingError(f"zero_model_state_bytes: dp must be >= 1, got {dp!r}")
    p, g, k = 2 * params, 2 * params, optimizer_bytes * params
    return {0: p + g + k, 1: p + g + k / dp, 2: p + (g + k) / dp, 3: (p + g + k) / dp}[stage]
