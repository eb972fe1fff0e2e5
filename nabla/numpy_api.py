"""numpy's protocols on tensors (``np.exp(t)``, ``np.sum(t)``): the registered op with that numpy name, looked up at
call time, or a composition listed here; anything else raises rather than reading the value to the host behind
the user's back (that would hide communication). ``np.asarray(t)`` stays the explicit host read."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import collectives as C
from . import ops
from .errors import ShardingError
from .ops import registry
from .tensor import Tensor

_REDUCE = {"add": "sum", "maximum": "max", "minimum": "min"}  # ufunc.reduce -> the op it is
_UFUNC_DEFAULTS = {"out": None, "where": True, "casting": "same_kind", "order": "K", "dtype": None, "subok": True}


def _host_hint(what: str, why: str = "") -> ShardingError:
    return ShardingError(f"{what} is not supported on nabla tensors{' (' + why + ')' if why else ''}: nabla has no "
                         f"sharded version of it and does not read the value to the host behind your back (that "
                         f"would hide communication); call it on t.numpy(), the global value as a host numpy array")


def _foreign(values: Any) -> bool:
    """An operand of a type that has its own numpy protocol (neither a Tensor nor an ndarray): let it answer."""
    return any(not isinstance(v, (Tensor, np.ndarray)) and hasattr(type(v), "__array_ufunc__") and
               type(v).__array_ufunc__ is not None for v in values)


def ufunc(ufunc: Any, method: str, inputs: tuple, kwargs: dict) -> Any:
    """``Tensor.__array_ufunc__``: the registered op answering to the ufunc's name, looked up now."""
    name = getattr(ufunc, "__name__", str(ufunc))
    if _foreign(inputs):
        return NotImplemented
    out = kwargs.get("out")
    if out is not None and any(o is not None for o in (out if isinstance(out, tuple) else (out,))):
        raise ShardingError(f"np.{name}(..., out=...): tensors are immutable; use the returned tensor")
    if method == "__call__":
        bad = [k for k, v in kwargs.items() if k not in _UFUNC_DEFAULTS or (k != "out" and not (
               v is _UFUNC_DEFAULTS[k] or (isinstance(v, (str, bool)) and v == _UFUNC_DEFAULTS[k])))]
        if bad:
            raise _host_hint(f"np.{name}", f"argument {bad[0]}={kwargs[bad[0]]!r} is not supported on tensors")
        if name == "positive":
            return inputs[0] if isinstance(inputs[0], Tensor) else ops.tensor(inputs[0])
        if name == "square":
            return ops.multiply(inputs[0], inputs[0])
        op = registry.by_numpy(name)
        if op is None or op.public is None:
            raise _host_hint(f"np.{name}")
        with C.user_op(op.name):
            return op.public(*inputs)
    if method == "reduce" and name in _REDUCE:
        kw = dict(kwargs)
        axis = kw.pop("axis", 0)
        keepdims = kw.pop("keepdims", False)
        dtype = kw.pop("dtype", None)
        kw.pop("out", None)
        bad = [k for k, v in kw.items() if not (k == "where" and v is True)]
        if bad:
            raise _host_hint(f"np.{name}.reduce", f"argument {bad[0]!r} is not supported on tensors")
        x = inputs[0] if dtype is None else ops.astype(inputs[0], dtype)
        return registry.function(_REDUCE[name])(x, axis, keepdims)
    raise _host_hint(f"np.{name}.{method}")


def _np_default(v: Any, default: Any = None) -> Any:
    return default if v is np._NoValue else v


def _reject(func: str, **given: Any) -> None:
    """Raise for the first numpy argument given that nabla cannot honour (out=, where=, order=...)."""
    for k, v in given.items():
        if v is np._NoValue or v is None or (k == "where" and v is True):
            continue
        if k == "out":
            raise ShardingError(f"np.{func}(..., out=...): tensors are immutable; use the returned tensor")
        raise _host_hint(f"np.{func}", f"argument {k}={v!r} is not supported on tensors")


def _np_sum(a, axis=None, dtype=None, out=None, keepdims=False, initial=np._NoValue, where=np._NoValue):
    _reject("sum", out=out, where=where)
    r = ops.sum(a if dtype is None else ops.astype(a, dtype), axis, bool(_np_default(keepdims, False)))
    return r if initial is np._NoValue else ops.add(r, initial)


def _np_mean(a, axis=None, dtype=None, out=None, keepdims=False, *, where=np._NoValue):
    _reject("mean", out=out, where=where)
    with C.user_op("mean"):
        return ops.mean(a if dtype is None else ops.astype(a, dtype), axis, bool(_np_default(keepdims, False)))


