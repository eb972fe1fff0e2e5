"""Ops that move elements without computing (transpose, reshape, broadcast_to, expand_dims, squeeze,
concatenate; ``swapaxes`` is a transpose): each keeps a sharded dim sharded wherever its factors allow."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..errors import ShardingError
from ..layout import global_rows
from ..opdef import OpDef
from ..value import Value
from .core import ArrayLike, Tensor, _align, _axes, apply, _is_diff, _ndim, _shape
from .creation import tensor, zeros
from .registry import _unbroadcast, onnx_export, register


def _reshape_vjp(g, node, out):
    x = node.args[0]
    return (reshape(g, x._shape),) if _is_diff(x) else (None,)


# ---- transpose -------------------------------------------------------------------------------------------------


def _transpose_kernel(arrays, local):
    return arrays[0].transpose(_grid_perm(local.G, local.params[0]))


@functools.lru_cache(maxsize=1024)
def _grid_perm(G: int, perm: tuple[int, ...]) -> tuple[int, ...]:
    """``perm`` on the blocks, the grid axes in front kept in place (made once per layout and permutation)."""
    return tuple(range(G)) + tuple(G + p for p in perm)


@functools.lru_cache(maxsize=64)
def _reversed(n: int) -> tuple[int, ...]:
    return tuple(range(n))[::-1]


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
        perm = _reversed(n)  # (a permutation)
    else:
        axes = tuple(axes)
        if len(axes) != n or any(not isinstance(a, (int, np.integer)) or isinstance(a, bool) or not -n <= a < n
                                 for a in axes):
            raise ShardingError(f"transpose: axes {axes} are not a permutation of the {n} dims of shape {_shape(x)}")
        perm = tuple(int(a) % n for a in axes)
        if sorted(perm) != list(range(n)):
            raise ShardingError(f"transpose: axes {axes} are not a permutation of {n} dims")
    return apply(_TRANSPOSE, (x,), (perm,))


def swapaxes(x: ArrayLike, axis1: int, axis2: int) -> Tensor:
    n = _ndim(x)
    a, b = _axes(axis1, n, "swapaxes")[0], _axes(axis2, n, "swapaxes")[0]
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return apply(_TRANSPOSE, (x,), (tuple(perm),))


_TRANSPOSE = register(OpDef("transpose", lambda shapes, perm: R.transpose_rule(shapes[0], perm), _transpose_kernel,
                            "add", dtype="same", vjp=_transpose_vjp, numpy="transpose", onnx=_transpose_onnx, arity=1,
                            public=transpose, saves="none", view=True))


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
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
    if not shape or min(shape) >= 0:  # the common call: every dim given
        return apply(_RESHAPE, (x,), (shape,))
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
    return apply(_RESHAPE, (x,), (shape,))


_RESHAPE = register(OpDef("reshape", lambda shapes, target: R.reshape_rule(shapes[0], target), _reshape_kernel,
                          "add", dtype="same", vjp=_reshape_vjp, numpy="reshape", onnx=_reshape_onnx, arity=1,
                          public=reshape, saves="none", view=True))


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
    return apply(_BROADCAST, (x,), (shape,))


_BROADCAST = register(OpDef("broadcast_to", lambda shapes, target: R.broadcast_to_rule(shapes[0], target),
                            _broadcast_kernel, "add", dtype="same",
                            vjp=lambda g, node, out: (_unbroadcast(g, node.args[0]),), numpy="broadcast_to",
                            onnx=_broadcast_onnx, arity=1, public=broadcast_to, saves="none"))
# (not a view: XLA materialises a broadcast a matmul reads or a program returns; one read only by elementwise ops,
# reductions and moves is fused into them, and the memory log counts it so: ``plan.memory.fused_broadcasts``)


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
    return apply(_EXPAND, (x,), (axes,))


def squeeze(x: ArrayLike, axis: int | Sequence[int] | None = None) -> Tensor:
    shape = _shape(x)
    axes = tuple(d for d, s in enumerate(shape) if s == 1) if axis is None else _axes(axis, len(shape), "squeeze")
    for a in axes:
        if shape[a] != 1:
            raise ShardingError(f"squeeze: dim {a} has size {shape[a]}, not 1")
    return apply(_SQUEEZE, (x,), (axes,))


_EXPAND = register(OpDef("expand_dims", lambda shapes, axes: R.expand_dims_rule(shapes[0], axes), _expand_kernel,
                         "add", dtype="same", vjp=_reshape_vjp, numpy="expand_dims",
                         onnx=_unit_dims_onnx("Unsqueeze"), arity=1, public=expand_dims, saves="none",
                         view=True))
_SQUEEZE = register(OpDef("squeeze", lambda shapes, axes: R.squeeze_rule(shapes[0], axes), _expand_kernel, "add",
                          dtype="same", vjp=_reshape_vjp, numpy="squeeze", onnx=_unit_dims_onnx("Squeeze"), arity=1,
                          public=squeeze, saves="none", view=True))


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
    return apply(_CONCAT, tensors, (_axes(axis, _ndim(tensors[0]), "concatenate")[0],))


_CONCAT = register(OpDef("concatenate", lambda shapes, axis: R.concatenate_rule(tuple(shapes), axis), _concat_kernel,
                         "add", aux=_concat_aux, vjp=_concat_vjp, numpy="concatenate", onnx=_concat_onnx,
                         public=concatenate, saves="none"))


# ---- flip, roll, pad, split, stack -------------------------------------------------------------------------

_INT64_MIN = -(2 ** 63)


def _flip_kernel(arrays, local):
    x = arrays[0]
    axes = tuple(local.G + a for a in local.params[0])
    return _xp(x).flip(x, axis=axes) if axes else x


@onnx_export("Slice")
def _flip_onnx(ex):
    axes = ex.params[0]
    x = ex.operand(0)
    n = len(axes)
    return ex.finish(ex.out("Slice", [x, ex.ints([-1] * n, "starts"), ex.ints([_INT64_MIN] * n, "ends"),
                                      ex.ints(axes, "axes"), ex.ints([-1] * n, "steps")]), [(x, 0)])


def flip(x: ArrayLike, axis: int | Sequence[int] | None = None) -> Tensor:
    """Reverse the order of elements along ``axis`` (all dims when None), as numpy's ``flip``. A sharded dim
    keeps its sharding: block ``p`` of the result is block ``k-1-p`` of ``x`` reversed, so each device sends its
    block to its mirror (one collective_permute; an uneven dim is first laid out evenly)."""
    axes = _axes(axis, _ndim(x), "flip")
    return apply(_FLIP, (x,), (axes,)) if axes else _as_tensor(x)


def _flip_rule(shape, axes):
    return R.index_rule(shape, tuple(("reverse",) if d in axes else ("full",) for d in range(len(shape))))


_FLIP = register(OpDef("flip", lambda shapes, axes: _flip_rule(shapes[0], axes), _flip_kernel, "add", dtype="same",
                       vjp=lambda g, node, out: (flip(g, node.params[0]),) if _is_diff(node.args[0]) else (None,),
                       numpy="flip", onnx=_flip_onnx, arity=1, public=flip, saves="none"))


def _roll_kernel(arrays, local):
    axis, shift = local.params
    if not local.windowed:  # the whole dim (a host value)
        return _xp(arrays[0]).roll(arrays[0], shift, axis)
    rows = local.aux[0]  # each operand's block is its window: rows from the first operand at and past `shift`
    return _xp(*arrays).where(rows >= shift, arrays[0], arrays[1])


def _roll_aux(spec, cuts, shapes, params):
    axis = params[0]
    return (global_rows(spec, cuts, shapes[0][axis], axis, len(shapes[0])),)


def _roll_vjp(g, node, out):
    axis, shift = node.params
    return (roll(g, -shift, axis) if _is_diff(node.args[0]) else None, None)


@onnx_export("Slice", "Concat")
def _roll_onnx(ex):
    axis, shift = ex.params
    x = ex.operand(0)
    n = ex.args[0]._shape[axis]
    tail = ex.emit("Slice", [x, ex.ints([n - shift], "starts"), ex.ints([n], "ends"), ex.ints([axis], "axes")], "tail")
    head = ex.emit("Slice", [x, ex.ints([0], "starts"), ex.ints([n - shift], "ends"), ex.ints([axis], "axes")], "head")
    return ex.finish(ex.out("Concat", [tail, head], axis=int(axis)), [(x, 0)])


def roll(x: ArrayLike, shift: int | Sequence[int], axis: int | Sequence[int] | None = None) -> Tensor:
    """Shift elements along ``axis`` cyclically, as numpy's ``roll`` (``axis`` None: over the flattened tensor,
    then reshaped back; a tuple of shifts and axes rolls each in turn). A sharded dim keeps its sharding: each
    device receives only the rows of its result block that another device holds, one collective_permute per
    round of senders (a shift of a whole number of blocks moves each block to the device ``shift / block`` to
    its right); nothing is gathered."""
    if axis is None:
        shape = _shape(x)
        return reshape(roll(reshape(x, (-1,)), shift, 0), shape)
    shifts = (shift,) if isinstance(shift, (int, np.integer)) else tuple(shift)
    axes_in = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    if len(shifts) == 1 and len(axes_in) > 1:
        shifts = shifts * len(axes_in)
    if len(axes_in) == 1 and len(shifts) > 1:
        axes_in = axes_in * len(shifts)
    if len(shifts) != len(axes_in):
        raise ShardingError(f"roll: shift {shift!r} and axis {axis!r} must have the same length")
    out = x
    for s, a in zip(shifts, axes_in):
        if not isinstance(s, (int, np.integer)) or isinstance(s, (bool, np.bool_)):
            raise ShardingError(f"roll: shift must be an int or a tuple of ints, got {shift!r}")
        ax = _axes(a, _ndim(x), "roll")[0]
        n = _shape(x)[ax]
        if n and int(s) % n:
            out = apply(_ROLL, (out, out), (ax, int(s) % n))
    return _as_tensor(out)


_ROLL = register(OpDef("roll", lambda shapes, axis, shift: R.roll_rule(shapes[0], axis, shift), _roll_kernel, "add",
                       dtype="same", aux=_roll_aux, vjp=_roll_vjp, numpy="roll", onnx=_roll_onnx, public=roll,
                       saves="none"))


def _pad_kernel(arrays, local):
    if local.windowed:  # every padded dim's block is already its window, padding filled
        return arrays[0]
    widths, fill = local.params
    return _xp(arrays[0]).pad(arrays[0], widths, constant_values=np.asarray(fill).astype(arrays[0].dtype))


def _pad_vjp(g, node, out):
    x = node.args[0]
    if not _is_diff(x):
        return (None,)
    widths = node.params[0]
    return (g[tuple(slice(lo, lo + n) for (lo, _), n in zip(widths, x._shape))],)


@onnx_export("Pad")
def _pad_onnx(ex):
    widths, fill = ex.params
    x = ex.operand(0)
    pads = [lo for lo, _ in widths] + [hi for _, hi in widths]
    value = ex.b.constant(np.asarray(fill).astype(ex.dtype), base="fill")
    return ex.finish(ex.out("Pad", [x, ex.ints(pads, "pads"), value], mode="constant"), [(x, 0)])


def _widths(pad_width, n: int, what: str) -> tuple[tuple, ...]:
    """numpy's ways of giving a pair per dim: ``k``, ``(k,)``, ``(lo, hi)``, ``((lo, hi),)`` or one pair per dim."""
    a = np.asarray(pad_width, dtype=object)
    try:
        pairs = np.broadcast_to(a, (n, 2)) if a.ndim <= 2 else None
    except ValueError:
        pairs = None
    if pairs is None:
        raise ShardingError(f"pad: {what} {pad_width!r} cannot be read as one (before, after) pair per dim of "
                            f"{n} dims")
    return tuple((pairs[d, 0], pairs[d, 1]) for d in range(n))


