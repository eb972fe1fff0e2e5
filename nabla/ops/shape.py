"""Ops that move elements without computing (transpose, reshape, broadcast_to, expand_dims, squeeze,
concatenate; ``swapaxes`` is a transpose): each keeps a sharded dim sharded wherever its factors allow."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..errors import ShardingError
from ..layout import global_rows
from ..opdef import OpDef
from .core import ArrayLike, Tensor, _align, _axes, _call, _is_diff, _ndim, _shape, _unbroadcast
from .creation import zeros
from .registry import onnx_export, register


def _reshape_vjp(g, node, out):
    x = node.args[0]
    return (reshape(g, x._shape),) if _is_diff(x) else (None,)


# ---- transpose -------------------------------------------------------------------------------------------------


def _transpose_kernel(arrays, local):
    G = local.G
    return arrays[0].transpose(tuple(range(G)) + tuple(G + p for p in local.params[0]))


def _transpose_vjp(g, node, out):
    perm = node.params[0]
    inv = tuple(int(i) for i in np.argsort(perm))
    return (transpose(g, inv),) if _is_diff(node.args[0]) else (None,)


@onnx_export("Transpose")
def _transpose_onnx(ex):
    return ex.one("Transpose", cast=False, perm=[int(p) for p in ex.params[0]])


def transpose(x: ArrayLike, axes: Sequence[int] | None = None) -> Tensor:
    n = _ndim(x)
    if axes is None:
        perm = tuple(range(n))[::-1]
    else:
        axes = tuple(axes)
        if len(axes) != n or any(not isinstance(a, (int, np.integer)) or isinstance(a, bool) or not -n <= a < n
                                 for a in axes):
            raise ShardingError(f"transpose: axes {axes} are not a permutation of the {n} dims of shape {_shape(x)}")
        perm = tuple(int(a) % n for a in axes)
    if sorted(perm) != list(range(n)):
        raise ShardingError(f"transpose: axes {axes} are not a permutation of {n} dims")
    return _call(_TRANSPOSE, (x,), (perm,))


def swapaxes(x: ArrayLike, axis1: int, axis2: int) -> Tensor:
    n = _ndim(x)
    a, b = _axes(axis1, n, "swapaxes")[0], _axes(axis2, n, "swapaxes")[0]
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return _call(_TRANSPOSE, (x,), (tuple(perm),))


_TRANSPOSE = register(OpDef("transpose", lambda shapes, perm: R.transpose_rule(shapes[0], perm), _transpose_kernel,
                            "add", dtype="same", vjp=_transpose_vjp, numpy="transpose", onnx=_transpose_onnx, arity=1,
                            public=transpose))


# ---- reshape ---------------------------------------------------------------------------------------------------


def _reshape_kernel(arrays, local):
    x = arrays[0]
    return x.reshape(x.shape[:local.G] + local.out_chunk)


@onnx_export("Reshape")
def _reshape_onnx(ex):
    x = ex.operand(0)
    target = [int(s) for s in ex.params[0]]
    attrs = {"allowzero": 1} if 0 in target else {}
    return ex.finish(ex.out("Reshape", [x, ex.ints(target)], **attrs), [(x, 0)])


def reshape(x: ArrayLike, shape: int | Sequence[int]) -> Tensor:
    """Keeps the sharding wherever the dims split or merge into common factors (sub-axes where needed)."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    src = _shape(x)
    total = 1
    for s in src:
        total *= s
    negative = [s for s in shape if s < 0]
    if len(negative) > 1:
        raise ShardingError(f"reshape: can only specify one unknown dim (-1), got shape {shape} for a tensor "
                            f"of shape {tuple(src)}")
    if negative and negative[0] != -1:  # numpy 2.4 takes any negative as -1 (undocumented); JAX refuses it
        raise ShardingError(f"reshape: negative dim {negative[0]} in shape {shape} for a tensor of shape "
                            f"{tuple(src)}; only -1 (one unknown dim) is allowed")
    if -1 in shape:
        rest = 1
        for s in shape:
            if s != -1:
                rest *= s
        if rest == 0 or total % rest:
            raise ShardingError(f"reshape: cannot reshape size {total} {tuple(src)} into {shape}")
        shape = tuple(total // rest if s == -1 else s for s in shape)
    return _call(_RESHAPE, (x,), (shape,))


_RESHAPE = register(OpDef("reshape", lambda shapes, target: R.reshape_rule(shapes[0], target), _reshape_kernel,
                          "add", dtype="same", vjp=_reshape_vjp, numpy="reshape", onnx=_reshape_onnx, arity=1,
                          public=reshape))


# ---- broadcast_to ----------------------------------------------------------------------------------------------


def _broadcast_kernel(arrays, local):
    x = _align(arrays, local)[0]
    return _xp(x).broadcast_to(x, x.shape[:local.G] + local.out_chunk)


@onnx_export("Expand")
def _broadcast_onnx(ex):
    x = ex.operand(0)
    return ex.finish(ex.out("Expand", [x, ex.ints(ex.params[0])]), [(x, 0)])


def broadcast_to(x: ArrayLike, shape: int | Sequence[int]) -> Tensor:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    return _call(_BROADCAST, (x,), (shape,))


_BROADCAST = register(OpDef("broadcast_to", lambda shapes, target: R.broadcast_to_rule(shapes[0], target),
                            _broadcast_kernel, "add", dtype="same",
                            vjp=lambda g, node, out: (_unbroadcast(g, node.args[0]),), numpy="broadcast_to",
                            onnx=_broadcast_onnx, arity=1, public=broadcast_to))


# ---- expand_dims, squeeze ---------------------------------------------------------------------------------------


def _expand_kernel(arrays, local):
    return arrays[0].reshape(arrays[0].shape[:local.G] + local.out_chunk)


def _unit_dims_onnx(op_type: str):
    """Unsqueeze or Squeeze over the op's axes (Identity for none)."""
    @onnx_export(op_type)
    def export(ex):
        x = ex.operand(0)
        axes = tuple(ex.params[0])
        if not axes:
            return ex.finish(ex.out("Identity", [x]), [(x, 0)])
        return ex.finish(ex.out(op_type, [x, ex.ints(axes, "axes")]), [(x, 0)])
    return export


def expand_dims(x: ArrayLike, axis: int | Sequence[int]) -> Tensor:
    n = _ndim(x)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = _axes(axes, n + len(axes), "expand_dims")
    return _call(_EXPAND, (x,), (axes,))


def squeeze(x: ArrayLike, axis: int | Sequence[int] | None = None) -> Tensor:
    shape = _shape(x)
    axes = tuple(d for d, s in enumerate(shape) if s == 1) if axis is None else _axes(axis, len(shape), "squeeze")
    for a in axes:
        if shape[a] != 1:
            raise ShardingError(f"squeeze: dim {a} has size {shape[a]}, not 1")
    return _call(_SQUEEZE, (x,), (axes,))


_EXPAND = register(OpDef("expand_dims", lambda shapes, axes: R.expand_dims_rule(shapes[0], axes), _expand_kernel,
                         "add", dtype="same", vjp=_reshape_vjp, numpy="expand_dims",
                         onnx=_unit_dims_onnx("Unsqueeze"), arity=1, public=expand_dims))
_SQUEEZE = register(OpDef("squeeze", lambda shapes, axes: R.squeeze_rule(shapes[0], axes), _expand_kernel, "add",
                          dtype="same", vjp=_reshape_vjp, numpy="squeeze", onnx=_unit_dims_onnx("Squeeze"), arity=1,
                          public=squeeze))


# ---- concatenate -----------------------------------------------------------------------------------------------


def _concat_kernel(arrays, local):
    G = local.G
    xp = _xp(*arrays)
    axis = local.params[0]
    if not local.windowed:
        return xp.concatenate(arrays, axis=axis)
    # each operand's block is already its window into the result's rows (padding elsewhere): pick, per row,
    # the operand that owns it; `rows` holds the global result row of every local row
    rows, offsets = local.aux
    out = arrays[-1]
    for j in range(len(arrays) - 2, -1, -1):
        out = xp.where((rows >= offsets[j]) & (rows < offsets[j + 1]), arrays[j], out)
    return out


def _concat_aux(spec, cuts, shapes, params):
    axis = params[0]
    offsets = tuple(int(o) for o in np.cumsum([0] + [s[axis] for s in shapes]))
    return global_rows(spec, cuts, offsets[-1], axis, len(shapes[0])), offsets


def _concat_vjp(g, node, out):
    axis = node.params[0]
    grads, off = [], 0
    for x in node.args:
        n = _shape(x)[axis]
        if _is_diff(x):
            grads.append(g[(slice(None),) * axis + (slice(off, off + n),)])
        else:
            grads.append(None)
        off += n
    return tuple(grads)


@onnx_export("Concat")
def _concat_onnx(ex):
    return ex.one("Concat", axis=int(ex.params[0]))


def concatenate(tensors: Sequence[ArrayLike], axis: int = 0) -> Tensor:
    """A sharded joined dim stays sharded: each device receives only the rows of its result block it lacks."""
    tensors = list(tensors)
    if not tensors:
        raise ShardingError("concatenate: needs at least one operand")
    return _call(_CONCAT, tensors, (_axes(axis, _ndim(tensors[0]), "concatenate")[0],))


_CONCAT = register(OpDef("concatenate", lambda shapes, axis: R.concatenate_rule(tuple(shapes), axis), _concat_kernel,
                         "add", aux=_concat_aux, vjp=_concat_vjp, numpy="concatenate", onnx=_concat_onnx,
                         public=concatenate))


# ---- transposes of slicing (the VJPs of getitem and the windowed ops use them) -------------------------------------


def _pad_dim(g: Tensor, axis: int, before: int, after: int) -> Tensor:
    """Zeros around ``g`` along ``axis`` (a concatenate: a sharded dim stays sharded)."""
    parts = []
    shape = list(g.shape)
    if before:
        shape[axis] = before
        parts.append(zeros(tuple(shape), g.dtype))
    parts.append(g)
    if after:
        shape[axis] = after
        parts.append(zeros(tuple(shape), g.dtype))
    return g if len(parts) == 1 else concatenate(parts, axis)


def _scatter_slice(g: Tensor, axis: int, n: int, start: int, step: int) -> Tensor:
    """The transpose of ``x[start::step]`` along ``axis`` (``step > 0``): each row back at its place, zeros
    between (rows spread by stacking zeros beside them and merging), zeros around."""
    m = g.shape[axis]
    if m == 0:
        shape = list(g.shape)
        shape[axis] = n
        return zeros(tuple(shape), g.dtype)
    if step > 1:
        wide = list(g.shape)
        wide.insert(axis + 1, step - 1)
        spread = concatenate([expand_dims(g, axis + 1), zeros(tuple(wide), g.dtype)], axis + 1)
        merged = list(g.shape)
        merged[axis] = m * step
        g = reshape(spread, tuple(merged))
        g = g[(slice(None),) * axis + (slice(0, (m - 1) * step + 1),)]
    span = (m - 1) * step + 1
    return _pad_dim(g, axis, start, n - start - span)


for _moving in (_TRANSPOSE, _RESHAPE, _BROADCAST, _EXPAND, _SQUEEZE, _CONCAT,):  # data moves, nothing is computed: no FLOPs
    _moving.flops = lambda blocks, out, params: 0
