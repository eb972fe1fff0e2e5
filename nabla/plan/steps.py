"""What the estimator prices: a recorded step, as plain data. The executor writes steps; this package
only reads them, through ``StepLike`` (any object with these attributes), so it never imports the executor."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

from ..collectives import CommEvent

#: Kernel ops priced by the matmul roofline (tensor cores); every other op is priced by its bytes. FlashAttention's
#: forward and backward kernels are matmuls on tiles (Dao 2023), their FLOPs the matmuls' only.
MATMUL_OPS = frozenset({"matmul", "einsum", "conv", "dot", "dot_general", "dot_product_attention",
                        "dot_product_attention_dq", "dot_product_attention_dkv"})


@runtime_checkable
class StepLike(Protocol):
    """One op as the executor recorded it: its kernel, the public op it ran for, its phase, dtype, FLOPs and
    bytes per device (the max over devices), the collectives carried out for it (in order) and a layer label."""

    op: str
    user: str
    phase: str
    out_dtype: Any
    flops: int
    bytes_in: int
    bytes_out: int
    events: Sequence[CommEvent]
    layer: str | None


class PricedStep(NamedTuple):
    """A step as the estimator prices it: a concrete ``StepLike``, what ``priced_step`` makes of a recorded
    ``nabla.step.Step`` and what tests and hand-made plans build.
    What fusion reads (``fusion.py``; a step without ``reads`` is priced on its own): ``reads``, the
    ``(value, bytes per device)`` of each operand, ``out`` the value it makes (ids as the recording names them),
    ``elems`` the elements per device its kernel runs over, ``kind`` how it fuses (default: by ``op``; a view
    is ``"alias"``). ``in_dtype``: the dtype a matmul-class kernel multiplies in (its operands'; default
    ``out_dtype``): float8 operands run at the float8 peak whatever the result's dtype. ``moves``: per entry of
    ``events``, the value it moves (0: not recorded), which the schedule reads to start a collective when its
    data is ready and to tell parameters' gathers from activations' (``schedule.py``)."""

    op: str
    user: str = ""
    phase: str = "forward"
    out_dtype: Any = "float32"
    flops: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    events: tuple[CommEvent, ...] = ()
    layer: str | None = None
    reads: tuple[tuple[int, int], ...] = ()
    out: int = 0
    elems: int = 0
    kind: str = ""
    in_dtype: Any = None
    moves: tuple[int, ...] = ()


def is_grad_reduction(step: StepLike) -> bool:
    """A gradient reduction: a backward step run for ``"grad of ..."`` (what ``overlap="grads"`` hides)."""
    return step.phase == "backward" and str(step.user).startswith("grad of")
