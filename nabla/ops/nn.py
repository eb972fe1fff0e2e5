"""Ops for language models (``jax.nn``'s meanings): ``one_hot``, ``log_softmax``, ``logsumexp``, ``stop_gradient``
and ``cross_entropy``. A normalised dim sharded over mesh axes is never gathered: its max and its sum of
exponentials are reduced across devices, one value per row each (as Megatron's vocabulary-parallel
cross-entropy does)."""

from __future__ import annotations

from math import prod
from typing import Any, Callable, Sequence

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..collectives import user_op as _user_op
from ..commlog import composed
from ..dtypes import accumulation, exp_dtype, is_float, is_inexact
from ..errors import ShardingError
from ..value import Value
from ..layout import global_rows
from ..opdef import OpDef
from ..trace import link, link_of, paused, record, tracked
from .core import ArrayLike, Tensor, _axes, apply, _is_diff, _ndim, _shape
from ..args import dtype_arg
from .gather import _indices, take_along_axis
from .pointwise import astype, equal, exp, log, where
from .reduction import _wide_sum, max, mean, sum  # noqa: A004 - numpy's names
from .registry import onnx_export, register
from .shape import expand_dims, squeeze


def _composite(op: OpDef, params: tuple, args: tuple, run: Callable[[], Tensor]) -> Tensor:
    """``op``'s value computed by ``run()`` from other ops (a reduced dim is sharded: no one kernel sees it
    whole). The result records ``op`` itself, so its gradient is ``op``'s VJP (lean: no value the size of the
    whole dim is made on any device), and the open recorders that read ops as called are told its steps made one
    ``op`` (ONNX export writes ``op``'s node)."""
    if not tracked(args):
        out = run()
    else:
        with paused():
            out = run()
        # the same value, linked to ``op`` (its link keeps what the VJP reads of ``out``: the same blocks and serial)
        out = record(out.twin(), op, params, args, result=out)
    composed(op, params, args, out)
    return out


def _sharded_along(x: Any, axes: Sequence[int]) -> bool:
    spec = x._spec if isinstance(x, Value) else None
    return spec is not None and any(spec.dim_specs[a].axes for a in axes) and prod(_shape(x)) > 0


# ---- stop_gradient ---------------------------------------------------------------------------------------------


def stop_gradient(x: ArrayLike) -> Tensor:
    """``x`` itself, with a zero gradient (``jax.lax.stop_gradient``): an identity step that moves and computes
    nothing, keeping ``x``'s sharding (pending sums included). What is computed from it alone is not
    differentiated: no cotangent is made for it."""
    out = apply(_STOP, (x,))
    node = link_of(out)
    if node is not None and node.diff:  # the same value, recorded as not differentiated
        out = link(out.twin(sums=True), node._replace(diff=False))
    return out


@onnx_export("Identity")
def _stop_onnx(ex: Any) -> tuple:
    """ONNX has no stop-gradient: an Identity node (an export function, not the op type itself, so the ONNX importer
    does not read every Identity back as a stop of gradients)."""
    return ex.one("Identity", cast=False)


_STOP = register(OpDef("stop_gradient", lambda shapes: R.elementwise_rule((shapes[0],), op="stop_gradient"),
                       lambda arrays, local: arrays[0], "add", dtype="same", fast=lambda x: x,
                       vjp=lambda g, node, out: (None,), onnx=_stop_onnx, reference=lambda x: x, arity=1,
                       public=stop_gradient, flops=lambda blocks, out, params: 0, saves="none"))


# ---- one_hot ---------------------------------------------------------------------------------------------------


def _one_hot_kernel(arrays, local):
    n, axis, dtype = local.params
    ids = arrays[0]
    xp = _xp(ids)
    G = local.G
    rank = len(local.out_chunk)
    if local.aux:
        cols = local.aux[0]  # the global class of every local column, (*grid, 1.., c, 1..)
    else:
        cols = np.arange(n).reshape((1,) * (G + axis) + (n,) + (1,) * (rank - axis - 1))
    return (xp.expand_dims(ids, G + axis) == cols).astype(dtype)


def _one_hot_aux(spec, cuts, shapes, params):
    n, axis, _ = params
    return (global_rows(spec, cuts, n, axis, len(shapes[0]) + 1),)


@onnx_export("Equal", "Unsqueeze", "Cast")
def _one_hot_onnx(ex):
    n, axis, dtype = ex.params
    work = np.dtype(np.float64 if is_float(ex.args[0]._dtype) else np.int64)  # (float ids are compared as they
    # are, as the kernel does: 1.5 is no class; their int64 cast made it class 1)
    ids = ex.operand(0, work)
    rank = len(ex.v.shape)
    cols = ex.b.constant(np.arange(n, dtype=work).reshape((n,) + (1,) * (rank - axis - 1)), base="classes")
    hot = ex.emit("Equal", [ex.emit("Unsqueeze", [ids, ex.ints([axis], "axes")], "ids"), cols], "hot")
    return ex.finish(ex.out("Cast", [hot], to=ex.onnx_type(dtype, "one_hot's result")), [(ids, 0)])


