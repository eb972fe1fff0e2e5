"""Ops whose value depends on each element's global index (``tril``, ``triu``, ``dropout``): their kernels read
every block's global rows from the ``aux`` hook, so each device masks the elements it holds and nothing moves."""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..dtypes import is_inexact
from ..errors import ShardingError
from ..value import Value
from ..layout import global_rows
from ..opdef import OpDef
from .core import ArrayLike, Tensor, apply, _is_diff, _ndim, _shape
from .pointwise import where
from .registry import onnx_export, register


# ---- tril, triu ----------------------------------------------------------------------------------------------


def _tri_aux(spec, cuts, shapes, params):
    """The global row and column of every local element of the last two dims (grid axes in front)."""
    shape = shapes[0]
    r = len(shape)
    return global_rows(spec, cuts, shape[-2], r - 2, r), global_rows(spec, cuts, shape[-1], r - 1, r)


def _tri_kernel(arrays, local):
    x = arrays[0]
    xp = _xp(x)
    k, upper = local.params
    if not local.aux:  # whole matrices (a host value): numpy's own
        return xp.triu(x, k) if upper else xp.tril(x, k)
    rows, cols = local.aux
    keep = cols - rows >= k if upper else cols - rows <= k
    return xp.where(keep, x, np.zeros((), x.dtype))


def _tri_vjp(g, node, out):
    x, = node.args
    return (apply(_TRIU if node.params[1] else _TRI, (g,), node.params),) if _is_diff(x) else (None,)


@onnx_export("Trilu")
def _tri_onnx(ex):
    k, upper = ex.params
    x = ex.operand(0)
    return ex.finish(ex.out("Trilu", [x, ex.b.constant(np.array(k, dtype=np.int64), base="k")], upper=int(upper)),
                     [(x, 0)])


def _tri(x: ArrayLike, k: Any, upper: bool) -> Tensor:
    name = "triu" if upper else "tril"
    if _ndim(x) < 2:
        raise ShardingError(f"{name}: needs a tensor of at least 2 dims (the last two are the matrix), got shape "
                            f"{tuple(_shape(x))}")
    if not isinstance(k, (int, np.integer)) or isinstance(k, (bool, np.bool_)):
        raise ShardingError(f"{name}: k must be an int, got {type(k).__name__} {k!r}")
    return apply(_TRIU if upper else _TRI, (x,), (int(k), upper))


def tril(x: ArrayLike, k: int = 0) -> Tensor:
    """The lower triangle of the last two dims (numpy's and jax.numpy's ``tril``): elements above diagonal ``k``
    become 0. Each device masks its block by the global row and column of its elements, so sharded dims stay
    sharded and nothing moves; linear, so a pending sum stays pending. Needs 2 dims or more (as jax.numpy)."""
    return _tri(x, k, False)


def triu(x: ArrayLike, k: int = 0) -> Tensor:
    """The upper triangle of the last two dims (numpy's ``triu``): elements below diagonal ``k`` become 0; sharded
    like ``tril``, with no communication."""
    return _tri(x, k, True)


_TRI = register(OpDef("tril", lambda shapes, k, upper: R.elementwise_rule(tuple(shapes), op="triu" if upper else "tril"),
                      _tri_kernel, "add", dtype="same", aux=_tri_aux, vjp=_tri_vjp, numpy="tril", onnx=_tri_onnx,
                      arity=1, public=tril, saves="none"))
_TRIU = register(OpDef("triu", _TRI.rule, _tri_kernel, "add", dtype="same", aux=_tri_aux, vjp=_tri_vjp, numpy="triu",
                       onnx=_tri_onnx, arity=1, public=triu, saves="none"))


# ---- dropout -------------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _fmix(h):
    """murmur3's 32-bit finalizer (a bijection of uint32 that mixes every bit into every other)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _seeds(key: int) -> tuple[np.uint32, np.uint32]:
    """Two 32-bit words from an int key of any size (its low and high 32 bits, mixed)."""
    with np.errstate(over="ignore"):
        lo = _fmix(np.uint32(key & _M32) ^ np.uint32(0x9E3779B9))
        hi = _fmix(np.uint32((key >> 32) & _M32) + lo)
    return lo, hi


def _host_offsets(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Per dim, each index times the dim's C-order stride, mod 2**32 (the whole tensor: a host value)."""
    rank = len(shape)
    out = []
    for d, n in enumerate(shape):
        stride = prod(shape[d + 1:])
        out.append(((np.arange(n, dtype=np.int64) * stride) & _M32).astype(np.uint32).reshape(
            (1,) * d + (n,) + (1,) * (rank - d - 1)))
    return tuple(out)


