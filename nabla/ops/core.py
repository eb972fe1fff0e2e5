"""The plumbing every op family shares: operands checked and wrapped, ops run through the executor, kernel
blocks aligned by rank, argument normalisers, and the cotangent helpers the VJPs use."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from ..dtypes import is_float, is_inexact
from ..collectives import logging as _logging, user_op as _user_op
from ..errors import ShardingError
from ..executor import run
from ..step import SCALARS
from ..trace import link_of, linked_any
from ..value import Value
from ..args import short_repr
from ..opdef import Local, OpDef
from ..tensor import Tensor
from ..spec import DimSpec, ShardingSpec

ArrayLike = Any  # a Tensor, a numpy array, or a Python scalar


def _arg(x: Any, op: str, i: int) -> Any:
    if isinstance(x, Value):
        return x
    if isinstance(x, SCALARS) and not isinstance(x, np.ndarray):
        return x
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - reported as the op's error
        raise ShardingError(f"{op}: operand {i} of type {type(x).__name__} is not array-like ({e})") from None
    if a.dtype.kind not in "biufc" and not is_inexact(a.dtype):  # (bfloat16 and the float8s are kind V)
        raise ShardingError(f"{op}: operand {i} ({type(x).__name__} of dtype {a.dtype}) is not a numeric array")
    if a.flags.writeable:  # the caller may change their array later; the result must not change with it
        a = a.copy()
        a.flags.writeable = False
    return Value(a, None, a.shape, a.dtype)


def _named(fn):
    """The collectives a composite op runs are logged under its own name (softmax, not max and divide), and the
    nodes it records carry it; with no log open and no traced operand nothing is logged or recorded, and the name
    is not set."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if not _logging() and _untraced(args) and (not kwargs or _untraced(kwargs.values())):
            return fn(*args, **kwargs)
        with _user_op(fn.__name__):
            return fn(*args, **kwargs)
    return wrapped


_PLAIN = (int, float, bool, str, type(None), np.ndarray)


def _untraced(args: Any) -> bool:
    """Whether no node can be made of these arguments: each a value recording none, or a plain Python scalar or
    numpy array (a container might hold a traced value: not looked into)."""
    for a in args:
        if not isinstance(a, Value) and type(a) not in _PLAIN:
            return False
    return not linked_any(args)


def apply(op: OpDef, args: Sequence[Any], params: tuple = ()) -> Tensor:
    vals, floats = args, False
    for a in args:  # (values and Python numbers, the common calls, are passed on as they are)
        if not isinstance(a, Value):
            if type(a) is float:
                floats = True
            elif type(a) is not int:
                vals = [a if isinstance(a, Value) else _arg(a, op.name, i) for i, a in enumerate(args)]
                break
    if op.arrange is not None:
        vals = list(op.arrange(vals, params))
    if (floats or vals is not args) and len(vals) > 1:
        for v in vals:
            if type(v) is float:
                vals = _weak(vals)
                break
    return run(op, vals, params, Tensor)


def _weak(vals: list) -> list:
    """A Python float beside a bfloat16 or float8 tensor takes its dtype, as NEP 50's weak scalars do: numpy keeps
    ``float16 * 1.5`` float16 and ints beside bfloat16 bfloat16, but (ml_dtypes registering no weak promotion)
    makes ``bfloat16 * 1.5`` float32 and ``where(c, bfloat16, 0.0)`` float64; jax.numpy keeps bfloat16."""
    for v in vals:
        if isinstance(v, Value) and v._dtype.kind == "V":
            break
    else:  # no bfloat16 or float8 (kind V) operand: numpy's promotion is NEP 50's
        return vals
    common = np.result_type(*[v._dtype for v in vals if isinstance(v, Value)])
    if common.kind != "V" or not is_float(common):
        return vals
    return [common.type(v) if type(v) is float else v for v in vals]


