"""Optimizers in optax's functional style: ``state = opt.init(params)``; ``params, state = opt.update(grads,
state, params)``. Every update is elementwise on tensors laid out like their parameters, so it is local: no
communication, and parameters and state keep their shardings."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import collectives as C
from .autodiff import flatten, unflatten
from .tensor import Tensor
from .errors import ShardingError


def _zeros_like(p):
    """Zeros laid out as ``p``: abstract for an abstract ``p`` (a plan without data stays without data), and
    for a sharded one made directly as its stored blocks (no global array is ever built)."""
    from .ops import abstract, zeros
    from .tensor import Tensor
    spec = p.sharding
    if spec is None:
        return abstract(p.shape, p.dtype) if p.is_abstract else zeros(p.shape, p.dtype)
    spec = type(spec)(spec.mesh, spec.dim_specs, spec.replicated_axes)  # no pending sums in a fresh state
    if p.is_abstract:
        return Tensor(None, spec, p.shape, p.dtype)
    from . import backends
    from .layout import chunks, grid
    data = backends.active().commit(np.zeros(grid(spec).shape + chunks(spec, p.shape), dtype=p.dtype), spec)
    if isinstance(data, np.ndarray):
        data.flags.writeable = False
    return Tensor(data, spec, p.shape, p.dtype)


def _like(x, p):
    """``x`` exactly as ``p`` is laid out and typed (updates are elementwise: nothing moves), so a compiled
    step sees the same signature every time."""
    if x.dtype != p.dtype:
        x = x.astype(p.dtype)
    return x if p.sharding is None or x.sharding == p.sharding else x.with_sharding(
        p.mesh, p.sharding.dim_specs, p.sharding.replicated_axes)


def _outline(tree: Any) -> str:
    """A pytree's structure in a line: dict keys, list and tuple lengths, leaves as their shapes."""
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {_outline(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, (list, tuple)):
        inner = ", ".join(_outline(v) for v in tree)
        return f"[{inner}]" if isinstance(tree, list) else f"({inner}{',' if len(tree) == 1 else ''})"
    return "None" if tree is None else f"<{'x'.join(map(str, getattr(tree, 'shape', ()))) or 'scalar'}>"


def _check(grads, params, what, state=None, kind=None):
    if state is not None and not isinstance(state, kind):
        raise ShardingError(f"{what}: the state is of type {type(state).__name__}, not the {kind.__name__} that "
                            f"{what.split('.')[0]}.init(params) returns (a state from another optimizer?)")
    gl, gt = flatten(grads)
    pl, pt = flatten(params)
    if gt != pt:
        g, p = _outline(grads), _outline(params)
        raise ShardingError(f"{what}: grads and params have different structures: grads {g[:300]}, "
                            f"params {p[:300]}")
    for g, p in zip(gl, pl):
        if g.shape != p.shape:
            raise ShardingError(f"{what}: a gradient of shape {g.shape} for a parameter of shape {p.shape}")
    return gl, pl, pt


class SGDState(NamedTuple):
    momentum: Any  # a pytree like params, or None without momentum


class SGD:
    """``p <- p - lr * v`` with ``v <- momentum * v + g`` (plain gradient descent when momentum is 0)."""

    def __init__(self, lr: float, momentum: float = 0.0) -> None:
        self.lr, self.momentum = float(lr), float(momentum)

    def init(self, params: Any) -> SGDState:
        if not self.momentum:
            return SGDState(None)
        leaves, tree = flatten(params)
        return _state(SGDState(unflatten(tree, [_zeros_like(p) for p in leaves])))

    def update(self, grads: Any, state: SGDState, params: Any) -> tuple[Any, SGDState]:
        gl, pl, tree = _check(grads, params, "SGD.update", state, SGDState)
        if self.momentum:
            vl, _ = flatten(state.momentum)
            vl = [_like(v * self.momentum + g, v) for v, g in zip(vl, gl)]
            new = [_like(p - v * self.lr, p) for p, v in zip(pl, vl)]
            return _params(unflatten(tree, new)), _state(SGDState(unflatten(tree, vl)))
        return _params(unflatten(tree, [_like(p - g * self.lr, p) for p, g in zip(pl, gl)])), state


class AdamState(NamedTuple):
    count: Any  # a 0-d int tensor, so a compiled step does not change with it
    mu: Any
    nu: Any


class Adam:
    """Adam (Kingma and Ba), bias-corrected, as optax.adam: ``p <- p - lr * m_hat / (sqrt(v_hat) + eps)``."""

    def __init__(self, lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> None:
        self.lr, self.b1, self.b2, self.eps = float(lr), float(b1), float(b2), float(eps)

    def init(self, params: Any) -> AdamState:
        leaves, tree = flatten(params)
        zeros = [_zeros_like(p) for p in leaves]
        from .ops import tensor
        return _state(AdamState(tensor(np.int32(0)), unflatten(tree, zeros),
                                 unflatten(tree, [_zeros_like(p) for p in leaves])))

    def update(self, grads: Any, state: AdamState, params: Any) -> tuple[Any, AdamState]:
        from .ops import sqrt
        gl, pl, tree = _check(grads, params, "Adam.update", state, AdamState)
        ml, _ = flatten(state.mu)
        vl, _ = flatten(state.nu)
        t = state.count + 1
        ml = [_like(m * self.b1 + g * (1 - self.b1), m) for m, g in zip(ml, gl)]
        vl = [_like(v * self.b2 + (g * g) * (1 - self.b2), v) for v, g in zip(vl, gl)]
        tf = t.astype(np.float64)
        c1, c2 = 1 - self.b1 ** tf, 1 - self.b2 ** tf
        new = [_like(p - (m / c1.astype(m.dtype)) / (sqrt(v / c2.astype(v.dtype)) + self.eps) * self.lr, p)
               for p, m, v in zip(pl, ml, vl)]
        return _params(unflatten(tree, new)), _state(AdamState(t, unflatten(tree, ml), unflatten(tree, vl)))


def _state(state: Any) -> Any:
    """Optimizer state, so told to an open memory log."""
    C.tag([x for x in flatten(tuple(state))[0] if isinstance(x, Tensor)], "optimizer")
    return state


def _params(params: Any) -> Any:
    C.tag([x for x in flatten(params)[0] if isinstance(x, Tensor)], "params")
    return params
