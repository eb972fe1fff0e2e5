"""Windowed ops (conv, max_pool, avg_pool; global_avg_pool, batch_norm and layer_norm built from others): batch
and channels pass through, a sharded spatial dim stays sharded and each device receives only the halo rows its
windows read. Their VJPs slice each window tap (a window op itself), so the backward pass exchanges halos too."""

from __future__ import annotations

from typing import Any

from math import prod

import numpy as np

from ..dtypes import is_inexact
from .. import rules as R
from .. import windows as _windows
from ..backends import xp as _xp
from ..errors import ShardingError
from ..rules.elementwise import broadcast_shapes
from ..layout import grid
from ..opdef import OpDef
from ..windows import out_size
from .core import ArrayLike, Tensor, _align, _axes, apply, _is_diff, _named, _ndim, _shape
from .contraction import einsum
from .creation import full, tensor
from .indexing import getitem
from .pointwise import add, astype, divide, equal, multiply, sqrt, subtract, where
from .reduction import mean
from .registry import _unbroadcast, onnx_export, register
from .shape import _pad_dim, _scatter_slice, concatenate, expand_dims, reshape


def per_dim(v: Any, nd: int, what: str, op: str) -> tuple[int, ...]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = (int(v),) * nd
    try:
        v = tuple(int(i) for i in v)
    except (TypeError, ValueError):
        raise ShardingError(f"{op}: {what} must be an int or {nd} ints, got {v!r}") from None
    if len(v) != nd or any(i < 1 for i in v):
        raise ShardingError(f"{op}: {what} needs {nd} ints >= 1 (one per spatial dim), got {v}")
    return v


def spatial_pads(padding: Any, nd: int, op: str) -> tuple[tuple[int, int], ...]:
    """An int, one int per spatial dim, or one (before, after) pair per spatial dim."""
    if isinstance(padding, (int, np.integer)) and not isinstance(padding, bool):
        out = ((int(padding), int(padding)),) * nd
    else:
        try:
            items = list(padding)
            if len(items) == nd and all(isinstance(p, (int, np.integer)) for p in items):
                out = tuple((int(p), int(p)) for p in items)
            else:
                out = tuple((int(a), int(b)) for a, b in items)
        except (TypeError, ValueError):
            raise ShardingError(f"{op}: padding must be an int, {nd} ints or {nd} (before, after) pairs, "
                                f"got {padding!r}") from None
    if len(out) != nd or any(a < 0 or b < 0 for a, b in out):
        raise ShardingError(f"{op}: padding needs {nd} non-negative (before, after) pairs, got {padding!r}")
    return out


def pad_spatial(x, pads, fill, G: int = 0):
    """Host path (no window factors ran): pad the spatial dims as the op asks."""
    if not any(a or b for a, b in pads):
        return x
    widths = [(0, 0)] * (G + 2) + list(pads)
    return _xp(x).pad(x, widths, constant_values=_windows.fill_value(fill, x.dtype))


def _taps(kernel, stride, dilation, outs):
    """Per kernel tap, the index key of the strided slice of the padded input that it reads."""
    for tap in np.ndindex(*kernel):
        yield tap, (slice(None), slice(None)) + tuple(
            slice(t * d, t * d + (o - 1) * s + 1, s) for t, d, o, s in zip(tap, dilation, outs, stride))


def _padded(x, pads, fill=0.0):
    for i, (lo, hi) in enumerate(pads):
        if lo or hi:
            if fill == 0.0:
                x = _pad_dim(x, 2 + i, lo, hi)
            else:
                shape = list(x.shape)
                parts = []
                for n in (lo, hi):
                    shape[2 + i] = n
                    parts.append(full(tuple(shape), fill, x.dtype) if n else None)
                x = concatenate([p for p in (parts[0], x, parts[1]) if p is not None], 2 + i)
    return x


def _unpad(g, pads, shape):
    key = (slice(None), slice(None)) + tuple(slice(lo, lo + n) for (lo, _), n in zip(pads, shape[2:]))
    return getitem(g, key)


