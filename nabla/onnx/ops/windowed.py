"""Windowed ops and normalizations: ``Conv``, ``ConvTranspose``, the pools (``MaxPool``, ``AveragePool``,
``LpPool``, their global forms) and the norms (``BatchNormalization``, ``LayerNormalization``,
``InstanceNormalization``, ``LpNormalization``, ``LRN``): the formalism draft's pooling and convolution group.
They share the window attributes (strides, dilations, pads with ``auto_pad`` and ``ceil_mode``), the p-norm
pieces and the moments of the norms; ``conv_act`` fuses a Conv with its bias and a following Relu."""

from __future__ import annotations

import builtins
from math import prod
from typing import Sequence

import numpy as np

import nabla as nb

from ...tensor import Tensor
from .registry import Node, _axis, _c, _cast, _hi, _take, op
from ..fuse import conv_act as fused


def _moments(x: Tensor, axes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    mean = nb.mean(x, axes, keepdims=True)
    d = x - mean
    return mean, nb.mean(d * d, axes, keepdims=True)


@op("InstanceNormalization")
def _instance_norm(n, x, scale, bias):
    axes = tuple(range(2, x.ndim))
    mean, var = _moments(x, axes)
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    y = (x - mean) / nb.sqrt(var + _c(x, n.attr("epsilon", 1e-5)))
    return y * nb.reshape(scale, shape) + nb.reshape(bias, shape)


@op("LRN")
def _lrn(n, x):
    """Sum of squares over a window of ``size`` channels (zero padded), from shifted slices."""
    size = n.attr("size")
    alpha, beta, bias = n.attr("alpha", 1e-4), n.attr("beta", 0.75), n.attr("bias", 1.0)
    c = x.shape[1]
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = x * x

    def zeros(k):
        shape = list(x.shape)
        shape[1] = k
        return nb.tensor(np.zeros(shape, x.dtype))

    padded = nb.concatenate([zeros(lo)] * bool(lo) + [sq] + [zeros(hi)] * bool(hi), 1)
    total = None
    for k in range(size):
        part = _take(padded, 1, slice(k, k + c))
        total = part if total is None else total + part
    return x / nb.power(total * _c(x, alpha / size) + _c(x, bias), _c(x, beta))


@op("GlobalMaxPool")
def _global_max_pool(n, x):
    return nb.max(x, tuple(range(2, x.ndim)), keepdims=True)


@op("LayerNormalization", needs=("layer_norm",))
def _layer_norm(n, x, scale, bias=None):
    ax = _axis(n, n.attr("axis", -1), x.ndim)
    eps = n.attr("epsilon", 1e-5)
    trailing = x.shape[ax:]
    flat = x if len(trailing) == 1 else nb.reshape(x, x.shape[:ax] + (prod(trailing),))
    s = nb.reshape(nb.broadcast_to(scale, trailing), (prod(trailing),)) if len(trailing) != 1 else \
        nb.broadcast_to(scale, trailing)
    b = None
    if bias is not None:
        b = nb.reshape(nb.broadcast_to(bias, trailing), (prod(trailing),))
    y = nb.layer_norm(flat, s, b, axis=-1, eps=eps)
    y = nb.reshape(y, x.shape) if len(trailing) != 1 else y
    if not (n.wants(1) or n.wants(2)):
        return y
    axes = tuple(range(ax, x.ndim))
    xs, _ = _hi(x) if n.attr("stash_type", 1) == 1 else (x, x.dtype)
    mean, var = _moments(xs, axes)
    inv = 1.0 / nb.sqrt(var + eps)
    st = np.float32 if n.attr("stash_type", 1) == 1 else x.dtype
    return y, _cast(mean, st), _cast(inv, st)


def _check_batch_norm(n: Node) -> None:
    if n.attr("training_mode", 0) or any(n.wants(i) for i in range(1, 5)):
        raise n.fail("training-mode BatchNormalization (running statistics outputs) is not supported; "
                     "only inference")


@op("BatchNormalization", needs=("batch_norm",), check=_check_batch_norm)
def _batch_norm(n, x, scale, bias, mean, var):
    return nb.batch_norm(x, mean, var, scale, bias, eps=n.attr("epsilon", 1e-5))


def _window(n: Node, x: Tensor, kernel: Sequence[int], with_dilation: bool = True):
    """(strides, dilations, per-dim (before, after) pads) from the attributes, auto_pad included."""
    sp = x.ndim - 2
    strides = list(n.attr("strides", None) or [1] * sp)
    dil = list(n.attr("dilations", None) or [1] * sp)
    auto = n.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for i in range(sp):
            size = x.shape[2 + i]
            out = -(-size // strides[i])
            total = builtins.max((out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - size, 0)
            small = total // 2
            pads.append((small, total - small) if auto == "SAME_UPPER" else (total - small, small))
    elif auto == "VALID":
        pads = [(0, 0)] * sp
    else:
        p = list(n.attr("pads", None) or [0] * (2 * sp))
        pads = [(p[i], p[i + sp]) for i in range(sp)]
    return strides, dil, pads


def _ceil_pads(x: Tensor, kernel, strides, dil, pads) -> list[tuple[int, int]]:
    """ceil_mode as extra padding at the end: the last window starts inside the input or the left pad."""
    out = []
    for i, (lo, hi) in enumerate(pads):
        size = x.shape[2 + i]
        span = (kernel[i] - 1) * dil[i] + 1
        n_out = -(-(size + lo + hi - span) // strides[i]) + 1
        if (n_out - 1) * strides[i] >= size + lo:
            n_out -= 1
        extra = builtins.max((n_out - 1) * strides[i] + span - (size + lo + hi), 0)
        out.append((lo, hi + extra))
    return out


@op("Conv", needs=("conv",))
def _conv(n, x, w, b=None):
    kernel = list(n.attr("kernel_shape", None) or w.shape[2:])
    strides, dil, pads = _window(n, x, kernel)
    return nb.conv(x, w, bias=b, stride=tuple(strides), padding=tuple(pads), dilation=tuple(dil),
                   groups=n.attr("group", 1))


def conv_act(n: Node, x: Tensor, w: Tensor, b: Tensor | None, relu: bool,
             residual: Tensor | None = None) -> Tensor | None:
    """The Conv node with its bias (and a following residual Add and Relu) as one op (``fuse.CONV_ACT``), or
    None when that does not apply: input channels sharded (their partial sums must be added before any bias
    or relu), or operands that are not a plain conv's."""

    def whole_channels(t: Tensor) -> bool:
        sp = t.sharding
        return sp is None or (not sp.dim_specs[1].axes and not sp.partial_axes)

    if x.ndim < 3 or w.ndim != x.ndim or not whole_channels(x) or not whole_channels(w):
        return None
    if b is not None and (b.ndim != 1 or b.shape[0] != w.shape[0] or (b.sharding is not None and b.sharding.partial_axes)):
        return None
    kernel = list(n.attr("kernel_shape", None) or w.shape[2:])
    if list(kernel) != list(w.shape[2:]):
        return None
    strides, dil, pads = _window(n, x, kernel)
    return fused(x, w, b, tuple(strides), tuple(pads), tuple(dil), n.attr("group", 1), relu, residual)


def _check_pool(n: Node) -> None:
    if n.op_type == "MaxPool" and n.wants(1):
        raise n.fail("the Indices output of MaxPool is not supported")


@op("MaxPool", needs=("max_pool",), check=_check_pool)
def _max_pool(n, x):
    kernel = list(n.attr("kernel_shape"))
    strides, dil, pads = _window(n, x, kernel)
    if n.attr("ceil_mode", 0):
        pads = _ceil_pads(x, kernel, strides, dil, pads)
    return nb.max_pool(x, tuple(kernel), stride=tuple(strides), padding=tuple(pads), dilation=tuple(dil))


@op("AveragePool", needs=("avg_pool",), check=_check_pool)
def _avg_pool(n, x):
    """With ceil_mode and count_include_pad, the explicit pads count but the extra end padding that
    emulates ceil_mode does not: rescale each window by (kernel size) / (its cells inside the pads)."""
    kernel = list(n.attr("kernel_shape"))
    strides, dil, pads = _window(n, x, kernel)
    include = bool(n.attr("count_include_pad", 0))
    wide = _ceil_pads(x, kernel, strides, dil, pads) if n.attr("ceil_mode", 0) else pads
    y = nb.avg_pool(x, tuple(kernel), stride=tuple(strides), padding=tuple(wide), count_include_pad=include,
                    dilation=tuple(dil))
    if not include or wide == pads:
        return y
    scale = np.ones((), np.float64)
    for i, ((lo, hi), (_, hi2)) in enumerate(zip(pads, wide)):
        end = x.shape[2 + i] + lo + hi  # the explicitly padded extent
        starts = np.arange(y.shape[2 + i]) * strides[i]
        inside = np.clip(-((starts - end) // dil[i]), 0, kernel[i])  # taps j with start + j*dilation < end
        shape = [1] * y.ndim
        shape[2 + i] = len(starts)
        scale = scale * (kernel[i] / inside).reshape(shape)
    return y * scale.astype(y.dtype)


@op("GlobalAveragePool", needs=("global_avg_pool",))
def _global_avg_pool(n, x):
    return nb.global_avg_pool(x)


def _lp(x: Tensor, p: int) -> Tensor:
    """``|x| ** p`` (p = 1 or 2 without a power)."""
    return nb.abs(x) if p == 1 else x * x if p == 2 else nb.power(nb.abs(x), _c(x, p))


def _root(s: Tensor, p: int) -> Tensor:
    return s if p == 1 else nb.sqrt(s) if p == 2 else nb.power(s, _c(s, 1.0 / p))


@op("LpNormalization")
def _lp_normalization(n, x):
    """``x / ||x||_p`` along ``axis`` (p 1 or 2); a zero norm gives 0. A sharded axis leaves partial sums,
    added (one all_reduce) before the root."""
    p = n.attr("p", 2)
    if p not in (1, 2):
        raise n.fail(f"p must be 1 or 2, got {p}")
    ax = _axis(n, n.attr("axis", -1), x.ndim)
    norm = _root(nb.sum(_lp(x, p), (ax,), keepdims=True), p)
    zero = nb.equal(norm, _c(norm, 0))
    return nb.where(zero, _c(x, 0), x / nb.where(zero, _c(norm, 1), norm))


@op("LpPool", needs=("avg_pool",), check=_check_pool)
def _lp_pool(n, x):
    """``(sum over each window of |x|^p) ** (1/p)``: an average pool of ``|x|^p`` counting the zero padding,
    times the window size (a sharded spatial dim exchanges halo rows, as the average pool does)."""
    p = n.attr("p", 2)
    kernel = list(n.attr("kernel_shape"))
    strides, dil, pads = _window(n, x, kernel)
    if n.attr("ceil_mode", 0):
        pads = _ceil_pads(x, kernel, strides, dil, pads)
    mean = nb.avg_pool(_lp(x, p), tuple(kernel), stride=tuple(strides), padding=tuple(pads),
                       count_include_pad=True, dilation=tuple(dil))
    return _root(mean * _c(mean, prod(kernel)), p)


@op("GlobalLpPool")
def _global_lp_pool(n, x):
    p = n.attr("p", 2)
    return _root(nb.sum(_lp(x, p), tuple(range(2, x.ndim)), keepdims=True), p)


def _upsample(x: Tensor, axis: int, stride: int) -> Tensor:
    """``stride - 1`` zeros between consecutive rows of dim ``axis``: rows ``(n - 1) * stride + 1``. Built as
    ``(n, stride)`` rows (the row, then zeros) merged into one dim and cut, so a sharded dim stays sharded."""
    if stride == 1 or x.shape[axis] == 0:
        return x
    shape = list(x.shape)
    shape[axis] = shape[axis] * (stride - 1)
    zeros = nb.tensor(np.zeros(x.shape[:axis + 1] + (stride - 1,) + x.shape[axis + 1:], x.dtype))
    pair = nb.concatenate([nb.expand_dims(x, axis + 1), zeros], axis + 1)  # (..., n, stride, ...)
    flat = nb.reshape(pair, x.shape[:axis] + (x.shape[axis] * stride,) + x.shape[axis + 1:])
    return _take(flat, axis, slice(0, (x.shape[axis] - 1) * stride + 1))


@op("ConvTranspose", needs=("conv",))
def _conv_transpose(n, x, w, b=None):
    """The transpose (gradient) of a conv, as a conv: the input's rows spread ``stride`` apart (zeros between),
    padded by ``(kernel - 1) * dilation`` less the pads, correlated with the kernel flipped and its channel
    dims swapped (per group). Batch and channels shard as for Conv, and a sharded spatial dim stays sharded:
    the spreading is a reshape of a sharded dim, the conv exchanges halo rows."""
    sp = x.ndim - 2
    if sp < 1 or w.ndim != x.ndim:
        raise n.fail(f"X must be (N, C, *spatial) and W (C, M/group, *kernel) of the same rank, got {x.shape}, "
                     f"{w.shape}")
    groups = n.attr("group", 1)
    kernel = list(n.attr("kernel_shape", None) or w.shape[2:])
    if list(kernel) != list(w.shape[2:]):
        raise n.fail(f"kernel_shape {kernel} does not match W's spatial dims {list(w.shape[2:])}")
    strides = list(n.attr("strides", None) or [1] * sp)
    dil = list(n.attr("dilations", None) or [1] * sp)
    out_pad = list(n.attr("output_padding", None) or [0] * sp)
    out_shape = list(n.attr("output_shape", None) or [])
    auto = n.attr("auto_pad", "NOTSET")
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dil)]
    full = [s * (size - 1) + op + k for s, size, op, k in zip(strides, x.shape[2:], out_pad, span)]
    if out_shape or auto in ("SAME_UPPER", "SAME_LOWER"):
        if len(out_shape) == sp + 2:
            out_shape = out_shape[2:]
        target = out_shape or [size * s for size, s in zip(x.shape[2:], strides)]
        if len(target) != sp:
            raise n.fail(f"output_shape must give {sp} spatial sizes, got {out_shape}")
        total = [f - t for f, t in zip(full, target)]
        upper = auto == "SAME_UPPER"
        pads = [(t // 2, t - t // 2) if upper else (t - t // 2, t // 2) for t in total]
    elif auto == "VALID":
        pads = [(0, 0)] * sp
    else:
        p = list(n.attr("pads", None) or [0] * (2 * sp))
        pads = [(p[i], p[i + sp]) for i in range(sp)]
    C, Mg = w.shape[0], w.shape[1]
    if x.shape[1] != C or C % groups:
        raise n.fail(f"X has {x.shape[1]} channels, W {C}; with group={groups} both must match and divide")
    # W (C, M/g, *k) -> (M, C/g, *k), flipped: per group, the channel dims swapped
    wg = nb.reshape(w, (groups, C // groups, Mg) + tuple(kernel))
    wg = nb.transpose(wg, (0, 2, 1) + tuple(range(3, 3 + sp)))
    wc = nb.reshape(wg, (groups * Mg, C // groups) + tuple(kernel))
    wc = wc[(slice(None), slice(None)) + (slice(None, None, -1),) * sp]
    u = x
    for i in range(sp):
        u = _upsample(u, 2 + i, strides[i])
    conv_pads, crop = [], []
    for i in range(sp):
        lo = span[i] - 1 - pads[i][0]
        hi = span[i] - 1 - pads[i][1] + out_pad[i]
        conv_pads.append((max(lo, 0), max(hi, 0)))
        crop.append((max(-lo, 0), max(-hi, 0)))
    y = nb.conv(u, wc, stride=1, padding=tuple(conv_pads), dilation=tuple(dil), groups=groups)
    for i, (a, c) in enumerate(crop):
        if a or c:
            y = _take(y, 2 + i, slice(a, y.shape[2 + i] - c))
    if b is not None:
        y = y + nb.reshape(b, (1, -1) + (1,) * sp)
    return y
