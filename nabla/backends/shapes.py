"""The abstract backend: values with no data (``nb.abstract``, or a mesh too large to hold blocks) planned,
logged and priced like any other, nothing computed. Every job gives None, the data an abstract value
holds, so the interpreters run one path whatever the data (the backend is chosen once, where data is read)."""

from __future__ import annotations

from typing import Any

from .base import Backend


class ShapesBackend(Backend):
    """Shapes and layouts only: each job's result is no data (None)."""

    name = "shapes"

    def owns(self, a: Any) -> bool:
        return a is None

    def commit(self, x: Any, spec: Any) -> None:
        return None

    def place(self, value: Any, spec: Any) -> None:
        return None

    def add_once(self, x: Any, spec: Any, axes: tuple[str, ...], zero: Any = None) -> None:
        return None

    def move(self, x: Any, plan: Any, shape: tuple[int, ...] = (), reduce_op: str = "sum") -> None:
        return None

    def regrid(self, x: Any, shape: tuple[int, ...]) -> None:
        return None

    def local(self, step: Any, x: Any) -> None:
        return None

    def bucket(self, entry: Any, blocks: list, plans: tuple, shapes: list) -> list:
        return [None] * len(blocks)

    def kernel(self, op: Any, arrays: list, prog: Any) -> None:
        return None