def _scatter_taps(parts, shape, pads, stride, dilation, outs):
    """Sum the cotangents of the window taps back into the (unpadded) input."""
    padded = tuple(n + lo + hi for n, (lo, hi) in zip(shape[2:], pads))
    total = None
    for tap, part in parts:
        g = part
        for i, (t, d, s, n) in enumerate(zip(tap, dilation, stride, padded)):
            g = _scatter_slice(g, 2 + i, n, t * d, s)
        total = g if total is None else add(total, g)
    return _unpad(total, pads, shape)


def onnx_pads(pads) -> list[int]:
    """nabla's (before, after) per spatial dim -> ONNX's begins then ends."""
    return [int(lo) for lo, _ in pads] + [int(hi) for _, hi in pads]


# ---- convolution -------------------------------------------------------------------------------------------


def _conv_kernel(arrays, local):
    x, w = arrays
    stride, padding, dilation, groups = local.params
    if not local.windowed:
        x = pad_spatial(x, padding, 0)
    G = local.G
    # a sharded group factor leaves each device its own groups: as many as its channels hold
    return _windows.conv(x, w, G, stride, dilation, x.shape[G + 1] // w.shape[G + 1])


def _conv_vjp(g, node, out):
    x, w = node.args
    stride, pads, dilation, groups = node.params
    kernel = _shape(w)[2:]
    outs = g.shape[2:]
    N, C = _shape(x)[:2]
    O, Cg = _shape(w)[:2]
    og = O // groups
    gg = reshape(g, (N, groups, og) + outs)
    gx = gw = None
    if _is_diff(w):
        xp = _padded(x, pads)
        cols = [reshape(getitem(xp, key), (N, groups, Cg) + outs) for _, key in _taps(kernel, stride, dilation, outs)]
        letters = "".join("stuv"[:len(outs)])
        per_tap = [einsum(f"ngc{letters},ngo{letters}->goc", c, gg) for c in cols]
        gw = reshape(concatenate([expand_dims(t, -1) for t in per_tap], -1), (O, Cg) + tuple(kernel))
        gw = gw if gw.dtype == w._dtype else astype(gw, w._dtype)
    if _is_diff(x):
        wg = reshape(w, (groups, og, Cg, -1))
        letters = "".join("stuv"[:len(outs)])
        parts = []
        for j, (tap, _) in enumerate(_taps(kernel, stride, dilation, outs)):
            part = einsum(f"ngo{letters},goc->ngc{letters}", gg, getitem(wg, (slice(None),) * 3 + (j,)))
            parts.append((tap, reshape(part, (N, C) + outs)))
        gx = _scatter_taps(parts, _shape(x), pads, stride, dilation, outs)
        gx = gx if gx.dtype == x._dtype else astype(gx, x._dtype)
    return gx, gw


@onnx_export("Conv", "Cast")
def _conv_onnx(ex):
    """Conv, in float32 for bfloat16 (ONNX's Conv takes none), rounded once."""
    stride, pads, dilation, groups = ex.params
    work = ex.carrier("Conv")
    x, w = ex.operand(0, work), ex.operand(1, work)
    kernel = [int(k) for k in ex.args[1]._shape[2:]]
    return ex.finish(ex.out_as(work, "Conv", [x, w], strides=list(stride), pads=onnx_pads(pads),
                               dilations=list(dilation), group=int(groups), kernel_shape=kernel), [(x, 0), (w, 1)])


@_named
def conv(x: ArrayLike, w: ArrayLike, bias: ArrayLike | None = None, stride: Any = 1, padding: Any = 0,
         dilation: Any = 1, groups: int = 1) -> Tensor:
    """N-d convolution (cross-correlation) in ONNX's layout: ``x (N, C, *spatial)``, ``w (O, C/groups,
    *kernel)``. Batch and output channels pass through; sharded input channels give partial sums; a sharded
    spatial dim stays sharded, each device receiving only the halo rows its windows read."""
    nd = _ndim(x) - 2
    if nd < 1:
        raise ShardingError(f"conv: x must be (N, C, *spatial), got shape {_shape(x)}")
    if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool):
        raise ShardingError(f"conv: groups must be an int, got {groups!r}")
    params = (per_dim(stride, nd, "stride", "conv"), spatial_pads(padding, nd, "conv"),
              per_dim(dilation, nd, "dilation", "conv"), int(groups))
    out = apply(_CONV, (x, w), params)
    if bias is not None:
        out = add(out, reshape(bias, (-1,) + (1,) * nd))
    return out