def pad(x: ArrayLike, pad_width, mode: str = "constant", constant_values=0) -> Tensor:
    """Pad with a constant, as numpy's ``pad`` in ``"constant"`` mode (the only mode). A padded sharded dim stays
    sharded: the result's rows are split over the same devices, and each device receives only the rows of its
    result block that another device holds (none when the padding is at the end and fills the last blocks).
    Padding with 0 is linear (a pending sum stays pending); another constant sums it first."""
    if mode != "constant":
        raise ShardingError(f"pad: mode {mode!r} is not supported; only mode='constant'")
    shape = _shape(x)
    n = len(shape)
    widths = _widths(pad_width, n, "pad_width")
    for d, (lo, hi) in enumerate(widths):
        for w in (lo, hi):
            if not isinstance(w, (int, np.integer)) or isinstance(w, (bool, np.bool_)):
                raise ShardingError(f"pad: pad_width must hold ints, got {w!r} for dim {d}")
            if w < 0:
                raise ShardingError(f"pad: dim {d}: pad widths must be >= 0, got ({lo}, {hi})")
    widths = tuple((int(lo), int(hi)) for lo, hi in widths)
    # each side's constant as numpy writes it into the padding (cast, or refused, as numpy's pad does it): read
    # back from a tiny array numpy pads
    dt = x._dtype if isinstance(x, Value) else np.asarray(x).dtype
    tiny = np.pad(np.zeros((1,) * n, dt), [(1, 1)] * n, constant_values=constant_values)
    values = [[tiny[(1,) * d + (2 * j,) + (1,) * (n - d - 1)] for j in range(2)] for d in range(n)]
    sides = {values[d][j].item() for d in range(n) for j in range(2) if widths[d][j]}
    if len(sides) > 1:  # different constants: pad one dim and side at a time
        out = x
        for d in range(n):
            for j in range(2):
                if widths[d][j]:
                    w = [(0, 0)] * n
                    w[d] = (0, widths[d][j]) if j else (widths[d][j], 0)
                    out = pad(out, w, constant_values=values[d][j])
        return out
    if not sides:
        return _as_tensor(x)
    fill = sides.pop()
    spec = x._spec if isinstance(x, Value) else None
    if fill != 0 and spec is not None and spec.partial_axes:  # padding is not linear in x: sum first
        x = x.with_sharding(spec.mesh, spec.dim_specs, spec.replicated_axes)
    return apply(_PAD, (x,), (widths, fill))