def _chooser(name: str):
    def f(a, axis=None, out=None, keepdims=False, initial=np._NoValue, where=np._NoValue):
        _reject(name, out=out, where=where)
        r = getattr(ops, name)(a, axis, bool(_np_default(keepdims, False)))
        if initial is not np._NoValue:
            r = (ops.maximum if name == "max" else ops.minimum)(r, initial)
        return r
    return f


def _np_arg(name: str):
    def f(a, axis=None, out=None, *, keepdims=False):
        _reject(name, out=out)
        with C.user_op(name):
            return getattr(ops, name)(a, axis, bool(_np_default(keepdims, False)))
    return f


def _np_prod(a, axis=None, dtype=None, out=None, keepdims=False, initial=np._NoValue, where=np._NoValue):
    _reject("prod", out=out, where=where)
    r = ops.prod(a, axis, dtype, bool(_np_default(keepdims, False)))
    return r if initial is np._NoValue else ops.multiply(r, initial)


def _np_truth(name: str):
    def f(a, axis=None, out=None, keepdims=False, *, where=np._NoValue):
        _reject(name, out=out, where=where)
        return getattr(ops, name)(a, axis, bool(_np_default(keepdims, False)))
    return f


def _np_sort(name: str):
    def f(a, axis=-1, kind=None, order=None, *, stable=None):
        _reject(name, order=order)  # (any kind: nabla's sort is stable, which every kind allows)
        return getattr(ops, name)(a, axis)
    return f


def _np_moments(name: str):
    def f(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=np._NoValue, mean=np._NoValue,
          correction=np._NoValue):
        _reject(name, out=out, where=where, mean=mean)
        ddof = ddof if correction is np._NoValue else correction
        return getattr(ops, name)(a, axis, dtype, ddof, bool(_np_default(keepdims, False)))
    return f


def _np_reshape(a, /, shape=None, order="C", *, newshape=None, copy=None):
    if order not in ("C", "A"):
        raise _host_hint("np.reshape", f"order={order!r}: nabla reshapes in C order only")
    shape = newshape if shape is None else shape
    return ops.reshape(a, shape)


