"""The op table and what every entry shares: ``OPS`` (ONNX op type -> ``Op``), the ``op`` decorator that
fills it, ``Node`` (a node's attributes with the schema's defaults, host reads of shape-deciding inputs, errors
naming the node), ``NeedsValue``, which dtypes nabla tensors hold, and the small tensor and axis helpers every
op family uses."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

import nabla as nb

from ...dtypes import is_float
from ...errors import ShardingError
from ...ops import apply, registry as ops_registry
from ...tensor import Tensor


class NeedsValue(ShardingError):
    """A value that decides shapes is abstract: ``check`` and ``annotate`` then take ONNX's shape inference."""


class Node:
    """What a handler sees of one node: its name and op type, its attributes (with the schema's
    defaults for the model's opset), and which outputs are wanted."""

    def __init__(self, proto: onnx.NodeProto, opset: int, label: str) -> None:
        self.proto = proto
        self.op_type = proto.op_type
        self.label = label  # "node 'name' (OpType)"
        self.op_label = f"{proto.op_type} {proto.name}" if proto.name else proto.op_type  # for the comm log
        self.opset = opset
        self.attrs = {a.name: _attr_value(a) for a in proto.attribute}
        try:
            self.schema = onnx.defs.get_schema(proto.op_type, opset, proto.domain or "")
        except Exception:  # noqa: BLE001 - an op unknown to this onnx: no defaults
            self.schema = None

    def attr(self, name: str, default: Any = None) -> Any:
        if name in self.attrs:
            return self.attrs[name]
        if self.schema is not None and name in self.schema.attributes:
            d = self.schema.attributes[name].default_value
            if d is not None and d.type != onnx.AttributeProto.UNDEFINED:
                return _attr_value(d)
        return default

    def wants(self, i: int) -> bool:
        return len(self.proto.output) > i and bool(self.proto.output[i])

    def fail(self, msg: str) -> ShardingError:
        return ShardingError(f"{self.label}: {msg}")

    def host(self, t: Tensor | None, what: str) -> np.ndarray:
        """The value of a tensor that decides shapes, read on the host."""
        if t is None:
            raise self.fail(f"input {what!r} is required")
        if t.is_abstract:
            raise NeedsValue(f"{self.label}: "
                             f"input {what!r} decides the output shape, so its value must be known; it is "
                             f"abstract (nb.abstract). Make it a constant or an initializer")
        return value(t)

    def scalar(self, t: Tensor | None, what: str) -> Any:
        v = self.host(t, what)
        if v.size != 1:
            raise self.fail(f"input {what!r} must hold one value, it has shape {v.shape}")
        return v.reshape(-1)[0]


def value(t: Tensor) -> np.ndarray:
    """``t.numpy()`` with ``t``'s shape (this nabla returns shape (1,) for a sharded 0-d tensor)."""
    return np.asarray(t.numpy()).reshape(t.shape)


def _attr_value(a: onnx.AttributeProto) -> Any:
    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return a  # sub-graphs: the ops using them are not in the table
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode() for s in v]
    return v


DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128))


def holdable(dtype) -> bool:
    """Whether nabla tensors hold this dtype: numpy's numeric types, and ml_dtypes' bfloat16 and float8 types
    (not int4, float4 or strings)."""
    return np.dtype(dtype) in DTYPES or is_float(dtype)


class Op(NamedTuple):
    run: Callable[..., Any]
    needs: tuple[str, ...] = ()  # nabla functions the entry calls that may not exist yet
    check: Callable[[Node], None] | None = None  # static attribute checks, before anything runs


OPS: dict[str, Op] = {}


def entry(op_type: str, inputs: int | None = None, attributes: bool = False) -> Op | None:
    """What runs a node of ``op_type`` (default domain) with ``inputs`` inputs (None: any count): the op registered
    as exactly that ONNX op (``OpDef.onnx`` naming the type: one node over its operands, no attributes) when the
    node has no attributes, so one registration serves ``nb.export_onnx`` and the importer alike; else this
    table's entry (ONNX ops that are compositions of nabla's, or that take attributes)."""
    if not attributes:
        same = [o for o in ops_registry.as_onnx(op_type) if inputs is None or o.arity == inputs]
        if len(same) == 1:
            return Op(partial(_registered, same[0]))
    return OPS.get(op_type)


def claimed() -> set[str]:
    """The ONNX op types nodes of which nabla.onnx runs (on this nabla: the table's entries whose nabla functions
    exist, and the registered ops' own types)."""
    table = {t for t, e in OPS.items() if all(hasattr(nb, f) for f in e.needs)}
    return table | {o.onnx for o in list(ops_registry.REGISTRY.values()) if isinstance(o.onnx, str)}


def _registered(op: Any, n: Node, *xs: Tensor) -> Tensor:
    return apply(op, xs)


def op(*names: str, needs: tuple[str, ...] = (), check=None):
    def deco(fn):
        for name in names:
            OPS[name] = Op(fn, needs, check)
        return fn
    return deco


# ---- small helpers -----------------------------------------------------------------------------------


def _c(x: Tensor, v) -> Any:
    """``v`` as a scalar of ``x``'s dtype (so it never changes the result dtype)."""
    return x.dtype.type(v)


def _cast(x: Tensor, dtype) -> Tensor:
    return x if x.dtype == np.dtype(dtype) else nb.astype(x, dtype)


def _hi(x: Tensor) -> tuple[Tensor, np.dtype]:
    """Work in float64 (float16/32 compositions then round once, as a kernel would)."""
    return _cast(x, np.float64), x.dtype


def _ints(a: np.ndarray) -> list[int]:
    return [int(v) for v in np.asarray(a).reshape(-1)]


def _axis(n: Node, axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < rank or (rank == 0 and axis not in (0, -1)):
        raise n.fail(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def _take(x: Tensor, axis: int, sl) -> Tensor:
    key = [slice(None)] * x.ndim
    key[axis] = sl
    return x[tuple(key)]