_CONV = register(OpDef("conv", lambda shapes, stride, padding, dilation, groups: R.conv_rule(
    shapes[0], shapes[1], stride, padding, dilation, groups), _conv_kernel, "mul",
    dtype=lambda a, b: np.result_type(a, b), vjp=_conv_vjp, onnx=_conv_onnx, arity=2, public=conv, saves="cross",
    flops=lambda blocks, out, params: 2 * prod(out) * prod(blocks[1][1:])))  # 2 x (C/groups x kernel) per output


# ---- layer norm, one op --------------------------------------------------------------------------------------------


def _compute_dtype(dt: np.dtype) -> np.dtype:
    """Where a norm's statistics are accumulated: float32 for 16-bit floats (as jax and the fused kernels do)."""
    return np.dtype(np.float32) if np.dtype(dt).itemsize < 4 and is_inexact(dt) else np.dtype(dt)


def _layer_norm_kernel(arrays, local):
    axes, eps, has_scale, has_bias = local.params
    x = arrays[0]
    xp = _xp(*arrays)
    ax = tuple(local.G + a for a in axes)
    xf = x.astype(_compute_dtype(x.dtype))
    c = xf - xf.mean(axis=ax, keepdims=True)
    y = c / xp.sqrt((c * c).mean(axis=ax, keepdims=True) + np.asarray(eps, xf.dtype))
    rest = _align(list(arrays[1:]), local)
    if has_scale:
        y = y * rest.pop(0).astype(xf.dtype)
    if has_bias:
        y = y + rest.pop(0).astype(xf.dtype)
    return y.astype(np.result_type(*(a.dtype for a in arrays)))


def _normalized(x: Tensor, axes: tuple, eps: float) -> tuple[Tensor, Tensor]:
    """``x`` normalised over ``axes`` and the reciprocal standard deviation per row, recomputed from ``x`` in the
    statistics' dtype (the backward pass keeps only ``x``)."""
    dt = _compute_dtype(x.dtype)
    xf = x if x.dtype == dt else astype(x, dt)
    c = subtract(xf, mean(xf, axes, keepdims=True))
    rstd = divide(1.0, sqrt(add(mean(multiply(c, c), axes, keepdims=True), eps)))
    return multiply(c, rstd), rstd


def _layer_norm_vjp(g, node, out):
    """dx = rstd (gs - mean(gs) - xhat mean(gs xhat)), gs = g scale; dscale = sum(g xhat); dbias = sum(g)."""
    axes, eps, has_scale, has_bias = node.params
    x = node.args[0]
    scale = node.args[1] if has_scale else None
    bias = node.args[1 + has_scale] if has_bias else None
    res: list = [None] * len(node.args)
    if bias is not None and _is_diff(bias):
        res[1 + has_scale] = _unbroadcast(g, bias)
    need_x, need_s = _is_diff(x), scale is not None and _is_diff(scale)
    if need_x or need_s:
        xhat, rstd = _normalized(x, axes, eps)
        gf = g if g.dtype == xhat.dtype else astype(g, xhat.dtype)
        if need_s:  # (in the cotangent's dtype: its sum over the batch is the gradient's, made once)
            res[1] = _unbroadcast(multiply(g, xhat if xhat.dtype == g.dtype else astype(xhat, g.dtype)), scale)
        if need_x:
            gs = gf if scale is None else multiply(gf, scale)
            m1, m2 = mean(gs, axes, keepdims=True), mean(multiply(gs, xhat), axes, keepdims=True)
            res[0] = astype(multiply(subtract(subtract(gs, m1), multiply(xhat, m2)), rstd), x.dtype)
    return tuple(res)


def _layer_norm_saves(diff: tuple, params: tuple) -> tuple:
    """x for the cotangents of x and scale, scale for x's; the bias's needs nothing."""
    _, _, has_scale, _ = params
    keep = (0,) if diff[0] or has_scale and diff[1] else ()
    return keep + ((1,) if has_scale and diff[0] else ()), False


