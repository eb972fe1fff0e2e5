"""The time of one step's kernel on one device: a roofline of its FLOPs against the dtype's achievable peak and
of its bytes against achievable HBM bandwidth; and of a program's steps, with chains of elementwise steps fused
into one kernel (fusion.py). Collectives are comm.py's."""

from __future__ import annotations

from typing import Sequence

from .fusion import groups
from .hardware import Hardware
from .steps import MATMUL_OPS, Step, StepLike


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


def kernel_times(steps: Sequence[StepLike], hw: Hardware, fusion: bool = True) -> tuple[list[float], list[int]]:
    """Each step's kernel time, and the index of the first step of the kernel it ran in. With ``fusion``, a
    group of fused steps (``fusion.groups``) is priced as one kernel (``kernel_time`` of its summed FLOPs and
    its bytes read and written once) and its time is shared among its steps in proportion to what each would
    take alone, so per-step and per-layer tables still add up to the step. Without, every step alone."""
    if not fusion:
        return [kernel_time(s, hw) for s in steps], list(range(len(steps)))
    times: list[float] = []
    first: list[int] = []
    for g in groups(steps):
        members = steps[g.start:g.stop]
        if len(members) == 1 and g.bytes_in == members[0].bytes_in and g.bytes_out == members[0].bytes_out:
            times.append(kernel_time(members[0], hw))
            first.append(g.start)
            continue
        s = members[0]
        total = kernel_time(Step(s.op if len(members) == 1 else "fused", out_dtype=s.out_dtype, flops=g.flops,
                                 bytes_in=g.bytes_in, bytes_out=g.bytes_out), hw)
        alone = [kernel_time(m, hw) for m in members]
        whole = sum(alone)
        times.extend(total * a / whole if whole else total / len(members) for a in alone)
        first.extend([g.start] * len(members))
    return times, first