def _dropout_aux(spec, cuts, shapes, params):
    """Per dim, the global index of every local row times the dim's stride, mod 2**32 (grid axes in front)."""
    shape = shapes[0]
    rank = len(shape)
    return tuple(((global_rows(spec, cuts, n, d, rank) * prod(shape[d + 1:])) & _M32).astype(np.uint32)
                 for d, n in enumerate(shape))


def keep_mask(xp: Any, offsets: tuple, rate: float, key: int) -> Any:
    """Whether each element is kept: a counter-based hash of (key, global flat index mod 2**32), the same
    uint32 arithmetic under numpy and jax.numpy. ``offsets``: per dim, index times stride (they add up to the
    flat index)."""
    lo, hi = _seeds(key)
    with np.errstate(over="ignore"):
        idx = np.uint32(0)
        for o in offsets:
            idx = idx + o
        h = _fmix(_fmix(xp.asarray(idx, dtype=np.uint32) * np.uint32(0x9E3779B1) + lo) ^ hi)
    return (h >> np.uint32(8)) >= np.uint32(round(rate * (1 << 24)))


def _dropout_kernel(arrays, local):
    x = arrays[0]
    xp = _xp(x)
    rate, key = local.params
    offsets = local.aux if local.aux else _host_offsets(tuple(x.shape[local.G:]))
    keep = keep_mask(xp, offsets, rate, key)
    return xp.where(keep, x * np.asarray(1.0 / (1.0 - rate), x.dtype), np.zeros((), x.dtype))


def _dropout_vjp(g, node, out):
    x, = node.args
    return (apply(_DROPOUT, (g,), node.params),) if _is_diff(x) else (None,)


@onnx_export("Where", "Mul")
def _dropout_onnx(ex):
    """The mask is a constant of the shape and the key: ``Where(mask, x * scale, 0)``."""
    rate, key = ex.params
    x = ex.operand(0)
    shape = ex.args[0]._shape
    mask = ex.b.constant(np.broadcast_to(keep_mask(np, _host_offsets(shape), rate, key), shape), base="keep")
    scaled = ex.emit("Mul", [x, ex.b.constant(np.array(1.0 / (1.0 - rate), ex.dtype), base="scale")], "scaled")
    return ex.finish(ex.out("Where", [mask, scaled, ex.b.constant(np.zeros((), ex.dtype), base="zero")]), [(x, 0)])


def dropout(x: ArrayLike, rate: float, key: int) -> Tensor:
    """Dropout: each element is kept with probability ``1 - rate`` and scaled by ``1 / (1 - rate)``, else 0.

    Whether an element is kept is a function of ``key`` (an int) and the element's global flat index only (a
    counter-based hash: murmur3's finalizer of the index mixed with the key), so the mask is the same on every
    sharding, under ``nb.jit`` and eagerly, and each device computes the mask of its own block: nothing moves.
    It is not ``jax.random``'s stream (no PRNG key splitting: use a new ``key`` per call). The index is taken
    mod 2**32, so tensors of more than 2**32 elements repeat their mask. ``rate`` 0 returns ``x``; ``rate`` 1
    gives zeros. Linear in ``x``: a pending sum stays pending; the gradient is the same mask and scale."""
    r = float(rate)
    if not 0.0 <= r <= 1.0:
        raise ShardingError(f"dropout: rate must be in [0, 1], got {rate!r}")
    if not isinstance(key, (int, np.integer)) or isinstance(key, (bool, np.bool_)):
        raise ShardingError(f"dropout: key must be an int, got {type(key).__name__} {key!r}")
    dt = x._dtype if isinstance(x, Value) else np.asarray(x).dtype
    if not is_inexact(dt):
        raise ShardingError(f"dropout: x must be a float tensor (its kept values are scaled), got dtype {dt}")
    if r == 1.0:  # nothing kept (as flax: zeros, even where x is not finite)
        return where(np.zeros((), np.bool_), x, np.zeros((), dt))
    if r == 0.0 and isinstance(x, Tensor):
        return x
    return apply(_DROPOUT, (x,), (r, int(key)))


_DROPOUT = register(OpDef("dropout", lambda shapes, rate, key: R.elementwise_rule(tuple(shapes), op="dropout"),
                          _dropout_kernel, "add", dtype="same", aux=_dropout_aux, vjp=_dropout_vjp, onnx=_dropout_onnx,
                          arity=1, public=dropout, flops=lambda blocks, out, params: 2 * prod(out),
                          saves="none"))  # the mask is made again from the key: none is kept
