"""``nb.import_jax``: a JAX function traced once per signature (``program``) and its jaxpr run equation by equation
as nabla ops on the tensors' mesh (``interpreter``; one module per primitive family fills ``table``). It plans and
prices nothing itself: every op it runs is a recorded step like any, labelled with the source line it came from."""

from __future__ import annotations

from . import control, conv, elementwise, indexing, random, reduce, shape, spmd, windowed  # noqa: F401 - they fill the table
from .program import Imported, import_jax

__all__ = ["Imported", "import_jax"]
