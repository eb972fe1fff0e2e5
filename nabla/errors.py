"""The one error type nabla raises for bad meshes, specs, placements and mixing."""

from __future__ import annotations


class ShardingError(ValueError):
    """A sharding request that cannot be honoured; the message names op, operand, dim, axis and sizes."""


def where(op: str | None = None, operand: str | int | None = None, dim: int | None = None) -> str:
    """A prefix like ``matmul: operand 1, dim 0: `` so every message locates its fault the same way."""
    parts = []
    if op:
        parts.append(op)
    if operand is not None:
        parts.append(f"operand {operand}")
    if dim is not None:
        parts.append(f"dim {dim}")
    return (", ".join(parts) + ": ") if parts else ""