def _np_concatenate(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    _reject("concatenate", out=out)
    arrays = list(arrays)
    if axis is None:
        arrays, axis = [ops.reshape(x, (-1,)) for x in arrays], 0
    if dtype is not None:
        arrays = [ops.astype(x, dtype) for x in arrays]
    return ops.concatenate(arrays, axis)


def _np_stack(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    _reject("stack", out=out)
    arrays = list(arrays)
    return ops.stack(arrays if dtype is None else [ops.astype(x, dtype) for x in arrays], axis)


def _np_where(condition, x=np._NoValue, y=np._NoValue):
    if x is np._NoValue or y is np._NoValue:
        raise _data_dependent("np.where(condition)")
    return ops.where(condition, x, y)


def _data_dependent(what: str) -> ShardingError:
    return _host_hint(what, "its result's shape depends on the values; nb.where(mask, t, fill) keeps the shape "
                            "and the sharding")


def _refuse(name: str):
    def f(*args, **kwargs):
        raise _data_dependent(f"np.{name}")
    return f


def _np_einsum(subscripts, *operands, out=None, dtype=None, order="K", casting="safe", optimize=False):
    _reject("einsum", out=out, dtype=dtype)
    if not isinstance(subscripts, str):
        raise _host_hint("np.einsum", "the interleaved (operand, sublist) form is not supported; pass a "
                                      "subscripts string")
    return ops.einsum(subscripts, *operands)


def _np_dot(a, b, out=None):
    _reject("dot", out=out)
    ra, rb = np.ndim(a), np.ndim(b)
    if ra == 0 or rb == 0:
        return ops.multiply(a, b)
    if ra <= 2 and rb <= 2:
        with C.user_op("matmul"):
            return ops.matmul(a, b)
    raise _host_hint("np.dot", f"on ranks {ra} and {rb} (dot's N-d rule differs from matmul's); use np.matmul "
                               f"or np.einsum")


def _np_clip(a, a_min=np._NoValue, a_max=np._NoValue, out=None, *, min=np._NoValue, max=np._NoValue, **kw):
    _reject("clip", out=out, **kw)
    return ops.clip(a, _np_default(a_min, _np_default(min)), _np_default(a_max, _np_default(max)))


def _np_moveaxis(a, source, destination):
    nd = np.ndim(a)
    src = [int(s) % nd for s in np.atleast_1d(source)]
    dst = [int(d) % nd for d in np.atleast_1d(destination)]
    if len(src) != len(dst):
        raise ShardingError(f"np.moveaxis: source {source} and destination {destination} differ in length")
    order = [n for n in range(nd) if n not in src]
    for d, s_ in sorted(zip(dst, src)):
        order.insert(d, s_)
    return ops.transpose(a, order)


def _np_like(name: str, fill: Any):
    def f(a, dtype=None, order="K", subok=True, shape=None, *, device=None):
        _reject(name, shape=shape, device=device)
        return _like(a, fill, dtype)
    return f


def _np_full_like(a, fill_value, dtype=None, order="K", subok=True, shape=None, *, device=None):
    _reject("full_like", shape=shape, device=device)
    return _like(a, fill_value, dtype)


def _like(a: Any, value: Any, dtype: Any) -> "Tensor":
    """A constant with ``a``'s shape and layout (no partial axes): each device fills its own block."""
    host = Tensor._host(np.full(a.shape, value, dtype=a.dtype if dtype is None else dtype))
    spec = a.sharding
    if spec is None:
        return host
    return host.shard(spec.mesh, spec.dim_specs, spec.replicated_axes)


def _np_size(a, axis=None):
    return a.size if axis is None else a.shape[axis]


def _np_result_type(*arrays_and_dtypes):
    return np.result_type(*(x.dtype if isinstance(x, Tensor) else x for x in arrays_and_dtypes))


#: how numpy's signature of a function that a registered op answers to maps onto the op's (by numpy name)
_ADAPTERS = {
    "sum": _np_sum, "max": _chooser("max"), "min": _chooser("min"), "argmax": _np_arg("argmax"),
    "argmin": _np_arg("argmin"), "prod": _np_prod, "any": _np_truth("any"), "all": _np_truth("all"),
    "cumsum": lambda a, axis=None, dtype=None, out=None: _reject("cumsum", out=out) or ops.cumsum(a, axis, dtype),
    "sort": _np_sort("sort"), "argsort": _np_sort("argsort"),
    "transpose": lambda a, axes=None: ops.transpose(a, axes), "reshape": _np_reshape,
    "concatenate": _np_concatenate, "where": _np_where, "einsum": _np_einsum,
    "squeeze": lambda a, axis=None: ops.squeeze(a, axis), "expand_dims": lambda a, axis: ops.expand_dims(a, axis),
    "broadcast_to": lambda array, shape, subok=False: ops.broadcast_to(array, shape),
    "astype": lambda x, dtype, /, *, copy=True, device=None: ops.astype(x, dtype),
}


def _composed() -> dict:
    """The numpy functions nabla answers by composing ops (no op answers to them by name)."""
    return {
        np.mean: _np_mean, np.amax: _chooser("max"), np.amin: _chooser("min"), np.var: _np_moments("var"),
        np.std: _np_moments("std"),
        np.ravel: lambda a, order="C": _np_reshape(a, (-1,), order), np.stack: _np_stack, np.split: ops.split,
        np.swapaxes: lambda a, axis1, axis2: ops.swapaxes(a, axis1, axis2), np.moveaxis: _np_moveaxis,
        np.dot: _np_dot, np.clip: _np_clip,
        np.zeros_like: _np_like("zeros_like", 0), np.ones_like: _np_like("ones_like", 1), np.full_like: _np_full_like,
        np.copy: lambda a, order="K", subok=False: a,  # tensors are immutable: a copy is the same value
        np.shape: lambda a: a.shape, np.ndim: lambda a: a.ndim, np.size: _np_size,
        np.result_type: _np_result_type,
        np.nonzero: _refuse("nonzero"), np.argwhere: _refuse("argwhere"), np.flatnonzero: _refuse("flatnonzero"),
    }


_COMPOSED: dict = {}


def function(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """``Tensor.__array_function__``: a function nabla composes, or the registered op answering to its name."""
    if not all(issubclass(t, (Tensor, np.ndarray)) for t in types):
        return NotImplemented
    if not _COMPOSED:
        _COMPOSED.update(_composed())
    handler = _COMPOSED.get(func)
    if handler is None:
        op = registry.by_numpy(getattr(func, "__name__", ""))
        if op is not None and op.public is not None and getattr(np, op.numpy, None) is func:
            handler = _ADAPTERS.get(op.numpy, op.public)
    if handler is None:
        raise _host_hint(f"np.{getattr(func, '__name__', func)}")
    return handler(*args, **kwargs)


def _array_ufunc(self: Tensor, ufunc_: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
    return ufunc(ufunc_, method, inputs, kwargs)


def _array_function(self: Tensor, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    return function(func, types, args, kwargs)


# numpy's protocols on tensors: np.exp(t), np.sum(t), np.matmul(t, u) give sharded tensors (set here, where they are
# answered: tensor.py sits below the ops this module builds on)
Tensor.__array_ufunc__ = _array_ufunc  # type: ignore[attr-defined]
Tensor.__array_function__ = _array_function  # type: ignore[attr-defined]
