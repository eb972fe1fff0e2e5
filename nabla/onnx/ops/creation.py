"""Ops that make a tensor from attributes and host values alone: ``Constant``, ``ConstantOfShape`` and
``Range`` (their inputs, if any, are read on the host; nothing comes from a sharded value)."""

from __future__ import annotations

import builtins

import numpy as np

import nabla as nb

from .registry import OPS, Node, Op, _ints, holdable, op


@op("Range")
def _range(n, start, limit, delta):
    s, l, d = (n.scalar(t, w) for t, w in ((start, "start"), (limit, "limit"), (delta, "delta")))
    count = builtins.max(int(np.ceil((l - s) / d)), 0)
    return nb.tensor((s + np.arange(count).astype(s.dtype) * d).astype(s.dtype))


@op("Constant")
def _constant(n):
    a = n.attrs
    if "value" in a:
        v = np.asarray(a["value"])
    elif "value_float" in a:
        v = np.array(a["value_float"], dtype=np.float32)
    elif "value_floats" in a:
        v = np.array(a["value_floats"], dtype=np.float32)
    elif "value_int" in a:
        v = np.array(a["value_int"], dtype=np.int64)
    elif "value_ints" in a:
        v = np.array(a["value_ints"], dtype=np.int64)
    else:
        raise n.fail(f"only tensor, float(s) and int(s) constants are supported, got {sorted(a)}")
    if not holdable(v.dtype):
        raise n.fail(f"constant of dtype {v.dtype} cannot be a nabla tensor")
    return nb.tensor(v)


def _check_constant(n: Node) -> None:
    if not any(k in n.attrs for k in ("value", "value_float", "value_floats", "value_int", "value_ints")):
        raise n.fail(f"only tensor, float(s) and int(s) constants are supported, got {sorted(n.attrs)}")


OPS["Constant"] = Op(_constant, (), _check_constant)


@op("ConstantOfShape")
def _constant_of_shape(n, shape_t):
    shape = tuple(_ints(n.host(shape_t, "input")))
    v = n.attrs.get("value")
    v = np.zeros(1, np.float32) if v is None else np.asarray(v).reshape(-1)
    return nb.tensor(np.full(shape, v[0], dtype=v.dtype))