def _layer_norm_stats(blocks, out, params) -> int:
    """Two float32 numbers per normalised row (mean and reciprocal deviation), as fused kernels keep them."""
    axes = params[0]
    return 8 * prod(n for d, n in enumerate(blocks[0]) if d not in axes)


@onnx_export("LayerNormalization")
def _layer_norm_onnx(ex):
    axes, eps, has_scale, has_bias = ex.params
    rank = len(ex.args[0]._shape)
    x = ex.operand(0, ex.dtype)
    if axes != tuple(range(axes[0], rank)):
        raise ShardingError(f"export: layer_norm over dims {axes} of a rank-{rank} tensor has no LayerNormalization "
                            f"form (ONNX normalises trailing dims); move the dims last first")
    norm = tuple(ex.args[0]._shape[a] for a in axes)
    ins = [x, ex.operand(1, ex.dtype) if has_scale else ex.b.constant(np.ones(norm, ex.dtype), base="scale")]
    if has_bias:
        ins.append(ex.operand(1 + has_scale, ex.dtype))
    main = [(ins[0], 0)] + ([(ins[1], 1)] if has_scale else []) + ([(ins[-1], 1 + has_scale)] if has_bias else [])
    return ex.finish(ex.out("LayerNormalization", ins, axis=int(axes[0]), epsilon=float(eps)), main)


_LAYER_NORM = register(OpDef(
    "layer_norm", lambda shapes, axes, eps, has_scale, has_bias: R.elementwise_rule(tuple(shapes), axes, "layer_norm"),
    _layer_norm_kernel, vjp=_layer_norm_vjp, onnx=_layer_norm_onnx, public=None, saves=_layer_norm_saves,
    saved_extra=_layer_norm_stats, flops=lambda blocks, out, params: 8 * prod(out)))  # mean, var, scale, shift


# ---- pooling ---------------------------------------------------------------------------------------------------


def _pool_params(x, kernel_size, stride, padding, dilation, op):
    nd = _ndim(x) - 2
    if nd < 1:
        raise ShardingError(f"{op}: x must be (N, C, *spatial), got shape {_shape(x)}")
    kernel = per_dim(kernel_size, nd, "kernel_size", op)
    stride = kernel if stride is None else per_dim(stride, nd, "stride", op)
    return kernel, stride, spatial_pads(padding, nd, op), per_dim(dilation, nd, "dilation", op)


def _max_pool_kernel(arrays, local):
    kernel, stride, padding, dilation = local.params
    x = arrays[0]
    if not local.windowed:
        x = pad_spatial(x, padding, -np.inf)
    return _windows.max_pool(x, local.G, kernel, stride, dilation)


def _max_pool_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    return (max_pool_scatter(x, g, out, *node.params),)


def max_pool_scatter(x: Tensor, g: Tensor, out: Tensor, kernel: tuple, stride: tuple, pads: tuple,
                     dilation: tuple) -> Tensor:
    """``max_pool``'s input gradient: each window's cotangent ``g`` added at the first tap of ``x`` holding the
    window's max ``out`` (XLA's ``select_and_scatter_add`` with ``ge``, which a JAX program's max pool gradient
    holds). Parameters as ``max_pool``'s, normalised: one int per spatial dim, (before, after) pairs."""
    outs = g.shape[2:]
    xp = _padded(x, pads, -np.inf)
    parts, taken = [], None
    for tap, key in _taps(kernel, stride, dilation, outs):
        hit = equal(getitem(xp, key), out)
        if taken is not None:  # the first tap holding the max takes the cotangent (as XLA's select)
            hit = where(taken, False, hit)
        taken = hit if taken is None else where(taken, True, hit)
        parts.append((tap, where(hit, g, 0.0)))
    return _scatter_taps(parts, _shape(x), pads, stride, dilation, outs)


@onnx_export("MaxPool", "Cast")
def _max_pool_onnx(ex):
    """MaxPool (padding never wins), over bfloat16 in float32 and bools in uint8 (ONNX's MaxPool takes neither).
    A window holding NaN: the kernel's max is NaN, onnxruntime's MaxPool and ONNX's reference skip it (a window
    [NaN, 5] pools to 5). No node is added for it: it would double every pool's work and, rerun on nabla, its halo
    exchange (squeezenet's rows-sharded rerun: 23 collective_permutes for 20)."""
    kernel, stride, pads, dilation = ex.params
    work = ex.carrier("MaxPool")
    x = ex.operand(0, work)
    return ex.finish(ex.out_as(work, "MaxPool", [x], kernel_shape=list(kernel), strides=list(stride),
                               pads=onnx_pads(pads), dilations=list(dilation)), [(x, 0)])


