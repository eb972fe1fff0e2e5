"""The time of one step's kernel on one device: a roofline of its FLOPs against the dtype's achievable peak and
of its bytes against achievable HBM bandwidth. Collectives are comm.py's."""

from __future__ import annotations

from .hardware import Hardware
from .steps import MATMUL_OPS, StepLike


def kernel_time(step: StepLike, hw: Hardware) -> float:
    """``max(flops / (peak[dtype] * eff_matmul(flops)), (bytes_in + bytes_out) / (hbm_bw * eff_hbm))`` for a
    matmul-class op (``MATMUL_OPS``: tensor cores); for any other op the compute roof is the FP32 vector
    peak (``hw.vector_flops``), so elementwise ops and reductions come out memory-bound by their bytes."""
    memory = (step.bytes_in + step.bytes_out) / (hw.hbm_bandwidth * hw.hbm_efficiency)
    if not step.flops:
        return memory
    if step.op in MATMUL_OPS:
        compute = step.flops / (hw.peak(step.out_dtype) * hw.matmul_fraction(step.flops))
    else:
        compute = step.flops / hw.vector_flops
    return max(compute, memory)
