"""Sorting along a dim (``sort``, ``argsort``: stable, NaN last) and ``top_k`` (largest first, NaN first, ties by
lower index). A sorted dim is needed whole on each device (gathered when sharded); ``top_k`` over a sharded dim
gathers only ``k`` candidates per device."""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..collectives import user_op as _user_op
from ..dtypes import is_ml, is_float
from ..errors import ShardingError
from ..opdef import OpDef
from ..rules.core import PASS, REPLICATE, build
from .core import ArrayLike, Tensor, _axes, apply, _is_diff, _ndim, _shape
from .gather import take_along_axis
from .pointwise import equal, where
from .reduction import _by_blocks, _sharded, sum
from .registry import onnx_export, register
from .shape import expand_dims, reshape


def _argsort(xp: Any, x: Any, axis: int) -> Any:
    """Stable ascending order along ``axis``, NaN last (numpy does not order the NaN of ml_dtypes' floats: they
    are sorted as float32, which holds each of their values exactly)."""
    if xp is np:
        return np.argsort(x.astype(np.float32) if is_ml(x.dtype) else x, axis=axis, kind="stable")
    return xp.argsort(x, axis=axis, stable=True)


def _descending(xp: Any, x: Any, axis: int) -> Any:
    """Largest first, NaN first, ties by lower index: the stable ascending order of the reversed values, reversed
    (equal values keep their reversed order, so the lower index ends up first)."""
    n = x.shape[axis]
    return xp.flip(n - 1 - _argsort(xp, xp.flip(x, axis), axis), axis)


def _comparisons(axis_of: Any):
    """FLOPs of a sort: ``n ceil(log2 n)`` comparisons per sorted row of ``n`` (the operand's block)."""
    def flops(blocks, out, params):
        shape = blocks[0]
        if not shape:
            return 0
        n = shape[axis_of(params, len(shape))]
        return prod(shape) * max(1, (n - 1).bit_length()) if n > 1 else prod(shape)
    return flops


def _along(xp: Any, x: Any, idx: Any, axis: int) -> Any:
    return xp.take_along_axis(x, idx, axis=axis)


# ---- sort, argsort -------------------------------------------------------------------------------------------


def _sort_kernel(arrays, local):
    x = arrays[0]
    xp = _xp(x)
    a = local.G + local.params[0]
    if xp is np:
        return np.sort(x.astype(np.float32), axis=a, kind="stable").astype(x.dtype) if is_ml(x.dtype) else \
            np.sort(x, axis=a, kind="stable")
    return xp.sort(x, axis=a, stable=True)


def _argsort_kernel(arrays, local):
    x = arrays[0]
    return _argsort(_xp(x), x, local.G + local.params[0])


def _top_k_node(ex, axis: int, k: int, largest: bool, output: int):
    """ONNX ``TopK`` (``sorted=1``: equal values by lower index first): its values or its indices (cast to nabla's
    index dtype). ONNX's TopK takes no bools or bfloat16: they are ranked as int32 and float32, which hold each of
    their values exactly and in the same order, and the values cast back."""
    from onnx import helper  # (export runs only where onnx is installed)
    x = ex.operand(0)
    dt = ex.args[0]._dtype
    work = ex.carrier("TopK", dtype=dt)
    names = [ex.b.fresh(f"{ex.base}_values"), ex.b.fresh(f"{ex.base}_indices")]
    ex.b.nodes.append(helper.make_node("TopK", [ex.b.cast(x, dt, work), ex.ints([k], "k")], names,
                                       name=ex.b.fresh(f"TopK_{ex.base}"), axis=int(axis), largest=int(largest),
                                       sorted=1))
    if output == 1:
        return ex.finish(ex.out("Cast", [names[1]], to=ex.onnx_type(ex.dtype, "an index")), [(x, 0)])
    if work != dt:
        return ex.finish(ex.out("Cast", [names[0]], to=ex.onnx_type(dt, "a value")), [(x, 0)])
    return ex.finish(ex.out("Identity", [names[0]]), [(x, 0)])


