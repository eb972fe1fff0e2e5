"""The time of one step's kernel on one device: a roofline of its FLOPs against the dtype's achievable peak and
of its bytes against achievable HBM bandwidth; and of a program's steps, with chains of elementwise steps fused
into one kernel (fusion.py). Collectives are comm.py's."""

from __future__ import annotations

from typing import Sequence

from .fusion import groups, kind
from .hardware import Hardware, dtype_key
from .steps import MATMUL_OPS, PricedStep, StepLike


#: FlashAttention's kernels (``nb.dot_product_attention``): the forward, and the backward pass's ops
ATTENTION_FORWARD = frozenset({"dot_product_attention"})
ATTENTION_BACKWARD = frozenset({"dot_product_attention_dq", "dot_product_attention_dkv"})


def kernel_time(step: StepLike, hw: Hardware) -> float:
    """``max(flops / (peak[dtype] * eff), (bytes_in + bytes_out) / (hbm_bw * eff_hbm))`` for a matmul-class op
    (``MATMUL_OPS``: tensor cores), ``dtype`` the one it multiplies in (``in_dtype``, so float8 operands run at
    the float8 peak) and ``eff`` the matmul efficiency of that dtype and size, or for FlashAttention's kernels
    the hardware's ``attention_efficiency``; for any other op the compute roof is the FP32 vector peak
    (``hw.vector_flops``), so elementwise ops and reductions come out memory-bound by their bytes."""
    memory = (step.bytes_in + step.bytes_out) / (hw.hbm_bandwidth * hw.hbm_efficiency)
    if not step.flops:
        return memory
    if step.op in MATMUL_OPS:
        dtype = getattr(step, "in_dtype", None) or step.out_dtype
        peak, dtype = matmul_peak(hw, dtype)
        att = hw.attention_efficiency
        if att is not None and step.op in ATTENTION_FORWARD:
            eff = att[0]
        elif att is not None and step.op in ATTENTION_BACKWARD:
            eff = att[1]
        else:
            eff = hw.matmul_fraction(step.flops, dtype)
        compute = step.flops / (peak * eff)
    else:
        compute = step.flops / hw.vector_flops
    return max(compute, memory)


def matmul_peak(hw: Hardware, dtype: object) -> tuple[float, str]:
    """The tensor-core peak a matmul in ``dtype`` runs at, and the dtype it runs in: float8 operands on hardware
    without float8 tensor cores (A100) are multiplied in 16 bits, at the bfloat16 peak."""
    key = dtype_key(dtype)
    if key == "float8" and "float8" not in dict(hw.peak_flops):
        key = "bfloat16"
    return hw.peak(key), key


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
            times.append(_kernel_time(members[0], hw))
            first.append(g.start)
            continue
        s = members[0]
        op = s.op if len(members) == 1 or s.op in MATMUL_OPS else "fused"  # a GEMM with its folded sum: a GEMM
        total = _kernel_time(PricedStep(op, out_dtype=s.out_dtype, flops=g.flops, bytes_in=g.bytes_in,
                                  bytes_out=g.bytes_out, in_dtype=getattr(s, "in_dtype", None)), hw)
        alone = [0.0 if kind(m) == "alias" else _kernel_time(m, hw) for m in members]  # a view runs no kernel
        whole = sum(alone)
        times.extend(total * a / whole if whole else total / len(members) for a in alone)
        first.extend([g.start] * len(members))
    return times, first


#: id(hardware) -> (the hardware, kept alive so its id is not reused; the fields ``kernel_time`` reads -> its
#: time): a search prices the same kernels over and over (hundreds of replays of one layer, 80 alike layers
#: stitched end to end), and a lookup costs a tenth of pricing one
_TIMES: dict[int, tuple[Hardware, dict]] = {}


def _kernel_time(step: StepLike, hw: Hardware) -> float:
    """``kernel_time``, cached on what it reads of the step (bounded: cleared when full)."""
    got = _TIMES.get(id(hw))
    if got is None or got[0] is not hw:
        if len(_TIMES) > 16:
            _TIMES.clear()
        got = _TIMES[id(hw)] = (hw, {})
    key = (step.op, step.flops, step.bytes_in, step.bytes_out, getattr(step, "in_dtype", None), step.out_dtype)
    t = got[1].get(key)
    if t is None:
        if len(got[1]) > 65536:
            got[1].clear()
        t = got[1][key] = kernel_time(step, hw)
    return t