def one_hot(x: ArrayLike, num_classes: int, dtype: Any = "float32", axis: int = -1) -> Tensor:
    """``jax.nn.one_hot``: 1 where ``x``'s value equals the class number, 0 elsewhere, the classes along a new
    dim ``axis``; an index out of ``[0, num_classes)`` (negative ones included) gives a row of zeros.

    Sharding: ``x``'s dims pass through; the class dim is new (each device compares its indices with the
    classes it computes): nothing moves."""
    if not isinstance(num_classes, (int, np.integer)) or isinstance(num_classes, bool) or num_classes < 0:
        raise ShardingError(f"one_hot: num_classes must be an int >= 0, got {num_classes!r}")
    dt = dtype_arg(dtype, "one_hot", "biufc") or np.dtype(np.float32)
    rank = _ndim(x) + 1
    if not -rank <= axis < rank:
        raise ShardingError(f"one_hot: axis {axis} is out of range for a result of rank {rank}")
    if isinstance(x, Value) and x._dtype.kind not in "biuf":
        raise ShardingError(f"one_hot: indices of dtype {x._dtype} (a tensor of shape {x._shape}) are not numbers")
    return apply(_ONE_HOT, (x,), (int(num_classes), axis % rank, dt))


_ONE_HOT = register(OpDef("one_hot", lambda shapes, n, axis, dtype: R.one_hot_rule(shapes[0], n, axis),
                          _one_hot_kernel, aux=_one_hot_aux, vjp=lambda g, node, out: (None,), onnx=_one_hot_onnx,
                          arity=1, public=one_hot, flops=lambda blocks, out, params: prod(out), saves="none"))


# ---- log_softmax -----------------------------------------------------------------------------------------------


def _log_softmax_kernel(arrays, local):
    x = arrays[0]
    xp = _xp(x)
    x = x.astype(exp_dtype(x.dtype)) if not is_inexact(x.dtype) else x
    if x.size == 0:
        return x
    ax = local.G + local.params[0]
    s = x - xp.max(x, axis=ax, keepdims=True)
    acc = accumulation(s.dtype)
    if acc == s.dtype:
        return s - xp.log(xp.sum(xp.exp(s), axis=ax, keepdims=True))
    # float16 and bfloat16: the exponentials and their sum in float32, the sum rounded once
    return s - xp.log(xp.sum(xp.exp(s.astype(acc)), axis=ax, keepdims=True).astype(s.dtype))


def _log_softmax_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    ax = node.params[0]
    return (g - exp(out) * sum(g, ax, keepdims=True),)


@onnx_export("LogSoftmax")
def _log_softmax_onnx(ex):
    return ex.one("LogSoftmax", axis=int(ex.params[0]))


def _log_softmax_np(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = np.asarray(x)
    x = x.astype(exp_dtype(x.dtype)) if not is_inexact(x.dtype) else x
    if x.size == 0:
        return x
    s = x - x.max(axis=axis, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=axis, keepdims=True))


def log_softmax(x: ArrayLike, axis: int = -1) -> Tensor:
    """``jax.nn.log_softmax``: ``x - max - log(sum(exp(x - max)))`` along ``axis`` (the max shifts nothing
    mathematically and its gradient is stopped, as jax's). For float16 and bfloat16 the shifted values are in
    that dtype, their exponentials and the sum in float32, the sum rounded once: what jax's log_softmax (jitted
    by jax) computes, read from its compiled HLO.

    Sharding: other dims pass through. When ``axis`` is sharded it is not gathered: the row max and the row sum
    of exponentials are reduced across devices (two all_reduces of one value per row), and the gradient
    ``g - softmax * sum(g)`` sums one value per row too."""
    axes = _axes(axis, _ndim(x), "log_softmax")
    if not axes:  # a 0-d value: numpy-style reduction over no dim; log_softmax of one element is 0
        return apply(_LOG_SOFTMAX, (expand_dims(x, 0),), (0,)).reshape(())
    ax = axes[0]
    if not _sharded_along(x, (ax,)):
        return apply(_LOG_SOFTMAX, (x,), (ax,))

    def run():
        y = x if is_inexact(x._dtype) else astype(x, exp_dtype(x._dtype))
        s = y - stop_gradient(max(y, ax, keepdims=True))
        acc = accumulation(s._dtype)
        if acc == s._dtype:
            return s - log(sum(exp(s), ax, keepdims=True))
        return s - log(astype(sum(exp(astype(s, acc)), ax, keepdims=True), s._dtype))

    with _user_op("log_softmax"):
        return _composite(_LOG_SOFTMAX, (ax,), (x,), run)


_LOG_SOFTMAX = register(OpDef("log_softmax", lambda shapes, axis: R.elementwise_rule((shapes[0],), (axis,),
                                                                                     "log_softmax"),
                              _log_softmax_kernel, vjp=_log_softmax_vjp, onnx=_log_softmax_onnx,
                              reference=_log_softmax_np, arity=1, public=log_softmax, saves="output",
                              flops=lambda blocks, out, params: 5 * prod(out)))  # max, subtract, exp, sum, log