def _sort_onnx(output: int):
    """The whole dim ascending: ``TopK`` with ``k = n``, ``largest=0``."""
    @onnx_export("TopK", "Cast")
    def export(ex):
        axis = ex.params[0]
        return _top_k_node(ex, axis, ex.args[0]._shape[axis], False, output)
    return export


def _flat(x: ArrayLike, axis: int | None, name: str) -> tuple[Any, int]:
    if axis is None:
        return reshape(x, (-1,)), 0
    axes = _axes(axis, _ndim(x), name)
    if not axes:
        raise ShardingError(f"{name}: axis {axis} is out of range for a tensor of rank 0")
    return x, axes[0]


def sort(x: ArrayLike, axis: int | None = -1) -> Tensor:
    """numpy's ``sort`` with ``kind="stable"`` (``axis`` None: the flattened tensor): ascending, NaN last, the same
    under ``nb.jit``. The sorted dim is needed whole: when it is sharded, it is gathered first (one all_gather of
    that dim, or an all_to_all that moves its axes to another dim); the other dims keep their sharding. The
    gradient puts each cotangent back where its element came from."""
    x, ax = _flat(x, axis, "sort")
    return apply(_SORT, (x,), (ax,))


def argsort(x: ArrayLike, axis: int | None = -1) -> Tensor:
    """numpy's ``argsort`` with ``kind="stable"``: the indices that sort ``x`` along ``axis`` (ties in order, NaN
    last). Sharded like ``sort``: the sorted dim is gathered when sharded."""
    x, ax = _flat(x, axis, "argsort")
    return apply(_ARGSORT, (x,), (ax,))


def _sort_vjp(g, node, out):
    """Each cotangent back where its element came from: ``g`` taken at the inverse of the sorting permutation."""
    x, = node.args
    if not _is_diff(x):
        return (None,)
    axis = node.params[0]
    return (take_along_axis(g, argsort(argsort(x, axis), axis), axis),)


_SORT = register(OpDef("sort", lambda shapes, axis: R.elementwise_rule((shapes[0],), (axis,), "sort"), _sort_kernel,
                       dtype="same", vjp=_sort_vjp, numpy="sort", onnx=_sort_onnx(0), arity=1, public=sort, saves="operands",
                       flops=_comparisons(lambda params, r: params[0])))
_ARGSORT = register(OpDef("argsort", lambda shapes, axis: R.elementwise_rule((shapes[0],), (axis,), "argsort"),
                          _argsort_kernel, dtype=np.intp, vjp=lambda g, node, out: (None,), saves="none", numpy="argsort",
                          onnx=_sort_onnx(1), arity=1, public=argsort,
                          flops=_comparisons(lambda params, r: params[0])))


# ---- top_k ---------------------------------------------------------------------------------------------------


def _top_k_rule(shapes, k, part):
    """The last dim is needed whole (its factor replicated); the result's last dim is ``k`` new elements."""
    shape = shapes[0]
    r = len(shape)
    dims = [(d,) if n != 1 else () for d, n in enumerate(shape[:-1])] + [(r - 1,)]
    kinds = [PASS] * (r - 1) + [REPLICATE, REPLICATE]
    return build([dims] * len(shapes), dims[:-1] + [(r,)], list(shape) + [k], kinds)


def _top_k_kernel(arrays, local):
    k, part = local.params
    x = arrays[0]
    xp = _xp(*arrays)
    a = x.ndim - 1
    idx = _descending(xp, x, a)[..., :k]
    if part == "values":
        return _along(xp, x, idx, a)
    return idx if len(arrays) == 1 else _along(xp, arrays[1], idx, a)  # the candidates' own (global) indices


