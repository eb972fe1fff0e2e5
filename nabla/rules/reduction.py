"""Reductions over some dims, with or without keepdims (ONNX reduction group, the ONNX sharding formalism)."""

from __future__ import annotations

from functools import lru_cache

from .core import PASS, REDUCE, REPLICATE, Rule, build


@lru_cache(maxsize=4096)
def reduce_rule(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool, replicate: bool = False) -> Rule:
    """Reduced dims are ``reduce`` factors (sharded -> partial sums), or ``replicate`` for argmax-like ops."""
    kinds = [(REPLICATE if replicate else REDUCE) if d in axes else PASS for d in range(len(shape))]
    operand = [(d,) if n != 1 else () for d, n in enumerate(shape)]
    result = [() if d in axes else operand[d] for d in range(len(shape)) if keepdims or d not in axes]
    return build([operand], result, shape, kinds)