# ---- logsumexp -------------------------------------------------------------------------------------------------


def _logsumexp_kernel(arrays, local):
    axes, keepdims = local.params
    x = arrays[0]
    xp = _xp(x)
    x = x.astype(exp_dtype(x.dtype)) if not is_inexact(x.dtype) else x
    ax = tuple(local.G + a for a in axes)
    if any(x.shape[a] == 0 for a in ax):  # a sum of no exponentials: log(0)
        shape = tuple(1 if d in ax else n for d, n in enumerate(x.shape) if keepdims or d not in ax)
        return xp.full(shape, -np.inf, x.dtype)
    m = xp.max(x, axis=ax, keepdims=True)
    m = xp.where(xp.isfinite(m), m, xp.zeros((), m.dtype))
    out = xp.log(_wide_sum(xp.exp(x - m), ax)) + m
    return out if keepdims else out.reshape(tuple(n for d, n in enumerate(out.shape) if d not in ax))


def _logsumexp_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    axes, keepdims = node.params
    if not keepdims and axes:
        g, out = expand_dims(g, axes), expand_dims(out, axes)
    return (g * exp(x - out),)


@onnx_export("ReduceLogSumExp")
def _logsumexp_onnx(ex):
    axes, keepdims = ex.params
    x = ex.operand(0, ex.dtype)
    return ex.finish(ex.out("ReduceLogSumExp", [x, ex.ints(axes, "axes")], keepdims=int(keepdims),
                            noop_with_empty_axes=int(not axes)), [(x, 0)])


def logsumexp(x: ArrayLike, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    """``jax.scipy.special.logsumexp``: ``log(sum(exp(x)))`` over ``axis`` (all dims when None), computed stably
    as ``m + log(sum(exp(x - m)))`` with ``m`` the max (0 where the max is not finite; its gradient stopped).

    Sharding: other dims pass through. A reduced dim that is sharded is not gathered: the max and the sum of
    exponentials are reduced across devices, one value per remaining element each (two all_reduces). The
    gradient ``g * exp(x - logsumexp)`` is local."""
    axes = _axes(axis, _ndim(x), "logsumexp")
    keep = bool(keepdims)
    if not _sharded_along(x, axes):
        return apply(_LOGSUMEXP, (x,), (axes, keep))

    def run():
        y = x if is_inexact(x._dtype) else astype(x, exp_dtype(x._dtype))
        m = max(y, axes, keepdims=True)
        m = stop_gradient(where(equal(m - m, 0), m, 0))  # an infinite (or NaN) max shifts nothing
        out = log(sum(exp(y - m), axes, keepdims=True)) + m
        return out if keep else squeeze(out, axes)

    with _user_op("logsumexp"):
        return _composite(_LOGSUMEXP, (axes, keep), (x,), run)


_LOGSUMEXP = register(OpDef("logsumexp", lambda shapes, axes, keepdims: R.reduce_rule(shapes[0], axes, keepdims,
                                                                                     True),
                            _logsumexp_kernel, vjp=_logsumexp_vjp, onnx=_logsumexp_onnx, arity=1,
                            public=logsumexp, flops=lambda blocks, out, params: 4 * prod(blocks[0])))


# ---- cross_entropy ---------------------------------------------------------------------------------------------


def cross_entropy(logits: ArrayLike, targets: ArrayLike) -> Tensor:
    """The mean over tokens of ``logsumexp(logits, -1) - logits[..., target]``, with integer ``targets`` of
    ``logits``' shape but the last dim (as ``optax.softmax_cross_entropy_with_integer_labels(...).mean()``). A
    target out of ``[-V, V)`` raises ``IndexError`` (under ``nb.jit`` it picks 0).

    Sharding, logits ``(B, S, V)`` sharded on the vocabulary ``V``: as Megatron's vocabulary-parallel
    cross-entropy, no logit moves. Each device picks the target logits its vocabulary rows hold (0 for the
    others) and the row max and sum of exponentials are reduced across devices: only ``(B, S)``-sized sums
    move, and the picked logits' sum is folded into the mean's. The gradient ``(softmax - one_hot) / N`` stays
    sharded on ``V`` and moves nothing."""
    shape = _shape(logits)
    if len(shape) < 1:
        raise ShardingError("cross_entropy: logits must have a class dim (the last one); got a 0-d value")
    with _user_op("cross_entropy"):
        ids = _indices(targets, "cross_entropy")
        if tuple(_shape(ids)) != tuple(shape[:-1]):
            raise ShardingError(f"cross_entropy: targets of shape {tuple(_shape(ids))} for logits of shape "
                                f"{tuple(shape)}; targets must have the logits' shape without the last dim")
        picked = take_along_axis(logits, expand_dims(ids, -1), -1)
        return mean(logsumexp(logits, -1, keepdims=True) - picked)