def _align(arrays: list, local: Local) -> list:
    """Give every block the result's rank (singletons after the grid axes) so numpy broadcasts by dim."""
    rank = len(local.out_chunk)
    if all(getattr(a, "ndim", -1) == local.G + rank for a in arrays):
        return arrays
    out = []
    for a in arrays:
        if hasattr(a, "ndim") and not isinstance(a, np.generic) and a.ndim - local.G < rank:
            a = a.reshape(a.shape[:local.G] + (1,) * (rank - a.ndim + local.G) + a.shape[local.G:])
        out.append(a)
    return out


def _ndim(x) -> int:
    return len(x._shape) if isinstance(x, Value) else np.ndim(x)


def _shape(x) -> tuple[int, ...]:
    return x._shape if isinstance(x, Value) else np.shape(x)


def _axes(axis, ndim: int, op: str) -> tuple[int, ...]:
    if type(axis) is int and 0 < ndim and -ndim <= axis < ndim:  # the common call, checked in one line
        return (axis % ndim,)
    if axis is None:
        return tuple(range(ndim))
    if ndim == 0 and isinstance(axis, (int, np.integer)) and not isinstance(axis, (bool, np.bool_)) and axis in (0, -1):
        return ()  # numpy lets a 0-d array be reduced over an int axis 0 (or -1): nothing to reduce
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, (bool, np.bool_)):
        axes = (axis,)
    elif isinstance(axis, (tuple, list)):
        axes = tuple(axis)
    else:  # numpy raises TypeError here; nabla's errors about op arguments are ShardingErrors (ValueErrors)
        raise ShardingError(f"{op}: axis must be None, an int or a tuple of ints, got {type(axis).__name__} "
                            f"{short_repr(axis)}")
    out = []
    for a in axes:
        if not isinstance(a, (int, np.integer)) or isinstance(a, (bool, np.bool_)):
            raise ShardingError(f"{op}: axis {short_repr(axis)} holds {type(a).__name__} {short_repr(a)}; axes are ints")
        if not -ndim <= a < ndim:
            raise ShardingError(f"{op}: axis {a} is out of range for a tensor of rank {ndim}")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ShardingError(f"{op}: repeated axis in {axis}")
    return tuple(sorted(out))


# ---- cotangents (VJPs are written with nabla ops: the backward pass shards like any code) ----------------------


def _is_diff(x: Any) -> bool:
    """Whether ``x`` needs a cotangent: a float or complex value that depends on a traced one."""
    return isinstance(x, Value) and getattr(link_of(x), "diff", False) and is_inexact(x._dtype)


def _laid_like(t: Tensor, x: Any) -> Tensor:
    """``t`` (a cotangent broadcast back to primal ``x``'s shape, held whole) laid out as ``x`` is: each device
    keeps its block (a local cut, nothing moves), so the backward ops that read it run on blocks, not on the whole
    value on every device. Left as it is where ``x`` is not sharded, or where ``t`` already is."""
    spec, own = t.sharding, getattr(x, "_spec", None)
    if spec is None or own is None or not hasattr(own, "dim_refs") or spec.mesh != own.mesh or \
            t.shape != tuple(x._shape) or any(d.axes for d in spec.dim_specs) or \
            not any(d.axes for d in own.dim_specs):
        return t
    used = {r for refs in own.dim_refs for r in refs}
    if any(r.overlaps(u) for r in spec.partial_refs for u in used):
        return t  # its pending sum lies on the axes x's dims use: summing it here would be a reduce_scatter
    dims = [DimSpec(d.axes, is_open=True) for d in own.dim_specs]
    return t.with_sharding(ShardingSpec(own.mesh, dims, partial_axes=spec.partial_axes))


def _mask(cond: Tensor, like: Any) -> Tensor:
    """``cond`` as 0/1 in the cotangent's dtype."""
    dt = like._dtype if isinstance(like, Value) and is_inexact(like._dtype) else np.dtype(np.float64)
    return cond.astype(dt)