def _top_k_vjp(g, node, out):
    """Each cotangent goes to the element it was taken from: a one-hot sum over the ``k`` results, so a sharded
    dim stays sharded."""
    x = node.args[0]
    k, part = node.params
    if not _is_diff(x) or part != "values":
        return (None,) * len(node.args)
    n = x._shape[-1]
    idx = top_k(x, k)[1]
    hit = equal(expand_dims(idx, -1), np.arange(n))  # (..., k, n)
    return (sum(where(hit, expand_dims(g, -1), np.zeros((), g.dtype)), -2),) + (None,) * (len(node.args) - 1)


def _lowest(dt: np.dtype) -> Any:
    """The value no element ranks below (fills a block's padding so it is never taken before a real element)."""
    if is_float(dt):
        return -np.inf
    if dt.kind in "iu":
        return np.iinfo(dt).min
    if dt.kind == "b":
        return False
    raise ShardingError(f"top_k: dtype {dt} has no order nabla ranks (use a real dtype)")


def top_k(x: ArrayLike, k: int) -> tuple[Tensor, Tensor]:
    """``jax.lax.top_k``: the ``k`` largest values along the last dim, largest first, and their indices (numpy's
    index dtype, ``intp``, as ``argsort``'s; ``lax.top_k`` gives int32); equal values in order of index; a NaN ranks
    above every number (of either sign: ``lax.top_k`` ranks a NaN with its sign bit set below ``-inf``).

    When the last dim is sharded ``k_s`` ways (blocks of ``c``), it is not gathered: each device takes the top
    ``min(k, c)`` of its block (with their global indices), then those candidates are gathered, ``k_s * min(k, c)``
    per row instead of the whole dim (one all_gather of the values, one of their indices), and the top ``k`` of
    them is taken. Other dims keep their sharding."""
    if _ndim(x) == 0:
        raise ShardingError("top_k: needs a tensor of at least 1 dim, got a 0-d one")
    n = _shape(x)[-1]
    if not isinstance(k, (int, np.integer)) or isinstance(k, (bool, np.bool_)) or not 0 <= k <= n:
        raise ShardingError(f"top_k: k must be an int in [0, {n}] (the last dim's size), got {k!r}")
    k = int(k)
    with _user_op("top_k"):
        if not _sharded(x, (_ndim(x) - 1,)):
            return apply(_TOP_K, (x,), (k, "values")), apply(_TOP_K, (x,), (k, "indices"))
        ax = _ndim(x) - 1
        blocks = _by_blocks(x, ax, _lowest(x._dtype))  # (..., k_s, c), k_s sharded
        ks, c = blocks.shape[-2:]
        kk = min(k, c)
        values = apply(_TOP_K, (blocks,), (kk, "values"))
        index = apply(_TOP_K, (blocks,), (kk, "indices")) + (np.arange(ks, dtype=np.intp) * c)[:, None]
        lead = tuple(_shape(x)[:-1])
        values, index = reshape(values, lead + (ks * kk,)), reshape(index, lead + (ks * kk,))
        spec = values.sharding
        values = values.with_sharding(spec.mesh, [d.axes for d in spec.dim_specs[:-1]] + [None])
        return apply(_TOP_K, (values,), (k, "values")), apply(_TOP_K, (values, index), (k, "indices"))


@onnx_export("TopK", "Cast")
def _top_k_onnx(ex):
    if len(ex.args) > 1:
        raise ShardingError("export: top_k over a sharded last dim picks global indices among gathered candidates, "
                            "which has no one-node ONNX form; export it with the last dim whole")
    k, part = ex.params
    return _top_k_node(ex, len(ex.args[0]._shape) - 1, k, True, 0 if part == "values" else 1)


_TOP_K = register(OpDef("top_k", _top_k_rule, _top_k_kernel, vjp=_top_k_vjp, onnx=_top_k_onnx, public=top_k,
                        saves=lambda diff, params: ((0,) if diff[0] and params[1] == "values" else (), False),
                        flops=_comparisons(lambda params, r: r - 1)))