def max_pool(x: ArrayLike, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1) -> Tensor:
    """Max over each window (padding never wins); a sharded spatial dim exchanges halo rows only."""
    return apply(_MAX_POOL, (x,), _pool_params(x, kernel_size, stride, padding, dilation, "max_pool"))

_MAX_POOL = register(OpDef("max_pool", lambda shapes, kernel, stride, padding, dilation: R.pool_rule(
    shapes[0], kernel, stride, padding, dilation, -np.inf, "max_pool"), _max_pool_kernel, dtype="same",
    vjp=_max_pool_vjp, onnx=_max_pool_onnx, arity=1, public=max_pool,
    flops=lambda blocks, out, params: prod(out) * prod(params[0])))  # a comparison per window tap


def _avg_pool_kernel(arrays, local):
    kernel, stride, padding, dilation, include = local.params
    x = arrays[0]
    if not local.windowed:
        x = pad_spatial(x, padding, 0)
        n = x.shape[2:]
        outs = tuple((ni - (k - 1) * d - 1) // s + 1 for ni, k, d, s in zip(n, kernel, dilation, stride))
        counts = _windows.avg_divisor([m - a - b for m, (a, b) in zip(n, padding)], [0] * len(n), outs, kernel,
                                      stride, [a for a, _ in padding], include, dilation)
    else:
        counts = local.aux[0]
    return _windows.avg_pool(x, local.G, kernel, stride, counts, dilation)


def _avg_pool_aux(spec, cuts, shapes, params):
    kernel, stride, padding, dilation, include = params
    x = shapes[0]
    g = grid(spec, cuts)
    nd = len(kernel)
    outs = [out_size(x[2 + i], kernel[i], stride[i], dilation[i], *padding[i]) for i in range(nd)]
    axes = [tuple(a for a in g.dims[2 + i] if g.shape[a] > 1) for i in range(nd)]
    return (_windows.avg_divisor_blocks(len(g.shape), g.shape, axes, x[2:], outs, kernel, stride,
                                        [a for a, _ in padding], include, dilation),)


def _avg_pool_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    kernel, stride, pads, dilation, include = node.params
    outs = g.shape[2:]
    counts = _windows.avg_divisor([n for n in _shape(x)[2:]], [0] * len(outs), outs, kernel, stride,
                                  [lo for lo, _ in pads], include, dilation)
    share = g / tensor(counts.astype(g.dtype if is_inexact(g.dtype) else np.float64))
    parts = [(tap, share) for tap, _ in _taps(kernel, stride, dilation, outs)]
    gx = _scatter_taps(parts, _shape(x), pads, stride, dilation, outs)
    return (gx if gx.dtype == x._dtype else astype(gx, x._dtype),)


@onnx_export("AveragePool", "Cast")
def _avg_pool_onnx(ex):
    """AveragePool, in float32 for bfloat16 (ONNX's AveragePool takes none), rounded once."""
    kernel, stride, pads, dilation, include = ex.params
    work = ex.carrier("AveragePool")
    x = ex.operand(0, work)
    return ex.finish(ex.out_as(work, "AveragePool", [x], kernel_shape=list(kernel), strides=list(stride),
                               pads=onnx_pads(pads), dilations=list(dilation), count_include_pad=int(include)),
                     [(x, 0)])


def avg_pool(x: ArrayLike, kernel_size: Any, stride: Any = None, padding: Any = 0, count_include_pad: bool = True,
             dilation: Any = 1) -> Tensor:
    """Mean over each window; with ``count_include_pad=False`` padding is left out of the divisor."""
    params = _pool_params(x, kernel_size, stride, padding, dilation, "avg_pool") + (bool(count_include_pad),)
    kernel, _, pads, dil, _ = params
    if all(k == n and p == (0, 0) and (d == 1 or k == 1) for k, n, p, d in zip(kernel, _shape(x)[2:], pads, dil)):
        # one window covering every spatial dim (ResNet's final 7 x 7 pool): a mean, so a sharded spatial dim
        # leaves partial sums (one all_reduce of the (N, C) result where it is needed), not a halo exchange
        return mean(x, tuple(range(2, _ndim(x))), keepdims=True)
    return apply(_AVG_POOL, (x,), params)

_AVG_POOL = register(OpDef("avg_pool", lambda shapes, kernel, stride, padding, dilation, include: R.pool_rule(
    shapes[0], kernel, stride, padding, dilation, 0.0, "avg_pool"), _avg_pool_kernel,
    dtype=lambda a: a if is_inexact(a) else np.dtype(np.float64), aux=_avg_pool_aux, vjp=_avg_pool_vjp,
    onnx=_avg_pool_onnx, arity=1, public=avg_pool, saves="none",
    flops=lambda blocks, out, params: prod(out) * prod(params[0])))  # an add per window tap (and a divide)


# ---- built from other ops ---------------------------------------------------------------------------------------


@_named
def global_avg_pool(x: ArrayLike) -> Tensor:
    """Mean over every spatial dim, kept as size-1 dims (a sharded spatial dim leaves partial sums)."""
    nd = _ndim(x) - 2
    if nd < 1:
        raise ShardingError(f"global_avg_pool: x must be (N, C, *spatial), got shape {_shape(x)}")
    return mean(x, tuple(range(2, 2 + nd)), keepdims=True)


@_named
def batch_norm(x: ArrayLike, mean: ArrayLike, var: ArrayLike, scale: ArrayLike, bias: ArrayLike,
               eps: float = 1e-5) -> Tensor:
    """Inference form, per channel (dim 1): ``(x - mean) / sqrt(var + eps) * scale + bias``."""
    nd = _ndim(x) - 2
    if nd < 0:
        raise ShardingError(f"batch_norm: x must be (N, C, ...), got shape {_shape(x)}")
    shape = (-1,) + (1,) * nd
    inv = reshape(divide(scale, sqrt(add(var, eps))), shape)
    return add(multiply(subtract(x, reshape(mean, shape)), inv), reshape(bias, shape))


def _check_affine(x: ArrayLike, axes: tuple[int, ...], params: dict) -> None:
    """A scale or bias must broadcast to ``x`` (covering the normalised trailing dims): the error names it, not the
    multiply inside."""
    shape = tuple(_shape(x))
    for name, t in params.items():
        if t is None:
            continue
        got = tuple(_shape(t))
        try:
            fits = broadcast_shapes((shape, got)) == shape
        except ShardingError:
            fits = False
        if not fits:
            raise ShardingError(f"layer_norm: {name} of shape {got} does not broadcast to the normalised dims "
                                f"{shape[min(axes):] if axes else ()} (x of shape {shape}, axis {axes})")


@_named
def layer_norm(x: ArrayLike, scale: ArrayLike | None = None, bias: ArrayLike | None = None, axis: Any = -1,
               eps: float = 1e-5) -> Tensor:
    """Normalise over ``axis`` (an int or a tuple, the trailing dims the scale and bias cover). With those dims
    whole on each device it is one op, as fused kernels run it: statistics in float32 for 16-bit inputs, and for
    the backward pass only its input (and two float32 numbers per row) kept, as Megatron-LM's and Apex's fused
    layer norms keep them. Over a sharded dim: two all_reduces, the mean's and the variance's."""
    axes = _axes(axis, _ndim(x), "layer_norm")
    _check_affine(x, axes, {"scale": scale, "bias": bias})
    spec = x._spec if isinstance(x, Tensor) else None
    if spec is None or not any(spec.dim_specs[a].axes for a in axes):
        args = (x,) + tuple(t for t in (scale, bias) if t is not None)
        return apply(_LAYER_NORM, args, (axes, float(eps), scale is not None, bias is not None))
    mu = mean(x, axes, keepdims=True)
    centred = subtract(x, mu)
    var = mean(multiply(centred, centred), axes, keepdims=True)
    out = divide(centred, sqrt(add(var, eps)))
    if scale is not None:
        out = multiply(out, scale)
    if bias is not None:
        out = add(out, bias)
    return out
