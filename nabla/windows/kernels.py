"""The local conv, max pool and average pool kernels on windowed blocks (``*grid, N, C, *spatial``), all devices
in one numpy call (vmapped over the grid on jax blocks), and the average pool's divisors. The windows they run on
are made by ``halos``."""

from __future__ import annotations

from itertools import product
from math import prod
from typing import Iterator, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..backends import xp as _xp
from ..dtypes import is_inexact
from . import winograd
from .arrays import finish, gemm_weight, relu_inplace
from .halos import _ceil_div, _span, _taps_inside, fill_value


# ---- kernels on windows ---------------------------------------------------------------------------


def _tuple(v: int | Sequence[int] | None, nd: int) -> tuple[int, ...]:
    if v is None:
        return (1,) * nd
    if isinstance(v, (int, np.integer)):
        return (int(v),) * nd
    v = tuple(int(i) for i in v)
    if len(v) != nd:
        raise ValueError(f"expected {nd} values, got {v}")
    return v


def _few_windows(x: np.ndarray, kernel: tuple[int, ...], stride: tuple[int, ...],
                 dilation: tuple[int, ...]) -> np.ndarray | None:
    """When the windows are few and large (a global pool), a strided view ``(..., *out, *kernel)`` of them,
    to reduce in one call; None when reducing tap by tap is faster (many windows, few taps)."""
    nd = len(kernel)
    n = x.shape[-nd:]
    outs = tuple((ni - _span(k, d)) // s + 1 for ni, k, d, s in zip(n, kernel, dilation, stride))
    if min(outs) < 1 or prod(outs) * 4 > prod(kernel):
        return None
    spans = tuple(_span(k, d) for k, d in zip(kernel, dilation))
    v = sliding_window_view(x, spans, axis=tuple(range(x.ndim - nd, x.ndim)))
    lead = (slice(None),) * (x.ndim - nd)
    return v[lead + tuple(slice(None, None, s) for s in stride) + tuple(slice(None, None, d) for d in dilation)]


def _taps(x: np.ndarray, kernel: tuple[int, ...], stride: tuple[int, ...],
          dilation: tuple[int, ...]) -> Iterator[np.ndarray]:
    """Each kernel tap's strided view ``(..., *out_spatial)``: reducing tap by tap is elementwise on
    large operands, much faster than reducing the tiny trailing axes of the window view."""
    nd = len(kernel)
    n = x.shape[-nd:]
    outs = tuple((ni - _span(k, d)) // s + 1 for ni, k, d, s in zip(n, kernel, dilation, stride))
    if min(outs) < 1:
        raise ValueError(f"window {kernel} (dilation {dilation}) does not fit spatial dims {n}")
    lead = (slice(None),) * (x.ndim - nd)
    for t in product(*(range(k) for k in kernel)):
        yield x[lead + tuple(slice(j * d, j * d + (o - 1) * s + 1, s)
                             for j, d, o, s in zip(t, dilation, outs, stride))]


# Below this many output positions per image, the images of a block are folded into the columns of one
# GEMM (a copy in and out, of small tensors) rather than batched as many thin GEMMs (BLAS is slow on those).
_THIN = 64


def conv(x: np.ndarray, w: np.ndarray, G: int, stride: int | Sequence[int] | None = None,
         dilation: int | Sequence[int] | None = None, groups: int = 1,
         live: Sequence[tuple[int, int]] = (), bias: np.ndarray | None = None, relu: bool = False,
         res: np.ndarray | None = None) -> np.ndarray:
    """Valid cross-correlation of windows ``x (*grid, N, C, *spatial)`` with ``w (*grid, O, C/groups, *kernel)``
    (grids broadcast) -> ``(*grid, N, O, *out)``, contiguous; then :func:`epilogue`'s ``bias (*grid, O)``,
    residual ``res`` (the output's shape) and relu, applied while each chunk of output is still in cache. A weight shared by every device (grid all 1)
    makes one kernel call for all blocks: grid and batch are one leading dim; otherwise one call per block.
    ``live``: ``(grid axis, n)`` pairs saying only the first ``n`` blocks along that axis hold real output
    rows (the others are all padding of a ceil-rule split): those others are not computed (zeros, through the
    epilogue)."""
    nd = w.ndim - G - 2
    kernel = w.shape[G + 2:]
    stride, dilation = _tuple(stride, nd), _tuple(dilation, nd)
    if _xp(x, w) is not np or any(a is not None and _xp(a) is not np for a in (bias, res)):
        y = _jax_windows(lambda a, b: __import__("jax").lax.conv_general_dilated(
            a, b, stride, "VALID", rhs_dilation=dilation, feature_group_count=groups), G, x, w)
        return epilogue(y, G, bias, relu, res)
    N, C = x.shape[G:G + 2]
    O, Cg = w.shape[G:G + 2]
    if x.ndim != G + 2 + nd or C != Cg * groups or O % groups:
        raise ValueError(f"conv shapes x {x.shape}, w {w.shape} (G={G}) do not fit groups={groups}")
    gx, gw = x.shape[:G], w.shape[:G]
    gb = (1,) * G if bias is None else bias.shape[:G]
    dtype = np.result_type(x, w)
    grid = np.broadcast_shapes(gx, gw, gb)
    outs = tuple((n - _span(k, d)) // s + 1 for n, k, d, s in zip(x.shape[G + 2:], kernel, dilation, stride))
    live = tuple((a, n) for a, n in live if n < gx[a] and gw[a] == 1 and gb[a] == 1)
    if res is not None and res.shape != grid + (N, O) + outs:  # a broadcast residual: added after, as it is
        return epilogue(conv(x, w, G, stride, dilation, groups, live, bias), G, None, relu, res)
    if all(s == 1 for s in gw + gb):
        w1 = w.reshape(w.shape[G:])
        b1 = None if bias is None else bias.reshape(O)
        if not live:
            return _conv_block(x, w1, stride, dilation, groups, dtype, None, b1, relu, res)
        out = np.empty(grid + (N, O) + outs, dtype)
        key = [slice(None)] * G
        for a, n in live:
            dead = [slice(None)] * G
            dead[a] = slice(n, None)
            out[tuple(dead)] = 0
            epilogue(out[tuple(dead)], G, bias, relu, None if res is None else res[tuple(dead)])
            key[a] = slice(0, n)
        _conv_block(x[tuple(key)], w1, stride, dilation, groups, dtype, out[tuple(key)], b1, relu,
                    None if res is None else res[tuple(key)])
        return out
    out = np.empty(grid + (N, O) + outs, dtype)
    for i in np.ndindex(*grid):
        xi = x[tuple(j if s > 1 else 0 for j, s in zip(i, gx))]
        wi = w[tuple(j if s > 1 else 0 for j, s in zip(i, gw))]
        bi = None if bias is None else bias[tuple(j if s > 1 else 0 for j, s in zip(i, gb))]
        _conv_block(xi, wi, stride, dilation, groups, dtype, out[i], bi, relu, None if res is None else res[i])
    return out


def _as_view(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``a`` reshaped without a copy, or None when its strides do not allow it."""
    try:
        return a.reshape(shape, copy=False)
    except ValueError:
        return None
    except TypeError:  # numpy < 2.1: no copy argument
        v = a.reshape(shape)
        return v if np.shares_memory(v, a) else None


def _conv_block(x: np.ndarray, w: np.ndarray, stride: tuple[int, ...], dilation: tuple[int, ...], groups: int,
                dtype: np.dtype, out: np.ndarray | None = None, bias: np.ndarray | None = None,
                relu: bool = False, res: np.ndarray | None = None) -> np.ndarray:
    """``x (*lead, C, *S)`` with one weight ``w (O, C/groups, *K)`` -> ``(*lead, O, *out)`` (written into
    ``out`` when given, else a new contiguous array), then ``+ bias (O,)``, ``+ res`` (the output's shape)
    and ``max(., 0)`` when asked.

    Per image, ``W (O, C*K) @ cols (C*K, out)`` gives the output rows in place (no transpose after): a 1x1
    stride-1 conv's cols are the input itself (no copy), a KxK conv's are an im2col copy of a window view.
    Where the cols are a copy, a row of ones under them and the bias as one more column of the weight make
    the GEMM add the bias (``arrays.gemm_weight``). Thin images (few output positions) are folded into the
    columns of one GEMM instead, its result transposed into place. Images go a few at a time
    (:func:`_chunk`), so a chunk's cols and output stay in cache from the copy through the GEMM to the
    epilogue: one im2col buffer for a whole block is tens of MB, and reading it back from memory cost as
    much as the GEMM. Groups are a batch dim of the GEMM. A 3x3 stride-1 conv with many channels runs
    as Winograd F(2x2, 3x3) instead (``winograd``)."""
    nd = w.ndim - 2
    kernel = w.shape[2:]
    O, Cg = w.shape[:2]
    nl = x.ndim - nd - 1
    lead, C = x.shape[:nl], x.shape[nl]
    L, K = prod(lead), prod(kernel)
    spans = tuple(_span(k, d) for k, d in zip(kernel, dilation))
    outs = tuple((n - sp) // s + 1 for n, sp, s in zip(x.shape[nl + 1:], spans, stride))
    P = prod(outs)
    x = x.astype(dtype, copy=False)
    if out is None:
        out = np.empty(lead + (O,) + outs, dtype)
    if winograd.fits(kernel, stride, dilation, groups, C, O, outs, dtype):
        return winograd.conv(_runs(x, out, res, nl), w, bias, relu, res is not None, dtype, out)
    if K == 1:  # a 1x1 conv reads a strided sub-grid: the view is its own im2col
        v = x[(Ellipsis,) + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(outs, stride))]
        taps, shape = (), (C,)
    else:
        v = sliding_window_view(x, spans, axis=tuple(range(nl + 1, nl + 1 + nd)))
        v = v[(Ellipsis,) + tuple(slice(None, None, s) for s in stride) + tuple(slice(None, None, d) for d in dilation)]
        taps, shape = tuple(range(2 + nd, 2 + 2 * nd)), (C,) + kernel  # C, then the taps
    runs = _runs(v, out, res, nl)
    fold = P < _THIN and L > 1
    # a folded chunk has at least as many columns as the weight has rows: each chunk's GEMM reads all of it
    n = _chunk((C * K + O) * P, dtype.itemsize, -(-max(_THIN, O) // P) if fold else 1)
    spatial = tuple(range(2, 2 + nd))
    # the bias as the GEMM's: where the cols are copied anyway (folded, an im2col, a strided 1x1), or where
    # copying them costs less than the pass over the output it saves (a 1x1 conv that widens its channels)
    copied = fold or K > 1 or any(s != 1 for s in stride) or groups > 1
    ones = bias is not None and groups == 1 and (copied or C <= O)
    wm = gemm_weight(w, bias if ones else None, dtype).reshape(groups, O // groups, -1)
    # a bias the GEMM does not add: added as a whole (O, *out) plane, which numpy's vectorised loop takes
    # (a bias broadcast along the rows ran 2x slower)
    b = None if bias is None or ones else np.broadcast_to(bias.astype(dtype, copy=False).reshape((O,) + (1,) * nd),
                                                          (O,) + outs).copy()
    rows = C * K + ones  # of the cols: the taps of every input channel, then the row of ones
    if fold:  # cols (C, *K, n, *out): the chunk's images are the GEMM's columns
        buf = np.empty((rows, n * P), dtype)
        ybuf = np.empty((groups, O // groups, n * P), dtype)
        src_order = (1,) + taps + (0,) + spatial
    elif copied or ones:  # cols (n, C, *K, *out): one GEMM per image (numpy batches them)
        buf = np.empty((n, rows, P), dtype)
        src_order = (0, 1) + taps + spatial
    else:
        buf = None
    if ones:
        buf[..., C * K, :] = 1
    for vr, orr, rr in runs:
        for i in range(0, vr.shape[0], n):
            src, dst = vr[i:i + n], orr[i:i + n]
            m = src.shape[0]
            if fold:
                cols = buf[:, :m * P]
                cols[:C * K].reshape(shape + (m,) + outs)[...] = src.transpose(src_order)
                y = ybuf[..., :m * P]
                np.matmul(wm, cols.reshape(groups, -1, m * P), out=y)
                y = y.reshape((O, m) + outs)
                if b is not None:  # on the GEMM's contiguous result: faster than in the transposing copy
                    np.add(y, b[:, None], out=y, casting="unsafe")
                dst[...] = y.transpose((1, 0) + spatial)
            else:
                if buf is None:
                    cols = src.reshape(m, groups, Cg, P)  # the 1x1 stride-1 case: the input as it is (a view)
                else:
                    cols = buf[:m]
                    cols[:, :C * K].reshape((m,) + shape + outs)[...] = src.transpose(src_order)
                    cols = cols.reshape(m, 1, rows, P) if ones else cols.reshape(m, groups, Cg * K, P)
                d = _as_view(dst, (m, groups, O // groups, P))
                if d is None:
                    dst[...] = np.matmul(wm, cols).reshape(dst.shape)
                else:
                    np.matmul(wm, cols, out=d)
                if b is not None:
                    np.add(dst, b, out=dst, casting="unsafe")
            finish(dst, None if res is None else rr[i:i + n], relu)
    return out


def _runs(v: np.ndarray, out: np.ndarray, res: np.ndarray | None, nl: int) -> list[tuple]:
    """The images of ``v`` (``nl`` lead dims), ``out`` and ``res`` as ``(image, ...)`` runs: one flat run when
    the strides allow, else one per prefix of the lead dims. An absent residual is stood in for by ``out``
    (never read then)."""
    lead = v.shape[:nl]
    r = out if res is None else res
    L = prod(lead)
    flat = (_as_view(v, (L,) + v.shape[nl:]), _as_view(out, (L,) + out.shape[nl:]), _as_view(r, (L,) + r.shape[nl:]))
    if all(f is not None for f in flat):
        return [flat]
    return [(v[i], out[i], r[i]) for i in np.ndindex(*lead[:-1])] if nl else [(v[None], out[None], r[None])]


# How many bytes of one chunk's operands (cols and output) :func:`_conv_block` aims to keep in cache.
_CHUNK_BYTES = 1 << 21


def _chunk(elems_per_image: int, itemsize: int, least: int = 1) -> int:
    """Images per chunk: as many as fit :data:`_CHUNK_BYTES`, at least ``least``."""
    return max(1, least, _CHUNK_BYTES // max(1, elems_per_image * itemsize))


def epilogue(y, G: int, bias=None, relu: bool = False, res=None):
    """``y (*grid, N, O, *out)`` plus ``bias (*grid, O)`` per channel, plus ``res`` (broadcastable to ``y``),
    then ``max(., 0)``: in place on a numpy block the kernel just made (one pass each, no new array),
    functionally otherwise (jax)."""
    nd = y.ndim - G - 2
    if bias is not None:
        bias = bias.reshape(bias.shape[:G] + (1, bias.shape[-1]) + (1,) * nd)
    if type(y) is not np.ndarray or not y.flags.writeable:
        xp = _xp(y)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        if res is not None:
            y = y + xp.asarray(res).astype(y.dtype)
        return xp.maximum(y, y.dtype.type(0)) if relu else y
    if bias is not None:
        np.add(y, bias, out=y, casting="unsafe")
    if res is not None:
        np.add(y, res, out=y, casting="unsafe")
    if relu:
        relu_inplace(y)
    return y


def max_pool(x: np.ndarray, G: int, kernel: Sequence[int], stride: int | Sequence[int] | None = None,
             dilation: int | Sequence[int] | None = None) -> np.ndarray:
    """Max over each window of ``x (*grid, N, C, *spatial)`` -> ``(*grid, N, C, *out)``."""
    kernel = tuple(kernel)
    nd = len(kernel)
    if _xp(x) is not np:
        lax = __import__("jax").lax
        return _jax_windows(lambda a: lax.reduce_window(
            a, -np.inf if is_inexact(a.dtype) else fill_value(-np.inf, a.dtype), lax.max, (1, 1) + kernel,
            (1, 1) + _tuple(stride, nd), "VALID", window_dilation=(1, 1) + _tuple(dilation, nd)), G, x)
    few = _few_windows(x, kernel, _tuple(stride, nd), _tuple(dilation, nd))
    if few is not None:
        return np.max(few, axis=tuple(range(-nd, 0)))
    lead = x.shape[:x.ndim - nd]
    flat = _as_view(x, (prod(lead),) + x.shape[x.ndim - nd:])
    if flat is None:
        return _max_taps(x, kernel, stride, dilation)
    # a few images' channels at a time: the running max stays in cache through every tap
    n = max(1, _CHUNK_BYTES // max(1, prod(x.shape[x.ndim - nd:]) * x.dtype.itemsize))
    out = None
    for i in range(0, flat.shape[0], n):
        part = _max_taps(flat[i:i + n], kernel, stride, dilation, None if out is None else out[i:i + n])
        if out is None:
            out = np.empty((flat.shape[0],) + part.shape[1:], x.dtype)
            out[:part.shape[0]] = part
    return out.reshape(lead + out.shape[1:])


def _max_taps(x: np.ndarray, kernel: tuple[int, ...], stride, dilation, out: np.ndarray | None = None) -> np.ndarray:
    """The windows' max one spatial dim at a time (a max is separable): a 3x3 window takes 3 + 3 taps, not 9,
    the first dim's (whole rows, contiguous) before the last's (strided within the rows)."""
    nd = len(kernel)
    stride, dilation = _tuple(stride, nd), _tuple(dilation, nd)
    y = x
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        axis = x.ndim - nd + i
        o = (y.shape[axis] - _span(k, d)) // s + 1
        pre = (slice(None),) * axis
        taps = [y[pre + (slice(j * d, j * d + (o - 1) * s + 1, s),)] for j in range(k)]
        z = out if i == nd - 1 and out is not None else np.empty(taps[0].shape, x.dtype)
        if k == 1:
            z[...] = taps[0]
        else:
            np.maximum(taps[0], taps[1], out=z)
        for t in taps[2:]:
            np.maximum(z, t, out=z)
        y = z
    return y


def avg_pool(x: np.ndarray, G: int, kernel: Sequence[int], stride: int | Sequence[int] | None = None,
             counts: np.ndarray | float | None = None,
             dilation: int | Sequence[int] | None = None) -> np.ndarray:
    """Window sums of ``x (*grid, N, C, *spatial)`` divided by ``counts`` (broadcastable to the output;
    default the kernel size, i.e. count_include_pad) -> ``(*grid, N, C, *out)``."""
    kernel = tuple(kernel)
    nd = len(kernel)
    if _xp(x) is not np:
        lax = __import__("jax").lax
        jnp = __import__("jax").numpy
        xf = x if is_inexact(x.dtype) else x.astype(jnp.float64)
        sums = _jax_windows(lambda a: lax.reduce_window(a, 0.0, lax.add, (1, 1) + kernel, (1, 1) + _tuple(stride, nd),
                                                        "VALID", window_dilation=(1, 1) + _tuple(dilation, nd)), G, xf)
        return sums / jnp.asarray(prod(kernel) if counts is None else counts, dtype=sums.dtype)
    few = _few_windows(x, kernel, _tuple(stride, nd), _tuple(dilation, nd))
    if few is not None:
        out = np.sum(few, axis=tuple(range(-nd, 0)), dtype=x.dtype if is_inexact(x.dtype) else np.float64)
    else:
        taps = _taps(x, kernel, _tuple(stride, nd), _tuple(dilation, nd))
        first = next(taps)
        out = first.astype(first.dtype if is_inexact(first.dtype) else np.float64)  # ints average to float64
        for t in taps:
            np.add(out, t, out=out)
    div = np.asarray(prod(kernel) if counts is None else counts, dtype=out.dtype)
    if np.broadcast_shapes(out.shape, div.shape) == out.shape:
        return np.divide(out, div, out=out)
    return out / div


def _jax_windows(fn, G: int, *arrays):
    """Apply a jax window op to blocks with ``G`` grid axes in front (grids broadcast): vmapped over the grid."""
    import jax
    if G == 0:
        return fn(*arrays)
    grid = np.broadcast_shapes(*(a.shape[:G] for a in arrays))
    flat = [jax.numpy.broadcast_to(a, grid + a.shape[G:]).reshape((-1,) + a.shape[G:]) for a in arrays]
    out = jax.vmap(fn)(*flat)
    return out.reshape(grid + out.shape[1:])


# ---- average pool divisors --------------------------------------------------------------------------


def tap_counts(idx: np.ndarray | int, n_in: int, kernel: int, stride: int = 1, dilation: int = 1,
               pad_lo: int = 0) -> np.ndarray:
    """For global output indices ``idx`` (any shape), how many of their taps land inside ``[0, n_in)``:
    the count_include_pad=False divisor along one dim, in closed form."""
    j_lo, j_hi = _taps_inside(np.asarray(idx) * stride - pad_lo, n_in, kernel, dilation)
    return np.maximum(0, j_hi - j_lo)


def avg_divisor(n_in: Sequence[int], start: Sequence[int], stop: Sequence[int], kernel: Sequence[int],
                stride: Sequence[int], pad_lo: Sequence[int], count_include_pad: bool,
                dilation: Sequence[int] | None = None) -> np.ndarray:
    """The divisors of the global output range ``[start, stop)`` per spatial dim, shape ``stop - start``.
    Positions whose taps are all padding (only past the real output) get 1, so their garbage stays finite."""
    nd = len(kernel)
    dilation = _tuple(dilation, nd)
    shape = tuple(b - a for a, b in zip(start, stop))
    if count_include_pad:
        return np.full(shape, prod(kernel), dtype=np.int64)
    out = np.ones(shape, dtype=np.int64)
    for i in range(nd):
        c = tap_counts(np.arange(start[i], stop[i]), n_in[i], kernel[i], stride[i], dilation[i], pad_lo[i])
        out = out * c.reshape((-1,) + (1,) * (nd - 1 - i))
    return np.maximum(out, 1)


def avg_divisor_blocks(G: int, grid_shape: Sequence[int], grid_axes: Sequence[Sequence[int]],
                       n_in: Sequence[int], n_out: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
                       pad_lo: Sequence[int], count_include_pad: bool,
                       dilation: Sequence[int] | None = None) -> np.ndarray:
    """Every device's divisors at once, ``(*grid, 1, 1, *co)`` to divide ``avg_pool`` output blocks by:
    spatial dim ``i`` is sharded on ``grid_axes[i]`` (sizes from ``grid_shape``), each device holding output
    rows ``[p*co, p*co + co)``; other grid axes are 1."""
    nd = len(kernel)
    dilation = _tuple(dilation, nd)
    if count_include_pad:
        return np.full((1,) * (G + 2 + nd), prod(kernel), dtype=np.int64)
    out = np.ones((1,) * (G + 2 + nd), dtype=np.int64)
    for i in range(nd):
        axes = tuple(grid_axes[i])
        sizes = tuple(grid_shape[a] for a in axes)
        k = prod(sizes)
        co = _ceil_div(n_out[i], k)
        idx = np.arange(k)[:, None] * co + np.arange(co)
        c = np.maximum(tap_counts(idx, n_in[i], kernel[i], stride[i], dilation[i], pad_lo[i]), 1)
        c = c.reshape(sizes + (co,))  # grid axes in major-to-minor order, then the dim
        shape = [1] * (G + 2 + nd)
        for a, s in zip(axes, sizes):
            shape[a] = s
        shape[G + 2 + i] = co
        order = sorted(range(len(axes)), key=lambda j: axes[j]) + [len(axes)]
        out = out * c.transpose(order).reshape(shape)
    return out