_PAD = register(OpDef("pad", lambda shapes, widths, fill: R.pad_rule(shapes[0], widths, fill),
                      _pad_kernel, "add", dtype="same", vjp=_pad_vjp, numpy="pad", onnx=_pad_onnx, arity=1,
                      public=pad, saves="none"))


def split(x: ArrayLike, indices_or_sections, axis: int = 0) -> list[Tensor]:
    """numpy's ``split``: ``N`` equal pieces (an error when the dim does not divide), or the pieces between the
    given indices. Each piece is a forward slice: a sharded dim stays sharded and each device receives only
    the rows of its piece's block that another device holds."""
    shape = _shape(x)
    ax = _axes(axis, len(shape), "split")[0]
    n = shape[ax]
    if isinstance(indices_or_sections, (int, np.integer)) and not isinstance(indices_or_sections, (bool, np.bool_)):
        k = int(indices_or_sections)
        if k <= 0:
            raise ShardingError(f"split: number sections must be larger than 0, got {k}")
        if n % k:
            raise ShardingError(f"split: array split does not result in an equal division: dim {ax} of size {n} "
                                f"into {k} sections")
        cuts = [n // k * i for i in range(1, k)]
    else:
        cuts = [int(i) for i in indices_or_sections]
    bounds = [0] + cuts + [n]
    pre = (slice(None),) * ax
    x = _as_tensor(x)
    return [x[pre + (slice(a, b),)] for a, b in zip(bounds, bounds[1:])]


def stack(arrays: Sequence[ArrayLike], axis: int = 0) -> Tensor:
    """numpy's ``stack``: a new dim at ``axis``, one entry per tensor (each given the new dim, then joined: a
    sharded dim of the operands stays sharded)."""
    arrays = list(arrays)
    if not arrays:
        raise ShardingError("stack: needs at least one array")
    shapes = {tuple(_shape(a)) for a in arrays}
    if len(shapes) > 1:
        raise ShardingError(f"stack: all input arrays must have the same shape, got {sorted(shapes)}")
    ax = _axes(axis, _ndim(arrays[0]) + 1, "stack")[0]
    return concatenate([expand_dims(a, ax) for a in arrays], ax)


def _as_tensor(x: ArrayLike) -> Tensor:
    return x if isinstance(x, Tensor) else tensor(x)


# ---- transposes of slicing (the VJPs of getitem and the windowed ops use them) -------------------------------------


def _pad_dim(g: Tensor, axis: int, before: int, after: int) -> Tensor:
    """Zeros around ``g`` along ``axis`` (a ``pad``: a sharded dim stays sharded, and the zeros are made where
    they belong, not sent)."""
    if not before and not after:
        return g
    widths = [(0, 0)] * g.ndim
    widths[axis] = (before, after)
    return pad(g, widths)


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


for _moving in (_TRANSPOSE, _RESHAPE, _BROADCAST, _EXPAND, _SQUEEZE, _CONCAT, _FLIP, _ROLL, _PAD):  # data moves, nothing is computed: no FLOPs
    _moving.flops = lambda blocks, out, params: 0
