"""The op table: one entry per ONNX op type, each a composition of nabla's public ops with the
ONNX spec's attribute semantics (defaults per opset come from the schema). Values that decide
shapes (a Reshape target, Slice bounds...) are read on the host; everything else stays on the mesh.

``registry`` holds the table (``OPS``, ``Op``, the ``op`` decorator), ``Node`` and the helpers every family
shares; each family module fills the table when imported: ``elementwise`` (unary, activations, broadcast
n-ary), ``reduction`` (``Reduce*``, ``ArgMax``/``ArgMin``, the softmax family, ``CumSum``), ``contraction``
(``MatMul``, ``Gemm``, ``Einsum``), ``shape`` (reshapes, transposes, concat, split, slice, pad...),
``indexing`` (``Gather``, ``GatherElements``, ``OneHot``, ``Trilu``), ``creation`` (``Constant``,
``ConstantOfShape``, ``Range``) and ``windowed`` (conv, pools, norms). ``groups`` sorts op types into the
ONNX sharding formalism's groups. ``entry(op_type)`` asks the op registry first: a node of a type some registered op
exports as itself (``Exp``, ``Relu``, ``BitwiseAnd``...) runs that op, so the table only holds the rest."""

from __future__ import annotations

from . import contraction, creation, elementwise, indexing, reduction, shape, windowed  # noqa: F401 - fill OPS
from .groups import BROADCAST, GROUPS, MATMUL, REDUCTION, UNARY, WINDOWED, group_of
from .registry import DTYPES, OPS, NeedsValue, Node, Op, claimed, entry, holdable, op, value
from .windowed import conv_act

__all__ = ["BROADCAST", "DTYPES", "GROUPS", "claimed", "entry", "MATMUL", "NeedsValue", "Node", "OPS", "Op", "REDUCTION", "UNARY",
           "WINDOWED", "conv_act", "group_of", "holdable", "op", "value"]
