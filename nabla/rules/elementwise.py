"""Elementwise ops with numpy broadcasting: a size-1 broadcast dim gets no factor (ONNX, the ONNX sharding formalism)."""

from __future__ import annotations

from functools import lru_cache

from ..errors import ShardingError
from .core import PASS, REPLICATE, Rule, build


def broadcast_shapes(shapes: tuple[tuple[int, ...], ...], op: str = "elementwise") -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for d in range(rank):
        sizes = {s[len(s) - rank + d] for s in shapes if len(s) - rank + d >= 0} - {1}
        if len(sizes) > 1:
            raise ShardingError(f"{op}: shapes {list(shapes)} do not broadcast: result dim {d} gets sizes {sorted(sizes)}")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


@lru_cache(maxsize=4096)
def elementwise_rule(shapes: tuple[tuple[int, ...], ...], replicate_dims: tuple[int, ...] = (),
                     op: str = "elementwise") -> Rule:
    """n-ary elementwise; ``replicate_dims`` (of the result) need the whole dim, as softmax's axis does."""
    out = broadcast_shapes(shapes, op)
    rank = len(out)
    operands = []
    for s in shapes:
        off = rank - len(s)
        operands.append([(off + d,) if n == out[off + d] and n != 1 else () for d, n in enumerate(s)])
    kinds = [REPLICATE if d in replicate_dims else PASS for d in range(rank)]
    result = [(d,) if out[d] != 1 else () for d in range(rank)]
    return build(operands, result, out, kinds)


@lru_cache(maxsize=4096)
def broadcast_to_rule(shape: tuple[int, ...], target: tuple[int, ...]) -> Rule:
    try:
        ok = len(target) >= len(shape) and broadcast_shapes((shape, target), "broadcast_to") == tuple(target)
    except ShardingError:
        ok = False
    if not ok:
        raise ShardingError(f"broadcast_to: cannot broadcast shape {shape} to {target}: each dim must match "
                            f"the target's or be 1")
    rule = elementwise_rule((shape, tuple(target)), op="broadcast_to")
    return rule._replace(operands=rule.operands[:1])
